"""Issue 21's single-GPU goals (1B >= 60% MFU, GPT-2 shape >= 1.15x nanoGPT): what is left to win.
Where does wall time go beyond kernel time; what do CUDA graphs (mode="reduce-overhead"), bf16 weights
(no per-step casts), gradient accumulation, one [gate | up] matmul, flash attention and a cheaper GELU buy.

    python bench/results/ceiling/ceiling.py gpt2 <nanoGPT model.py>   # and 1b, 1b16, 1bfused, gpt2flash, gpt2act

Run from the repository root (session 12, as .gpu/s12.py; since then only this docstring, the import of
ceiling_gelu and a redundant `del` at the end of row() changed). Per row and variant (accum micro-steps, opt 0 = forward + backward only):
compile s, wall ms per micro-step (timed), then inside a profiled window of 2 steps the GPU kernel ms,
idle ms (span of the kernels minus their sum) and kernels per micro-step. In rows profiled with shapes
(CPU activity on) the kernel and idle columns count the ops' device time twice: read only wall there.
"""
import argparse, collections, contextlib, importlib.util, os, sys, time
import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile
sys.path.insert(0, os.getcwd())
import logs, optim
from model import ModelConfig, Transformer

dev = torch.device("cuda")
torch.backends.cuda.matmul.allow_tf32 = True
torch.backends.cudnn.allow_tf32 = True
peak = logs.peak_tflops(dev, 0.0)
GPT2 = dict(vocab_size=50304, block_size=1024, n_layer=12, n_head=12, n_embd=768, pos_emb="learned",
            norm="layernorm", activation="gelu", bias=True, tie_embeddings=True, dropout=0.0, fp32_residual=False)
ONEB = dict(pos_emb="rope", norm="rmsnorm", activation="swiglu", bias=False, tie_embeddings=False, vocab_size=50304,
            block_size=2048, n_layer=16, n_head=16, n_embd=2048, n_kv_head=8, ffn_hidden=8192, fp32_residual=False)
OPT = argparse.Namespace(optimizer="adamw", lr=6e-4, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)


def nanogpt(path):
    spec = importlib.util.spec_from_file_location("nanogpt_model", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["nanogpt_model"] = mod
    spec.loader.exec_module(mod)
    cfg = mod.GPTConfig(block_size=1024, vocab_size=50304, n_layer=12, n_head=12, n_embd=768, dropout=0.0, bias=True)
    model = mod.GPT(cfg).to(dev)
    opt = model.configure_optimizers(0.1, 6e-4, (0.9, 0.95), "cuda")
    return model, (lambda x, y: model(x, y)[1]), opt


def ours(shape, bf16=False):
    model = Transformer(ModelConfig(**shape)).to(dev)
    if bf16:
        model.to(torch.bfloat16)
    return model, model, optim.build_optimizer(model, OPT)


def window(pr, n):
    ks = [e for e in pr.events() if e.device_type == DeviceType.CUDA]
    s = sum(e.device_time for e in ks)
    span = max(e.time_range.end for e in ks) - min(e.time_range.start for e in ks)
    return s / n / 1e3, (span - s) / n / 1e3, len(ks) / n


def row(name, build, B, T, fpt, mode=None, variants=((1, True),), steps=12, shapes=False, ctx=contextlib.nullcontext):
    torch._dynamo.reset(); torch.manual_seed(0); torch.cuda.empty_cache(); torch.cuda.reset_peak_memory_stats()
    model, fwd, opt = build()
    fwd = torch.compile(fwd, mode=mode) if mode != "eager" else fwd
    g = torch.Generator(dev).manual_seed(1)
    xs = [torch.randint(0, 50257, (B, T + 1), device=dev, generator=g) for _ in range(4)]
    xs = [(x[:, :-1].contiguous(), x[:, 1:].contiguous()) for x in xs]

    def step(i, a, opt_step=True):
        for k in range(a):
            x, y = xs[(i * a + k) % 4]
            with ctx(), torch.autocast("cuda", dtype=torch.bfloat16):
                loss = fwd(x, y)
            (loss / a).backward()
        if opt_step:
            opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    t0 = time.perf_counter()
    for i in range(3):
        step(i, 1)
    torch.cuda.synchronize()
    comp = time.perf_counter() - t0
    for a, o in variants:
        step(0, a, o); step(1, a, o); torch.cuda.synchronize()
        t0 = time.perf_counter()
        for i in range(steps):
            loss = step(i, a, o)
        torch.cuda.synchronize()
        dt = (time.perf_counter() - t0) / steps / a
        with profile(activities=[ProfilerActivity.CUDA] + ([ProfilerActivity.CPU] if shapes else []),
                     record_shapes=shapes) as pr:
            for i in range(2):
                step(i, a, o)
            torch.cuda.synchronize()
        gpu, idle, nk = window(pr, 2 * a)
        tok = B * T / dt
        print(f"{name:28s} accum {a} opt {int(o)}: compile {comp:5.1f} s | wall {1e3 * dt:7.2f} ms/micro | kernels {gpu:7.2f} "
              f"| idle {idle:5.2f} | {nk:6.0f} kernels | {tok:,.0f} tok/s MFU {100 * tok * fpt / (peak * 1e12):.1f}% "
              f"| peak {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB | loss {loss.item():.3f}", flush=True)
        if shapes:
            tab = collections.defaultdict(lambda: [0.0, 0])
            for e in pr.key_averages(group_by_input_shape=True):
                if e.key in ("aten::mm", "aten::addmm", "aten::bmm") or "attention" in e.key:
                    tab[(e.key, str(e.input_shapes)[:90])][0] += e.device_time_total / 2 / 1e3
                    tab[(e.key, str(e.input_shapes)[:90])][1] += e.count / 2
            for (k, sh), (ms, c) in sorted(tab.items(), key=lambda kv: -kv[1][0])[:16]:
                print(f"    {ms:7.2f} ms {c:4.0f}x  {k} {sh}")


def main():
    what = sys.argv[1]
    if what == "gpt2":
        path = sys.argv[2]
        with torch.device("meta"):
            fpt = Transformer(ModelConfig(**GPT2)).flops_per_token(1024)
        B, T = 32, 1024
        row("nanogpt", lambda: nanogpt(path), B, T, fpt)
        row("ours-bf16res", lambda: ours(GPT2), B, T, fpt, variants=((1, True), (1, False)), shapes=True)
        row("ours-bf16res reduce-overhead", lambda: ours(GPT2), B, T, fpt, mode="reduce-overhead")
        row("nanogpt reduce-overhead", lambda: nanogpt(path), B, T, fpt, mode="reduce-overhead")
        row("ours bf16 weights", lambda: ours(GPT2, bf16=True), B, T, fpt, variants=((1, False),))
    elif what == "gpt2flash":
        from torch.nn.attention import sdpa_kernel, SDPBackend
        with torch.device("meta"):
            fpt = Transformer(ModelConfig(**GPT2)).flops_per_token(1024)
        row("ours-bf16res flash", lambda: ours(GPT2), 32, 1024, fpt, ctx=lambda: sdpa_kernel([SDPBackend.FLASH_ATTENTION]))
    elif what == "gpt2act":
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from ceiling_gelu import PolyGELU
        path = sys.argv[2]
        with torch.device("meta"):
            fpt = Transformer(ModelConfig(**GPT2)).flops_per_token(1024)

        def poly():
            m, f, o = ours(GPT2)
            for b in m.blocks:
                b.mlp.act = PolyGELU.apply
            return m, f, o
        row("nanogpt", lambda: nanogpt(path), 32, 1024, fpt)
        row("ours-bf16res", lambda: ours(GPT2), 32, 1024, fpt)
        row("ours-bf16res gelu poly", poly, 32, 1024, fpt)
        row("ours-bf16res gelu_tanh", lambda: ours(dict(GPT2, activation="gelu_tanh")), 32, 1024, fpt)
    elif what == "1bfused":
        with torch.device("meta"):
            fpt = Transformer(ModelConfig(**ONEB)).flops_per_token(2048)

        def fused_mlp():
            m, f, o = ours(ONEB)
            for b in m.blocks:
                b.mlp.split = False  # one (C x 2H) matmul for [gate | up], then a split
            return m, f, o
        row("1b gate|up one matmul", fused_mlp, 8, 2048, fpt, variants=((1, True), (1, False)), steps=6)
        row("1b", lambda: ours(ONEB), 8, 2048, fpt, variants=((1, True), (1, False)), steps=6)
    elif what == "1b16":
        with torch.device("meta"):
            fpt = Transformer(ModelConfig(**ONEB)).flops_per_token(2048)
        row("1b B=16", lambda: ours(ONEB), 16, 2048, fpt, variants=((1, True), (2, True), (1, False)), steps=4)
    else:
        with torch.device("meta"):
            fpt = Transformer(ModelConfig(**ONEB)).flops_per_token(2048)
        B, T = 8, 2048
        row("1b", lambda: ours(ONEB), B, T, fpt, variants=((1, True), (4, True), (1, False)), steps=6, shapes=True)
        row("1b reduce-overhead", lambda: ours(ONEB), B, T, fpt, mode="reduce-overhead", steps=6)
        row("1b bf16 weights", lambda: ours(ONEB, bf16=True), B, T, fpt, variants=((1, False),), steps=6)


if __name__ == "__main__":
    main()
