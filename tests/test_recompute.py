"""recompute.py's selective activation checkpointing against no checkpointing, and its memory against plan.py.

Proves:
- every mode (block, attn, mlp) at every = 1 and 2, with dropout (its masks drawn again the same):
  the loss and every parameter's gradient are bitwise those of the plain model (fp32, CPU), also for
  a LoRA model (adapters' gradients); model.py's grad_checkpoint=True is "block" at every = 1;
- what autograd keeps (saved-tensor hooks, bf16 autocast) is what plan.activations predicts for
  recompute = mlp / attn / block at every 1 and 2 (within 1%), and less than without;
- evaluation and KV-cache generation run the plain forward (no checkpoint under no_grad or with a
  cache: the same greedy tokens); a deepcopy keeps its wrappers on the copy; bad settings refuse;
- offload (the kept inputs on the host, recompute.Offloaded): the same bitwise equalities for every
  mode, LoRA and grad_checkpoint=True; the host copies exist between forward and backward (one per
  checkpointed part) and are gone after it, and no input stays on its device between forward and
  backward (checkpointing without offload keeps them: the control); compiled (aot_eager) the same;
  without a recompute the setting is refused; on a GPU (side stream) offloaded = checkpointed = plain;
- mlp_tile (recompute.Tiled, MLPs over token tiles, one recomputed at a time): the loss and every gradient
  equal the untiled model's (relative 1e-5: matmuls over fewer rows sum in another order) for tiles that divide the tokens and
  tiles that do not, with dropout, LoRA, and inside recomputed blocks, and compiled (aot_eager); a deepcopy's
  wrappers train the copy's own parameters (here and under offload); only the MLPs' inputs are kept;
- FSDP2 and DP2 (2 gloo processes) with recompute=mlp every 2 / block every 2, DP2 and FSDP2 with
  offloaded blocks, TP2 with offloaded MLPs, TP2 with tiled MLPs and FSDP2 with tiled MLPs in recomputed
  blocks equal one process (weights after 2 AdamW steps with clipping, relative error <= 1e-5).
"""
import copy
import os

import distributed
import pytest
import torch
from distributed import assert_close, spawn, train_cfg

import config
import generate
import lifecycle
import lora
import parallel
import plan
from memory import recompute
from model import ModelConfig, Transformer

SMALL = dict(vocab_size=97, pad_vocab_multiple=32, n_layer=3, n_head=4, n_kv_head=2, n_embd=32, block_size=16,
             lr=1e-3, weight_decay=0.1, grad_clip=1.0, eps=1e-6)


def model_of(**kw):
    torch.manual_seed(0)
    return Transformer(ModelConfig.from_cfg(train_cfg(SMALL, **kw)))


def loss_and_grads(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randint(0, 97, (4, 16), generator=g), torch.randint(0, 97, (4, 16), generator=g)
    model.zero_grad(set_to_none=True)
    torch.manual_seed(123)  # the dropout masks
    loss = model(x, y)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("mode", recompute.MODES)
@pytest.mark.parametrize("every", [1, 2])
@pytest.mark.parametrize("offload", [False, True])
def test_gradients_equal_no_checkpointing(mode, every, offload):
    for kw in (dict(), dict(dropout=0.1)):
        ref = model_of(**kw)
        model = recompute.apply(copy.deepcopy(ref), mode, every, offload)
        assert sum(isinstance(m.forward, recompute.Checkpointed) for m in model.modules()) == (3 if every == 1 else 2)
        (l1, g1), (l0, g0) = loss_and_grads(model), loss_and_grads(ref)
        assert torch.equal(l1, l0) and g1.keys() == g0.keys()
        assert all(torch.equal(g1[k], g0[k]) for k in g0), [k for k in g0 if not torch.equal(g1[k], g0[k])]
    whole = model_of(grad_checkpoint=True)
    assert torch.equal(loss_and_grads(whole)[0], loss_and_grads(model_of())[0])


def test_lora_gradients_equal():
    cfg = train_cfg(SMALL, lora_r=4)
    ref = lora.apply(model_of(), cfg, parallel.init(cfg))
    lora.load(ref, parallel.init(cfg), {n: 0.1 * torch.randn(p.shape, generator=torch.Generator().manual_seed(1))
                                        for n, p in ref.named_parameters() if lora.is_adapter(n)})
    for mode, offload in (("mlp", False), ("block", True)):
        model = recompute.apply(copy.deepcopy(ref), mode, 1, offload)
        (l1, g1), (l0, g0) = loss_and_grads(model), loss_and_grads(ref)
        assert torch.equal(l1, l0) and g1.keys() == g0.keys() and all(torch.equal(g1[k], g0[k]) for k in g0)


def close(a, b, rel=1e-5):
    return (a - b).abs().max() <= rel * b.abs().max()


@pytest.mark.parametrize("tile", [5, 16, 64])
def test_tiled_mlp_equals_untiled(tile):
    cfg = train_cfg(SMALL, lora_r=4)
    for kw, mode, use_lora in ((dict(), "", False), (dict(dropout=0.1), "", False), (dict(), "block", False),
                               (dict(), "", True), (dict(), "block", True)):
        ref = model_of(**kw)
        if use_lora:
            ref = lora.apply(ref, cfg, parallel.init(cfg))
            lora.load(ref, parallel.init(cfg), {n: 0.1 * torch.randn(p.shape, generator=torch.Generator().manual_seed(1))
                                                for n, p in ref.named_parameters() if lora.is_adapter(n)})
        model = recompute.apply(copy.deepcopy(ref), mode, 1, mlp_tile=tile)
        assert sum(isinstance(b.mlp.forward, recompute.TiledForward) for b in model.blocks) == 3
        (l1, g1), (l0, g0) = loss_and_grads(model), loss_and_grads(ref)
        assert close(l1, l0) and g1.keys() == g0.keys(), (l1, l0)
        assert all(close(g1[k], g0[k]) for k in g0), [k for k in g0 if not close(g1[k], g0[k])]
    # what autograd keeps: the MLPs keep their inputs only, as under recompute=mlp (plan.activations)
    kept = {}
    for name, m in (("tile", recompute.apply(model_of(), "", 1, mlp_tile=tile)), ("mlp", recompute.apply(model_of(), "mlp"))):
        seen = {}
        with torch.autograd.graph.saved_tensors_hooks(lambda t: seen.setdefault(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()) and t,
                                                      lambda t: t):
            m(torch.randint(0, 97, (4, 16)), torch.randint(0, 97, (4, 16)))
        own = {p.untyped_storage().data_ptr() for p in list(m.parameters()) + list(m.buffers())}
        kept[name] = sum(n for k, n in seen.items() if k not in own)
    assert kept["tile"] == kept["mlp"], kept
    twin = copy.deepcopy(model)  # the copy's wrappers run the copy's MLPs: its own parameters get gradients
    (l3, g3) = loss_and_grads(twin)
    assert torch.equal(l3, l1) and g3.keys() == g1.keys() and all(torch.equal(g3[k], g1[k]) for k in g1)
    if tile == 5:  # compiled (aot_eager; the tiled MLPs are graph breaks): the same numbers
        compiled = torch.compile(recompute.apply(model_of(), "", 1, mlp_tile=tile), backend="aot_eager")
        (l2, g2), (l0, g0) = loss_and_grads(compiled), loss_and_grads(model_of())
        assert close(l2, l0) and all(close(g2[f"_orig_mod.{k}"], g0[k]) for k in g0)
    with pytest.raises(ValueError, match="mlp_tile already recomputes"):
        recompute.apply(model_of(), "mlp", mlp_tile=tile)


def test_offload_keeps_inputs_on_the_host_until_backward():
    ref = model_of(dropout=0.1)
    model = recompute.apply(model_of(dropout=0.1, grad_checkpoint=True), "", 1, offload=True)  # grad_checkpoint's way
    assert not model.cfg.grad_checkpoint and all(isinstance(b.forward, recompute.Checkpointed) for b in model.blocks)
    (l1, g1), (l0, g0) = loss_and_grads(model), loss_and_grads(ref)
    assert torch.equal(l1, l0) and all(torch.equal(g1[k], g0[k]) for k in g0)
    offloader = model.blocks[0].forward.offloader
    x = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(3))
    loss = model(x, x)
    assert len(offloader.saved) == 3 and all(e["host"].shape == (2, 16, 32) for e in offloader.saved)
    entries = list(offloader.saved)
    loss.backward()
    assert offloader.saved == [] and all(e["host"] is None and e["back"] is None for e in entries)  # nothing kept
    twin = copy.deepcopy(model)
    assert twin.blocks[0].forward.offloader is not offloader
    (l3, g3) = loss_and_grads(twin)  # the copy's wrappers run the copy's blocks: its own parameters get gradients
    assert torch.equal(l3, l0) and g3.keys() == g0.keys() and all(torch.equal(g3[k], g0[k]) for k in g0)
    compiled = torch.compile(recompute.apply(model_of(dropout=0.1), "block", 1, True), backend="aot_eager")
    (l2, g2) = loss_and_grads(compiled)  # compile leaves the offloaded blocks eager: the same numbers
    assert torch.equal(l2, l0) and all(torch.equal(g2[f"_orig_mod.{k}"], g0[k]) for k in g0)
    with pytest.raises(ValueError, match="offload_activations"):
        recompute.apply(model_of(), "", 1, offload=True)
    with pytest.raises(config.ConfigError, match="offload_activations"):
        config.validate(config.load(["--offload_activations=True", "--device=cpu"], extra=lifecycle.TRAIN), 1)


def kept_bytes(model, T=12):
    """Unique storages autograd keeps in a bf16-autocast hidden_states forward, parameters and
    buffers (and the int64 ids) excluded."""
    seen = {}

    def pack(t):
        st = t.untyped_storage()
        seen.setdefault(st.data_ptr(), st.nbytes() if t.dtype != torch.int64 else 0)
        return t
    own = {t.untyped_storage().data_ptr() for t in list(model.parameters()) + list(model.buffers())}
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.autocast("cpu", torch.bfloat16):
        model.hidden_states(torch.randint(0, 97, (2, T)))
    return sum(n for k, n in seen.items() if k not in own)


@pytest.mark.parametrize("mode, every", [("mlp", 1), ("attn", 1), ("block", 2), ("mlp", 2)])
def test_memory_is_plans(mode, every):
    cfg = train_cfg(SMALL, dtype="bfloat16", recompute=mode, recompute_every=every)
    model = recompute.apply(model_of(), mode, every)
    tokens = 24
    saved, _ = plan.activations(cfg, tokens, 1, 2, fused_norm=False)  # (a CPU's composite rms_norm)
    saved -= tokens * 2 * 32  # no head input cast in hidden_states
    copies = 2 * sum(p.numel() for i, b in enumerate(model.blocks) for n, p in b.named_parameters()
                     if p.dim() == 2 and not (i % every == 0 and (mode == "block" or n.startswith(mode))))
    got = kept_bytes(model)
    assert abs(got - (saved + copies)) <= 0.01 * got, (got, saved + copies)
    assert got < kept_bytes(model_of())


@torch.no_grad()
def test_eval_and_generation_run_plain():
    ref = model_of().eval()
    model = recompute.apply(copy.deepcopy(ref), "block").eval()
    x = torch.randint(0, 97, (2, 5), generator=torch.Generator().manual_seed(2))
    assert torch.equal(model(x), ref(x))
    assert torch.equal(generate.generate(model, x, 6, vocab=model.cfg.vocab_size, temperature=0.0),
                       generate.generate(ref, x, 6, vocab=ref.cfg.vocab_size, temperature=0.0))
    twin = copy.deepcopy(model)
    assert twin.blocks[0].forward.module is twin.blocks[0]
    with pytest.raises(ValueError, match="recompute='ffn'"):
        recompute.apply(model_of(), "ffn")
    with pytest.raises(ValueError, match="grad_checkpoint=True"):
        recompute.apply(model_of(grad_checkpoint=True), "mlp")
    with pytest.raises(ValueError, match="already"):
        recompute.apply(model, "block")
    assert recompute.apply(ref, "") is ref


# ----------------------------------------------------------------------------- layouts

def train(cfg, grid, mode, every, offload=False, tile=0):
    torch.manual_seed(0)
    model = recompute.apply(Transformer(ModelConfig.from_cfg(cfg)), mode, every, offload, tile)
    net = parallel.parallelize(model, grid, cfg)
    per = distributed.G // grid.data_world
    for s in range(2):
        x, y = (t[grid.data_rank * per:(grid.data_rank + 1) * per] for t in distributed.global_batch(s, 16, 97))
        net(x, y).backward()
        net.step(cfg.grad_clip)
    return net.full_state(optimizer=False)[0]


def _layouts(rank, out_dir):
    for name, dp, mode, every, offload, tile in (
            ("fsdp", "fsdp", "mlp", 2, False, 0), ("ddp", "ddp", "block", 2, False, 0),
            ("ddp_off", "ddp", "block", 1, True, 0), ("fsdp_off", "fsdp", "block", 1, True, 0),
            ("tp_off", "ddp", "mlp", 1, True, 0), ("tp_tile", "ddp", "", 1, False, 5),
            ("fsdp_tile", "fsdp", "block", 1, False, 5)):
        cfg = train_cfg(SMALL, data_parallel=dp, tp=2 if name.startswith("tp") else 1)
        torch.save(train(cfg, parallel.init(cfg), mode, every, offload, tile), os.path.join(out_dir, f"{name}_{rank}.pt"))


def test_fsdp2_and_dp2_equal_one_process(tmp_path):
    spawn(_layouts, 2, str(tmp_path))
    cfg = train_cfg(SMALL)
    ref = train(cfg, parallel.init(cfg), "", 1)
    for name in ("fsdp", "ddp", "ddp_off", "fsdp_off", "tp_off", "tp_tile", "fsdp_tile"):
        assert_close(torch.load(tmp_path / f"{name}_0.pt", weights_only=True), ref, f"{name}2 weights")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: the side stream and pinned host copies")
@pytest.mark.parametrize("mode", recompute.MODES)
def test_offload_on_gpu_equals_checkpointing(mode):
    """On a GPU the copies run on a side stream: offloaded = checkpointed = plain within fp32 rounding (the
    embedding's backward adds with atomics), over two steps (the second reuses the freed host buffers)."""
    g = torch.Generator().manual_seed(0)
    x, y = (torch.randint(0, 97, (8, 16), generator=g).cuda() for _ in range(2))
    ref = model_of().cuda()
    models = [ref, recompute.apply(copy.deepcopy(ref), mode, 1, False), recompute.apply(copy.deepcopy(ref), mode, 1, True)]
    for _ in range(2):
        out = []
        for m in models:
            m.zero_grad(set_to_none=True)
            loss = m(x, y)
            loss.backward()
            out.append((loss.detach(), {n: p.grad.clone() for n, p in m.named_parameters()}))
        for loss, grads in out[1:]:
            torch.testing.assert_close(loss, out[0][0], rtol=1e-6, atol=0)
            for n, gr in grads.items():
                torch.testing.assert_close(gr, out[0][1][n], rtol=1e-5, atol=1e-7)
        parts = [m.forward for m in models[2].modules() if isinstance(m.forward, recompute.Checkpointed)]
        assert len(parts) == 3 and all(f.offloader.saved == [] for f in parts)  # every host copy taken back


@pytest.mark.parametrize("mode", recompute.MODES)
def test_offloaded_inputs_leave_the_device_in_forward(mode):
    """Between forward and backward nothing holds an offloaded part's input on its device (only the host copy):
    each part's input tensor is freed once the forward has passed it; checkpointed without offload, it is kept."""
    import gc
    import weakref
    for offload in (True, False):
        model, seen = recompute.apply(model_of(), mode, 1, offload), []
        parts = [m for m in model.modules() if isinstance(m.forward, recompute.Checkpointed)]
        hooks = [m.register_forward_pre_hook(lambda m, args: seen.append(weakref.ref(args[0]))) for m in parts]
        x = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(3))
        loss = model(x, x)
        gc.collect()
        alive = [r() is not None for r in seen]
        assert len(alive) == 3 and (not any(alive) if offload else all(alive)), (offload, alive)
        loss.backward()
        for h in hooks:
            h.remove()
