"""The GPT-2-124M shape, ours against nanoGPT's model, one GPU, same process (issue 21, item 3).

    python bench/bench_gpt2.py --nanogpt=/path/to/nanoGPT/model.py --json=bench/results/gpt2.json

The shape of configs/gpt2.py: learned positions, LayerNorm, GELU, biases, tied embeddings, 12 layers,
width 768, vocabulary 50,304, T = 1024. Both models compiled (torch.compile), bf16 autocast over
fp32 weights, fused AdamW (each model's own: optim.build_optimizer, nanoGPT's
configure_optimizers), the same random batches, micro batch --batch. Rows run A B B A (ours,
nanoGPT, nanoGPT, ours with --repeats=2) so a drifting clock favours neither; tokens/s is each
row's best.
MFU from our flops_per_token (the same shape). --profile: three more steps of each model's
first row under torch.profiler: GPU time per step and the kernels that take it, the profile that explains the gap.
nanoGPT's model.py is not ours and is not in this repository: pass its path (a clone of
karpathy/nanoGPT).
"""
import argparse
import collections
import datetime
import importlib.util
import json
import os
import sys
import time

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import logs  # noqa: E402
import optim  # noqa: E402
from model import ModelConfig, Transformer  # noqa: E402

GPT2 = dict(vocab_size=50304, block_size=1024, n_layer=12, n_head=12, n_embd=768, pos_emb="learned",
            norm="layernorm", activation="gelu", bias=True, tie_embeddings=True, dropout=0.0)

p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
p.add_argument("--nanogpt", required=True, help="path of nanoGPT's model.py")
p.add_argument("--batch", type=int, default=32)
p.add_argument("--steps", type=int, default=20, help="timed steps per row")
p.add_argument("--warmup", type=int, default=5)
p.add_argument("--repeats", type=int, default=1, help="rounds, alternately forward and reversed (2: A B B A)")
p.add_argument("--rows", default="ours,nanogpt,ours-bf16res", help="ours, ours-bf16res (bf16 residual), nanogpt")
p.add_argument("--profile", type=int, default=1)
p.add_argument("--json", default="")
args = p.parse_args()
dev = torch.device("cuda")
torch.backends.cuda.matmul.allow_tf32 = True
torch.backends.cudnn.allow_tf32 = True
B, T = args.batch, GPT2["block_size"]


def nanogpt():
    spec = importlib.util.spec_from_file_location("nanogpt_model", args.nanogpt)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["nanogpt_model"] = mod  # dynamo re-imports the module of the code it traces
    spec.loader.exec_module(mod)
    cfg = mod.GPTConfig(block_size=T, vocab_size=GPT2["vocab_size"], n_layer=12, n_head=12, n_embd=768,
                        dropout=0.0, bias=True)
    model = mod.GPT(cfg).to(dev)
    opt = model.configure_optimizers(0.1, 6e-4, (0.9, 0.95), "cuda")
    return model, (lambda x, y: model(x, y)[1]), opt


def ours(fp32_residual=True):
    model = Transformer(ModelConfig(**GPT2, fp32_residual=fp32_residual)).to(dev)
    opt = optim.build_optimizer(model, argparse.Namespace(optimizer="adamw", zero1=False, adamw_state="fp32", lr=6e-4, beta1=0.9, beta2=0.95,
                                                          eps=1e-8, weight_decay=0.1, optimizer_in_backward=False))
    return model, model, opt


BUILD = {"ours": ours, "ours-bf16res": lambda: ours(False), "nanogpt": nanogpt}


def run(name, batches, prof=False):
    torch.manual_seed(0)
    model, fwd, opt = BUILD[name]()
    fwd = torch.compile(fwd)

    def step(i):
        x, y = batches[i % len(batches)]
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = fwd(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    for i in range(args.warmup):
        step(i)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    for i in range(args.steps):
        loss = step(i)
    torch.cuda.synchronize()
    dt = (time.perf_counter() - t0) / args.steps
    out = {"tok_s": B * T / dt, "step_ms": 1e3 * dt, "loss": loss.item(),
           "peak_gb": torch.cuda.max_memory_allocated() / 1e9,
           "params": sum(q.numel() for q in model.parameters())}
    if prof:
        n = 3
        with profile(activities=[ProfilerActivity.CUDA]) as pr:
            for i in range(n):
                step(i)
            torch.cuda.synchronize()
        kernels = collections.Counter()
        calls = collections.Counter()
        for e in pr.events():
            if e.device_type == DeviceType.CUDA:
                kernels[e.name] += e.device_time / n
                calls[e.name] += 1 / n
        out["gpu_us_per_step"] = sum(kernels.values())
        out["kernels"] = [(k[:110], round(v, 1), round(calls[k], 1)) for k, v in kernels.most_common(25)]
    model = fwd = opt = None  # (freed before the next run; not del: step() closes over them)
    torch._dynamo.reset()
    torch.cuda.empty_cache()
    return out


def main():
    with torch.device("meta"):
        fpt = Transformer(ModelConfig(**GPT2)).flops_per_token(T)
    peak = logs.peak_tflops(dev, 0.0)
    g = torch.Generator(dev).manual_seed(1)
    batches = [(torch.randint(0, 50257, (B, T), device=dev, generator=g),
                torch.randint(0, 50257, (B, T), device=dev, generator=g)) for _ in range(4)]
    rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    order = [r for k in range(args.repeats) for r in (rows if k % 2 == 0 else rows[::-1])]
    res = {"meta": {"date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
                    "device": torch.cuda.get_device_name(dev), "torch": torch.__version__, "batch": B, "T": T,
                    "flops_per_token": fpt, "peak_tflops": peak, "order": order}, "runs": []}
    for i, name in enumerate(order):
        r = run(name, batches, prof=args.profile and i < len(rows))  # profiled after the first round's timing
        r["mfu"] = r["tok_s"] * fpt / (peak * 1e12) if peak else None
        res["runs"].append(dict(r, row=name))
        print(f"{name:14s} {r['tok_s']:>10,.0f} tok/s  {r['step_ms']:.1f} ms/step  MFU {100 * (r['mfu'] or 0):.1f}%  "
              f"peak {r['peak_gb']:.2f} GB  params {r['params']:,}  loss {r['loss']:.3f}", flush=True)
    best = {n: max(r["tok_s"] for r in res["runs"] if r["row"] == n) for n in rows}
    for n in rows:
        print(f"best {n:14s} {best[n]:>10,.0f} tok/s" + (f"  = {best[n] / best['nanogpt']:.3f}x nanoGPT"
                                                        if "nanogpt" in best else ""))
    res["best"] = best
    for r in res["runs"]:
        if "kernels" in r:
            print(f"\n## {r['row']}: {r['gpu_us_per_step'] / 1e3:.1f} ms GPU per step (wall {r['step_ms']:.1f} ms)")
            for k, us, c in r["kernels"]:
                print(f"  {us / 1e3:8.2f} ms {c:6.1f}x  {k}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
