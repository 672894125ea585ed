"""Smoke tests of bench.py and bench/bench_parallel.py's 4-process combo mode on CPU: tiny shape, eager
rows, a couple of steps; checks the JSON (rows present, tokens/s measured, rows that see the same
model and data report the same loss)."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--shape=tiny", "--device=cpu", "--batch=2", "--steps=2", "--warmup=1"]


def run(cmd, tmp_path):
    out = tmp_path / "bench.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    res = subprocess.run(cmd + TINY + [f"--json={out}"], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "| run | tokens/s |" in res.stdout
    return json.loads(out.read_text())


def test_single_eager(tmp_path):
    rep = run([sys.executable, "bench/bench.py", "single", "--runs=ours-eager,hf-eager"], tmp_path)
    ours, hf = rep["rows"]
    assert ours["tokens_per_s"] > 0 and ours["mfu"] is None and "error" not in ours
    # HF row: measured when transformers is installed, otherwise skipped with a reason, never an error
    assert "error" not in hf and ("tokens_per_s" in hf or "skipped" in hf)
    if "tokens_per_s" in hf:
        assert hf["params"] == ours["params"] and ours["ratio_vs_peer"] > 0
    assert rep["seq_len"] == 64 and rep["batch_per_gpu"] == 2 and rep["commit"]


def test_dp_eager_two_processes(tmp_path):
    rep = run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               "bench/bench.py", "dp", "--compile=0"], tmp_path)
    rows = {r["run"]: r for r in rep["rows"]}
    assert set(rows) == {"ours-1gpu", "ours-dp", "torch-ddp"}
    assert all(r.get("tokens_per_s", 0) > 0 for r in rows.values()), rows
    # same seed, same data on rank 0: the first steps match between ours and DDP
    assert abs(rows["ours-dp"]["loss"] - rows["torch-ddp"]["loss"]) < 1e-4
    assert rep["processes"] == 2 and rows["ours-dp"]["gpus"] == 2
    assert set(rep["goals"]) == {"ours_dp_scaling_vs_1gpu", "ours_dp_vs_torch_ddp"}


def test_bench_parallel_combo_four_processes(tmp_path):
    out = tmp_path / "combo.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4",
           "bench/bench_parallel.py", "combo", "--shape=tiny", "--device=cpu", "--batch=2", "--steps=1", "--warmup=1",
           f"--json={out}"]
    res = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    rows = {r["run"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"torch-fsdp2", "tp2-dp2", "tp2-fsdp2", "moe-torch-fsdp2", "ep2-dp2"}
    assert all(r.get("tokens_per_s", 0) > 0 for r in rows.values()), rows
    # same model, same data per data rank, two optimizer steps: the same loss
    assert abs(rows["tp2-dp2"]["loss"] - rows["tp2-fsdp2"]["loss"]) < 1e-4
    assert abs(rows["ep2-dp2"]["loss"] - rows["moe-torch-fsdp2"]["loss"]) < 1e-4


def test_bench_memory_tiny(tmp_path):
    """bench/bench_memory.py --tiny: two QLoRA rows in child processes on CPU, each with tokens/s and
    plan.py's prediction (nothing measured on CPU)."""
    out = tmp_path / "memory.json"
    cmd = [sys.executable, "bench/bench_memory.py", "qlora8b", "--tiny", "--steps=1", "--warmup=1", f"--json={out}"]
    res = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True,
                         text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [r["row"] for r in rows] == ["qlora8b+chunk+ckpt", "qlora8b+chunk"]
    assert all(r["tokens_per_s"] > 0 and r["predicted_gib"] > 0 and "measured_gib" not in r for r in rows), rows
    assert rows[0]["knobs"]["lora_base_dtype"] == "nf4" and rows[0]["knobs"]["grad_checkpoint"]


def test_grpo_families_variants_and_report(tmp_path):
    """bench/grpo_families.py: --variants parses to (name, args) with 'defaults' alone when empty, refuses a bad
    spec in one line, and the report has one row a family and variant with the gains worked here by hand;
    --stages=grpo without the family's SFT run under --runs stops in one line before any work, as does a family
    both tuned on and judged; pick() takes the highest mean greedy gain over the tuning families, only a variant
    with a row on each, and keeps defaults unless beaten by a point (gains worked here by hand)."""
    import pytest
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    try:
        import grpo_families as gf
    finally:
        sys.path.remove(os.path.join(ROOT, "bench"))
    assert gf.variants("") == [("defaults", [])]
    assert gf.variants("defaults:;ds:--dynamic_sampling=True --refill_rounds=2") == [
        ("defaults", []), ("ds", ["--dynamic_sampling=True", "--refill_rounds=2"])]
    for bad in ("ds", "Ds:--lr=1", "a:--lr=1;a:--lr=2"):
        with pytest.raises(SystemExit, match="--variants"):
            gf.variants(bad)
    with pytest.raises(SystemExit, match="--stages=grpo: no SFT run of units under .*: run --stages=sft first"):
        gf.main([f"--out={tmp_path / 'o'}", f"--runs={tmp_path / 'runs'}", "--stages=grpo", "--families=units", "--tiny"])
    assert not (tmp_path / "runs").exists() and not (tmp_path / "o").exists()
    with pytest.raises(SystemExit, match="--tune: units also in --families: a family tuned on is not judged"):
        gf.main([f"--out={tmp_path / 'o'}", "--tune=word_problems,units", "--families=units,strings", "--tiny"])
    kinds = gf.variants("defaults:;lr:--lr=1e-5;ds:--dynamic_sampling=True;half:--lr=1e-6")

    def r(family, variant, gain, failed=False):
        return {"family": family, "variant": variant, "grpo": {"gain_greedy": gain}, **({"failed": "rc 1"} if failed else {})}
    rows = [r("a", "defaults", 0.006), r("b", "defaults", -0.002), r("a", "lr", 0.03), r("b", "lr", 0.01),
            r("a", "ds", 0.05), r("b", "ds", 0.0, failed=True), r("a", "half", 0.2), r("c", "half", 0.2)]
    (name, args), means = gf.pick(rows, kinds, ["a", "b"])  # ds failed on b, half has no row on b: out
    assert (name, args) == ("lr", ["--lr=1e-5"]) and means == pytest.approx({"defaults": 0.002, "lr": 0.02})
    rows[2]["grpo"]["gain_greedy"] = 0.012  # lr's mean 0.011: beats defaults' 0.002 by under a point
    assert gf.pick(rows, kinds, ["a", "b"])[0] == ("defaults", [])
    assert gf.pick([], kinds, ["a", "b"]) == (("defaults", []), {})
    g = dict(start_greedy=0.326, start_sampled=0.192, end_greedy=0.332, end_sampled=0.216, gain_greedy=0.006,
             gain_sampled=0.024, steps=169, end_step=150, frac_equal_groups_first=0.534, frac_equal_groups_last=0.563)
    rows = [{"family": "word_problems", "variant": "ds", "sft": {"greedy_before": 0.0, "greedy_after": 0.326},
             "grpo": g, "stopped": True, "grpo_seconds": 306.0, "jobs": 4},
            {"family": "strings", "failed": "rc 1"}]
    text = gf.report(rows, str(tmp_path / "report.md"))
    assert ("| word_problems | ds | 0.0 -> 32.6 | 32.6 / 19.2 | 33.2 / 21.6 | +0.6 / +2.4 | 169 (150) stopped | 5.1 | "
            "53.4 -> 56.3 |") in text
    assert "| strings | defaults | failed: rc 1 |" in text and "4 GRPO runs side by side" in text
