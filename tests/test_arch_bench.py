"""Smoke tests of bench/compare_arch.py, bench/alibi_extrapolation.py and bench/bench_encoders.py on
CPU: tiny shapes, a few steps, a small text corpus. Checks the JSON: the four architectures have blocks of matched size
(within 5%), each trains for the FLOPs of GPT-2's steps (within one step's), the causal LMs report
bits per byte and the others none, every loss is finite and the PNG is written; the extrapolation
table has ALiBi, RoPE and RoPE with a window of T, whose loss at 1x equals RoPE's (the window
changes nothing at the training length); bench/bench_encoders.py's BERT and T5 rows have the
parameter count of their HF peers (the same shape) and the same FLOP count per step."""
import json
import math
import os
import subprocess
import sys
import sysconfig

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--shape=tiny", "--device=cpu", "--steps=2", "--seq_len=32", "--batch=4", "--vocab=512"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("corpus")
    text = "".join(open(os.path.join(sysconfig.get_paths()["stdlib"], f), encoding="utf-8").read()
                   for f in ("argparse.py", "textwrap.py", "shlex.py"))
    (d / "corpus.txt").write_text(text)
    return str(d / "corpus.txt"), str(d / "data")


def run(script, args, tmp_path):
    res = subprocess.run([sys.executable, script, *args], cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"},
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return res.stdout


def test_compare_arch(corpus, tmp_path):
    src, root = corpus
    out = run("bench/compare_arch.py", TINY + ["--eval_every=1", f"--data={src}", f"--data_root={root}",
                                              f"--json={tmp_path / 'a.json'}", f"--png={tmp_path / 'a.png'}"], tmp_path)
    assert "| arch | params |" in out
    rep = json.loads((tmp_path / "a.json").read_text())
    rows = rep["rows"]
    assert set(rows) == {"gpt2", "llama", "bert", "t5"}
    sizes = [r["block_params"] for r in rows.values()]
    assert max(sizes) <= 1.05 * min(sizes), sizes
    budget = rows["gpt2"]["steps"] * rows["gpt2"]["flops_per_step"]
    for name, r in rows.items():
        assert abs(r["steps"] * r["flops_per_step"] - budget) <= r["flops_per_step"] / 2 + 1, name
        assert all(math.isfinite(c["val_loss"]) for c in r["curve"]) and r["curve"][-1]["step"] == r["steps"]
        assert (r["curve"][-1]["val_bpb"] is not None) == (name in ("gpt2", "llama")), name
    assert rows["bert"]["steps"] >= rows["gpt2"]["steps"] and rows["t5"]["steps"] > rows["gpt2"]["steps"]
    pytest.importorskip("matplotlib")
    assert os.path.getsize(tmp_path / "a.png") > 1000


def test_alibi_extrapolation(corpus, tmp_path):
    src, root = corpus
    out = run("bench/alibi_extrapolation.py", TINY + [f"--data={src}", f"--data_root={root}",
                                                     f"--json={tmp_path / 'x.json'}"], tmp_path)
    assert "| positions |" in out
    rows = json.loads((tmp_path / "x.json").read_text())["rows"]
    assert set(rows) == {"rope", "alibi", "rope, window T"}
    assert rows["rope, window T"]["1"] == rows["rope"]["1"]
    assert all(math.isfinite(v) for r in rows.values() for f in ("1", "2", "4") for v in r[f])


def test_bench_encoders(tmp_path):
    pytest.importorskip("transformers")
    out = run("bench/bench_encoders.py", ["--shape=tiny", "--device=cpu", "--steps=1", "--warmup=0",
                                          f"--json={tmp_path / 'e.json'}"], tmp_path)
    assert "| row | params |" in out
    rows = {r["row"]: r for r in json.loads((tmp_path / "e.json").read_text())["rows"]}
    assert set(rows) == {"bert", "bert-hf", "t5", "t5-hf"}
    for ours in ("bert", "t5"):  # the HF peer of the same shape: the same parameters and FLOP count
        assert rows[ours]["params"] == rows[ours + "-hf"]["params"], ours
        assert rows[ours]["flops_per_step"] == rows[ours + "-hf"]["flops_per_step"] > 0, ours
    assert all(math.isfinite(r["loss"]) and r["tok_s"] > 0 for r in rows.values())
