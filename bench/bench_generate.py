"""Generation throughput: our decoders vs transformers' generate, same weights, one run (issue 16).

    python bench/bench_generate.py --json=bench/results/generate/generate_h200.json   # one GPU, < 9 min
    python bench/bench_generate.py --device=cpu --points=tiny:3 --profile=             # smoke test, seconds

Every row generates --new tokens (256) after --prompt random tokens (64) for B prompts, sampling
with temperature 1 and top-k 50, no stop tokens, bf16 weights (fp32 on CPU), random init (the
124m and 1b LLaMA shapes of bench.py and bench/bench_parallel.py). tokens/s = B * new / seconds of
one whole call (prefill, capture and compilation guards included), timed after one untimed
warm-up call of the same shape (compilation happens there). The rows are ROWS' (below); a row
"name:variant" runs the ours-* row with decode() settings VARIANTS[variant] (bare: "all", today's
defaults). "before" is the decoder BENCHMARKS.md measured first; the table's "vs before" column
divides by the row of the same name with variant "before" at that point.

--rows run at every --points entry (shape:batch, in priority order); the --explore rows (the
settings one by one) at the first point, where the list says "explore"; the --profile rows of the
first point run once more, uncaptured, under torch.profiler: GPU kernels per decode step, GPU time
per step and the kernels that take it (CPU: top-level ATen ops per step; the JSON lists every one).
Each row also reports `of_bound`, tokens/s over the memory-bandwidth limit (bound()), and the run
starts with checks() (correctness of the fast paths against the eager one). Rows run in priority
order until --budget_s has passed; later ones are listed as skipped. A failing row prints its error
and the table goes on.
"""
import argparse
import copy
import datetime
import functools
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from types import SimpleNamespace

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity

# the modules live one folder up (the repository root)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import config  # noqa: E402
import generate  # noqa: E402
import hf  # noqa: E402
import lifecycle  # noqa: E402
import lora  # noqa: E402
import parallel  # noqa: E402
from model import ModelConfig, Transformer  # noqa: E402

LLAMA = dict(vocab_size=50304, pos_emb="rope", norm="rmsnorm", activation="swiglu", bias=False,
             tie_embeddings=False, dropout=0.0)
SHAPES = {  # name -> (model config, prompt length, new tokens)
    "124m": (dict(LLAMA, block_size=1024, n_layer=12, n_head=12, n_embd=768), 64, 256),
    "1b": (dict(LLAMA, block_size=2048, n_layer=16, n_embd=2048, n_head=16, n_kv_head=8, ffn_hidden=8192), 64, 256),
    "tiny": (dict(LLAMA, vocab_size=512, block_size=64, n_layer=2, n_head=4, n_kv_head=2, n_embd=64), 8, 16),
}
ROWS = {  # name -> what it runs
    "ours-eager": "generate.generate: the eager KV-cache loop (the reference path)",
    "ours-static": "generate.decode(graph=False): static cache, the step run uncaptured",
    "ours-graph": "generate.decode: the step captured as a CUDA graph by hand and replayed",
    "ours-compile": "generate.decode(compile=True): torch.compile'd step, then captured",
    "ours-lora": "ours-compile on the model with LoRA adapters (r=16, every linear) applied on the fly",
    "ours-lora-merged": "the same adapters merged into the weights first (lora.merge)",
    "hf-dynamic": "transformers generate, its default dynamic cache (SDPA)",
    "hf-static": "transformers generate, cache_implementation='static' (its own auto-compile)",
}
BEFORE = dict(bucket=0, fuse_mlp=False, candidates=False)
VARIANTS = {  # decode() keyword arguments; "compile": torch.compile's (compile rows only); "keep": keep={}
    "before": BEFORE,                               # the first measured decoder
    "bucket": dict(BEFORE, bucket=64),              # + attention over KV-length buckets of 64 slots
    "fuse_mlp": dict(BEFORE, fuse_mlp=True),        # + one gate|up matmul
    "candidates": dict(BEFORE, candidates=True),    # + the sampling race among the top-k only
    "all": {},                                      # today's defaults: all three
    "keep": dict(keep=True),                        # + the warm-up call's graphs replayed (GRPO's steady state)
    "bucket32": dict(bucket=32, keep=True),
    "bucket128": dict(bucket=128, keep=True),
    "math": dict(attention="math", keep=True),      # SDPA as matmuls + softmax (compile fuses them)
    "cudnn": dict(attention="cudnn", keep=True),
    "flex": dict(attention="flex", keep=True),      # flex_attention: split-KV decoding kernel (Triton)
    "triton": dict(attention="triton", keep=True),  # fused.decode_attention: our split-KV kernel (Triton)
    "sdpa": dict(attention="sdpa", keep=True),      # SDPA picks its kernel (the default before fused.decode_attention)
    "flex-static": dict(attention="flex", compile={"dynamic": False}, keep=True),
    "static": dict(compile={"dynamic": False}, keep=True),  # one specialised compile per bucket
    "autotune": dict(compile={"mode": "max-autotune-no-cudagraphs"}, keep=True),  # Triton matmuls, epilogues fused
}
EXPLORE = ("ours-compile:before,ours-lora:keep,ours-lora-merged:keep,ours-compile:flex,ours-compile:math,"
           "ours-compile:cudnn,ours-compile:bucket,ours-compile:fuse_mlp,ours-compile:candidates,ours-compile:all,"
           "ours-compile:flex-static,ours-graph:before,ours-graph:all,ours-compile:bucket128,ours-compile:static,"
           "ours-compile:bucket32")

p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
p.add_argument("--device", default="cuda")
p.add_argument("--points", default="124m:64,1b:64,124m:256,124m:1,explore,1b:256,1b:1",
               help="shape:batch in priority order (shapes: " + ", ".join(SHAPES) + "); 'explore': the --explore rows "
               "(at the first point) run there")
p.add_argument("--rows", default="ours-compile:keep,hf-static",
               help="comma-separated, in priority order: " + ", ".join(ROWS) + " (ours-*: optionally :variant, "
               "one of " + ", ".join(VARIANTS) + ")")
p.add_argument("--explore", default=EXPLORE, help="rows run at the first point only, after every point's --rows")
p.add_argument("--profile", default="ours-compile:before,ours-compile:keep",
               help="rows of the first point also profiled (kernels and GPU time per step)")
p.add_argument("--prompt", type=int, default=0, help="prompt tokens (0: the shape's)")
p.add_argument("--new", type=int, default=0, help="new tokens (0: the shape's)")
p.add_argument("--top_k", type=int, default=50)
p.add_argument("--budget_s", type=float, default=480.0, help="start no row after this many seconds (checks included)")
p.add_argument("--no_checks", action="store_true")
p.add_argument("--check_compile", action="store_true", help="checks also for compile=True (two more compilations)")
p.add_argument("--json", default="", help="write the results here")
args = p.parse_args()

device = torch.device(args.device)
cuda = device.type == "cuda"
if not cuda:
    torch.set_num_threads(1)  # the CPU smoke test's tiny matmuls: extra threads only contend
dtype = torch.bfloat16 if cuda else torch.float32
START = time.time()


class SkipRow(Exception):
    pass


say = functools.partial(print, flush=True)


def sync():
    if cuda:
        torch.cuda.synchronize(device)


def free():
    gc.collect()
    torch._dynamo.reset()
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def copy_bandwidth():
    """Bytes/s of a device-to-device copy (read + write counted)."""
    n = (1 << 30) if cuda else (1 << 26)
    x = torch.empty(n, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    sync()
    t, reps = time.perf_counter(), 20
    for _ in range(reps):
        y.copy_(x)
    sync()
    return 2 * n * reps / (time.perf_counter() - t)


def build(shape, dt=None, std=0.02):
    mcfg, T, N = SHAPES[shape]
    torch.manual_seed(0)
    with torch.device(device):
        model = Transformer(ModelConfig(**dict(mcfg, init_std=std)))
    return model.to(dt or dtype).eval(), T, N


def hf_model(ctx):
    """transformers' LlamaForCausalLM with our weights (exported through hf.py), once per shape."""
    try:
        import transformers
    except ImportError:
        raise SkipRow("transformers is not installed")
    if "hf" not in ctx:
        transformers.logging.set_verbosity_error()
        hf.export_hf(ctx["model"], ctx["folder"])
        ctx["hf"] = transformers.AutoModelForCausalLM.from_pretrained(ctx["folder"], dtype=dtype).to(device).eval()
    return ctx["hf"]


def bound(model, B, T, N, bw):
    """The memory-bandwidth limit of a decode step, tokens/s = B / (bytes / bandwidth): bytes = the weights
    read once per step (every parameter but the token embedding) + the KV cache read at the mean context
    (prompt + new/2 keys per row); bw = a measured 1 GiB device copy (read + write bytes / seconds)."""
    c = model.cfg
    weights = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if n != "tok_emb.weight")
    if c.tie_embeddings:
        weights += model.head.weight.numel() * model.head.weight.element_size()
    kv = 2 * c.n_layer * c.kv_heads * c.head_dim * dtype.itemsize * B * (T + N / 2)
    return B * bw / (weights + kv)


def lora_model(ctx, merged):
    """The shape's model with LoRA adapters (r=16 on every linear, B random: a real delta), once
    per shape; merged: the adapters folded into the weights (lora.merge)."""
    if "lora" not in ctx:
        cfg = SimpleNamespace(**dict(config.defaults(lifecycle.TRAIN), device=device.type, lora_r=16))
        model = copy.deepcopy(ctx["model"]).float()
        lora.apply(model, cfg, parallel.init(SimpleNamespace(device=device.type, tp=1, ep=1)))
        with torch.no_grad():
            for n, prm in model.named_parameters():
                if "lora_B" in n:
                    prm.normal_(0, 0.01)
        ctx["lora"] = model.to(dtype).eval()
    (lora.merge if merged else lora.unmerge)(ctx["lora"])
    return ctx["lora"]


def row_call(name, ctx, x, N, keep, profile=False):
    """The row's generate call, (kind, variant) from "kind[:variant]"; profile: the step uncaptured
    (graph=False keeps the compiled code: every kernel visible to the profiler), nothing kept."""
    kind, _, variant = name.partition(":")
    kw = dict(temperature=1.0, top_k=args.top_k)
    if kind == "ours-eager":
        return lambda: generate.generate(ctx["model"], x, N, vocab=ctx["model"].cfg.vocab_size, seed=0, **kw)
    if kind.startswith("ours-"):
        opts = dict(VARIANTS[variant or "all"])
        comp = opts.pop("compile", True)
        if opts.pop("keep", False) and not profile:
            opts["keep"] = keep
        captured = cuda and kind != "ours-static"
        opts.update(graph=captured and not profile, compile=comp if captured and kind != "ours-graph" else False)
        model = lora_model(ctx, kind == "ours-lora-merged") if kind.startswith("ours-lora") else ctx["model"]
        return lambda: generate.decode(model, x, N, vocab=model.cfg.vocab_size, seed=0, **kw, **opts)
    ref = hf_model(ctx)
    extra = {"cache_implementation": "static"} if kind == "hf-static" else {}
    mask = torch.ones_like(x)
    return lambda: ref.generate(x, attention_mask=mask, max_new_tokens=N, min_new_tokens=N, do_sample=True,
                                pad_token_id=0, **kw, **extra)


def run_row(name, ctx, B, T, N, profile=False):
    """Seconds of the warm-up call (compilation and capture: what a user's first call costs) and of
    one timed call after it; with profile, a profile of one more call whose step runs uncaptured
    (same compiled code): per step, kernels and their GPU time."""
    kind = name.partition(":")[0]
    if kind in ("ours-graph", "ours-compile") and not cuda:
        raise SkipRow("CUDA only")
    g = torch.Generator(device).manual_seed(0)
    x = torch.randint(0, ctx["model"].cfg.vocab_size, (B, T), device=device, generator=g)
    call = row_call(name, ctx, x, N, keep={})
    with torch.no_grad():
        t = time.perf_counter()
        call()  # warm-up: compilation, cuBLAS handles, autotuning
        sync()
        first = time.perf_counter() - t
        t = time.perf_counter()
        out = call()
        sync()
        secs = time.perf_counter() - t
    toks = out.tokens if isinstance(out, generate.Rollout) else out
    if toks.shape != (B, T + N):
        raise RuntimeError(f"{name} returned {tuple(toks.shape)}, expected {(B, T + N)}")
    return first, secs, profile_row(name, ctx, x, N) if profile else None


def profile_row(name, ctx, x, N):
    """One call with the step uncaptured under torch.profiler -> per-step statistics. GPU: every
    kernel (and memcpy/memset) of the call / N; CPU: top-level ATen ops / N. The prefill's share
    is included (about 1/N of one forward)."""
    call = row_call(name, ctx, x, N, keep=None, profile=True)
    with torch.no_grad(), torch.profiler.profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        call()
        sync()
    evs = [e for e in prof.events() if (e.device_type == DeviceType.CUDA if cuda else
                                        e.cpu_parent is None and e.name.startswith("aten::"))]
    per = {}
    for e in evs:
        n, us = per.get(e.name, (0, 0.0))
        per[e.name] = (n + 1, us + e.time_range.elapsed_us())
    ranked = sorted(per.items(), key=lambda kv: -kv[1][1])
    return {"ops_per_step": len(evs) / N, "us_per_step": sum(us for _, us in per.values()) / N,
            "top": [{"name": k[:200], "per_step": n / N, "us_per_step": us / N} for k, (n, us) in ranked]}


def checks():
    """fp32 and bf16 (124m; tiny on CPU), prompts of different lengths: greedy decode (graph; compile too with
    --check_compile) vs the eager path: token agreement rate, tokens per row before the first difference
    (fp32: all identical; bf16: near-ties flip, then the rows go apart); max |log-prob - teacher-forced
    log_softmax| of tokens sampled with top-k; fp32: sampled tokens of the captured step = the uncaptured
    step's (same seed), a call replaying kept graphs (keep=) = a fresh one, also under bf16 autocast (greedy;
    the graphs replayed after the autocast context that captured them)."""
    shape = "124m" if cuda else "tiny"
    out = {}
    for dt in ((torch.float32, torch.bfloat16) if cuda else (torch.float32,)):
        model, T, N = build(shape, dt, std=0.05)  # a less flat distribution than 0.02: fewer near-ties
        g = torch.Generator().manual_seed(1)
        prompts = [torch.randint(0, model.cfg.vocab_size, (n,), generator=g) for n in (T, T // 2, 1, T - 3)]
        idx, mask = generate.pad_prompts(prompts, device=device)
        V = model.cfg.vocab_size  # random prompts: every id of the model (no tokenizer decodes them)
        ref = generate.generate(model, idx, N, vocab=V, temperature=0, attention_mask=mask)[:, T:]
        for name, opts in [("graph" if cuda else "static", {}), ("compile", dict(compile=True))]:
            if name == "compile" and not (cuda and args.check_compile):
                continue
            r = generate.decode(model, prompts, N, vocab=V, temperature=0, **opts)
            sampled = generate.decode(model, prompts, N, vocab=V, temperature=1.0, top_k=args.top_k, seed=0, **opts)
            with torch.no_grad():
                logits = model(sampled.tokens, attn_mask=sampled.mask)[:, T - 1:-1].float()
            tf = logits.log_softmax(-1).gather(-1, sampled.tokens[:, T:, None]).squeeze(-1)
            key = f"{str(dt).removeprefix('torch.')}-{name}"
            same = r.tokens[:, T:] == ref
            first_diff = torch.where(same.all(1), N, (~same).float().argmax(1))  # per row: tokens before a flip
            out[key] = {"greedy_agreement": same.float().mean().item(),
                        "tokens_before_first_difference": first_diff.tolist(),
                        "greedy_identical": bool(torch.equal(r.tokens[:, T:], ref)),
                        "logprob_max_abs_err": (sampled.logprobs - tf).abs().max().item()}
            if dt == torch.float32 and name != "compile":
                # the uncaptured step gets the captured one's attention kernel (decode picks Triton's only
                # when captured): the comparison is of the capture, not of two kernels' rounding
                att = "triton" if cuda and generate.fused.available(prompts[0].to(device)) else "sdpa"
                kw = dict(vocab=V, temperature=1.0, top_k=args.top_k, seed=0, bucket=16, attention=att)
                plain = generate.decode(model, prompts, N, graph=False, keep={}, **kw)
                fresh = generate.decode(model, prompts, N, keep={}, **kw)
                keep = {}
                for i in range(2):  # the second call replays the graphs the first one captured
                    kept = generate.decode(model, prompts if i else prompts[::-1], N, keep=keep, **kw)
                out[key]["captured_equals_uncaptured"] = bool(torch.equal(fresh.tokens, plain.tokens))
                out[key]["kept_equals_fresh"] = bool(torch.equal(kept.tokens, fresh.tokens)
                                                     and torch.equal(kept.logprobs, fresh.logprobs))
                keep, got = {}, []  # bf16 autocast: graphs kept past the autocast context that captured them
                for kw_ in (dict(graph=False, keep={}), dict(keep=keep), dict(keep=keep)):
                    with torch.autocast(device.type, torch.bfloat16):
                        got.append(generate.decode(model, prompts, N, vocab=V, temperature=0, attention=att, **kw_).tokens)
                out[key]["autocast_kept_equals_uncaptured"] = bool(torch.equal(got[2], got[0]))
            say(f"  check {key}: {out[key]}")
        del model
        free()
    return out


def main():
    say(f"# bench_generate: {torch.cuda.get_device_name(device) if cuda else 'cpu'}, torch {torch.__version__}, "
        f"dtype {str(dtype).removeprefix('torch.')}")
    bw = copy_bandwidth()
    say(f"# measured copy bandwidth {bw / 1e9:.0f} GB/s")
    res = {"meta": {"device": torch.cuda.get_device_name(device) if cuda else "cpu", "torch": torch.__version__,
                    "date": datetime.datetime.now().isoformat(timespec="seconds"), "copy_bandwidth_Bps": bw,
                    "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                             text=True).stdout.strip(), "args": vars(args)},
           "checks": {}, "rows": []}
    try:
        import transformers
        res["meta"]["transformers"] = transformers.__version__
    except ImportError:
        pass
    rows, explore, profiled = ([r for r in a.split(",") if r] for a in (args.rows, args.explore, args.profile))
    for r in rows + explore + profiled:
        kind, _, variant = r.partition(":")
        if kind not in ROWS or (variant and (variant not in VARIANTS or not kind.startswith("ours-"))):
            raise SystemExit(f"unknown row {r!r}: choose from {', '.join(ROWS)}, ours-* optionally with "
                             f":variant, one of {', '.join(VARIANTS)}")
    points, plan = [], []  # (batch, shape); (batch, shape, row)
    for pt in args.points.split(","):
        if pt == "explore" and points:
            plan += [(*points[0], name) for name in explore if name not in rows]
        elif pt.partition(":")[0] in SHAPES and pt.partition(":")[2].isdigit():
            points.append((int(pt.partition(":")[2]), pt.partition(":")[0]))
            plan += [(*points[-1], name) for name in rows]
        else:
            raise SystemExit(f"--points: {pt!r} is not shape:batch ({', '.join(SHAPES)}) nor 'explore' after one")
    if not args.no_checks:
        res["checks"] = checks()
    with tempfile.TemporaryDirectory() as tmp:
        ctxs = {}  # shape -> {"model", "folder", "hf", "lora"}: built once, kept (one GPU holds both shapes)
        for B, shape, name in plan:
            if shape not in ctxs:
                model, T, N = build(shape)
                ctxs[shape] = {"model": model, "folder": os.path.join(tmp, shape), "T": args.prompt or T,
                               "N": args.new or N}
            ctx = ctxs[shape]
            T, N = ctx["T"], ctx["N"]
            bnd = bound(ctx["model"], B, T, N, bw)
            row = {"shape": shape, "batch": B, "prompt": T, "new": N, "row": name, "bound_tok_s": bnd}
            if time.time() - START > args.budget_s:
                row["skipped"] = f"time budget {args.budget_s:.0f} s spent"
            else:
                try:
                    first, secs, stats = run_row(name, ctx, B, T, N, profile=(B, shape) == points[0] and name in profiled)
                    row.update(first_call_s=first, seconds=secs, tok_s=B * N / secs, ms_per_step=1e3 * secs / N,
                               of_bound=B * N / secs / bnd, profile=stats,
                               peak_gb=torch.cuda.max_memory_allocated(device) / 1e9 if cuda else None)
                except SkipRow as e:
                    row["skipped"] = str(e)
                except Exception as e:  # report and go on
                    traceback.print_exc()
                    row["error"] = f"{type(e).__name__}: {e}"
                free()
            res["rows"].append(row)
            report(row)
            write(res)  # after every row: a run cut short keeps what it measured
    table(res["rows"])
    if args.json:
        say(f"# wrote {args.json}")


def write(res):
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)


def report(r):
    what = r.get("skipped") or r.get("error") or f"{r['tok_s']:,.0f} tok/s, {r['ms_per_step']:.2f} ms/step, first call {r['first_call_s']:.1f} s"
    say(f"  {r['shape']:>5} B={r['batch']:<4} {r['row']:<26} {what}  (t={time.time() - START:.0f}s)")
    if r.get("profile"):
        p = r["profile"]
        say(f"      {p['ops_per_step']:.0f} {'kernels' if cuda else 'ops'}/step, {p['us_per_step']:.0f} us/step "
            f"{'GPU' if cuda else 'CPU'}; the largest:")
        for k in p["top"][:12]:  # the JSON keeps every kernel
            say(f"      {k['us_per_step']:8.1f} us {k['per_step']:5.1f}x  {k['name'][:90]}")


def table(rows):
    say("\n| shape | B | row | new tok/s | ms/step | vs hf-static | vs before | of bound | bound tok/s | peak GB |")
    say("|---|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    at = {(r["shape"], r["batch"], r["row"]): r.get("tok_s") for r in rows}
    for r in rows:
        if "tok_s" not in r:
            say(f"| {r['shape']} | {r['batch']} | {r['row']} | {r.get('skipped') or r.get('error')} | | | | | | |")
            continue
        hf_ = at.get((r["shape"], r["batch"], "hf-static"))
        kind = r["row"].partition(":")[0]
        kind = "ours-compile" if kind.startswith("ours-lora") else kind  # LoRA: vs the plain model's decoder
        before = at.get((r["shape"], r["batch"], kind + ":before"))
        ratio = lambda ref: f"{r['tok_s'] / ref:.2f}x" if ref else ""
        peak = f"{r['peak_gb']:.1f}" if r["peak_gb"] is not None else ""
        say(f"| {r['shape']} | {r['batch']} | {r['row']} | {r['tok_s']:,.0f} | {r['ms_per_step']:.2f} | {ratio(hf_)} | "
            f"{ratio(before)} | {r['of_bound']:.2f} | {r['bound_tok_s']:,.0f} | {peak} |")


if __name__ == "__main__":
    main()
