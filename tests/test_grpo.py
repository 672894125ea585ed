"""GRPO (grpo.py): its math against hand-worked values and TRL, its log-probs against the model,
its step against one process.

Proves:
- golden values (issue 18): advantages [1,0,1,0] -> +-0.86588 (sample std + 1e-4), [1,1,1,0] ->
  [0.4999, 0.4999, 0.4999, -1.4997], Dr. GRPO [1,0,1,0] -> +-0.5, batch std worked by hand, a
  reward of None (NaN) left out of its group's statistics with A = 0; k3(ref - logp) = 0, 0.00517,
  0.00484, 0.71828 at 0, +0.1, -0.1, 1; at ratio 1, beta 0, A = [.866, -.866, .866, -.866], lengths
  [3, 5, 2, 6]: grpo 0.0, dapo 0.3247, dr_grpo (L = 8) 0.1624;
- autograd: dL/dlogp = -A mask / N for each aggregation (N = |o_i| G, sum of mask, G L); a token
  whose ratio is outside the clip range gets zero gradient (1.3 with A > 0, 0.7 with A < 0), and
  with clip_high 0.28 the bound is 1.28 (1.27 still learns); a step split into micro-batches with
  the step's normalisers adds up to the whole batch's loss;
- the policy gradient: on one-token completions with an exactly computable expected reward, the
  loss's gradient over 4 x 256 samples is minus the exact gradient of the expected reward (cosine
  > 0.97, norm within 10%): signs, advantages, temperature and normalisers agree end to end;
- TRL parity: GRPOTrainer._compute_loss (TRL 1.16, tiny local LLaMA, no hub, generation skipped) on
  a hand-built batch (left-padded prompts, ragged completions, old and reference log-probs away from
  the policy's) equals ours on the same weights (hf.load_hf), for grpo / dapo / dr_grpo, beta 0 and
  0.04, with and without the ratio on the KL term, token and sequence (GSPO) ratios: loss within
  1e-5, and the gradients of the embedding and head within 1e-5 relative;
- temperature: the rollout's (old), the policy's (new) and the reference's log-probs all equal
  log_softmax(logits / T) of a plain forward at T = 0.7, which differs from T = 1 by far more
  than the tolerance (so a path that forgot T fails); a LoRA model's reference (lora.disabled) is
  the base model's, and the adapters come back after it;
- rewards to a batch (score): rewards gathered before the group statistics, dynamic sampling
  drops groups of equal rewards from the loss mask and the normaliser, mask_truncated drops
  completions that did not stop, the end-of-turn token is in the completion mask; the entropy
  estimate's sum (neglogp) is -sum of the generated tokens' rollout log-probs;
- the rollout copy (generate.cast_copy / refresh): after a step the refreshed copy holds the trained
  weights cast to bf16 at unchanged addresses; in fp32 it samples the trained model's tokens and
  log-probs (also through a decoder kept across calls); in bf16 under CPU bf16 autocast exactly the
  fp32 model's under that autocast; grpo.main logs the same with and without it (a stale copy does
  not), and plots.py draws the reward and step-time panels from its log;
- layouts (one 4-process gloo spawn): under TP2 x DP2 and TP2 x FSDP2 (inside full_params) every
  rank of a TP group samples the same tokens as one process with its data rank's seed
  (rollout_seed(seed, step, grid)); a GRPO step (3 prompts x 4 samples, groups spanning data
  ranks, micro-batches, 2 epochs, clip-higher, KL to a reference, dynamic sampling and overlong
  filtering) under TP2 x DP2, TP2 x FSDP2, DP4 and FSDP4 gives the one-process weights, gradient
  norm and logged sums (relative error <= 1e-5) on the same rollouts: rewards are gathered across
  ranks before the advantages, the normalisers are the step's. (DP4 / FSDP4 stand in for the
  issue's DP2 / FSDP2: the same code with more ranks, in the one spawn.)
"""
import os
from types import SimpleNamespace

import pytest
import torch

import generate
import grpo
import lora
from model import ModelConfig, Transformer

pytestmark = pytest.mark.usefixtures("one_thread")

V = 64
LLAMA = dict(vocab_size=V, block_size=32, n_layer=2, n_head=4, n_kv_head=2, n_embd=32, init_std=0.2)



def learn(net, batch, cfg, lr):
    """grpo.learn at a fixed learning rate (the stage sets it with optim.set_lr first)."""
    for g in net.optimizer.param_groups:
        g["lr"] = lr * g.get("lr_scale", 1.0)
    return grpo.learn(net, batch, cfg)

def build(seed=0, **kw):
    torch.manual_seed(seed)
    return Transformer(ModelConfig(**{**LLAMA, **kw}))


# ----------------------------------------------------------------------------- golden values

def test_advantages_golden():
    A = grpo.advantages(torch.tensor([1.0, 0, 1, 0]), 4)
    assert torch.allclose(A, torch.tensor([0.86588, -0.86588, 0.86588, -0.86588]), atol=1e-5)
    A = grpo.advantages(torch.tensor([1.0, 1, 1, 0]), 4)
    assert torch.allclose(A, torch.tensor([0.4999, 0.4999, 0.4999, -1.4997]), atol=1e-4)
    assert torch.equal(grpo.advantages(torch.tensor([1.0, 0, 1, 0]), 4, "none"), torch.tensor([0.5, -0.5, 0.5, -0.5]))
    # batch std of [1,0,1,0,1,1,1,1]: mean 0.75, squares 1.5 / 7; group means 0.5 and 1
    A = grpo.advantages(torch.tensor([1.0, 0, 1, 0, 1, 1, 1, 1]), 4, "batch")
    s = (1.5 / 7) ** 0.5 + 1e-4
    assert torch.allclose(A, torch.tensor([0.5 / s, -0.5 / s, 0.5 / s, -0.5 / s, 0, 0, 0, 0]), atol=1e-6)
    # None (NaN) is left out: the group is [1, 1, 0] -> mean 2/3, std sqrt(1/3); its own A is 0
    A = grpo.advantages(torch.tensor([1.0, float("nan"), 1, 0]), 4)
    s = (1 / 3) ** 0.5 + 1e-4
    assert torch.allclose(A, torch.tensor([(1 / 3) / s, 0, (1 / 3) / s, -(2 / 3) / s]), atol=1e-6)
    with pytest.raises(ValueError, match="scale"):
        grpo.advantages(torch.zeros(4), 4, "std")


def test_k3_golden():
    got = grpo.k3(torch.tensor([0.0, 0.1, -0.1, 1.0]), torch.zeros(4))
    assert torch.allclose(got, torch.tensor([0.0, 0.00517, 0.00484, 0.71828]), atol=1e-5)


A4 = torch.tensor([0.866, -0.866, 0.866, -0.866])
MASK4 = torch.arange(8)[None] < torch.tensor([3, 5, 2, 6])[:, None]


@pytest.mark.parametrize("loss_type, value, N", [
    ("grpo", 0.0, MASK4.sum(1, keepdim=True).float() * 4), ("dapo", 0.3247, 16.0), ("dr_grpo", 0.1624, 4 * 8.0)])
def test_loss_golden_and_gradient(loss_type, value, N):
    logp = torch.randn(4, 8).requires_grad_()
    loss, _ = grpo.policy_loss(logp, logp.detach(), A4, MASK4, loss_type=loss_type)
    assert abs(loss.item() - value) < 1e-4
    loss.backward()
    assert torch.allclose(logp.grad, -A4[:, None] * MASK4 / N, atol=1e-7)


def test_clipped_tokens_get_no_gradient():
    def grads(ratio, adv, **kw):
        logp = torch.zeros(1, 1, requires_grad=True)
        grpo.policy_loss(logp, -torch.tensor([[ratio]]).log(), torch.tensor([adv]), torch.ones(1, 1, dtype=torch.bool),
                         **kw)[0].backward()
        return logp.grad.item()
    assert grads(1.3, 1.0) == 0 and grads(0.7, -1.0) == 0  # outside [0.8, 1.2] on the side A pushes to
    assert grads(1.3, -1.0) == pytest.approx(1.3) and grads(0.7, 1.0) == pytest.approx(-0.7)  # the other side learns
    assert grads(1.27, 1.0, eps_high=0.28) == pytest.approx(-1.27) and grads(1.29, 1.0, eps_high=0.28) == 0
    assert grads(1.27, 1.0) == 0  # symmetric 0.2: 1.27 is clipped


@pytest.mark.parametrize("loss_type", grpo.LOSS_TYPES)
def test_micro_batches_add_up(loss_type):
    g = torch.Generator().manual_seed(0)
    logp, old, ref = (torch.randn(6, 5, generator=g) * 0.3 for _ in range(3))
    adv, mask = torch.randn(6, generator=g), torch.rand(6, 5, generator=g) > 0.3
    kw = dict(loss_type=loss_type, beta=0.1, ref_logp=ref, eps_high=0.28)
    whole = grpo.policy_loss(logp, old, adv, mask, **kw)[0]
    parts = sum(grpo.policy_loss(logp[i:i + 2], old[i:i + 2], adv[i:i + 2], mask[i:i + 2], n_seqs=6,
                                 n_tokens=mask.sum(), max_len=5, **{**kw, "ref_logp": ref[i:i + 2]})[0]
                for i in range(0, 6, 2))
    assert abs(whole.item() - parts.item()) < 1e-6


def test_gradient_estimates_the_expected_reward_gradient():
    """One-token completions of a tiny model, reward 1 when the token is in the lower half of the
    vocabulary: the expected reward is exact (softmax(logits / T) summed over that half). The
    gradient of the loss on 4 x 256 sampled completions (rollout, score, token_logprobs,
    policy_loss; Dr. GRPO advantages) is minus the exact gradient: cosine > 0.97, norm within 10%."""
    import parallel
    model, T, G = build(), 0.7, 256
    cfg = grpo_cfg(group_size=G, scale_rewards="none", temperature=T)
    prompts = [torch.randint(0, V, (5,), generator=torch.Generator().manual_seed(i)) for i in range(4)]
    r, _ = generate.rollout(model, prompts, G, 0, 1, 1, vocab=V, temperature=T, seed=1)
    batch, _ = grpo.score(r, (r.tokens[:, -1] < V // 2).float(), parallel.init(cfg), cfg, [])
    logp = grpo.token_logprobs(model, batch.tokens, batch.mask, batch.start, T)
    params = list(model.parameters())
    estimate = torch.autograd.grad(grpo.policy_loss(logp, batch.old, batch.adv, batch.loss_mask)[0], params)
    exact = torch.autograd.grad((model(torch.stack(prompts))[:, -1] / T).softmax(-1)[:, :V // 2].sum(-1).mean(),
                                params)
    dot = sum((-a * b).sum() for a, b in zip(estimate, exact))
    norms = [sum(g.square().sum() for g in gs).sqrt() for gs in (estimate, exact)]
    assert dot / (norms[0] * norms[1]) > 0.97 and 0.9 < norms[0] / norms[1] < 1.1


# ----------------------------------------------------------------------------- TRL parity

def test_trl_parity(tmp_path):
    transformers = pytest.importorskip("transformers")
    trl = pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    tokenizers = pytest.importorskip("tokenizers")
    import hf
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, initializer_range=0.2, bos_token_id=None,
        eos_token_id=1, pad_token_id=0)).save_pretrained(str(tmp_path))
    words = tokenizers.Tokenizer(tokenizers.models.WordLevel(
        {"<pad>": 0, "<eos>": 1, **{f"t{i}": i for i in range(2, V)}}, unk_token="<pad>"))
    words.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=words, eos_token="<eos>", pad_token="<pad>")
    ours = hf.load_hf(str(tmp_path))

    T, B, P, C = 0.7, 4, 5, 7
    g = torch.Generator().manual_seed(1)
    prompt_mask = (torch.arange(P)[None] >= P - torch.tensor([5, 3, 4, 2])[:, None]).long()  # left-padded
    completion_mask = (torch.arange(C)[None] < torch.tensor([3, 7, 2, 6])[:, None]).long()
    prompt_ids = torch.randint(2, V, (B, P), generator=g) * prompt_mask
    completion_ids = torch.randint(2, V, (B, C), generator=g) * completion_mask
    tokens = torch.cat([prompt_ids, completion_ids], 1)
    mask = torch.cat([prompt_mask, completion_mask], 1).bool()
    with torch.no_grad():
        lp = grpo.token_logprobs(ours, tokens, mask, P, T)
    old = (lp + 0.3 * torch.randn(B, C, generator=g)) * completion_mask  # ratios across the clip range
    ref = (lp + 0.3 * torch.randn(B, C, generator=g)) * completion_mask
    adv = torch.tensor([0.9, -1.2, 0.4, -0.3])
    data = datasets.Dataset.from_dict({"prompt": ["t2 t3"] * 4})
    for lt in grpo.LOSS_TYPES:  # one trainer per loss type; the variants set what GRPOConfig's fields set
        args = trl.GRPOConfig(
            output_dir=str(tmp_path / "out"), use_cpu=True, bf16=False, gradient_checkpointing=False, report_to="none",
            per_device_train_batch_size=4, num_generations=4, max_completion_length=C + 1, loss_type=lt, beta=0.04,
            temperature=T, epsilon=0.2, epsilon_high=0.28)
        trainer = trl.GRPOTrainer(model=str(tmp_path), reward_funcs=lambda completions, **k: [0.0] * len(completions),
                                  args=args, train_dataset=data, processing_class=tok)
        trainer.model.train()
        trainer.current_gradient_accumulation_steps = 1
        for beta, level, kr in [(0.0, "token", True), (0.0, "sequence", True), (0.04, "token", True),
                                (0.04, "sequence", True), (0.04, "token", False)]:
            trainer.beta, trainer.importance_sampling_level, args.use_bias_correction_kl = beta, level, kr
            trainer.model.zero_grad()
            theirs = trainer._compute_loss(trainer.model, dict(
                prompt_ids=prompt_ids, prompt_mask=prompt_mask, completion_ids=completion_ids,
                completion_mask=completion_mask, advantages=adv, old_per_token_logps=old, ref_per_token_logps=ref,
                num_items_in_batch=completion_mask.sum()))
            ours.zero_grad()
            mine = grpo.policy_loss(grpo.token_logprobs(ours, tokens, mask, P, T), old, adv, completion_mask.bool(),
                                    loss_type=lt, eps_low=0.2, eps_high=0.28, beta=beta, ref_logp=ref, kl_ratio=kr,
                                    level=level, max_len=C + 1)[0]
            case = f"{lt} beta={beta} {level} kl_ratio={kr}"
            assert abs(theirs.item() - mine.item()) <= 1e-5, f"{case}: TRL {theirs.item()} ours {mine.item()}"
            theirs.backward()
            mine.backward()
            for a, b in [(ours.tok_emb.weight.grad, trainer.model.model.embed_tokens.weight.grad),
                         (ours.head.weight.grad, trainer.model.lm_head.weight.grad)]:
                assert ((a - b).norm() / b.norm()).item() <= 1e-5, case


# ----------------------------------------------------------------------------- temperature, LoRA reference

def plain_logprobs(model, tokens, start, temperature):
    """log_softmax(logits / T) of one plain forward per row (no padding), at the completion tokens."""
    with torch.no_grad():
        logits = model(tokens)[:, start - 1:-1]
    return (logits / temperature).log_softmax(-1).gather(-1, tokens[:, start:, None]).squeeze(-1)


def test_all_logprobs_use_the_temperature():
    import parallel
    T = 0.7
    cfg = grpo_cfg(temperature=T, micro_batch_size=3, clip_low=1e-4, clip_high=1e-4, beta=0.1)
    run = parallel.parallelize(build(), parallel.init(cfg), cfg)
    model = run.raw
    prompts = [torch.randint(0, V, (6,), generator=torch.Generator().manual_seed(i)) for i in range(2)]
    r, which = generate.rollout(model, prompts, G, 0, 1, 8, vocab=V, temperature=T, seed=3)  # no stop token: every row 8 long
    assert which == [0] * G + [1] * G
    want = plain_logprobs(model, r.tokens, r.prompt_len, T)
    at_one = plain_logprobs(model, r.tokens, r.prompt_len, 1.0)
    assert (want - at_one).abs().max() > 0.05  # T matters here
    batch, _ = grpo.score(r, torch.tensor([1.0, 0, 0, 1, 0, 1, 1, 0]), run.grid, cfg, [STOP])
    with torch.no_grad():
        new = grpo.token_logprobs(model, r.tokens, r.mask, r.prompt_len, T)
    batch.ref = grpo.reference_logprobs(model, batch, cfg)
    for name, got in [("old (rollout)", r.logprobs), ("new", new), ("reference", batch.ref)]:
        assert (got - want).abs().max() <= 1e-5, name
    # inside learn(): the policy's ratio to the rollout is 1 (no token outside a 1e-4 clip range) and
    # k3 to the same weights is 0; rollout log-probs taken at T = 1 instead put tokens outside
    sums, _ = learn(run, batch, cfg, 0.0)
    assert sums[0] <= 1e-6 * sums[3] and sums[1] == sums[2] == 0 and sums[3] == 64
    batch.old = at_one
    sums, _ = learn(run, batch, cfg, 0.0)
    assert sums[1] + sums[2] > 10


def test_lora_reference_is_the_base():
    import types

    from distributed import train_cfg

    import parallel
    model = build()
    tokens = torch.randint(0, V, (3, 12), generator=torch.Generator().manual_seed(0))
    base = plain_logprobs(model, tokens, 4, 0.7)
    cfg = train_cfg(LLAMA, lora_r=4, dtype="float32")
    lora.apply(model, cfg, parallel.init(types.SimpleNamespace(device="cpu", tp=1, ep=1)))
    with torch.no_grad():
        for m in lora.adapted(model):
            for B in m.lora_B.values():
                B.normal_(0, 0.5)
    tuned = plain_logprobs(model, tokens, 4, 0.7)
    assert (tuned - base).abs().max() > 0.05
    with lora.disabled(model):
        assert (plain_logprobs(model, tokens, 4, 0.7) - base).abs().max() <= 1e-6
    assert torch.equal(plain_logprobs(model, tokens, 4, 0.7), tuned)
    lora.merge(model)
    with pytest.raises(ValueError, match="unmerge"):
        with lora.disabled(model):
            pass


# ----------------------------------------------------------------------------- the rollout copy

def test_rollout_copy_refreshed_and_same_tokens():
    """generate.cast_copy / refresh (grpo's rollout_copy): after a GRPO step the refreshed copy holds
    the trained weights cast to bf16 (nn.Linear weights, the tied head too) and fp32 elsewhere, at
    unchanged addresses; in fp32 its rollout gives the trained model's tokens and log-probs, also
    through a decoder kept across calls (keep=); in bf16 under CPU bf16 autocast it samples exactly
    what the fp32 model under that autocast samples (autocast's casts are the copy's)."""
    import parallel
    cfg = grpo_cfg(lr=1e-2, warmup_steps=0)
    run = parallel.parallelize(build(tie_embeddings=True), parallel.init(cfg), cfg)
    raw = run.raw
    copy = generate.cast_copy(raw, torch.bfloat16)
    assert copy.head.weight.dtype == torch.bfloat16 and copy.tok_emb.weight.dtype == torch.float32
    assert copy.blocks[0].attn.qkv.weight.dtype == torch.bfloat16 and copy.norm_f.weight.dtype == torch.float32
    ptrs = [t.data_ptr() for t in copy.parameters()]
    r, rewards = synthetic(raw)
    batch, _ = grpo.score(r, rewards, run.grid, cfg, [STOP])
    learn(run, batch, cfg, cfg.lr)

    def cast(name, t):
        return dict(raw.named_parameters(remove_duplicate=False))[name].detach().to(t.dtype)
    assert not all(torch.equal(t, cast(n, t)) for n, t in copy.named_parameters())  # the step moved the weights
    assert generate.refresh(copy, raw) is copy and [t.data_ptr() for t in copy.parameters()] == ptrs
    for name, t in copy.named_parameters():
        assert torch.equal(t, cast(name, t)), name
    assert torch.equal(copy.head.weight, raw.tok_emb.weight.detach().bfloat16())  # tied in raw, refreshed too

    prompts = [torch.randint(0, V, (n,), generator=torch.Generator().manual_seed(n)) for n in (3, 6)]
    sampling = dict(temperature=0.8, stop_tokens=[STOP], seed=4)
    want, _ = generate.rollout(raw, prompts, G, 0, 1, N, vocab=V, **sampling)
    fp32, keep = generate.cast_copy(raw, torch.float32), {}
    got, _ = generate.rollout(fp32, prompts, G, 0, 1, N, vocab=V, **sampling)
    assert torch.equal(got.tokens, want.tokens) and torch.equal(got.logprobs, want.logprobs)
    for seed in (4, 5, 4):  # kept across calls (its cache rounded up to 64 slots), each call's own tokens
        got, _ = generate.rollout(fp32, prompts, G, 0, 1, N, vocab=V, keep=keep, **{**sampling, "seed": seed})
        assert torch.equal(got.tokens, want.tokens) == (seed == 4) and len(keep) == 1
    assert torch.allclose(got.logprobs, want.logprobs, atol=1e-5) and torch.equal(got.mask, want.mask)
    with torch.autocast("cpu", torch.bfloat16):
        want, _ = generate.rollout(raw, prompts, G, 0, 1, N, vocab=V, **sampling)
        got, _ = generate.rollout(copy, prompts, G, 0, 1, N, vocab=V, **sampling)
    assert torch.equal(got.tokens, want.tokens) and torch.equal(got.logprobs, want.logprobs)


# ----------------------------------------------------------------------------- rewards to a batch

STOP, P, G, N = 5, 3, 4, 6


def synthetic(model, T=0.8):
    """A Rollout of P x G completions by hand (left-padded prompts, ragged completions, rows 1, 4, 7, 10
    cut at N without a stop token, the others ending with STOP), old log-probs near the model's, and
    0/1 rewards: group 0 all 1 (equal), group 1 with a None."""
    g = torch.Generator().manual_seed(5)
    R, S0 = P * G, 5
    plen = torch.randint(2, S0 + 1, (R,), generator=g)
    lengths = torch.randint(2, N + 1, (R,), generator=g)
    lengths[1::3] = N
    tokens = torch.randint(6, V, (R, S0 + N), generator=g)
    mask = torch.zeros(R, S0 + N, dtype=torch.bool)
    for i in range(R):
        mask[i, S0 - plen[i]:S0 + lengths[i]] = True
        if i % 3 != 1:
            tokens[i, S0 + lengths[i] - 1] = STOP
    tokens = tokens * mask
    with torch.no_grad():
        old = grpo.token_logprobs(model, tokens, mask, S0, T)
    old = (old + 0.2 * torch.randn(old.shape, generator=g)) * mask[:, S0:]
    rewards = torch.tensor([1.0, 1, 1, 1, 0, float("nan"), 1, 0, 1, 0, 0, 0])
    return generate.Rollout(tokens, mask, old, lengths, S0), rewards


def part(r, rows):
    return generate.Rollout(r.tokens[rows], r.mask[rows], r.logprobs[rows], r.lengths[rows], r.prompt_len)


def grpo_cfg(**kw):
    from distributed import train_cfg

    # reward_truncated=True: TRL's semantics (a cut completion keeps its reward), what the parity tests compare
    return train_cfg({**grpo.DEFAULTS, **LLAMA}, **{**dict(group_size=G, max_new_tokens=N, temperature=0.8,
                                                           micro_batch_size=2, reward_truncated=True), **kw})


def test_score_masks_and_normalisers():
    import parallel
    model = build()
    r, rewards = synthetic(model)
    grid = parallel.init(grpo_cfg())
    gen = r.mask[:, r.prompt_len:]
    batch, stats = grpo.score(r, rewards, grid, grpo_cfg(), [STOP])
    assert torch.equal(batch.loss_mask, gen) and batch.n_seqs == 12 and batch.n_tokens == gen.sum()
    assert torch.allclose(batch.adv, grpo.advantages(rewards, G))
    for i in range(12):  # the end-of-turn token is the completion's last counted token
        last = r.tokens[i, r.prompt_len + r.lengths[i] - 1]
        assert batch.loss_mask[i, r.lengths[i] - 1] and (last == STOP) == (i % 3 != 1)
    neglogp = stats.pop("neglogp")  # the entropy estimate's sum: -log p of the generated tokens (mask: theirs)
    assert neglogp > 0 and abs(neglogp + float((r.logprobs * gen).sum())) <= 1e-4 * neglogp
    assert stats == {"reward": 6.0, "rewarded": 11.0, "equal": 1.0, "groups": 3.0, "truncated": 4.0,
                     "gen_tokens": float(r.lengths.sum())}
    batch, _ = grpo.score(r, rewards, grid, grpo_cfg(dynamic_sampling=True, mask_truncated=True), [STOP])
    want = gen.clone()
    want[:4] = False  # group 0: all rewards equal
    want[1::3] = False  # cut at max_new_tokens
    assert torch.equal(batch.loss_mask, want) and batch.n_seqs == 8 and batch.n_tokens == want.sum()


# ----------------------------------------------------------------------------- layouts


def test_truncated_completions_earn_nothing_by_default():
    """The default (reward_truncated=False): a completion cut at max_new_tokens earns 0 whatever its
    reward said, a NaN (no reward) stays NaN, a completion that stopped keeps its reward; the
    advantages are those of the zeroed rewards."""
    import parallel
    model = build()
    prompts = [torch.randint(0, V, (4,), generator=torch.Generator().manual_seed(i)) for i in range(3)]
    r, _ = generate.rollout(model, prompts, 4 * G, 0, 1, N, vocab=V, temperature=1.0, seed=3, stop_tokens=[STOP])
    T = r.prompt_len
    stopped = r.tokens.gather(1, (T + r.lengths - 1)[:, None]).squeeze(1) == STOP
    assert stopped.any() and (~stopped).any()
    rewards = torch.ones(r.tokens.shape[0])
    rewards[0] = float("nan")
    cfg = grpo_cfg(reward_truncated=False, group_size=4 * G)
    batch, stats = grpo.score(r, rewards, parallel.init(cfg), cfg, [STOP])
    want = torch.where(stopped, rewards, torch.zeros_like(rewards))
    want[0] = float("nan")
    assert torch.allclose(batch.adv, grpo.advantages(want, 4 * G))
    assert stats["reward"] == float(want.nansum()) and stats["truncated"] == float((~stopped).sum())


def one_step(cfg, grid, r, rewards, out=None, batch=None):
    """Rollouts r (this rank's rows) and rewards -> full weights after one GRPO step (2 epochs, KL to
    the initial weights), the gradient norm of its last epoch (AdamW would hide a gradient off by a
    factor), the sums it logs (KL, clipped tokens, tokens) over every rank. batch: this one instead of r's."""
    import parallel
    torch.manual_seed(0)
    run = parallel.parallelize(Transformer(ModelConfig.from_cfg(cfg)), grid, cfg)
    torch.manual_seed(0)
    ref = parallel.parallelize(Transformer(ModelConfig.from_cfg(cfg)).requires_grad_(False), grid, cfg, optimizer=False)
    batch = grpo.score(r, rewards, grid, cfg, [STOP])[0] if batch is None else batch  # or one given (refill's)
    batch.ref = grpo.reference_logprobs(ref.fwd, batch, cfg)
    sums, norm = learn(run, batch, cfg, cfg.lr)
    weights = run.full_state(optimizer=False)[0]
    return {"weights": weights, "grad_norm": norm.reshape(1), "sums": parallel.data_sum(sums, grid)}


LAYOUT_CFG = dict(lr=1e-2, beta=0.04, grpo_epochs=2, clip_high=0.28, dynamic_sampling=True, mask_truncated=True,
                  warmup_steps=0, grad_clip=0.5, eps=1e-6)


def _layouts(rank, out_dir):
    import parallel
    res = {}
    for tp_size, dp in [(2, "ddp"), (2, "fsdp"), (1, "ddp"), (1, "fsdp")]:  # TP2 x DP2 / FSDP2, DP4, FSDP4
        cfg = grpo_cfg(tp=tp_size, data_parallel=dp, **LAYOUT_CFG)
        grid = parallel.init(cfg)
        model = build()
        r, rewards = synthetic(model)
        per = P * G // grid.data_world
        rows = list(range(grid.data_rank * per, (grid.data_rank + 1) * per))
        res[f"tp{tp_size} {dp}"] = one_step(cfg, grid, part(r, rows), rewards[rows])
        if tp_size == 2:  # the rollout (FSDP: parameters gathered once around it), seeded by the data rank
            torch.manual_seed(0)
            run = parallel.parallelize(Transformer(ModelConfig.from_cfg(cfg)), grid, cfg)
            prompts = [r.tokens[i * G, :r.prompt_len][r.mask[i * G, :r.prompt_len]] for i in range(P)]
            with run.full_params():
                res[dp + "_rollout"] = generate.rollout(run.raw, prompts, G, grid.data_rank, grid.data_world, N, vocab=V,
                                                    temperature=1.0, stop_tokens=[STOP],
                                                    seed=grpo.rollout_seed(0, 7, grid))[0].tokens
    torch.save(res, os.path.join(out_dir, f"rank{rank}.pt"))


def test_layouts_equal_one_process(tmp_path):
    from distributed import assert_close, rel_err, spawn

    import parallel
    spawn(_layouts, 4, str(tmp_path))
    cfg = grpo_cfg(**LAYOUT_CFG)
    model = build()
    r, rewards = synthetic(model)
    want = one_step(cfg, parallel.init(cfg), r, rewards)
    init = build().state_dict()
    assert max(rel_err(want["weights"][k], init[k]) for k in init) > 1e-3  # the step moved the weights
    assert want["sums"][1:3].sum() > 0  # some tokens were clipped in the second epoch
    res = [torch.load(tmp_path / f"rank{k}.pt", weights_only=False) for k in range(4)]
    for k in range(4):
        for layout in ("tp2 ddp", "tp2 fsdp", "tp1 ddp", "tp1 fsdp"):  # weights, gradient norm, logged sums
            assert_close(res[k][layout], want, f"rank {k} {layout}")
    prompts = [r.tokens[i * G, :r.prompt_len][r.mask[i * G, :r.prompt_len]] for i in range(P)]
    for d in range(2):  # ranks 2d, 2d+1: data rank d's TP pair; both equal one process with d's seed
        one, which = generate.rollout(model, prompts, G, d, 2, N, vocab=V, temperature=1.0, stop_tokens=[STOP],
                                  seed=grpo.rollout_seed(0, 7, SimpleNamespace(data_rank=d)))
        assert which == [c // G for c in range(6 * d, 6 * d + 6)]  # prompts 0, 0, 0, 0, 1, 1 | 1, 1, 2, 2, 2, 2
        one = one.tokens
        for k in (2 * d, 2 * d + 1):
            assert torch.equal(res[k]["ddp_rollout"], one) and torch.equal(res[k]["fsdp_rollout"], one), k


# ----------------------------------------------------------------------------- the stage end to end

def test_main_runs_and_logs(tmp_path, capsys):
    """grpo.main on a tiny random model, LoRA with the KL to its base: steps run, the log splits
    their time, the held-out reward is logged before and after, a checkpoint is written; bad
    settings stop before any work."""
    import json

    import config
    out = tmp_path / "run"
    args = ["--device=cpu", "--tokenizer_vocab=300", "--n_layer=1", "--n_embd=32", "--n_head=2", "--block_size=48",
            "--batch_size=8", "--group_size=4", "--micro_batch_size=4", "--max_steps=2", "--train_prompts=16",
            "--eval_prompts=4", "--eval_every=2", "--max_new_tokens=4", "--log_every=1", "--beta=0.1",
            "--lora_r=2", "--progress=False", f"--out_dir={out}"]
    grpo.main(args)
    import re
    summary = capsys.readouterr().out.strip().splitlines()[-1]  # the stage's one closing line
    assert re.fullmatch(r"GRPO done: 2 steps in [0-9.]+ min \| held-out greedy reward [0-9.]+% \(step 0\) -> "
                        r"[0-9.]+% \(step 2\) \| final checkpoint .*step_000002", summary), summary
    rec = [json.loads(line) for line in open(out / "train_metrics.jsonl")]
    steps = [r for r in rec if "reward" in r]
    assert [r["step"] for r in steps] == [1, 2] and all(r["t_rollout"] > 0 and r["t_learn"] > 0 for r in steps)
    assert all(set(r) >= {"t_reward", "kl", "clip_low", "clip_high", "frac_equal_groups", "len"} for r in steps)
    assert [r["step"] for r in rec if "heldout_reward" in r] == [0, 2]
    assert (out / "step_000002" / "model.safetensors").exists()
    for bad, match in [("--group_size=3", "a multiple of group_size"), ("--loss_type=bnpo", "loss_type"),
                       ("--max_new_tokens=60", "block_size")]:
        with pytest.raises(config.UserError, match=match):
            grpo.main(args + [bad, "--overwrite"])


def test_main_rollout_copy_and_reward_plot(tmp_path, monkeypatch):
    """grpo.main with rollout_copy (CPU, fp32: an fp32 copy, refreshed before every rollout; a stale
    copy would show as clipped tokens and other log lines) logs exactly what the trained model's own
    rollouts log, over 3 steps at a large lr (a random model's reward: 1 for an odd-length text);
    plots.py draws the reward panel (training, held-out sampled and greedy) and the step-time panel
    from the run's log."""
    import json

    from posttrain import tasks
    from tools import plots
    monkeypatch.setattr(tasks.Arithmetic, "reward", lambda self, completion, item: float(len(completion) % 2))
    args = ["--device=cpu", "--tokenizer_vocab=300", "--n_layer=1", "--n_embd=32", "--n_head=2", "--block_size=48",
            "--batch_size=8", "--group_size=4", "--micro_batch_size=8", "--max_steps=3", "--train_prompts=16",
            "--eval_prompts=4", "--eval_every=3", "--max_new_tokens=4", "--log_every=1", "--lr=3e-2",
            "--warmup_steps=0", "--tie_embeddings=True", "--progress=False", "--reward_truncated=True"]
    logged = {}
    for copy in (True, False):
        grpo.main(args + [f"--rollout_copy={copy}", f"--out_dir={tmp_path / str(copy)}"])
        logged[copy] = [{k: v for k, v in json.loads(line).items() if k not in ("time", "gen_tok_s") and not k.startswith("t_")}
                        for line in open(tmp_path / str(copy) / "train_metrics.jsonl")]
    assert logged[True] == logged[False] and len(logged[True]) == 5  # held-out at 0, 3 steps, held-out at 3
    steps = [r for r in logged[True] if "reward" in r]
    assert all(r["grad_norm"] > 0 and r["clip_low"] == r["clip_high"] == 0 for r in steps)  # learnt; fresh copy
    drawn = plots.plot_runs([str(tmp_path / "True")], None)
    lines = drawn["reward (GRPO) (step)"]
    assert lines["True heldout_reward"][0] == [0, 3] and lines["True reward"][0] == [1, 2, 3]
    assert lines["True heldout_greedy"][1][0] == logged[True][0]["heldout_greedy"]
    assert set(drawn["GRPO step time, s (step)"]) == {"True t_rollout", "True t_reward", "True t_learn"}


def test_trl_policy_types_and_logged_metrics():
    """cispo and sapo through grpo.policy_loss are objectives.policy_loss's (objectives' tests hold them to
    TRL's GRPOTrainer); the logged KL is k3 times the ratio (kl_ratio, as TRL logs it) and sequence-level
    clip fractions count rows, as objectives.kl_sums / clip_sums compute them; cispo's clip fraction is TRL's
    cispo_clip_ratio (the ratio above the cap itself, A > 0), by hand."""
    from posttrain import objectives
    g = torch.Generator().manual_seed(0)
    B, N = 4, 6
    logp, old, ref = (torch.randn(B, N, generator=g) * 0.1 - 2 for _ in range(3))
    adv, mask = torch.randn(B, generator=g), torch.rand(B, N, generator=g) > 0.2
    for kind in ("cispo", "sapo"):
        got, _ = grpo.policy_loss(logp, old, adv, mask, loss_type=kind, eps_high=5.0, beta=0.04, ref_logp=ref)
        want = objectives.policy_loss(logp, old, adv, mask, loss_type=kind, eps_high=5.0, beta=0.04, ref_logp=ref)
        assert torch.allclose(got, want, rtol=1e-6), kind
    _, sums = grpo.policy_loss(logp, old, adv, mask, beta=0.04, ref_logp=ref, level="sequence", eps_low=0.01)
    ratio = (((logp - old) * mask).sum(-1) / mask.sum(-1)).exp()[:, None]
    assert torch.allclose(sums[0], objectives.kl_sums(logp, ref, mask, ratio)[0])
    assert torch.equal(sums[1:4], objectives.clip_sums(ratio, adv, mask, 0.01)[[0, 1, 3]]) and sums[3] == B
    # cispo: TRL's cispo_clip_ratio counts tokens whose ratio is above the cap itself (eps_high), with A > 0
    _, sums = grpo.policy_loss(logp, old, adv, mask, loss_type="cispo", eps_high=1.02)
    r = (logp - old).exp()
    want = (((r > 1.02) & (adv[:, None] > 0)) * mask).sum()
    assert sums[1] == 0 and sums[2] == want and sums[3] == mask.sum() and 0 < want < mask.sum()


@pytest.mark.parametrize("key,value,says", [("temperature", 0.0, "temperature=0.0 must be > 0: rollouts sample"),
                                            ("beta", -0.1, "beta=-0.1 must be >= 0"),
                                            ("max_new_tokens", 0, "max_new_tokens=0 must be >= 1"),
                                            ("dead_steps", 0, "dead_steps=0 must be >= 1")])
def test_check_names_the_one_key_that_is_wrong(key, value, says):
    """grpo.check's message names the key the user set wrong, and no other."""
    import config
    import parallel
    cfg = grpo_cfg(**{key: value})
    with pytest.raises(config.ConfigError) as e:
        grpo.check(cfg, parallel.init(grpo_cfg()))
    assert str(e.value) == says
