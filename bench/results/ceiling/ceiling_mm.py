"""Session 12 (as .gpu/s12mm.py): the head's matmul (1B: 503 TFLOP/s in the training profile against ~700-760 for the others) and attention backends,
timed alone with CUDA events (bf16, median of 20 after 5 warm-up). ms() is the timer of ceiling_mm2.py and
ceiling_gelu.py too (they had copies when run)."""
import torch
import torch.nn.functional as F
from torch.nn.attention import sdpa_kernel, SDPBackend

dev = "cuda"
torch.manual_seed(0)


def ms(fn, n=20):
    for _ in range(5):
        fn()
    ts = []
    for _ in range(n):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); fn(); b.record(); b.synchronize(); ts.append(a.elapsed_time(b))
    return sorted(ts)[n // 2]


def head(M, K, V):
    x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
    print(f"## head forward logits ({M} x {K}) @ ({V} x {K})^T")
    for Vp in (V, 50432, 51200, 50176):
        W = torch.randn(Vp, K, device=dev, dtype=torch.bfloat16) * 0.02
        f = 2 * M * K * Vp
        t = ms(lambda: F.linear(x, W)); print(f"  linear  V={Vp}: {t:.3f} ms {f / t / 1e9:.0f} TFLOP/s")
        if Vp == V:
            t = ms(lambda: torch.mm(W, x.t())); print(f"  W @ x^T (logits^T) V={Vp}: {t:.3f} ms {f / t / 1e9:.0f} TFLOP/s")
            for c in (2, 4, 8):
                xs = x.chunk(c)
                t = ms(lambda: [F.linear(xc, W) for xc in xs]); print(f"  {c} row chunks: {t:.3f} ms {f / t / 1e9:.0f} TFLOP/s")
            for c in (2, 3):
                Ws = W.chunk(c)
                t = ms(lambda: [F.linear(x, Wc) for Wc in Ws]); print(f"  {c} vocab chunks: {t:.3f} ms {f / t / 1e9:.0f} TFLOP/s")
            out = torch.empty(M, V, device=dev, dtype=torch.bfloat16)
            t = ms(lambda: torch.mm(x, W.t(), out=out)); print(f"  mm out= V={Vp}: {t:.3f} ms {f / t / 1e9:.0f} TFLOP/s")
            # backward products of the head, for reference
            g = torch.randn(M, V, device=dev, dtype=torch.bfloat16)
            t = ms(lambda: g @ W); print(f"  dX = dL @ W: {t:.3f} ms {f / t / 1e9:.0f} TFLOP/s")
            t = ms(lambda: g.t() @ x); print(f"  dW = dL^T @ X: {t:.3f} ms {f / t / 1e9:.0f} TFLOP/s")


def attn(B, H, KV, T, D):
    q = torch.randn(B, H, T, D, device=dev, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(B, KV, T, D, device=dev, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(B, KV, T, D, device=dev, dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(B, H, T, D, device=dev, dtype=torch.bfloat16)
    f = 4 * B * H * T * T * D / 2 * 3.5  # fwd 2 matmuls causal-halved; bwd 2.5x fwd
    print(f"## attention B={B} H={H} KV={KV} T={T} D={D} fwd+bwd")
    for name, be in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION),
                     ("efficient", SDPBackend.EFFICIENT_ATTENTION)):
        def fn():
            with sdpa_kernel([be]):
                y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=KV != H)
            y.backward(g)
        try:
            t = ms(fn); print(f"  {name}: {t:.3f} ms {f / t / 1e9:.0f} TFLOP/s")
        except Exception as e:
            print(f"  {name}: {type(e).__name__} {str(e)[:100]}")


if __name__ == "__main__":
    head(16384, 2048, 50304)
    head(32768, 768, 50304)
    attn(32, 12, 12, 1024, 64)
    attn(8, 16, 8, 2048, 128)
