"""sweep.py: a 2x2 grid of configs/tiny.py runs, resumed without redoing finished runs, compared.

Proves, with real pretrain.py subprocesses (a 1-layer model, 4 steps, checkpoints every 2; one thread each):
- the grid is every combination, one folder each named from its overrides; as a queue over two
  "GPUs" (CUDA_VISIBLE_DEVICES per run; the runs use the CPU) all four finish; the table (markdown
  and JSON) holds each run's final loss equal to the last loss of its train_metrics.jsonl, and
  curves.png is written;
- re-invoked after one run lost its final checkpoint (resumable from step 2) and another lost all
  checkpoints (only its metrics left): the two finished ones are not run again (their files are
  untouched), the first continues with --resume, the second starts over with --overwrite=True; the
  table again holds four final losses at step 4 (the resumed run's equal to its first);
- SIGTERM to the sweep reaches the running stage, which saves and stops: the run is 'interrupted'
  with a checkpoint before its last step: the next invocation will resume it;
- the sweep spec parser (nested lists and quoted commas stay whole) and its mistakes.
"""
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

import config
from tools import sweep

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FAST = ["--max_steps=4", "--ckpt_every=2", "--eval_every=0", "--log_every=1", "--max_docs=10", "--clean=False",
        "--dedup=none", "--tokenizer_vocab=512", "--n_layer=1", "--n_embd=32", "--n_head=2", "--n_kv_head=1",
        "--block_size=32", "--batch_size=4", "--micro_batch_size=2", "--sample_tokens=0", "--progress=False",
        "--device=cpu", "--warmup_steps=1"]
SPEC = "--sweep=lr=[1e-3,3e-3];norm=[layernorm,rmsnorm]"
NAMES = ["lr=1e-3_norm=layernorm", "lr=1e-3_norm=rmsnorm", "lr=3e-3_norm=layernorm", "lr=3e-3_norm=rmsnorm"]


def invoke(tmp, *extra, wait=True):
    cmd = [sys.executable, "-m", "tools.sweep", os.path.join(ROOT, "pretrain.py"),
           os.path.join(ROOT, "configs", "tiny.py"), *FAST, *extra, f"--data_dir={tmp / 'data'}",
           f"--out_dir={tmp / 'sw'}"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)  # `python -m tools.sweep` from another folder
    if not wait:
        return subprocess.Popen(cmd, cwd=tmp, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    p = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    return p.stdout


def last_loss(run_dir):
    recs = [json.loads(ln) for ln in open(os.path.join(run_dir, "train_metrics.jsonl")) if ln.strip()]
    return [r for r in recs if "loss" in r][-1]


def test_sweep_runs_resumes_compares(tmp_path):
    out = invoke(tmp_path, SPEC, "--gpus=0,1")
    sw = tmp_path / "sw"
    assert sorted(os.listdir(sw)) == sorted(NAMES + ["logs", "sweep.json", "sweep.md", "curves.png"])
    assert "on GPU 0" in out and "on GPU 1" in out
    rows = json.load(open(sw / "sweep.json"))
    assert [r["name"] for r in rows] == NAMES and all(r["state"] == "finished" for r in rows)
    for r in rows:
        assert r["final"]["loss"] == pytest.approx(last_loss(r["dir"])["loss"]) and r["final"]["step"] == 4
        assert r["overrides"] == dict(kv.split("=") for kv in r["name"].split("_"))
    first = {r["name"]: r["final"]["loss"] for r in rows}
    # one run loses its final checkpoint, another every checkpoint (interrupted before the first)
    shutil.rmtree(sw / NAMES[1] / "step_000004")
    for d in os.listdir(sw / NAMES[2]):
        if d.startswith("step_"):
            shutil.rmtree(sw / NAMES[2] / d)
    stamps = {n: os.path.getmtime(sw / n / "step_000004" / "complete.json") for n in (NAMES[0], NAMES[3])}
    out = invoke(tmp_path, SPEC)
    assert f"{NAMES[0]}: finished (step_000004), not run again" in out
    assert f"{NAMES[3]}: finished (step_000004), not run again" in out
    assert f"{NAMES[1]}: resumes from" in out and "step_000002" in out
    assert f"{NAMES[2]}: starts over" in out
    assert stamps == {n: os.path.getmtime(sw / n / "step_000004" / "complete.json") for n in stamps}
    log1 = open(sw / "logs" / f"{NAMES[1]}.log").read().split("$ ")[-1]
    assert "--resume" in log1 and "resumed from" in log1
    rows = json.load(open(sw / "sweep.json"))
    assert all(r["state"] == "finished" and r["final"]["step"] == 4 for r in rows)
    table = open(sw / "sweep.md").read()
    for r in rows:
        assert f"{r['final']['loss']:.4f}" in table
    assert first[NAMES[1]] == pytest.approx(rows[1]["final"]["loss"], rel=1e-5)  # the resumed run lands where it did
    assert len(table.strip().splitlines()) == 2 + 4


def test_sigterm_interrupts_and_resumes(tmp_path):
    p = invoke(tmp_path, "--sweep=lr=[1e-3]", "--max_steps=400", "--ckpt_every=50", wait=False)
    metrics = tmp_path / "sw" / "lr=1e-3" / "train_metrics.jsonl"
    t0 = time.time()
    while not (metrics.exists() and metrics.read_text().count("\n") >= 3):
        assert time.time() - t0 < 300 and p.poll() is None, p.stdout.read() if p.poll() is not None else "slow"
        time.sleep(0.2)
    p.send_signal(signal.SIGTERM)
    text = p.communicate(timeout=300)[0]
    assert "interrupted (SIGTERM): run the same command to continue" in text
    row = json.load(open(tmp_path / "sw" / "sweep.json"))[0]
    assert row["state"] == "interrupted"
    st, path = sweep.state(row["dir"])
    assert st == "resume" and int(path[-6:]) < 400


def test_parse_sweep():
    assert sweep.parse_sweep("lr=[3e-4, 1e-3];norm=[layernorm,rmsnorm]") == [
        ("lr", ["3e-4", "1e-3"]), ("norm", ["layernorm", "rmsnorm"])]
    assert sweep.parse_sweep("lora_targets=['q_proj,v_proj',all-linear];x=[[1,2],3]") == [
        ("lora_targets", ["'q_proj,v_proj'", "all-linear"]), ("x", ["[1,2]", "3"])]
    assert sweep.run_name([("data", "/my/corpus"), ("lr", "1e-3")]) == "data=-my-corpus_lr=1e-3"
    for bad, msg in [("lr=1e-3", "key=\\[v1"), ("lr=[1,];", "empty value"), ("a=[1];a=[2]", "twice"), ("", "empty")]:
        with pytest.raises(config.ConfigError, match=msg):
            sweep.parse_sweep(bad)
    with pytest.raises(config.ConfigError, match="drop it"):
        sweep.main([os.path.join(ROOT, "pretrain.py"), "--sweep=lr=[1]", "--resume"])
