"""The warnings of a GRPO run that trains but does not improve (posttrain/diagnose.py), and its --grpo plot.

Proves: on constructed metric histories (grpo.py's records: training lines with reward, frac_equal_groups,
entropy, kl, clip fractions; evaluations with heldout_greedy / heldout_reward) each rule fires on the history
built to show its failure, with exactly its own kind, and names what to try: groups with signal but flat
held-out, training reward up with held-out flat, held-out greedy down while sampled up, entropy collapsing and
exploding, clip fraction over 0.2 (cispo's too), KL to the reference growing past 0.1. No rule fires on a run
that learns (reward and held-out rising together, entropy in band, small KL and clipping), nor before enough
evaluations. tools.plots --grpo writes a PNG from a small metrics JSONL, with the informative share
(1 - frac_equal_groups), held-out and entropy curves drawn.
"""
import json

from posttrain import diagnose
from tools import plots


def history(n=8, reward=(0.2, 0.6), greedy=(0.2, 0.6), sampled=(0.2, 0.6), entropy=(1.0, 0.8), kl=(0.0, 0.02),
            equal=0.3, clip=0.01, every=2):
    """n training records (log every step) and an evaluation every `every` steps (and at step 0), each metric
    moving linearly from its first to its last value: the defaults learn."""
    def at(pair, i, last):
        return pair[0] + (pair[1] - pair[0]) * i / last
    out = [{"step": 0, "heldout_greedy": greedy[0], "heldout_reward": sampled[0]}]
    for s in range(1, n + 1):
        out.append({"step": s, "reward": at(reward, s, n), "frac_equal_groups": equal, "entropy": at(entropy, s, n),
                    "kl": at(kl, s, n), "clip_low": clip / 2, "clip_high": clip / 2})
        if s % every == 0:
            out.append({"step": s, "heldout_greedy": at(greedy, s, n), "heldout_reward": at(sampled, s, n)})
    return out


def kinds(h):
    return [k for k, _ in diagnose.warnings(h)]


def test_a_learning_run_warns_of_nothing():
    assert kinds(history()) == []
    assert kinds(history(n=2)) == []  # too few evaluations for the held-out rules
    assert kinds(history(n=1, reward=(0, 0), greedy=(0.5, 0.0))) == []


def test_each_failure_warns_its_kind():
    cases = {  # kind: (history, a fix the line names)
        "signal_without_gain": (history(reward=(0.4, 0.4), greedy=(0.5, 0.5), sampled=(0.5, 0.5)), "group_size"),
        "reward_without_heldout": (history(greedy=(0.4, 0.41), sampled=(0.4, 0.38)), "raise beta"),
        "greedy_against_sampled": (history(greedy=(0.6, 0.4), sampled=(0.3, 0.6), reward=(0.3, 0.3)),
                                   "lower temperature"),
        "entropy_collapse": (history(entropy=(1.0, 0.1)), "raise temperature"),
        "entropy_explode": (history(entropy=(1.0, 6.0)), "lower lr"),
        "clipped": (history(clip=0.3), "lower lr"),
        "kl_growing": (history(kl=(0.01, 0.3)), "raise beta"),
    }
    for kind, (h, fix) in cases.items():
        got = dict(diagnose.warnings(h))
        assert list(got) == [kind], (kind, list(got))
        assert fix in got[kind].lower(), got[kind]
    # a run without signal (every group equal) is dead.py's case, not signal_without_gain's
    assert kinds(history(reward=(0.4, 0.4), greedy=(0.5, 0.5), sampled=(0.5, 0.5), equal=0.9)) == []
    cispo = [{**r, "cispo_clip": 0.25} if "reward" in r else r for r in history(clip=0.0)]
    assert kinds(cispo) == ["clipped"]


def test_grpo_plot_writes_a_png(tmp_path):
    with open(tmp_path / "train_metrics.jsonl", "w") as f:
        for rec in history():
            f.write(json.dumps({"time": 0.0, **rec}) + "\n")
    out = tmp_path / "grpo.png"
    plots.main([str(tmp_path), "--grpo", f"--out={out}"])
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    drawn = plots.plot_runs([str(tmp_path)], None, panels=plots.GRPO_PANELS)
    assert len(drawn) == 3
    lines = {k: v for panel in drawn.values() for k, v in panel.items()}
    name = tmp_path.name
    assert lines[f"{name} informative_groups"][1] == [0.7] * 8
    assert lines[f"{name} heldout_greedy"][0] == [0, 2, 4, 6, 8]
    assert f"{name} heldout_reward" in lines and f"{name} entropy" in lines and f"{name} reward" in lines
