"""1B LLaMA shape on one GPU: compiled train step; attention backend variants; kernel profile."""
import os, sys, time, collections, torch
sys.path.insert(0, os.getcwd())
from torch.profiler import ProfilerActivity, profile
from torch.nn.attention import sdpa_kernel, SDPBackend
import logs
import model as M
from model import ModelConfig, Transformer
dev = torch.device("cuda"); torch.backends.cuda.matmul.allow_tf32 = True
SH = dict(pos_emb="rope", norm="rmsnorm", activation="swiglu", bias=False, tie_embeddings=False, vocab_size=50304,
          block_size=2048, n_layer=16, n_head=16, n_embd=2048, n_kv_head=8, ffn_hidden=8192, fp32_residual=False)
B = int(sys.argv[1]) if len(sys.argv) > 1 else 8
peak = logs.peak_tflops(dev)
def run(name, ctx, repeat_kv=False, prof=False):
    torch._dynamo.reset(); torch.manual_seed(0)
    if repeat_kv: M.SDPA_GQA = False  # repeat k, v to full heads (cuDNN / flash without GQA)
    m = Transformer(ModelConfig(**SH)).to(dev)
    fpt = m.flops_per_token(2048)
    f = torch.compile(m)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-4, fused=True)
    x = torch.randint(0, 50304, (B, 2049), device=dev)
    def step():
        with ctx(), torch.autocast("cuda", dtype=torch.bfloat16):
            loss = f(x[:, :-1], x[:, 1:])
        loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)
    try:
        for _ in range(4): step()
    except Exception as e:
        print(name, "FAILED", type(e).__name__, str(e)[:200]); M.SDPA_GQA = True; return
    torch.cuda.synchronize(); t = time.perf_counter()
    for _ in range(8): step()
    torch.cuda.synchronize(); dt = (time.perf_counter() - t) / 8
    tok = B * 2048 / dt
    print(f"{name}: {dt*1e3:.1f} ms/step {tok:,.0f} tok/s MFU {100*tok*fpt/(peak*1e12):.1f}% peak mem {torch.cuda.max_memory_allocated()/2**30:.1f} GiB", flush=True)
    if prof:
        with profile(activities=[ProfilerActivity.CUDA]) as pr:
            for _ in range(2): step()
            torch.cuda.synchronize()
        tot = collections.Counter()
        for e in pr.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                tot[e.name] += e.device_time / 2
        s = sum(tot.values())
        print(f"  GPU time per step {s/1e3:.1f} ms")
        for k, v in tot.most_common(28):
            print(f"  {v/1e3:7.2f} ms {100*v/s:5.1f}%  {k[:110]}")
    M.SDPA_GQA = True
    del m, f, opt; torch.cuda.empty_cache(); torch.cuda.reset_peak_memory_stats()
import contextlib
run("default (enable_gqa)", contextlib.nullcontext, prof=True)
run("cudnn, repeat kv", lambda: sdpa_kernel([SDPBackend.CUDNN_ATTENTION]), repeat_kv=True, prof=True)
run("flash, enable_gqa", lambda: sdpa_kernel([SDPBackend.FLASH_ATTENTION]))
