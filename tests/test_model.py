"""model.py is a correct Transformer, and its fast paths agree with its slow ones.

What these tests prove, all on CPU in fp32 against independent references:
- every config variant (GPT-2-like, LLaMA-like, MQA, relu/relu2/geglu, post-norm, qk-norm,
  dropout, tied/untied) trains: finite loss, a gradient for every parameter;
- the logits and loss equal a hand-written reference Transformer (explicit per-head
  softmax(QK^T/sqrt(d) + causal mask) V, RoPE via complex rotation, norms and MLPs written
  out) run on the model's own weights, for every variant;
- activation checkpointing gives the same gradients as no checkpointing;
- fp32_residual=False keeps the residual stream bf16 under (CPU bf16) autocast, inert without it;
- KV-cache decoding (prefill, multi-token chunks, single tokens) equals one full forward, for
  RoPE/learned positions and MHA/GQA, and a left-padded batch equals each row run alone;
- generate(): greedy equals a naive re-run-everything argmax loop, also for left-padded
  batches; stop tokens stop rows; top_k=1 equals greedy; top-p keeps the smallest set with
  mass >= p (checked on a hand-made distribution);
- padded vocabulary rows never reach logits or loss;
- parameter and FLOP counts equal arithmetic written out by hand;
- bad configs raise ValueErrors naming the field; same seed -> identical weights;
- the training forward compiles with fullgraph=True (no graph breaks).
"""
import math

import pytest
import torch
import torch.nn.functional as F

import generate
from generate import KVCache, top_k_filter, top_p_filter
from model import IGNORE, ModelConfig, Transformer

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: extra threads only add overhead


TINY = dict(vocab_size=97, pad_vocab_multiple=64, block_size=32, n_layer=2, n_head=4, n_embd=32)
GPT2 = dict(TINY, pos_emb="learned", norm="layernorm", activation="gelu", bias=True, tie_embeddings=True)
LLAMA = dict(TINY, pos_emb="rope", norm="rmsnorm", activation="swiglu", n_kv_head=2)

VARIANTS = {
    "gpt2": GPT2,
    "llama_gqa": LLAMA,
    "llama_tied": dict(LLAMA, tie_embeddings=True),
    "mqa": dict(LLAMA, n_kv_head=1),
    "relu": dict(GPT2, activation="relu", tie_embeddings=False),
    "relu2": dict(LLAMA, activation="relu2", n_kv_head=0),
    "geglu": dict(LLAMA, activation="geglu", bias=True),
    "postnorm": dict(GPT2, prenorm=False),
    "postnorm_rms": dict(LLAMA, prenorm=False),
    "qk_norm": dict(LLAMA, qk_norm=True),
    "dropout": dict(GPT2, dropout=0.1),
    "ffn_hidden": dict(LLAMA, ffn_hidden=48),
}


def build(seed=0, **kw):
    torch.manual_seed(seed)
    return Transformer(ModelConfig(**kw))


def tokens(B, T, vocab=97, seed=1):
    return torch.randint(0, vocab, (B, T), generator=torch.Generator().manual_seed(seed))


# ----------------------------------------------------------------------------- independent reference

def ref_norm(cfg, sd, name, x):
    w = sd[name + ".weight"]
    if cfg.norm == "rmsnorm":
        return x / torch.sqrt((x * x).mean(-1, keepdim=True) + cfg.norm_eps) * w
    mu = x.mean(-1, keepdim=True)
    var = ((x - mu) ** 2).mean(-1, keepdim=True)
    y = (x - mu) / torch.sqrt(var + cfg.norm_eps) * w
    return y + sd[name + ".bias"] if cfg.bias else y


def ref_rope(x, theta):
    """x (T, D): rotate pair (x[i], x[i+D/2]) at position t by t * theta^(-2i/D), as a complex product."""
    T, D = x.shape
    freq = theta ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)
    rot = torch.polar(torch.ones(T, D // 2, dtype=torch.float64), torch.arange(T, dtype=torch.float64)[:, None] * freq)
    z = torch.complex(x[:, : D // 2].double(), x[:, D // 2:].double()) * rot
    return torch.cat([z.real, z.imag], -1).float()


def ref_linear(sd, name, x, bias):
    y = x @ sd[name + ".weight"].T
    return y + sd[name + ".bias"] if bias else y


def ref_act(name, x):
    gelu = 0.5 * x * (1 + torch.erf(x / math.sqrt(2)))
    return {"gelu": gelu, "geglu": gelu, "relu": x.clamp(min=0), "relu2": x.clamp(min=0) ** 2,
            "swiglu": x / (1 + torch.exp(-x))}[name]


def ref_forward(model, idx):
    """A from-scratch Transformer over the model's weights: one sequence at a time, one head at a time."""
    cfg, sd = model.cfg, model.state_dict()
    H, KV, D, L = cfg.n_head, cfg.kv_heads, cfg.n_embd // cfg.n_head, cfg.n_layer
    out = []
    for seq in idx:
        T = len(seq)
        x = sd["tok_emb.weight"][seq]
        if cfg.pos_emb == "learned":
            x = x + sd["pos_emb.weight"][:T]
        causal = torch.full((T, T), float("-inf")).triu(1)
        for i in range(L):
            p = f"blocks.{i}."
            h = ref_norm(cfg, sd, p + "norm1", x) if cfg.prenorm else x
            qkv = ref_linear(sd, p + "attn.qkv", h, cfg.bias)
            heads = []
            for hq in range(H):
                g = hq // (H // KV)  # consecutive query heads share one kv head
                q = qkv[:, hq * D:(hq + 1) * D]
                k = qkv[:, (H + g) * D:(H + g + 1) * D]
                v = qkv[:, (H + KV + g) * D:(H + KV + g + 1) * D]
                if cfg.qk_norm:
                    q = q / torch.sqrt((q * q).mean(-1, keepdim=True) + cfg.norm_eps) * sd[p + "attn.q_norm.weight"]
                    k = k / torch.sqrt((k * k).mean(-1, keepdim=True) + cfg.norm_eps) * sd[p + "attn.k_norm.weight"]
                if cfg.pos_emb == "rope":
                    q, k = ref_rope(q, cfg.rope_theta), ref_rope(k, cfg.rope_theta)
                att = torch.softmax(q @ k.T / math.sqrt(D) + causal, dim=-1)
                heads.append(att @ v)
            a = ref_linear(sd, p + "attn.proj", torch.cat(heads, -1), cfg.bias)
            x = x + a if cfg.prenorm else ref_norm(cfg, sd, p + "norm1", x + a)
            h = ref_norm(cfg, sd, p + "norm2", x) if cfg.prenorm else x
            f = ref_linear(sd, p + "mlp.fc", h, cfg.bias)
            if cfg.gated:
                f = ref_act(cfg.activation, f[:, :cfg.hidden]) * f[:, cfg.hidden:]
            else:
                f = ref_act(cfg.activation, f)
            m = ref_linear(sd, p + "mlp.proj", f, cfg.bias)
            x = x + m if cfg.prenorm else ref_norm(cfg, sd, p + "norm2", x + m)
        if cfg.prenorm:
            x = ref_norm(cfg, sd, "norm_f", x)
        out.append((x @ sd["head.weight"].T)[:, :cfg.vocab_size])
    return torch.stack(out)


# ----------------------------------------------------------------------------- variants train, match the reference

@pytest.mark.parametrize("name", VARIANTS)
def test_forward_backward(name):
    model = build(**VARIANTS[name]).train()
    x, y = tokens(2, 16), tokens(2, 16, seed=2)
    y[0, :3] = IGNORE
    loss = model(x, y)
    assert loss.dim() == 0 and torch.isfinite(loss)
    loss.backward()
    for n, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), n
    assert (model.head.weight is model.tok_emb.weight) == model.cfg.tie_embeddings


@pytest.mark.parametrize("name", VARIANTS)
def test_matches_reference(name):
    model = build(**VARIANTS[name]).eval()
    x, y = tokens(2, 12), tokens(2, 12, seed=2)
    y[1, 5:] = IGNORE
    ref = ref_forward(model, x)
    logits = model(x)
    assert logits.shape == (2, 12, 97)
    assert (logits - ref).abs().max() <= 1e-5
    for red in ("mean", "sum", "none"):
        want = F.cross_entropy(ref.flatten(0, 1), y.flatten(), ignore_index=-100, reduction=red)
        got = model(x, y, reduction=red)
        assert got.shape == (want.view(2, 12) if red == "none" else want).shape
        # relative: a summed loss grows with the batch, and its fp32 summation order differs from
        # F.cross_entropy's by CPU model (78.196198 vs 78.196182 seen: relative 2e-7)
        torch.testing.assert_close(got, want.view_as(got), rtol=1e-6, atol=1e-5)


def test_grad_checkpoint_same_grads():
    grads = []
    for ckpt in (False, True):
        model = build(**LLAMA, grad_checkpoint=ckpt).train()
        model(tokens(2, 16), tokens(2, 16, seed=2)).backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    for n in grads[0]:
        torch.testing.assert_close(grads[1][n], grads[0][n], rtol=0, atol=1e-7, msg=n)


def test_dropout_only_in_training():
    model = build(**VARIANTS["dropout"])
    x = tokens(2, 16)
    model.eval()
    assert torch.equal(model(x), model(x))
    model.train()
    assert not torch.equal(model(x), model(x))


def test_padded_vocab():
    model = build(**dict(LLAMA, vocab_size=100, pad_vocab_multiple=64)).eval()
    assert model.cfg.padded_vocab == 128
    assert model.tok_emb.weight.shape == model.head.weight.shape == (128, 32)
    x, y = tokens(2, 8, 100), tokens(2, 8, 100, seed=2)
    logits, loss = model(x), model(x, y)
    assert logits.shape == (2, 8, 100)
    torch.testing.assert_close(loss, F.cross_entropy(logits.flatten(0, 1), y.flatten()), rtol=1e-6, atol=1e-6)
    with torch.no_grad():  # padding rows carry no meaning: huge values there change nothing
        model.head.weight[100:] = 1e4
    assert torch.equal(model(x), logits) and torch.equal(model(x, y), loss)


def test_bf16_keeps_rope_fp32():
    model = build(**LLAMA).to(torch.bfloat16)
    assert model.rope_cos.dtype == torch.float32 and model.tok_emb.weight.dtype == torch.bfloat16
    assert torch.isfinite(model(tokens(1, 8), tokens(1, 8, seed=2)))


def test_residual_stream_dtype():
    """fp32_residual=False keeps the residual stream in the autocast dtype; it changes nothing
    without autocast, and under autocast the loss stays within bf16 rounding of the fp32 stream."""
    x, y = tokens(2, 16), tokens(2, 16, seed=2)
    fp32, bf16 = build(**LLAMA), build(**LLAMA, fp32_residual=False)
    seen = []
    for m in (fp32, bf16):
        m.blocks[-1].register_forward_hook(lambda mod, inp, out: seen.append(out.dtype))
    assert torch.equal(fp32(x, y), bf16(x, y))  # no autocast: the flag is inert
    with torch.autocast("cpu", dtype=torch.bfloat16):
        l32, l16 = fp32(x, y), bf16(x, y)
    assert seen[-2:] == [torch.float32, torch.bfloat16]
    assert l16.dtype == torch.float32 and not torch.equal(l32, l16)
    torch.testing.assert_close(l16, l32, rtol=2e-2, atol=0)


def test_meta_init_rebuilds_rope():
    cfg = ModelConfig(**LLAMA)
    with torch.device("meta"):
        model = Transformer(cfg)
    model.to_empty(device="cpu")
    model.init_weights()
    ref = Transformer(cfg)
    assert torch.equal(model.rope_cos, ref.rope_cos) and torch.equal(model.rope_sin, ref.rope_sin)


def test_compiles_without_graph_breaks():
    model = build(**LLAMA).train()
    compiled = torch.compile(model, backend="eager", fullgraph=True)  # fullgraph: a break is an error
    x, y = tokens(2, 16), tokens(2, 16, seed=2)
    torch.testing.assert_close(compiled(x, y), model(x, y), rtol=0, atol=1e-6)


# ----------------------------------------------------------------------------- KV cache

CACHE_CASES = {
    "rope_mha": dict(LLAMA, n_kv_head=0),
    "rope_gqa": LLAMA,
    "learned_mha": GPT2,
    "learned_gqa": dict(GPT2, n_kv_head=2),
    "rope_qknorm_mqa": dict(LLAMA, n_kv_head=1, qk_norm=True),
}


@pytest.mark.parametrize("name", CACHE_CASES)
def test_kv_cache_equals_full_forward(name):
    model = build(**CACHE_CASES[name]).eval()
    x = tokens(2, 14)
    full = model(x)
    cache = KVCache(max_len=14)
    # prefill 5, a chunk of 3 (causal mask offset by the cache), then one token at a time
    bounds = [0, 5, 8] + list(range(9, 15))
    parts = [model(x[:, a:b], cache=cache) for a, b in zip(bounds, bounds[1:])]
    assert cache.length == 14
    assert (torch.cat(parts, 1) - full).abs().max() <= 1e-5


@pytest.mark.parametrize("name", ["rope_gqa", "learned_mha"])
def test_left_padded_batch_equals_rows_alone(name):
    model = build(**CACHE_CASES[name]).eval()
    lengths, new, T = [7, 4, 1], 4, 7
    seqs = [tokens(1, n + new, seed=10 + n)[0] for n in lengths]  # prompt + continuation
    prompt = torch.zeros(3, T, dtype=torch.long)
    mask = torch.zeros(3, T, dtype=torch.long)
    for r, n in enumerate(lengths):
        prompt[r, T - n:], mask[r, T - n:] = seqs[r][:n], 1
    alone = [model(s[None])[0] for s in seqs]

    # no cache: one masked forward
    logits = model(prompt, attn_mask=mask)
    for r, n in enumerate(lengths):
        assert (logits[r, T - n:] - alone[r][:n]).abs().max() <= 1e-5

    # cache: masked prefill, then feed each row's continuation one token at a time
    cache = KVCache(T + new)
    steps = [model(prompt, cache=cache, attn_mask=mask)[:, T - 1]]
    for j in range(new - 1):
        mask = torch.cat([mask, torch.ones(3, 1, dtype=torch.long)], 1)
        nxt = torch.stack([s[n + j] for s, n in zip(seqs, lengths)])[:, None]
        steps.append(model(nxt, cache=cache, attn_mask=mask)[:, 0])
    for r, n in enumerate(lengths):
        got = torch.stack([s[r] for s in steps])
        assert (got - alone[r][n - 1:n - 1 + new]).abs().max() <= 1e-5


# ----------------------------------------------------------------------------- generation

def naive_greedy(model, idx, n):
    for _ in range(n):
        idx = torch.cat([idx, model(idx)[:, -1].argmax(-1, keepdim=True)], 1)
    return idx


@pytest.mark.parametrize("name", ["gpt2", "llama_gqa"])
def test_greedy_equals_naive_loop(name):
    model = build(**VARIANTS[name]).eval()
    x = tokens(3, 5)
    out = generate.generate(model, x, 10, vocab=model.cfg.vocab_size, temperature=0)
    assert out.shape == (3, 15) and torch.equal(out[:, :5], x)
    assert torch.equal(out, naive_greedy(model, x, 10))


def test_generate_left_padded_equals_rows_alone():
    model = build(**LLAMA).eval()
    prompts = [tokens(1, n, seed=20 + n)[0] for n in (6, 3, 1)]
    T = 6
    x = torch.zeros(3, T, dtype=torch.long)
    mask = torch.zeros(3, T, dtype=torch.long)
    for r, p in enumerate(prompts):
        x[r, T - len(p):], mask[r, T - len(p):] = p, 1
    model.train()  # generate must switch dropout off by itself, and restore the mode
    out = generate.generate(model, x, 8, vocab=model.cfg.vocab_size, temperature=0, attention_mask=mask)
    assert model.training
    for r, p in enumerate(prompts):
        assert torch.equal(out[r, T:], naive_greedy(model.eval(), p[None], 8)[0, len(p):])


def test_stop_tokens():
    model = build(**LLAMA).eval()
    x = tokens(2, 4)
    free = generate.generate(model, x, 12, vocab=model.cfg.vocab_size, temperature=0)
    stop = int(free[0, 4])  # row 0 stops on its first generated token
    for pad_id in (None, 0):
        out = generate.generate(model, x, 12, vocab=model.cfg.vocab_size, temperature=0, stop_tokens=[stop], pad_id=pad_id)
        ends = []
        for r in range(2):
            gen = free[r, 4:].tolist()
            k = gen.index(stop) + 1 if stop in gen else len(gen)  # tokens up to and incl. the stop
            ends.append(k)
        n = max(ends)
        assert out.shape == (2, 4 + n)  # early exit once every row stopped
        for r in range(2):
            want = free[r, 4:4 + ends[r]].tolist()
            want += [stop if pad_id is None else pad_id] * (n - ends[r])
            assert out[r, 4:].tolist() == want
    # a single row stopping ends generation at once
    assert generate.generate(model, x[:1], 12, vocab=model.cfg.vocab_size, temperature=0, stop_tokens=[stop]).shape == (1, 5)


def test_sampling_knobs():
    model = build(**GPT2).eval()
    x = tokens(2, 4)
    greedy = generate.generate(model, x, 6, vocab=model.cfg.vocab_size, temperature=0)
    assert torch.equal(generate.generate(model, x, 6, vocab=model.cfg.vocab_size, temperature=1.0, top_k=1, seed=0), greedy)
    a = generate.generate(model, x, 6, vocab=model.cfg.vocab_size, temperature=1.0, top_p=0.9, seed=123)
    b = generate.generate(model, x, 6, vocab=model.cfg.vocab_size, generator=torch.Generator().manual_seed(123), top_p=0.9)
    assert torch.equal(a, b)
    with pytest.raises(ValueError, match="block_size"):
        generate.generate(model, x, 29, vocab=model.cfg.vocab_size)


def test_top_p_and_top_k_filters():
    probs = torch.tensor([[0.125, 0.5, 0.0625, 0.25, 0.0625]])  # sorted: .5 .25 .125 .0625 .0625
    logits = probs.log()
    kept = lambda p: torch.isfinite(top_p_filter(logits, p))[0].tolist()
    T, F_ = True, False
    assert kept(0.3) == [F_, T, F_, F_, F_]    # 0.5 alone already >= 0.3
    assert kept(0.5) == [F_, T, F_, F_, F_]    # ... and >= 0.5 (boundary is inclusive)
    assert kept(0.6) == [F_, T, F_, T, F_]     # 0.5 + 0.25
    assert kept(0.75) == [F_, T, F_, T, F_]
    assert kept(0.76) == [T, T, F_, T, F_]     # 0.5 + 0.25 + 0.125 = 0.875
    assert kept(0.875) == [T, T, F_, T, F_]
    assert kept(1.0) == [T, T, T, T, T]
    torch.testing.assert_close(top_p_filter(logits, 0.75).softmax(-1),
                               torch.tensor([[0.0, 2 / 3, 0.0, 1 / 3, 0.0]]))
    assert torch.isfinite(top_k_filter(logits, 2))[0].tolist() == [F_, T, F_, T, F_]


# ----------------------------------------------------------------------------- counting

def test_counts_by_hand_llama():
    model = build(**dict(LLAMA, vocab_size=100, block_size=16))  # C=32, H=4, KV=2, D=8, L=2
    C, H, KV, D, L, Vp = 32, 4, 2, 8, 2, 128
    hidden = 128  # round_up(int(8 * 32 / 3) = 85, 64)
    assert model.cfg.hidden == hidden
    qkv, proj, fc, down = C * (H + 2 * KV) * D, H * D * C, C * 2 * hidden, hidden * C
    matmul = L * (qkv + proj + fc + down)
    assert matmul == 30720 == model.non_embedding_params()
    norms = L * 2 * C + C
    assert model.num_params() == matmul + norms + Vp * C + Vp * C  # untied: embedding + head
    assert model.num_params(non_embedding=True) == matmul + norms
    assert model.flops_per_token(16) == 6 * matmul + 6 * C * Vp + 6 * L * 16 * C == 215040
    assert model.flops_per_token() == model.flops_per_token(16)


def test_counts_by_hand_gpt2():
    model = build(**dict(GPT2, vocab_size=100, block_size=16))  # C=32, H=4, L=2, hidden=4C, biases, tied
    C, L, Vp, T = 32, 2, 128, 16
    matmul_layer = C * 3 * C + C * C + C * 4 * C + 4 * C * C
    bias_layer = 3 * C + C + 4 * C + C
    norm_layer = 2 * (C + C)  # two LayerNorms with weight and bias
    assert model.non_embedding_params() == L * matmul_layer == 24576
    total = L * (matmul_layer + bias_layer + norm_layer) + 2 * C + Vp * C + T * C  # head tied: counted once
    assert model.num_params() == total == 30080
    assert model.num_params(non_embedding=True) == total - Vp * C - T * C
    assert model.flops_per_token(8) == 6 * L * matmul_layer + 6 * C * Vp + 6 * L * 8 * C


# ----------------------------------------------------------------------------- config and init

@pytest.mark.parametrize("kw, field", [
    (dict(n_embd=100, n_head=12), "n_embd=100 is not divisible by n_head=12"),
    (dict(n_head=4, n_embd=32, n_kv_head=3), "n_kv_head"),
    (dict(activation="swish"), "activation"),
    (dict(norm="batchnorm"), "norm"),
    (dict(pos_emb="sinusoidal"), "pos_emb"),
    (dict(sliding_window=-1), "sliding_window"),
    (dict(sliding_window=4, window_from=12), "window_from"),
    (dict(n_embd=12, n_head=4), "head_dim"),
    (dict(dropout=1.0), "dropout"),
    (dict(n_layer=0), "n_layer"),
    (dict(vocab_size=-1), "vocab_size"),
])
def test_config_errors(kw, field):
    with pytest.raises(ValueError, match=field):
        ModelConfig(**kw)


def test_config_derived():
    c = ModelConfig(vocab_size=50257, n_embd=768, n_head=12, activation="gelu")
    assert (c.padded_vocab, c.kv_heads, c.head_dim, c.gated, c.hidden) == (50304, 12, 64, False, 3072)
    c = ModelConfig(n_embd=4096, n_head=32, n_kv_head=8, activation="swiglu")
    assert (c.kv_heads, c.head_dim, c.gated, c.hidden) == (8, 128, True, 10944)  # int(8*4096/3)=10922 -> 64s


def test_init_deterministic_and_scaled():
    a, b = build(seed=3, **GPT2).state_dict(), build(seed=3, **GPT2).state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    c = build(seed=4, **GPT2).state_dict()
    assert not torch.equal(a["blocks.0.attn.qkv.weight"], c["blocks.0.attn.qkv.weight"])

    model = build(**dict(LLAMA, n_embd=256, n_head=4, n_layer=8))
    std = lambda t: t.float().std().item()
    assert abs(std(model.blocks[0].attn.qkv.weight) - 0.02) < 0.001
    assert abs(std(model.blocks[0].mlp.proj.weight) - 0.02 / math.sqrt(16)) < 0.0003
    assert abs(std(model.blocks[0].attn.proj.weight) - 0.02 / math.sqrt(16)) < 0.0003
    assert all(torch.equal(m.weight, torch.ones_like(m.weight)) for m in (model.norm_f, model.blocks[1].norm2))
    gpt = build(**GPT2)
    assert torch.equal(gpt.blocks[0].attn.qkv.bias, torch.zeros_like(gpt.blocks[0].attn.qkv.bias))


def test_parameter_names():
    names = set(dict(build(**dict(GPT2, tie_embeddings=False)).named_parameters()))
    for n in ["tok_emb.weight", "pos_emb.weight", "blocks.0.norm1.weight", "blocks.0.attn.qkv.weight",
              "blocks.0.attn.proj.weight", "blocks.0.norm2.weight", "blocks.0.mlp.fc.weight",
              "blocks.1.mlp.proj.weight", "norm_f.weight", "head.weight"]:
        assert n in names, n
