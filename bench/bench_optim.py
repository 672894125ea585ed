"""Muon vs AdamW, and ZeRO-1: optimizer step time, training step time and memory; loss curves.

    python bench/bench_optim.py step                              # 1 GPU, 124M LLaMA shape, compiled
    torchrun --nproc_per_node=2 bench/bench_optim.py step         # 2 GPUs: DataParallel, with/without ZeRO-1
    python bench/bench_optim.py step --shape=tiny --device=cpu --steps=2 --warmup=1   # smoke test
    python bench/bench_optim.py curves out/adamw out/muon --png=muon_vs_adamw.png    # two pretrain runs
    python bench/bench_optim.py state8 --shape=1b                 # 8-bit AdamW's step: ours, bitsandbytes, torch

step rows (same model, data and batch; bf16 autocast, torch.compile, dp.DataParallel):
adamw (torch.optim.AdamW, fused), muon (muon.Muon: NS in bf16, batched over equal shapes; AdamW
for embeddings/head/norms), and with 2+ GPUs adamw-zero1 / muon-zero1 (optimizer state sharded,
gradients reduced to their owners, parameters all-gathered). Per row: training step time (--accum
micro-steps, sync, clip, step, zero_grad), the optimizer step alone (CUDA events around clip +
opt.step()), peak memory (over the timed steps, less what the row had before) and state bytes per GPU.

state8 rows (the parameters of the shape, fp32, random gradients; the step alone, CUDA-synchronised,
median of --steps after --warmup): torch.optim.AdamW (fused), optim_memory.AdamW8bit eager with
slices of 2^20 and 2^22 elements and compiled (its GPU default), bitsandbytes.optim.AdamW8bit where
installed; and how far the compiled step lands from the eager one after 3 steps from one start.

curves: two pretrain.py runs' train_metrics.jsonl (the first the baseline): the step where the second
first reaches the baseline's final validation loss (interpolated) as a fraction of the baseline's steps,
the largest loss difference at common steps, and both runs' curves in --png (matplotlib).
"""
import argparse
import contextlib
import gc
import json
import os
import sys
import time
from types import SimpleNamespace

import torch
import torch.distributed as dist

# This script lives in bench/ and the modules it imports (model, parallel, ...) in the repo root, one
# folder up: put the root first on sys.path so `python bench/bench_optim.py` works from any folder.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import config
import lifecycle
import logs
import optim
import parallel
from model import ModelConfig, Transformer
from parallelism import dp

LLAMA = dict(pos_emb="rope", norm="rmsnorm", activation="swiglu", tie_embeddings=False)
SHAPES = {"124m": dict(LLAMA, vocab_size=50304, block_size=1024, n_layer=12, n_head=12, n_embd=768),
          "1b": dict(LLAMA, vocab_size=128256, block_size=2048, n_layer=16, n_head=32, n_kv_head=8, n_embd=2048,
                     ffn_hidden=8192, tie_embeddings=True),
          "tiny": dict(LLAMA, vocab_size=512, block_size=64, n_layer=2, n_head=4, n_embd=64)}


def curves(args):
    def read(d):
        rows = [json.loads(line) for line in open(os.path.join(d, "train_metrics.jsonl"))]
        train = [(r["step"], r["loss"]) for r in rows if "loss" in r]
        val = [(r["step"], r["val_loss"]) for r in rows if "val_loss" in r]
        return train, val
    (bt, bv), (ct, cv) = read(args.runs[0]), read(args.runs[1])
    target, n = bv[-1][1], bv[-1][0]
    reach = None
    for (s0, v0), (s1, v1) in zip([(0, float("inf"))] + cv, cv):
        if v1 <= target:  # first evaluation at or below the target: interpolate inside the interval
            reach = s1 if v0 == float("inf") else s0 + (s1 - s0) * (v0 - target) / (v0 - v1)
            break
    name = [os.path.basename(r.rstrip("/")) for r in args.runs]
    for what, a, b in (("train", bt, ct), ("val", bv, cv)):  # equivalence runs: how far apart
        common = sorted(set(dict(a)) & set(dict(b)))
        if common:
            d = max(abs(dict(a)[s] - dict(b)[s]) for s in common)
            print(f"max |{what} loss difference| over {len(common)} common steps: {d:.4f}")
    print(f"{name[0]}: final val loss {target:.4f} at step {n}; {name[1]}: final val loss {cv[-1][1]:.4f}")
    print(f"{name[1]} reaches {target:.4f} at step {reach:.0f} = {reach / n:.3f} of the steps" if reach else
          f"{name[1]} never reaches {target:.4f}")
    if args.png:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(8, 5))
        for (t, v), nm, c in (((bt, bv), name[0], "C0"), ((ct, cv), name[1], "C1")):
            ax.plot(*zip(*t), color=c, alpha=0.35, lw=1, label=f"{nm} train")
            ax.plot(*zip(*v), color=c, marker="o", ms=3, lw=2, label=f"{nm} val")
        ax.axhline(target, color="gray", ls="--", lw=1)
        if reach:
            ax.axvline(reach, color="gray", ls=":", lw=1)
        lo = min(v for _, v in bt + bv + ct + cv)
        ax.set_ylim(lo - 0.05, lo + 2.5)
        ax.set_xlabel("step")
        ax.set_ylabel("loss")
        ax.set_title(f"{name[1]} vs {name[0]}: same data and tokens" +
                     (f"; reaches {name[0]}'s final val loss at {reach / n:.0%} of the steps" if reach else ""))
        ax.legend()
        fig.savefig(args.png, dpi=120, bbox_inches="tight")
        print(f"wrote {args.png}")


def step_rows(args):
    world = int(os.environ.get("WORLD_SIZE", "1"))
    grid = parallel.init(SimpleNamespace(device=args.device, tp=1, ep=1))
    device, cuda = grid.device, grid.device.type == "cuda"
    say = print if grid.is_main else (lambda *a, **k: None)
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = True
    dtype = torch.bfloat16 if cuda else torch.float32
    shape = SHAPES[args.shape]
    T, B = shape["block_size"], args.batch
    peak = logs.peak_tflops(device)

    def sync():
        if cuda:
            torch.cuda.synchronize(device)

    def max_over_ranks(v):
        t = torch.tensor([float(v)], dtype=torch.float64, device=device)
        if world > 1:
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.item()

    def measure(name, optimizer, zero1):
        torch._dynamo.reset()  # compiled graphs of the previous row hold its parameters: free them
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
        # what earlier rows left behind (NCCL keeps finished work's buffers a while) is not this row's
        base = torch.cuda.memory_allocated(device) if cuda else 0
        torch.manual_seed(0)
        with torch.device(device):
            raw = Transformer(ModelConfig(**shape))
        cfg = SimpleNamespace(**{**config.defaults(lifecycle.TRAIN), "optimizer": optimizer, "zero1": zero1,
                                 "lr": 1e-3})
        opt = optim.build_optimizer(raw, cfg, grid)
        model = dp.DataParallel(raw, grid, owner=getattr(opt, "grad_owner", None))
        fwd = torch.compile(raw) if args.compile else raw
        g = torch.Generator(device=device).manual_seed(1 + grid.rank)
        data = [torch.randint(0, shape["vocab_size"], (B, T + 1), device=device, generator=g) for _ in range(3)]
        ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) if cuda else None
              for _ in range(args.steps)]

        def step(i, e=None):
            for k in range(args.accum):
                d = data[(i + k) % len(data)]
                with model.no_sync() if k < args.accum - 1 else contextlib.nullcontext():
                    with torch.autocast(device.type, dtype=dtype, enabled=cuda):
                        loss = fwd(d[:, :-1], d[:, 1:]) / args.accum
                    loss.backward()
            model.finish()
            t0 = e[0].record() if e else time.perf_counter()
            if getattr(opt, "grad_owner", None):
                parallel.clip_grad_norm_(raw, 1.0, grid, owner=opt.grad_owner)
            else:
                torch.nn.utils.clip_grad_norm_(raw.parameters(), 1.0)
            opt.step()
            t1 = e[1].record() if e else time.perf_counter()
            model.zero_grad(set_to_none=True)
            return loss, (None if e else t1 - t0)

        for i in range(args.warmup):
            step(i)
        sync()
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        t0, cpu_opt = time.perf_counter(), 0.0
        for i in range(args.steps):
            loss, dt_opt = step(i, ev[i])
            cpu_opt += dt_opt or 0.0
        sync()
        dt = max_over_ranks(time.perf_counter() - t0) / args.steps
        opt_s = sum(a.elapsed_time(b) / 1e3 for a, b in ev) / args.steps if cuda else cpu_opt / args.steps
        state = sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values() if torch.is_tensor(v))
        tok_s = B * T * args.accum * world / dt
        row = dict(run=name, step_ms=1e3 * dt, opt_ms=1e3 * max_over_ranks(opt_s), tokens_per_s=tok_s,
                   mfu=tok_s * raw.flops_per_token(T) / (peak * 1e12 * world) if peak else None,
                   peak_mem_gb=max_over_ranks((torch.cuda.max_memory_allocated(device) - base) / 2**30) if cuda else None,
                   state_gb=max_over_ranks(state / 2**30), loss=loss.item())
        say(f"  {name}: {row['step_ms']:.1f} ms/step | optimizer {row['opt_ms']:.2f} ms | {tok_s:,.0f} tokens/s"
            f" | MFU {100 * (row['mfu'] or 0):.1f}% | peak {row['peak_mem_gb'] or 0:.2f} GiB"
            f" | optimizer state {row['state_gb']:.3f} GiB | loss {row['loss']:.3f}")
        model = opt = raw = fwd = None  # (freed before the next row; not del: step() closes over them)
        return row

    say(f"# bench_optim step | {torch.cuda.get_device_name(device) if cuda else 'cpu'} x {world} | "
        f"{args.shape}, batch {B} x {T} per GPU x {args.accum} micro-steps | torch {torch.__version__} | {time.strftime('%Y-%m-%d %H:%M')}")
    runs = [("adamw", "adamw", False), ("muon", "muon", False)]
    if world > 1:
        runs += [("adamw-zero1", "adamw", True), ("muon-zero1", "muon", True)]
    rows = [measure(*r) for r in runs]
    by = {r["run"]: r for r in rows}
    for a, b in (("muon", "adamw"), ("muon-zero1", "adamw"), ("adamw-zero1", "adamw"), ("muon-zero1", "muon")):
        if a in by and b in by:
            say(f"  {a} / {b}: step time {by[a]['step_ms'] / by[b]['step_ms']:.3f}x, optimizer "
                f"{by[a]['opt_ms'] / by[b]['opt_ms']:.2f}x, peak memory {by[a]['peak_mem_gb'] or 0:.2f} vs "
                f"{by[b]['peak_mem_gb'] or 0:.2f} GiB, state {by[a]['state_gb']:.3f} vs {by[b]['state_gb']:.3f} GiB")
    if grid.is_main and args.json:
        with open(args.json, "w") as f:
            json.dump({"world": world, "batch": B, "accum": args.accum, "shape": args.shape, "rows": rows}, f, indent=1)
    parallel.shutdown()


def state8(args):
    """8-bit AdamW's step against torch's fused AdamW and bitsandbytes' (the module docstring)."""
    from memory import materialize, optim_memory
    dev = torch.device(args.device)
    torch.manual_seed(0)
    model = materialize.build(ModelConfig(**SHAPES[args.shape]), dev, torch.float32, init=True)
    params = list(model.parameters())
    start = [p.detach().clone() for p in params]
    grads = [torch.randn_like(p) * 1e-3 for p in params]
    n = sum(p.numel() for p in params)

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize()

    def reset():
        with torch.no_grad():
            for p, s0, g in zip(params, start, grads):
                p.copy_(s0)
                p.grad = g

    def timed(opt):
        reset()
        times = []
        for i in range(args.warmup + args.steps):
            sync()
            t0 = time.perf_counter()
            opt.step()
            sync()
            times.append(time.perf_counter() - t0)
        return sorted(times[args.warmup:])[args.steps // 2]

    kw = dict(lr=1e-3, weight_decay=0.01)
    makers = [("torch AdamW, fused", lambda: torch.optim.AdamW(params, fused=dev.type == "cuda", **kw)),
              ("ours 8-bit, eager, slices of 2^20", lambda: optim_memory.AdamW8bit(params, chunk=1 << 20, compiled=False, **kw)),
              ("ours 8-bit, eager, slices of 2^22", lambda: optim_memory.AdamW8bit(params, chunk=1 << 22, compiled=False, **kw)),
              ("ours 8-bit, compiled, slices of 2^22", lambda: optim_memory.AdamW8bit(params, compiled=dev.type == "cuda", **kw))]
    try:
        import bitsandbytes
        makers.append((f"bitsandbytes {bitsandbytes.__version__} AdamW8bit", lambda: bitsandbytes.optim.AdamW8bit(params, **kw)))
    except ImportError as e:
        print(f"bitsandbytes: not installed ({e})")
    rows = []
    print(f"# bench_optim state8 | {torch.cuda.get_device_name(dev) if dev.type == 'cuda' else 'cpu'} | {args.shape}: "
          f"{n / 1e9:.3f}B parameters | torch {torch.__version__} | {time.strftime('%Y-%m-%d %H:%M')}")
    for name, make in makers:
        try:
            opt = make()
            row = {"row": name, "step_s": round(timed(opt), 5)}
        except Exception as e:  # a peer that cannot run here is a result too
            row = {"row": name, "error": f"{type(e).__name__}: {e}"[:300]}
        opt = None
        rows.append(row)
        print(f"| {name:<40} | " + (f"{row['step_s'] * 1e3:.1f} ms a step" if "step_s" in row else row["error"]), flush=True)
    after = []
    for compiled in (False, True):  # 3 steps from one start: how far the fused step lands from the eager one
        reset()
        opt = optim_memory.AdamW8bit(params, compiled=compiled, **kw)
        for _ in range(3):
            opt.step()
        after.append([p.detach().clone() for p in params])
    moved = max((a - s0).abs().max().item() for a, s0 in zip(after[0], start))
    apart = max((a - b).abs().max().item() for a, b in zip(*after))
    print(f"compiled vs eager after 3 steps: largest difference {apart:.3g}, largest change {moved:.3g}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"shape": args.shape, "params": n, "rows": rows, "compiled_vs_eager": apart, "largest_change": moved},
                      f, indent=1)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("mode", choices=["step", "curves", "state8"])
    p.add_argument("runs", nargs="*", help="curves: two pretrain out_dirs, the baseline first")
    p.add_argument("--png", default="")
    p.add_argument("--shape", choices=list(SHAPES), default="124m")
    p.add_argument("--batch", type=int, default=16, help="sequences per GPU")
    p.add_argument("--accum", type=int, default=1, help="gradient-accumulation micro-steps per optimizer step")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=8)
    p.add_argument("--compile", type=int, default=1)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--json", default="")
    args = p.parse_args()
    if args.mode == "curves" and len(args.runs) != 2:
        p.error("curves needs two run folders (the baseline first)")
    {"curves": curves, "step": step_rows, "state8": state8}[args.mode](args)
