"""data.py and corpus.py, pretraining part: what these tests prove.

Tokenizer: the bundled cl100k_base/o200k_base build exactly tiktoken's own Encoding
(tiktoken.load.load_tiktoken_bpe + the constructor in tiktoken_ext.openai_public, fed the same
file), give tiktoken's published ids, round-trip arbitrary text, refuse a corrupt file, and a
truncated vocab is a complete BPE with EOS at vocab-1. Unknown encodings fail with a clear
message and no network.
Corpora (corpus.py): every source kind yields exactly the expected documents; the hub path is the
same `datasets` streaming path as local parquet; bad sources fail with clear messages, as
corpus.DataError, a config.UserError that is also a ValueError.
prepare: train.bin/val.bin hold exactly encode(doc) + [eos] per document of each split, in order,
with the right dtype, split as an independent reference (and val_split as worked by hand) says;
a finished preparation is reused; an interrupted one is never mistaken for finished.
Loader: two ranks get disjoint batches whose union is exactly one process with B*2, y is x shifted,
each epoch visits every window once, a saved state resumes the identical stream, eval batches are
deterministic, too-short data fails clearly.
Issue 13 (each test failed on commit 4bce2c0): a single text file is a corpus; a 2-document corpus
keeps validation at its share; validation has a token floor; binary / undecodable files are skipped
and counted, a few bad bytes counted; unsupported files are named; a malformed .jsonl line names
file:line; bad settings fail before any work; a small validation split shrinks the evaluation (with
a message) and only no window per rank is refused; a too-small train split is refused by
check_split; long documents tokenize in parts to the same ids; the "python" corpus (on a fake
site-packages) is deduplicated, in a seeded non-alphabetical order, each package capped, and
rebuilt when a file is added.
"""
import gzip
import itertools
import json
import os
import subprocess
import sys
import types

import numpy as np
import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import config  # noqa: E402
from corpora import corpus, prepare  # noqa: E402
import data  # noqa: E402
import tokenizer  # noqa: E402

TEXTS = [
    "hello world",
    "def f(x):\n    return {'a': x ** 2}  # comment\n\n\n",
    "héllo wörld — ünïcödé, 日本語のテキスト, emoji 🙂👍🏽, Ελληνικά, русский",
    "   leading spaces\t\ttabs\n\n\n\nnewlines   \r\n trailing   ",
    "I'm sure they'll say we've done it; DON'T 1234567 3.14159",
    "special tokens as text: <|endoftext|> <|fim_prefix|>",
    "",
]


def test_import_has_no_side_effects():
    code = "import sys, data; from corpora import corpus; assert 'datasets' not in sys.modules, 'datasets imported at import time'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=os.path.dirname(data.__file__))


# ----------------------------------------------------------------------------- tokenizer

def test_cl100k_published_ids():
    tok = tokenizer.get_tokenizer("cl100k_base")
    # tiktoken's README / OpenAI cookbook examples for cl100k_base
    assert tok.encode("hello world") == [15339, 1917]
    assert tok.encode("tiktoken is great!") == [83, 1609, 5963, 374, 2294, 0]
    assert tok.eos_id == 100257 and tok.n_vocab == 100277
    assert tok.encode_batch(["hello world", "tiktoken is great!"]) == [[15339, 1917], [83, 1609, 5963, 374, 2294, 0]]


@pytest.mark.parametrize("name", ["cl100k_base", "o200k_base"])
def test_bundled_equals_tiktoken_reference(name, tmp_path, monkeypatch):
    """Independent reference: tiktoken's own loader and tiktoken_ext's constructor (pattern,
    special tokens), with the download replaced by the same bundled file, decompressed."""
    import tiktoken
    import tiktoken.load
    from tiktoken_ext import openai_public
    plain = tmp_path / f"{name}.tiktoken"
    plain.write_bytes(gzip.decompress(open(tokenizer._bundled_path(name), "rb").read()))
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", "")  # no caching of the local file
    monkeypatch.setattr(openai_public, "load_tiktoken_bpe",
                        lambda url, expected_hash: tiktoken.load.load_tiktoken_bpe(str(plain), expected_hash))
    ref = tiktoken.Encoding(**getattr(openai_public, name)())
    ours = tokenizer.get_tokenizer(name)
    assert ours.enc._pat_str == ref._pat_str
    assert ours.enc._special_tokens == ref._special_tokens
    assert ours.enc._mergeable_ranks == ref._mergeable_ranks
    assert ours.n_vocab == ref.n_vocab and ours.eos_id == ref.eot_token
    for text in TEXTS:
        assert ours.encode(text) == ref.encode_ordinary(text)
        assert ours.decode(ours.encode(text)) == text
    assert ours.eos_id not in ours.encode("a<|endoftext|>b")  # special tokens in text are just text


def test_corrupt_bpe_file_raises(tmp_path, monkeypatch):
    raw = gzip.decompress(open(tokenizer._bundled_path("cl100k_base"), "rb").read())
    bad = tmp_path / "cl100k_base.tiktoken.gz"
    bad.write_bytes(gzip.compress(raw.replace(b" 100\n", b" 101\n", 1)))
    with pytest.raises(ValueError, match="sha256"):
        tokenizer.load_bpe_ranks(str(bad), tokenizer.BUNDLED["cl100k_base"][0])
    monkeypatch.setattr(tokenizer, "_bundled_path", lambda name: str(bad))
    tokenizer._encoding.cache_clear()
    try:
        with pytest.raises(ValueError, match="sha256.*corrupt"):
            tokenizer.get_tokenizer("cl100k_base")
    finally:
        tokenizer._encoding.cache_clear()


def test_truncated_vocab():
    tok = tokenizer.get_tokenizer("cl100k_base", 4096)
    full = tokenizer.get_tokenizer("cl100k_base")
    assert tok.n_vocab == 4096 and tok.eos_id == 4095
    for text in TEXTS + ["".join(chr(c) for c in range(32, 2000)), "\x00\x01\xff"]:
        ids = tok.encode(text)
        assert all(0 <= i < 4095 for i in ids)  # EOS never comes out of ordinary text
        assert tok.decode(ids) == text
        assert len(ids) >= len(full.encode(text))  # fewer merges, never shorter
    # the first 256 ranks are the single bytes, so tokens below the cut are identical tokens
    assert all(tok.enc.decode_single_token_bytes(i) == full.enc.decode_single_token_bytes(i) for i in range(4095))
    with pytest.raises(ValueError, match="257"):
        tokenizer.get_tokenizer("cl100k_base", 200)
    # a BPE whose single bytes are not all among the first ranks cannot be cut there
    ranks = {bytes([b]): b for b in range(255)} | {b"ab": 255, b"\xff": 256, b"abc": 257}
    with pytest.raises(ValueError, match="single bytes"):
        tokenizer.truncate_ranks(ranks, 257)
    assert len(tokenizer.truncate_ranks(ranks, 258)) == 257


def test_unknown_encoding_offline_error(tmp_path, monkeypatch):
    import tiktoken.load

    def no_network(url):
        raise ConnectionError(f"network disabled in this test: {url}")
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path))  # empty cache
    monkeypatch.setattr(tiktoken.load, "read_file", no_network)
    for name in ("r50k_base", "gpt2"):
        with pytest.raises(ValueError, match=r"(?s)not available.*network disabled.*cl100k_base.*o200k_base"
                                             r".*TIKTOKEN_CACHE_DIR"):
            tokenizer.get_tokenizer(name)
    with pytest.raises(ValueError, match="not available"):
        tokenizer.get_tokenizer("no_such_encoding")


# ----------------------------------------------------------------------------- corpora

def _write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return str(path)


def _jsonl(path, rows):
    return _write(path, "".join(json.dumps(r) + "\n" for r in rows))


def test_corpus_files(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    text = "one doc\nwith two lines"
    assert list(corpus.iter_documents(_write(tmp_path / "a.txt", text))) == [text]
    rows = [{"content": "first", "id": 1}, {"content": "", "id": 2}, {"content": "  \n", "id": 3},
            {"content": "second ünï", "id": 4}]
    jl = _jsonl(tmp_path / "d.jsonl", rows)
    assert list(corpus.iter_documents(jl, text_field="content")) == ["first", "second ünï"]  # blanks skipped
    with pytest.raises(corpus.DataError, match=r"d\.jsonl:1: no field 'text' \(fields: \['content', 'id'\]\)"):
        list(corpus.iter_documents(jl))
    pq.write_table(pa.table({"text": ["p0", "p1", "p2"]}), tmp_path / "p.parquet")
    assert list(corpus.iter_documents(str(tmp_path / "p.parquet"))) == ["p0", "p1", "p2"]

    root = tmp_path / "folder"
    _write(root / "b" / "z.md", "markdown")
    _write(root / "a.py", "print(1)\n")
    _jsonl(root / "b" / "c.jsonl", [{"text": "j0"}, {"text": "j1"}])
    _write(root / "ignored.csv", "x,y")
    _write(root / "c" / "empty.txt", "")
    assert list(corpus.iter_documents(str(root))) == ["print(1)\n", "j0", "j1", "markdown"]  # sorted paths


def test_corpus_errors(tmp_path):
    assert issubclass(corpus.DataError, config.UserError) and issubclass(corpus.DataError, ValueError)
    with pytest.raises(corpus.DataError, match=r"no/such/dir.*not found.*stdlib.*python.*hf:.*jsonl"):
        corpus.iter_documents(str(tmp_path / "no/such/dir"))  # raised at call time, not lazily
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="corpus .*empty.* is empty"):
        list(corpus.iter_documents(str(tmp_path / "empty")))
    with pytest.raises(ValueError, match="is empty"):
        list(corpus.iter_documents(_write(tmp_path / "blank.txt", " \n\n ")))
    with pytest.raises(ValueError, match="unsupported"):
        corpus.iter_documents(_write(tmp_path / "x.csv", "a,b"))
    with pytest.raises(ValueError, match="hf:<name>"):
        corpus.iter_documents("hf:")


def test_hub_source_uses_streaming_datasets(monkeypatch):
    calls = []

    def load_dataset(*args, **kwargs):
        calls.append((args, kwargs))
        return iter([{"text": "row 0"}, {"text": ""}, {"text": "row 2"}])
    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    assert list(corpus.iter_documents("hf:org/name:cfg@validation")) == ["row 0", "row 2"]
    assert calls == [(("org/name", "cfg"), {"split": "validation", "streaming": True})]
    list(corpus.iter_documents("hf:org/name"))
    assert calls[-1] == (("org/name", None), {"split": "train", "streaming": True})


def test_stdlib_corpus():
    docs = list(itertools.islice(corpus.iter_documents("stdlib"), 150))
    assert len(docs) == 150 and all(isinstance(d, str) and d.strip() for d in docs)
    roots = corpus.python_roots(site_packages=False)
    files = corpus.python_files(roots)
    assert len(files) > 100 and files == corpus.python_files(roots)  # a fixed order
    assert not any("site-packages" in f for f in files)
    assert any(f.endswith(os.sep + "functools.py") for f in files)
    for f, d in zip(files[:20], docs):  # the documents are those files, in that order
        if open(f, "rb").read().strip():
            assert open(f, encoding="utf-8", errors="replace").read() == d
            break
    # the tiny config's first 400 files are not alphabetical, so not mostly encodings/ (finding of issue 13)
    assert files != sorted(files)
    assert sum(os.sep + "encodings" + os.sep in f for f in files[:400]) < 40


# ----------------------------------------------------------------------------- prepare

DOCS = ["doc zero: hello", "doc one\n", "def two():\n    pass\n", "three ünïcödé 🙂", "four 4444",
        "five <|endoftext|> as text", "six", "seven\t\tseven"]


def _folder(tmp_path, docs=DOCS):
    root = tmp_path / "corpus"
    for i, d in enumerate(docs):
        _write(root / f"{i:03d}.md", d)  # .md: one document per file (.txt would split DOCS[5])
    return str(root)


def _reference_split(ids, share, limit):
    """Independent reference of prepare's split of documents `ids` (token lists, EOS included) for a
    target `share` of the tokens and a share limit: a document goes to val when val holds less than
    `share` of the tokens before it, if that lands within 10% of the target and the limit; else val
    is the last round(share * total) tokens. Returns ({"train": ids, "val": ids}, mode,
    (train documents, val documents)) where a cut document counts in both."""
    want, total, start, n_val_docs = {"train": [], "val": []}, sum(map(len, ids)), 0, 0
    for d in ids:
        split = "val" if len(want["val"]) < share * start else "train"
        n_val_docs += split == "val"
        want[split] += d
        start += len(d)
    if 0.9 * round(share * total) <= len(want["val"]) <= min(1.1 * share, limit) * total:
        return want, "documents", (len(ids) - n_val_docs, n_val_docs)
    stream, cut, ends = [t for d in ids for t in d], total - round(share * total), np.cumsum([len(d) for d in ids])
    return ({"train": stream[:cut], "val": stream[cut:]}, "tokens",
            (int(np.sum(ends - [len(d) for d in ids] < cut)), int(np.sum(ends > cut))))


def _read_bin(out_dir, split, dtype):
    return np.fromfile(os.path.join(out_dir, f"{split}.bin"), dtype=dtype).tolist()


@pytest.mark.parametrize("vocab, dtype", [(4096, np.uint16), (0, np.uint32)])
def test_prepare_tokens_exact(tmp_path, vocab, dtype):
    tok = tokenizer.get_tokenizer("cl100k_base", vocab)
    out = str(tmp_path / "out")
    for fraction, mode in [(0.4, "tokens"), (0.5, "documents")]:  # 8 documents: coarse for 40%
        meta = prepare.prepare(_folder(tmp_path), tok, out, val_fraction=fraction, verbose=False)
        want, want_mode, docs = _reference_split([tok.encode(d) + [tok.eos_id] for d in DOCS], fraction, fraction)
        assert _read_bin(out, "train", dtype) == want["train"]
        assert _read_bin(out, "val", dtype) == want["val"]
        assert meta["dtype"] == np.dtype(dtype).name and meta["n_vocab"] == tok.n_vocab
        assert (meta["n_train"], meta["n_val"]) == (len(want["train"]), len(want["val"]))
        assert (meta["n_train_docs"], meta["n_val_docs"], meta["n_docs"]) == (*docs, 8)
        assert meta["val_split"] == want_mode == mode and meta["eos_id"] == tok.eos_id
    assert json.load(open(os.path.join(out, "meta.json"))) == meta
    assert sorted(os.listdir(out)) == ["meta.json", "train.bin", "val.bin"]  # no tmp files left


def test_prepare_reuse_and_rebuild(tmp_path, monkeypatch):
    tok = tokenizer.get_tokenizer("cl100k_base", 4096)
    src, out = _folder(tmp_path), str(tmp_path / "out")
    meta = prepare.prepare(src, tok, out, val_fraction=0.25, verbose=False)

    def fail(*a, **k):
        raise AssertionError("tokenized again")
    with monkeypatch.context() as m:
        m.setattr(tok, "encode_batch", fail)
        assert prepare.prepare(src, tok, out, val_fraction=0.25, verbose=False) == meta  # reused
    assert prepare.prepare(src, tok, out, val_fraction=0.25, val_tokens=0, verbose=False) != meta  # new params
    _write(tmp_path / "corpus" / "008.md", "an added document")  # corpus changed -> fingerprint changed
    meta = prepare.prepare(src, tok, out, val_fraction=0.25, verbose=False)
    assert meta["n_docs"] == 9


def test_prepare_interrupted_is_not_reused(tmp_path, monkeypatch):
    tok = tokenizer.get_tokenizer("cl100k_base", 4096)
    src, out = _folder(tmp_path), str(tmp_path / "out")
    good = prepare.prepare(src, tok, out, val_fraction=0.25, verbose=False)
    real = corpus.iter_documents

    def dies_midway(*a, **k):
        yield from itertools.islice(real(*a, **k), 3)
        raise RuntimeError("killed mid-way")
    monkeypatch.setattr(corpus, "iter_documents", dies_midway)
    with pytest.raises(RuntimeError, match="killed"):
        prepare.prepare(src, tok, out, val_fraction=0.5, verbose=False)
    assert not os.path.exists(os.path.join(out, "meta.json"))  # old meta must not describe new bins
    assert not [f for f in os.listdir(out) if ".tmp" in f]
    with pytest.raises(RuntimeError, match="killed"):  # and nothing is mistaken for finished data
        prepare.prepare(src, tok, out, val_fraction=0.25, verbose=False)
    monkeypatch.setattr(corpus, "iter_documents", real)
    assert prepare.prepare(src, tok, out, val_fraction=0.25, verbose=False) == good
    assert _read_bin(out, "val", np.uint16)[-1] == tok.eos_id


def test_prepare_split_edge_cases(tmp_path):
    tok = tokenizer.get_tokenizer("cl100k_base", 4096)
    meta = prepare.prepare(_write(tmp_path / "one.md", "a"), tok, str(tmp_path / "o1"), verbose=False)  # "a" + EOS
    assert (meta["n_train"], meta["n_val"], meta["val_split"]) == (1, 1, "tokens")  # the smallest corpus
    assert _read_bin(str(tmp_path / "o1"), "val", np.uint16) == [tok.eos_id]
    with pytest.raises(corpus.DataError, match="val_fraction"):
        prepare.prepare("stdlib", tok, str(tmp_path / "o3"), val_fraction=1)
    # no validation asked: an empty val.bin
    meta = prepare.prepare(_folder(tmp_path), tok, str(tmp_path / "o4"), val_fraction=0, val_tokens=0, verbose=False)
    assert meta["n_val"] == 0 == os.path.getsize(tmp_path / "o4" / "val.bin") and meta["n_train_docs"] == 8


def test_prepare_stdlib_max_docs(tmp_path):
    tok = tokenizer.get_tokenizer("cl100k_base", 8192)
    meta = prepare.prepare("stdlib", tok, str(tmp_path / "std"), max_docs=50, val_fraction=0.1, verbose=False)
    docs = list(itertools.islice(corpus.iter_documents("stdlib"), 50))
    want, mode, n_docs = _reference_split([tok.encode(d) + [tok.eos_id] for d in docs], 0.1, 0.1)
    assert (meta["n_train_docs"], meta["n_val_docs"], meta["val_split"], meta["n_docs"]) == (*n_docs, mode, 50)
    assert _read_bin(str(tmp_path / "std"), "val", np.uint16) == want["val"]
    assert _read_bin(str(tmp_path / "std"), "train", np.uint16) == want["train"]


def test_default_data_dir():
    a = prepare.default_data_dir("stdlib", "cl100k_base", 8192)
    assert a.startswith(os.path.join("data", "stdlib-cl100k_base-8192-"))
    others = {prepare.default_data_dir("stdlib", "cl100k_base", 4096), prepare.default_data_dir("stdlib", "o200k_base"),
              prepare.default_data_dir("/x/corpus.jsonl", "cl100k_base", 8192),
              prepare.default_data_dir("/y/corpus.jsonl", "cl100k_base", 8192),
              prepare.default_data_dir("hf:org/set:cfg@train", "cl100k_base", 8192)}
    assert len(others) == 5 and a not in others
    assert "corpus.jsonl" in prepare.default_data_dir("/x/corpus.jsonl", "gpt2", root="r")
    assert prepare.default_data_dir("stdlib", "cl100k_base", 8192) == a  # stable


# ----------------------------------------------------------------------------- loader

def _token_file(tmp_path, n, dtype=np.uint16, offset=0):
    """Token i = offset + i: every token tells where it came from."""
    d = tmp_path / f"tok{n}_{np.dtype(dtype).name}"
    d.mkdir()
    (np.arange(n, dtype=np.int64) + offset).astype(dtype).tofile(d / "train.bin")
    (d / "meta.json").write_text(json.dumps({"dtype": np.dtype(dtype).name}))
    return str(d / "train.bin")


def test_loader_windows_and_shift(tmp_path):
    T, B = 8, 3
    L = data.Loader(_token_file(tmp_path, 1001), B=B, T=T)
    assert L.n_windows == 125  # (1001 - 1) // 8
    x, y = L.next()
    assert x.shape == y.shape == (B, T) and x.dtype == y.dtype == torch.int64
    assert torch.equal(y, x + 1)  # y is x shifted by one token
    assert torch.equal(x[:, 0] % T, torch.zeros(B, dtype=torch.int64))  # windows start at multiples of T
    assert torch.equal(x, x[:, :1] + torch.arange(T))


def test_loader_uint32_dtype_from_meta(tmp_path):
    L = data.Loader(_token_file(tmp_path, 200, np.uint32, offset=100_000), B=2, T=4)
    x, y = L.next()
    assert x.min() >= 100_000 and torch.equal(y, x + 1)


def test_loader_ranks_disjoint_union_is_one_process(tmp_path):
    path, T, B, steps = _token_file(tmp_path, 8 * 50 + 1), 8, 3, 20  # 50 windows, 8 global batches/epoch
    ranks = [data.Loader(path, B=B, T=T, rank=r, world=2, seed=7) for r in range(2)]
    one = data.Loader(path, B=2 * B, T=T, seed=7)
    starts = []
    for step in range(steps):  # crosses two epoch boundaries
        (x0, y0), (x1, y1), (x, y) = ranks[0].next(), ranks[1].next(), one.next()
        assert torch.equal(torch.cat([x0, x1]), x) and torch.equal(torch.cat([y0, y1]), y)
        assert not set(x0[:, 0].tolist()) & set(x1[:, 0].tolist())
        starts.append(x[:, 0].tolist())
    # each epoch visits distinct windows: 8 batches x 6 windows of the 50, tail of 2 skipped
    epoch0 = [s for b in starts[:8] for s in b]
    epoch1 = [s for b in starts[8:16] for s in b]
    assert len(set(epoch0)) == len(set(epoch1)) == 48 and epoch0 != epoch1
    assert one.state_dict()["epoch"] == 2 and ranks[0].state_dict() == {**one.state_dict(), "B": B, "world": 2}


def test_loader_resume(tmp_path):
    path, T = _token_file(tmp_path, 8 * 20 + 1), 8  # 20 windows, 5 batches of 4 per epoch
    L = data.Loader(path, B=2, T=T, rank=1, world=2, seed=3)
    for _ in range(4):
        L.next()
    state = json.loads(json.dumps(L.state_dict()))  # survives a checkpoint round trip
    expected = [L.next() for _ in range(7)]  # crosses an epoch boundary
    R = data.Loader(path, B=2, T=T, rank=1, world=2, seed=999)
    R.load_state_dict(state)
    for xe, ye in expected:
        x, y = R.next()
        assert torch.equal(x, xe) and torch.equal(y, ye)
    # a new layout with the same global batch continues the same global stream
    ranks = [data.Loader(path, B=2, T=T, rank=r, world=2, seed=3) for r in range(2)]
    for r in ranks:
        for _ in range(4):
            r.next()
    one = data.Loader(path, B=4, T=T)
    one.load_state_dict(ranks[0].state_dict())
    for _ in range(5):
        assert torch.equal(one.next()[0], torch.cat([ranks[0].next()[0], ranks[1].next()[0]]))
    with pytest.raises(ValueError, match="T=8"):
        data.Loader(path, B=2, T=4).load_state_dict(state)


def test_loader_too_short(tmp_path):
    path = _token_file(tmp_path, 64)  # 7 windows of T=9
    with pytest.raises(ValueError, match=r"needs 8 \(B\*world\).*at least 73 tokens"):
        data.Loader(path, B=4, T=9, world=2)
    data.Loader(path, B=7, T=9)  # exactly enough
    with pytest.raises(ValueError, match="rank"):
        data.Loader(path, B=1, T=9, rank=2, world=2)
    with pytest.raises(corpus.DataError, match="meta.json"):
        data.Loader(str(tmp_path / "train.bin"), B=1, T=1)


def test_eval_batches_deterministic(tmp_path):
    path, T, B = _token_file(tmp_path, 8 * 30 + 1), 8, 2  # 30 windows
    per_rank = [list(data.eval_batches(path, B, T, rank=r, world=2, n_batches=100)) for r in range(2)]
    one = list(data.eval_batches(path, 2 * B, T))
    assert len(one) == len(per_rank[0]) == len(per_rank[1]) == 7  # 30 // 4 full global batches
    for j, (x, y) in enumerate(one):
        assert torch.equal(x[:, 0], torch.arange(4 * j, 4 * j + 4) * T)  # windows in order
        assert torch.equal(torch.cat([per_rank[0][j][0], per_rank[1][j][0]]), x) and torch.equal(y, x + 1)
    again = list(data.eval_batches(path, B, T, rank=1, world=2, n_batches=3))
    assert len(again) == 3 and all(torch.equal(a[0], b[0]) for a, b in zip(again, per_rank[1]))


def test_loader_on_prepared_data(tmp_path):
    tok = tokenizer.get_tokenizer("cl100k_base", 4096)
    out = str(tmp_path / "out")
    meta = prepare.prepare(_folder(tmp_path), tok, out, val_fraction=0.25, verbose=False)
    stream = np.fromfile(os.path.join(out, "train.bin"), dtype=np.uint16).astype(np.int64)
    L = data.Loader(os.path.join(out, "train.bin"), B=2, T=4, seed=1)
    assert L.n_windows == (meta["n_train"] - 1) // 4
    for _ in range(5):
        x, y = L.next()
        for row_x, row_y in zip(x.numpy(), y.numpy()):
            s = np.flatnonzero(np.all(np.lib.stride_tricks.sliding_window_view(stream, 5) ==
                                      np.append(row_x, row_y[-1]), axis=1))
            assert len(s) and s[0] % 4 == 0
    x, y = next(data.eval_batches(os.path.join(out, "val.bin"), 1, 3))
    val = np.fromfile(os.path.join(out, "val.bin"), dtype=np.uint16).astype(np.int64)
    assert x[0].tolist() == val[:3].tolist() and y[0].tolist() == val[1:4].tolist()


# ----------------------------------------------------------------------------- issue 13: intake, splits, checks

def test_val_split_by_hand():
    """Worked by hand: ten documents of 10 tokens. A document goes to val when val holds less than
    the share of the tokens before it; too coarse documents fall back to the last `target` tokens."""
    ten = [10] * 10
    assert prepare.val_split(ten, 0.2, val_tokens=0) == ([(10, 20), (60, 70)], "documents")  # 0 < 2, 10 < 12
    # the floor raises the share to 30%: 0 < 3, 10 < 12, 20 < 21
    assert prepare.val_split(ten, 0.01, val_tokens=30, max_val_share=0.5) == ([(10, 20), (40, 50), (70, 80)],
                                                                            "documents")
    # ... but never past max_val_share (10% here), and val_fraction itself is the user's choice
    assert prepare.val_split(ten, 0.01, val_tokens=1000, max_val_share=0.1) == ([(10, 20)], "documents")
    assert prepare.val_split(ten, 0.3, val_tokens=0, max_val_share=0.1)[0] == [(10, 20), (40, 50), (70, 80)]
    # two documents: whole ones would put 50% into val, so the last 10% of the tokens (a cut document)
    assert prepare.val_split([50, 50], 0.01, val_tokens=1000, max_val_share=0.1) == ([(90, 100)], "tokens")
    assert prepare.val_split([100], 0.01, val_tokens=1000, max_val_share=0.1) == ([(90, 100)], "tokens")
    assert prepare.val_split([1, 1, 1, 97], 0.25, val_tokens=0) == ([(75, 100)], "tokens")  # 1 of 25 by documents
    assert prepare.val_split([10, 10, 30, 10, 10, 30], 0.2, val_tokens=0) == ([(10, 20), (60, 70)], "documents")
    assert prepare.val_split(ten, 0.0, val_tokens=0) == ([], "documents")  # no validation asked


def test_single_text_file_is_a_corpus(tmp_path, capsys):
    """Finding: a single text file was refused ("need at least 2 documents")."""
    tok = tokenizer.get_tokenizer("cl100k_base", 4096)
    text = "".join(f"line {i}: the quick brown fox jumps over the lazy dog\n" for i in range(300))
    meta = prepare.prepare(_write(tmp_path / "book.txt", text), tok, str(tmp_path / "out"), verbose=True)
    stream = tok.encode(text) + [tok.eos_id]
    cut = len(stream) - round(0.1 * len(stream))  # no document structure: the last 10% by tokens
    assert _read_bin(str(tmp_path / "out"), "train", np.uint16) == stream[:cut]
    assert _read_bin(str(tmp_path / "out"), "val", np.uint16) == stream[cut:]
    assert (meta["n_docs"], meta["n_train_docs"], meta["n_val_docs"], meta["val_split"]) == (1, 1, 1, "tokens")
    assert "1 documents -> " in capsys.readouterr().out
    # documents inside one .txt file: separated by '<|endoftext|>' or form feeds
    sep = _write(tmp_path / "stories.txt", "one upon a time<|endoftext|>two\n\fthree\n<|endoftext|>\nfour\n")
    assert list(corpus.iter_documents(sep)) == ["one upon a time", "two\n", "three\n", "four\n"]


def test_two_document_corpus_val_share(tmp_path):
    """Finding: a 2-document corpus put 50% of its tokens into validation."""
    tok = tokenizer.get_tokenizer("cl100k_base", 4096)
    docs = ["def f(x):\n    return x * 2\n" * 20, "class A:\n    pass\n" * 30]
    meta = prepare.prepare(_folder(tmp_path, docs), tok, str(tmp_path / "out"), verbose=False)
    total = meta["n_train"] + meta["n_val"]
    assert total == sum(len(tok.encode(d)) + 1 for d in docs)
    assert meta["n_val"] == round(0.1 * total) and meta["val_split"] == "tokens"  # max_val_share=0.1


def test_val_tokens_floor(tmp_path):
    """val_fraction=0.01 of 150 documents is under two documents; the floor of 200 tokens gives
    validation about that many (whole documents, within 10%), and meta.json says so."""
    tok = tokenizer.get_tokenizer("cl100k_base", 4096)
    docs = [f"document {i}: " + "word " * (5 + i % 7) for i in range(150)]
    meta = prepare.prepare(_folder(tmp_path, docs), tok, str(tmp_path / "out"), val_tokens=200, verbose=False)
    total = meta["n_train"] + meta["n_val"]
    assert 180 <= meta["n_val"] <= 200 < 0.1 * total and meta["val_split"] == "documents"
    assert meta["val_tokens"] == 200 and json.load(open(tmp_path / "out" / "meta.json"))["n_val"] == meta["n_val"]


def test_binary_and_undecodable_files_skipped_and_counted(tmp_path, capsys):
    """Findings: random binary files named .txt were trained on; invalid UTF-8 was replaced silently."""
    root = tmp_path / "corpus"
    _write(root / "a.txt", "good text")
    (root / "b.txt").write_bytes(bytes(np.random.default_rng(0).integers(0, 256, 4000, dtype=np.uint8)))
    (root / "c.md").write_bytes("caf\u00e9 cr\u00e8me ".encode("latin-1") * 50)  # 2 of 12 bytes invalid
    (root / "d.py").write_bytes(b"x = 1  # one bad byte \xff here\n" + b"y = 2\n" * 20)
    tok = tokenizer.get_tokenizer("cl100k_base", 4096)
    meta = prepare.prepare(str(root), tok, str(tmp_path / "out"), verbose=True)
    out = capsys.readouterr().out
    assert meta["intake"] == dict(files=4, binary=1, undecodable=1, replaced=1, unsupported=0, duplicates=0, capped=0)
    assert meta["n_docs"] == 2 and "d.py" in out
    assert f"skipped 1 binary / 1 undecodable files (NUL bytes / over 10% invalid UTF-8): {root / 'b.txt'}" in out
    assert "1 files with a few invalid UTF-8 bytes were read with U+FFFD" in out and out.count("skipped") == 1
    docs = list(corpus.iter_documents(str(root)))
    assert docs == ["good text", "x = 1  # one bad byte \ufffd here\n" + "y = 2\n" * 20]
    only_binary = tmp_path / "bin"
    (only_binary / "x.txt").parent.mkdir()
    (only_binary / "x.txt").write_bytes(b"\x00\x01\x02" * 10)
    with pytest.raises(corpus.DataError, match=r"is empty.*skipped 1 binary / 0 undecodable.*x\.txt"):
        list(corpus.iter_documents(str(only_binary)))


def test_unsupported_files_named(tmp_path, capsys):
    """Finding: a folder of unsupported files was reported as "empty"; ignored files were not named."""
    root = tmp_path / "corpus"
    _write(root / "a.txt", "text")
    for name in ("b.csv", "sub/c.csv", "d.xlsx", ".hidden", ".git/config"):
        _write(root / name, "x,y")
    prepare.prepare(str(root), tokenizer.get_tokenizer("cl100k_base", 4096), str(tmp_path / "out"), verbose=True)
    assert "3 files with unsupported extensions .csv .xlsx were ignored: b.csv, d.xlsx, sub/c.csv" in capsys.readouterr().out
    only = tmp_path / "sheets"
    for name in ("b.csv", "d.xlsx"):
        _write(only / name, "x,y")
    with pytest.raises(corpus.DataError, match=r"holds no .txt/.md/.py/.jsonl/.parquet file, only 2 files with "
                                             r"unsupported extensions .csv .xlsx \(b.csv, d.xlsx\)"):
        corpus.iter_documents(str(only))  # at once, not "empty"


def test_malformed_jsonl_line_named(tmp_path):
    """Finding: a malformed .jsonl line gave ~60 lines of pandas/pyarrow tracebacks."""
    path = _write(tmp_path / "bad.jsonl", '{"text": "a"}\n\n{"text": "b"}\n{"text": "c"\n{"text": "d"}\n')
    with pytest.raises(corpus.DataError) as e:
        list(corpus.iter_documents(path))
    msg = str(e.value)
    assert msg.startswith(f"{path}:4: not valid JSON") and "\n" not in msg and len(msg) < 300
    for line, match in [('["a list"]', "bad2.jsonl:1: no field 'text' \\(a JSON list"),
                        ('{"text": 3}', "bad2.jsonl:1: field 'text' holds a int, not text")]:
        with pytest.raises(corpus.DataError, match=match):
            list(corpus.iter_documents(_write(tmp_path / "bad2.jsonl", line + "\n")))
    assert list(corpus.iter_documents(_write(tmp_path / "ok.jsonl", '{"text": null}\n{"text": "x"}\n'))) == ["x"]


def test_corrupt_parquet_named(tmp_path):
    path = tmp_path / "broken.parquet"
    path.write_bytes(b"PAR1 this is not a parquet file PAR1")
    with pytest.raises(corpus.DataError, match=r"broken\.parquet: cannot read it as parquet \("):
        list(corpus.iter_documents(str(path)))


@pytest.mark.parametrize("call, match", [
    (lambda p, tok, out: prepare.prepare(p, tok, out, max_docs=-1), "max_docs=-1"),
    (lambda p, tok, out: prepare.prepare(p, tok, out, val_tokens=-5), "val_tokens=-5"),
    (lambda p, tok, out: prepare.prepare(p, tok, out, val_fraction=-0.1), "val_fraction=-0.1"),
    (lambda p, tok, out: prepare.prepare(p, tok, out, max_val_share=1.5), "max_val_share=1.5"),
])
def test_bad_prepare_settings_fail_at_once(tmp_path, monkeypatch, call, match):
    """Finding: --max_docs=-1 failed late with an itertools/numpy error."""
    monkeypatch.setattr(corpus, "iter_documents", lambda *a, **k: pytest.fail("read the corpus first"))
    with pytest.raises(corpus.DataError, match=match):
        call(_folder(tmp_path), tokenizer.get_tokenizer("cl100k_base", 4096), str(tmp_path / "out"))


def test_bad_loader_settings_fail_at_once(tmp_path):
    """Finding: --seed=-1 failed late, at the first batch, with a numpy error."""
    path = _token_file(tmp_path, 1000)
    with pytest.raises(corpus.DataError, match="seed=-1 must be an integer >= 0"):
        data.Loader(path, B=2, T=8, seed=-1)
    with pytest.raises(corpus.DataError, match="B=0"):
        data.Loader(path, B=0, T=8)
    with pytest.raises(corpus.DataError, match="eval_batches=-1"):
        data.eval_batches(path, 2, 8, n_batches=-1)


def test_train_split_too_small(tmp_path):
    """check_split: train.bin must fill one global batch; the message says what to change."""
    path = _token_file(tmp_path, 8 * 10 + 1)  # 10 windows of T=8
    assert data.check_split(path, 8, 10, "train split") == 10
    with pytest.raises(corpus.DataError, match=r"train split: 81 tokens make 10 windows of T=8, but one global "
                                             r"batch needs 16 .*at least 129 tokens.*micro_batch_size.*seq_len.*more data"):
        data.check_split(path, 8, 16, "train split")


def test_small_validation_split_shrinks_evaluation(tmp_path):
    """Finding: val.bin with 18 windows of T=1024 crashed the first evaluation of a run with global
    batch 64 ("one global batch needs 64"). The plan now shrinks to what the split holds and says so;
    only no window per rank is refused. The same shape at T=8: 18 windows, B=32, 2 ranks."""
    path = _token_file(tmp_path, 8 * 18 + 5)
    n, msg = data.eval_plan(path, B=32, T=8, world=2, eval_batches=20)
    assert n == 1 and "149 tokens = 18 windows of T=8" in msg and "1 batch(es) of 9 sequence(s) per rank instead of 20 x 32" in msg
    per_rank = [list(data.eval_batches(path, 32, 8, rank=r, world=2, n_batches=20)) for r in range(2)]
    assert [len(b) for b in per_rank] == [1, 1]
    x = torch.cat([per_rank[0][0][0], per_rank[1][0][0]])
    assert torch.equal(x[:, 0], torch.arange(18) * 8)  # all 18 windows, in order, 9 per rank
    # fewer batches, full size: 18 windows of B=2 x 2 ranks -> 4 of the 20 asked
    assert data.eval_plan(path, B=2, T=8, world=2, eval_batches=20)[0] == 4
    assert len(list(data.eval_batches(path, 2, 8, rank=1, world=2, n_batches=20))) == 4
    assert data.eval_plan(path, B=2, T=8, world=2, eval_batches=3) == (3, None)  # enough: no message
    assert data.eval_plan(path, B=2, T=8, world=2, eval_batches=0) == (4, None)  # 0: all of it
    with pytest.raises(corpus.DataError, match=r"18 windows of T=8, fewer than one per data-parallel rank \(19\).*val_tokens"):
        data.eval_plan(path, B=1, T=8, world=19, eval_batches=1)
    with pytest.raises(corpus.DataError, match="fewer than one per data-parallel rank"):
        data.eval_batches(path, 1, 200, world=1)  # 149 tokens: no window of T=200


def test_pieces_encode_like_the_whole():
    """Long documents are tokenized in parts cut after a newline; the ids equal the whole text's."""
    text = ("x = f(a)\n//comment\n  indented\n\n\nword's\r\nlast)\n/path\n" + "日本語 🙂\n" * 3 + "tail") * 40
    text += "".join(open(os.path.join(corpus.python_roots(False)[0], m), encoding="utf-8").read()
                    for m in ("functools.py", "textwrap.py"))
    for name in ("cl100k_base", "o200k_base"):
        tok = tokenizer.get_tokenizer(name)
        parts = prepare._pieces(text, size=37)
        assert len(parts) > 100 and "".join(parts) == text
        assert [t for p in parts for t in tok.encode(p)] == tok.encode(text)


def _site(tmp_path):
    """A fake site-packages: 'big' 6 files of 1000 bytes, 'mid' 2 x 1000, ten small one-file
    packages of 500 bytes, one file duplicated in another package."""
    site = tmp_path / "site-packages"
    body = lambda tag, n: (f"# {tag}\n" + "x" * n)[:n]
    for i in range(6):
        _write(site / "big" / f"m{i}.py", body(f"big {i}", 1000))
    for i in range(2):
        _write(site / "mid" / "sub" / f"m{i}.py", body(f"mid {i}", 1000))
    for i in range(10):
        _write(site / f"small{i}.py", body(f"small {i}", 500))
    _write(site / "copy" / "__init__.py", body("big 3", 1000))  # same content as big/m3.py
    _write(site / "empty" / "__init__.py", "")
    _write(site / "__pycache__" / "c.py", "cached")
    _write(site / "notes.txt", "not python")
    return str(site)


def test_python_files_dedup_shuffle_cap(tmp_path):
    site = _site(tmp_path)
    files = corpus.python_files([site], seed=0)
    rel = [os.path.relpath(f, site) for f in files]
    assert len(files) == 6 + 2 + 10 and files == corpus.python_files([site], seed=0)  # deterministic
    assert rel != sorted(rel) and corpus.python_files([site], seed=1) != files  # not alphabetical; seeded
    assert ("big/m3.py" in rel) != ("copy/__init__.py" in rel)  # one of the two equal files
    assert len({open(f).read() for f in files}) == len(files)
    report = corpus.Intake()
    corpus.python_files([site], seed=0, report=report)
    assert report.duplicates == 1
    # cap by hand: sizes {big 6000 (or 5000 + copy 1000), mid 2000, 10 x 500}; share 0.25:
    # c <= 0.25 * (5000 + c + c) -> c <= 2500 with big and mid cut (2000 < 2500: mid is not cut)
    # c <= 0.25 * (5000 + 2000 + c) -> c = 7000 / 3 = 2333
    sizes = [6000, 2000] + [500] * 10 if "big/m3.py" in rel else [5000, 1000, 2000] + [500] * 10
    cap = corpus.package_cap(sizes, 0.25)
    assert cap == (2333 if sizes[0] == 6000 else int(0.25 * 8000 / 0.75))
    report = corpus.Intake()
    capped = corpus.python_files([site], seed=0, max_package_share=0.25, report=report)
    big = [f for f in capped if os.sep + "big" + os.sep in f]
    assert len(big) == 2 and big == [f for f in files if f in big]  # the first two big files in order
    assert report.capped == {"big": len([f for f in files if os.sep + "big" + os.sep in f]) - 2}
    total = sum(os.path.getsize(f) for f in capped)
    assert 2000 / total <= 0.25 and len(capped) == len(files) - report.capped["big"]
    assert corpus.package_cap([100, 100, 100], 0.25) is None  # three packages cannot be held to 25% each
    assert corpus.package_cap([10, 10, 10, 10, 100], 0.25) == 13  # 13 <= 0.25 * (40 + 13)


def test_python_corpus_source(tmp_path, monkeypatch):
    """data="python" reads stdlib + site-packages through python_files; its fingerprint changes when
    a file is added, so the prepared memmaps are rebuilt."""
    site = _site(tmp_path)
    monkeypatch.setattr(corpus, "python_roots", lambda site_packages=True: [site] if site_packages else [])
    monkeypatch.setitem(corpus.PYTHON_CORPORA, "python", (True, 0.25))
    docs = list(corpus.iter_documents("python"))
    assert docs == [open(f).read() for f in corpus.python_files([site], max_package_share=0.25)]
    tok = tokenizer.get_tokenizer("cl100k_base", 4096)
    out = prepare.default_data_dir("python", tok.name, 4096, root=str(tmp_path / "d"))
    assert os.path.basename(out).startswith("python-cl100k_base-4096-")
    meta = prepare.prepare("python", tok, out, verbose=False)
    assert meta["n_docs"] == len(docs) and meta["intake"]["duplicates"] == 1 and meta["intake"]["capped"] == 4
    _write(tmp_path / "site-packages" / "new.py", "def new(): pass\n")
    assert prepare.prepare("python", tok, out, verbose=False)["n_docs"] == len(docs) + 1


def test_json_records(tmp_path):
    """corpus.json_records (chat data and eval tasks in .json files): a list of records is returned as
    is; a file that is not JSON names its line, one that holds no list says what to use."""
    good, broken, single = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "c.json"
    good.write_text(json.dumps([{"x": 1}, {"x": 2}]))
    broken.write_text('[{"x": 1},\n{oops}]')
    single.write_text(json.dumps({"x": 1}))
    assert corpus.json_records(str(good)) == [{"x": 1}, {"x": 2}]
    with pytest.raises(corpus.DataError, match=r"b.json:2: not valid JSON"):
        corpus.json_records(str(broken))
    with pytest.raises(corpus.DataError, match=r"c.json: a .json file of task records must hold a list of records, "
                                               r"not a dict \(one record per line: use .jsonl\)"):
        corpus.json_records(str(single), "task records")
