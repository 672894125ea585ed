"""Session 12 (as .gpu/s12mm2.py): MLP matmuls of the 1B shape, [gate | up] as one matmul or two; GPT-2's K = 768 matmuls;
cuBLAS against cuBLASLt. CUDA events, bf16, median of 20 after 5 warm-up."""
import os, sys, torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ceiling_mm import ms  # noqa: E402
dev = "cuda"


def r(*s):
    return torch.randn(*s, device=dev, dtype=torch.bfloat16)


for lib in ("cublas", "cublaslt"):
    torch.backends.cuda.preferred_blas_library(lib)
    print(f"## {lib}")
    M, C, Hd = 16384, 2048, 8192
    x, Wgu, Wd, g2, g1 = r(M, C), r(2 * Hd, C), r(C, Hd), r(M, 2 * Hd), r(M, C)
    Wg, Wu = Wgu[:Hd], Wgu[Hd:]
    f = 2 * M * C * 2 * Hd
    cases = {
        "fwd gate,up: two (M x C)(C x H)": lambda: (F.linear(x, Wg), F.linear(x, Wu)),
        "fwd gate|up: one (M x C)(C x 2H)": lambda: F.linear(x, Wgu),
        "dX: two (M x H)(H x C) + add": lambda: g2[:, :Hd] @ Wg + g2[:, Hd:] @ Wu,
        "dX: one (M x 2H)(2H x C)": lambda: g2 @ Wgu,
        "dW: two (H x M)(M x C)": lambda: (g2[:, :Hd].t() @ x, g2[:, Hd:].t() @ x),
        "dW: one (2H x M)(M x C)": lambda: g2.t() @ x,
    }
    for k, fn in cases.items():
        t = ms(fn); print(f"  1b {k}: {t:.3f} ms {f / t / 1e9:.0f} TFLOP/s")
    f = 2 * M * C * Hd
    t = ms(lambda: F.linear(r(M, Hd) if False else g2[:, :Hd].contiguous(), Wd)); print(f"  1b down fwd (M x H)(H x C): {t:.3f} ms {f / t / 1e9:.0f} TFLOP/s")
    M, C = 32768, 768
    x, g = r(M, C), r(M, 4 * C)
    W, b = r(4 * C, C), r(4 * C)
    f = 2 * M * C * 4 * C
    t = ms(lambda: F.linear(x, W, b)); print(f"  gpt2 fc fwd +bias (M x 768)(768 x 3072): {t:.3f} ms {f / t / 1e9:.0f} TFLOP/s")
    t = ms(lambda: F.linear(x, W)); print(f"  gpt2 fc fwd no bias: {t:.3f} ms {f / t / 1e9:.0f} TFLOP/s")
    t = ms(lambda: g @ W); print(f"  gpt2 fc dX (M x 3072)(3072 x 768): {t:.3f} ms {f / t / 1e9:.0f} TFLOP/s")
    t = ms(lambda: g.t() @ x); print(f"  gpt2 fc dW (3072 x M)(M x 768): {t:.3f} ms {f / t / 1e9:.0f} TFLOP/s")
    Wp = r(C, 4 * C)
    t = ms(lambda: F.linear(g, Wp, b[:C])); print(f"  gpt2 proj fwd +bias (M x 3072)(3072 x 768): {t:.3f} ms {f / t / 1e9:.0f} TFLOP/s")
    t = ms(lambda: x @ Wp); print(f"  gpt2 proj dX (M x 768)(768 x 3072): {t:.3f} ms {f / t / 1e9:.0f} TFLOP/s")
