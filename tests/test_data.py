"""data.py, pretraining part: what these tests prove.

Tokenizer: the bundled cl100k_base/o200k_base build exactly tiktoken's own Encoding
(tiktoken.load.load_tiktoken_bpe + the constructor in tiktoken_ext.openai_public, fed the same
file), give tiktoken's published ids, round-trip arbitrary text, refuse a corrupt file, and a
truncated vocab is a complete BPE with EOS at vocab-1. Unknown encodings fail with a clear
message and no network.
Corpora: every source kind yields exactly the expected documents; the hub path is the same
`datasets` streaming path as local jsonl/parquet; bad sources fail with clear messages.
prepare: train.bin/val.bin hold exactly encode(doc) + [eos] per document of each split, in order,
with the right dtype; a finished preparation is reused; an interrupted one is never mistaken for
finished.
Loader: two ranks get disjoint batches whose union is exactly one process with B*2, y is x shifted,
each epoch visits every window once, a saved state resumes the identical stream, eval batches are
deterministic, too-short data fails clearly.
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
import data  # noqa: E402

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
    code = "import sys, data; assert 'datasets' not in sys.modules, 'datasets imported at import time'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=os.path.dirname(data.__file__))


# ----------------------------------------------------------------------------- tokenizer

def test_cl100k_published_ids():
    tok = data.get_tokenizer("cl100k_base")
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
    plain.write_bytes(gzip.decompress(open(data._bundled_path(name), "rb").read()))
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", "")  # no caching of the local file
    monkeypatch.setattr(openai_public, "load_tiktoken_bpe",
                        lambda url, expected_hash: tiktoken.load.load_tiktoken_bpe(str(plain), expected_hash))
    ref = tiktoken.Encoding(**getattr(openai_public, name)())
    ours = data.get_tokenizer(name)
    assert ours.enc._pat_str == ref._pat_str
    assert ours.enc._special_tokens == ref._special_tokens
    assert ours.enc._mergeable_ranks == ref._mergeable_ranks
    assert ours.n_vocab == ref.n_vocab and ours.eos_id == ref.eot_token
    for text in TEXTS:
        assert ours.encode(text) == ref.encode_ordinary(text)
        assert ours.decode(ours.encode(text)) == text
    assert ours.eos_id not in ours.encode("a<|endoftext|>b")  # special tokens in text are just text


def test_corrupt_bpe_file_raises(tmp_path, monkeypatch):
    raw = gzip.decompress(open(data._bundled_path("cl100k_base"), "rb").read())
    bad = tmp_path / "cl100k_base.tiktoken.gz"
    bad.write_bytes(gzip.compress(raw.replace(b" 100\n", b" 101\n", 1)))
    with pytest.raises(ValueError, match="sha256"):
        data.load_bpe_ranks(str(bad), data.BUNDLED["cl100k_base"][0])
    monkeypatch.setattr(data, "_bundled_path", lambda name: str(bad))
    data._encoding.cache_clear()
    try:
        with pytest.raises(ValueError, match="sha256.*corrupt"):
            data.get_tokenizer("cl100k_base")
    finally:
        data._encoding.cache_clear()


def test_truncated_vocab():
    tok = data.get_tokenizer("cl100k_base", 4096)
    full = data.get_tokenizer("cl100k_base")
    assert tok.n_vocab == 4096 and tok.eos_id == 4095
    for text in TEXTS + ["".join(chr(c) for c in range(32, 2000)), "\x00\x01\xff"]:
        ids = tok.encode(text)
        assert all(0 <= i < 4095 for i in ids)  # EOS never comes out of ordinary text
        assert tok.decode(ids) == text
        assert len(ids) >= len(full.encode(text))  # fewer merges, never shorter
    # the first 256 ranks are the single bytes, so tokens below the cut are identical tokens
    assert all(tok.enc.decode_single_token_bytes(i) == full.enc.decode_single_token_bytes(i) for i in range(4095))
    with pytest.raises(ValueError, match="257"):
        data.get_tokenizer("cl100k_base", 200)
    # a BPE whose single bytes are not all among the first ranks cannot be cut there
    ranks = {bytes([b]): b for b in range(255)} | {b"ab": 255, b"\xff": 256, b"abc": 257}
    with pytest.raises(ValueError, match="single bytes"):
        data.truncate_ranks(ranks, 257)
    assert len(data.truncate_ranks(ranks, 258)) == 257


def test_unknown_encoding_offline_error(tmp_path, monkeypatch):
    import tiktoken.load

    def no_network(url):
        raise ConnectionError(f"network disabled in this test: {url}")
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path))  # empty cache
    monkeypatch.setattr(tiktoken.load, "read_file", no_network)
    for name in ("r50k_base", "gpt2"):
        with pytest.raises(ValueError, match=r"(?s)not available.*network disabled.*cl100k_base.*o200k_base"
                                             r".*TIKTOKEN_CACHE_DIR"):
            data.get_tokenizer(name)
    with pytest.raises(ValueError, match="not available"):
        data.get_tokenizer("no_such_encoding")


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
    assert list(data.iter_documents(_write(tmp_path / "a.txt", text))) == [text]
    rows = [{"content": "first", "id": 1}, {"content": "", "id": 2}, {"content": "  \n", "id": 3},
            {"content": "second ünï", "id": 4}]
    jl = _jsonl(tmp_path / "d.jsonl", rows)
    assert list(data.iter_documents(jl, text_field="content")) == ["first", "second ünï"]  # blanks skipped
    with pytest.raises(KeyError, match="no field 'text'"):
        list(data.iter_documents(jl))
    pq.write_table(pa.table({"text": ["p0", "p1", "p2"]}), tmp_path / "p.parquet")
    assert list(data.iter_documents(str(tmp_path / "p.parquet"))) == ["p0", "p1", "p2"]

    root = tmp_path / "folder"
    _write(root / "b" / "z.md", "markdown")
    _write(root / "a.py", "print(1)\n")
    _jsonl(root / "b" / "c.jsonl", [{"text": "j0"}, {"text": "j1"}])
    _write(root / "ignored.csv", "x,y")
    _write(root / "c" / "empty.txt", "")
    assert list(data.iter_documents(str(root))) == ["print(1)\n", "j0", "j1", "markdown"]  # sorted paths


def test_corpus_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"no/such/dir.*not found.*stdlib.*hf:.*jsonl"):
        data.iter_documents(str(tmp_path / "no/such/dir"))  # raised at call time, not lazily
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="corpus .*empty.* is empty"):
        list(data.iter_documents(str(tmp_path / "empty")))
    with pytest.raises(ValueError, match="is empty"):
        list(data.iter_documents(_write(tmp_path / "blank.txt", " \n\n ")))
    with pytest.raises(ValueError, match="unsupported"):
        data.iter_documents(_write(tmp_path / "x.csv", "a,b"))
    with pytest.raises(ValueError, match="hf:<name>"):
        data.iter_documents("hf:")


def test_hub_source_uses_streaming_datasets(monkeypatch):
    calls = []

    def load_dataset(*args, **kwargs):
        calls.append((args, kwargs))
        return iter([{"text": "row 0"}, {"text": ""}, {"text": "row 2"}])
    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    assert list(data.iter_documents("hf:org/name:cfg@validation")) == ["row 0", "row 2"]
    assert calls == [(("org/name", "cfg"), {"split": "validation", "streaming": True})]
    list(data.iter_documents("hf:org/name"))
    assert calls[-1] == (("org/name", None), {"split": "train", "streaming": True})


def test_stdlib_corpus():
    docs = list(itertools.islice(data.iter_documents("stdlib"), 150))
    assert len(docs) == 150 and all(isinstance(d, str) and d.strip() for d in docs)
    files = data._stdlib_files()
    assert len(files) > 100 and files == sorted(files)
    assert not any("site-packages" in f for f in files)
    assert any(f.endswith(os.sep + "functools.py") for f in files)


# ----------------------------------------------------------------------------- prepare

DOCS = ["doc zero: hello", "doc one\n", "def two():\n    pass\n", "three ünïcödé 🙂", "four 4444",
        "five <|endoftext|> as text", "six", "seven\t\tseven"]


def _folder(tmp_path, docs=DOCS):
    root = tmp_path / "corpus"
    for i, d in enumerate(docs):
        _write(root / f"{i:03d}.txt", d)
    return str(root)


def _read_bin(out_dir, split, dtype):
    return np.fromfile(os.path.join(out_dir, f"{split}.bin"), dtype=dtype).tolist()


@pytest.mark.parametrize("vocab, dtype", [(4096, np.uint16), (0, np.uint32)])
def test_prepare_tokens_exact(tmp_path, vocab, dtype):
    tok = data.get_tokenizer("cl100k_base", vocab)
    out = str(tmp_path / "out")
    meta = data.prepare(_folder(tmp_path), tok, out, val_fraction=1 / 3, verbose=False)
    want = {"train": [], "val": []}
    for i, d in enumerate(DOCS):  # independent reference: document i -> val when i % 3 == 0
        want["val" if i % 3 == 0 else "train"] += tok.encode(d) + [tok.eos_id]
    assert _read_bin(out, "train", dtype) == want["train"]
    assert _read_bin(out, "val", dtype) == want["val"]
    assert meta["dtype"] == np.dtype(dtype).name and meta["n_vocab"] == tok.n_vocab
    assert (meta["n_train"], meta["n_val"]) == (len(want["train"]), len(want["val"]))
    assert (meta["n_train_docs"], meta["n_val_docs"]) == (5, 3) and meta["eos_id"] == tok.eos_id
    assert json.load(open(os.path.join(out, "meta.json"))) == meta
    assert sorted(os.listdir(out)) == ["meta.json", "train.bin", "val.bin"]  # no tmp files left


def test_prepare_reuse_and_rebuild(tmp_path, monkeypatch):
    tok = data.get_tokenizer("cl100k_base", 4096)
    src, out = _folder(tmp_path), str(tmp_path / "out")
    meta = data.prepare(src, tok, out, val_fraction=0.25, verbose=False)

    def fail(*a, **k):
        raise AssertionError("tokenized again")
    with monkeypatch.context() as m:
        m.setattr(tok, "encode_batch", fail)
        assert data.prepare(src, tok, out, val_fraction=0.25, verbose=False) == meta  # reused
    assert data.prepare(src, tok, out, val_fraction=0.5, verbose=False)["n_val_docs"] == 4  # new params
    _write(tmp_path / "corpus" / "008.txt", "an added document")  # corpus changed -> fingerprint changed
    meta = data.prepare(src, tok, out, val_fraction=0.5, verbose=False)
    assert (meta["n_train_docs"], meta["n_val_docs"]) == (4, 5)


def test_prepare_interrupted_is_not_reused(tmp_path, monkeypatch):
    tok = data.get_tokenizer("cl100k_base", 4096)
    src, out = _folder(tmp_path), str(tmp_path / "out")
    good = data.prepare(src, tok, out, val_fraction=0.25, verbose=False)
    real = data.iter_documents

    def dies_midway(*a, **k):
        yield from itertools.islice(real(*a, **k), 3)
        raise RuntimeError("killed mid-way")
    monkeypatch.setattr(data, "iter_documents", dies_midway)
    with pytest.raises(RuntimeError, match="killed"):
        data.prepare(src, tok, out, val_fraction=0.5, verbose=False)
    assert not os.path.exists(os.path.join(out, "meta.json"))  # old meta must not describe new bins
    assert not [f for f in os.listdir(out) if ".tmp" in f]
    with pytest.raises(RuntimeError, match="killed"):  # and nothing is mistaken for finished data
        data.prepare(src, tok, out, val_fraction=0.25, verbose=False)
    monkeypatch.setattr(data, "iter_documents", real)
    assert data.prepare(src, tok, out, val_fraction=0.25, verbose=False) == good
    assert _read_bin(out, "train", np.uint16)[-1] == tok.eos_id


def test_prepare_split_edge_cases(tmp_path):
    tok = data.get_tokenizer("cl100k_base", 4096)
    with pytest.raises(ValueError, match="need at least 2"):
        data.prepare(_folder(tmp_path / "one", ["only doc"]), tok, str(tmp_path / "o1"), verbose=False)
    meta = data.prepare(_folder(tmp_path / "two", ["a doc", "b doc"]), tok, str(tmp_path / "o2"), verbose=False)
    assert (meta["n_val_docs"], meta["n_train_docs"]) == (1, 1)
    with pytest.raises(ValueError, match="val_fraction"):
        data.prepare("stdlib", tok, str(tmp_path / "o3"), val_fraction=0)


def test_prepare_stdlib_max_docs(tmp_path):
    tok = data.get_tokenizer("cl100k_base", 8192)
    meta = data.prepare("stdlib", tok, str(tmp_path / "std"), max_docs=50, val_fraction=0.1, verbose=False)
    docs = list(itertools.islice(data.iter_documents("stdlib"), 50))
    assert meta["n_train_docs"] + meta["n_val_docs"] == 50 and meta["n_val_docs"] == 5
    val = [t for i, d in enumerate(docs) if i % 10 == 0 for t in tok.encode(d) + [tok.eos_id]]
    assert _read_bin(str(tmp_path / "std"), "val", np.uint16) == val


def test_default_data_dir():
    a = data.default_data_dir("stdlib", "cl100k_base", 8192)
    assert a.startswith(os.path.join("data", "stdlib-cl100k_base-8192-"))
    others = {data.default_data_dir("stdlib", "cl100k_base", 4096), data.default_data_dir("stdlib", "o200k_base"),
              data.default_data_dir("/x/corpus.jsonl", "cl100k_base", 8192),
              data.default_data_dir("/y/corpus.jsonl", "cl100k_base", 8192),
              data.default_data_dir("hf:org/set:cfg@train", "cl100k_base", 8192)}
    assert len(others) == 5 and a not in others
    assert "corpus.jsonl" in data.default_data_dir("/x/corpus.jsonl", "gpt2", root="r")
    assert data.default_data_dir("stdlib", "cl100k_base", 8192) == a  # stable


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
    with pytest.raises(FileNotFoundError, match="meta.json"):
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
    with pytest.raises(ValueError, match="tokens"):
        data.eval_batches(path, 16, T, world=2)


def test_loader_on_prepared_data(tmp_path):
    tok = data.get_tokenizer("cl100k_base", 4096)
    out = str(tmp_path / "out")
    meta = data.prepare(_folder(tmp_path), tok, out, val_fraction=0.25, verbose=False)
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
