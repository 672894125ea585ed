"""Parallel forms on several GPUs, side by side with PyTorch's own, in one run.

    torchrun --nproc_per_node=2 bench/bench_parallel.py speed              # ~1B LLaMA, seq 2048, bf16
    torchrun --nproc_per_node=2 bench/bench_parallel.py capacity --cap_gb=24  # largest model FSDP=2 trains
    torchrun --nproc_per_node=2 bench/bench_parallel.py speed --shape=tiny --device=cpu --steps=2  # smoke test
    torchrun --nproc_per_node=2 bench/bench_parallel.py moe                # 8-expert top-2 MoE: DP vs EP
    torchrun --nproc_per_node=2 bench/bench_parallel.py moe --shape=tiny --device=cpu --steps=2  # smoke test
    torchrun --nproc_per_node=4 bench/bench_parallel.py combo              # TP2xDP2, TP2xFSDP2, EP2xDP2 vs FSDP2 over 4
    torchrun --nproc_per_node=2 bench/bench_parallel.py check-compile      # compiled FSDP == eager FSDP (inductor)

What each mode runs and compares is MODES' (below; also in --help). Every row: bf16 autocast, fused
AdamW, random tokens; tokens/s counts the global batch once; MFU = tokens/s *
model.flops_per_token(T) / (peak * GPUs). Compilation happens in the warm-up steps (not timed); each
row starts with torch._dynamo.reset() (no graphs of the previous row).
"""
import argparse
import gc
import json
import os
import sys
import time
import traceback
from types import SimpleNamespace

import torch
import torch.distributed as dist

# This script lives in bench/ and the modules it imports (model, parallel, ...) in the repo root, one
# folder up: put the root first on sys.path so `python bench/bench_parallel.py` works from any folder.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import logs
import moe
import optim
import parallel
from model import ModelConfig, Transformer
from parallelism import dp, fsdp, tp

LLAMA = dict(vocab_size=50304, activation="swiglu", norm="rmsnorm", pos_emb="rope")
SHAPES = {  # ~1B: Llama-3.2-1B-like width/depth with a 50k vocabulary (1.21B parameters)
    "1b": dict(LLAMA, block_size=2048, n_layer=16, n_embd=2048, n_head=16, n_kv_head=8, ffn_hidden=8192),
    "small": dict(LLAMA, vocab_size=8192, block_size=512, n_layer=4, n_embd=512, n_head=8, n_kv_head=4),
    "tiny": dict(LLAMA, vocab_size=512, block_size=64, n_layer=2, n_embd=64, n_head=4, n_kv_head=2),
}
MOE = dict(n_experts=8, moe_top_k=2)
MOE_SHAPES = {"1b": dict(SHAPES["1b"], **MOE, moe_hidden=4096), "tiny": dict(SHAPES["tiny"], **MOE)}
CAPACITY = [  # (name, shape): 2.1B, 2.5B, 2.9B, 3.3B parameters at width 2560
    (f"{L}-layers", dict(LLAMA, block_size=2048, n_layer=L, n_embd=2560, n_head=20, n_kv_head=4,
                          ffn_hidden=10240, grad_checkpoint=True)) for L in (20, 24, 28, 32)]

MODES = {  # mode -> its rows, what they compare
    "speed": "the same global batch (--batch sequences per GPU for the data-parallel forms, the same total on "
             "the TP group): ours-fsdp (fsdp.FSDP, bf16 compute, fp32 master shards and reduce) vs torch-fsdp2 "
             "(fully_shard per block and on the root, MixedPrecisionPolicy(bf16 params, fp32 reduce)); ours-dp "
             "(dp.DataParallel) vs torch-ddp (DistributedDataParallel, 25 MB buckets); ours-tp (tp.tensor_parallel "
             "over all GPUs, dp = 1); compiled: ours-fsdp-compiled (FSDP.compile: each block's forward, the final "
             "norm and the head's loss compiled, the gather hooks eager) vs torch-fsdp2-compiled (torchtitan's "
             "recipe: each block replaced by torch.compile(block), then fully_shard per block and on the root), "
             "ours-tp-compiled (torch.compile of the TP model: TP's collectives traced into the graph) and "
             "ours-tp-sp-compiled (the same with sequence parallelism); the other rows eager",
    "capacity": "for growing LLaMA shapes, FSDP over all GPUs with activation checkpointing, each process capped "
                "at --cap_gb (set_per_process_memory_fraction after the model is built and sharded: the cap covers "
                "training, not the one-off full-size init); a row passes when --steps optimizer steps complete",
    "moe": "the shape with 8 experts, top-2, in every layer (1b: experts of 4096 hidden units, 3.6B parameters, "
           "1.2B active): moe-dp (every GPU every expert, DataParallel), moe-ep (experts over all GPUs, all_to_all, "
           "dropless), moe-ep-cap (EP, capacity_factor 1.25: static shapes, no host sync), moe-ep-loop (CUDA: one "
           "matmul per expert, MoE.expert_mm='loop', which 'auto' picks on Hopper in bf16), moe-ep-compiled (CUDA: "
           "whole-model compile; the dropless exchange's host sync breaks the graph once per layer); the same "
           "--batch per GPU; MFU counts active parameters",
    "combo": "4+ GPUs as 2 x 2: tp2-dp2, tp2-fsdp2 and torch-fsdp2 over every GPU on the dense shape; ep2-dp2 and "
             "moe-torch-fsdp2 on the MoE shape; --batch sequences per data-parallel rank (a TP pair shares one)",
    "check-compile": "eager vs compiled (inductor) on --shape (default small), --steps steps on the same data: "
                     "ours-fsdp in fp32 (TF32 off) with and without activation checkpointing and bf16 with it; "
                     "ours-tp with and without sequence parallelism, fp32 and bf16: losses and weights after the "
                     "last step (relative error <= 1e-4; bf16: 1e-2), the graphs after step 1 and the last equal "
                     "(no recompilation); exits 1 when a check fails",
}
p = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                            epilog="\n".join(f"{k}: {v}" for k, v in MODES.items()))
p.add_argument("mode", choices=list(MODES))
p.add_argument("--shape", choices=list(SHAPES), default=None, help="default: 1b (check-compile: small)")
p.add_argument("--batch", type=int, default=4, help="sequences per GPU per step")
p.add_argument("--steps", type=int, default=10)
p.add_argument("--warmup", type=int, default=3)
p.add_argument("--runs", default="ours-fsdp,torch-fsdp2,ours-fsdp-compiled,torch-fsdp2-compiled,ours-dp,torch-ddp,ours-tp,"
                                 "ours-tp-compiled,ours-tp-sp-compiled")
p.add_argument("--cap_gb", type=float, default=24.0)
p.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
p.add_argument("--json", default="")
args = p.parse_args()
args.shape = args.shape or ("small" if args.mode == "check-compile" else "1b")

world = int(os.environ.get("WORLD_SIZE", "1"))
grid = parallel.init(SimpleNamespace(device=args.device, tp=1, ep=1))  # dp = world
tp_grid = parallel.init(SimpleNamespace(device=args.device, tp=world, ep=1))  # same processes, tp = world
device, cuda, main = grid.device, grid.device.type == "cuda", grid.is_main
say = print if main else (lambda *a, **k: None)
if cuda:
    torch.backends.cuda.matmul.allow_tf32 = True
dtype = torch.bfloat16 if cuda else torch.float32
opt_cfg = SimpleNamespace(optimizer="adamw", zero1=False, adamw_state="fp32", optimizer_in_backward=False, lr=1e-4, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
peak = logs.peak_tflops(device)


def build(shape):
    torch.manual_seed(0)  # the same full model on every rank
    with torch.device(device):
        return Transformer(ModelConfig(**shape))


def ours_fsdp(raw, compile_=False):
    m = fsdp.FSDP(raw, grid, compute_dtype=dtype if cuda else None)
    if compile_:
        m.compile()
    return m, m, m.finish, m.zero_grad


def torch_fsdp2(raw, compile_=False):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    for i, block in enumerate(raw.blocks):
        if compile_:  # torchtitan's apply_compile, then apply_fsdp: each block wrapped, then sharded
            block = raw.blocks[i] = torch.compile(block)
        fully_shard(block, mp_policy=mp)
    fully_shard(raw, mp_policy=mp)
    return raw, raw, (lambda: None), (lambda: raw.zero_grad(set_to_none=True))


def ours_dp(raw):
    m = dp.DataParallel(raw, grid)
    return raw, raw, m.finish, m.zero_grad


def torch_ddp(raw):
    from torch.nn.parallel import DistributedDataParallel as DDP
    m = DDP(raw, device_ids=[device.index] if cuda else None, bucket_cap_mb=25, gradient_as_bucket_view=True)
    return raw, m, (lambda: None), (lambda: raw.zero_grad(set_to_none=True))


def ours_tp(raw, compile_=False, sp=False):
    tp.tensor_parallel(raw, tp_grid, sequence_parallel=sp)
    fwd = torch.compile(raw) if compile_ else raw  # as parallel.parallelize: dynamo traces TP's collectives
    return raw, fwd, (lambda: None), (lambda: raw.zero_grad(set_to_none=True))


ROWS = {"ours-fsdp": ours_fsdp, "torch-fsdp2": torch_fsdp2, "ours-dp": ours_dp, "torch-ddp": torch_ddp,
        "ours-tp": ours_tp, "ours-fsdp-compiled": lambda raw: ours_fsdp(raw, True),
        "torch-fsdp2-compiled": lambda raw: torch_fsdp2(raw, True), "ours-tp-compiled": lambda raw: ours_tp(raw, True),
        "ours-tp-sp-compiled": lambda raw: ours_tp(raw, True, sp=True)}
ep_grid = (parallel.init(SimpleNamespace(device=args.device, tp=1, ep=world))  # same processes, ep = world
           if args.mode == "moe" else None)
if args.mode == "combo":  # pairs of neighbouring GPUs: TP (or EP) inside, data parallel across
    if world % 2 or world < 4:
        p.error("combo needs an even world of at least 4: torchrun --nproc_per_node=4")
    tp2_grid = parallel.init(SimpleNamespace(device=args.device, tp=2, ep=1))
    ep2_grid = parallel.init(SimpleNamespace(device=args.device, tp=1, ep=2))


def combo(g, shard):
    def wrap(raw):
        if g.tp > 1:
            tp.tensor_parallel(raw, g)
        moe.expert_parallel(raw, g)  # (dense model: no-op)
        m = fsdp.FSDP(raw, g, compute_dtype=dtype if cuda else None) if shard else dp.DataParallel(raw, g)
        return (m, m, m.finish, m.zero_grad) if shard else (raw, raw, m.finish, m.zero_grad)
    wrap.tp = g.tp
    return wrap


def moe_wrap(g, expert_mm="auto", compile_=False):
    def wrap(raw):
        moe.expert_parallel(raw, g)  # ep = 1: every expert here; ep = world: this rank's share
        for m in moe.layers(raw):
            m.expert_mm = expert_mm  # the experts' kernel (moe.py): grouped matmuls or a loop
        m = dp.DataParallel(raw, g)
        return raw, torch.compile(raw) if compile_ else raw, m.finish, m.zero_grad  # as parallel.parallelize
    return wrap


def measure(name, shape, wrap, cap_gb=0.0):
    """Build, wrap, warm up, time; returns a dict row (or its error)."""
    row = {"run": name}
    torch._dynamo.reset()
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.set_per_process_memory_fraction(1.0, device)
    try:
        raw = build(shape)
        row["params"] = raw.num_params()
        row["active_params"] = raw.active_params()
        fpt = raw.flops_per_token(shape["block_size"])
        params_of, fwd, finish, zero_grad = wrap(raw)
        opt = optim.build_optimizer(params_of, opt_cfg)
        tp_size = world if name.startswith("ours-tp") else getattr(wrap, "tp", 1)
        B = args.batch * tp_size  # TP ranks share one batch: the same global batch
        T = shape["block_size"]
        g = torch.Generator(device=device).manual_seed(1 + grid.rank // tp_size)
        data = [torch.randint(0, shape["vocab_size"], (B, T + 1), device=device, generator=g) for _ in range(3)]
        if cuda:
            gc.collect()
            torch.cuda.empty_cache()
            if cap_gb:
                total = torch.cuda.get_device_properties(device).total_memory
                torch.cuda.set_per_process_memory_fraction(cap_gb * 2**30 / total, device)
            torch.cuda.reset_peak_memory_stats(device)

        def step(i):
            d = data[i % len(data)]
            with torch.autocast(device.type, dtype=dtype, enabled=cuda):
                loss = fwd(d[:, :-1], d[:, 1:])
            loss.backward()
            finish()
            opt.step()
            zero_grad()
            return loss

        for i in range(args.warmup):
            step(i)
        sync()
        t0 = time.perf_counter()
        for i in range(args.steps):
            loss = step(i)
        sync()
        dt = max_over_ranks(time.perf_counter() - t0)
        tok_s = B * T * args.steps * (world // tp_size) / dt
        row.update(tokens_per_s=tok_s, step_ms=1e3 * dt / args.steps, loss=loss.item(),
                   mfu=tok_s * fpt / (peak * 1e12 * world) if peak else None,
                   peak_mem_gb=max_over_ranks(torch.cuda.max_memory_allocated(device) / 2**30) if cuda else None)
        say(f"  {name}: {row['params'] / 1e9:.2f}B params | {tok_s:,.0f} tokens/s | {row['step_ms']:.1f} ms/step"
            f" | MFU {100 * (row['mfu'] or 0):.1f}% | peak {row['peak_mem_gb'] or 0:.2f} GiB | loss {row['loss']:.3f}")
    except Exception as e:  # OOM in a capacity row is a result, not a crash
        row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        say(f"  {name}: FAILED {row['error']}")
        if not isinstance(e, torch.cuda.OutOfMemoryError):
            say(traceback.format_exc())
    finally:
        if cuda:
            torch.cuda.set_per_process_memory_fraction(1.0, device)
    if world > 1:
        dist.barrier()
    return row


def check_compile(shape):
    """Eager vs compiled (inductor), the same losses and weights and no recompilation: ours-fsdp in
    fp32 (TF32 off) with and without activation checkpointing and in bf16 compute (autocast) with
    it; ours-tp over all GPUs (dp = 1), with and without sequence parallelism, in fp32 and bf16."""
    torch.backends.cuda.matmul.allow_tf32 = False
    graphs = [0]

    def backend(gm, example_inputs):  # inductor, counting the graphs it is handed
        graphs[0] += 1
        return torch._dynamo.lookup_backend("inductor")(gm, example_inputs)
    cfg = SimpleNamespace(**{**vars(opt_cfg), "eps": 1e-6})  # eps: see tests/test_parallel.py (rounding-noise gradients)

    def batches(seed):
        g = torch.Generator(device=device).manual_seed(seed)
        return [torch.randint(0, shape["vocab_size"], (args.batch, shape["block_size"] + 1), device=device,
                              generator=g) for _ in range(args.steps)]
    own, shared = batches(1 + grid.rank), batches(1)  # FSDP: each rank its own; a TP group: one batch

    def train(form, ckpt, compute, compiled):
        torch._dynamo.reset()
        graphs[0] = 0
        raw = build(dict(shape, grad_checkpoint=ckpt))
        if form == "fsdp":
            m = fwd = fsdp.FSDP(raw, grid, compute_dtype=compute)
            if compiled:
                m.compile(backend=backend)
        else:  # TP over all GPUs (dp = 1)
            m = tp.tensor_parallel(raw, tp_grid, sequence_parallel=form == "tp-sp")
            fwd = torch.compile(m, backend=backend) if compiled else m
        opt = optim.build_optimizer(m, cfg)
        losses, counts = [], []
        for d in own if form == "fsdp" else shared:
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=compute is not None):
                loss = fwd(d[:, :-1], d[:, 1:])
            loss.backward()
            if form == "fsdp":
                m.finish()
            opt.step()
            m.zero_grad()
            losses.append(loss.detach().float())
            counts.append(graphs[0])
        weights = fsdp.full_state_dict(m) if form == "fsdp" else {k: v.detach().float().clone()
                                                                   for k, v in m.state_dict().items()}
        return torch.stack(losses), weights, counts

    rows = []
    for form, name, ckpt, compute, tol in (
            ("fsdp", "fp32", False, None, 1e-4), ("fsdp", "fp32 + grad_checkpoint", True, None, 1e-4),
            ("fsdp", "bf16 + grad_checkpoint", True, torch.bfloat16, 1e-2),
            ("tp", "fp32", False, None, 1e-4), ("tp", "bf16", False, torch.bfloat16, 1e-2),
            ("tp-sp", "fp32", False, None, 1e-4), ("tp-sp", "bf16", False, torch.bfloat16, 1e-2)):
        (l0, w0, _), (l1, w1, counts) = train(form, ckpt, compute, False), train(form, ckpt, compute, True)
        loss_err = max_over_ranks(((l1 - l0).norm() / l0.norm()).item())
        w_err = max_over_ranks(max(((w1[k] - w0[k]).norm() / w0[k].norm().clamp(min=1e-12)).item() for k in w0))
        ok = loss_err <= tol and w_err <= tol and counts[0] > 0 and counts[-1] == counts[0]
        say(f"  check-compile {form} {name} ({shape['n_layer']} layers, width {shape['n_embd']}, {args.steps} steps): "
            f"loss rel err {loss_err:.2e}, worst weight rel err {w_err:.2e} (tol {tol:g}); graphs after each step "
            f"{counts}: {'OK' if ok else 'FAILED'}")
        rows.append({"run": f"check-compile {form} {name}", "loss_rel_err": loss_err, "weight_rel_err": w_err,
                     "graphs": counts, "ok": ok})
    return rows


def sync():
    if cuda:
        torch.cuda.synchronize(device)


def max_over_ranks(v):
    t = torch.tensor([v], dtype=torch.float64, device=device)
    if world > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


say(f"# bench_parallel {args.mode} | {torch.cuda.get_device_name(device) if cuda else 'cpu'} x {world} | "
    f"torch {torch.__version__} | {time.strftime('%Y-%m-%d %H:%M')}")
if args.mode == "speed":
    rows = [measure(name, SHAPES[args.shape], ROWS[name]) for name in args.runs.split(",")]
    by = {r["run"]: r.get("tokens_per_s") for r in rows}
    for a, b in (("ours-fsdp", "torch-fsdp2"), ("ours-fsdp-compiled", "torch-fsdp2-compiled"),
                 ("ours-fsdp-compiled", "ours-fsdp"), ("ours-dp", "torch-ddp"), ("ours-tp", "ours-fsdp"),
                 ("ours-tp-compiled", "ours-fsdp-compiled"), ("ours-tp-sp-compiled", "ours-fsdp-compiled")):
        if by.get(a) and by.get(b):
            say(f"  {a} / {b}: {by[a] / by[b]:.3f}x tokens/s")
elif args.mode == "moe":
    shape = MOE_SHAPES[args.shape]
    rows = [measure("moe-dp", shape, moe_wrap(grid)), measure("moe-ep", shape, moe_wrap(ep_grid)),
            measure("moe-ep-cap", dict(shape, capacity_factor=1.25), moe_wrap(ep_grid))]
    if cuda:  # on CPU "auto" is the loop already
        rows.append(measure("moe-ep-loop", shape, moe_wrap(ep_grid, "loop")))
        if rows[1].get("tokens_per_s") and rows[3].get("tokens_per_s"):
            say(f"  moe-ep (grouped where available) / moe-ep-loop: "
                f"{rows[1]['tokens_per_s'] / rows[3]['tokens_per_s']:.3f}x tokens/s")
    if cuda:  # (on CPU inductor's compile time would dominate a smoke test)
        rows.append(measure("moe-ep-compiled", shape, moe_wrap(ep_grid, compile_=True)))
    if cuda and rows[1].get("tokens_per_s") and rows[-1].get("tokens_per_s"):
        say(f"  moe-ep-compiled / moe-ep: {rows[-1]['tokens_per_s'] / rows[1]['tokens_per_s']:.3f}x tokens/s "
            f"(loss {rows[-1]['loss']:.4f} vs {rows[1]['loss']:.4f} eager)")
    if rows[0].get("tokens_per_s") and rows[1].get("tokens_per_s"):
        say(f"  moe-ep / moe-dp: {rows[1]['tokens_per_s'] / rows[0]['tokens_per_s']:.3f}x tokens/s "
            f"({rows[0]['active_params'] / 1e9:.2f}B active of {rows[0]['params'] / 1e9:.2f}B parameters)")
elif args.mode == "combo":
    dense, sparse = SHAPES[args.shape], MOE_SHAPES[args.shape]
    rows = [measure("torch-fsdp2", dense, torch_fsdp2), measure("tp2-dp2", dense, combo(tp2_grid, False)),
            measure("tp2-fsdp2", dense, combo(tp2_grid, True)), measure("moe-torch-fsdp2", sparse, torch_fsdp2),
            measure("ep2-dp2", sparse, combo(ep2_grid, False))]
    by = {r["run"]: r.get("tokens_per_s") for r in rows}
    for a, b in (("tp2-dp2", "torch-fsdp2"), ("tp2-fsdp2", "torch-fsdp2"), ("ep2-dp2", "moe-torch-fsdp2")):
        if by.get(a) and by.get(b):
            say(f"  {a} / {b}: {by[a] / by[b]:.3f}x tokens/s (goal >= 0.85x)")
elif args.mode == "check-compile":
    rows = check_compile(SHAPES[args.shape])
else:
    rows = [measure(name, shape, ours_fsdp, cap_gb=args.cap_gb) for name, shape in CAPACITY]
if main and args.json:
    with open(args.json, "w") as f:
        json.dump({"mode": args.mode, "world": world, "batch": args.batch, "rows": rows}, f, indent=1)
parallel.shutdown()
if not all(r.get("ok", True) for r in rows):
    sys.exit(1)
