"""Training throughput, MFU and peak memory, side by side with the peers a user would pick.

    python bench/bench.py single                          # 1 GPU: ours vs HF LlamaForCausalLM
    torchrun --nproc_per_node=2 bench/bench.py dp         # 2 GPUs: our DataParallel vs torch DDP
    python bench/bench.py single --shape=tiny --device=cpu --steps=3 --warmup=1   # smoke test, seconds

Every row times full training steps (forward + backward + fused AdamW + zero_grad), bf16 autocast
over fp32 master weights for ours and the peers alike, micro batch --batch of T tokens, random
tokens, no data loading; warm-up steps (compilation) untimed, timed steps bracketed by syncs.
tokens/s = B*T*steps*GPUs / seconds; MFU = tokens/s * our model's flops_per_token(T) / (peak*GPUs)
for every row (the HF peer has our exact shape, asserted by parameter count); peak memory is
torch.cuda.max_memory_allocated, reset per row (dp mode: the largest over the ranks).

single rows: ours eager / torch.compile(model), HF LlamaForCausalLM eager / compiled (SDPA,
use_cache=False, labels=x). dp rows (torchrun): ours-1gpu (each rank alone, no communication:
the scaling baseline, same run), ours-dp (dp.DataParallel around the model, compiled as one
graph as pretrain.py does: per-block graphs are no faster, BENCHMARKS.md), torch-ddp (DDP, 25 MB
buckets, gradient_as_bucket_view, then torch.compile: PyTorch's recommended order). A failing row prints
its error and the table goes on; a failure on one rank only leaves the other in a collective.
"""
import argparse
import contextlib
import datetime
import gc
import importlib.metadata
import importlib.util
import json
import math
import os
import platform
import subprocess
import sys
import time
import traceback
from dataclasses import asdict
from types import SimpleNamespace

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run as a script in bench/
import logs  # noqa: E402
import optim  # noqa: E402
import parallel  # noqa: E402
from model import ModelConfig, Transformer  # noqa: E402
from parallelism import dp  # noqa: E402

# LLaMA style, so HF's LlamaForCausalLM has the same shape: RoPE, RMSNorm, SwiGLU, no biases, untied head
LLAMA = dict(pos_emb="rope", norm="rmsnorm", activation="swiglu", bias=False, tie_embeddings=False,
             qk_norm=False, n_kv_head=0, ffn_hidden=0, dropout=0.0, norm_eps=1e-5, rope_theta=10000.0)
SHAPES = {"124m": dict(LLAMA, vocab_size=50304, block_size=1024, n_layer=12, n_head=12, n_embd=768),
          "1b": dict(LLAMA, vocab_size=50304, block_size=2048, n_layer=16, n_head=16, n_embd=2048, n_kv_head=8,
                     ffn_hidden=8192),  # bench/bench_parallel.py's ~1B shape (1.21B parameters)
          "tiny": dict(LLAMA, vocab_size=512, block_size=64, n_layer=2, n_head=4, n_embd=64)}
GOALS = {"mfu": 0.45, "vs_hf": 1.2, "dp_scaling": 1.9, "vs_ddp": 0.98}

# ---------------------------------------------------------------------------- arguments
p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
p.add_argument("mode", choices=["single", "dp"])
p.add_argument("--shape", choices=list(SHAPES), default="124m")
p.add_argument("--batch", type=int, default=16, help="micro batch per GPU (sequences)")
p.add_argument("--seq_len", type=int, default=0, help="T (and block_size); 0 = the shape's block_size")
p.add_argument("--steps", type=int, default=30, help="timed steps per row")
p.add_argument("--accum", type=int, default=1, help="micro-steps of --batch per optimizer step (one sync)")
p.add_argument("--warmup", type=int, default=10, help="untimed steps per row (compilation happens here)")
p.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
p.add_argument("--runs", default="", help="comma-separated subset of the mode's rows (see the docstring)")
p.add_argument("--dtype", choices=["auto", "bfloat16", "float32"], default="auto",
               help="autocast compute dtype; auto: bfloat16 on GPU, float32 on CPU (CPU bf16 is ~10x slower)")
p.add_argument("--compile", type=int, default=1, help="dp mode: compile the model (0 = eager)")
p.add_argument("--ddp_compile", choices=["outer", "inner"], default="outer",
               help="outer: torch.compile(DDP(model)) (DDPOptimizer); inner: DDP(torch.compile(model))")
p.add_argument("--bucket_mb", type=float, default=25.0, help="gradient bucket size, ours and DDP")
p.add_argument("--grad_reduce_dtype", choices=["float32", "bfloat16"], default="float32",
               help="dp: gradients travel in this dtype, ours and DDP (bf16_compress_hook)")
p.add_argument("--fp32_residual", type=int, default=1,
               help="0: our residual stream in bf16 (ModelConfig.fp32_residual)")
p.add_argument("--peak_tflops", type=float, default=0.0, help="override the per-GPU peak for MFU")
p.add_argument("--seed", type=int, default=0)
p.add_argument("--commit", default="", help="git commit to record (default: git rev-parse)")
p.add_argument("--json", default="", help="write every number here")
args = p.parse_args()
RUNS = {"single": ["ours-eager", "ours-compiled", "hf-eager", "hf-compiled"],
        "dp": ["ours-1gpu", "ours-dp", "torch-ddp"]}[args.mode]
runs = [r.strip() for r in args.runs.split(",") if r.strip()] or RUNS
if args.steps < 1 or args.warmup < 0 or args.batch < 1 or args.accum < 1:
    p.error("need --steps >= 1, --warmup >= 0, --batch >= 1, --accum >= 1")
for r in runs:
    if r not in RUNS:
        p.error(f"--runs: unknown row {r!r} for mode {args.mode}; choose from {', '.join(RUNS)}")

# ---------------------------------------------------------------------------- setup
grid = parallel.init(SimpleNamespace(device=args.device, tp=1, ep=1))
if args.mode == "dp" and grid.world < 2:
    p.error("dp mode needs several processes: torchrun --nproc_per_node=2 bench/bench.py dp")
if args.mode == "single" and grid.world > 1:
    p.error("single mode is one process: python bench/bench.py single")
device, main = grid.device, grid.is_main
say = print if main else (lambda *a, **k: None)
cuda = device.type == "cuda"
if cuda:
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
# bf16 autocast over fp32 weights, gradients and optimizer state (as pretrain.py)
dtype = {"auto": torch.bfloat16 if cuda else torch.float32,
         "bfloat16": torch.bfloat16, "float32": torch.float32}[args.dtype]
autocast = lambda: torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)
mcfg = ModelConfig(**{**SHAPES[args.shape], **({"block_size": args.seq_len} if args.seq_len else {}),
                      "fp32_residual": bool(args.fp32_residual)})  # the HF peer keeps its own (fp32)
T, B = mcfg.block_size, args.batch
opt_cfg = SimpleNamespace(optimizer="adamw", zero1=False, adamw_state="fp32", optimizer_in_backward=False, lr=3e-4, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
peak = logs.peak_tflops(device, args.peak_tflops)  # TFLOP/s per GPU; None on CPU / unknown GPU
with torch.device("meta"):
    flops_per_token = Transformer(mcfg).flops_per_token(T)  # counts shapes only: no memory


def commit():
    if args.commit:
        return args.commit
    try:
        here = os.path.dirname(os.path.abspath(__file__))
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here, capture_output=True,
                              text=True, timeout=10, check=True).stdout.strip() or "unknown"
    except Exception:
        return "unknown"


meta = {"mode": args.mode, "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "commit": commit(), "device": torch.cuda.get_device_name(device) if cuda else platform.processor() or "cpu",
        "gpus": grid.world if cuda else 0, "processes": grid.world,
        "dtype": str(dtype).replace("torch.", ""), "torch": torch.__version__,
        "transformers": importlib.metadata.version("transformers")
        if importlib.util.find_spec("transformers") else None, "python": platform.python_version(), "shape": args.shape,
        "model": asdict(mcfg), "batch_per_gpu": B, "seq_len": T, "steps": args.steps,
        "warmup": args.warmup, "accum": args.accum, "flops_per_token": flops_per_token, "peak_tflops_per_gpu": peak,
        "bucket_mb": args.bucket_mb, "grad_reduce_dtype": args.grad_reduce_dtype}
say(f"# bench {args.mode} | {meta['device']} x {grid.world} | torch {meta['torch']} | "
    f"transformers {meta['transformers']} | commit {meta['commit']} | {meta['date']}")
say(f"# shape {args.shape}: {mcfg.n_layer} layers, width {mcfg.n_embd}, {mcfg.n_head} heads, "
    f"ffn {mcfg.hidden}, vocab {mcfg.padded_vocab}, T={T} | micro batch {B} per GPU x {args.accum} | {meta['dtype']} | "
    f"{args.warmup} warm-up + {args.steps} timed steps | {flops_per_token / 1e6:.1f} MFLOPs/token | "
    f"peak {peak or 'n/a'} TFLOP/s per GPU")


# ---------------------------------------------------------------------------- models
class SkipRow(Exception):
    """A row that cannot run here (a missing optional package): reported, not an error."""


def build_ours():
    torch.manual_seed(args.seed)  # same seed everywhere: identical weights on every rank
    with torch.device(device):  # initialise in place on the GPU: no host-side init, no copy
        model = Transformer(mcfg)
    return model.to(device)


def build_hf():
    """HF LlamaForCausalLM with exactly our shape, SDPA attention, no KV cache (training)."""
    try:
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError:
        raise SkipRow("transformers is not installed (pip install transformers)")
    hcfg = LlamaConfig(
        vocab_size=mcfg.padded_vocab, hidden_size=mcfg.n_embd, intermediate_size=mcfg.hidden,
        num_hidden_layers=mcfg.n_layer, num_attention_heads=mcfg.n_head, num_key_value_heads=mcfg.kv_heads,
        max_position_embeddings=mcfg.block_size, rms_norm_eps=mcfg.norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": mcfg.rope_theta},
        tie_word_embeddings=mcfg.tie_embeddings, attention_bias=mcfg.bias, mlp_bias=mcfg.bias,
        initializer_range=mcfg.init_std, use_cache=False, attn_implementation="sdpa")
    torch.manual_seed(args.seed)
    with torch.device(device):
        model = LlamaForCausalLM(hcfg)
    model = model.to(device=device, dtype=torch.float32)  # fp32 master weights, as ours
    model.train()
    hf_params_match(model)
    return model


def hf_params_match(hf):
    """Same shape <=> same parameter count (HF gets our padded vocabulary, so normally exact)."""
    with torch.device("meta"):
        ours = Transformer(mcfg).num_params()
    theirs = sum(p.numel() for p in hf.parameters())
    slack = 2 * (mcfg.padded_vocab - mcfg.vocab_size) * mcfg.n_embd  # embedding + head padding rows
    say(f"  parameters: ours {ours:,} | HF {theirs:,}")
    assert abs(ours - theirs) <= slack, f"HF has {theirs:,} parameters, ours {ours:,}: an unfair comparison"


# ---------------------------------------------------------------------------- timing
def sync():
    if cuda:
        torch.cuda.synchronize(device)


def reduce_(value, op):
    """Max/min of a number over the ranks (one process: the number itself)."""
    t = torch.tensor([value], dtype=torch.float64, device=device)
    if grid.world > 1:
        dist.all_reduce(t, op=op)
    return t.item()


def free():
    gc.collect()
    torch._dynamo.reset()  # drop compiled graphs (and what they hold) of the previous row
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def measure(name, build, n_gpus, peer=None, min_time=False):
    """One row: its numbers, or why it has none. Memory is freed before each row, and the
    row's locals (model, optimizer, compiled graphs) die with time_row's frame."""
    row = {"run": name, "peer": peer, "gpus": n_gpus}
    say(f"\n## {name}")
    try:
        free()
        time_row(row, build, n_gpus, min_time)
    except SkipRow as e:
        row["skipped"] = str(e)
        say(f"  skipped: {e}")
    except Exception as e:  # one broken row (a compile error, OOM) must not lose the others
        row["error"] = f"{type(e).__name__}: {e}"
        say(traceback.format_exc() if main else "", end="")
        print(f"  [rank {grid.rank}] {name} failed: {row['error'][:500]}")
    return row


def time_row(row, build, n_gpus, min_time):
    """build() -> (model, forward(x, y) -> loss[, finish, zero_grad]); warm up, then time
    args.steps training steps bracketed by device synchronisation."""
    t_build = time.perf_counter()
    model, forward, *rest = build()
    finish, zero_grad, no_sync = (rest + [None] * 3)[:3]
    finish, no_sync = finish or (lambda: None), no_sync or contextlib.nullcontext
    zero_grad = zero_grad or (lambda: model.zero_grad(set_to_none=True))
    row["params"] = sum(p.numel() for p in model.parameters())
    optimizer = optim.build_optimizer(model, opt_cfg)  # fused AdamW on CUDA
    g = torch.Generator(device=device).manual_seed(args.seed + 1 + grid.rank)  # distinct data per rank
    batches = [(torch.randint(0, mcfg.vocab_size, (B, T), device=device, generator=g),
                torch.randint(0, mcfg.vocab_size, (B, T), device=device, generator=g)) for _ in range(4)]

    def step(i):  # --accum micro-steps; data parallel communicates on the last one only
        for k in range(args.accum):
            x, y = batches[(i + k) % len(batches)]
            # backward inside no_sync too: our DataParallel decides in its gradient hooks (DDP at forward)
            with no_sync() if k < args.accum - 1 else contextlib.nullcontext():
                with autocast():
                    loss = forward(x, y) / args.accum
                loss.backward()
        finish()  # data parallel: wait for the gradient all-reduce (no-op otherwise)
        optimizer.step()
        zero_grad()
        return loss

    t0 = time.perf_counter()
    for i in range(args.warmup):
        step(i)
    sync()
    row["build_s"], row["warmup_s"] = t0 - t_build, time.perf_counter() - t0
    say(f"  params {row['params']:,} | built in {row['build_s']:.1f}s | warm-up ({args.warmup} steps, "
        f"incl. compilation) {row['warmup_s']:.1f}s")
    if grid.world > 1:
        dist.barrier()
    sync()
    t0 = time.perf_counter()
    for i in range(args.steps):
        loss = step(args.warmup + i)
    sync()
    dt = time.perf_counter() - t0
    # data-parallel rows run in lockstep: the slowest rank's time is the job's; the 1-GPU
    # baseline (independent ranks) takes the fastest, which can only lower the scaling ratio
    if grid.world > 1:  # per-rank times: a slow GPU shows up here
        row["rank_step_ms"] = [reduce_(1e3 * dt / args.steps if grid.rank == r else 0.0, dist.ReduceOp.MAX)
                               for r in range(grid.world)]
        say(f"  per-rank ms/step: {', '.join(f'{t:.1f}' for t in row['rank_step_ms'])}")
    dt = reduce_(dt, dist.ReduceOp.MIN if min_time else dist.ReduceOp.MAX)
    row["loss"] = loss.item()  # last step's loss (this rank's batch): ~ln(vocab) early on
    if not math.isfinite(row["loss"]):
        raise FloatingPointError(f"loss is {row['loss']}")
    tok_s = B * T * args.accum * args.steps * n_gpus / dt
    row.update(tokens_per_s=tok_s, step_ms=1e3 * dt / args.steps,
               mfu=tok_s * flops_per_token / (peak * 1e12 * n_gpus) if peak else None,
               peak_mem_gb=reduce_(torch.cuda.max_memory_allocated(device) / 1e9, dist.ReduceOp.MAX)
               if cuda else None)
    mfu = "n/a" if row["mfu"] is None else f"{100 * row['mfu']:.1f}%"
    say(f"  {tok_s:,.0f} tokens/s | {row['step_ms']:.1f} ms/step | MFU {mfu} | loss {row['loss']:.3f}")


# ---------------------------------------------------------------------------- rows
# a row's build() -> (model, forward(x, y) -> loss[, finish, zero_grad]); the optimizer gets
# model's parameters; without finish/zero_grad: nothing / model.zero_grad(set_to_none=True)
def ours_row(compile_):
    """compile_: False | True (torch.compile(model))."""
    def build():
        raw = build_ours()
        return raw, (torch.compile(raw) if compile_ else raw)
    return build


def hf_row(compile_):
    def build():
        hf = build_hf()
        fwd = torch.compile(hf) if compile_ else hf
        # HF shifts labels inside: logits for all T positions (the same work), loss over T-1
        return hf, lambda x, y: fwd(input_ids=x, labels=x).loss
    return build


def ours_dp():
    """Gradient hooks live on the parameters, so the inner module is compiled (one graph)."""
    def build():
        raw = build_ours()
        wrapper = dp.DataParallel(raw, grid, args.bucket_mb, reduce_dtype=getattr(torch, args.grad_reduce_dtype))
        fwd = torch.compile(raw) if args.compile else raw
        return raw, fwd, wrapper.finish, lambda: wrapper.zero_grad(set_to_none=True), wrapper.no_sync
    return build


def torch_ddp():
    from torch.nn.parallel import DistributedDataParallel as DDP
    raw = build_ours()
    kw = dict(device_ids=[device.index] if cuda else None, bucket_cap_mb=args.bucket_mb,
              gradient_as_bucket_view=True)
    ddp = DDP(torch.compile(raw) if args.compile and args.ddp_compile == "inner" else raw, **kw)
    if args.grad_reduce_dtype == "bfloat16":
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import bf16_compress_hook
        ddp.register_comm_hook(None, bf16_compress_hook)
    fwd = torch.compile(ddp) if args.compile and args.ddp_compile == "outer" else ddp
    return raw, fwd, None, None, ddp.no_sync


BUILDS = {"ours-eager": ours_row(False), "ours-compiled": ours_row(True), "hf-eager": hf_row(False),
          "hf-compiled": hf_row(True), "ours-1gpu": ours_row(bool(args.compile)), "ours-dp": ours_dp(),
          "torch-ddp": torch_ddp}
PEERS = {"ours-eager": "hf-eager", "ours-compiled": "hf-compiled", "ours-dp": "torch-ddp"}
ONE_GPU = ("ours-eager", "ours-compiled", "hf-eager", "hf-compiled", "ours-1gpu")


rows = [measure(name, BUILDS[name], 1 if name in ONE_GPU else grid.world,
                peer=PEERS.get(name), min_time=name == "ours-1gpu") for name in runs]
free()

# ---------------------------------------------------------------------------- report
by = {r["run"]: r for r in rows}


def ratio(a, b):
    ra, rb = by.get(a, {}), by.get(b, {})
    if ra.get("tokens_per_s") and rb.get("tokens_per_s"):
        return ra["tokens_per_s"] / rb["tokens_per_s"]
    return None


for r in rows:
    r["ratio_vs_peer"] = ratio(r["run"], r["peer"]) if r["peer"] else None

goals = {}
if args.mode == "single":
    hf_best = max((by[k] for k in ("hf-eager", "hf-compiled") if by.get(k, {}).get("tokens_per_s")),
                  key=lambda r: r["tokens_per_s"], default=None)
    if hf_best:
        goals["ours_compiled_vs_best_hf"] = (ratio("ours-compiled", hf_best["run"]), GOALS["vs_hf"], hf_best["run"])
    if by.get("ours-compiled", {}).get("mfu") is not None:
        goals["ours_compiled_mfu"] = (by["ours-compiled"]["mfu"], GOALS["mfu"], None)
else:
    goals["ours_dp_scaling_vs_1gpu"] = (ratio("ours-dp", "ours-1gpu"), GOALS["dp_scaling"], "ours-1gpu")
    goals["ours_dp_vs_torch_ddp"] = (ratio("ours-dp", "torch-ddp"), GOALS["vs_ddp"], "torch-ddp")
goals = {k: {"value": v, "goal": g, "versus": vs, "met": v >= g}
         for k, (v, g, vs) in goals.items() if v is not None}


cell = lambda v, fmt: "n/a" if v is None else format(v, fmt)
prec = (f"{meta['dtype']} autocast over fp32 weights" if dtype != torch.float32 else "fp32") + \
    ("" if mcfg.fp32_residual else ", our residual stream bf16")
say(f"\n{args.mode}: {args.shape} shape, micro batch {B} x T={T} per GPU, {prec}, AdamW, {meta['device']} "
    f"x {grid.world}, torch {meta['torch']}, transformers {meta['transformers']}, commit {meta['commit']}, "
    f"{meta['date']}\n")
say("| run | tokens/s | MFU % | peak mem GB | ratio vs peer |\n|---|---:|---:|---:|---:|")
for r in rows:
    if "tokens_per_s" not in r:
        say(f"| {r['run']} | {r.get('skipped') or 'failed: ' + r.get('error', '?')[:80]} | | | |")
        continue
    rat = f"{r['ratio_vs_peer']:.2f}x vs {r['peer']}" if r["ratio_vs_peer"] else ""
    unit = ("GPU" if cuda else "proc") + ("s" if r["gpus"] > 1 else "")
    say(f"| {r['run']} ({r['gpus']} {unit}) | {r['tokens_per_s']:,.0f} | "
        f"{cell(r['mfu'] and 100 * r['mfu'], '.1f')} | {cell(r['peak_mem_gb'], '.2f')} | {rat} |")
if goals:
    say("\ngoals:")
for k, g in goals.items():
    val = (f"{100 * g['value']:.1f}% (goal >= {100 * g['goal']:.0f}%)" if k.endswith("mfu")
           else f"{g['value']:.3f}x vs {g['versus']} (goal >= {g['goal']}x)")
    say(f"  {k}: {val} {'MET' if g['met'] else 'NOT MET'}")
if main and args.json:
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump({**meta, "rows": rows, "goals": goals}, f, indent=2)
    say(f"\nwrote {args.json}")
parallel.shutdown()
