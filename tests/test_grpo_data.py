"""GRPO on a user's prompt file under the layouts, and the warning of a run that cannot learn.

Proves: grpo.py reads a GSM8K-style .jsonl (question / answer '#### N') with a user's reward loaded
from a file (path.py:function, given the prompts, the completions and the records' columns), holds a
share out, and under DP2 and TP2 x DP2 (gloo: the same data ranks, so the same rollouts) logs the
same rewards at every step and ends with the same weights (<= 1e-5); the held-out greedy reward
before training, split over the data ranks and gathered, is the one-process run's. diagnose.dead names
the cause on constructed means (truncation, every reward 0, every reward 1, equal rewards) and
nothing on means with signal; a run whose reward is always 0 warns once, after dead_steps steps,
naming that cause, and a run with signal does not warn.
"""
import json
import os
import subprocess
import sys

import pytest
from safetensors.torch import load_file

import grpo
from posttrain import diagnose

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
TINY = ["--device=cpu", "--reward_truncated=True", "--tokenizer_vocab=300", "--n_layer=1", "--n_embd=32", "--n_head=2", "--block_size=128",
        "--batch_size=8", "--group_size=4", "--micro_batch_size=4", "--max_new_tokens=6", "--temperature=1.0",
        "--lr=3e-3", "--warmup_steps=0", "--eps=1e-4", "--log_every=1", "--progress=False", "--ckpt_every=0"]
REWARD = '''def length(prompts, completions, answer, **columns):
    """A completion's length in characters / 40, at most 1 (the records' gold answers are handed in too)."""
    assert len(answer) == len(completions) and all(isinstance(a, str) for a in answer)
    return [min(len(c), 40) / 40 for c in completions]


def nothing(prompts, completions, **columns):
    return [0.0] * len(completions)
'''


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("grpo_data")
    with open(d / "gsm.jsonl", "w") as f:
        for i in range(40):
            a, b = 3 + i, 7 + 2 * i
            f.write(json.dumps({"question": f"Tom has {a} apples and buys {b} more. How many now?",
                                "answer": f"{a} + {b} = {a + b}\n#### {a + b}"}) + "\n")
    (d / "my_reward.py").write_text(REWARD)
    return d


def run(args, nproc=1):
    cmd = ([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
           if nproc > 1 else [sys.executable]) + [os.path.join(ROOT, "grpo.py")] + args
    r = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r


def metrics(out):
    with open(os.path.join(out, "train_metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_prompt_file_under_dp2_and_tp2_dp2(files, tmp_path):
    data = TINY + [f"--prompt_data={files}/gsm.jsonl", "--eval_percent=20", f"--reward={files}/my_reward.py:length",
                   "--max_steps=2", "--eval_every=2"]
    outs = {name: str(tmp_path / name) for name in ("one", "dp2", "tp2dp2")}
    r = run(data + [f"--out_dir={outs['one']}"])
    assert "held out" in r.stdout or "held-out" in r.stdout, r.stdout[-2000:]
    run(data + [f"--out_dir={outs['dp2']}"], nproc=2)
    run(data + [f"--out_dir={outs['tp2dp2']}", "--tp=2"], nproc=4)
    m = {name: metrics(out) for name, out in outs.items()}
    train = {name: [(r["step"], r["reward"]) for r in rows if "reward" in r] for name, rows in m.items()}
    assert [s for s, _ in train["dp2"]] == [1, 2] and all(v > 0 for _, v in train["dp2"])
    assert [s for s, _ in train["tp2dp2"]] == [1, 2]  # (pytest >= 9.2's approx takes no nested pairs)
    assert [v for _, v in train["tp2dp2"]] == pytest.approx([v for _, v in train["dp2"]], rel=1e-5)
    held = {name: {r["step"]: r["heldout_greedy"] for r in rows if "heldout_greedy" in r} for name, rows in m.items()}
    assert held["one"][0] > 0 and held["dp2"][0] == pytest.approx(held["one"][0], rel=1e-5), held
    assert held["tp2dp2"][0] == pytest.approx(held["one"][0], rel=1e-5), held
    from distributed import assert_close, rel_err
    w = {name: load_file(os.path.join(out, "step_000002", "model.safetensors")) for name, out in outs.items()}
    assert max(rel_err(w["dp2"][k], w["one"][k]) for k in w["one"]) > 0  # (different rollouts: other seeds)
    assert_close(w["tp2dp2"], w["dp2"], "TP2 x DP2 weights after 2 steps vs DP2")


def test_diagnose_names_the_cause():
    from types import SimpleNamespace
    base = {"truncated": 0.0, "frac_equal_groups": 0.5, "reward": 0.4}
    assert diagnose.dead(base, _cfg()) is None
    kept = SimpleNamespace(max_new_tokens=6, reward_truncated=True, mask_truncated=False)  # truncation costs nothing
    assert diagnose.dead({**base, "truncated": 0.95}, kept) is None
    assert "max_new_tokens=6" in diagnose.dead({**base, "truncated": 0.95}, _cfg())
    assert "earns 0" in diagnose.dead({**base, "frac_equal_groups": 1.0, "reward": 0.0}, _cfg())
    assert "solved" in diagnose.dead({**base, "frac_equal_groups": 0.97, "reward": 1.0}, _cfg())
    assert "all equal" in diagnose.dead({**base, "frac_equal_groups": 1.0, "reward": 0.5}, _cfg())


def _cfg():
    from types import SimpleNamespace
    return SimpleNamespace(max_new_tokens=6, reward_truncated=False, mask_truncated=False)


def test_dead_run_warns_once_and_a_live_one_does_not(files, tmp_path):
    common = TINY + [f"--prompt_data={files}/gsm.jsonl", "--eval_percent=20", "--max_steps=6", "--eval_every=0",
                     "--dead_steps=4"]
    dead = run(common + [f"--reward={files}/my_reward.py:nothing", f"--out_dir={tmp_path}/dead"])
    warnings = [line for line in dead.stdout.splitlines() if line.startswith("warning: no learning signal")]
    assert len(warnings) == 1 and "last 4 steps" in warnings[0] and "earns 0" in warnings[0], dead.stdout[-3000:]
    live = run(common + [f"--reward={files}/my_reward.py:length", f"--out_dir={tmp_path}/live"])
    assert "no learning signal" not in live.stdout, live.stdout[-3000:]
