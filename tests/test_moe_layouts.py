"""Mixture of experts composes with the other layouts: every one equals one process.

What these tests prove, on CPU in fp32 with gloo, against one process that sees the whole global
batch (relative error <= 1e-5): EP2 (DDP), EP2 x TP2 (experts' hidden units cut over TP, router
replicated, shared expert cut like the dense MLP), EP2 under FSDP (dp 1), EP2 x FSDP2 and
EP2 x TP2 under FSDP produce the same initial full weights, first gradients, losses (mean over
data ranks), gradient norms, weights and full optimizer state after 3 steps (AdamW with clipping,
dropless and with capacity dropping; Muon with fp32 Newton-Schulz under DDP, where NS only ever
sees whole matrices: expert slices are gathered over TP); under DDP every replicated piece (the
router included) stays bitwise identical over the ranks that hold it. Checkpoints move both ways:
the one-process checkpoint of step 2 resumed in each layout (experts and their AdamW moments /
Muon momentum cut on load) continues like the uninterrupted run, and each layout's checkpoint of
step 3 resumed in one process does too. Muon under FSDP (EP2 with dp 1, EP2 x FSDP2) equals one
process too, each whole matrix orthogonalised by exactly one owner of its unit's group (the router
in its own AdamW run of the flat buffer). config.validate accepts these combinations.
"""
import collections
import os
from types import SimpleNamespace

import distributed
import pytest
import torch
import torch.distributed as dist
from distributed import assert_close, full_state, load_checkpoint, ns_calls, rel_err, spawn, train_cfg

import checkpoint
import config
import moe
import optim
import parallel
from model import ModelConfig, Transformer
from parallelism import dp, fsdp, tp

pytestmark = pytest.mark.usefixtures("one_thread")

G, T, STEPS = 8, 8, 3
MOE = dict(n_experts=4, moe_top_k=2, aux_loss_coeff=0.1, z_loss_coeff=0.01)
VARIANTS = {
    "adamw": dict(n_shared_experts=1, capacity_factor=1.0, moe_first_dense=1, bias=True, activation="gelu"),
    "muon": dict(optimizer="muon", ns_dtype="float32"),     # dropless, swiglu, every layer MoE
    "dropless": dict(),
}


SMALL = dict(vocab_size=61, pad_vocab_multiple=32, n_layer=2, n_head=2, n_embd=32, ffn_hidden=16,
             block_size=T, lr=3e-3, weight_decay=0.1, grad_clip=0.5, grad_bucket_mb=0.01,
             eps=1e-6, **MOE)


def small_cfg(**kw):
    return train_cfg(SMALL, **kw)


def global_batch(step):
    return distributed.global_batch(step, T, 61)


def layout(grid, kw, sharded, steps, load=None, save=None, seed=0):
    """pretrain.py's loop in miniature for any grid: -> record of full (one-process) tensors."""
    cfg = small_cfg(tp=grid.tp, ep=grid.ep, **kw)
    torch.manual_seed(seed)
    raw = tp.tensor_parallel(Transformer(ModelConfig.from_cfg(cfg)), grid)
    moe.expert_parallel(raw, grid)
    if sharded:
        model = fsdp.FSDP(raw, grid)
        opt = optim.build_optimizer(model, cfg, grid)
    else:
        opt = optim.build_optimizer(raw, cfg, grid)
        model = dp.DataParallel(raw, grid, cfg.grad_bucket_mb)
    wrapper = model if sharded else None
    start = load_checkpoint(load, raw, opt, grid, wrapper)["step"] if load else 0
    rec = {"init": full_state(raw, None, grid, wrapper)[0], "losses": [], "norms": [], "steps": []}
    per = G // grid.data_world
    with ns_calls() as calls:
        for s in range(start, start + steps):
            x, y = (t[grid.data_rank * per:(grid.data_rank + 1) * per] for t in global_batch(s))
            loss = model(x, y)
            loss.backward()
            model.finish()
            if grid.world > 1:  # each rank's loss is its local mean: their mean is the one-process loss
                loss = loss.detach().clone()
                dist.all_reduce(loss, group=grid.data_group or grid.dp_group)
                loss /= grid.data_world
            rec["losses"].append(loss.detach())
            if s == 0:
                if sharded:
                    g = fsdp.gather_by_name(model, lambda u: u.grad)
                else:
                    g = {n: tp.full_tensor(p, p.grad, grid) for n, p in raw.named_parameters()}
                rec["grads"] = moe.gather_experts(raw, grid, g)[0]
            if grid.world == 1:  # the reference clips with torch's own
                rec["norms"].append(torch.nn.utils.clip_grad_norm_(raw.parameters(), cfg.grad_clip))
            elif sharded:
                rec["norms"].append(parallel.clip_grad_norm_(model, cfg.grad_clip, grid))
            else:
                rec["norms"].append(parallel.clip_grad_norm_(model, cfg.grad_clip, grid))
            opt.step()
            model.zero_grad()
            if grid.world == 1 or s + 1 == start + steps or (save and s + 1 == save[1]):
                rec["steps"].append(full_state(raw, opt, grid, wrapper))
            if save and s + 1 == save[1]:
                checkpoint.save(save[0], s + 1, *rec["steps"][-1], cfg, rank=grid.rank)
    rec["calls"], rec["dropped"] = calls, moe.metrics(raw)["dropped"]  # (of this rank's last micro-batch)
    rec["grid"] = (grid.dp_rank, grid.ep_rank, grid.tp_rank)
    if not sharded:  # this rank's tensors, and which of them are cut by EP / TP
        rec["local"] = {n: (p.detach().clone(), getattr(p, "ep_split", 1) > 1, hasattr(p, "tp_split"))
                        for n, p in raw.named_parameters()}
    return rec


def _run(rank, out_dir, jobs, ref_dir):
    """jobs: [(tag, variant, FSDP?, tp, ep)], several layouts in one spawn (processes are slow to start)."""
    for tag, variant, sharded, tp_size, ep in jobs:
        grid = parallel.init(SimpleNamespace(device="cpu", tp=tp_size, ep=ep))
        kw = VARIANTS[variant]
        rec = {"train": layout(grid, kw, sharded, STEPS, save=(os.path.join(out_dir, tag), STEPS))}
        ckpt = os.path.join(ref_dir, variant, "step_000002")  # one process -> this layout
        rec["resumed"] = layout(grid, kw, sharded, 1, load=ckpt, seed=1)["steps"][-1]
        torch.save(rec, os.path.join(out_dir, f"{tag}_rank{rank}.pt"))


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One process, STEPS + 1 steps, a checkpoint after step 2; per variant."""
    d = str(tmp_path_factory.mktemp("moe_ref"))
    grid = parallel.init(SimpleNamespace(device="cpu", tp=1, ep=1))
    refs = {v: layout(grid, kw, False, STEPS + 1, save=(os.path.join(d, v), 2)) for v, kw in VARIANTS.items()}
    for r in refs.values():
        assert max(rel_err(r["steps"][-1][0][k], r["init"][k]) for k in r["init"]) > 1e-3  # it trains
        assert r["norms"][0] > small_cfg().grad_clip  # and clipping clips
    assert refs["adamw"]["dropped"] > 0 and refs["muon"]["dropped"] == 0  # capacity drops, dropless does not
    return d, refs


def check(tmp, reference, tag, variant, world, tp_size):
    ref_dir, refs = reference
    ref = refs[variant]
    recs = [torch.load(os.path.join(tmp, f"{tag}_rank{r}.pt"), weights_only=False) for r in range(world)]
    for r, rec in enumerate(recs):
        got, what = rec["train"], f"{tag} rank {r}"
        assert_close(got["init"], ref["init"], f"{what} initial weights")
        assert_close(got["grads"], ref["grads"], f"{what} first gradients")
        for s in range(STEPS):
            assert_close(got["losses"][s], ref["losses"][s], f"{what} loss of step {s}")
            assert_close(got["norms"][s], ref["norms"][s], f"{what} gradient norm of step {s}")
        assert_close(got["steps"][-1][0], ref["steps"][STEPS - 1][0], f"{what} weights after {STEPS} steps")
        assert_close(got["steps"][-1][1], ref["steps"][STEPS - 1][1], f"{what} optimizer state after {STEPS} steps")
        assert_close(rec["resumed"][0], ref["steps"][2][0], f"{what} one-process checkpoint resumed here: weights")
        assert_close(rec["resumed"][1], ref["steps"][2][1], f"{what} one-process checkpoint resumed here: state")
    if variant == "muon" and "local" in recs[0]["train"]:  # DDP: NS saw only whole matrices (expert
        for r, rec in enumerate(recs):                         # slices gathered over TP): one process's shapes
            assert set(rec["train"]["calls"]) == set(ref["calls"]), (r, rec["train"]["calls"], ref["calls"])
    elif variant == "muon":  # FSDP (tp 1): every whole matrix orthogonalised by exactly one owner, per step
        got = sum((rec["train"]["calls"] for rec in recs), collections.Counter())
        assert {k: v * (STEPS + 1) for k, v in got.items()} == {k: v * STEPS for k, v in ref["calls"].items()}, \
            (got, ref["calls"])
    if "local" in recs[0]["train"]:  # DDP: every piece bitwise identical over the ranks holding it
        for a in recs:
            for b in recs:
                (_, ep_a, tp_a), (_, ep_b, tp_b) = a["train"]["grid"], b["train"]["grid"]
                for n, (t, by_ep, by_tp) in a["train"]["local"].items():
                    if (ep_a == ep_b or not by_ep) and (tp_a == tp_b or not by_tp):
                        assert torch.equal(t, b["train"]["local"][n][0]), f"{tag}: {n} differs between replicas"
    # this layout's checkpoint of step 3, resumed in one process, makes step 4 like the straight run
    grid = parallel.init(SimpleNamespace(device="cpu", tp=1, ep=1))
    back = layout(grid, VARIANTS[variant], False, 1, load=os.path.join(tmp, tag, f"step_{STEPS:06d}"), seed=1)
    assert_close(back["steps"][-1][0], ref["steps"][STEPS][0], f"{tag} checkpoint resumed in one process: weights")
    assert_close(back["steps"][-1][1], ref["steps"][STEPS][1], f"{tag} checkpoint resumed in one process: state")


def run(tmp_path, reference, world, jobs):
    spawn(_run, world, str(tmp_path), jobs, reference[0])
    for tag, variant, _, tp_size, _ in jobs:
        check(str(tmp_path), reference, tag, variant, world, tp_size)


def test_ep2_equals_one_process_and_resumes_across_layouts(tmp_path, reference):
    # DDP with AdamW (shared expert, capacity) and Muon (dropless); FSDP with dp 1: expert units
    # are not sharded (their group is one rank), the rest is sharded over the 2 EP ranks
    run(tmp_path, reference, 2, [("ep2_adamw", "adamw", False, 1, 2), ("ep2_muon", "muon", False, 1, 2),
                                 ("ep2_fsdp", "dropless", True, 1, 2), ("ep2_fsdp_muon", "muon", True, 1, 2)])


def test_ep2_tp2_equals_one_process(tmp_path, reference):
    run(tmp_path, reference, 4, [("ep2tp2_adamw", "adamw", False, 2, 2), ("ep2tp2_muon", "muon", False, 2, 2)])


def test_ep2_dp2_fsdp_and_ep2_tp2_fsdp_equal_one_process(tmp_path, reference):
    run(tmp_path, reference, 4, [("ep2dp2_fsdp", "adamw", True, 1, 2), ("ep2tp2_fsdp", "dropless", True, 2, 2),
                                 ("ep2dp2_fsdp_muon", "muon", True, 1, 2)])


def test_config_accepts_the_combinations():
    ok = [dict(tp=2, ep=2), dict(tp=2, ep=2, optimizer="muon"), dict(ep=2, data_parallel="fsdp"),
          dict(ep=2, resume=True), dict(tp=2, ep=2, data_parallel="fsdp", resume=True),
          dict(ep=2, data_parallel="fsdp", optimizer="muon")]
    for kw in ok:
        config.validate(small_cfg(batch_size=32, micro_batch_size=2, **kw), 8)
