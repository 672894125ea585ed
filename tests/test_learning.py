"""Post-training loops that learn, where the optimum is known and easy (tasks.Probe).

Proves: GRPO's whole loop (rollout from the fast decoder, the rewards paired with their completions,
advantages, the clipped loss, the optimizer step) raises the training reward of a random tiny model
from its chance level (~0.2: completions whose first character is a lowercase letter) to near 1 in a
few steps, in one process and under DP2 (each data rank samples its own share with its own seed); on a GPU the same with the rollout
copy and captured decode steps as configs/grpo_small.py runs them, and with each rollout setting
that changes the decoder's path (one prefill per prompt or per row, KV buckets, top-k candidates);
and DPO on probe pairs raises the policy's own held-out preference for the chosen answer to ~1.
A loop that samples, rewards or orders rows wrongly does not learn: it stays at chance.
"""
import json
import os
import string

import pytest
import torch

import dpo
import grpo
from distributed import spawn

PROBE = ["--task=probe", f"--task_args={{'chars': '{string.ascii_lowercase}'}}", "--device=cpu",
         "--tokenizer_vocab=300", "--n_layer=1", "--n_embd=32", "--n_head=2", "--block_size=48", "--seed=3",
         "--warmup_steps=0", "--schedule=constant", "--weight_decay=0.0", "--progress=False", "--ckpt_every=0",
         "--log_every=1"]
# a random model never ends its turn: its completions are cut at max_new_tokens, and keep their reward
GRPO = PROBE + ["--batch_size=64", "--group_size=8", "--micro_batch_size=32", "--max_new_tokens=2",
                "--reward_truncated=True", "--temperature=1.0", "--lr=3e-2", "--max_steps=12", "--eval_every=0",
                "--train_prompts=256"]


def rewards(out):
    with open(os.path.join(out, "train_metrics.jsonl")) as f:
        return [r["reward"] for r in map(json.loads, f) if "reward" in r]


def _grpo(rank, argv):
    grpo.main(argv)


def test_grpo_learns_the_probe_one_process_and_dp2(tmp_path, one_thread):
    one, two = str(tmp_path / "one"), str(tmp_path / "two")
    grpo.main(GRPO + [f"--out_dir={one}"])
    spawn(_grpo, 2, GRPO + [f"--out_dir={two}"])
    for r in rewards(one), rewards(two):
        assert len(r) == 12 and r[0] < 0.4 and min(r[-3:]) > 0.85, r  # from chance to near 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the captured decode steps and the rollout copy need a GPU")
@pytest.mark.parametrize("variant", [[], ["--top_k=8"], ["--group_size=6", "--batch_size=48", "--micro_batch_size=16"],
                                     ["--max_new_tokens=40", "--block_size=96", "--lr=6e-2", "--max_steps=30"]])
def test_grpo_learns_the_probe_on_gpu(tmp_path, variant):
    """bf16, the rollout copy, captured steps (configs/grpo_small.py's path); top-k candidates; a group
    split over rows prefilled one by one (48 rows, G=6: not all prompts' samples equal per call: n=1);
    completions long enough for several KV buckets (the first token's share of a token-mean loss is
    1/40 here: a higher lr and more steps)."""
    out = str(tmp_path / "gpu")
    grpo.main([a for a in GRPO if a != "--device=cpu"] + ["--device=cuda", "--rollout_copy=True", f"--out_dir={out}"]
              + variant)
    r = rewards(out)
    assert r[0] < 0.4 and min(r[-3:]) > 0.85, r


def test_dpo_learns_the_probe_preference(tmp_path, one_thread):
    """Chosen: a lowercase letter; rejected: a digit. From a random model (the policy is its own
    reference: held-out reward accuracy 0, margins 0) a few DPO steps make the implicit reward prefer
    the chosen answer on every held-out prompt, by a clear margin."""
    out = str(tmp_path / "dpo")
    dpo.main(PROBE + ["--n_pairs=256", "--eval_pairs=64", "--batch_size=32", "--micro_batch_size=32", "--lr=1e-2",
                      "--beta=0.1", "--max_steps=12", "--eval_every=12", f"--out_dir={out}"])
    with open(os.path.join(out, "train_metrics.jsonl")) as f:
        held = [r for r in map(json.loads, f) if "eval_rewards/accuracies" in r]
    assert [r["step"] for r in held] == [0, 12]
    assert held[0]["eval_rewards/accuracies"] == 0.0 and held[1]["eval_rewards/accuracies"] > 0.95, held
    assert held[0]["eval_rewards/margins"] == 0.0 < 1.0 < held[1]["eval_rewards/margins"], held
