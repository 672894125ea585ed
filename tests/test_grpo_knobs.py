"""GRPO's prompt-selection and entropy knobs (posttrain/selection.py, objectives.logprobs_and_entropy / aggregate).

Proves:
- filter_pass_rate: with a reward set by hand per (prompt, sample) (prompt i passes counts[i] of its k = 4
  samples), by_pass_rate keeps exactly the prompts with 0 < pass rate < 1 (and those within filter_low /
  filter_high when set), across chunks whose last wraps around; none left: one ConfigError naming the key;
  two gloo processes (each rolling out half of every chunk) keep the same prompts as one;
- refill_rounds: rounds whose equal-reward groups are dropped, counted by hand (round 0: 1 informative
  group of 3, round 1: 0, round 2: 3): with 3 more rounds allowed the step stops after round 2 with exactly
  P = 3 groups (round 0's one, round 2's first two; the third is cut), its rows, advantages and
  normalisers those groups'; with 1 more round it stops at the cap with 1 group; a GRPO step (2 epochs,
  KL, micro-batches) on the refilled batch under DP2 (groups spanning ranks, rows dropped unevenly)
  gives one process's weights, gradient norm and logged sums;
- dynamic_sampling alone (no refill, beta 0) scales the gradient by all tokens / kept tokens and leaves an
  AdamW step's weights unchanged (what docs/stages.md says: its use is with refill_rounds);
- entropy_coeff: the entropy term equals, value and gradient, the entropy of softmax(logits / T) computed
  by torch.distributions.Categorical on each completion alone (no padding), masked and normalised like
  the loss (grpo / dapo / dr_grpo); grpo.learn's gradient norm with entropy_coeff = 0.3 is that of the
  hand-built loss - 0.3 x that term (the log-probs of the entropy path equal token_logprobs');
- the keys' checks: one line naming the key.
"""
import os
from types import SimpleNamespace

import pytest
import torch
from test_grpo import LAYOUT_CFG, STOP, V, build, grpo_cfg, learn, one_step

import generate
import grpo
from posttrain import objectives, selection

pytestmark = pytest.mark.usefixtures("one_thread")

COUNTS = [0, 1, 2, 3, 4, 0, 4, 2, 1]  # prompt i passes COUNTS[i] of its 4 samples


def knob_cfg(**kw):
    return grpo_cfg(**{**selection.DEFAULTS, **kw})


def filter_sample(grid, k=4):
    """sample(idx, k, at) as grpo.main's: this data rank's rows of the len(idx) x k completions, rewards by hand."""
    def sample(idx, n, at):
        per = len(idx) * n // grid.data_world
        rows = range(grid.data_rank * per, (grid.data_rank + 1) * per)
        rewards = torch.tensor([float(c % n < COUNTS[idx[c // n]]) for c in rows])
        r = SimpleNamespace(tokens=torch.full((per, 2), STOP), lengths=torch.ones(per, dtype=torch.long), prompt_len=1)
        return r, rewards, {}, 0.0
    return sample


def kept(grid, **kw):
    cfg = knob_cfg(filter_pass_rate=4, batch_size=8, **kw)  # chunks of 2 prompts: the fifth wraps around
    quiet = lambda line: None
    return selection.by_pass_rate((list(range(len(COUNTS))),), filter_sample(grid), cfg, grid, [STOP], quiet)[0]


def test_filter_keeps_prompts_strictly_between():
    import config
    import parallel
    grid = parallel.init(knob_cfg())
    assert kept(grid) == [1, 2, 3, 7, 8]
    assert kept(grid, filter_low=0.25, filter_high=0.8) == [2, 3, 7]  # 2 or 3 passes of 4
    with pytest.raises(config.ConfigError, match="filter_pass_rate=4: no training prompt"):
        kept(grid, filter_low=0.9)


def _filter_ranks(rank, out_dir):
    import parallel
    torch.save(kept(parallel.init(knob_cfg())), os.path.join(out_dir, f"rank{rank}.pt"))


def test_filter_two_processes_agree_with_one(tmp_path):
    from distributed import spawn
    spawn(_filter_ranks, 2, str(tmp_path))
    assert [torch.load(tmp_path / f"rank{k}.pt") for k in range(2)] == [[1, 2, 3, 7, 8]] * 2


# ----------------------------------------------------------------------------- refill

P, G = 3, 4
ROUND_REWARDS = [[1, 1, 1, 1, 0, 1, 0, 0, 0, 0, 0, 0],   # round 0: group 1 informative
                 [1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1],   # round 1: none
                 [1, 0, 0, 0, 0, 1, 1, 1, 1, 0, 1, 0]]   # round 2: all three


def round_rollout(model, j, T=0.8):
    """Round j's P x G completions by hand: prompts of up to 4 + j tokens, completions of up to 6 - j (so
    the rounds' widths differ), each ending with STOP, old log-probs near the model's."""
    g = torch.Generator().manual_seed(10 + j)
    R, S0, N = P * G, 4 + j, 6 - j
    plen, lengths = torch.randint(2, S0 + 1, (R,), generator=g), torch.randint(1, N + 1, (R,), generator=g)
    tokens, mask = torch.randint(6, V, (R, S0 + N), generator=g), torch.zeros(R, S0 + N, dtype=torch.bool)
    for i in range(R):
        mask[i, S0 - plen[i]:S0 + lengths[i]] = True
        tokens[i, S0 + lengths[i] - 1] = STOP
    tokens = tokens * mask
    with torch.no_grad():
        old = grpo.token_logprobs(model, tokens, mask, S0, T)
    old = (old + 0.1 * torch.randn(old.shape, generator=g)) * mask[:, S0:]
    return generate.Rollout(tokens, mask, old, lengths, S0), torch.tensor(ROUND_REWARDS[j], dtype=torch.float)


def refilled(cfg, grid, extra):
    """selection.refill over round_rollout's rounds, this data rank's rows of each."""
    model = build()
    per = P * G // grid.data_world
    rows = slice(grid.data_rank * per, (grid.data_rank + 1) * per)

    def round_of(j, need):
        r, rewards = round_rollout(model, j)
        mine = generate.Rollout(r.tokens[rows], r.mask[rows], r.logprobs[rows], r.lengths[rows], r.prompt_len)
        return grpo.score(mine, rewards[rows], grid, cfg, [STOP], need)
    return selection.refill(round_of, P, G, extra, grid)


def test_refill_counts_by_hand():
    import parallel
    cfg = knob_cfg(dynamic_sampling=True, refill_rounds=3)
    grid = parallel.init(cfg)
    batch, stats = refilled(cfg, grid, 3)
    assert stats["rounds"] == 3 and stats["groups"] == 9 and stats["equal"] == 5 and batch.n_seqs == P * G
    model = build()
    (r0, w0), (r2, w2) = round_rollout(model, 0), round_rollout(model, 2)
    want_rows = [(r0, w0, i) for i in range(4, 8)] + [(r2, w2, i) for i in range(8)]  # round 0's group 1, round 2's 0-1
    assert batch.tokens.shape[0] == 12 and batch.start == 6 and batch.old.shape[1] == 6
    for row, (r, w, i) in enumerate(want_rows):
        n = int(r.lengths[i])
        assert torch.equal(batch.tokens[row, 6:6 + n], r.tokens[i, r.prompt_len:r.prompt_len + n])
        assert torch.equal(batch.mask[row].sum(), r.mask[i].sum()) and batch.loss_mask[row].sum() == n
        assert torch.allclose(batch.adv[row], grpo.advantages(w, G)[i])
    assert batch.n_tokens == sum(int(r.lengths[i]) for r, _, i in want_rows)
    batch, stats = refilled(cfg, grid, 1)  # the cap: round 1 finds nothing, the step learns from round 0's group
    assert stats["rounds"] == 2 and batch.n_seqs == G and batch.loss_mask.any(1).sum() == G


def _refill_ranks(rank, out_dir):
    import parallel
    cfg = knob_cfg(data_parallel="ddp", refill_rounds=3, **LAYOUT_CFG)
    grid = parallel.init(cfg)
    torch.save(refill_step(cfg, grid), os.path.join(out_dir, f"rank{rank}.pt"))


def refill_step(cfg, grid):
    """one_step's GRPO step on the refilled batch (test_grpo.one_step with the rollout already scored)."""
    batch, _ = refilled(cfg, grid, 3)
    return one_step(cfg, grid, None, None, batch=batch)


def test_refill_two_processes_equal_one(tmp_path):
    from distributed import assert_close, spawn

    import parallel
    spawn(_refill_ranks, 2, str(tmp_path))
    cfg = knob_cfg(refill_rounds=3, **LAYOUT_CFG)
    want = refill_step(cfg, parallel.init(cfg))
    for k in range(2):
        assert_close(torch.load(tmp_path / f"rank{k}.pt", weights_only=False), want, f"rank {k}")


def test_dynamic_sampling_alone_only_rescales():
    """dynamic_sampling without refill (beta 0): equal groups have zero advantage, so leaving them out only
    divides the loss by fewer tokens: the gradient is the full batch's times all tokens / kept tokens, and
    AdamW divides the scale out (eps 1e-16 here): the same weights after the step, which moved."""
    import parallel
    from model import ModelConfig, Transformer
    r, rewards = round_rollout(build(), 0)  # round 0: 1 informative group of 3
    out = {}
    for ds in (False, True):
        cfg = knob_cfg(dynamic_sampling=ds, grad_clip=0.0, micro_batch_size=12, loss_type="dapo", eps=1e-16)
        grid = parallel.init(cfg)
        batch, _ = grpo.score(r, rewards, grid, cfg, [STOP])
        torch.manual_seed(0)
        net = parallel.parallelize(Transformer(ModelConfig.from_cfg(cfg)), grid, cfg)
        before = {k: v.clone() for k, v in net.full_state(optimizer=False)[0].items()}
        _, norm = learn(net, batch, cfg, 1e-3)
        out[ds] = batch.n_tokens, float(norm), net.full_state(optimizer=False)[0]
    (n_all, g_all, w_all), (n_kept, g_kept, w_kept) = out[False], out[True]
    assert n_kept < n_all and abs(g_kept / g_all - n_all / n_kept) <= 1e-5 * n_all / n_kept
    assert max((w_all[k] - before[k]).abs().max() for k in w_all) > 5e-4  # the step moved the weights
    for k in w_all:
        assert torch.allclose(w_all[k], w_kept[k], atol=1e-6), k


# ----------------------------------------------------------------------------- entropy

@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo"])
def test_entropy_term_value_and_gradient(loss_type):
    model, T = build(), 0.7
    r, _ = round_rollout(build(), 0)
    loss_mask = r.mask[:, r.prompt_len:].clone()
    loss_mask[:4] = False  # a dropped group: no entropy counted there
    logp, ent = objectives.logprobs_and_entropy(model, r.tokens, r.mask, r.prompt_len, T)
    assert torch.allclose(logp, grpo.token_logprobs(model, r.tokens, r.mask, r.prompt_len, T), atol=1e-5)
    got = objectives.aggregate(ent, loss_mask, loss_type, max_len=8)
    g_got = torch.autograd.grad(got, list(model.parameters()))
    per_row = []
    for i in range(r.tokens.shape[0]):  # each completion alone, its real tokens only
        seq = r.tokens[i][r.mask[i]]
        n = int(r.lengths[i])
        logits = model(seq[None, :-1])[0, -n:] / T
        h = torch.distributions.Categorical(logits=logits).entropy() * loss_mask[i, :n]
        per_row.append(h)
    count = float(loss_mask.sum())
    if loss_type == "grpo":
        want = sum(h.sum() / max(float(loss_mask[i].sum()), 1.0) for i, h in enumerate(per_row)) / len(per_row)
    else:
        want = sum(h.sum() for h in per_row) / (count if loss_type == "dapo" else len(per_row) * 8)
    g_want = torch.autograd.grad(want, list(model.parameters()))
    assert abs(got.item() - want.item()) <= 1e-5 * abs(want.item()) and want > 0
    for a, b in zip(g_got, g_want):
        assert torch.allclose(a, b, atol=1e-6, rtol=1e-4)


def test_learn_adds_the_entropy_bonus():
    """grpo.learn with entropy_coeff: its gradient norm is that of policy_loss - coeff x the entropy term."""
    import parallel
    from model import ModelConfig, Transformer
    cfg = knob_cfg(entropy_coeff=0.3, grad_clip=1e9, micro_batch_size=12, loss_type="grpo")
    grid = parallel.init(cfg)
    r, rewards = round_rollout(build(), 2)
    batch, _ = grpo.score(r, rewards, grid, cfg, [STOP])
    torch.manual_seed(0)
    net = parallel.parallelize(Transformer(ModelConfig.from_cfg(cfg)), grid, cfg)
    ref = build()  # the same initial weights (seed 0)
    logp, ent = objectives.logprobs_and_entropy(ref, batch.tokens, batch.mask, batch.start, cfg.temperature)
    loss, _ = grpo.policy_loss(logp, batch.old, batch.adv, batch.loss_mask, loss_type="grpo", n_seqs=batch.n_seqs)
    loss = loss - 0.3 * objectives.aggregate(ent, batch.loss_mask, "grpo", n_seqs=batch.n_seqs)
    loss.backward()
    want = torch.sqrt(sum(p.grad.square().sum() for p in ref.parameters()))
    _, norm = learn(net, batch, cfg, 0.0)
    assert abs(float(norm) - float(want)) <= 1e-5 * float(want)


@pytest.mark.parametrize("key,value,says", [
    ("filter_pass_rate", -1, "filter_pass_rate=-1 must be >= 0"),
    ("filter_low", 0.5, "filter_low=0.5, filter_high=0.5"),
    ("refill_rounds", 2, "refill_rounds=2 refills what dynamic_sampling drops: set dynamic_sampling=True"),
    ("entropy_coeff", -0.1, "entropy_coeff=-0.1 must be >= 0")])
def test_knob_checks_name_the_key(key, value, says):
    import config
    import parallel
    cfg = knob_cfg(**{key: value, **({"filter_high": 0.5} if key == "filter_low" else {})})
    with pytest.raises(config.ConfigError, match=says):
        selection.check(cfg) if key != "entropy_coeff" else grpo.check(cfg, parallel.init(knob_cfg()))
