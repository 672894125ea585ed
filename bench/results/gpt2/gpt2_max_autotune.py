"""The GPT-2-124M shape (bench_gpt2.py's), ours with the bf16 residual: default torch.compile, then
max-autotune (Triton GEMM templates against cuBLAS, epilogue fusion: could a GELU fused into the fc
matmul pay?), then default again. Run by hand on the GPU machine (session 11, 3411608):
    python bench/results/gpt2/gpt2_max_autotune.py
Result (gpt2_max_autotune_3411608.log): default 549,620 tok/s; max-autotune's compile had not finished
after ~185 s. Of the 10 GEMMs it had autotuned, cuBLAS won 8 (the best Triton template 12-48% slower,
the fc matmul's 24%); in the other two, weight gradients (qkv, proj), a Triton kernel won by 3-4%."""
import os, sys, time, torch
sys.path.insert(0, os.getcwd())
import torch._inductor.config as ic
from model import ModelConfig, Transformer
import logs
dev = torch.device("cuda"); torch.backends.cuda.matmul.allow_tf32 = True
cfg = dict(vocab_size=50304, block_size=1024, n_layer=12, n_head=12, n_embd=768, pos_emb="learned", norm="layernorm",
           activation="gelu", bias=True, tie_embeddings=True, dropout=0.0, fp32_residual=False)
def run(name, **flags):
    torch._dynamo.reset(); torch.manual_seed(0)
    with ic.patch(flags):
        m = Transformer(ModelConfig(**cfg)).to(dev); f = torch.compile(m)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-4, fused=True)
        x = torch.randint(0, 50304, (32, 1025), device=dev)
        def step():
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = f(x[:, :-1], x[:, 1:])
            loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)
        t = time.time(); step(); torch.cuda.synchronize(); print(f"{name}: first step (compile) {time.time()-t:.1f} s", flush=True)
        for _ in range(3): step()
        torch.cuda.synchronize(); t = time.perf_counter()
        for _ in range(10): step()
        torch.cuda.synchronize(); dt = (time.perf_counter() - t) / 10
    tok = 32 * 1024 / dt
    print(f"{name}: {dt*1e3:.1f} ms/step {tok:,.0f} tok/s MFU {100*tok*m.flops_per_token(1024)/(logs.peak_tflops(dev)*1e12):.1f}%", flush=True)
run("default")
run("max-autotune", max_autotune=True, max_autotune_gemm_backends="TRITON,ATEN", epilogue_fusion=True)
run("default")
