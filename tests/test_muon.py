"""Muon (+ AdamW) and ZeRO-1 equal their references.

One process: Muon's update equals a plain reference written here from the formulas (fp32
Newton-Schulz, relative error <= 1e-5), the AdamW part equals torch.optim.AdamW, fused qkv and
gate|up weights are orthogonalised per logical matrix; NS pushes singular values into a band.
Distributed (gloo): Muon under TP2, ZeRO-1 over DP2, TP2 x DP2 + ZeRO-1, FSDP2, TP2 x FSDP2, EP2
and EP2 x DP2 + ZeRO-1 equal one process after 3 steps (weights and full optimizer state);
Newton-Schulz only ever sees whole logical matrices (the multiset of its call shapes over the
owners equals one process's, so NS on a TP shard or a flat FSDP piece fails); ZeRO-1 / FSDP
state bytes per rank ~ 1/dp of the total; checkpoints resume exactly, in one process and across
layouts (one process -> each layout, each layout -> one process). The compiled NS step's inductor
options per torch version name a real key.
"""
import collections
import os
from types import SimpleNamespace

import distributed
import pytest
import torch
from distributed import assert_close, full_state, load_checkpoint, ns_calls, rel_err, spawn, train_cfg

import checkpoint
import config
import moe
import muon
import optim
import parallel
from model import ModelConfig, Transformer
from parallelism import dp, fsdp, tp

G, T, STEPS, MORE = 8, 16, 3, 2


SMALL = dict(vocab_size=97, pad_vocab_multiple=32, n_layer=2, n_head=4, n_kv_head=2, n_embd=32,
             block_size=T, lr=3e-3, weight_decay=0.1, grad_clip=1.0, grad_bucket_mb=0.01,
             eps=1e-6, optimizer="muon", ns_dtype="float32", muon_lr=0.0)  # muon lr = lr (rms scale)


def small_cfg(**kw):
    return train_cfg(SMALL, **kw)


def global_batch(step):
    return distributed.global_batch(step, T, 97)






# ----------------------------------------------------------------------------- reference, from the formulas

def ref_ns(M):
    r, c = M.shape
    X = M.T if r > c else M
    X = X / (X.norm() + 1e-7)
    for _ in range(5):
        A = X @ X.T
        X = 3.4445 * X + (-4.7750 * A + 2.0315 * A @ A) @ X
    return X.T if r > c else X


def ref_muon_step(named, grads, bufs, lr, wd, mu, mode, splits):
    for n, p in named:
        g = grads[n]
        b = bufs.setdefault(n, torch.zeros_like(g))
        b.mul_(mu).add_(g)
        u = g + mu * b
        outs = []
        for m in (u.split(splits[n]) if n in splits else [u]):
            r, c = m.shape
            s = 0.2 * max(r, c) ** 0.5 if mode == "rms" else max(1, r / c) ** 0.5
            outs.append(ref_ns(m) * s)
        with torch.no_grad():
            p.mul_(1 - lr * wd).add_(torch.cat(outs), alpha=-lr)


@pytest.mark.parametrize("mode", ["rms", "shape"])
def test_one_process_equals_reference(mode):
    cfg = small_cfg(muon_scale=mode)
    mcfg = ModelConfig.from_cfg(cfg)
    assert mcfg.gated and mcfg.kv_heads != mcfg.n_head  # split qkv and gate|up for real
    torch.manual_seed(0)
    a, b = Transformer(mcfg), Transformer(mcfg)
    b.load_state_dict(a.state_dict())
    opt = optim.build_optimizer(a, cfg)
    assert isinstance(opt, muon.Muon) and [g["kind"] for g in opt.param_groups] == ["muon", "adamw", "adamw"]
    H, KV, D, hid = mcfg.n_head, mcfg.kv_heads, mcfg.head_dim, mcfg.hidden
    splits = {}
    mnames = [n for n, p in b.named_parameters() if n.startswith("blocks.") and p.dim() == 2]
    for n in mnames:
        if n.endswith("attn.qkv.weight"):
            splits[n] = [H * D, KV * D, KV * D]
        elif n.endswith("mlp.fc.weight"):
            splits[n] = [hid, hid]
    assert len(splits) == 2 * mcfg.n_layer
    bp = dict(b.named_parameters())
    adam_named = [(n, p) for n, p in b.named_parameters() if n not in mnames]
    assert any(n == "tok_emb.weight" for n, _ in adam_named) and any(n == "head.weight" for n, _ in adam_named)
    ref_adam = torch.optim.AdamW([{"params": [p for _, p in adam_named if p.dim() >= 2], "weight_decay": cfg.weight_decay},
                                  {"params": [p for _, p in adam_named if p.dim() < 2], "weight_decay": 0.0}],
                                 lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, foreach=False)
    bufs = {}
    for s in range(STEPS):
        x, y = global_batch(s)
        for m in (a, b):
            m.zero_grad()
            m(x, y).backward()
        opt.step()
        ref_adam.step()
        ref_muon_step([(n, bp[n]) for n in mnames], {n: bp[n].grad for n in mnames}, bufs,
                      cfg.muon_lr or cfg.lr, cfg.weight_decay, cfg.muon_momentum, mode, splits)
    pa = dict(a.named_parameters())
    for n, p in b.named_parameters():
        assert_close(pa[n], p, f"{mode}: {n} after {STEPS} steps")
    for n in mnames:
        assert_close(opt.state[pa[n]]["momentum_buffer"], bufs[n], f"momentum {n}")


def test_per_logical_matrix_differs_from_fused():
    # the fused block and the per-matrix update really differ (so the split is tested above)
    torch.manual_seed(0)
    u = torch.randn(64, 32)
    fused, split = muon.orthogonalize([u, u], [None, [32, 16, 16]], 5, torch.float32, "rms")
    assert rel_err(fused, split) > 0.1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(64, 32), (32, 96), (48, 48)])
def test_newton_schulz_band(shape, dtype):
    # G = U diag(s) V^T with singular values over two decades (NS's 5 steps lift anything above
    # ~1e-3 of |G|_F into the band; smaller ones, e.g. pure noise directions, stay small)
    torch.manual_seed(0)
    k = min(shape)
    u, _ = torch.linalg.qr(torch.randn(shape[0], k))
    v, _ = torch.linalg.qr(torch.randn(shape[1], k))
    g = u @ torch.diag(torch.logspace(-2, 0, k)) @ v.T
    sv = torch.linalg.svdvals(muon.newton_schulz(g, dtype=dtype).float())
    assert sv.min() > 0.6 and sv.max() < 1.25, (sv.min().item(), sv.max().item())
    s = torch.linalg.svdvals(muon.orthogonalize([g], [None], 5, dtype, "rms")[0].float())
    assert s.max() < 1.25 * 0.2 * max(shape) ** 0.5  # scaled by 0.2 sqrt(max(rows, cols))


# ----------------------------------------------------------------------------- layouts

def _layout(grid, kw, out_dir, tag, load_from=None, steps=STEPS, save=True):
    """Train `steps` steps in this layout (optionally after loading a checkpoint); returns the full
    weights, full optimizer state, NS call shapes and state bytes; saves a checkpoint."""
    cfg = small_cfg(tp=grid.tp, **kw)
    torch.manual_seed(0 if load_from is None else 1)
    raw = tp.tensor_parallel(Transformer(ModelConfig.from_cfg(cfg)), grid)
    if cfg.data_parallel == "fsdp":
        model = fsdp.FSDP(raw, grid)
        opt = optim.build_optimizer(model, cfg, grid)
    else:
        opt = optim.build_optimizer(raw, cfg, grid)
        model = dp.DataParallel(raw, grid, cfg.grad_bucket_mb, owner=getattr(opt, "grad_owner", None))
    wrapper = model if cfg.data_parallel == "fsdp" else None
    start = load_checkpoint(load_from, raw, opt, grid, wrapper)["step"] if load_from else 0
    with ns_calls() as calls:
        for s in range(start, start + steps):
            per = G // grid.dp
            x, y = (t[grid.dp_rank * per:(grid.dp_rank + 1) * per] for t in global_batch(s))
            model(x, y).backward()
            model.finish()
            if getattr(opt, "grad_owner", None):  # reduced to owners only; the rest dropped
                assert all((p.grad is not None) == opt.owns(p) for p in raw.parameters())
            # one norm for every layout (ZeRO-1: gradients were reduced to their owners)
            parallel.clip_grad_norm_(model, cfg.grad_clip, grid, getattr(opt, "grad_owner", None))
            opt.step()
            model.zero_grad()
    weights, ostate = full_state(raw, opt, grid, wrapper)
    if save:
        checkpoint.save(os.path.join(out_dir, tag), start + steps, weights, ostate, cfg, rank=grid.rank)
    return dict(weights=weights, optim=ostate, calls=calls, bytes=opt.state_bytes(),
                total=sum(p.numel() * p.element_size() * (1 if g["kind"] == "muon" else 2)
                          for g in opt.param_groups for p in g["params"]),
                replicated={} if wrapper else {n: p.detach().clone() for n, p in raw.named_parameters()})


def _run(rank, out_dir, jobs, ref_ckpt):
    for tag, tp_size, kw in jobs:
        grid = parallel.init(SimpleNamespace(device="cpu", tp=tp_size, ep=1))
        rec = {"train": _layout(grid, kw, out_dir, tag)}
        rec["resumed"] = _layout(grid, kw, out_dir, tag + "_resumed", load_from=ref_ckpt, steps=MORE, save=False)
        torch.save(rec, os.path.join(out_dir, f"{tag}_rank{rank}.pt"))


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("muon_ref"))
    grid = parallel.init(SimpleNamespace(device="cpu", tp=1, ep=1))
    first = _layout(grid, {}, d, "ref")  # 3 steps, checkpoint at step 3
    cont = _layout(grid, {}, d, "ref_cont", load_from=checkpoint.latest(os.path.join(d, "ref")), steps=MORE,
                   save=False)
    return d, first, cont


def _check(tmp, ref, tag, world, tp_size, dp):
    _, first, cont = ref
    recs = [torch.load(os.path.join(tmp, f"{tag}_rank{r}.pt"), weights_only=False) for r in range(world)]
    # Newton-Schulz saw exactly the whole logical matrices one process sees (never a TP shard)
    want = collections.Counter(first["calls"])
    for t in range(tp_size):
        got = collections.Counter()
        for d in range(dp):
            got += collections.Counter(recs[d * tp_size + t]["train"]["calls"])
        assert got == want, f"{tag}: NS call shapes {dict(got)} vs one process {dict(want)}"
    for r, rec in enumerate(recs):
        what = f"{tag} rank {r}"
        assert_close(rec["train"]["weights"], first["weights"], f"{what} weights after {STEPS} steps")
        assert_close(rec["train"]["optim"], first["optim"], f"{what} optimizer state (full)")
        assert_close(rec["resumed"]["weights"], cont["weights"], f"{what} one-process checkpoint resumed here")
    for d in range(1, dp):  # after ZeRO-1's all-gather every dp replica holds the same parameters, bitwise
        for t in range(tp_size):
            for n, v in recs[t]["train"]["replicated"].items():
                assert torch.equal(recs[d * tp_size + t]["train"]["replicated"][n], v), f"{tag}: {n} on dp rank {d}"
    # layout -> one process: its checkpoint resumes in one process
    grid = parallel.init(SimpleNamespace(device="cpu", tp=1, ep=1))
    back = _layout(grid, {}, tmp, "back", load_from=checkpoint.latest(os.path.join(tmp, tag)), steps=MORE,
                   save=False)
    assert_close(back["weights"], cont["weights"], f"{tag} checkpoint resumed in one process")
    return recs


def test_reference_moves(reference):
    _, first, cont = reference
    init = Transformer(ModelConfig.from_cfg(small_cfg()))
    assert first["calls"] and "momentum_buffer" in first["optim"]["blocks.0.attn.qkv.weight"]
    assert "exp_avg" in first["optim"]["tok_emb.weight"]
    assert max(rel_err(first["weights"][k], v) for k, v in init.state_dict().items() if k in first["weights"]) > 1e-3
    # one process: 3 steps, checkpoint, resume, 2 steps == 5 steps straight (Muon momentum included)
    grid = parallel.init(SimpleNamespace(device="cpu", tp=1, ep=1))
    straight = _layout(grid, {}, reference[0], "straight", steps=STEPS + MORE, save=False)
    assert_close(cont["weights"], straight["weights"], "resume in one process", tol=1e-6)


def test_tp2_and_zero1_dp2_equal_one_process(tmp_path, reference):
    jobs = [("tp2", 2, {}), ("zero1_dp2", 1, dict(zero1=True))]
    spawn(_run, 2, str(tmp_path), jobs, checkpoint.latest(os.path.join(reference[0], "ref")))
    _check(str(tmp_path), reference, "tp2", 2, 2, 1)
    recs = _check(str(tmp_path), reference, "zero1_dp2", 2, 1, 2)
    total = recs[0]["train"]["total"]
    assert total == reference[1]["bytes"] - 4 * len([k for k, v in reference[1]["optim"].items() if "step" in v])
    for r in recs:  # ZeRO-1: each rank holds about half of the state (scalar steps aside)
        assert 0.4 * total <= r["train"]["bytes"] <= 0.6 * total + 1024, (r["train"]["bytes"], total)
    assert abs(sum(r["train"]["bytes"] for r in recs) - reference[1]["bytes"]) <= 1024


def test_tp2_dp2_zero1_and_tp2_fsdp2_equal_one_process(tmp_path, reference):
    jobs = [("tp2_dp2_zero1", 2, dict(zero1=True)), ("tp2_fsdp2", 2, dict(data_parallel="fsdp"))]
    spawn(_run, 4, str(tmp_path), jobs, checkpoint.latest(os.path.join(reference[0], "ref")))
    _check(str(tmp_path), reference, "tp2_dp2_zero1", 4, 2, 2)
    _check(str(tmp_path), reference, "tp2_fsdp2", 4, 2, 2)


def test_fsdp2_equals_one_process(tmp_path, reference):
    # FSDP: flat shards cut across matrices; each matrix has one owner that orthogonalises it whole
    spawn(_run, 2, str(tmp_path), [("fsdp2", 1, dict(data_parallel="fsdp"))],
          checkpoint.latest(os.path.join(reference[0], "ref")))
    recs = _check(str(tmp_path), reference, "fsdp2", 2, 1, 2)
    ref_bytes = reference[1]["bytes"]  # one process: momentum + AdamW moments + steps
    for r in recs:  # FSDP: AdamW moments of the flat shards, momentum of the matrices a rank owns
        assert 0.4 * ref_bytes <= r["train"]["bytes"] <= 0.6 * ref_bytes, (r["train"]["bytes"], ref_bytes)


def _ep(rank, out_dir, ep, zero1=False):
    """MoE with ep experts-parallel ranks (x dp = world / ep, ZeRO-1 optional; ep 1: one process):
    full weights after STEPS steps."""
    cfg = small_cfg(ep=ep, n_experts=4, moe_top_k=2, ffn_hidden=16, aux_loss_coeff=0.1, z_loss_coeff=0.01,
                    zero1=zero1)
    grid = parallel.init(SimpleNamespace(device="cpu", tp=1, ep=ep))
    torch.manual_seed(0)
    raw = Transformer(ModelConfig.from_cfg(cfg))
    moe.expert_parallel(raw, grid)
    opt = optim.build_optimizer(raw, cfg, grid)
    model = dp.DataParallel(raw, grid, cfg.grad_bucket_mb)
    with ns_calls() as calls:
        for s in range(STEPS):
            per = G // grid.data_world
            x, y = (t[grid.data_rank * per:(grid.data_rank + 1) * per] for t in global_batch(s))
            model(x, y).backward()
            model.finish()
            parallel.clip_grad_norm_(raw, cfg.grad_clip, grid)
            opt.step()
            model.zero_grad()
    out = {}
    for n, p in raw.named_parameters():
        t = p.detach().clone()
        if getattr(p, "ep_split", 1) > 1:  # this rank's experts -> all of them
            parts = [torch.empty_like(t) for _ in range(ep)]
            torch.distributed.all_gather(parts, t, group=grid.ep_group)
            t = torch.cat(parts)
        out[n] = t
    torch.save({"weights": out, "calls": calls, "w1_split": raw.blocks[0].mlp.w1.muon_split,
                "bytes": opt.state_bytes()}, os.path.join(out_dir, f"ep{ep}_rank{rank}.pt"))


def test_ep2_equals_one_process(tmp_path):
    # expert stacks (E, 2H, C): Muon orthogonalises each expert's gate and up matrices, batched
    _ep(0, str(tmp_path), 1)
    spawn(_ep, 2, str(tmp_path), 2)
    ref = torch.load(tmp_path / "ep1_rank0.pt", weights_only=False)
    assert ref["w1_split"] == [16, 16]
    for r in range(2):
        got = torch.load(tmp_path / f"ep2_rank{r}.pt", weights_only=False)
        assert_close(got["weights"], ref["weights"], f"EP2 rank {r} weights after {STEPS} steps")
        # whole matrices: the other rank's 2 experts x 2 layers x (gate, up, w2^T), all (16, 32), are missing
        missing = collections.Counter(ref["calls"]) - collections.Counter(got["calls"])
        assert missing == {(16, 32): 2 * 2 * 3 * STEPS}, missing


def test_ep2_dp2_zero1_equals_one_process(tmp_path):
    _ep(0, str(tmp_path), 1)
    spawn(_ep, 4, str(tmp_path), 2, True)
    ref = torch.load(tmp_path / "ep1_rank0.pt", weights_only=False)
    got = [torch.load(tmp_path / f"ep2_rank{r}.pt", weights_only=False) for r in range(4)]
    for r in range(4):
        assert_close(got[r]["weights"], ref["weights"], f"EP2 x DP2 ZeRO-1 rank {r} weights after {STEPS} steps")
    # ZeRO-1 over the 2 replicas of each expert shard: each holds about half of what an EP rank would
    for ep_rank in range(2):
        a, b = got[ep_rank]["bytes"], got[2 + ep_rank]["bytes"]
        assert 0.6 < a / b < 1.6, (a, b)


def test_zero1_adamw_only(tmp_path):
    # optimizer="adamw" with zero1: AdamW-only groups, same arithmetic as torch.optim.AdamW
    cfg = small_cfg(optimizer="adamw", zero1=True)
    torch.manual_seed(0)
    a = Transformer(ModelConfig.from_cfg(cfg))
    b = Transformer(ModelConfig.from_cfg(cfg))
    b.load_state_dict(a.state_dict())
    oa, ob = optim.build_optimizer(a, cfg), optim.build_optimizer(b, small_cfg(optimizer="adamw"))
    assert isinstance(oa, muon.Muon) and isinstance(ob, torch.optim.AdamW)
    for s in range(STEPS):
        x, y = global_batch(s)
        for m, o in ((a, oa), (b, ob)):
            m.zero_grad()
            m(x, y).backward()
            o.step()
    assert_close(dict(a.named_parameters()), dict(b.named_parameters()), "adamw via Muon class")


def test_config_validation():
    for kw, msg in [(dict(optimizer="sgd"), "adamw or muon"), (dict(muon_scale="x"), "rms or shape"),
                    (dict(ns_dtype="float16"), "bfloat16 or float32"), (dict(muon_momentum=1.0), "muon_momentum"),
                    (dict(zero1=True, data_parallel="fsdp"), "zero1")]:
        with pytest.raises(ValueError, match=msg):
            config.validate(small_cfg(**kw))
    config.validate(small_cfg())


def test_compile_options_name_a_real_inductor_key():
    """torch < 2.12 compiles the NS step without inductor's loop reordering (it asserts there on
    configs/speedrun.py's graph, torch 2.11); the option is a real inductor key of this torch
    (torch.compile raises on an unknown one) and is a bool, so False is a value it takes."""
    assert muon.compile_options("2.11.0+cu130") == {"loop_ordering_after_fusion": False}
    assert muon.compile_options("2.10.1") == {"loop_ordering_after_fusion": False}
    assert muon.compile_options("2.12.0") is None and muon.compile_options("2.13.0+cpu") is None
    from torch._inductor import config as inductor_config
    assert isinstance(inductor_config.get_config_copy()["loop_ordering_after_fusion"], bool)
