"""Fully sharded data parallelism (fsdp.py) equals one process.

Proves, in fp32 on CPU with gloo, against one process that sees the whole global batch (relative
error <= 1e-5): FSDP over 2 ranks (and TP2 x FSDP2 over 4, once tp.py exists) starts from the same
full weights, produces the same first gradients, the same gradient norm and the same weights and
AdamW state (weight_decay 0.1, clipping active) after 3 steps; also with gradient accumulation and
with activation checkpointing. Checkpoints are layout-independent: a one-process state loaded into
FSDP2 continues like the one process, and FSDP2's full state continues in one process.
Compiled FSDP2 (parallelize with compile=True, the aot_eager backend: the same graphs and autograd
as inductor, no C++ codegen) equals eager FSDP2 (losses and weights, relative error <= 1e-6) and the
one process after 3 steps, also with activation checkpointing and accumulation; one graph serves
every block, steps 2 and 3 compile nothing new, and the compiled graphs are what runs (counted
calls: checkpointing recomputes each block through its compiled forward); config.validate accepts
compile with FSDP.
"""
import os
from types import SimpleNamespace

import distributed
import pytest
import torch
from distributed import assert_close, rel_err, spawn, train_cfg

import config
import generate
import optim
import parallel
from model import ModelConfig, Transformer
from parallelism import fsdp
from parallelism.tp import tensor_parallel

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
G, T, STEPS = 8, 16, 3  # global batch (sequences), sequence length, optimizer steps
GPT2 = {"tie_embeddings": True, "pos_emb": "learned", "norm": "layernorm", "activation": "gelu", "bias": True}


SMALL = dict(vocab_size=97, pad_vocab_multiple=32, n_layer=2, n_head=4, n_kv_head=2, n_embd=32,
             block_size=T, lr=1e-3, weight_decay=0.1,
             grad_clip=0.5,  # below the first steps' gradient norms: clipping is exercised
             # eps=1e-6: see tests/test_parallel.py (the key bias's gradient is rounding noise)
             eps=1e-6)


def small_cfg(**kw):
    return train_cfg(SMALL, **kw)


def global_batch(step):
    return distributed.global_batch(step, T, 97)


def named_optim_state(raw, opt):
    return {n: {k: v.clone() for k, v in opt.state[p].items()} for n, p in raw.named_parameters()}


def load_named_optim_state(raw, opt, state):
    ps = [p for g in opt.param_groups for p in g["params"]]
    names = {id(p): n for n, p in raw.named_parameters()}
    opt.load_state_dict({"state": {i: state[names[id(p)]] for i, p in enumerate(ps)},
                         "param_groups": opt.state_dict()["param_groups"]})


def reference(cfg_kw, steps, out_file=None):
    """One process, whole batch: what every layout must reproduce."""
    cfg = small_cfg(**cfg_kw)
    torch.manual_seed(0)
    raw = Transformer(ModelConfig.from_cfg(cfg))
    opt = optim.build_optimizer(raw, cfg)
    rec = {"init": {k: v.clone() for k, v in raw.state_dict().items()}, "steps": [], "optim": [], "norms": []}
    for step in range(steps):
        x, y = global_batch(step)
        raw(x, y).backward()
        if step == 0:
            rec["grads"] = {n: p.grad.clone() for n, p in raw.named_parameters()}
        rec["norms"].append(torch.nn.utils.clip_grad_norm_(raw.parameters(), cfg.grad_clip))
        opt.step()
        opt.zero_grad()
        rec["steps"].append({k: v.clone() for k, v in raw.state_dict().items()})
        rec["optim"].append(named_optim_state(raw, opt))
    if out_file:
        torch.save(rec, out_file)
    return rec


def train(rank, world, tp, accum, out_dir, cfg_kw, ref_file):
    """pretrain.py's step under FSDP (optionally TP x FSDP), in miniature."""
    cfg = small_cfg(tp=tp, ep=1, **cfg_kw)
    grid = parallel.init(cfg)
    torch.manual_seed(0)
    raw = Transformer(ModelConfig.from_cfg(cfg))
    if tp > 1:
        tensor_parallel(raw, grid)
    if grid.dp_rank == 1:  # a different local init must be overwritten by the dp group's first rank
        with torch.no_grad():
            for p in raw.parameters():
                p.add_(1.0)
    model = fsdp.FSDP(raw, grid)
    opt = optim.build_optimizer(model, cfg)  # over the shards; decayed shards are (1, n)
    full = lambda: fsdp.full_state_dict(model)  # noqa: E731

    def step(i):
        x, y = global_batch(i)
        per_rank = G // grid.dp
        x, y = x[grid.dp_rank * per_rank:][:per_rank], y[grid.dp_rank * per_rank:][:per_rank]
        mb = per_rank // accum
        for m in range(accum):
            with model.no_sync() if m < accum - 1 else torch.enable_grad():
                (model(x[m * mb:(m + 1) * mb], y[m * mb:(m + 1) * mb]) / accum).backward()
        model.finish()
        if i == 0 and not rec.get("grads"):
            rec["grads"] = fsdp.gather_by_name(model, lambda u: u.grad)
        rec["norms"].append(parallel.clip_grad_norm_(model, cfg.grad_clip, grid))
        opt.step()
        model.zero_grad()

    rec = {"init": full(), "steps": [], "norms": []}
    for i in range(STEPS):
        step(i)
        rec["steps"].append(full())
    rec["optim"] = fsdp.full_optim_state(model, opt)
    if ref_file:  # resume from a one-process checkpoint taken after step 1, redo step 2
        ref = torch.load(ref_file)
        fsdp.load_full_state_dict(model, ref["steps"][0])
        fsdp.load_full_optim_state(model, opt, ref["optim"][0])
        step(1)
        rec["resumed"] = full()
    torch.save(rec, os.path.join(out_dir, f"rank{rank}.pt"))


def run(tmp_path, world, tp=1, accum=1, ref_file=None, **cfg_kw):
    out = tmp_path / f"w{world}t{tp}a{accum}"
    out.mkdir()
    spawn(train, world, world, tp, accum, str(out), cfg_kw, ref_file)
    return [torch.load(out / f"rank{r}.pt") for r in range(world)]






def assert_matches(ranks, ref, what):
    for r in ranks:
        assert_close(r["init"], ref["init"], f"{what} initial weights")
        assert_close(r["grads"], ref["grads"], f"{what} first gradients")
        for got, want in zip(r["norms"][:STEPS], ref["norms"][:STEPS]):
            assert rel_err(got, want) <= 1e-5, f"{what} gradient norm {got} vs {want}"
        assert_close(r["steps"][-1], ref["steps"][STEPS - 1], f"{what} weights after {STEPS} steps")
        for n, s in ref["optim"][STEPS - 1].items():
            assert_close(r["optim"][n], s, f"{what} AdamW state of {n}")
    for k, v in ranks[0]["steps"][-1].items():  # every rank assembles the same full state
        assert all(torch.equal(v, r["steps"][-1][k]) for r in ranks[1:]), f"{k} differs across ranks"


@pytest.fixture(scope="module")
def ref_default(tmp_path_factory):
    f = tmp_path_factory.mktemp("ref") / "ref.pt"
    return reference({}, STEPS + 1, f), str(f)


@pytest.mark.parametrize("cfg_kw", [{}, GPT2], ids=["llama", "gpt2_tied"])
def test_fsdp2_equals_one_process_and_checkpoints_move_between_layouts(tmp_path, ref_default, cfg_kw):
    if cfg_kw:
        ref_file = str(tmp_path / "ref.pt")
        ref = reference(cfg_kw, STEPS + 1, ref_file)
    else:
        ref, ref_file = ref_default
    assert ref["norms"][0] > small_cfg().grad_clip  # clipping is active
    ranks = run(tmp_path, 2, ref_file=ref_file, **cfg_kw)
    assert_matches(ranks, ref, "FSDP2")
    # one process -> FSDP2: state after step 1 loaded, step 2 redone
    for r in ranks:
        assert_close(r["resumed"], ref["steps"][1], "FSDP2 resumed from a one-process checkpoint")
    # FSDP2 -> one process: its full weights and AdamW state continue with step 4
    cfg = small_cfg(**cfg_kw)
    raw = Transformer(ModelConfig.from_cfg(cfg))
    raw.load_state_dict(ranks[0]["steps"][-1])
    opt = optim.build_optimizer(raw, cfg)
    load_named_optim_state(raw, opt, ranks[0]["optim"])
    x, y = global_batch(STEPS)
    raw(x, y).backward()
    torch.nn.utils.clip_grad_norm_(raw.parameters(), cfg.grad_clip)
    opt.step()
    assert_close(raw.state_dict(), ref["steps"][STEPS], "one process resumed from FSDP2's checkpoint")


def test_fsdp2_with_accumulation_and_grad_checkpoint(tmp_path, ref_default):
    # blocks recomputed in backward must be gathered again; 2 micro-steps reduce-scatter twice
    ranks = run(tmp_path, 2, accum=2, grad_checkpoint=True)
    assert_matches(ranks, ref_default[0], "FSDP2 x accumulation 2 x grad_checkpoint")


def test_tp2_fsdp2_equals_one_process(tmp_path):
    # MQA: the one kv head and the q/k norms are pieces both TP ranks hold (gradient summed over
    # TP by tp.py's parameter hooks, counted once in the norm)
    cfg_kw = dict(n_kv_head=1, qk_norm=True, grad_checkpoint=True)
    ref = reference(cfg_kw, STEPS)
    ranks = run(tmp_path, 4, tp=2, accum=2, **cfg_kw)
    assert_matches(ranks, ref, "TP2 x FSDP2")


def test_fsdp_on_one_process(ref_default):
    """dp=1 (no collectives); the shard layout (every parameter once, decayed shards 2-D); what is
    held when (blocks freed after forward, everything after backward); activation checkpointing
    without early stop (the block's post-hook then runs inside the recompute); bf16 compute."""
    ref = ref_default[0]
    cfg = small_cfg()
    grid = parallel.init(SimpleNamespace(device="cpu", tp=1, ep=1))
    torch.manual_seed(0)
    raw = Transformer(ModelConfig.from_cfg(cfg))
    n = raw.num_params()
    model = fsdp.FSDP(raw, grid)
    assert sum(p.numel() for p in model.parameters()) == n
    groups = optim.param_groups(model, 0.1)
    assert sum(p.numel() for p in groups[0]["params"]) == sum(p.numel() for p in ref["init"].values() if p.dim() >= 2)
    opt = optim.build_optimizer(model, cfg)
    for i in range(2):
        raw.cfg.grad_checkpoint = i == 1
        with torch.utils.checkpoint.set_checkpoint_early_stop(False):
            loss = model(*global_batch(i))
            held = [u.full.untyped_storage().nbytes() for u in model.units]
            assert held[0] > 0 and held[1:] == [0] * cfg.n_layer  # the root stays, blocks are freed
            loss.backward()
        assert all(u.full is None for u in model.units)
        model.finish()
        parallel.clip_grad_norm_(model, cfg.grad_clip, grid)
        opt.step()
        model.zero_grad()
    assert_close(fsdp.full_state_dict(model), ref["steps"][1], "FSDP on one process")
    with model.summon_full_params():  # the plain model is back, e.g. for generate()
        out = generate.generate(raw, torch.zeros(1, 1, dtype=torch.long), 3, vocab=raw.cfg.vocab_size, temperature=0)
        assert out.shape == (1, 4)
    with torch.no_grad():  # evaluation: no backward will come, nothing stays gathered
        model(*global_batch(0))
    assert all(u.full is None for u in model.units)

    torch.manual_seed(0)
    model = fsdp.FSDP(Transformer(ModelConfig.from_cfg(cfg)), grid, compute_dtype=torch.bfloat16)
    model(*global_batch(0)).backward()
    model.finish()
    for k, g in fsdp.gather_by_name(model, lambda u: u.grad).items():  # fp32 gradients of bf16 compute
        assert rel_err(g, ref["grads"][k]) < 3e-2, k


def train_compiled(rank, world, out_dir):
    """parallelize(cfg.compile) under FSDP2: eager, compiled, compiled with checkpointing and
    accumulation 2, in one spawn; counts the graphs the backend compiles and the calls of compiled
    graphs, after each step."""
    graphs, calls = [0], [0]

    def backend(gm, example_inputs):  # aot_eager, counting the graphs it is handed and their calls
        graphs[0] += 1
        fn = torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)

        def counted(*args):
            calls[0] += 1
            return fn(*args)
        return counted

    rec = {}
    for name, compile_, accum, ckpt in (("eager", False, 1, False), ("compiled", True, 1, False),
                                        ("compiled_ckpt", True, 2, True)):
        cfg = small_cfg(tp=1, ep=1, data_parallel="fsdp", compile=compile_, grad_checkpoint=ckpt)
        grid = parallel.init(cfg)
        torch.manual_seed(0)
        run = parallel.parallelize(Transformer(ModelConfig.from_cfg(cfg)), grid, cfg, compile_kwargs=dict(backend=backend))
        r = rec[name] = {"losses": [], "graphs": [], "calls": []}
        calls[0] = 0
        for i in range(STEPS):
            x, y = global_batch(i)
            per_rank = G // grid.dp
            x, y = x[grid.dp_rank * per_rank:][:per_rank], y[grid.dp_rank * per_rank:][:per_rank]
            mb = per_rank // accum
            for m in range(accum):
                loss = run.fwd(x[m * mb:(m + 1) * mb], y[m * mb:(m + 1) * mb]) / accum
                loss.backward()
                r["losses"].append(loss.detach())
            run.wrapper.finish()
            run.clip_grad_norm_(cfg.grad_clip)
            run.optimizer.step()
            run.wrapper.zero_grad()
            r["graphs"].append(graphs[0])
            r["calls"].append(calls[0])
        r["weights"] = fsdp.full_state_dict(run.wrapper)
    torch.save(rec, os.path.join(out_dir, f"rank{rank}.pt"))


def test_compiled_fsdp2_equals_eager_and_one_process(tmp_path, ref_default):
    config.validate(small_cfg(data_parallel="fsdp", compile=True), 2)  # accepted (it was refused before)
    spawn(train_compiled, 2, 2, str(tmp_path))
    ref = ref_default[0]["steps"][STEPS - 1]
    for rank in range(2):
        rec = torch.load(tmp_path / f"rank{rank}.pt")
        eager = rec["eager"]
        assert eager["graphs"] == [0, 0, 0]  # compile=False compiles nothing
        # the block graph (both blocks), the final norm, the head's loss; nothing more in steps 2, 3
        assert rec["compiled"]["graphs"] == [3, 3, 3], rec["compiled"]["graphs"]
        # calls per step: 2 blocks + norm + head; with checkpointing each block again in backward
        # (recomputed through the compiled forward), 2 micro-steps
        assert rec["compiled"]["calls"] == [4, 8, 12] and rec["compiled_ckpt"]["calls"] == [12, 24, 36]
        for name in ("compiled", "compiled_ckpt"):
            r = rec[name]
            assert r["graphs"][1:] == r["graphs"][:1] * 2, f"{name}: recompiled after step 1 {r['graphs']}"
            assert_close(r["weights"], ref, f"{name} FSDP2 vs one process after {STEPS} steps")
            assert_close(r["weights"], eager["weights"], f"{name} vs eager FSDP2", tol=1e-6)
        assert_close(torch.stack(rec["compiled"]["losses"]), torch.stack(eager["losses"]), "losses", tol=1e-6)
