"""Why a GRPO run does not learn: rules over its logged metrics, each a plain function, each naming what to try.

    warnings(history) -> [(kind, line)]   # history: grpo.py's logged records in order ({"step", metric: value})

dead(m, cfg) reads one log line's means (a run without signal: every group's rewards equal, or nearly every
completion truncated); grpo.py warns when it holds for dead_steps in a row. The rules of warnings() read the
history of training records (reward, frac_equal_groups, entropy, kl, clip_low / clip_high / cispo_clip) and
evaluation records (heldout_greedy, heldout_reward: held-out samples, as in training) for a run that trains
but does not improve; grpo.py says each kind once per run (rank 0). The bands (BANDS) are conservative
heuristics, not laws: a warning is a hint of what to try, never an error. entropy is the mean -log p of the
sampled tokens (an estimate of the policy's per-token entropy at the sampling temperature).
"""

BANDS = dict(
    evals=4,          # the window: the last this many held-out evaluations (and the training steps since the first)
    flat=0.02,        # held-out accuracy changed by less than this over the window: flat
    rising=0.05,      # training reward / held-out sampled reward rose by at least this: rising
    informative=0.2,  # share of groups with unequal rewards (1 - frac_equal_groups) that counts as a signal
    entropy_low=0.2,  # entropy below this fraction of the run's first: collapsing
    entropy_high=3.0,  # above this multiple: exploding
    clip=0.2,         # share of tokens whose ratio was clipped (PPO's usual ~0.1; above 0.2 the steps are too big)
    kl=0.1,           # k3 per token to the reference (beta > 0) above this, and still growing
)


def dead(m, cfg):
    """What is wrong with a stretch of steps that cannot learn (their logged means m), and what to try;
    None while the run has signal. Equal rewards in (nearly) every group give zero advantages: no gradient."""
    if m["truncated"] >= 0.9 and (cfg.mask_truncated or not cfg.reward_truncated):  # truncated: no reward / token
        return (f"{m['truncated']:.0%} of completions ran to max_new_tokens={cfg.max_new_tokens} without their end of "
                "turn, so they earn nothing: raise max_new_tokens, lower lr, or start from a model that stops "
                "(more SFT)")
    if m["frac_equal_groups"] >= 0.95:
        if m["reward"] <= 0.05:
            return ("every sample of nearly every prompt earns 0: nothing to reinforce. The task is too hard for this "
                    "model: fine-tune it first (sft.py), make the task easier (task_args), or sample more (group_size, "
                    "temperature)")
        if m["reward"] >= 0.95:
            return "every sample of nearly every prompt is right: the task is solved; harder prompts (task_args)"
        return ("the rewards of each group are all equal: check that the reward varies between completions "
                "(a reward that only sees the prompt), or sample more (group_size, temperature)")
    return None


def window(history, k):
    """(the last k evaluation records, the training records since the first of them); ([], []) before k evaluations."""
    evals = [h for h in history if "heldout_greedy" in h][-k:]
    if len(evals) < k or k < 2:
        return [], []
    return evals, [h for h in history if "reward" in h and h["step"] > evals[0]["step"]]


def rise(records, key):
    """The mean of key over the later half of records minus the earlier half (0 with fewer than 2)."""
    xs = [r[key] for r in records if key in r]
    if len(xs) < 2:
        return 0.0
    h = len(xs) // 2
    return sum(xs[-h:]) / h - sum(xs[:h]) / h


def change(evals, key):
    """key's last minus its first value over the evaluations (0 when either lacks it)."""
    return evals[-1][key] - evals[0][key] if key in evals[0] and key in evals[-1] else 0.0


def heldout_flat(evals, b):
    """Held-out greedy accuracy and the held-out sampled reward both rose by less than flat (or fell)."""
    return change(evals, "heldout_greedy") < b["flat"] and change(evals, "heldout_reward") < b["flat"]


def flat_heldout(history, b=BANDS):
    """(kind, line) when held-out accuracy (greedy and sampled) is flat or falls over the window while training
    rises (reward_without_heldout: fitting the training prompts, or gaming the reward) or only carries signal
    (signal_without_gain: informative groups, a flat training reward)."""
    evals, train = window(history, b["evals"])
    if not train or not heldout_flat(evals, b):
        return None
    up, informative = rise(train, "reward"), sum(1 - t["frac_equal_groups"] for t in train) / len(train)
    seen = (f"held-out greedy accuracy went {evals[0]['heldout_greedy']:.3f} -> {evals[-1]['heldout_greedy']:.3f} "
            f"over the last {len(evals)} evaluations")
    if up >= b["rising"]:
        return "reward_without_heldout", (f"the training reward rose by {up:.3f} while {seen}: the policy fits the "
                                          "training prompts or games the reward. More training prompts "
                                          "(train_prompts), check the reward against strict / lenient accuracy, "
                                          "lower lr, raise beta")
    if informative >= b["informative"]:
        return "signal_without_gain", (f"{informative:.0%} of groups carry a learning signal, yet the training reward "
                                       f"rose by {up:.3f} (under {b['rising']}) and {seen}: give each step more groups "
                                       "that carry a signal: dynamic_sampling=True with refill_rounds=2 (alone it "
                                       "only rescales the loss, which AdamW undoes), more samples per prompt "
                                       "(group_size), or filter prompts by pass rate (keep those the model sometimes "
                                       "solves); a higher lr last (measured: larger steps lose greedy accuracy first)")
    return None


def greedy_against_sampled(history, b=BANDS):
    """Held-out greedy accuracy falls while the held-out sampled reward rises."""
    evals, _ = window(history, b["evals"])
    greedy, sampled = (change(evals, k) if evals else 0.0 for k in ("heldout_greedy", "heldout_reward"))
    if greedy <= -b["flat"] and sampled >= b["flat"]:
        return (f"held-out greedy accuracy fell by {-greedy:.3f} while the held-out sampled reward rose by "
                f"{sampled:.3f}: the samples improve, not the mode. Lower temperature (train closer to greedy "
                "decoding), lower lr, or judge the run by sampled accuracy")
    return None


def entropy(history, b=BANDS):
    """(kind, line) when the samples' entropy fell below entropy_low or rose above entropy_high times its first."""
    xs = [h["entropy"] for h in history if "entropy" in h]
    if len(xs) < 2 or xs[0] <= 0:
        return None
    if xs[-1] < b["entropy_low"] * xs[0]:
        return "entropy_collapse", (f"the entropy of the samples collapsed ({xs[0]:.3f} -> {xs[-1]:.3f} nats per "
                                    "token): groups stop differing. Raise temperature, raise beta, lower lr, or "
                                    "clip_high=0.28 (DAPO's clip-higher)")
    if xs[-1] > b["entropy_high"] * xs[0]:
        return "entropy_explode", (f"the entropy of the samples exploded ({xs[0]:.3f} -> {xs[-1]:.3f} nats per "
                                   "token): the policy drifts toward noise. Lower lr, raise beta, or lower "
                                   "temperature")
    return None


def clipped(history, b=BANDS):
    """The latest training record's share of clipped tokens above clip."""
    last = next((h for h in reversed(history) if "reward" in h), {})
    share = last.get("cispo_clip", last.get("clip_low", 0) + last.get("clip_high", 0))
    if share > b["clip"]:
        return (f"{share:.0%} of tokens had their ratio clipped (usually < {b['clip']:.0%}): each rollout moves "
                "the policy too far. Lower lr, or fewer grpo_epochs")
    return None


def kl_growing(history, b=BANDS):
    """The KL to the reference (logged when beta > 0) above kl and higher than at the start of the window."""
    xs = [h["kl"] for h in history if "kl" in h]
    if len(xs) >= 2 and xs[-1] > b["kl"] and xs[-1] > xs[0]:
        return (f"the KL to the reference grew to {xs[-1]:.3f} per token (usually < {b['kl']}): the policy "
                "leaves its start. Raise beta, or lower lr")
    return None


RULES = {"greedy_against_sampled": greedy_against_sampled, "clipped": clipped, "kl_growing": kl_growing}  # kind: rule
KINDED = (flat_heldout, entropy)  # rules that return (kind, line): one of two kinds each


def warnings(history, b=BANDS):
    """Every rule that holds on history: [(kind, line)]."""
    return ([found for rule in KINDED if (found := rule(history, b))]
            + [(kind, line) for kind, rule in RULES.items() if (line := rule(history, b))])
