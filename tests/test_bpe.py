"""bpe.py: a byte-level BPE trained with HF `tokenizers` on part of the standard library gives the
same ids through three readers (tokenizers' own Tokenizer, transformers' PreTrainedTokenizerFast,
and tokenizer.py's reader through tiktoken, which pretraining uses) on held-out code and
on text of many scripts, decodes back to the text, has exactly `vocab` ids with EOS at vocab-1 and
the 256 bytes; the compression report equals bytes / tokens counted here for both tokenizers;
shards.prepare tokenizes with it by path; pretrain.py trains two steps with --tokenizer=<folder>."""
import json
import os
import subprocess
import sys
import sysconfig

import numpy as np
import pytest

import tokenizer
from corpora import bpe, corpus, shards

LIB = sysconfig.get_paths()["stdlib"]
TEXTS = ["naïve café — 東京 🙂 12345 don't  \n\n\tx = {'a': [1, 2]}", "Ünïcödé ελληνικά русский العربية", "", " "]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("bpe") / "tok")
    report = bpe.train(os.path.join(LIB, "json"), out, vocab=1000, held_out=0.2, verbose=False)
    return out, report


def test_same_ids_three_readers(trained):
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer
    out, _ = trained
    ours = tokenizer.get_tokenizer(out)
    hf = Tokenizer.from_file(os.path.join(out, "tokenizer.json"))
    fast = transformers.PreTrainedTokenizerFast.from_pretrained(out)
    assert ours.n_vocab == hf.get_vocab_size() == len(fast) == 1000
    assert ours.eos_id == hf.token_to_id("<|endoftext|>") == fast.eos_token_id == 999
    texts = list(corpus.iter_documents(os.path.join(LIB, "email")))[:25] + TEXTS
    for text in texts:
        ids = ours.encode(text)
        assert ids == hf.encode(text).ids == fast(text, add_special_tokens=False)["input_ids"]
        assert ours.decode(ids) == text == fast.decode(ids)
    assert sum(len(ours.encode(t)) for t in texts) < sum(len(t.encode()) for t in texts)  # it merges
    assert all(len(ours.encode(bytes([b]).decode("latin-1"))) >= 1 for b in range(256))


def test_compression_report(trained):
    out, report = trained
    held = [d for i, d in enumerate(corpus.iter_documents(os.path.join(LIB, "json"))) if shards.is_val(i, 0.2)]
    assert report["documents"] == len(held) > 0
    n_bytes = sum(len(d.encode()) for d in held)
    for name, tok in (("ours", tokenizer.get_tokenizer(out)), ("cl100k_base", tokenizer.get_tokenizer("cl100k_base"))):
        n_tokens = sum(len(tok.encode(d)) for d in held)
        assert report[name]["bytes"] == n_bytes and report[name]["tokens"] == n_tokens
        assert report[name]["bytes_per_token"] == pytest.approx(n_bytes / n_tokens)
    with open(os.path.join(out, "compression.json")) as f:
        assert json.load(f) == report
    with pytest.raises(corpus.DataError, match="vocab=100"):
        bpe.train(os.path.join(LIB, "json"), out, vocab=100)


def test_shards_and_pretraining_by_path(trained, tmp_path):
    out, _ = trained
    src = os.path.join(LIB, "json")
    tok = tokenizer.get_tokenizer(out)
    shards.prepare(src, str(tmp_path / "sh"), tokenizer=out, shard_tokens=5000, processes=1, verbose=False)
    ref = [t for d in corpus.iter_documents(src) for t in tok.encode(d) + [tok.eos_id]]
    assert np.array_equal(shards.tokens(str(tmp_path / "sh")), np.array(ref, np.uint16))
    args = [f"--tokenizer={out}", "--tokenizer_vocab=0", f"--data={src}", "--n_layer=1", "--n_head=2", "--n_embd=16", "--block_size=16",
            "--batch_size=2", "--micro_batch_size=2", "--max_steps=2", "--log_every=1", "--eval_every=0",
            "--sample_tokens=0", "--progress=False", f"--out_dir={tmp_path / 'run'}",
            f"--data_dir={tmp_path / 'data'}", "--device=cpu"]
    r = subprocess.run([sys.executable, "pretrain.py", "configs/tiny.py", *args], capture_output=True, text=True,
                       cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))), timeout=600,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    with open(tmp_path / "data" / "meta.json") as f:
        meta = json.load(f)
    assert meta["tokenizer"] == tok.name and meta["n_vocab"] == 1000
