"""configs/speedrun.py, pretrain.py's target_loss and bench/speedrun.py, on CPU with tiny shapes.

Proves: the speedrun recipe (Muon, ReLU², QK-norm, an untied head, soft-capped logits, value embeddings, U-net
skips, the FP8 head (the plain head on CPU), WSD; tiny shapes by overrides) stopped at step 3 and resumed logs
exactly the losses of an uninterrupted run; target_loss stops the run at the first
evaluation at or below it, after exactly the steps of the same run without it, and saves that step; and
bench/speedrun.py --tiny races nanoGPT's own train.py against the config: nanoGPT reads our tokens, its val.bin
holds exactly the held-out windows ingot evaluates, its target L agrees with train.py's own estimate, and the
race's scoring of ingot's final model equals ingot's own last evaluation (the same windows); a later call with
--nanogpt_from=<that race's nanogpt results> races ingot against its L without running train.py, and an earlier
row is reused only for the same recipe on the same tokens (paths aside); --seeds adds ingot's row at other seeds,
whose fastest and slowest times to L are the spread an ablation's cost is judged against. The race needs a checkout of
karpathy/nanoGPT (INGOT_NANOGPT=<folder>): skipped without one.
"""
import copy
import importlib.util
import json
import os
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
TINY = ["configs/speedrun.py", "--data=stdlib", "--max_docs=40", "--tokenizer_vocab=512", "--n_layer=2", "--n_head=2",
        "--n_embd=32", "--value_embeds=1", "--block_size=32", "--batch_size=4", "--micro_batch_size=2",
        "--compile=False", "--warmup_steps=2", "--log_every=1", "--progress=False"]


def pretrain(args):
    r = subprocess.run([sys.executable, "pretrain.py", *TINY, *args], cwd=ROOT, env=ENV, capture_output=True,
                       text=True, timeout=600, check=False)
    assert r.returncode == 0, f"pretrain failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r


def metrics(out_dir, key):
    with open(os.path.join(out_dir, "train_metrics.jsonl")) as f:
        return {r["step"]: r[key] for r in map(json.loads, f) if key in r}


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("data"))


def test_speedrun_config_resumes_exactly(tmp_path, data_dir):
    common = [f"--data_dir={data_dir}", "--max_steps=6", "--ckpt_every=3", "--eval_every=0"]
    full, part = str(tmp_path / "full"), str(tmp_path / "part")
    pretrain(common + [f"--out_dir={full}"])
    pretrain(common + [f"--out_dir={part}", "--stop_at=3"])
    pretrain(common + [f"--out_dir={part}", "--resume=True"])
    a, b = metrics(full, "loss"), metrics(part, "loss")
    assert sorted(b) == [1, 2, 3, 4, 5, 6]
    assert all(a[s] == b[s] for s in a), (a, b)  # bit for bit: Muon's momenta, the loader, the WSD schedule
    assert a[6] < a[1]


def test_target_loss_stops_at_the_first_evaluation_below_it(tmp_path, data_dir):
    common = [f"--data_dir={data_dir}", "--max_steps=8", "--eval_every=1", "--eval_batches=2", "--ckpt_every=0"]
    free = str(tmp_path / "free")
    pretrain(common + [f"--out_dir={free}"])
    val = metrics(free, "val_loss")
    # the target: a step's loss below every earlier one (it is the first at or below itself); not the last step
    k = next(s for s in range(2, 8) if val[s] < min(val[t] for t in range(s)))
    stopped = str(tmp_path / "stopped")
    r = pretrain(common + [f"--out_dir={stopped}", f"--target_loss={val[k]!r}"])
    assert f"<= target_loss {val[k]:g} at step {k}" in r.stdout
    assert metrics(stopped, "val_loss") == {s: v for s, v in val.items() if s <= k}
    loss = metrics(free, "loss")
    assert metrics(stopped, "loss") == {s: v for s, v in loss.items() if s <= k}  # the same steps, no more
    assert sorted(os.listdir(stopped)).count(f"step_{k:06d}") == 1  # the step that reached it, saved


def test_race_tiny_on_cpu(tmp_path):
    nanogpt = os.environ.get("INGOT_NANOGPT", "")
    if not os.path.isfile(os.path.join(nanogpt, "train.py")):
        pytest.skip("no nanoGPT checkout: set INGOT_NANOGPT to a clone of karpathy/nanoGPT")
    out, results = tmp_path / "race", tmp_path / "results"
    r = subprocess.run([sys.executable, "bench/speedrun.py", "--tiny", f"--nanogpt={nanogpt}", f"--out={out}",
                        f"--data_dir={tmp_path / 'data'}", "--ablate=qk_norm", "--seeds=2", "--cap_gib=24",
                        f"--results={results}"],
                       cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600, check=False)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    rep = json.loads((results / "speedrun.json").read_text())
    rows = {row["row"]: row for row in rep["rows"]}
    assert list(rows) == ["nanogpt", "ingot", "ingot-seed1338", "ingot-no-qk_norm", "ingot-24gib"]
    assert "--seed=1338" in rows["ingot-seed1338"]["command"] and "--seed=" not in rows["ingot"]["command"]
    times = [rows[n]["time_to_L_s"] for n in ("ingot", "ingot-seed1338") if rows[n]["reached"]]
    assert rep["seeds_time_to_L_s"] == times
    if len(times) == 2 and rows["ingot-no-qk_norm"]["reached"]:  # an ablation's cost against the seeds' spread
        t = rows["ingot-no-qk_norm"]["time_to_L_s"]
        assert rows["ingot-no-qk_norm"]["against_seeds"] == ("slower" if t > max(times) else
                                                             "faster" if t < min(times) else "within")
    race, nano = rep["race"], rows["nanogpt"]
    # nanoGPT's held-out file is the first windows of our validation split, token for token
    ours = np.fromfile(os.path.join(race["data_dir"], "val.bin"), dtype=np.uint16)
    theirs = np.fromfile(os.path.join(race["nano_dir"], "val.bin"), dtype=np.uint16)
    assert len(theirs) == race["windows"] * race["T"] + 1 and (theirs == ours[:len(theirs)]).all()
    # L: the final model's mean loss over those windows, close to train.py's own estimate on random windows of them
    windows = json.loads((out / "nanogpt" / "windows.json").read_text())["windows"]
    assert len(windows) == race["windows"] and rep["L"] == pytest.approx(np.mean(windows), abs=1e-12)
    own = [float(line.split("val loss ")[1]) for line in (out / "nanogpt" / "train.log").read_text().splitlines()
           if line.startswith(f"step {nano['steps_to_L']}: ")]
    assert abs(own[0] - rep["L"]) < 0.05, (own, rep["L"])
    assert nano["tokens_to_L"] == 40 * 8 * 2 * 64 and nano["time_to_L_s"] > 0
    for name in ("ingot", "ingot-seed1338", "ingot-no-qk_norm", "ingot-24gib"):
        row = rows[name]
        assert "--target_loss=" in row["command"] and row["curve"][0][0] == 0
        if row["reached"]:  # stopped at its first evaluation at or below L, scored on the same windows as nanoGPT's
            own = metrics(str(out / name / "run"), "val_loss")
            assert max(own) == row["steps_to_L"] and own[row["steps_to_L"]] <= rep["L"]
            assert rep["L"] + row["final_minus_L"] == pytest.approx(own[row["steps_to_L"]], abs=1e-4)
            assert row["tokens_to_L"] == row["steps_to_L"] * 16 * 64
            assert 0 <= row["time_bracket_s"][0] < row["time_bracket_s"][1] == row["time_to_L_s"]
    assert all("--max_steps=14 " in row["command"] for row in rep["rows"][1:])  # 1/3 of nanoGPT's tokens (1,024 a step)
    assert "--qk_norm=False" in rows["ingot-no-qk_norm"]["command"]
    assert rows["ingot-24gib"]["plan"]["predicted_peak_gib"] > 0
    assert (results / "speedrun.png").exists() or "matplotlib is not installed" in r.stdout
    # a later call: ingot against the committed nanoGPT row, nanoGPT not run again
    later = tmp_path / "later"
    r = subprocess.run([sys.executable, "bench/speedrun.py", "--tiny", f"--nanogpt={nanogpt}", f"--out={later}",
                        f"--data_dir={tmp_path / 'data'}", "--rows=ingot", f"--nanogpt_from={results / 'nanogpt'}"],
                       cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600, check=False)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    rep2 = json.loads((later / "speedrun.json").read_text())
    assert rep2["L"] == rep["L"] and rep2["nanogpt_from"] == str(results / "nanogpt")
    assert not (later / "nanogpt" / "train.log").exists() and "an earlier call's" in r.stdout
    again = {row["row"]: row for row in rep2["rows"]}["ingot"]
    assert again["final_val_loss"] == rows["ingot"]["final_val_loss"]  # the same run, scored against the same L


def load_speedrun():
    spec = importlib.util.spec_from_file_location("speedrun", os.path.join(ROOT, "bench", "speedrun.py"))
    speedrun = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(speedrun)
    return speedrun


def test_seed_spread_is_ingots_rows_alone():
    """seed_spread: the fastest and slowest time to L over ingot and its ingot-seed<n> rows that reached L; ablation,
    capped and unreached rows do not count, and one run has no spread. against_seeds places an ablation's time."""
    rows = [{"row": "nanogpt", "reached": True, "time_to_L_s": 180.0},
            {"row": "ingot", "reached": True, "time_to_L_s": 11.5},
            {"row": "ingot-seed1338", "reached": True, "time_to_L_s": 12.6},
            {"row": "ingot-seed1339", "reached": True, "time_to_L_s": 10.9},
            {"row": "ingot-seed1340", "reached": False},
            {"row": "ingot-no-muon", "reached": True, "time_to_L_s": 22.2},
            {"row": "ingot-24gib", "reached": True, "time_to_L_s": 14.0}]
    speedrun = load_speedrun()
    assert speedrun.seed_spread(rows) == ([11.5, 12.6, 10.9], (10.9, 12.6))
    assert speedrun.seed_spread(rows[:2] + rows[5:]) == ([11.5], None)
    # an ablation's time against that spread: slower than the slowest seed, faster than the fastest, or inside it
    assert [speedrun.against_seeds(t, (10.9, 12.6)) for t in (22.2, 12.6, 11.0, 10.9, 10.2)] == \
        ["slower", "within", "within", "within", "faster"]


def test_nanogpt_from_needs_the_same_race():
    """setup_differs: an earlier nanoGPT row serves only the same recipe (knobs, train.py) on the same tokens."""
    speedrun = load_speedrun()
    saved = {"knobs": {"max_iters": 168, "out_dir": "/a/out/nanogpt", "dataset": "/a/out/nanogpt_data"},
             "race": {"data_dir": "/a/data/python", "nano_dir": "/a/out/nanogpt_data", "T": 1024, "n_train": 99317421,
                      "fingerprint": "f6553d550aa6f243"}, "nanogpt": "5ed1127a19d04243"}
    moved = copy.deepcopy(saved)
    moved["knobs"].update(out_dir="/b/nanogpt", dataset="/b/data")
    moved["race"].update(data_dir="/b/data/python", nano_dir="/b/data")
    assert speedrun.setup_differs(saved, moved) == []
    other = copy.deepcopy(moved)
    other["knobs"]["max_iters"], other["race"]["fingerprint"], other["nanogpt"] = 84, "0", "1"
    assert speedrun.setup_differs(saved, other) == ["knobs.max_iters", "nanogpt", "race.fingerprint"]
    del other["race"]["T"]
    assert "race.T" in speedrun.setup_differs(saved, other)
