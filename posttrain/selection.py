"""Which prompts and groups a GRPO step learns from: the start's pass-rate filter and DAPO's refill.

by_pass_rate(): before training (filter_pass_rate = k > 0), the starting policy samples k answers
to every training prompt, in chunks of about batch_size completions, each data rank its contiguous share
(generate.rollout), the rewards summed over the data ranks: every rank keeps the same prompts, those with
filter_low < pass rate < filter_high (a sample passes with a reward >= 1; a cut one earns 0 as in
training). Deterministic given the seed and the layout's data ranks (their seeds).
refill(): DAPO's dynamic sampling with refill (refill_rounds > 0, with dynamic_sampling). As verl's DAPO
trainer (recipe/dapo/dapo_ray_trainer.py: filter_groups, max_num_gen_batches): groups whose rewards are
all equal leave the step, more prompts are rolled out until batch_size / group_size informative groups are
found, the surplus beyond them is cut (the first ones in order are kept). Unlike verl, which raises once
max_num_gen_batches batches did not suffice, the step learns from what refill_rounds more rounds found.
Round j of step s rolls out prompts ((s (refill_rounds + 1) + j) P + i) mod len(train): a step's prompts
follow from its number (a resumed run draws the same); round 0 is the step's prompts without refill.
gather_rewards(): a rollout's rewards over every data rank, after the truncation rule (score's too).
"""
import dataclasses
import math

import torch

import config
import parallel

DEFAULTS = dict(
    filter_pass_rate=0,  # k > 0: k samples of the start per training prompt; train on those with filter_low < pass rate
    filter_low=0.0,      # kept prompts pass more often than this (a pass: a reward >= 1)
    filter_high=1.0,     # and less often than this
    refill_rounds=0,     # dynamic_sampling: up to this many more rollout rounds a step, for batch_size / G signal groups
)


def check(cfg, world=1):
    """The filter's and the refill's settings, one line naming the key at fault."""
    k, low, high = cfg.filter_pass_rate, cfg.filter_low, cfg.filter_high
    config.need(k >= 0, f"filter_pass_rate={k} must be >= 0 (samples per prompt; 0: no filter)")
    config.need(k != 1, "filter_pass_rate=1: one sample cannot have a pass rate strictly between 0 and 1; use >= 2")
    config.need(0 <= low < high <= 1, f"filter_low={low}, filter_high={high}: need 0 <= filter_low < filter_high <= 1")
    config.need(cfg.refill_rounds >= 0, f"refill_rounds={cfg.refill_rounds} must be >= 0")
    config.need(not cfg.refill_rounds or cfg.dynamic_sampling,
                f"refill_rounds={cfg.refill_rounds} refills what dynamic_sampling drops: set dynamic_sampling=True")


KEYS = config.Keys((DEFAULTS, check))  # grpo.py's EXTRA takes them


def gather_rewards(r, rewards, grid, stops, reward_truncated=False):
    """A Rollout and this data rank's rewards (NaN: none) -> (every data rank's rewards in order, which of
    this rank's rows stopped). A completion cut before its end of turn earns 0 unless reward_truncated."""
    R, T, dev = rewards.numel(), r.prompt_len, rewards.device
    last = r.tokens.gather(1, (T + r.lengths - 1)[:, None]).squeeze(1)
    stopped = torch.isin(last, torch.as_tensor(stops, device=dev))
    if not reward_truncated:
        rewards = torch.where(stopped | rewards.isnan(), rewards, torch.zeros_like(rewards))
    every = torch.zeros(R * grid.data_world, device=dev)
    every[grid.data_rank * R:(grid.data_rank + 1) * R] = rewards  # each rank fills its slot (NaN stays NaN)
    return parallel.data_sum(every, grid), stopped


def by_pass_rate(lists, sample, cfg, grid, stops, say=print):
    """lists (the training prompts, their token ids, ...: n each) -> those of the prompts kept (all when
    filter_pass_rate is 0: no sample drawn). sample(idx, k, at) -> (this data rank's Rollout of k samples of
    each prompt idx, its rewards, ...), drawn with step at's seeds: -2 - c for chunk c (evaluate's are -1)."""
    n, k, world = len(lists[0]), cfg.filter_pass_rate, grid.data_world
    if not k:
        return lists
    per = world // math.gcd(k, world)  # chunk prompts x k splits evenly over the data ranks
    c = -(-max(1, cfg.batch_size // k) // per) * per
    passed = torch.zeros(n)
    for chunk, first in enumerate(range(0, n, c)):
        idx = [(first + i) % n for i in range(c)]  # the last chunk wraps around: every chunk has one shape
        r, got = sample(idx, k, -2 - chunk)[:2]
        every, _ = gather_rewards(r, got, grid, stops, cfg.reward_truncated)
        wins = (every.nan_to_num(0.0) >= 1).float().view(c, k).mean(1).cpu()
        passed[first:first + c] = wins[:min(c, n - first)]
    kept = ((passed > cfg.filter_low) & (passed < cfg.filter_high)).nonzero().flatten().tolist()
    counts = torch.histc(passed, bins=10, min=0.0, max=1.0).long().tolist()
    say(f"filter_pass_rate: kept {len(kept):,} of {n:,} prompts with {cfg.filter_low} < pass rate < {cfg.filter_high} "
        f"({k} samples each); {int((passed == 0).sum())} never passed, {int((passed == 1).sum())} always; "
        f"histogram [0, 0.1) .. [0.9, 1]: {counts}")
    config.need(kept, f"filter_pass_rate={k}: no training prompt has {cfg.filter_low} < pass rate < {cfg.filter_high} "
                "under the start; widen filter_low / filter_high, sample more, or set filter_pass_rate=0")
    return [[items[i] for i in kept] for items in lists]


def prompts_of(step, j, P, n, extra):
    """The training prompt indices of round j of a step (round 0 with no refill: step * P + i)."""
    return [((step * (extra + 1) + j) * P + i) % n for i in range(P)]


def refill(round_of, P, G, extra, grid):
    """Rounds until P groups carry a signal or 1 + extra rounds ran -> (Batch, stats with rounds).
    round_of(j, need) -> (Batch, stats) of round j, at most the first `need` informative groups kept (score's limit)."""
    parts, found = [], 0
    for j in range(1 + extra):
        batch, stats = round_of(j, P - found)
        parts.append((batch, stats))
        found += round(batch.n_seqs) // G
        if found >= P:
            break
    stats = {k: sum(s[k] for _, s in parts) for k in parts[0][1]}
    if extra:
        stats["rounds"] = len(parts)
    return (parts[0][0] if len(parts) == 1 else concat([b for b, _ in parts], grid)), stats


def concat(batches, grid):
    """Rounds' Batches as one (prompts left-padded, completions right-padded to the widest), without the rows
    that count no token; every data rank keeps as many rows (padded with dropped ones): equal micro-batches."""
    T, N = max(b.start for b in batches), max(b.old.shape[1] for b in batches)

    def pad(x, left, right, value):
        return torch.nn.functional.pad(x, (left, right), value=value)
    tokens = torch.cat([pad(b.tokens, T - b.start, N - b.old.shape[1], 0) for b in batches])
    mask = torch.cat([pad(b.mask, T - b.start, N - b.old.shape[1], False) for b in batches])
    old, loss_mask = (torch.cat([pad(getattr(b, k), 0, N - b.old.shape[1], v) for b in batches])
                      for k, v in (("old", 0.0), ("loss_mask", False)))
    counts = loss_mask.any(1)
    rows = torch.zeros(grid.data_world, device=tokens.device)
    rows[grid.data_rank] = counts.sum()
    n = max(int(parallel.data_sum(rows, grid).max()), 1)  # at least a row: the reference pass needs one
    order = torch.cat([counts.nonzero().flatten(), (~counts).nonzero().flatten()])[:n]  # the counted rows first
    return dataclasses.replace(batches[0], tokens=tokens[order], mask=mask[order], start=T, old=old[order],
                               loss_mask=loss_mask[order], adv=torch.cat([b.adv for b in batches])[order],
                               n_seqs=sum(b.n_seqs for b in batches), n_tokens=sum(b.n_tokens for b in batches))
