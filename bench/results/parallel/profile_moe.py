"""The 8-expert MoE shape of bench_parallel.py (moe 1b: 3.63B parameters, 1.21B active) on ONE GPU,
eager, all experts local (dropless, grouped matmuls): where a step's time goes (issue 21, MoE point).
Run by hand on the GPU machine:  python bench/results/parallel/profile_moe.py [sequences]
Prints ms/step, MFU (active parameters), GPU busy time per step (kernels summed; wall - busy is the
GPU waiting on the host: syncs, launches) and the largest kernels and host-side ops."""
import collections, os, sys, time, torch
sys.path.insert(0, os.getcwd())
from torch.profiler import ProfilerActivity, profile
import logs
from model import ModelConfig, Transformer
dev = torch.device("cuda")
SH = dict(vocab_size=50304, activation="swiglu", norm="rmsnorm", pos_emb="rope", block_size=2048, n_layer=16,
          n_embd=2048, n_head=16, n_kv_head=8, ffn_hidden=8192, n_experts=8, moe_top_k=2, moe_hidden=4096,
          fp32_residual=False)
B = int(sys.argv[1]) if len(sys.argv) > 1 else 4
torch.manual_seed(0)
m = Transformer(ModelConfig(**SH)).to(dev)
fpt, peak = m.flops_per_token(2048), logs.peak_tflops(dev)
opt = torch.optim.AdamW(m.parameters(), lr=1e-4, fused=True)
x = torch.randint(0, 50304, (B, 2049), device=dev)
def step():
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = m(x[:, :-1], x[:, 1:])
    loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)
for _ in range(3): step()
torch.cuda.synchronize(); t = time.perf_counter()
for _ in range(6): step()
torch.cuda.synchronize(); dt = (time.perf_counter() - t) / 6
tok = B * 2048 / dt
print(f"B={B}: {dt*1e3:.1f} ms/step {tok:,.0f} tok/s MFU {100*tok*fpt/(peak*1e12):.1f}% (active) "
      f"peak mem {torch.cuda.max_memory_allocated()/2**30:.1f} GiB", flush=True)
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as pr:
    for _ in range(2): step()
    torch.cuda.synchronize()
gpu, cpu = collections.Counter(), collections.Counter()
for e in pr.events():
    if e.device_type == torch.autograd.DeviceType.CUDA:
        gpu[e.name] += e.device_time / 2
    elif e.name.startswith(("cuda", "aten::item", "aten::_local_scalar", "aten::tolist", "aten::nonzero")):
        cpu[e.name] += e.cpu_time_total / 2
s = sum(gpu.values())
print(f"  GPU busy per step {s/1e3:.1f} ms of {dt*1e3:.1f} wall ({100*s/1e3/(dt*1e3):.0f}%)")
for k, v in gpu.most_common(25):
    print(f"  {v/1e3:7.2f} ms {100*v/s:5.1f}%  {k[:110]}")
print("  host-side waits and syncs per step:")
for k, v in cpu.most_common(8):
    print(f"  {v/1e3:7.2f} ms  {k[:80]}")
