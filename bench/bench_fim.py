"""Infilling quality of a FIM-trained checkpoint on held-out Python files (issue 19).

    python bench/bench_fim.py out/small --files='*.py' --n=200 --json=bench/results/fim.json

Held out: this repository's own .py files, which no embedded corpus reads (corpus.python_roots
takes the standard library and site-packages only), or any --files glob. For each of --n cases a
random file and a random non-blank line (one matching --match, if given) are drawn (fixed seed);
the line is the middle, the whole lines within --context characters before and after it the
prefix and suffix. The model generates greedily after the PSM prompt and after the SPM prompt
(fim.prompt: EOS <PRE> prefix <SUF> suffix <MID>, or EOS <PRE> <SUF> suffix <MID> prefix; cut to
block_size - --tokens by dropping far prefix and suffix tokens) until EOS or a sentinel, at most
--tokens tokens (--batch prompts at a time, left-padded). Reported: exact match of the generated
middle with the line (whitespace at the ends ignored), the mean character-level similarity
(difflib's ratio), and the bits per character the model gives the true line after the prompt
(teacher-forced: graded where greedy output is all wrong); next to them, the same model continuing
the prefix alone left to right (the suffix unseen) to the end of the line: the gap is what the
suffix is worth.
"""
import argparse
import difflib
import glob
import json
import math
import os
import random
import re
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # run from the repo root as a script in bench/: import the flat modules

import torch  # noqa: E402

import generate  # noqa: E402
import sample  # noqa: E402
import tokenizer  # noqa: E402
from corpora import fim  # noqa: E402


def cases(files, n, context, seed, match=""):
    """(file name, prefix, middle line, suffix) for n random lines (non-blank, matching `match`)."""
    rng = random.Random(seed)
    texts = [open(f, encoding="utf-8").read() for f in files]
    pattern = re.compile(match)
    if not any(line.strip() and pattern.search(line) for t in texts for line in t.splitlines()):
        raise SystemExit(f"no non-blank line matching {match!r} in {len(files)} files")
    out = []
    while len(out) < n:
        i = rng.randrange(len(texts))
        lines = texts[i].splitlines(keepends=True)
        j = rng.randrange(len(lines))
        if not lines[j].strip() or not pattern.search(lines[j]):
            continue
        start = sum(len(x) for x in lines[:j])
        end = start + len(lines[j].rstrip("\n"))  # the newline stays in the suffix
        text = texts[i]
        first = text.find("\n", max(0, start - context) - 1, start) + 1 if start > context else 0  # whole lines
        last = text.rfind("\n", end, end + context) if len(text) - end > context else len(text)
        out.append((os.path.basename(files[i]), text[first:start], text[start:end], text[end:max(last, end)]))
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("path")
    p.add_argument("--files", default="*.py", help="glob under the repository root")
    p.add_argument("--n", type=int, default=200)
    p.add_argument("--context", type=int, default=1500, help="characters of prefix and of suffix")
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--match", default="", help="only lines matching this regular expression")
    p.add_argument("--batch", type=int, default=16, help="prompts generated together (left-padded)")
    p.add_argument("--json", default="")
    a = p.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model, tok, cfg = sample.load(a.path, device)
    stops = [tok.eos_id] + list(tokenizer.fim_sentinels(tok))
    files = sorted(glob.glob(os.path.join(ROOT, a.files)))  # an absolute --files stays as it is
    autocast = torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda")
    t0 = time.perf_counter()

    def fill(prompts):  # greedy, a batch of left-padded prompts; each middle up to its first stop, one line
        x, mask = generate.pad_prompts(prompts, tok.eos_id, device)
        with autocast:
            out = generate.generate(model, x, a.tokens, vocab=tok, temperature=0, stop_tokens=stops, attention_mask=mask)
        rows = out[:, x.shape[1]:].tolist()
        cut = [next((j for j, t in enumerate(r) if t in stops), len(r)) for r in rows]
        return [tok.decode(r[:j]).lstrip("\n").split("\n")[0] for r, j in zip(rows, cut)]

    @torch.no_grad()
    def bits(prompt, middle):  # bits per character of the true middle after the prompt (teacher-forced)
        ids = tok.encode(middle)[:a.tokens]
        x = torch.tensor([prompt + ids[:-1]], device=device)
        y = torch.tensor([prompt[1:] + ids], device=device)
        with autocast:
            nll = model(x, y, reduction="none")[0, len(prompt) - 1:].float().sum().item()
        return nll / math.log(2) / max(1, len(tok.decode(ids)))

    def score(got, want):
        return got.strip() == want.strip(), difflib.SequenceMatcher(None, got.strip(), want.strip()).ratio()
    room = cfg.block_size - a.tokens
    prompts = {"FIM, PSM order": lambda pre, suf: fim.prompt(tok, pre, suf, room),
               "FIM, SPM order": lambda pre, suf: fim.prompt(tok, pre, suf, room, spm=True),
               "the prefix alone": lambda pre, suf: tok.encode(pre)[-room:] or [tok.eos_id]}  # a first line: EOS
    todo = cases(files, a.n, a.context, a.seed, a.match)
    rows = [dict(file=name, want=mid) for name, _, mid, _ in todo]
    for i in range(0, len(todo), a.batch):
        batch, out = todo[i:i + a.batch], rows[i:i + a.batch]
        for kind, build in prompts.items():
            ids = [build(pre, suf) for _, pre, _, suf in batch]
            for r, x, got in zip(out, ids, fill(ids)):
                exact, sim = score(got, r["want"])
                r[kind] = dict(got=got, exact=exact, similarity=sim, bits_per_char=bits(x, r["want"]))
    n = len(rows)
    res = dict(path=a.path, n=n, context=a.context, seconds=round(time.perf_counter() - t0, 1),
               **{kind: {k: sum(r[kind][k] for r in rows) / n for k in ("exact", "similarity", "bits_per_char")}
                  for kind in prompts}, examples=rows[:12])
    print(f"{n} cases, {a.context} characters of context each side\n\n| prompt | exact match | character "
          "similarity | bits/char of the true line |\n|---|---:|---:|---:|")
    for kind in prompts:
        print(f"| {kind} | {res[kind]['exact']:.3f} | {res[kind]['similarity']:.3f} | {res[kind]['bits_per_char']:.3f} |")
    for r in rows[:6]:
        print(f"{r['file']}: want {r['want'].strip()!r} | " + " | ".join(f"{k.split(',')[-1].strip()} "
                                                                      f"{r[k]['got'].strip()!r}" for k in prompts))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
