"""fused.py's Triton kernels against PyTorch's own, on a GPU. Skipped without CUDA (CPU builds of
torch have no Triton).

cross_entropy equals F.cross_entropy: per-row values and gradients for fp32 and bf16 logits, plain and
soft-capped (cap * tanh(logits / cap) before the loss: model.py's logit_softcap), a vocabulary slice of
wider rows (the model's padded head), ignored targets and a vocabulary that is no multiple of the
kernel's block; the same through Transformer.loss's three reductions, under torch.compile, and for a
whole model's gradients against the F.cross_entropy path (plain and soft-capped).

decode_attention equals SDPA over the same masked keys in fp32 and bf16 (MHA, GQA, MQA, a head size
that is no power of two; chunks holding only padding or only unwritten slots, a last chunk cut short;
one chunk, a few, and more than the combine kernel takes at once), and is the same traced by
torch.compile and replayed from a CUDA graph; a tile too large for registers is refused."""
import pytest
import torch
import torch.nn.functional as F

import fused
from model import IGNORE, ModelConfig, Transformer

pytestmark = pytest.mark.skipif(not (torch.cuda.is_available() and fused.triton is not None),
                                reason="needs a CUDA GPU and Triton")


def case(dtype, N=300, V=5000, pad=120, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    full = (3 * torch.randn(N, V + pad, device="cuda", generator=g)).to(dtype)
    logits = full[:, :V]  # row stride V + pad, as the model's vocab slice
    targets = torch.randint(0, V, (N,), device="cuda", generator=g)
    targets[::7] = IGNORE
    targets[1], targets[2] = 0, V - 1
    return logits, targets


@pytest.mark.parametrize("cap", [0.0, 2.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_torch(dtype, cap):
    logits, targets = case(dtype)
    x = logits.detach().requires_grad_()
    got = fused.cross_entropy(x, targets, IGNORE, cap)
    dnll = torch.randn_like(got)
    (got * dnll).sum().backward()
    ref_x = logits.detach().float().requires_grad_()
    want = F.cross_entropy(cap * torch.tanh(ref_x / cap) if cap else ref_x, targets, ignore_index=IGNORE,
                           reduction="none")
    (want * dnll).sum().backward()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert x.grad.dtype == dtype and x.grad.shape == logits.shape
    rtol = 1e-6 if dtype == torch.float32 else 1e-2  # bf16 gradient: one rounding of the exact value
    torch.testing.assert_close(x.grad.float(), ref_x.grad, rtol=rtol, atol=1e-6)
    assert (x.grad[targets == IGNORE] == 0).all()


@pytest.mark.parametrize("compiled", [False, True])
def test_transformer_loss_reductions(compiled):
    logits, targets = case(torch.bfloat16, N=2 * 150)
    logits, targets = logits.view(2, 150, -1), targets.view(2, 150)
    fn = torch.compile(Transformer.loss) if compiled else Transformer.loss
    for red in ("mean", "sum", "none"):
        x = logits.detach().requires_grad_()
        got = fn(x, targets, red)
        got.sum().backward()
        ref_x = logits.detach().float().requires_grad_()
        want = F.cross_entropy(ref_x.flatten(0, 1), targets.flatten(), ignore_index=IGNORE, reduction=red)
        want = want.view(targets.shape) if red == "none" else want
        want.sum().backward()
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(x.grad.float(), ref_x.grad, rtol=1e-2, atol=1e-5)


@pytest.mark.parametrize("cap", [0.0, 10.0])
def test_model_gradients_match_fallback(monkeypatch, cap):
    cfg = ModelConfig(vocab_size=1000, pad_vocab_multiple=128, block_size=64, n_layer=2, n_head=4, n_embd=64,
                      logit_softcap=cap)
    torch.manual_seed(0)
    model = Transformer(cfg).cuda()
    x = torch.randint(0, 1000, (4, 64), device="cuda")
    y = torch.randint(0, 1000, (4, 64), device="cuda")
    y[0, :10] = IGNORE
    grads = []
    for use in (True, False):
        monkeypatch.setattr(fused, "available", lambda logits, use=use: use)
        model.zero_grad()
        loss = model(x, y)
        loss.backward()
        grads.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    torch.testing.assert_close(grads[0][0], grads[1][0], rtol=1e-6, atol=1e-6)
    for n in grads[0][1]:
        torch.testing.assert_close(grads[0][1][n], grads[1][1][n], rtol=1e-5, atol=1e-6, msg=n)


def attention_case(R, H, KV, D, S, L, dtype, seed=0):
    """q over the first L of S cache slots, as decode() passes them (views of the cache and of its
    (R, S) bias); rows left-padded by 0-39 slots, the last 24 of the L slots not yet written: chunks
    of 16 keys that hold only padding or only unwritten slots, and a last chunk cut short."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    kb, vb = (torch.randn(R, KV, S, D, device="cuda", generator=g).to(dtype) for _ in range(2))
    q = torch.randn(R, H, 1, D, device="cuda", generator=g).to(dtype)
    pad = torch.randint(0, 40, (R,), device="cuda", generator=g)
    j = torch.arange(S, device="cuda")
    real = (j[None] >= pad[:, None]) & (j[None] < L - 24)
    bias = torch.zeros(R, S, device="cuda", dtype=dtype).masked_fill_(~real, float("-inf"))
    return q, kb[:, :, :L], vb[:, :, :L], bias[:, None, None, :L]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(64, 12, 12, 64, 320, 192), (5, 16, 8, 128, 130, 77), (3, 6, 3, 80, 70, 64),
                                   (2, 4, 1, 64, 800, 700)], ids=["124m", "gqa_d128", "d80", "mqa_long"])
def test_decode_attention_matches_sdpa(dtype, shape):
    R, H, KV, D, S, L = shape
    q, k, v, bias = attention_case(R, H, KV, D, S, L, dtype)
    G = H // KV
    want = F.scaled_dot_product_attention(q.float(), k.float().repeat_interleave(G, 1),
                                          v.float().repeat_interleave(G, 1), attn_mask=bias.float())
    tol = 1e-5 if dtype == torch.float32 else 1e-2  # bf16: one rounding of the output
    # many chunks (over 16: the combine loops), a few, and one that holds every key (with more warps,
    # for a long one: fused refuses more than 512 values of a tile per thread)
    one, DP = 1 << (L - 1).bit_length(), 1 << (D - 1).bit_length()
    for chunk, warps in ((16, 1), (64, 1), (one, max(1, one * DP // 16384))):
        got = fused.decode_attention(q, k, v, bias, chunk=chunk, warps=warps)
        assert got.dtype == dtype and got.shape == q.shape
        torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol)


def test_decode_attention_refuses_a_tile_that_would_spill():
    q, k, v, bias = attention_case(2, 4, 1, 64, 800, 700, torch.bfloat16)
    with pytest.raises(AssertionError, match="more than 512 values per thread"):
        fused.decode_attention(q, k, v, bias, chunk=1024)  # 1024 keys x 64 on one warp: 31 s of compile
    assert fused.decode_attention(q, k, v, bias, chunk=1024, warps=4).shape == q.shape


def test_decode_attention_compiled_and_captured():
    q, k, v, bias = attention_case(8, 4, 4, 64, 200, 192, torch.bfloat16)
    want = fused.decode_attention(q, k, v, bias)
    f = torch.compile(lambda *a: fused.decode_attention(*a) * 2, fullgraph=True)
    torch.testing.assert_close(f(q, k, v, bias), want * 2)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = f(q, k, v, bias)
    q.mul_(-1)  # new inputs at the captured addresses
    graph.replay()
    torch.testing.assert_close(out, fused.decode_attention(q, k, v, bias) * 2)
