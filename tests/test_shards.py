"""shards.py: the shards joined are exactly prepare.prepare's train.bin for the same corpus and tokenizer
(no validation), each full shard holds shard_tokens tokens, and the .idx files hold the document starts
that an independent per-document encode gives; 2 tokenizing processes write the same bytes as 1; an
interrupted preparation resumes at the document and offset where its last listed shard ended (the
finished shards' files untouched, only the rest tokenized) and ends with the same shards as an
uninterrupted run; a truncated or altered shard is named by verify and by the resume, which redoes it;
validation documents (val_fraction) go to val.bin, which data.eval_batches reads; other settings in
the same folder are refused."""
import json
import os
import random

import numpy as np
import pytest

import data
import tokenizer
from corpora import corpus, prepare, shards

TOK = ("cl100k_base", 4096)


def make_corpus(root, n_files=24, seed=0):
    """A folder of .txt files (several documents each, split at form feeds) and .py files."""
    rng = random.Random(seed)
    words = "alpha beta gamma delta river stone market def return class import the of and 12 345 ( ) :".split()
    os.makedirs(root, exist_ok=True)
    for i in range(n_files):
        if i % 3 == 0:
            body = "\n".join(f"def f{i}_{j}(x):\n    return x * {j} + {rng.randint(0, 999)}" for j in range(rng.randint(2, 30)))
            name = f"m{i:02d}.py"
        else:
            body = "\f".join(" ".join(rng.choice(words) for _ in range(rng.randint(5, 200)))
                             for _ in range(rng.randint(1, 6)))
            name = f"t{i:02d}.txt"
        with open(os.path.join(root, name), "w") as f:
            f.write(body)
    return str(root)


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    return make_corpus(tmp_path_factory.mktemp("corpus") / "c")


def shard_hashes(out):
    return [(e["tokens"], e["sha256"], e["index_sha256"], e["end"]) for e in shards.read_manifest(out)["shards"]]


def test_tokens_equal_data_prepare(src, tmp_path):
    tok = tokenizer.get_tokenizer(*TOK)
    meta = prepare.prepare(src, tok, str(tmp_path / "mm"), val_fraction=0.0, val_tokens=0, verbose=False)
    ref = np.fromfile(tmp_path / "mm" / "train.bin", dtype=meta["dtype"])
    m = shards.prepare(src, str(tmp_path / "sh"), *TOK, shard_tokens=997, processes=1, verbose=False)
    got = shards.tokens(str(tmp_path / "sh"))
    assert m["complete"] and m["n_tokens"] == len(ref) == meta["n_train"] and m["n_docs"] == meta["n_docs"]
    assert got.dtype == ref.dtype and np.array_equal(got, ref)
    sizes = [e["tokens"] for e in m["shards"]]
    assert sizes[:-1] == [997] * (len(sizes) - 1) and 0 < sizes[-1] <= 997 and len(sizes) > 5
    # document starts: an independent encode of each document, + EOS
    lens = [len(tok.encode(d)) + 1 for d in corpus.iter_documents(src)]
    want = np.concatenate([[0], np.cumsum(lens)[:-1]])
    starts = np.concatenate([np.fromfile(tmp_path / "sh" / f"{e['name']}.idx", np.int64) + 997 * k
                             for k, e in enumerate(m["shards"])])
    assert np.array_equal(starts, want)
    assert all(ref[s - 1] == tok.eos_id for s in want[1:])


def test_parallel_equals_serial(src, tmp_path):
    shards.prepare(src, str(tmp_path / "a"), *TOK, shard_tokens=1500, processes=1, verbose=False)
    shards.prepare(src, str(tmp_path / "b"), *TOK, shard_tokens=1500, processes=2, chunk_chars=2000, verbose=False)
    assert shard_hashes(tmp_path / "a") == shard_hashes(tmp_path / "b")


def test_resume_redoes_nothing_finished(src, tmp_path, monkeypatch):
    ref_out, out = str(tmp_path / "ref"), str(tmp_path / "out")
    ref = shards.prepare(src, ref_out, *TOK, shard_tokens=800, processes=1, verbose=False)
    write = shards._write_manifest

    def crash_after_4(folder, m):
        write(folder, m)
        if len(m["shards"]) == 4 and not m["complete"]:
            raise KeyboardInterrupt  # killed after the 4th shard was listed
    monkeypatch.setattr(shards, "_write_manifest", crash_after_4)
    with pytest.raises(KeyboardInterrupt):
        shards.prepare(src, out, *TOK, shard_tokens=800, processes=1, chunk_chars=500, verbose=False)
    monkeypatch.setattr(shards, "_write_manifest", write)
    first = shards.read_manifest(out)
    assert len(first["shards"]) == 4 and not first["complete"]
    mtimes = [os.stat(os.path.join(out, e["name"] + ".bin")).st_mtime_ns for e in first["shards"]]
    seen = []
    encode = shards.encode_documents
    monkeypatch.setattr(shards, "encode_documents", lambda args: seen.append(len(args[2])) or encode(args))
    m = shards.prepare(src, out, *TOK, shard_tokens=800, processes=1, chunk_chars=500, verbose=False)
    assert shard_hashes(out) == shard_hashes(ref_out) and m["n_tokens"] == ref["n_tokens"]
    assert [os.stat(os.path.join(out, e["name"] + ".bin")).st_mtime_ns for e in m["shards"][:4]] == mtimes
    doc, offset = first["shards"][3]["end"]
    assert offset > 0 or doc > 0
    assert sum(seen) == ref["n_docs"] - doc  # tokenized from the document the 4th shard ended in
    seen.clear()
    assert shards.prepare(src, out, *TOK, shard_tokens=800, processes=1, verbose=False)["complete"] and not seen


def test_bad_shard_named_and_redone(src, tmp_path, capsys):
    out = str(tmp_path / "out")
    shards.prepare(src, out, *TOK, shard_tokens=700, processes=1, verbose=False)
    good = shard_hashes(out)
    p2 = os.path.join(out, "shard_000002.bin")
    raw = open(p2, "rb").read()
    with open(p2, "wb") as f:
        f.write(raw[:-10])
    with pytest.raises(shards.ShardError, match=r"shard_000002\.bin: 1,390 bytes, the manifest says 1,400 \(truncated\)"):
        shards.verify(out)
    with pytest.raises(shards.ShardError, match="shard_000002.bin"):
        shards.tokens(out)
    p1 = os.path.join(out, "shard_000001.bin")
    raw1 = bytearray(open(p1, "rb").read())
    raw1[100] ^= 1
    open(p1, "wb").write(bytes(raw1))
    with pytest.raises(shards.ShardError, match=r"shard_000001\.bin: sha256 differs .*altered"):
        shards.verify(out)
    shards.prepare(src, out, *TOK, shard_tokens=700, processes=1, verbose=True)
    assert "shard_000001.bin: sha256 differs" in capsys.readouterr().out
    assert shard_hashes(out) == good
    shards.verify(out)
    with pytest.raises(shards.ShardError, match="other settings"):
        shards.prepare(src, out, *TOK, shard_tokens=701, processes=1, verbose=False)


def test_validation_documents(src, tmp_path):
    out = str(tmp_path / "out")
    tok = tokenizer.get_tokenizer(*TOK)
    m = shards.prepare(src, out, *TOK, shard_tokens=900, processes=1, val_fraction=0.25, verbose=False)
    docs = list(corpus.iter_documents(src))
    picked = [shards.is_val(i, 0.25) for i in range(len(docs))]
    assert 0 < sum(picked) < len(docs)
    enc = lambda ds: np.array([t for d in ds for t in tok.encode(d) + [tok.eos_id]], np.uint16)  # noqa: E731
    val = enc(d for d, v in zip(docs, picked) if v)
    assert np.array_equal(np.fromfile(os.path.join(out, "val.bin"), np.uint16), val) and m["n_val"] == len(val)
    assert np.array_equal(shards.tokens(out), enc(d for d, v in zip(docs, picked) if not v))
    x, y = next(data.eval_batches(os.path.join(out, "val.bin"), 2, 16))
    assert x.tolist() == [val[:16].tolist(), val[16:32].tolist()] and y[0].tolist() == val[1:17].tolist()
    with open(os.path.join(out, "meta.json")) as f:
        assert json.load(f)["dtype"] == "uint16"


def test_cli(src, tmp_path, capsys):
    out = str(tmp_path / "out")
    shards.main(["prepare", src, out, "--vocab=4096", "--shard_tokens=5000", "--processes=1"])
    shards.main(["verify", out])
    assert "all match the manifest" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="no manifest.json"):
        shards.main(["verify", str(tmp_path)])
