"""Mixture of experts (moe.py) is correct, and expert parallelism equals one process.

What these tests prove, on CPU in fp32 (gloo for the distributed ones):
- the MoE layer equals a per-token dense oracle written plainly here (router softmax, top-k,
  renormalisation, capacity granted in choice-major slot order, shared expert): outputs and the
  gradients of input, router and every expert (relative error <= 1e-5), dropless and with
  capacity dropping, including an expert that receives no tokens (exactly zero gradient),
  and local experts that together receive no rows (an EP rank's dropless case);
- the grouped expert kernel (torch._grouped_mm over all experts at once) equals the per-expert
  loop: outputs and gradients (relative error <= 1e-6), dropless and with capacity, an expert
  without tokens (exactly zero gradient), no rows at all; it really runs (counted calls); dropless
  it reads nothing on the host (torch.compile traces the layer whole, fullgraph; the loop is kept
  out of the graph); forcing it on unaligned shapes or naming an unknown kernel is one clear error; on a
  Hopper GPU (skipped elsewhere) "auto" picks it under bf16 and its forward and backward run
  under torch.cuda.set_sync_debug_mode("error"), equal to the loop within bf16 rounding;
- golden values: the balance loss of a perfectly balanced router equals its coefficient; the
  z-loss of a hand-computed example; the router runs in fp32 under bf16 autocast;
- a MoE Transformer trains, adds its router losses to the loss, counts total and active params;
- EP=2 (and EP=2 x DP=2, dropless and capacity; EP=2 with the grouped kernel; EP=2 dropless
  compiled whole, with no recompilation over the steps) equals one process: outputs (losses), first gradients, weights after 3 AdamW steps with clipping;
  router-loss values (mean over ranks) and gradients equal one process for the same global
  micro-batch, also with gradient accumulation; expert and non-expert parameters stay bitwise
  identical across their replicas.
(EP with TP, FSDP, Muon and resuming across layouts: tests/test_moe_layouts.py.)
"""
import math
import os
from types import SimpleNamespace

import distributed
import pytest
import torch
from distributed import full_state, rel_err, spawn, train_cfg

import config
import lifecycle
import moe
import optim
import parallel
from model import ModelConfig, Transformer, make_moe
from parallelism import dp

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: extra threads only add overhead




def layer_cfg(**kw):
    d = dict(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=16, ffn_hidden=24,
             n_experts=4, moe_top_k=2)
    d.update(kw)
    return ModelConfig(**d)


def oracle(layer, x):
    """Per-token dense reference, written plainly: loops over tokens and choices.
    x (B, T, C); capacity is granted per sequence, every first choice before any second one."""
    B, T, C = x.shape
    x = x.reshape(B * T, C)
    N, E, k = B * T, layer.n_experts, layer.top_k
    logits = x @ layer.router.weight.t()
    probs = torch.softmax(logits, dim=-1)
    choices = [torch.topk(probs[n], k) for n in range(N)]
    keep = [[True] * k for _ in range(N)]
    if layer.capacity_factor > 0:
        cap = max(1, math.ceil(layer.capacity_factor * T * k / E))
        for b in range(B):
            taken = [0] * E
            for j in range(k):
                for n in range(b * T, (b + 1) * T):
                    e = int(choices[n].indices[j])
                    keep[n][j] = taken[e] < cap
                    taken[e] += 1
    act = layer.act
    rows = []
    for n in range(N):
        w, idx = choices[n]
        if layer.renorm:
            w = w / w.sum()
        y = torch.zeros(C)
        for j in range(k):
            if not keep[n][j]:
                continue
            e = int(idx[j])
            h = layer.w1[e] @ x[n]
            if layer.gated:
                g, u = h.chunk(2)
                h = act(g) * u
            else:
                h = act(h)
            y = y + w[j] * (layer.w2[e] @ h)
        if layer.shared is not None:
            y = y + layer.shared(x[n])
        rows.append(y)
    return torch.stack(rows).view(B, T, C)


def grads_of(layer, x, fn, dy):
    layer.zero_grad()
    x = x.clone().requires_grad_(True)
    y = fn(x)
    (y * dy).sum().backward()
    g = {n: p.grad.clone() for n, p in layer.named_parameters()}
    g["x"] = x.grad.clone()
    return y.detach(), g


@pytest.mark.parametrize("kw", [
    dict(),                                              # dropless, swiglu, renormalised
    dict(capacity_factor=1.0),                           # dropping
    dict(capacity_factor=0.5, moe_top_k=3, n_experts=5, activation="gelu", moe_renorm=False),
    dict(n_shared_experts=1, moe_hidden=8, capacity_factor=1.25),
])
def test_layer_equals_dense_oracle(kw):
    torch.manual_seed(0)
    layer = make_moe(layer_cfg(**kw))
    B, N, C, E = 2, 6, 16, layer.n_experts
    x = torch.rand(B, N, C) + 0.5  # positive: a router row of -1s is never chosen
    with torch.no_grad():
        layer.router.weight.normal_(0, 0.3)
        layer.router.weight[E - 1] = -1.0  # expert E-1 gets no tokens
        layer.w1.normal_(0, 0.3)
        layer.w2.normal_(0, 0.3)
    dy = torch.randn(B, N, C)
    y, g = grads_of(layer, x, layer, dy)
    y_ref, g_ref = grads_of(layer, x, lambda t: oracle(layer, t), dy)
    assert rel_err(y, y_ref) <= 1e-5
    for name in g_ref:
        assert rel_err(g[name], g_ref[name]) <= 1e-5, name
    assert layer.stats["load"][E - 1] == 0
    assert torch.equal(g["w1"][E - 1], torch.zeros_like(g["w1"][E - 1]))  # took part, zero gradient
    assert torch.equal(g["w2"][E - 1], torch.zeros_like(g["w2"][E - 1]))
    if kw.get("capacity_factor", 0):
        assert layer.stats["dropped"] > 0  # the capacity path really dropped slots
    else:
        assert layer.stats["dropped"] == 0


GROUPED_CASES = [
    dict(),                                              # dropless, swiglu, an expert without tokens
    dict(capacity_factor=1.0),                           # dropping: equal blocks
    dict(capacity_factor=0.5, moe_top_k=3, n_experts=5, activation="gelu", moe_renorm=False),
    dict(n_shared_experts=1, moe_hidden=8),              # dropless, shared expert, hidden 8
]


@pytest.mark.parametrize("kw", GROUPED_CASES)
def test_grouped_equals_loop(kw, monkeypatch):
    """The grouped kernel (torch._grouped_mm over all experts at once) gives the per-expert loop's
    outputs and gradients (fp32), and really runs: two _grouped_mm calls per forward, none in the
    loop. expert_mm "auto" on CPU is the loop."""
    calls = []
    real = torch._grouped_mm
    monkeypatch.setattr(torch, "_grouped_mm", lambda *a, **k: calls.append(1) or real(*a, **k))
    torch.manual_seed(0)
    layer = make_moe(layer_cfg(**kw))
    E = layer.n_experts
    x = torch.rand(2, 6, 16) + 0.5
    with torch.no_grad():
        layer.router.weight.normal_(0, 0.3)
        layer.router.weight[E - 1] = -1.0  # expert E-1 gets no tokens
    dy = torch.randn(2, 6, 16)
    out = {}
    for mode in ("loop", "auto", "grouped"):
        layer.expert_mm = mode
        out[mode] = grads_of(layer, x, layer, dy)
        assert len(calls) == (2 if mode == "grouped" else 0), mode
    (y, g), (y_ref, g_ref) = out["grouped"], out["loop"]
    assert rel_err(y, y_ref) <= 1e-6
    for name in g_ref:
        assert rel_err(g[name], g_ref[name]) <= 1e-6, name
        assert torch.equal(out["auto"][1][name], g_ref[name]), name
    assert torch.equal(g["w1"][E - 1], torch.zeros_like(g["w1"][E - 1]))  # no tokens: exactly zero
    assert g["w1"].abs().sum() > 0
    if kw.get("capacity_factor", 0):
        assert layer.stats["dropped"] > 0


def test_grouped_dropless_traces_without_host_sync():
    """Dropless with the grouped kernel reads no routing-dependent value on the host: torch.compile
    traces the layer as one graph (fullgraph=True; bf16: the op's meta function takes bf16 only),
    and the traced layer equals eager. The loop, which reads its block sizes on the host, is kept
    out of the graph (MoE._host_sized runs eagerly: fullgraph refuses it, the check can fail),
    and the whole model compiled with it still equals eager."""
    torch.manual_seed(0)
    layer = make_moe(layer_cfg())
    x = torch.randn(2, 8, 16, dtype=torch.bfloat16)
    layer.expert_mm = "grouped"
    y = torch.compile(layer, backend="eager", fullgraph=True)(x)
    assert torch.equal(y, layer(x))
    assert not layer.sync_free("cpu", torch.bfloat16)  # on CPU _grouped_mm reads offs on the host
    layer.expert_mm = "loop"
    with pytest.raises(Exception, match="disable"):
        torch.compile(layer, backend="eager", fullgraph=True)(x)
    x = x.float()  # (the loop takes fp32 rows here: no autocast)
    assert torch.equal(torch.compile(layer, backend="eager")(x), layer(x))  # a graph break, not an error


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                    reason="the grouped kernel's fast path: a CUDA GPU of compute capability 9.x")
def test_grouped_cuda_bf16_no_sync():
    """On Hopper under bf16 autocast, dropless: "auto" picks the grouped kernel, and its forward
    and backward never synchronise with the host (torch.cuda.set_sync_debug_mode("error") raises
    on any sync; the loop's block sizes would); outputs and gradients equal the loop's within bf16
    rounding; an expert without tokens gets exactly zero gradient."""
    torch.manual_seed(0)
    E = 8
    layer = make_moe(layer_cfg(n_embd=64, moe_hidden=128, n_experts=E)).cuda()
    with torch.no_grad():
        layer.router.weight.normal_(0, 0.3)
        layer.router.weight[E - 1] = -1.0  # x > 0: expert E-1 gets no tokens
    x = torch.rand(4, 32, 64, device="cuda") + 0.5
    dy = torch.randn(4, 32, 64, device="cuda")
    out = {}
    for mode in ("loop", "auto"):
        layer.expert_mm = mode
        assert layer.sync_free("cuda", torch.bfloat16) == (mode == "auto")
        layer.zero_grad()
        xg = x.clone().requires_grad_(True)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error" if mode == "auto" else 0)
        try:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                y = layer(xg)
            (y.float() * dy).sum().backward()
        finally:
            torch.cuda.set_sync_debug_mode(0)
        out[mode] = [y.float(), xg.grad] + [p.grad.clone() for p in layer.parameters()]
    for got, want in zip(out["auto"], out["loop"]):
        assert rel_err(got, want) <= 2e-2
    assert torch.equal(layer.w1.grad[E - 1], torch.zeros_like(layer.w1.grad[E - 1]))
    assert torch.equal(layer.w2.grad[E - 1], torch.zeros_like(layer.w2.grad[E - 1]))


def test_grouped_errors():
    """Forcing the grouped kernel on rows it cannot take, or an unknown kernel: one clear error."""
    layer = make_moe(layer_cfg(n_embd=18, n_head=1))  # 18 fp32 = 72 bytes, not a multiple of 16
    layer.expert_mm = "grouped"
    with pytest.raises(ValueError, match="n_embd=18 .* multiples of 4"):
        layer(torch.randn(1, 4, 18))
    hidden = make_moe(layer_cfg(moe_hidden=6))
    hidden.expert_mm = "grouped"
    with pytest.raises(ValueError, match="hidden size per rank 6 multiples of 4"):
        hidden(torch.randn(1, 4, 16))
    layer.expert_mm = "fast"
    with pytest.raises(ValueError, match="choose 'auto', 'grouped' or 'loop'"):
        layer(torch.randn(1, 4, 18))


def test_experts_with_no_rows():
    """An EP rank may receive no slot at all for its experts (dropless): empty output, zero gradients."""
    layer = make_moe(layer_cfg())
    out = layer._ffn(torch.zeros(0, 16, requires_grad=True), [0] * 4)
    assert out.shape == (0, 16)
    out.sum().backward()
    assert layer.w1.grad.abs().sum() == 0 and layer.w2.grad.abs().sum() == 0
    layer.zero_grad()
    layer.expert_mm = "grouped"  # the same with the grouped kernel (whose backward takes a dense
    out = layer._ffn(torch.zeros(0, 16, requires_grad=True), [0] * 4)  # gradient, as _dropless gives)
    assert out.shape == (0, 16)
    out.backward(torch.zeros(0, 16))
    assert torch.equal(layer.w1.grad, torch.zeros_like(layer.w1)) and torch.equal(layer.w2.grad, torch.zeros_like(layer.w2))


def test_balance_loss_golden():
    """Perfectly balanced router (uniform probabilities, every expert the same load) -> coeff."""
    layer = make_moe(layer_cfg(n_experts=4, moe_top_k=1, aux_loss_coeff=0.01, z_loss_coeff=0.0))
    with torch.no_grad():
        layer.router.weight.zero_()  # uniform probs; topk ties break to expert 0 -> make loads equal by hand
    logits = torch.zeros(8, 4)
    counts = torch.tensor([2, 2, 2, 2])
    layer._losses(logits, logits.softmax(-1), counts, counts.new_zeros(()))
    assert abs(layer.stats["aux_loss"].item() - 0.01) < 1e-9
    assert torch.allclose(layer.stats["load"], torch.full((4,), 0.25))
    # top-2 of 4 experts: f normalised by tokens * top_k, still exactly the coefficient
    layer.top_k = 2
    layer._losses(logits, logits.softmax(-1), torch.tensor([4, 4, 4, 4]), counts.new_zeros(()))
    assert abs(layer.stats["aux_loss"].item() - 0.01) < 1e-9
    # all to one expert with probability ~1 there: coeff * E * 1 * 1
    big = torch.tensor([[30.0, 0, 0, 0]] * 8)
    layer.top_k = 1
    layer._losses(big, big.softmax(-1), torch.tensor([8, 0, 0, 0]), counts.new_zeros(()))
    assert abs(layer.stats["aux_loss"].item() - 0.04) < 1e-6


def test_z_loss_golden():
    layer = make_moe(layer_cfg(n_experts=2, moe_top_k=1, aux_loss_coeff=0.0, z_loss_coeff=0.5))
    logits = torch.tensor([[0.0, 0.0], [math.log(3.0), 0.0]])
    # logsumexp: log 2 and log 4 = 2 log 2 -> mean of squares = (1 + 4) / 2 * log(2)^2
    layer._losses(logits, logits.softmax(-1), torch.tensor([1, 1]), torch.zeros((), dtype=torch.long))
    assert abs(layer.stats["z_loss"].item() - 0.5 * 2.5 * math.log(2) ** 2) < 1e-7


def test_router_fp32_under_autocast():
    torch.manual_seed(0)
    layer = make_moe(layer_cfg())
    seen = {}
    layer.router.register_forward_hook(lambda *a: None)  # the router weight is used via F.linear
    orig = layer._losses
    layer._losses = lambda logits, *a: (seen.update(dtype=logits.dtype), orig(logits, *a))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(torch.randn(2, 5, 16).bfloat16())
    assert seen["dtype"] == torch.float32 and y.dtype == torch.bfloat16 and y.shape == (2, 5, 16)


def test_moe_transformer_trains_and_counts():
    cfg = dict(vocab_size=64, pad_vocab_multiple=64, block_size=16, n_layer=3, n_head=2, n_embd=16,
               ffn_hidden=24, n_experts=4, moe_top_k=2, moe_first_dense=1, n_shared_experts=1, moe_hidden=8)
    torch.manual_seed(0)
    m = Transformer(ModelConfig(**cfg))
    assert [type(b.mlp).__name__ for b in m.blocks] == ["MLP", "MoE", "MoE"]
    C, V, H, E, k = 16, 64, 8, 4, 2
    expert = 2 * H * C + C * H  # swiglu: w1 (2H, C), w2 (C, H)
    attn = C * 3 * C + C * C
    dense_mlp = 2 * 24 * C + 24 * C
    moe_layer = C * E + 2 * H * C + H * C  # router + shared expert (hidden 1 * H)
    assert m.non_embedding_params() == 3 * attn + dense_mlp + 2 * (moe_layer + k * expert)
    assert m.num_params() - m.active_params() == 2 * (E - k) * expert
    assert m.flops_per_token(16) == 6 * m.non_embedding_params() + 6 * C * V + 6 * 3 * 16 * C
    x = torch.randint(0, 64, (2, 16))
    lm = m(x, x, reduction="sum") / x.numel()  # reduction != mean: LM loss only
    loss = m(x, x)
    assert torch.allclose(loss, lm + m.router_loss())
    loss.backward()
    assert all(p.grad is not None for p in m.parameters())
    assert m.blocks[1].mlp.router.weight.grad.abs().sum() > 0
    mt = moe.metrics(m)
    assert set(mt) == {"aux_loss", "z_loss", "load_max", "dropped"} and mt["load_max"] >= 1.0
    m.eval()
    assert torch.allclose(m(x, x), lm)  # eval: no router losses


@pytest.mark.parametrize("cf", [0.0, 1.0])
def test_grad_checkpoint_same_gradients(cf):
    cfg = dict(vocab_size=64, pad_vocab_multiple=64, block_size=8, n_layer=2, n_head=2, n_embd=16,
               ffn_hidden=16, n_experts=4, capacity_factor=cf)
    x = torch.randint(0, 64, (2, 8))
    grads = []
    for gc in (False, True):
        torch.manual_seed(0)
        m = Transformer(ModelConfig(**cfg, grad_checkpoint=gc))
        m(x, x).backward()
        grads.append({n: p.grad for n, p in m.named_parameters()})
    for n in grads[0]:
        assert rel_err(grads[1][n], grads[0][n]) <= 1e-5, n


@pytest.mark.parametrize("kw,msg", [(dict(n_experts=4, moe_top_k=5), "moe_top_k"),
                                    (dict(n_experts=4, moe_every=0), "moe_every"),
                                    (dict(n_experts=4, moe_first_dense=2), "moe_first_dense"),
                                    (dict(n_experts=-1), "n_experts")])
def test_bad_configs(kw, msg):
    with pytest.raises(ValueError, match=msg):
        ModelConfig(n_layer=2, **kw)


# ----------------------------------------------------------------------------- distributed

G, T, STEPS = 8, 8, 3


SMALL = dict(vocab_size=61, pad_vocab_multiple=32, n_layer=2, n_head=2, n_embd=16, ffn_hidden=16,
             n_experts=4, moe_top_k=2, block_size=T, lr=3e-3, weight_decay=0.1,
             grad_clip=0.5, grad_bucket_mb=0.001, eps=1e-6, aux_loss_coeff=0.1, z_loss_coeff=0.01)


def small_cfg(**kw):
    return train_cfg(SMALL, **kw)


def global_batch(step):
    return distributed.global_batch(step, T, 61)


def train(rank, world, accum, out_dir, cfg_kw):
    """pretrain.py's step in miniature. The one-process run (world 1) sees, in micro-step m, the
    union of every rank's micro-step m, so each global micro-batch is the same in every layout."""
    cfg = small_cfg(**cfg_kw)
    grid = parallel.init(cfg)
    torch.manual_seed(0)
    raw = Transformer(ModelConfig.from_cfg(cfg))
    for m in moe.layers(raw):
        m.expert_mm = cfg_kw.get("_expert_mm", "auto")
    full = {k: v.clone() for k, v in raw.state_dict().items()}
    moe.expert_parallel(raw, grid)
    opt = optim.build_optimizer(raw, cfg)
    model = dp.DataParallel(raw, grid, cfg.grad_bucket_mb)
    # _compile: as parallel.parallelize, the model compiled whole, DataParallel's hooks on the parameters
    fwd = torch.compile(raw, backend="aot_eager") if cfg_kw.get("_compile") else model
    names = dict(raw.named_parameters())
    rec = {"init": full, "steps": [], "router": []}
    R = int(cfg_kw.get("_ranks", world))  # data ranks the global batch is split over
    me = grid.dp_rank * grid.ep + grid.ep_rank
    per, mb = G // R, G // R // accum
    for step in range(STEPS):
        x, y = global_batch(step)
        micro = []
        for m in range(accum):
            rows = [r * per + m * mb + i for r in range(R) for i in range(mb)] if world == 1 else \
                   [me * per + m * mb + i for i in range(mb)]
            micro.append((x[rows], y[rows]))
        for m, (xm, ym) in enumerate(micro):
            with model.no_sync() if m < accum - 1 else torch.enable_grad():
                loss = fwd(xm, ym) / accum
                loss.backward()
            if step == 0:
                rec["router"].append(moe.metrics(raw, grid.data_group if world > 1 else None))
        model.finish()
        if step == 0:
            rec["grads"] = {n: p.grad.clone() for n, p in names.items()}
        parallel.clip_grad_norm_(raw, cfg.grad_clip, grid)
        opt.step()
        model.zero_grad()
        rec["steps"].append({n: p.detach().clone() for n, p in names.items()})
        if cfg_kw.get("_compile"):
            from torch._dynamo.utils import counters
            rec.setdefault("graphs", []).append(counters["stats"]["unique_graphs"])
    rec["grid"] = (grid.dp_rank, grid.ep_rank)
    w, o = full_state(raw, opt, grid, model)  # checkpoint layout: full experts too
    rec["full"] = (w, {n: st["exp_avg_sq"] for n, st in o.items()})
    torch.save(rec, os.path.join(out_dir, f"rank{rank}.pt"))


def run(tmp_path, world, accum, ep, variants):
    """Train every config variant (one spawn for all): -> [[rank records] per variant]."""
    outs = []
    for i in range(len(variants)):
        outs.append(tmp_path / f"w{world}a{accum}e{ep}v{i}")
        outs[-1].mkdir()
    if world == 1:
        for kw, out in zip(variants, outs):
            train(0, 1, accum, str(out), kw)
    else:
        spawn(_train_ep, world, ep, world, accum, [str(o) for o in outs], variants)
    return [[torch.load(out / f"rank{r}.pt") for r in range(world)] for out in outs]


def _train_ep(rank, ep, world, accum, out_dirs, variants):
    for out, kw in zip(out_dirs, variants):
        train(rank, world, accum, out, dict(kw, ep=ep))


def local_expert(full, name, ep, ep_rank):
    """The slice of a full (one-process) tensor that EP rank ep_rank holds."""
    if name.endswith((".w1", ".w2")) and ep > 1:
        n = full.shape[0] // ep
        return full[ep_rank * n:(ep_rank + 1) * n]
    return full


def compare(ranks, ref, ep, accum):
    for r in ranks:
        dp_rank, ep_rank = r["grid"]
        for what in ("grads", "steps"):
            got = r[what] if what == "grads" else r["steps"][-1]
            want = ref[what] if what == "grads" else ref["steps"][-1]
            assert got.keys() == want.keys()
            for k in want:
                err = rel_err(got[k], local_expert(want[k], k, ep, ep_rank))
                assert err <= 1e-5, f"{what}: {k} relative error {err:.2e}"
        for m in range(accum):  # router losses: mean over data ranks = one process, per micro-batch
            for key in ("aux_loss", "z_loss", "load_max", "dropped"):
                a, b = r["router"][m][key], ref["router"][m][key]
                assert abs(a - b) <= 1e-5 * max(1.0, abs(b)), (key, m, a, b)
    for r in ranks:  # checkpoints of any layout hold the one-process names, shapes and values
        for got, want in zip(r["full"], ref["full"]):
            assert got.keys() == want.keys()
            for k in want:
                assert got[k].shape == want[k].shape and rel_err(got[k], want[k]) <= 1e-5, k
    for s in range(STEPS):  # replicas bitwise identical: experts over dp, the rest over dp x ep
        for k in ranks[0]["steps"][s]:
            for r in ranks[1:]:
                same_shard = r["grid"][1] == ranks[0]["grid"][1]
                if same_shard or not k.endswith((".w1", ".w2")):
                    assert torch.equal(r["steps"][s][k], ranks[0]["steps"][s][k]), f"step {s}: {k}"


def test_ep2_equals_one_process(tmp_path):
    """Dropless and capacity-dropping, accumulation 1 and 2 (with accumulation, micro-step m's
    global micro-batch is the union of the ranks' micro-batches m, in every layout)."""
    variants = [{}, {"capacity_factor": 1.0}]
    for accum in (1, 2):
        refs = [r[0] for r in run(tmp_path, 1, accum, 1, [dict(kw, _ranks=2) for kw in variants])]
        for ranks, ref in zip(run(tmp_path, 2, accum, 2, variants), refs):
            compare(ranks, ref, 2, accum)
            assert max(rel_err(ref["steps"][-1][k], ref["init"][k]) for k in ref["steps"][-1]) > 1e-3
    assert ref["router"][0]["dropped"] > 0  # the capacity variant really drops


def test_ep2_grouped_and_compiled_equal_one_process(tmp_path):
    """EP=2 with the grouped kernel (dropless: uneven blocks per local expert; capacity: equal
    ones) equals one process running the loop. So does EP=2 dropless under torch.compile
    (aot_eager, in the same spawn): the all_to_all traced as a functional collective, the paths
    that read sizes on the host kept out of the graph (MoE._host_sized), so sizes that change every
    step cause no recompilation."""
    variants = [{}, {"capacity_factor": 1.0}]
    refs = [r[0] for r in run(tmp_path, 1, 1, 1, [dict(kw, _ranks=2) for kw in variants])]
    got = run(tmp_path, 2, 1, 2, [dict(kw, _expert_mm="grouped") for kw in variants] + [dict(_compile=True)])
    for ranks, ref in zip(got, refs + refs[:1]):
        compare(ranks, ref, 2, 1)
    for r in got[-1]:  # graphs compiled after each step: all in the first
        assert r["graphs"][0] > 0 and r["graphs"] == r["graphs"][:1] * STEPS, r["graphs"]


def test_ep2_dp2_equals_one_process(tmp_path):
    variants = [{}, {"capacity_factor": 1.5, "n_shared_experts": 1, "moe_first_dense": 1}]
    refs = [r[0] for r in run(tmp_path, 1, 1, 1, [dict(kw, _ranks=4) for kw in variants])]
    for ranks, ref in zip(run(tmp_path, 4, 1, 2, variants), refs):
        compare(ranks, ref, 2, 1)


def test_bench_parallel_moe_smoke(tmp_path):
    """bench/bench_parallel.py's moe mode runs on CPU: DP and EP rows, active params, same first loss."""
    import json
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = tmp_path / "moe.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "bench/bench_parallel.py", "moe", "--shape=tiny", "--device=cpu", "--batch=2", "--steps=1",
           "--warmup=1", f"--json={out}"]
    res = subprocess.run(cmd, cwd=root, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    rows = {r["run"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"moe-dp", "moe-ep", "moe-ep-cap"}
    assert all(r.get("tokens_per_s", 0) > 0 for r in rows.values()), rows
    assert rows["moe-dp"]["active_params"] < rows["moe-dp"]["params"]
    assert abs(rows["moe-dp"]["loss"] - rows["moe-ep"]["loss"]) < 1e-4  # same model, same data, same loss


@pytest.mark.parametrize("kw,world,msg", [
    (dict(ep=2), 2, "set n_experts"),
    (dict(ep=2, n_experts=3), 2, "not divisible by ep"),
    (dict(n_experts=4, ep=2, batch_size=8, micro_batch_size=8), 4, "batch_size=8"),  # 4 data ranks
])
def test_config_validation(kw, world, msg):
    cfg = SimpleNamespace(**dict(config.defaults(lifecycle.TRAIN), **kw))
    with pytest.raises(ValueError, match=msg):
        config.validate(cfg, world, keys=lifecycle.TRAIN)
    ok = SimpleNamespace(**dict(config.defaults(lifecycle.TRAIN), n_experts=4, ep=2, batch_size=32, micro_batch_size=8))
    config.validate(ok, 4, keys=lifecycle.TRAIN)  # 2 dp x 2 ep data ranks x 8 sequences x 2 accumulation steps
