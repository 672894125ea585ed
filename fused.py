"""Fused cross-entropy for the GPU: one Triton pass over the logits forward, one backward.

Why: at the 124M shape the loss is a pure memory problem. Its logits (tokens x 50k: 3.3 GB of
bf16 at batch 32) are read by the loss and its gradient written, and torch.compile's kernels for
F.cross_entropy take 4.6 ms per step for it, about twice the traffic needed (BENCHMARKS.md).
  forward:  each row's logsumexp in one online pass (running max, sum rescaled when the max
            grows), plus the target's logit; stores the nll and one fp32 lse per row.
  backward: (softmax - one_hot) * the row's incoming gradient, computed from the logits and the
            saved lse and written in the logits' dtype: nothing fp32 of the logits' size exists.

cross_entropy(logits, targets, ignore_index) -> per-row nll in fp32, 0 where the target is
ignore_index. Needs CUDA tensors, Triton and torch.library.triton_op (torch >= 2.6): `available()`
says whether it can run; model.py falls back to F.cross_entropy otherwise. Targets must lie in
[0, vocab) or be ignore_index: another value makes its row's loss NaN (F.cross_entropy raises).
The kernels launch on the current CUDA device, so the logits must live there
(torch.cuda.set_device, as parallel.init does for every rank).
tests/test_fused.py compares it with F.cross_entropy (values and gradients) on a GPU.
"""
import torch

try:
    import triton
    import triton.language as tl
    from torch.library import triton_op, wrap_triton
except ImportError:  # CPU builds of torch come without Triton; torch < 2.6 without triton_op
    triton = None

FWD_BLOCK, BWD_BLOCK = 4096, 4096  # columns per step; forward 4 warps (1.71 vs 1.90 ms with 8), backward 8


def available(logits):
    return triton is not None and logits.is_cuda


def cross_entropy(logits, targets, ignore_index=-100):
    """logits (N, V) with unit column stride (a vocab slice of wider rows is fine), targets (N,)."""
    return torch.ops.ingot.cross_entropy(logits, targets.contiguous(), ignore_index)[0]


if triton is not None:
    @triton.jit
    def _forward_kernel(logits, row_stride, targets, nll, lse, V, ignore_index, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        base = logits + row * row_stride
        cols = tl.arange(0, BLOCK)
        m = tl.full([], float("-inf"), tl.float32)  # running max
        s = tl.full([], 0.0, tl.float32)  # running sum of exp(x - m)
        for start in tl.range(0, V, BLOCK):
            x = tl.load(base + start + cols, mask=start + cols < V, other=float("-inf")).to(tl.float32)
            m_new = tl.maximum(m, tl.max(x, 0))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # all -inf so far: exp(-inf - -inf) is nan
            s = s * tl.exp(m - m_safe) + tl.sum(tl.exp(x - m_safe), 0)
            m = m_new
        row_lse = m + tl.log(s)
        t = tl.load(targets + row)
        in_range = (t >= 0) & (t < V)
        x_t = tl.load(base + tl.where(in_range, t, 0)).to(tl.float32)
        # an ignored target counts 0; one outside [0, V) makes the loss NaN, loudly wrong
        tl.store(lse + row, row_lse)
        tl.store(nll + row, tl.where(t == ignore_index, 0.0, tl.where(in_range, row_lse - x_t, float("nan"))))

    @triton.jit
    def _backward_kernel(logits, row_stride, grad, targets, lse, dnll, V, ignore_index, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < V
        t = tl.load(targets + row)
        x = tl.load(logits + row * row_stride + cols, mask=mask, other=0.0).to(tl.float32)
        d = (tl.exp(x - tl.load(lse + row)) - tl.where(cols == t, 1.0, 0.0)) * tl.load(dnll + row)
        d = tl.where(t == ignore_index, 0.0, d)  # not d * 0: an ignored row's d may be nan
        tl.store(grad + row * V + cols, d.to(grad.dtype.element_ty), mask=mask)

    # custom ops, so torch.compile traces them as opaque calls into the two kernels
    @triton_op("ingot::cross_entropy", mutates_args=())
    def _cross_entropy(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int) -> tuple[torch.Tensor, torch.Tensor]:
        N, V = logits.shape
        assert logits.stride(1) == 1 and targets.shape == (N,), "logits (N, V) with unit column stride, targets (N,)"
        nll = torch.empty(N, device=logits.device, dtype=torch.float32)
        lse = torch.empty_like(nll)
        wrap_triton(_forward_kernel)[(N,)](logits, logits.stride(0), targets, nll, lse, V, ignore_index,
                                           BLOCK=FWD_BLOCK, num_warps=4)
        return nll, lse

    @triton_op("ingot::cross_entropy_backward", mutates_args=())
    def _cross_entropy_backward(logits: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor,
                                dnll: torch.Tensor, ignore_index: int) -> torch.Tensor:
        N, V = logits.shape
        grad = torch.empty((N, V), device=logits.device, dtype=logits.dtype)
        wrap_triton(_backward_kernel)[(N, triton.cdiv(V, BWD_BLOCK))](
            logits, logits.stride(0), grad, targets, lse, dnll, V, ignore_index, BLOCK=BWD_BLOCK, num_warps=8)
        return grad

    def _setup_context(ctx, inputs, output):
        logits, targets, ctx.ignore_index = inputs
        ctx.save_for_backward(logits, targets, output[1])

    def _backward(ctx, dnll, _dlse):  # lse is an internal output: its gradient is never used
        logits, targets, lse = ctx.saved_tensors
        dnll = dnll.float().contiguous()  # a mean/sum's gradient arrives expanded (stride 0)
        return torch.ops.ingot.cross_entropy_backward(logits, targets, lse, dnll, ctx.ignore_index), None, None

    _cross_entropy.register_autograd(_backward, setup_context=_setup_context)
