"""modded-nanogpt's model options (ModelConfig: logit_softcap, value_embeds, unet_skips, fp8_head) against
hand-worked numbers, PyTorch references written here, and one process.

Proves, on CPU with tiny models:
- fused.softcap equals c tanh(z / c) worked by hand, values and derivatives; a model's logits, loss (every
  reduction, with a temperature), the chunked loss (memory/chunked.py) and Transformer.loss's CPU path
  equal F.cross_entropy of c tanh(raw logits / c), gradients included;
- value embeddings: the tables' shapes (padded vocab x kv width: GQA), the layers that read them
  (modded-nanogpt's 012 ... 012), and a hand-written forward (v = l0 v + l1 table[ids], SDPA) that gives
  the model's logits and every gradient (tables, lambdas); rows of absent tokens get no gradient;
- U-net skips: a hand-written loop (block L-1-i's input += w_i x block i's output, the middle block of an
  odd depth alone) gives the logits and the weights' gradients; weights start at 1;
- fp8_head: on CPU the head is nn.Linear exactly (logits, loss, gradients bit-identical), the log line
  says so; FP8Matmul's forward and backward equal the FP8 arithmetic emulated by hand (quantise to
  float8_e4m3fn / e5m2 with the scale, dequantise, matmul) and are within FP8's error of the exact
  matmul; FP8Linear runs FP8 only while training where the device has it (forced here);
- every option off leaves the forward exactly embed -> blocks -> norm -> head (bit-identical logits);
- generation: generate()'s seeded samples equal a naive loop over soft-capped full-forward logits, and
  decode()'s log-probs equal a teacher-forced forward's, with value embeddings and skips in the cache path;
- refusals in one line: pp > 1 with value_embeds / unet_skips, fp8_head with loss_chunk, HF export;
- init_from takes the options from a checkpoint (fp8_head stays the run's); one older than them loads with
  them off;
- all options on together: DP2, FSDP2, TP2 and TP2 with sequence parallelism and the chunked loss equal
  one process (losses, first gradients, weights after 2 AdamW steps, evaluation logits), in one spawn;
  with FP8 forced on CPU, TP2's and one process's gradients are within FP8's rounding of the exact ones.
GPU of compute capability >= 8.9 only: FP8Linear equals the emulation, compiled too.
"""
import json
import os
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from distributed import assert_close, global_batch, rel_err, spawn, train_cfg

import checkpoint
import config
import fused
import generate
import hf
import lifecycle
import optim
import parallel
import sft
import weights
from memory import chunked
from model import ModelConfig, Transformer, value_layer
from parallelism import dp, fsdp, pp, tp

pytestmark = pytest.mark.usefixtures("one_thread")
V, T = 97, 16


def cfg_of(**kw):
    base = dict(vocab_size=V, pad_vocab_multiple=32, block_size=T, n_layer=4, n_head=4, n_kv_head=2, n_embd=32,
                init_std=0.3)
    return ModelConfig(**{**base, **kw})


def tokens(seed, shape=(3, T)):
    return torch.randint(0, V, shape, generator=torch.Generator().manual_seed(seed))


def grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def plain_forward(model, idx):
    """The house model's forward, by hand: token embeddings, the blocks in order, final norm, head."""
    x = model.tok_emb(idx)
    for i, block in enumerate(model.blocks):
        x = block(x, model.rope_cos[None, :idx.shape[1], None], model.rope_sin[None, :idx.shape[1], None], layer=i)
    return model.head(model.norm_f(x))[..., :model.cfg.vocab_size]


# ----------------------------------------------------------------------------- logit_softcap

def test_softcap_hand_worked():
    z = torch.tensor([0.0, 1.0, -3.0, 100.0], requires_grad=True)
    y = fused.softcap(z, 2.0)
    # 2 tanh(z / 2): tanh(0.5) = 0.4621171573, tanh(1.5) = 0.9051482536, tanh(50) = 1 in fp32
    assert torch.allclose(y, torch.tensor([0.0, 0.9242343146, -1.8102965073, 2.0]), atol=1e-6)
    y.sum().backward()  # 1 - tanh^2
    assert torch.allclose(z.grad, torch.tensor([1.0, 0.7864477329, 0.1807066389, 0.0]), atol=1e-6)
    assert fused.softcap(z, 0.0) is z


@pytest.mark.parametrize("chunk", [0, 5])
def test_softcap_logits_loss_and_gradients(chunk):
    cap, cfg = 0.7, cfg_of(logit_softcap=0.7)
    torch.manual_seed(0)
    model, ref = Transformer(cfg), Transformer(cfg_of())
    ref.load_state_dict(model.state_dict())
    chunked.use(model, chunk)
    x, y = tokens(1), tokens(2)
    y[0, :4] = -100
    raw = ref(x)
    assert raw.abs().max() > 2 * cap  # the cap bites
    torch.testing.assert_close(model(x), cap * torch.tanh(raw / cap), rtol=0, atol=1e-6)
    for red in ("mean", "sum", "none"):
        for t in (1.0, 0.6):
            model.zero_grad()
            ref.zero_grad()
            got = model(x, y, reduction=red, temperature=t)
            want = F.cross_entropy((cap * torch.tanh(ref(x) / cap) / t).flatten(0, 1), y.flatten(), reduction=red)
            want = want.view(y.shape) if red == "none" else want
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
            got.sum().backward()
            want.sum().backward()
            assert_close(grads(model), grads(ref), f"chunk {chunk}, {red}, t {t}: gradients")
    logits = torch.randn(2, 5, V)  # the static loss (BERT, T5 call it): F.cross_entropy of the capped logits
    torch.testing.assert_close(Transformer.loss(logits, y[:2, :5], "sum", 0.5),
                               F.cross_entropy(0.5 * torch.tanh(logits / 0.5).flatten(0, 1), y[:2, :5].flatten(),
                                               reduction="sum"))


# ----------------------------------------------------------------------------- value embeddings, U-net skips

def ref_forward(model, idx, lambdas=True, skips=True):
    """GPT-2-style blocks written out here (learned positions, layernorm, gelu, SDPA with kv heads
    repeated), each layer's v = l0 v + l1 table[idx] where it has a table, and the U-net's loop."""
    cfg, (B, Tn) = model.cfg, idx.shape
    H, KV, D, L = cfg.n_head, cfg.kv_heads, cfg.head_dim, cfg.n_layer
    x = model.tok_emb(idx) + model.pos_emb(torch.arange(Tn))
    half, stack = (L // 2 if skips and cfg.unet_skips else 0), []
    for i, b in enumerate(model.blocks):
        if i >= L - half:
            x = x + model.skip_weights[i - (L - half)] * stack.pop()  # the last pushed first
        q, k, v = b.attn.qkv(b.norm1(x)).split([H * D, KV * D, KV * D], -1)
        j = value_layer(cfg, i)
        if lambdas and j is not None:
            v = b.attn.ve_lambdas[0] * v + b.attn.ve_lambdas[1] * model.value_embeds[j](idx)
        q, k, v = (t.view(B, Tn, -1, D).transpose(1, 2) for t in (q, k, v))
        k, v = (t.repeat_interleave(H // KV, dim=1) for t in (k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, Tn, H * D)
        x = x + b.attn.proj(a)
        x = x + b.mlp.proj(F.gelu(b.mlp.fc(b.norm2(x))))
        if i < half:
            stack.append(x)
    return model.head(model.norm_f(x))[..., :cfg.vocab_size]


GPT2 = dict(pos_emb="learned", norm="layernorm", activation="gelu", bias=True)


def test_value_embeds_layers_and_shapes():
    assert [value_layer(cfg_of(n_layer=12, value_embeds=3), i) for i in range(12)] == [0, 1, 2] + [None] * 6 + [0, 1, 2]
    assert [value_layer(cfg_of(n_layer=5, value_embeds=2), i) for i in range(5)] == [0, 1, None, 0, 1]
    assert [value_layer(cfg_of(n_layer=4), i) for i in range(4)] == [None] * 4
    m = Transformer(cfg_of(n_layer=5, value_embeds=2))  # GQA: 2 kv heads of 8
    assert [tuple(e.weight.shape) for e in m.value_embeds] == [(128, 16)] * 2  # padded vocab x kv width
    assert [hasattr(b.attn, "ve_lambdas") for b in m.blocks] == [True, True, False, True, True]
    assert torch.equal(m.blocks[0].attn.ve_lambdas, torch.tensor([0.5, 0.5]))
    # token table, untied head and the value tables are embeddings; the 4 lambdas are not
    assert m.num_params() - m.num_params(non_embedding=True) == 2 * 128 * 32 + 2 * 128 * 16
    with pytest.raises(ValueError, match="value_embeds=3"):
        cfg_of(value_embeds=3)  # more than half the layers


@pytest.mark.parametrize("n_layer,unet,ve", [(4, False, 2), (4, True, 0), (5, True, 1), (4, True, 1)])
def test_value_embeds_and_skips_equal_hand_written_forward(n_layer, unet, ve):
    cfg = cfg_of(n_layer=n_layer, value_embeds=ve, unet_skips=unet, **GPT2)
    torch.manual_seed(0)
    model = Transformer(cfg)
    with torch.no_grad():  # off their init, so each lambda and weight matters
        for p in model.parameters():
            if p.dim() == 1 and p.numel() <= n_layer:
                p.add_(torch.randn(p.shape) * 0.3)
    if unet:
        assert model.skip_weights.shape == (n_layer // 2,)
    x, y = tokens(3), tokens(4)
    x[:, 0] = 5  # token 5 occurs; token 6 never does
    x[x == 6] = 7
    got = model(x)
    want = ref_forward(model, x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    if ve or unet:  # the references without them differ: the test sees them
        assert (want - ref_forward(model, x, lambdas=False, skips=False)).abs().max() > 1e-2
    F.cross_entropy(got.flatten(0, 1), y.flatten()).backward()
    g = grads(model)
    model.zero_grad()
    F.cross_entropy(ref_forward(model, x).flatten(0, 1), y.flatten()).backward()
    assert_close(g, grads(model), f"L={n_layer} unet={unet} ve={ve}: gradients")
    for e in model.value_embeds:
        assert e.weight.grad[5].abs().sum() > 0 and (e.weight.grad[6] == 0).all()


def test_unet_skips_hand_loop_and_init():
    """L = 5 by hand: blocks 0, 1 push, block 2 alone, block 3 gets block 1's output (w0), block 4 block 0's (w1)."""
    model = Transformer(cfg_of(n_layer=5, unet_skips=True, **GPT2))
    assert torch.equal(model.skip_weights, torch.ones(2))  # modded-nanogpt's init
    with torch.no_grad():
        model.skip_weights.copy_(torch.tensor([0.7, -1.3]))
    x = tokens(5)
    B = [lambda h, b=b, i=i: b(h, layer=i) for i, b in enumerate(model.blocks)]
    h0 = B[0](model.tok_emb(x) + model.pos_emb(torch.arange(T)))
    h1 = B[1](h0)
    h2 = B[2](h1)
    h3 = B[3](h2 + 0.7 * h1)
    h4 = B[4](h3 - 1.3 * h0)
    torch.testing.assert_close(model(x), model.head(model.norm_f(h4))[..., :V], rtol=1e-5, atol=1e-5)


def test_options_off_leave_the_forward_as_it_was():
    cfg = cfg_of()
    assert (cfg.logit_softcap, cfg.value_embeds, cfg.unet_skips, cfg.fp8_head) == (0.0, 0, False, False)
    torch.manual_seed(0)
    model = Transformer(cfg)
    assert type(model.head) is torch.nn.Linear and model.skip_weights is None and len(model.value_embeds) == 0
    assert not any("ve_lambdas" in n or "skip" in n or "value" in n for n in model.state_dict())
    x = tokens(6)
    assert torch.equal(model(x), plain_forward(model, x))


# ----------------------------------------------------------------------------- fp8_head

def emulate_fp8(x, w, g):
    """modded-nanogpt's / torchao's FP8 arithmetic by hand: per-tensor scale amax / the format's largest
    value, quantise, dequantise, fp32 matmuls. -> (x w^T, dx = g w, dw = g^T x)."""
    def q(t, dtype):
        s = t.abs().amax().float() / torch.finfo(dtype).max
        return (t.float() / s).to(dtype).float() * s
    xq, wq, gq = q(x, torch.float8_e4m3fn), q(w, torch.float8_e4m3fn), q(g, torch.float8_e5m2)
    return xq @ wq.T, gq @ wq, gq.T @ xq


def scaled_mm_on_cpu():
    try:
        fused.scaled_mm(*fused.to_fp8(torch.ones(16, 16), torch.float8_e4m3fn)[:1],
                        torch.ones(16, 16, dtype=torch.float8_e4m3fn).t(), torch.tensor(1.0), torch.tensor(1.0),
                        torch.float32)
        return True
    except (RuntimeError, NotImplementedError):
        return False


def test_fp8_head_on_cpu_is_the_plain_head():
    cfg = cfg_of(logit_softcap=2.0, fp8_head=True)
    assert not fused.has_fp8("cpu")
    torch.manual_seed(0)
    model, ref = Transformer(cfg), Transformer(cfg_of(logit_softcap=2.0))
    assert isinstance(model.head, fused.FP8Linear)
    ref.load_state_dict(model.state_dict())
    x, y = tokens(7), tokens(8)
    model(x, y).backward()
    ref(x, y).backward()
    assert torch.equal(model(x, y), ref(x, y)) and torch.equal(model(x), ref(x))
    for (n, a), b in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(a.grad, b.grad), n
    cfg = train_cfg({}, fp8_head=True)
    grid = SimpleNamespace(device=torch.device("cpu"), world=1, pp=1, dp=1, ep=1, tp=1)
    assert "fp8_head: no FP8 on cpu (needs compute capability >= 8.9): the head's matmul in" in \
        lifecycle.layout(cfg, grid)
    assert "fp8_head" not in lifecycle.layout(train_cfg({}), grid)


@pytest.mark.skipif(not scaled_mm_on_cpu(), reason="torch._scaled_mm does not run on this CPU build")
def test_fp8_matmul_equals_emulation(monkeypatch):
    torch.manual_seed(0)
    x, w, g = torch.randn(48, 64) * 3, torch.randn(80, 64) * 0.05, torch.randn(48, 80) * 1e-3
    x8, sx = fused.to_fp8(x, torch.float8_e4m3fn)
    assert x8.dtype == torch.float8_e4m3fn and (x8.float() * sx).abs().max() == x.abs().max()  # amax -> 448
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    out = fused.FP8Matmul.apply(xr, wr, torch.float32)
    out.backward(g)
    want, dx, dw = emulate_fp8(x, w, g)
    for name, a, b in (("out", out, want), ("dx", xr.grad, dx), ("dw", wr.grad, dw)):
        assert (a - b).norm() / b.norm() < 1e-6, name
    exact = [x @ w.T, g @ w, g.T @ x]  # FP8 rounds (3 mantissa bits, 2 for the gradient): near, not equal
    for a, b in zip((out, xr.grad, wr.grad), exact):
        assert 1e-4 < ((a - b).norm() / b.norm()).item() < 0.1
    # FP8Linear takes the FP8 path where the device has it, only while training
    monkeypatch.setattr(fused, "has_fp8", lambda device: True)
    head = fused.FP8Linear(64, 80, bias=False)
    with torch.no_grad():
        head.weight.copy_(w)
    assert torch.equal(head(x), fused.FP8Matmul.apply(x, w, torch.float32))
    assert torch.equal(head(x[:7]), F.linear(x[:7], w))  # rows no multiple of 16: _scaled_mm cannot
    assert torch.equal(head.eval()(x), F.linear(x, w))


@pytest.mark.skipif(not (torch.cuda.is_available() and fused.has_fp8("cuda")), reason="needs a GPU with FP8")
@pytest.mark.parametrize("compiled", [False, True])
def test_fp8_linear_on_gpu(compiled):
    torch.manual_seed(0)
    x = torch.randn(4, 64, 768, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    head = fused.FP8Linear(768, 1024, bias=False).cuda()
    g = torch.randn(4, 64, 1024, device="cuda", dtype=torch.bfloat16) * 1e-3
    fn = torch.compile(head) if compiled else head
    with torch.autocast("cuda", torch.bfloat16):
        out = fn(x)
    assert out.dtype == torch.bfloat16
    out.backward(g)
    want, dx, dw = emulate_fp8(x.detach().flatten(0, 1), head.weight.detach(), g.flatten(0, 1))
    got = (("out", out.flatten(0, 1), want), ("dx", x.grad.flatten(0, 1), dx), ("dw", head.weight.grad, dw))
    for name, a, b in got:
        assert ((a.float() - b).norm() / b.norm()).item() < 1e-2, name  # bf16 output rounding


# ----------------------------------------------------------------------------- generation

ALL = dict(logit_softcap=0.8, value_embeds=1, unet_skips=True, fp8_head=True, qk_norm=True, activation="relu2")


def test_generation_applies_every_option():
    torch.manual_seed(0)
    model = Transformer(cfg_of(**ALL)).eval()
    prompt, n = tokens(9, (2, 5)), 6
    got = generate.generate(model, prompt, n, vocab=V, temperature=1.0, seed=3)
    seq, gen = prompt, torch.Generator().manual_seed(3)  # naive: every step re-runs the whole prefix
    with torch.no_grad():
        for _ in range(n):
            h = model.hidden_states(seq)[:, -1]
            logits = 0.8 * torch.tanh(model.head(h)[:, :V] / 0.8)
            seq = torch.cat([seq, generate.sample(logits, 1.0, None, None, gen)[:, None]], 1)
    assert torch.equal(got, seq)
    ro = generate.decode(model, prompt, n, vocab=V, temperature=1.0, seed=3, bucket=4)
    with torch.no_grad():  # teacher-forced log-probs of what decode sampled (its prompts all real: no padding)
        lp = -model(ro.tokens[:, :-1], ro.tokens[:, 1:], reduction="none")[:, prompt.shape[1] - 1:]
        raw = -F.cross_entropy(plain_forward(model, ro.tokens[:, :-1]).transpose(1, 2), ro.tokens[:, 1:],
                               reduction="none")[:, prompt.shape[1] - 1:]
    torch.testing.assert_close(ro.logprobs, lp, rtol=1e-5, atol=1e-5)
    assert (ro.logprobs - raw).abs().max() > 1e-2  # uncapped (and without the options) they differ


# ----------------------------------------------------------------------------- refusals

def test_refusals(tmp_path):
    for key in ("value_embeds", "unet_skips"):
        cfg = train_cfg({}, pp=2, **{key: 1 if key == "value_embeds" else True})
        with pytest.raises(config.UserError, match=f"pp > 1 with .*{key}"):
            pp.check(cfg, 1)
    with pytest.raises(config.UserError, match="fp8_head=True .* loss_chunk=64"):
        chunked.check(train_cfg({}, fp8_head=True, loss_chunk=64))
    chunked.check(train_cfg({}, fp8_head=True))
    for kw, name in ((dict(logit_softcap=30.0), "logit_softcap=30.0"), (dict(value_embeds=1), "value_embeds=1"),
                     (dict(unet_skips=True), "unet_skips=True")):
        with pytest.raises(ValueError, match=f"cannot be exported to Hugging Face: {name}"):
            hf.export_hf(Transformer(cfg_of(**kw)), str(tmp_path / name))
        assert not os.path.exists(tmp_path / name)
    hf.export_hf(Transformer(cfg_of(fp8_head=True)), str(tmp_path / "fp8"))  # a run's speed choice: exportable


def test_init_from_carries_the_options_and_reads_older_checkpoints(tmp_path):
    cfg = train_cfg(dict(ALL, vocab_size=V, n_layer=2, n_head=2, n_embd=16, block_size=T))
    path = checkpoint.save(str(tmp_path / "run"), 1, Transformer(ModelConfig.from_cfg(cfg)).state_dict(), None, cfg)
    new = config.load([f"--init_from={path}", "--fp8_head=False"], extra=sft.EXTRA, world=1)
    weights.configure(new)
    assert (new.logit_softcap, new.value_embeds, new.unet_skips, new.fp8_head) == (0.8, 1, True, False)
    meta = os.path.join(path, "config.json")  # a checkpoint written before these keys existed
    with open(meta) as f:
        old = {k: v for k, v in json.load(f).items() if k not in ("logit_softcap", "value_embeds", "unet_skips",
                                                                  "fp8_head")}
    with open(meta, "w") as f:
        json.dump(old, f)
    new = config.load([f"--init_from={path}", "--value_embeds=1"], extra=sft.EXTRA, world=1)
    assert "value_embeds=0 (not 1 as given)" in weights.configure(new)
    assert (new.logit_softcap, new.value_embeds, new.unet_skips) == (0.0, 0, False)


# ----------------------------------------------------------------------------- layouts, one spawn

BASE = dict(ALL, vocab_size=V, pad_vocab_multiple=32, n_layer=4, n_head=4, n_kv_head=2, n_embd=32, block_size=T,
            logit_softcap=0.1, value_embeds=1, lr=3e-3, eps=1e-6, weight_decay=0.1, grad_bucket_mb=0.01)
STEPS = 2
# (tag, tp, data_parallel, sequence_parallel, loss_chunk)
LAYOUTS = [("dp2", 1, "ddp", False, 0), ("fsdp2", 1, "fsdp", False, 0), ("tp2", 2, "ddp", False, 0),
           ("tp2_sp_chunked", 2, "ddp", True, 24)]


def full_grads(raw, grid):
    """{name: full gradient}: the gradients put in the weights' place for parallel.full_state_dict (TP cuts)."""
    with torch.no_grad():
        params = [p for p in raw.parameters()]
        kept = [p.detach().clone() for p in params]
        for p in params:
            p.copy_(p.grad)
        out = {n: t for n, t in parallel.full_state_dict(raw, grid).items() if not n.endswith(("rope_cos", "rope_sin"))}
        for p, k in zip(params, kept):
            p.copy_(k)
    return out


def train(grid, data_parallel="ddp", sp=False, chunk=0, steps=STEPS):
    """`steps` AdamW steps on the global batches (this rank's share) -> losses, full first gradients, full
    weights, evaluation logits of the first batch."""
    cfg = train_cfg(BASE, tp=grid.tp, data_parallel=data_parallel, sequence_parallel=sp)
    torch.manual_seed(0)
    raw = chunked.use(tp.tensor_parallel(Transformer(ModelConfig.from_cfg(cfg)), grid, sequence_parallel=sp), chunk)
    model = fsdp.FSDP(raw, grid) if data_parallel == "fsdp" else dp.DataParallel(raw, grid, cfg.grad_bucket_mb)
    opt = optim.build_optimizer(model if data_parallel == "fsdp" else raw, cfg, grid)
    rec = {"loss": []}
    for s in range(steps):
        per = len(global_batch(s, T, V)[0]) // grid.dp
        x, y = (t[grid.dp_rank * per:(grid.dp_rank + 1) * per] for t in global_batch(s, T, V))
        loss = model(x, y)
        loss.backward()
        model.finish()
        rec["loss"].append(loss.item())
        if s == 0:
            fsdp_grads = data_parallel == "fsdp"
            rec["grads"] = fsdp.gather_by_name(model, lambda u: u.grad) if fsdp_grads else full_grads(raw, grid)
        opt.step()
        model.zero_grad()
    wrapper = model if data_parallel == "fsdp" else None
    rec["weights"] = parallel.Net(raw, wrapper, raw, opt, grid).full_state(optimizer=False)[0]
    model.eval()
    with torch.no_grad():
        rec["logits"] = model(global_batch(0, T, V)[0])
    return rec


def _layouts(rank, out_dir):
    recs = {}
    for tag, tp_size, kind, sp, chunk in LAYOUTS:
        grid = parallel.init(SimpleNamespace(device="cpu", tp=tp_size, ep=1))
        recs[tag] = train(grid, kind, sp, chunk)
    fused.has_fp8 = lambda device: True  # (this process only) the FP8 head on CPU: torch._scaled_mm runs there
    if scaled_mm_on_cpu():
        recs["tp2_fp8"] = train(grid, steps=1)  # the last grid: TP2
    torch.save(recs, os.path.join(out_dir, f"rank{rank}.pt"))


def test_all_options_dp2_fsdp2_tp2_equal_one_process(tmp_path, monkeypatch):
    grid = parallel.init(SimpleNamespace(device="cpu", tp=1, ep=1))
    ref = train(grid)
    m = Transformer(ModelConfig.from_cfg(train_cfg(BASE)))
    assert isinstance(m.head, fused.FP8Linear) and len(m.value_embeds) == 1 and m.skip_weights is not None
    spawn(_layouts, 2, str(tmp_path))
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for tag, *_ in LAYOUTS:
        what = [r[tag] for r in ranks]
        for s in range(STEPS):  # the mean of the ranks' losses (DP: each its half; TP: both the whole)
            got = sum(w["loss"][s] for w in what) / 2
            want = ref["loss"][s]
            assert abs(got - want) <= 1e-5 * abs(want), f"{tag} step {s}: loss {got} vs {want}"
        for r, w in enumerate(what):
            assert_close(w["grads"], ref["grads"], f"{tag} rank {r}: first gradients")
            assert_close(w["weights"], ref["weights"], f"{tag} rank {r}: weights after {STEPS} steps")
            assert_close(w["logits"], ref["logits"], f"{tag} rank {r}: evaluation logits")
    if not scaled_mm_on_cpu():
        return
    # TP2's head in FP8 (each rank its own columns' scales) and one process's: near the exact gradients, within
    # FP8's rounding (e5m2's 2 mantissa bits on the logits' gradient: ~7% here), far from a wrong path's 50%+
    monkeypatch.setattr(fused, "has_fp8", lambda device: True)
    fp8 = train(grid, steps=1)
    for what, rec in [("one process", fp8)] + [(f"TP2 rank {r}", ranks[r]["tp2_fp8"]) for r in range(2)]:
        assert 1e-7 < abs(rec["loss"][0] - ref["loss"][0]) < 1e-3 * ref["loss"][0], f"{what}: FP8 ran, near"
        assert_close(rec["grads"], ref["grads"], f"{what}, the FP8 head: first gradients", tol=0.2)
        assert max(rel_err(rec["grads"][n], g) for n, g in ref["grads"].items()) > 1e-2
