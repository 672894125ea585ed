"""Infilling quality of a FIM-trained checkpoint on held-out Python files (issue 19).

    python bench/bench_fim.py out/small --files='*.py' --n=200 --json=bench/results/fim.json

Held out: this repository's own .py files, which no embedded corpus reads (corpus.python_roots
takes the standard library and site-packages only). For each of --n cases a random file and a
random non-blank line are drawn (fixed seed); the line is the middle, up to --context characters
before and after it the prefix and suffix. The model generates greedily in PSM order (fim.prompt)
until EOS or a sentinel, at most --tokens tokens. Reported: exact match of the generated middle
with the line (whitespace at the ends ignored), and the mean character-level similarity
(difflib's ratio); next to them, the same model continuing the prefix alone left to right (the
suffix unseen) to the end of the line: the gap between the two is what the suffix is worth.
"""
import argparse
import difflib
import glob
import json
import os
import random
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # run from the repo root as a script in bench/: import the flat modules

import torch  # noqa: E402

import fim  # noqa: E402
import generate  # noqa: E402
import sample  # noqa: E402


def cases(files, n, context, seed):
    rng = random.Random(seed)
    texts = [open(f, encoding="utf-8").read() for f in files]
    out = []
    while len(out) < n:
        i = rng.randrange(len(texts))
        lines = texts[i].splitlines(keepends=True)
        j = rng.randrange(len(lines))
        if not lines[j].strip():
            continue
        start = sum(len(x) for x in lines[:j])
        end = start + len(lines[j]) - 1  # the newline stays in the suffix
        text = texts[i]
        out.append((os.path.basename(files[i]), text[max(0, start - context):start], text[start:end],
                    text[end:end + context]))
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("path")
    p.add_argument("--files", default="*.py", help="glob under the repository root")
    p.add_argument("--n", type=int, default=200)
    p.add_argument("--context", type=int, default=1500, help="characters of prefix and of suffix")
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default="")
    a = p.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model, tok, cfg = sample.load(a.path, device)
    stops = [tok.eos_id] + list(fim.sentinels(tok))
    files = sorted(glob.glob(os.path.join(ROOT, a.files)))
    rows, t0 = [], time.perf_counter()
    def fill(ids):
        ids = (ids or [tok.eos_id])[-(cfg.block_size - a.tokens):]  # a file's first line: no prefix
        x = torch.tensor([ids], dtype=torch.long, device=device)
        with torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
            out = generate.generate(model, x, a.tokens, temperature=0, stop_tokens=stops)
        got = tok.decode([t for t in out[0, len(ids):].tolist() if t not in stops])
        return got.lstrip("\n").split("\n")[0]  # one line asked for

    def score(got, want):
        return got.strip() == want.strip(), difflib.SequenceMatcher(None, got.strip(), want.strip()).ratio()
    for name, pre, mid, suf in cases(files, a.n, a.context, a.seed):
        got, left = fill(fim.prompt(tok, pre, suf)), fill(tok.encode(pre))
        (exact, sim), (l_exact, l_sim) = score(got, mid), score(left, mid)
        rows.append(dict(file=name, want=mid, got=got, left=left, exact=exact, sim=sim, l_exact=l_exact, l_sim=l_sim))
    n = len(rows)
    mean = lambda k: sum(r[k] for r in rows) / n  # noqa: E731
    res = dict(path=a.path, n=n, seconds=round(time.perf_counter() - t0, 1), exact=mean("exact"),
               similarity=mean("sim"), left_to_right_exact=mean("l_exact"), left_to_right_similarity=mean("l_sim"),
               examples=rows[:12])
    print("| cases | FIM exact | FIM char similarity | prefix-only exact | prefix-only similarity |")
    print(f"| {n} | {res['exact']:.3f} | {res['similarity']:.3f} | {res['left_to_right_exact']:.3f} | "
          f"{res['left_to_right_similarity']:.3f} |")
    for r in rows[:6]:
        print(f"{r['file']}: want {r['want'].strip()!r} | FIM {r['got'].strip()!r} | prefix-only {r['left'].strip()!r}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
