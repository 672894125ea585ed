"""chunked.py's loss without logits against the materialised head (fp32, relative error <= 1e-5).

Proves:
- linear_cross_entropy equals F.cross_entropy of x W[:vocab]^T / temperature (padded rows left out)
  for reductions none / sum / mean, ignored targets, temperature 1 and 0.7, a chunk that does not
  divide the tokens: values and the gradients of x and W (a random upstream gradient for "none");
  a frozen W gets no gradient;
- chunked.use(model): a tiny Transformer (untied and tied embeddings) gives the same loss, per-token
  log-probs under temperature, and every parameter's gradient as the materialised model; a deepcopy
  of the model keeps its own chunked head;
- memory (tests/meter.py, storage bytes alive on CPU, forward + backward): the chunked path's
  peak is below a quarter of the materialised one's, and its largest tensor is one chunk's logits;
- TP2 (2 gloo processes): the vocab-parallel chunked loss equals the one-process materialised loss
  with rank 1's slice partly padding (vocab 97 of 128) and wholly padding (vocab 50 of 128):
  values, dx (after the head's Copy) and each rank's dW slice; a TP2 model (and TP2 with sequence
  parallelism) with chunked.use equals the one-process materialised model: loss, temperature
  log-probs, and every parameter's full gradient.
"""
import copy

import pytest
import torch
import torch.nn.functional as F
from distributed import assert_close, spawn, train_cfg
from meter import PeakBytes

import parallel
from memory import chunked
from model import IGNORE, ModelConfig, Transformer
from parallelism import tp

MODEL = dict(vocab_size=97, pad_vocab_multiple=32, n_layer=2, n_head=4, n_kv_head=2, n_embd=32, block_size=16)


def reference(x, w, targets, reduction, temperature, vocab):
    logits = (x @ w[:vocab].T) / temperature
    loss = F.cross_entropy(logits.flatten(0, -2), targets.flatten(), ignore_index=IGNORE, reduction=reduction)
    return loss.view(targets.shape) if reduction == "none" else loss


def case(seed=0, B=3, T=15, C=16, rows=128, vocab=101):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, C, generator=g)
    w = torch.randn(rows, C, generator=g) * 0.5
    t = torch.randint(0, vocab, (B, T), generator=g)
    t[:, :2] = IGNORE
    t[0, 5], t[1, 6] = 0, vocab - 1
    return x, w, t


@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_equals_materialised(reduction, temperature):
    x, w, t = case()
    up = torch.randn(t.shape, generator=torch.Generator().manual_seed(1))
    out = {}
    for name in ("ref", "chunked"):
        xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
        if name == "ref":
            loss = reference(xx, ww, t, reduction, temperature, 101)
        else:
            loss = chunked.linear_cross_entropy(xx, ww, t, reduction, temperature, chunk=7, vocab_size=101)
        (loss * up).sum().backward() if reduction == "none" else loss.backward()
        out[name] = dict(loss=loss.detach(), dx=xx.grad, dw=ww.grad)
    assert_close(out["chunked"], out["ref"], f"{reduction}, T={temperature}")
    if reduction == "none":
        assert (out["chunked"]["loss"][:, :2] == 0).all()
    assert (out["chunked"]["dw"][101:] == 0).all()


def test_frozen_weight_gets_no_gradient():
    x, w, t = case()
    x.requires_grad_()
    chunked.linear_cross_entropy(x, w, t, chunk=4, vocab_size=101).backward()
    assert w.grad is None and x.grad is not None
    with pytest.raises(ValueError, match="chunk=0"):
        chunked.linear_cross_entropy(x, w, t, chunk=0)


def model_grads(model, x, y, **kw):
    model.zero_grad(set_to_none=True)
    loss = model(x, y, **kw)
    (loss.sum() if loss.dim() else loss).backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("tied", [False, True])
def test_model_equals_materialised(tied):
    torch.manual_seed(0)
    ref = Transformer(ModelConfig(**MODEL, tie_embeddings=tied))
    model = chunked.use(copy.deepcopy(ref), 5)
    g = torch.Generator().manual_seed(3)
    x, y = torch.randint(0, 97, (2, 16), generator=g), torch.randint(0, 97, (2, 16), generator=g)
    y[:, :4] = IGNORE
    for kw in (dict(), dict(reduction="none", temperature=0.7), dict(reduction="sum")):
        got, want = model_grads(model, x, y, **kw), model_grads(ref, x, y, **kw)
        assert_close(got[0], want[0], f"loss {kw}")
        assert_close(got[1], want[1], f"grads {kw}")
    twin = copy.deepcopy(model)  # the bound head_loss follows the copy, not the original
    assert twin.head_loss.__self__ is twin and model.head_loss.__self__ is model
    with torch.no_grad():
        assert torch.equal(twin(x, y), model(x, y))


def test_peak_memory_below_materialised():
    N, C, V, chunk = 512, 32, 4096, 64
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(N, C, generator=g).requires_grad_(), torch.randn(V, C, generator=g).requires_grad_()
    t = torch.randint(0, V, (N,), generator=g)
    peaks = {}
    for name in ("materialised", "chunked"):
        x.grad = w.grad = None
        with PeakBytes() as m:
            if name == "materialised":
                F.cross_entropy(x @ w.T, t).backward()
            else:
                chunked.linear_cross_entropy(x, w, t, chunk=chunk).backward()
        peaks[name] = m
    logits = N * V * 4
    assert peaks["materialised"].largest >= logits  # the (tokens, vocab) fp32 logits exist
    assert peaks["chunked"].largest <= max(chunk * V * 4, V * C * 4)  # one chunk's logits (or dW) at most
    assert peaks["chunked"].peak < peaks["materialised"].peak / 4, (peaks["chunked"].peak, peaks["materialised"].peak)


# ----------------------------------------------------------------------------- TP2

def _tp(rank, results):
    torch.manual_seed(0)
    cfg = train_cfg(MODEL, tp=2)
    grid = parallel.init(cfg)
    # the function: rank r holds rows [64 r, 64 r + 64) of the padded 128; vocab 97 and 50 (rank 1: all padding)
    for vocab in (97, 50):
        x, w, t = case(seed=vocab, rows=128, vocab=vocab)
        for temperature, reduction in ((1.0, "mean"), (0.7, "none")):
            up = torch.randn(t.shape, generator=torch.Generator().manual_seed(2))
            xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
            ref = reference(xr, wr, t, reduction, temperature, vocab)
            (ref * up).sum().backward() if reduction == "none" else ref.backward()
            xl, wl = x.clone().requires_grad_(), w[64 * rank:64 * rank + 64].clone().requires_grad_()
            got = chunked.linear_cross_entropy(tp.Copy.apply(xl, grid.tp_group), wl, t, reduction, temperature,
                                               chunk=8, vocab_size=vocab, group=grid.tp_group)
            (got * up).sum().backward() if reduction == "none" else got.backward()
            what = f"rank {rank} vocab {vocab} T={temperature}"
            assert_close(got.detach(), ref.detach(), f"{what} loss")
            assert_close(xl.grad, xr.grad, f"{what} dx")
            if vocab == 50 and rank == 1:
                assert (wl.grad == 0).all()
            else:
                assert_close(wl.grad, wr.grad[64 * rank:64 * rank + 64], f"{what} dW slice")
    # the model: TP2 (and sequence parallel) + chunked.use against one process, materialised
    g = torch.Generator().manual_seed(3)
    x, y = torch.randint(0, 97, (2, 16), generator=g), torch.randint(0, 97, (2, 16), generator=g)
    y[:, :3] = IGNORE
    for sp in (False, True):
        torch.manual_seed(0)
        ref = Transformer(ModelConfig(**MODEL))
        model = chunked.use(tp.tensor_parallel(copy.deepcopy(ref), grid, sequence_parallel=sp), 6)
        for kw in (dict(), dict(reduction="none", temperature=0.7)):
            got, want = model_grads(model, x, y, **kw), model_grads(ref, x, y, **kw)
            assert_close(got[0], want[0], f"sp={sp} loss {kw}")
            params = dict(model.named_parameters())
            full = {n: tp.full_tensor(params[n], gr, grid) for n, gr in got[1].items()}
            assert_close(full, want[1], f"sp={sp} grads {kw}")


def test_tp2_equals_one_process():
    spawn(_tp, 2, None)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (fused.py's kernels per chunk)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_model_matches_materialised(dtype):
    """On a GPU (Triton: fused.py's kernels per chunk), fp32 and bf16 autocast: loss and gradients of
    the chunked model against the materialised one (bf16: both round the logits to bf16)."""
    torch.manual_seed(0)
    ref = Transformer(ModelConfig(**dict(MODEL, vocab_size=5000, block_size=64))).cuda()
    model = chunked.use(copy.deepcopy(ref), 50)
    g = torch.Generator(device="cuda").manual_seed(3)
    x, y = (torch.randint(0, 5000, (4, 64), generator=g, device="cuda") for _ in range(2))
    y[:, :5] = IGNORE
    tol = (1e-5, 1e-5) if dtype == torch.float32 else (2e-3, 2e-2)
    with torch.autocast("cuda", dtype, enabled=dtype != torch.float32):
        for kw in (dict(), dict(reduction="none", temperature=0.7)):
            got, want = model_grads(model, x, y, **kw), model_grads(ref, x, y, **kw)
            assert_close(got[0], want[0], f"{dtype} loss {kw}", tol[0])
            assert_close(got[1], want[1], f"{dtype} grads {kw}", tol[1])
