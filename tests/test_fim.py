"""Fill-in-the-Middle in the data path (fim.py, prepare.prepare) and clean.py inside prepare: what these tests prove.

- Every FIM document in train.bin decodes back to exactly its original document, PSM and SPM,
  by a decoder written here from the layouts (PSM: <PRE> prefix <SUF> suffix <MID> middle <EOS>;
  SPM: <PRE> <SUF> suffix <MID> prefix middle <EOS>), with each part encoded on its own; documents
  not chosen are plain encode(doc) + EOS.
- On 10,000 documents the observed FIM and SPM rates are within 0.02 of fim_rate / fim_spm_rate
  (two settings), and the cut points are uniform (sorted pair: means 1/3, 2/3).
- EOS and loss: one EOS per document (per fragment), after the middle; one of each sentinel per FIM
  sequence; validation stays plain; the Loader's targets include the sentinels and EOS (no mask:
  every token is trained on).
- Fragments (fim_fragment): a long FIM document is cut as a greedy line packer written here cuts it
  (a line longer than the rest of a half-full fragment is split at the limit), each fragment laid
  out with its own BLAKE2b cut points and an EOS after it, PSM/SPM decided once per document.
- The infilling prompt (PSM and SPM) is token for token what precedes a middle in train.bin (the
  previous document's EOS, then <PRE> prefix <SUF> suffix <MID> / <PRE> <SUF> suffix <MID> prefix),
  and what follows it there is middle + EOS; max_len trims the far prefix / suffix ids, never the
  EOS or a sentinel.
- Determinism: a document's transform depends only on (fim_seed, its index), as the documented
  BLAKE2b formula computed here; the same settings give identical files, another seed others.
- Sentinels: cl100k_base's ids 100258-100260; a truncated vocab with fim keeps them at vocab-4..-2
  (EOS at vocab-1), inside the model's vocab; without fim the truncated tokenizer is as before;
  o200k_base (no sentinels) is refused by get_tokenizer, prepare and pretrain.py, before work.
- Settings: fim/clean/dedup name the prepared folder; an old meta.json without those keys is reused.
- clean=True / dedup in prepare: planted exact / near duplicates, an auto-generated file and a
  binary-ish file are removed and counted in meta.json, the kept documents tokenized exactly.
- End to end on CPU: pretrain.py (tiny config, shrunk) trains with fim_rate=1 on a tiny corpus,
  then sample.py --prefix/--suffix infills and stops at EOS, in SPM order by default (PSM for a model
  trained without SPM samples, which refuses --fim_order=spm); a checkpoint whose config says it was
  trained without FIM is refused.
"""
import hashlib
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

import data
import sample
import tokenizer
from corpora import corpus, fim, prepare

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
DOCS = ["def f(x):\n    return {'a': x ** 2}  # comment\n", "héllo wörld — ünïcödé, 日本語, emoji 🙂👍🏽",
        "x", "ab", "special tokens as text: <|endoftext|> <|fim_prefix|> <|fim_middle|>"]
DOCS += [f"class C{i}:\n    value = {i * 7919}\n    name = 'n{i}' * {i % 5}\n" * (1 + i % 4) for i in range(200)]


def _jsonl(path, docs):
    with open(path, "w") as f:
        for d in docs:
            f.write(json.dumps({"text": d}) + "\n")
    return str(path)


def _split_docs(ids, eos):
    ends = np.flatnonzero(ids == eos)
    return [ids[a + 1 if i else 0: b + 1] for i, (a, b) in enumerate(zip(np.r_[-1, ends[:-1]], ends))]


def _decode(seq, tok):
    """(mode, document) from one training sequence, by the layouts alone."""
    pre, mid, suf = (tok.special_tokens[s] for s in ("<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>"))
    seq = [int(t) for t in seq]
    assert seq[-1] == tok.eos_id and tok.eos_id not in seq[:-1]  # one EOS, last
    body = seq[:-1]
    if not body or body[0] != pre:
        assert not {pre, mid, suf} & set(body)
        return "plain", tok.decode(body)
    assert body.count(pre) == body.count(mid) == body.count(suf) == 1
    if body[1] == suf:  # SPM: <PRE> <SUF> suffix <MID> prefix middle (= PSM with an empty prefix)
        m = body.index(mid)
        return "spm", tok.decode(body[m + 1:]) + tok.decode(body[2:m])
    s, m = body.index(suf), body.index(mid)  # PSM: <PRE> prefix <SUF> suffix <MID> middle
    assert 0 < s < m
    return "psm", tok.decode(body[1:s]) + tok.decode(body[m + 1:]) + tok.decode(body[s + 1:m])


def _uniforms(key):
    # fim.py's documented draws: BLAKE2b(key, 32 bytes) as 4 little-endian u64 / 2^64
    h = hashlib.blake2b(key.encode(), digest_size=32).digest()
    return [int.from_bytes(h[8 * k: 8 * k + 8], "little") / 2 ** 64 for k in range(4)]


def _reference_plan(text, index, rate, spm_rate, seed):
    u = _uniforms(f"fim:{seed}:{index}")
    if u[0] >= rate:
        return None
    a, b = sorted(int(x * (len(text) + 1)) for x in u[2:])
    return ("spm" if u[1] < spm_rate else "psm"), a, b


def _reference_fragments(text, n):
    # greedy line packing: whole lines while they fit in n characters; a fragment holding n/2 or
    # fewer characters when the next line does not fit is filled up to n with part of that line
    out, cur = [], ""
    for line in text.splitlines(keepends=True):
        while len(cur) + len(line) > n:
            if len(cur) > n // 2:
                out.append(cur)
                cur = ""
            else:
                take = n - len(cur)
                out.append(cur + line[:take])
                cur, line = "", line[take:]
        cur += line
    return out + [cur] if cur else out


def _layout_ids(tok, mode, text, a, b):
    pre, mid, suf = tokenizer.fim_sentinels(tok)
    parts = [[pre], tok.encode(text[:a]), [suf], tok.encode(text[b:]), [mid], tok.encode(text[a:b])]
    if mode == "spm":
        parts = [[pre, suf], tok.encode(text[b:]), [mid], tok.encode(text[:a]), tok.encode(text[a:b])]
    return sum(parts, []) + [tok.eos_id]  # each part encoded on its own


@pytest.fixture(scope="module")
def tok():
    return tokenizer.get_tokenizer("cl100k_base", 4096, fim=True)


def _prepare(tmp_path, docs, tok, name="out", **kw):
    kw = {"val_fraction": 0, "val_tokens": 0, "verbose": False, **kw}
    out = str(tmp_path / name)
    meta = prepare.prepare(_jsonl(tmp_path / f"{name}.jsonl", docs), tok, out, **kw)
    read = lambda s: np.fromfile(os.path.join(out, f"{s}.bin"), dtype=meta["dtype"])  # noqa: E731
    return meta, read("train"), read("val"), out


def test_every_fim_document_decodes_to_the_original(tmp_path, tok):
    meta, train, val, _ = _prepare(tmp_path, DOCS, tok, fim_rate=0.7, fim_spm_rate=0.5, fim_seed=3)
    assert len(val) == 0 and meta["n_docs"] == len(DOCS)
    seqs = _split_docs(train, tok.eos_id)
    assert len(seqs) == len(DOCS)
    modes = {"plain": 0, "psm": 0, "spm": 0}
    separately = 0
    for i, (doc, seq) in enumerate(zip(DOCS, seqs)):
        mode, text = _decode(seq, tok)
        assert text == doc, (i, mode)
        ref = _reference_plan(doc, i, 0.7, 0.5, 3)
        modes[ref[0] if ref else "plain"] += 1
        assert mode == (ref[0] if ref and ref[1] else "spm" if ref else "plain")  # empty prefix: PSM = SPM
        if ref is None:
            assert seq.tolist() == tok.encode(doc) + [tok.eos_id]
            continue
        _, a, b = ref
        assert seq.tolist() == _layout_ids(tok, mode, doc, a, b)
        separately += tok.encode(doc[:a]) + tok.encode(doc[a:b]) + tok.encode(doc[b:]) != tok.encode(doc)
    assert modes["psm"] > 20 and modes["spm"] > 20 and modes["plain"] > 20, modes
    assert meta["fim_docs"] == {"psm": modes["psm"], "spm": modes["spm"]}
    assert separately > 10  # cuts inside tokens happen, and the parts are not re-merged


@pytest.mark.parametrize("rate,spm_rate", [(0.5, 0.5), (0.9, 0.2)])
def test_rates_on_10000_documents(tmp_path, tok, rate, spm_rate):
    docs = [f"doc {i}: " + "word " * (i % 37) for i in range(10_000)]
    meta, train, _, _ = _prepare(tmp_path, docs, tok, fim_rate=rate, fim_spm_rate=spm_rate)
    seqs = _split_docs(train, tok.eos_id)
    refs = [_reference_plan(d, i, rate, spm_rate, 0) for i, d in enumerate(docs)]
    pre, _, suf = tokenizer.fim_sentinels(tok)
    for seq, ref in zip(seqs, refs):  # the data follows the documented draws (full check: first test)
        assert (seq[0] == pre) == (ref is not None) and (ref is None or (seq[1] == suf) == (ref[0] == "spm" or not ref[1]))
    modes = [r[0] if r else "plain" for r in refs]
    n_fim = sum(m != "plain" for m in modes)
    assert abs(n_fim / 10_000 - rate) < 0.02
    assert abs(modes.count("spm") / n_fim - spm_rate) < 0.02
    assert meta["fim_docs"] == {"psm": modes.count("psm"), "spm": modes.count("spm")}
    cuts = [p[1][0] for i, d in enumerate(docs) if (p := fim.plan(d, i, 1.0, 0.5)) is not None]
    lo = np.mean([len(p[0]) / (len(docs[i]) + 1) for i, p in enumerate(cuts)])
    hi = np.mean([(len(p[0]) + len(p[1])) / (len(docs[i]) + 1) for i, p in enumerate(cuts)])
    assert abs(lo - 1 / 3) < 0.02 and abs(hi - 2 / 3) < 0.02  # two sorted uniform cuts


def test_validation_plain_and_targets_unmasked(tmp_path, tok):
    meta, train, val, out = _prepare(tmp_path, DOCS, tok, fim_rate=0.5, val_fraction=0.05)
    assert meta["val_split"] == "documents" and meta["n_val_docs"] > 5
    assert not set(tokenizer.fim_sentinels(tok)) & set(val.tolist())  # validation stays plain
    plain = {d for d in DOCS}
    assert all(_decode(s, tok) == ("plain", tok.decode(s[:-1])) and tok.decode(s[:-1]) in plain
               for s in _split_docs(val, tok.eos_id))
    assert sum(len(s) for s in _split_docs(val, tok.eos_id)) == meta["n_val"] == len(val)
    assert meta["n_train"] == len(train)
    # every token is a target: y is x shifted, sentinels and EOS included, nothing ignored
    T = 16
    loader = data.Loader(os.path.join(out, "train.bin"), 4, T)
    targets = set()
    for _ in range(loader.n_windows // 4):
        x, y = loader.next()
        assert torch.equal(x[:, 1:], y[:, :-1]) and (y >= 0).all()
        targets |= set(y.flatten().tolist())
    assert set(tokenizer.fim_sentinels(tok)) | {tok.eos_id} <= targets


def test_tokens_split_keeps_the_cut_document_plain(tmp_path, tok):
    docs = ["short one\n", "def long():\n" + "    x = 1\n" * 400]
    meta, train, val, _ = _prepare(tmp_path, docs, tok, fim_rate=1.0, val_fraction=0.3)
    assert meta["val_split"] == "tokens" and meta["fim_docs"] == {"psm": 1, "spm": 0} or \
        meta["fim_docs"] == {"psm": 0, "spm": 1}
    first = _split_docs(train, tok.eos_id)[0]
    assert _decode(first, tok)[1] == docs[0] and _decode(first, tok)[0] != "plain"
    head = train[len(first):].tolist()
    assert head + val.tolist() == tok.encode(docs[1]) + [tok.eos_id]  # the cut document, plain


def test_deterministic_per_seed_and_document(tmp_path, tok):
    _, a, _, _ = _prepare(tmp_path, DOCS, tok, "a", fim_rate=0.5)
    _, b, _, _ = _prepare(tmp_path, DOCS, tok, "b", fim_rate=0.5)
    _, c, _, _ = _prepare(tmp_path, DOCS, tok, "c", fim_rate=0.5, fim_seed=1)
    assert np.array_equal(a, b) and not np.array_equal(a, c)
    t = fim.Transform(tok, 0.5, 0.5, seed=0)
    for i in (0, 7, 123):  # a document's layout needs only (seed, index), not the others
        mode, parts = t.apply(DOCS[i], i)
        ref = _reference_plan(DOCS[i], i, 0.5, 0.5, 0)
        assert fim.MODES[mode] == (ref[0] if ref else "plain")
        ids = sum(([p] if isinstance(p, int) else tok.encode(p) for p in parts), [])
        assert ids + [tok.eos_id] == _split_docs(a, tok.eos_id)[i].tolist()


def test_long_documents_fim_in_fragments(tmp_path, tok):
    body = "".join(f"    value_{i} = compute({i}, 'x' * {i % 7})\n" for i in range(60))
    docs = ["def f():\n" + body, "short\n", "y" * 700 + "\n" + body[:300], "def g():\n" + body.replace("value", "v")]
    N = 400
    meta, train, _, _ = _prepare(tmp_path, docs, tok, fim_rate=1.0, fim_spm_rate=0.5, fim_fragment=N)
    seqs, pos, n_frag = _split_docs(train, tok.eos_id), 0, 0
    for i, doc in enumerate(docs):
        frags = _reference_fragments(doc, N)
        assert "".join(frags) == doc and all(len(f) <= N for f in frags)
        mode, _, _ = _reference_plan(doc, i, 1.0, 0.5, 0)  # the document's draws decide FIM and PSM/SPM
        for k, frag in enumerate(frags):
            u = _uniforms(f"fim:0:{i}" + (f":{k}" if k else ""))  # fragment k > 0: its own cut points
            a, b = sorted(int(x * (len(frag) + 1)) for x in u[2:])
            assert seqs[pos].tolist() == _layout_ids(tok, mode, frag, a, b), (i, k)  # EOS after every fragment
            pos += 1
        n_frag += len(frags)
    assert pos == len(seqs) and n_frag == 6 + 1 + 3 + 5  # the 700 'y' line is cut at 400 characters
    assert meta["fim_fragment"] == N and sum(meta["fim_docs"].values()) == len(docs)
    folder = lambda f: prepare.default_data_dir("stdlib", "cl100k_base", 4096, fim_rate=0.5, fim_fragment=f)  # noqa: E731
    assert folder(N) != folder(0)  # another fragment size, another prepared folder
    with pytest.raises(corpus.DataError, match="fim_fragment=-1 must be an integer >= 0"):
        fim.Transform(tok, 0.5, 0.5, fragment=-1)


def test_prompt_is_the_training_context(tmp_path, tok):
    docs = [f"def f{i}(a):\n    b = a * {i}\n    return b + {i * 3}\n" for i in range(30)]
    pre, mid, suf = tokenizer.fim_sentinels(tok)
    for spm in (False, True):
        _, train, _, _ = _prepare(tmp_path, docs, tok, f"spm{spm}", fim_rate=1.0, fim_spm_rate=float(spm))
        seqs = _split_docs(train, tok.eos_id)
        for i in range(1, len(docs)):
            _, a, b = _reference_plan(docs[i], i, 1.0, float(spm), 0)
            context = [tok.eos_id] + seqs[i].tolist()  # the previous document's EOS, then this FIM document
            m = context.index(mid) + (len(tok.encode(docs[i][:a])) if spm else 0)  # SPM: the prefix is given
            assert fim.prompt(tok, docs[i][:a], docs[i][b:], spm=spm) == context[:m + 1]  # token for token
            assert context[m + 1:] == tok.encode(docs[i][a:b]) + [tok.eos_id]  # what the model is to write
    P, S = tok.encode("x = 1\n" * 40), tok.encode("y = 2\n" * 40)
    full = fim.prompt(tok, "x = 1\n" * 40, "y = 2\n" * 40)
    assert full == [tok.eos_id, pre, *P, suf, *S, mid]
    for max_len, want_p, want_s in [(len(full), len(P), len(S)), (40, 18, 18), (41, 19, 18), (4, 0, 0)]:
        got = fim.prompt(tok, "x = 1\n" * 40, "y = 2\n" * 40, max_len=max_len)
        assert got == [tok.eos_id, pre, *P[len(P) - want_p:], suf, *S[:want_s], mid]  # prefix tail, suffix head
    got = fim.prompt(tok, "z\n", "y = 2\n" * 40, max_len=30)  # a short prefix leaves its room to the suffix
    assert got == [tok.eos_id, pre, *tok.encode("z\n"), suf, *S[:30 - 4 - len(tok.encode("z\n"))], mid]
    assert fim.prompt(tok, "x = 1\n" * 40, "y = 2\n" * 40, max_len=40, spm=True) == \
        [tok.eos_id, pre, suf, *S[:18], mid, *P[-18:]]
    with pytest.raises(corpus.DataError, match="needs 4 tokens"):
        fim.prompt(tok, "a", "b", max_len=3)


def test_sentinels_and_refusals(tmp_path):
    full = tokenizer.get_tokenizer("cl100k_base", fim=True)
    assert tokenizer.fim_sentinels(full) == (100258, 100259, 100260)  # tiktoken's published ids
    for vocab in (512, 4096, 32768):
        t = tokenizer.get_tokenizer("cl100k_base", vocab, fim=True)
        assert tokenizer.fim_sentinels(t) == (vocab - 4, vocab - 3, vocab - 2) and t.eos_id == vocab - 1 == t.n_vocab - 1
        assert t.decode([vocab - 4]) == "<|fim_prefix|>"
        assert t.enc.decode_single_token_bytes(vocab - 5) == full.enc.decode_single_token_bytes(vocab - 5)
        plain = tokenizer.get_tokenizer("cl100k_base", vocab)
        assert plain.special_tokens == {"<|endoftext|>": vocab - 1}  # unchanged without fim
        assert plain.enc.decode_single_token_bytes(vocab - 2) == full.enc.decode_single_token_bytes(vocab - 2)
        with pytest.raises(corpus.DataError, match="no fill-in-the-middle sentinels"):
            tokenizer.fim_sentinels(plain)
    with pytest.raises(corpus.DataError, match="needs 260 <= vocab"):
        tokenizer.get_tokenizer("cl100k_base", 259, fim=True)  # 256 bytes + 3 sentinels + EOS do not fit
    for vocab in (0, 4096):
        with pytest.raises(corpus.DataError, match="o200k_base has no fill-in-the-middle sentinels.*fim_rate=0"):
            tokenizer.get_tokenizer("o200k_base", vocab, fim=True)
    o200k = tokenizer.get_tokenizer("o200k_base", 4096)
    with pytest.raises(corpus.DataError, match="no fill-in-the-middle sentinels"):
        prepare.prepare(_jsonl(tmp_path / "c.jsonl", DOCS), o200k, str(tmp_path / "o"), fim_rate=0.5)
    assert not os.path.exists(tmp_path / "o")  # refused before any work


def test_settings_name_the_folder_and_old_meta_is_reused(tmp_path, tok):
    base = prepare.default_data_dir("stdlib", "cl100k_base", 4096)
    assert prepare.default_data_dir("stdlib", "cl100k_base", 4096, **prepare.VARIANT_DEFAULTS, max_docs=5) == base
    named = {prepare.default_data_dir("stdlib", "cl100k_base", 4096, **kw) for kw in
             [dict(fim_rate=0.5), dict(fim_rate=0.5, fim_seed=1), dict(fim_rate=0.5, fim_spm_rate=0.1),
              dict(clean=True), dict(dedup="exact"), dict(dedup="near"), dict(clean=True, dedup="near")]}
    assert len(named) == 7 and base not in named
    assert prepare.default_data_dir("stdlib", "cl100k_base", 4096, clean=True, dedup="near", fim_rate=0.5) \
        .startswith("data/stdlib-cl100k_base-4096-clean-near-fim-")
    plain = tokenizer.get_tokenizer("cl100k_base", 4096)
    meta, _, _, out = _prepare(tmp_path, DOCS, plain)
    with open(os.path.join(out, "meta.json")) as f:
        old = json.load(f)
    for k in ("fim_rate", "fim_spm_rate", "fim_seed", "clean", "dedup", "cleaned", "fim_docs"):
        old.pop(k)  # as written before these settings existed
    with open(os.path.join(out, "meta.json"), "w") as f:
        json.dump(old, f)
    assert prepare.prepare(str(tmp_path / "out.jsonl"), plain, out, val_fraction=0, val_tokens=0, verbose=False) == old
    again = prepare.prepare(str(tmp_path / "out.jsonl"), tok, out, val_fraction=0, val_tokens=0, verbose=False,
                         fim_rate=0.5)
    assert again["fim_rate"] == 0.5 and sum(again["fim_docs"].values()) > 0  # a changed setting rebuilds


def test_clean_and_dedup_in_prepare(tmp_path, tok, capsys):
    body = "".join(f"def handler_{i}(request, value):\n    return compute(value, {i}) + offset_{i}\n\n"
                   for i in range(30))
    near = body.replace("handler_7(", "handler_seven(")  # one line of thirty edited
    generated = "# Generated by the protocol buffer compiler.  DO NOT EDIT!\n" + body.replace("def ", "def g_")
    binary = "x = 1\n" + "\x00\x01\x02" * 40
    other = body.replace("compute", "other_function").replace("offset", "shift").replace("handler", "h")
    docs = [body, body.replace("\n\n", "\n \n"), near, generated, binary, other]
    want = {"none": ({}, docs), "exact": ({"exact_duplicate": 1}, [body, near, generated, binary, other])}
    for dedup, (removed, kept) in want.items():
        meta, train, _, _ = _prepare(tmp_path, docs, tok, f"d{dedup}", dedup=dedup)
        assert meta["cleaned"]["removed"] == removed and meta["n_docs"] == len(kept)
        assert train.tolist() == sum((tok.encode(d) + [tok.eos_id] for d in kept), [])
    meta, train, _, _ = _prepare(tmp_path, docs, tok, "all", clean=True, dedup="near", verbose=True)
    assert meta["cleaned"]["removed"] == {"exact_duplicate": 1, "near_duplicate": 1, "autogenerated": 1, "binary": 1}
    assert meta["cleaned"]["docs"] == 6 and meta["cleaned"]["kept"] == meta["n_docs"] == 2
    assert train.tolist() == sum((tok.encode(d) + [tok.eos_id] for d in (body, other)), [])
    printed = capsys.readouterr().out
    assert printed.count("6 documents in, 2 kept") == 1 and "removed        1 near_duplicate" in printed


def _run(args, script="pretrain.py"):
    r = subprocess.run([sys.executable, os.path.join(ROOT, script)] + args, cwd=ROOT, env=ENV,
                       capture_output=True, text=True, timeout=600)
    return r


def test_pretrain_with_fim_then_infill(tmp_path, capsys):
    doc = "def add(a, b):\n    return a + b\n"
    src = _jsonl(tmp_path / "c.jsonl", [doc] * 400)
    common = ["configs/tiny.py", f"--data={src}", "--n_layer=2", "--n_embd=64", "--block_size=64", "--tokenizer_vocab=512",
              "--batch_size=16", "--micro_batch_size=16", "--eval_every=0", "--sample_tokens=0", "--progress=False",
              "--log_every=50", "--warmup_steps=10", "--max_docs=0", "--val_tokens=0", "--val_fraction=0.05",
              "--clean=False", "--dedup=none"]  # tiny.py dedups: 400 copies would become one document
    out = str(tmp_path / "fim")
    r = _run(common + ["--fim_rate=1.0", "--max_steps=150", f"--out_dir={out}", f"--data_dir={tmp_path}/d1"])
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "FIM (rate 1.0" in r.stdout
    s = _run([out, "--prefix=def add(a, b):\n    return", "--suffix= + b\n", "--tokens=20", "--temperature=0",
              "--device=cpu"], "sample.py")
    assert s.returncode == 0, s.stderr
    head, text = s.stdout.split("---\n", 1)
    assert head.startswith("--- sample 0: middle of") and "(SPM order), stopped at EOS" in head, s.stdout  # learned to stop
    assert text.startswith("def add(a, b):\n    return") and text.endswith(" + b\n\n")  # prefix middle suffix
    print(s.stdout)  # the quality of the middle is the GPU run's question, not this test's

    def variant(name, **changes):  # the same checkpoint, its config (and manifest) changed
        ckpt = tmp_path / name
        shutil.copytree(os.path.join(out, "step_000150"), ckpt)
        conf, manifest = ckpt / "config.json", ckpt / "complete.json"
        conf.write_text(json.dumps({**json.loads(conf.read_text()), **changes}))
        man = json.loads(manifest.read_text())
        man["files"]["config.json"] = dict(size=conf.stat().st_size, sha256=hashlib.sha256(conf.read_bytes()).hexdigest())
        manifest.write_text(json.dumps(man))
        return str(ckpt)

    psm_only = variant("psm_only", fim_spm_rate=0.0)  # in process: sample.main, as the command line calls it
    sample.main([psm_only, "--prefix=def add(a, b):\n    return", "--suffix= + b\n", "--tokens=20", "--temperature=0", "--device=cpu"])
    assert "(PSM order)" in capsys.readouterr().out  # auto: the order it was trained in
    with pytest.raises(SystemExit) as e:
        sample.main([psm_only, "--prefix=x", "--suffix=y", "--fim_order=spm", "--device=cpu"])
    assert e.value.code == 2 and "trained without SPM samples" in capsys.readouterr().err
    s = _run([variant("plain", fim_rate=0.0), "--prefix=x", "--suffix=y", "--device=cpu"], "sample.py")
    assert s.returncode == 2 and "trained without fill-in-the-middle" in s.stderr
    r = _run(common + ["--tokenizer=o200k_base", "--fim_rate=0.5", f"--out_dir={tmp_path}/o"])
    assert r.returncode == 2 and "o200k_base has no fill-in-the-middle sentinels" in r.stderr
    assert not os.path.exists(tmp_path / "o" / "train_metrics.jsonl")
