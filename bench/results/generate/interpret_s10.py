"""fused.decode_attention through Triton's CPU interpreter, no GPU needed (session 10, e02d789): the
cases of tests/test_fused.py on CPU tensors against fp32 SDPA. Needs triton installed (~1 GB, so not
in CI):  TRITON_INTERPRET=1 python bench/results/generate/interpret_s10.py   (~50 s on 2 cores).
Result at e02d789: every case within tolerance, worst fp32 error 5.4e-7; dropping the combine
kernel's rescale (a planted bug) fails the 44-chunk case. Rerun at 1646dde (custom op; chunk 1024
on more warps): the same worst error."""
import os, sys, torch, torch.nn.functional as F
sys.path.insert(0, os.getcwd())
import fused
def case(R, H, KV, D, S, L, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    kb, vb = (torch.randn(R, KV, S, D, generator=g).to(dtype) for _ in range(2))
    q = torch.randn(R, H, 1, D, generator=g).to(dtype)
    pad = torch.randint(0, 40, (R,), generator=g)
    j = torch.arange(S)
    real = (j[None] >= pad[:, None]) & (j[None] < L - 24)
    bias = torch.zeros(R, S, dtype=dtype).masked_fill_(~real, float("-inf"))
    return q, kb[:, :, :L], vb[:, :, :L], bias[:, None, None, :L]
worst = 0
for shape in [(8, 12, 12, 64, 320, 192), (5, 16, 8, 128, 130, 77), (3, 6, 3, 80, 70, 64), (2, 4, 1, 64, 800, 700)]:
    for dtype in (torch.float32, torch.bfloat16):
        R, H, KV, D, S, L = shape
        q, k, v, b = case(*shape, dtype)
        G = H // KV
        want = F.scaled_dot_product_attention(q.float(), k.float().repeat_interleave(G, 1), v.float().repeat_interleave(G, 1), attn_mask=b.float())
        for chunk in (16, 64, 1024):  # since 1646dde a tile of more than 512 values per thread needs more warps
            got = fused.decode_attention(q, k, v, b, chunk=chunk, warps=max(1, chunk * 128 // 16384))
            err = (got.float() - want).abs().max().item()
            tol = 1e-5 if dtype == torch.float32 else 1e-2
            assert got.shape == q.shape and got.dtype == dtype and err <= tol, (shape, dtype, chunk, err)
            worst = max(worst, err if dtype == torch.float32 else 0)
        print(shape, dtype, "ok")
print("worst fp32 err", worst)
try:
    fused.decode_attention(q, k, v, b, chunk=24); print("BAD: chunk 24 accepted")
except AssertionError as e:
    print("refused:", e)
