"""Data parallelism equals one process.

Proves, in fp32 on CPU with gloo: two data-parallel ranks that each see half of a global batch
produce the same initial weights, the same first gradients and the same weights after 3 AdamW
steps as one process that sees the whole batch (relative error <= 1e-5); replicated parameters
stay bitwise identical across ranks after every step; gradient accumulation over micro-steps
equals the full batch; with bf16 gradient reduction the gradients are exactly the bf16 sum of the
ranks' rounded gradients (close to fp32's); a dropped DataParallel model is freed (its gradient
hooks hold it weakly); a backward into buckets still being reduced (DDP-style no_sync around the
forward only) is refused with an error that says what to change; the process grid places TP
innermost. parallel.parallelize with partly frozen parameters, under DP and FSDP on two ranks,
equals one process (frozen weights unchanged, the rest as a plain run training only them, the
gradient norm as torch's over the trainable ones); a frozen model gets no optimizer and stays
replicated, also when fsdp is asked for.
"""
import gc
import os
import weakref
from types import SimpleNamespace

import distributed
import pytest
import torch
from distributed import assert_close, rel_err, spawn, train_cfg

import optim
import parallel
from model import ModelConfig, Transformer
from parallelism import dp

G, T, STEPS = 8, 16, 3  # global batch (sequences), sequence length, optimizer steps


SMALL = dict(vocab_size=97, pad_vocab_multiple=32, n_layer=2, n_head=4, n_kv_head=2, n_embd=32,
             block_size=T, lr=1e-3, weight_decay=0.1, grad_clip=1.0,
             grad_bucket_mb=0.01,  # tiny buckets: several all-reduces in flight during backward
             # The key bias has a mathematically zero gradient (softmax ignores a constant shift of
             # all scores), so its gradient is pure rounding noise; Adam with eps=1e-8 would blow that
             # noise up to lr-sized, run-dependent updates. eps=1e-6 keeps noise at noise level.
             eps=1e-6)


def small_cfg(**kw):
    return train_cfg(SMALL, **kw)


def global_batch(step):
    return distributed.global_batch(step, T, 97)


def train(rank, world, accum, out_dir, cfg_kw):
    """The training step of pretrain.py in miniature; saves what the test compares."""
    cfg = small_cfg(**cfg_kw)
    grid = parallel.init(cfg)
    torch.manual_seed(0)
    raw = Transformer(ModelConfig.from_cfg(cfg))
    if rank == 1:  # a different local init must be overwritten by rank 0's broadcast
        with torch.no_grad():
            for p in raw.parameters():
                p.add_(1.0)
    opt = optim.build_optimizer(raw, cfg)
    model = dp.DataParallel(raw, grid, cfg.grad_bucket_mb, reduce_dtype=getattr(torch, cfg.grad_reduce_dtype))
    rec = {"init": {k: v.clone() for k, v in raw.state_dict().items()}, "steps": []}
    per_rank = G // world
    mb = per_rank // accum
    for step in range(STEPS):
        x, y = global_batch(step)
        x, y = x[rank * per_rank:(rank + 1) * per_rank], y[rank * per_rank:(rank + 1) * per_rank]
        if step == 0 and accum == 1:  # this rank's own gradients, unreduced (for the bf16 test)
            with model.no_sync():
                model(x, y).backward()
            rec["local_grads"] = {n: p.grad.clone() for n, p in raw.named_parameters()}
            model.zero_grad()
        for m in range(accum):
            ctx = model.no_sync() if m < accum - 1 else torch.enable_grad()
            with ctx:
                loss = model(x[m * mb:(m + 1) * mb], y[m * mb:(m + 1) * mb]) / accum
                loss.backward()
        model.finish()
        if step == 0:
            rec["grads"] = {n: p.grad.clone() for n, p in raw.named_parameters()}
        torch.nn.utils.clip_grad_norm_(raw.parameters(), cfg.grad_clip)
        opt.step()
        model.zero_grad()
        rec["steps"].append({k: v.clone() for k, v in raw.state_dict().items()})
    torch.save(rec, os.path.join(out_dir, f"rank{rank}.pt"))
    # dropping the wrapped model frees it: the gradient hooks do not keep DataParallel alive
    alive = weakref.ref(next(raw.parameters()))
    del model, raw, opt, loss  # (the last loss's graph holds the leaves too)
    gc.collect()
    assert alive() is None, "DataParallel leaked its model"


def run(tmp_path, accum, **cfg_kw):
    """One process (the reference), in this process."""
    out = tmp_path / f"a{accum}"
    out.mkdir()
    train(0, 1, accum, str(out), cfg_kw)
    return torch.load(out / "rank0.pt")




@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return run(tmp_path_factory.mktemp("ref"), 1)


GPT2_KW = {"tie_embeddings": True, "pos_emb": "learned", "norm": "layernorm", "activation": "gelu", "bias": True}
DP2_JOBS = {"llama": (1, {}), "gpt2": (1, GPT2_KW), "bf16": (1, {"grad_reduce_dtype": "bfloat16"}), "accum2": (2, {})}


def train_jobs(rank, world, out_dir):
    for name, (accum, cfg_kw) in DP2_JOBS.items():  # one spawn for every two-rank run of this file
        os.makedirs(os.path.join(out_dir, name), exist_ok=True)
        train(rank, world, accum, os.path.join(out_dir, name), cfg_kw)


@pytest.fixture(scope="module")
def dp2(tmp_path_factory):
    out = tmp_path_factory.mktemp("dp2")
    spawn(train_jobs, 2, 2, str(out))
    return {name: [torch.load(out / name / f"rank{r}.pt") for r in range(2)] for name in DP2_JOBS}


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_dp2_equals_one_process(tmp_path, dp2, name):
    ref = run(tmp_path, 1, **DP2_JOBS[name][1])
    ranks = dp2[name]
    for r in ranks:
        assert_close(r["init"], ref["init"], "initial weights")
        assert_close(r["grads"], ref["grads"], "first gradients")
        assert_close(r["steps"][-1], ref["steps"][-1], f"weights after {STEPS} steps")
    for s in range(STEPS):  # replicas bitwise identical after every step
        for k, v in ranks[0]["steps"][s].items():
            assert torch.equal(v, ranks[1]["steps"][s][k]), f"step {s}: {k} differs across ranks"


def test_dp2_bf16_gradient_reduction(dp2, reference):
    # gradients travel in bf16: the result is the bf16 sum of the ranks' bf16-rounded gradients
    # (gloo sums), then divided by the world in fp32; replicas stay bitwise identical
    ranks = dp2["bf16"]
    for n, g in ranks[0]["grads"].items():
        a, b = (r["local_grads"][n].bfloat16() for r in ranks)
        assert torch.equal(g, (a + b).float() / 2), n
        assert torch.equal(g, ranks[1]["grads"][n]), n
    err = max(rel_err(ranks[0]["grads"][n], g) for n, g in reference["grads"].items())
    assert 1e-5 < err < 2e-2, err  # not the fp32 path, and close to it
    for s in range(STEPS):
        for k, v in ranks[0]["steps"][s].items():
            assert torch.equal(v, ranks[1]["steps"][s][k]), f"step {s}: {k} differs across ranks"


def _ddp_style(rank, out_dir):
    cfg = small_cfg()
    grid = parallel.init(cfg)
    raw = Transformer(ModelConfig.from_cfg(cfg))
    model = dp.DataParallel(raw, grid, cfg.grad_bucket_mb)
    x, y = global_batch(0)
    model(x, y).backward()  # the last micro-step's backward launches the reductions ...
    with model.no_sync():   # ... and a DDP-style no_sync around the next forward only does not stop
        loss = model(x, y)  # the next backward from writing into buckets in flight
    with pytest.raises(RuntimeError, match="inside model.no_sync"):
        loss.backward()


def test_backward_outside_no_sync_is_refused(tmp_path):
    spawn(_ddp_style, 2, str(tmp_path))


def test_grad_accumulation_equals_full_batch(tmp_path, reference):
    acc = run(tmp_path, 4)
    assert_close(acc["grads"], reference["grads"], "accumulated gradients")
    assert_close(acc["steps"][-1], reference["steps"][-1], "weights after accumulation")


def test_dp2_with_accumulation(dp2, reference):
    ranks = dp2["accum2"]
    for r in ranks:
        assert_close(r["grads"], reference["grads"], "DP2 x accumulation 2 gradients")
        assert_close(r["steps"][-1], reference["steps"][-1], "DP2 x accumulation 2 weights")


def test_weights_actually_move(reference):
    # guards the comparisons above against a no-op optimizer
    moved = max(rel_err(reference["steps"][-1][k], reference["init"][k]) for k in reference["init"])
    assert moved > 1e-3


LAYOUTS = [(2, 1), (1, 2), (2, 2)]  # (tp, ep) on 4 ranks


def _grid(rank, out_dir):
    os.environ["WORLD_SIZE"] = "4"
    for tp, ep in LAYOUTS:  # one spawn, a grid per layout (init joins the existing process group)
        g = parallel.init(SimpleNamespace(device="cpu", tp=tp, ep=ep))
        torch.save({k: getattr(g, k) for k in ("dp", "tp", "ep", "dp_rank", "tp_rank", "ep_rank")},
                   os.path.join(out_dir, f"g{tp}{ep}_{rank}.pt"))


def test_grid_tp_innermost(tmp_path):
    spawn(_grid, 4, str(tmp_path))
    for tp, ep in LAYOUTS:
        gs = [torch.load(tmp_path / f"g{tp}{ep}_{r}.pt") for r in range(4)]
        dp = 4 // (tp * ep)
        for r, g in enumerate(gs):  # rank = (dp_rank * ep + ep_rank) * tp + tp_rank
            assert (g["dp"], g["tp"], g["ep"]) == (dp, tp, ep), (tp, ep)
            assert r == (g["dp_rank"] * ep + g["ep_rank"]) * tp + g["tp_rank"], (tp, ep)


FROZEN = ("tok_emb.weight", "blocks.0.attn.qkv.weight", "blocks.1.norm1.weight")  # LoRA-style partial freezing


def _frozen(rank, world, out_dir, data_parallel):
    cfg = small_cfg(data_parallel=data_parallel, grad_clip=0.3)
    grid = parallel.init(cfg)
    torch.manual_seed(0)
    model = Transformer(ModelConfig.from_cfg(cfg))
    for n, p in model.named_parameters():
        p.requires_grad_(n not in FROZEN)
    run = parallel.parallelize(model, grid, cfg)
    per = G // world
    rec = {"norms": []}
    for step in range(2):
        x, y = (t[rank * per:(rank + 1) * per] for t in global_batch(step))
        run.fwd(x, y).backward()
        run.wrapper.finish()
        rec["norms"].append(run.clip_grad_norm_(cfg.grad_clip))
        run.optimizer.step()
        run.wrapper.zero_grad(set_to_none=True)
    with run.full_params():
        rec["weights"] = {k: v.clone() for k, v in run.raw.state_dict().items()}
    ref = Transformer(ModelConfig.from_cfg(cfg)).requires_grad_(False)  # a frozen reference model
    frozen = parallel.parallelize(ref, grid, cfg, optimizer=False)
    assert frozen.optimizer is None and isinstance(frozen.wrapper, dp.DataParallel)
    rec["ref_loss"] = frozen.fwd(*global_batch(0)).item()
    torch.save(rec, os.path.join(out_dir, f"{data_parallel}{rank}.pt"))


def test_parallelize_partly_frozen_and_frozen(tmp_path):
    """One process trains only the unfrozen parameters (AdamW, torch's clip); DP and FSDP over two
    ranks, through parallelize, give the same weights, norms and frozen-model loss."""
    cfg = small_cfg(grad_clip=0.3)  # below the first norms: clipping is exercised
    torch.manual_seed(0)
    model = Transformer(ModelConfig.from_cfg(cfg))
    init = {k: v.clone() for k, v in model.state_dict().items()}
    for n, p in model.named_parameters():
        p.requires_grad_(n not in FROZEN)
    opt = optim.build_optimizer(model, cfg)
    assert sum(len(g["params"]) for g in opt.param_groups) == len(list(model.parameters())) - len(FROZEN)
    norms = []
    for step in range(2):
        model(*global_batch(step)).backward()
        norms.append(torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad],
                                                    cfg.grad_clip))
        opt.step()
        opt.zero_grad(set_to_none=True)
    ref_loss = Transformer(ModelConfig.from_cfg(cfg))(*global_batch(0)).item()  # same seed stream as _frozen
    spawn(_frozen, 2, 2, str(tmp_path), "ddp")
    spawn(_frozen, 2, 2, str(tmp_path), "fsdp")
    for name in ("ddp0", "ddp1", "fsdp0", "fsdp1"):
        rec = torch.load(tmp_path / f"{name}.pt")
        assert_close(rec["weights"], model.state_dict(), name)
        assert all(torch.equal(rec["weights"][n], init[n]) for n in FROZEN)
        assert_close(torch.stack(rec["norms"]), torch.stack(norms), f"{name} norms")
        assert abs(rec["ref_loss"] - ref_loss) <= 1e-5 * ref_loss
    assert norms[0] > cfg.grad_clip  # clipping was exercised
