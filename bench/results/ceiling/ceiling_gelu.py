"""Session 12 (as .gpu/s12gelu.py): is exact GELU compute-bound on the H200? GELU(x + b) forward and backward (with the bias
gradient) on the GPT-2 fc output (32768 x 3072 bf16), compiled: erf (F.gelu), tanh (F.gelu tanh), and an
erfc-polynomial form (A&S 7.1.26, one exp shared by the cdf and the pdf). CUDA events, median of 20."""
import math, os, sys, torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ceiling_mm import ms  # noqa: E402
dev = "cuda"
A = (0.254829592, -0.284496736, 1.421413741, -1.453152027, 1.061405429)
P, S2, SPI = 0.3275911, 1 / math.sqrt(2), 1 / math.sqrt(2 * math.pi)


def cdf_pdf(xf):
    z = xf.abs() * S2
    t = 1 / (1 + P * z)
    e = torch.exp(-z * z)
    q = 0.5 * t * (A[0] + t * (A[1] + t * (A[2] + t * (A[3] + t * A[4])))) * e
    return torch.where(xf >= 0, 1 - q, q), e * SPI


class PolyGELU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        xf = x.float()
        return (xf * cdf_pdf(xf)[0]).to(x.dtype)

    @staticmethod
    def backward(ctx, g):
        x, = ctx.saved_tensors
        xf = x.float()
        c, p = cdf_pdf(xf)
        return (g.float() * (c + xf * p)).to(g.dtype)


if __name__ == "__main__":
    h = torch.randn(32768, 3072, device=dev, dtype=torch.bfloat16)
    b = torch.zeros(3072, device=dev, dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(32768, 3072, device=dev, dtype=torch.bfloat16)
    xs = torch.linspace(-8, 8, 100001, device=dev, dtype=torch.float64)
    for name, act in (("erf", F.gelu), ("tanh", lambda x: F.gelu(x, approximate="tanh")), ("poly", PolyGELU.apply)):
        fwd = torch.compile(lambda h, b: act(h + b))
        fb = torch.compile(lambda h, b, g: torch.autograd.grad(act(h + b), b, g))
        t1 = ms(lambda: fwd(h, b)); t2 = ms(lambda: fb(h, b, g))
        xf = xs.float().requires_grad_()
        y = act(xf.to(torch.float32))
        d, = torch.autograd.grad(y.sum(), xf)
        ref = 0.5 * xs * (1 + torch.erf(xs / math.sqrt(2)))
        dref = 0.5 * (1 + torch.erf(xs / math.sqrt(2))) + xs * torch.exp(-xs * xs / 2) / math.sqrt(2 * math.pi)
        print(f"{name:5s} fwd {t1:.3f} ms ({4 * h.numel() / t1 / 1e9:.0f} GB/s)  fwd+bwd(bias grad) {t2:.3f} ms | "
              f"fp32 max abs err {(y.double() - ref).abs().max():.2e}, grad {(d.double() - dref).abs().max():.2e}")
