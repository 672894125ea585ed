"""The fast decoder (generate.decode) against the eager path, transformers and the model itself.

Proves, on CPU in fp32 with tiny models:
- greedy decode of left-padded prompts of different lengths equals the eager generate() and each
  prompt run alone by a naive re-run-everything argmax loop, token for token (RoPE + GQA, learned
  positions + MHA), and transformers' greedy generate on the same weights (tiny HF LLaMA);
- the speed settings are exact: KV-length buckets (dividing the cache or not, off), one gate|up
  matmul, the SDPA math kernel, flex_attention give the eager path's greedy tokens and, with a seed, the same
  sampled tokens and log-probs (<= 1e-5); the top-k candidate race and the full-vocabulary race
  both give teacher-forced log-probs;
- keep={}: a later call of the same shapes reuses the first call's decoder (its buffers, its
  graphs) and equals a fresh decoder's rollout bit for bit; a new shape replaces it;
- the log-prob of every generated token equals log_softmax(logits / temperature) of a
  teacher-forced forward over the returned tokens (max abs diff <= 1e-5), with top-k / top-p
  filtering (which the log-probs ignore), n samples per prompt and stop tokens; greedy uses t = 1;
  log-probs are 0 after a stop;
- the sampler draws from the filtered distribution (frequencies of 40,000 draws within 0.01 of
  the hand-computed probabilities, for plain, top-k and top-p, racing the vocabulary or only the
  top-k candidates);
- the top-k candidates taken from the k best blocks are torch.topk's (a valid top k under ties), and
  the blockwise logsumexp gives log_softmax's log-probs (<= 1e-5);
- a fixed seed reproduces tokens and log-probs, seed and generator agree, another seed differs,
  top_k=1 equals greedy;
- stop tokens: each row is the free run up to and with its first stop token, then pad_id; mask and
  lengths say so; the whole batch stops at the first check_every boundary after every row stopped
  (counted model calls);
- left-padded prompts whose prefill mask would pass PREFILL_MASK_BYTES are prefilled row by row over their real
  tokens (counted calls) and give the batched prefill's tokens and log-probs (RoPE, learned positions, ALiBi with
  a sliding window);
- n samples per prompt: one prefill of the B prompts (counted rows); greedy rows of a prompt are
  identical and equal the n = 1 rollout; sampled rows of one prompt differ;
- the decode step traces as one graph (torch.compile fullgraph=True, eager backend), also across
  buckets: no .item(), no data-dependent Python branch, so it can be captured;
- LoRA adapters applied on the fly give the merged model's tokens; MoE layers decode dropless
  (equal to the eager path with capacity_factor 0; the setting is restored);
- layouts (2 gloo ranks, one spawn) equal one process: tensor parallelism (greedy, seeded sampling,
  every rank the same tokens), LoRA under TP on the fly and merged, FSDP inside
  Parallel.full_params() (parameters freed after), expert parallelism with different prompts per
  rank whose rows stop at different steps (the ranks stop together);
- bad arguments raise errors naming the fix; bench/bench_generate.py's CPU smoke test runs and its
  checks pass.
Not testable here: CUDA graph capture and compile + capture, and the Triton attention kernel (on a
GPU: test_triton_attention_on_gpu below, tests/test_fused.py, bench/bench_generate.py's checks:
captured = uncaptured, kept graphs = fresh, fp32 greedy = eager).
"""
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from distributed import spawn, train_cfg

import generate
import lora
import parallel
from model import ModelConfig, Transformer
from parallelism import tp

pytestmark = pytest.mark.usefixtures("one_thread")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

V = 97
TINY = dict(vocab_size=V, block_size=48, n_layer=2, n_head=4, n_embd=32, init_std=0.2)
LLAMA = dict(TINY, n_kv_head=2)  # RoPE, RMSNorm, SwiGLU, GQA
GPT2 = dict(TINY, pos_emb="learned", norm="layernorm", activation="gelu", bias=True, tie_embeddings=True)


def build(seed=0, **kw):
    torch.manual_seed(seed)
    return Transformer(ModelConfig(**kw)).eval()


def prompts(lengths=(6, 3, 1, 5), seed=3):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, V, (n,), generator=g) for n in lengths]


def naive_greedy(model, p, n):
    idx = p[None]
    for _ in range(n):
        idx = torch.cat([idx, model(idx)[:, -1].argmax(-1, keepdim=True)], 1)
    return idx[0, len(p):]


def teacher_forced(model, r, temperature):
    """log_softmax(logits / t) of a full forward over r.tokens, at every generated token."""
    T = r.prompt_len
    with torch.no_grad():
        logits = model(r.tokens, attn_mask=r.mask)[:, T - 1:-1]
    lp = (logits / (temperature or 1.0)).log_softmax(-1)
    return lp.gather(-1, r.tokens[:, T:, None]).squeeze(-1)


def counting(model):
    """Record the batch shape of every hidden_states call (prefill and decode steps)."""
    calls, orig = [], model.hidden_states
    model.hidden_states = lambda idx, **kw: (calls.append(tuple(idx.shape)), orig(idx, **kw))[1]
    return calls


@pytest.mark.parametrize("kw", [LLAMA, GPT2], ids=["llama_gqa", "gpt2"])
def test_greedy_equals_eager_and_rows_alone(kw):
    model = build(**kw)
    ps = prompts()
    r = generate.decode(model, ps, 12, vocab=V, temperature=0)
    idx, mask = generate.pad_prompts(ps)
    assert torch.equal(r.tokens, generate.generate(model, idx, 12, vocab=V, temperature=0, attention_mask=mask))
    for b, p in enumerate(ps):
        assert torch.equal(r.tokens[b, 6:], naive_greedy(model, p, 12))
    assert torch.equal(r.mask[:, :6], mask) and r.mask[:, 6:].all() and r.lengths.tolist() == [12] * 4
    # (B, T) ids + attention_mask give the same rollout
    assert torch.equal(generate.decode(model, idx, 12, vocab=V, temperature=0, attention_mask=mask).tokens, r.tokens)


def test_greedy_equals_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")
    import hf
    torch.manual_seed(0)
    ref = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, initializer_range=0.1, bos_token_id=None,
        eos_token_id=None)).eval()
    ref.save_pretrained(str(tmp_path))
    ours = hf.load_hf(str(tmp_path))
    ps = prompts((7, 2, 5))
    idx, mask = generate.pad_prompts(ps)
    with torch.no_grad():
        theirs = ref.generate(idx, attention_mask=mask.long(), max_new_tokens=14, do_sample=False, pad_token_id=0)
    for bucket in (64, 4):  # one bucket, five
        assert torch.equal(generate.decode(ours, ps, 14, vocab=V, temperature=0, bucket=bucket).tokens[:, 7:], theirs[:, 7:])


@pytest.mark.parametrize("temperature, top_k, top_p", [(0.7, 5, 0.9), (0, None, None), (1.3, None, 0.8)])
def test_logprobs_equal_teacher_forced(temperature, top_k, top_p):
    model = build(**LLAMA)
    ps = prompts()
    stop = int(generate.decode(model, ps, 4, vocab=V, temperature=0).tokens[1, 6 + 2])  # row 1 stops early when greedy
    r = generate.decode(model, ps, 10, vocab=V, n=2, temperature=temperature, top_k=top_k, top_p=top_p,
                        stop_tokens=[stop], seed=5, check_every=1)
    assert r.tokens.shape[0] == 8 and r.logprobs.shape == r.tokens[:, 6:].shape
    gen = r.mask[:, 6:]
    want = teacher_forced(model, r, temperature)
    assert (r.logprobs - want)[gen].abs().max() <= 1e-5
    assert (r.logprobs[~gen] == 0).all() and (r.logprobs[gen] < 0).all()


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")  # the unfused reference: exact
def test_speed_settings_are_exact():
    """KV-length buckets (aligned, not dividing the cache, off), one gate|up matmul, the SDPA math
    kernel, the full-vocabulary race: greedy equals the eager path token for token; with a seed
    the sampled tokens do not depend on them (the candidate race aside) and every log-prob equals
    the teacher-forced one."""
    model = build(**LLAMA)
    ps = prompts()
    idx, mask = generate.pad_prompts(ps)
    eager = generate.generate(model, idx, 14, vocab=V, temperature=0, attention_mask=mask)
    kw = dict(n=2, temperature=0.9, top_k=6, top_p=0.95, seed=4, stop_tokens=[7], check_every=3)
    ref = generate.decode(model, ps, 14, vocab=V, bucket=0, **kw)
    for opts in [dict(bucket=4), dict(bucket=7, fuse_mlp=False), dict(bucket=64, attention="math"),
                 dict(bucket=0, fuse_mlp=False), dict(bucket=4, attention="flex")]:
        assert torch.equal(generate.decode(model, ps, 14, vocab=V, temperature=0, **opts).tokens, eager), opts
        r = generate.decode(model, ps, 14, vocab=V, **opts, **kw)
        assert torch.equal(r.tokens, ref.tokens) and torch.equal(r.lengths, ref.lengths), opts
        assert (r.logprobs - ref.logprobs).abs().max() <= 1e-5
    assert ref.lengths.min() < 14  # the stop token ends some rows
    for r in (ref, generate.decode(model, ps, 14, vocab=V, bucket=5, candidates=False, **kw)):
        assert (r.logprobs - teacher_forced(model, r, 0.9))[r.mask[:, 6:]].abs().max() <= 1e-5
    gpt2 = build(**GPT2)  # learned positions, LayerNorm, GELU MLP
    want = generate.generate(gpt2, idx, 14, vocab=V, temperature=0, attention_mask=mask)
    assert torch.equal(generate.decode(gpt2, ps, 14, vocab=V, temperature=0, bucket=3).tokens, want)


def test_keep_reuses_the_state():
    """keep={}: a second call of the same shapes (prompts of other lengths, same cache after
    rounding) runs on the first call's decoder and equals a fresh one's decode, bit for bit; a new
    shape replaces it; returned tensors are the caller's (a later call does not change them)."""
    model = build(**LLAMA)
    keep = {}
    kw = dict(n=2, temperature=1.0, top_k=5, seed=1, stop_tokens=[7], bucket=8)
    a = generate.decode(model, prompts(), 12, vocab=V, keep=keep, **kw)
    (dec,) = keep.values()
    other = prompts((2, 5, 4, 3), seed=9)  # T = 5 instead of 6: the same 24-slot cache
    b = generate.decode(model, other, 12, vocab=V, keep=keep, **kw)
    assert list(keep.values()) == [dec]
    fresh_a, fresh_b = (generate.decode(model, p, 12, vocab=V, keep={}, **kw) for p in (prompts(), other))
    for got, want in ((a, fresh_a), (b, fresh_b)):
        assert torch.equal(got.tokens, want.tokens) and torch.equal(got.mask, want.mask)
        assert torch.equal(got.logprobs, want.logprobs) and torch.equal(got.lengths, want.lengths)
    generate.decode(model, prompts(), 12, vocab=V, keep=keep, **dict(kw, n=3))
    assert len(keep) == 1 and list(keep.values()) != [dec]


def test_sampler_draws_the_filtered_distribution():
    p = torch.tensor([0.4, 0.3, 0.15, 0.1, 0.05])
    R = 40000
    logits = p.log().expand(R, 5)
    g = torch.Generator().manual_seed(0)
    for kw, want in [({}, p), ({"top_k": 2}, torch.tensor([4 / 7, 3 / 7, 0, 0, 0])),
                     ({"top_p": 0.8}, torch.tensor([0.4, 0.3, 0.15, 0, 0]) / 0.85)]:
        tok, lp = generate.pick(logits, 1.0, noise=torch.empty(R, 5).exponential_(generator=g), **kw)
        freq = torch.bincount(tok, minlength=5).float() / R
        assert (freq - want).abs().max() < 0.01, (kw, freq)
        assert torch.allclose(lp, p.log()[tok])  # log-probs before the filter
    tok, _ = generate.pick(logits, 0.5, noise=torch.empty(R, 5).exponential_(generator=g))
    sharp = p ** 2 / (p ** 2).sum()  # temperature 0.5 squares the probabilities
    assert (torch.bincount(tok, minlength=5).float() / R - sharp).abs().max() < 0.01
    # the race among the top_k candidates only (noise (R, k)): the same filtered distributions
    shuffled = torch.tensor([3, 0, 4, 1, 2])  # candidates come out of topk in another order than the ids
    for kw, k, want in [({"top_k": 2}, 2, torch.tensor([4 / 7, 3 / 7, 0, 0, 0])),
                        ({"top_k": 4, "top_p": 0.8}, 4, torch.tensor([0.4, 0.3, 0.15, 0, 0]) / 0.85)]:
        tok, lp = generate.pick(logits[:, shuffled], 1.0, noise=torch.empty(R, k).exponential_(generator=g), **kw)
        freq = torch.bincount(shuffled[tok], minlength=5).float() / R
        assert (freq - want).abs().max() < 0.01, (kw, freq)
        assert torch.allclose(lp, p.log()[shuffled[tok]])


def test_top_candidates_and_blockwise_logsumexp():
    """top_candidates (the k best blocks' maxima, then those blocks) returns torch.topk's set, with
    the vocabulary a multiple of the block or not, and with ties a valid top k; log_softmax_at (a
    blockwise logsumexp) equals log_softmax at the token."""
    g = torch.Generator().manual_seed(0)
    for V, k, block in [(1000, 5, 16), (1001, 7, 16), (50304, 50, 64), (300, 3, 1)]:
        x = 3 * torch.randn(6, V, generator=g)
        vals, ids = generate.top_candidates(x, k, block)
        assert torch.equal(ids.sort(-1).values, x.topk(k).indices.sort(-1).values), (V, k, block)
        assert torch.equal(x.gather(-1, ids), vals)
        tok = torch.randint(0, V, (6,), generator=g)
        for t in (1.0, 0.6):
            want = (x / t).log_softmax(-1).gather(-1, tok[:, None]).squeeze(-1)
            assert (generate.log_softmax_at(x, tok, t, block=block if block > 1 else 7) - want).abs().max() < 1e-5
    x = torch.randint(0, 4, (6, 1000), generator=g).float()  # ties everywhere: any k of the best values,
    x.scatter_(1, torch.randint(0, 1000, (6, 5), generator=g), 10 + torch.rand(6, 5, generator=g))  # and 5 above all
    vals, ids = generate.top_candidates(x, 30, 16)
    assert all(len(set(row.tolist())) == 30 for row in ids) and torch.equal(x.gather(-1, ids), vals)
    assert torch.equal(vals.sort(-1).values, x.topk(30).values.sort(-1).values)  # the top-k values are unique


def test_seed_reproducible():
    model = build(**GPT2)
    ps = prompts()
    a = generate.decode(model, ps, 8, vocab=V, temperature=1.0, top_p=0.9, seed=123)
    b = generate.decode(model, ps, 8, vocab=V, temperature=1.0, top_p=0.9, generator=torch.Generator().manual_seed(123))
    c = generate.decode(model, ps, 8, vocab=V, temperature=1.0, top_p=0.9, seed=124)
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.logprobs, b.logprobs)
    assert not torch.equal(a.tokens, c.tokens)
    greedy = generate.decode(model, ps, 8, vocab=V, temperature=0).tokens
    assert torch.equal(generate.decode(model, ps, 8, vocab=V, temperature=1.0, top_k=1, seed=0).tokens, greedy)


def test_stop_tokens_and_early_exit():
    model = build(**LLAMA)
    ps = prompts()
    free = generate.decode(model, ps, 16, vocab=V, temperature=0).tokens[:, 6:]
    stop = int(free[0, 2])
    for check_every, pad_id in [(1, 0), (4, 96)]:
        r = generate.decode(model, ps, 16, vocab=V, temperature=0, stop_tokens=[stop, 1000], pad_id=pad_id,
                            check_every=check_every)
        ends = [row.index(stop) + 1 if stop in row else 16 for row in free.tolist()]
        assert r.lengths.tolist() == ends and r.tokens.shape[1] == 6 + max(ends)
        for b, e in enumerate(ends):
            gen = r.tokens[b, 6:].tolist()
            assert gen == free[b, :e].tolist() + [pad_id] * (max(ends) - e)
            assert r.mask[b, 6:].tolist() == [True] * e + [False] * (max(ends) - e)
    # one row that stops on its 3rd token: the batch ends at the first check after it
    model_calls = counting(model)
    r = generate.decode(model, ps[:1], 16, vocab=V, temperature=0, stop_tokens=[stop], check_every=4)
    assert r.lengths.tolist() == [3] and r.tokens.shape == (1, 9)
    assert model_calls == [(1, 6)] + [(1, 1)] * 3  # prefill, steps for tokens 1..3, stopped at the check before 4
    model_calls.clear()
    generate.decode(model, ps[:1], 16, vocab=V, temperature=0)
    assert len(model_calls) == 16  # no stop tokens: prefill + 15 steps


def test_n_samples_share_one_prefill():
    model = build(**LLAMA)
    ps = prompts()
    calls = counting(model)
    greedy = generate.decode(model, ps, 6, vocab=V, n=3, temperature=0)
    assert calls[0] == (4, 6) and set(calls[1:]) == {(12, 1)}  # one prefill of the 4 prompts, 12 rows after
    one = generate.decode(model, ps, 6, vocab=V, temperature=0).tokens
    assert torch.equal(greedy.tokens, one.repeat_interleave(3, dim=0))
    r = generate.decode(model, ps, 6, vocab=V, n=8, temperature=2.0, seed=0)
    first = r.tokens[:, 6].view(4, 8)
    assert all(len(set(row.tolist())) > 1 for row in first)  # independent draws per sample row
    # and every row's first token is scored under its prompt's one prefill distribution
    assert (r.logprobs - teacher_forced(model, r, 2.0)).abs().max() <= 1e-5


@pytest.mark.parametrize("kw", [LLAMA, GPT2, dict(LLAMA, pos_emb="alibi", sliding_window=4)],
                         ids=["llama_gqa", "gpt2", "alibi_window"])
def test_long_padded_prompts_prefill_row_by_row(kw, monkeypatch):
    model = build(**kw)
    ps = prompts((7, 2, 5))
    want = generate.decode(model, ps, 10, vocab=V, n=2, temperature=0.8, seed=0)
    monkeypatch.setattr(generate, "PREFILL_MASK_BYTES", 3 * 7 * 7 - 1)  # the (3, 7, 7) mask is past it
    calls = counting(model)
    got = generate.decode(model, ps, 10, vocab=V, n=2, temperature=0.8, seed=0)
    assert calls[:4] == [(1, 7), (1, 2), (1, 5), (6, 1)]  # each row alone over its real tokens, then 6 rows
    assert torch.equal(got.tokens, want.tokens) and (got.logprobs - want.logprobs).abs().max() <= 1e-5
    assert (got.logprobs - teacher_forced(model, got, 0.8)).abs().max() <= 1e-5
    idx, mask = generate.pad_prompts(ps)
    mask[0, 3] = False  # a hole, not left padding: one batched prefill under the mask
    del calls[:]
    generate.decode(model, idx, 4, vocab=V, temperature=0, attention_mask=mask)
    assert calls[0] == (3, 7)


def test_step_traces_as_one_graph():
    torch._dynamo.reset()
    model = build(**LLAMA)
    ps = prompts()
    want = generate.decode(model, ps, 6, vocab=V, temperature=1.0, top_k=7, seed=1, stop_tokens=[3])
    got = generate.decode(model, ps, 6, vocab=V, temperature=1.0, top_k=7, seed=1, stop_tokens=[3],
                          compile={"backend": "eager", "fullgraph": True})
    assert torch.equal(got.tokens, want.tokens) and torch.allclose(got.logprobs, want.logprobs, atol=1e-6)
    got = generate.decode(model, ps, 6, vocab=V, temperature=1.0, top_k=7, seed=1, stop_tokens=[3], bucket=4,
                          compile={"backend": "eager", "fullgraph": True})  # 3 buckets: spans 8, 12
    assert torch.equal(got.tokens, want.tokens) and torch.allclose(got.logprobs, want.logprobs, atol=1e-6)
    torch._dynamo.reset()


def lora_model(grid=None, adapters=None):
    """The tiny LLaMA (seed 0) with LoRA adapters whose B factors are random (not zero); with a
    grid: cut for tensor parallelism, the full `adapters` (one process's) loaded into its slices."""
    cfg = train_cfg(dict(LLAMA, lora_r=4, lora_alpha=8.0))
    grid = grid or parallel.init(cfg)
    torch.manual_seed(0)
    model = tp.tensor_parallel(Transformer(ModelConfig.from_cfg(cfg)), grid)
    lora.apply(model, cfg, grid)
    if adapters is None:
        g = torch.Generator().manual_seed(0)
        adapters = {n: 0.5 * torch.randn(p.shape, generator=g) if "lora_B" in n else p.detach()
                    for n, p in model.named_parameters() if lora.is_adapter(n)}
    lora.load(model, grid, adapters)
    return model.eval()


def test_lora_on_the_fly_equals_merged():
    model = lora_model()
    ps = prompts()
    r = generate.decode(model, ps, 10, vocab=V, temperature=0.8, seed=0)
    base = generate.decode(model, ps, 10, vocab=V, temperature=0)
    lora.merge(model)
    merged = generate.decode(model, ps, 10, vocab=V, temperature=0.8, seed=0)
    assert torch.equal(r.tokens, merged.tokens) and (r.logprobs - merged.logprobs).abs().max() <= 1e-5
    lora.unmerge(model)
    for m in lora.adapted(model):
        m.lora_A.clear()  # no adapters: the base model, which must differ
    assert not torch.equal(generate.decode(model, ps, 10, vocab=V, temperature=0).tokens, base.tokens)


def test_moe_decodes_dropless():
    model = build(**dict(LLAMA, n_experts=4, moe_top_k=2, capacity_factor=0.5))
    ps = prompts()
    r = generate.decode(model, ps, 8, vocab=V, temperature=0)
    assert all(m.capacity_factor == 0.5 for m in model.blocks.modules() if hasattr(m, "capacity_factor"))
    dropped = generate.generate(model, *generate.pad_prompts(ps)[:1], 8, vocab=V, temperature=0,
                                attention_mask=generate.pad_prompts(ps)[1])
    for m in model.blocks.modules():
        if hasattr(m, "capacity_factor"):
            m.capacity_factor = 0.0
    idx, mask = generate.pad_prompts(ps)
    dropless = generate.generate(model, idx, 8, vocab=V, temperature=0, attention_mask=mask)
    assert torch.equal(r.tokens, dropless) and not torch.equal(dropped, dropless)  # the setting matters here


MOE = dict(LLAMA, n_experts=4, moe_top_k=2)


def _layouts(rank, out_dir):
    grid = parallel.init(SimpleNamespace(device="cpu", tp=2, ep=1))
    torch.manual_seed(0)
    model = tp.tensor_parallel(Transformer(ModelConfig(**LLAMA)), grid).eval()
    ps = prompts()
    res = {"greedy": generate.decode(model, ps, 10, vocab=V, temperature=0).tokens,
           "sampled": generate.decode(model, ps, 10, vocab=V, n=2, temperature=1.0, top_p=0.9, seed=7, stop_tokens=[5])}
    # LoRA under TP: one process's adapters in this rank's slices, applied on the fly, then merged
    lm = lora_model(grid, torch.load(os.path.join(out_dir, "adapters.pt")))
    res["lora"] = generate.decode(lm, ps, 10, vocab=V, temperature=0.8, seed=0)
    lora.merge(lm)
    res["lora_merged"] = generate.decode(lm, ps, 10, vocab=V, temperature=0.8, seed=0)
    # FSDP over the same two ranks: parameters gathered once around the whole rollout, freed after
    cfg = train_cfg(dict(LLAMA, data_parallel="fsdp"))
    torch.manual_seed(0)
    run = parallel.parallelize(Transformer(ModelConfig.from_cfg(cfg)), parallel.init(cfg), cfg)
    with run.full_params():
        res["fsdp"] = generate.decode(run.raw, ps, 10, vocab=V, temperature=0).tokens
    res["fsdp_freed"] = all(p.numel() == 0 for p in run.raw.parameters())
    # expert parallelism: each rank its own prompts; rank 0's rows all stop on their first token,
    # rank 1's never: rank 0 keeps stepping (its MoE layers exchange tokens with rank 1's) until both are done
    cfg = train_cfg(MOE, ep=2)
    torch.manual_seed(0)
    run = parallel.parallelize(Transformer(ModelConfig.from_cfg(cfg)), parallel.init(cfg), cfg)
    res["ep"] = generate.decode(run.raw, prompts(seed=10 + rank), 10, vocab=V, temperature=0, check_every=1,
                                stop_tokens=list(range(V)) if rank == 0 else None)
    torch.save(res, os.path.join(out_dir, f"rank_{rank}.pt"))


def test_layouts_equal_one_process(tmp_path):
    """Tensor parallelism (greedy, seeded sampling with n and a stop token), LoRA under TP (on the
    fly and merged), FSDP (inside full_params, parameters freed after) and expert parallelism
    (ranks with different prompts stopping at different steps), 2 gloo ranks: each rank's rollout
    equals one process's."""
    one = lora_model()
    torch.save({n: p.detach() for n, p in one.named_parameters() if lora.is_adapter(n)}, tmp_path / "adapters.pt")
    spawn(_layouts, 2, str(tmp_path))
    model = build(**LLAMA)
    ps = prompts()
    greedy = generate.decode(model, ps, 10, vocab=V, temperature=0).tokens
    sampled = generate.decode(model, ps, 10, vocab=V, n=2, temperature=1.0, top_p=0.9, seed=7, stop_tokens=[5])
    with_lora = generate.decode(one, ps, 10, vocab=V, temperature=0.8, seed=0)
    moe_model = build(**MOE)
    for rank in (0, 1):
        res = torch.load(tmp_path / f"rank_{rank}.pt", weights_only=False)
        assert torch.equal(res["greedy"], greedy) and torch.equal(res["fsdp"], greedy) and res["fsdp_freed"]
        for got, want in ((res["sampled"], sampled), (res["lora"], with_lora), (res["lora_merged"], with_lora)):
            assert torch.equal(got.tokens, want.tokens) and (got.logprobs - want.logprobs).abs().max() <= 1e-5
        want = generate.decode(moe_model, prompts(seed=10 + rank), 10, vocab=V, temperature=0, check_every=1,
                               stop_tokens=list(range(V)) if rank == 0 else None)
        assert torch.equal(res["ep"].tokens, want.tokens) and res["ep"].lengths.tolist() == [1 if rank == 0 else 10] * 4


def test_bad_arguments():
    model = build(**LLAMA)
    with pytest.raises(ValueError, match="block_size"):
        generate.decode(model, prompts(), 43, vocab=V)
    with pytest.raises(ValueError, match="graph=False"):
        generate.decode(model, prompts(), 4, vocab=V, graph=True)
    with pytest.raises(ValueError, match="at least one token"):
        generate.decode(model, [[1, 2], []], 4, vocab=V)
    with pytest.raises(ValueError, match="temperature"):
        generate.decode(model, prompts(), 4, vocab=V, temperature=-1)
    with pytest.raises(ValueError, match="bucket=-1 must be >= 0"):
        generate.decode(model, prompts(), 4, vocab=V, bucket=-1)
    with pytest.raises(ValueError, match="attention='fast': choose one of sdpa, math, efficient, flash, cudnn, flex, triton"):
        generate.decode(model, prompts(), 4, vocab=V, attention="fast")
    with pytest.raises(ValueError, match="attention='triton' needs Triton and the model on the current CUDA device"):
        generate.decode(model, prompts(), 4, vocab=V, attention="triton")


def test_bench_smoke(tmp_path):
    """bench/bench_generate.py on CPU: the checks pass, every CPU row is measured (a settings variant,
    LoRA on the fly and merged, a profile), CUDA rows say so."""
    out = tmp_path / "gen.json"
    res = subprocess.run([sys.executable, "bench/bench_generate.py", "--device=cpu", "--points=tiny:3,explore",
                          "--rows=ours-eager,ours-static,ours-static:before,ours-graph",
                          "--explore=ours-lora:keep,ours-lora-merged", "--profile=ours-static", f"--json={out}"],
                         cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    rep = json.loads(out.read_text())
    check = rep["checks"]["float32-static"]
    assert check["greedy_identical"] and check["logprob_max_abs_err"] <= 1e-5
    assert check["kept_equals_fresh"] and check["captured_equals_uncaptured"] and check["autocast_kept_equals_uncaptured"]
    rows = {r["row"]: r for r in rep["rows"]}
    for name in ("ours-eager", "ours-static", "ours-static:before", "ours-lora:keep", "ours-lora-merged"):
        assert rows[name]["tok_s"] > 0 and rows[name]["bound_tok_s"] > 0, name
    assert rows["ours-graph"]["skipped"] == "CUDA only"
    assert rows["ours-static"]["profile"]["ops_per_step"] > 10 and rows["ours-static"]["profile"]["top"]
    assert "| tiny | 3 | ours-static |" in res.stdout  # the table, with its "vs before" column


@pytest.mark.skipif(not (torch.cuda.is_available() and generate.fused.triton is not None), reason="needs a CUDA GPU and Triton")
@pytest.mark.parametrize("kw", [LLAMA, GPT2], ids=["llama_gqa", "gpt2"])
def test_triton_attention_on_gpu(kw):
    """attention="triton" (fused.decode_attention) in fp32 on a GPU: the captured step, compiled or
    not, gives the eager path's greedy tokens, and the math kernel's sampled tokens and log-probs,
    on left-padded prompts across KV-length buckets."""
    model = build(**kw).cuda()
    ps = [p.cuda() for p in prompts()]
    idx, mask = generate.pad_prompts(ps, device="cuda")
    want = generate.generate(model, idx, 40, vocab=V, temperature=0, attention_mask=mask)
    for compile_ in (False, True):
        r = generate.decode(model, ps, 40, vocab=V, temperature=0, attention="triton", bucket=16, compile=compile_)
        assert torch.equal(r.tokens, want), compile_
    a, b = (generate.decode(model, ps, 40, vocab=V, top_k=20, seed=1, attention=att, bucket=16) for att in ("triton", "math"))
    assert torch.equal(a.tokens, b.tokens)
    torch.testing.assert_close(a.logprobs, b.logprobs, rtol=1e-5, atol=1e-5)
