"""GPU kernels and the head's arithmetic: a fused cross-entropy (training), one decode step's attention,
the head's matmul in FP8, and the logits' soft cap.

    nll = fused.cross_entropy(logits, targets, ignore_index, softcap)  # (N,) fp32, 0 where ignored: model.py's loss
    out = fused.decode_attention(q, k, v, bias)                # generate.py's captured decode step
    fused.available(logits)                                    # can the Triton kernels run here?
    head = fused.FP8Linear(C, V, bias=False)                   # model.py's head with fp8_head=True
    logits = fused.softcap(z, 15.0)                            # cap * tanh(z / cap): logit_softcap

The Triton kernels are registered as custom ops, so torch.compile traces each as one opaque call; the
registration, at import, is this file's one import-time effect. They need CUDA tensors, Triton and
torch.library.triton_op (torch >= 2.6): `available()` says whether they can run; model.py falls
back to F.cross_entropy otherwise, generate.py to SDPA. The kernels launch on the current CUDA
device, so the tensors must live there (torch.cuda.set_device, as parallel.init does for every
rank). Why each kernel exists and how it works: cross_entropy, decode_attention, FP8Matmul.
IGNORE: the target id that contributes no loss.

Invariants: each kernel computes what its plain-PyTorch reference does, within rounding
(tests/test_fused.py compares values and gradients on a GPU; tests/test_speedrun_model.py the FP8
matmul); the cross-entropy allocates nothing fp32 of the logits' size; a target outside [0, vocab)
that is not ignore_index makes its row's loss NaN (F.cross_entropy raises). FP8Linear is nn.Linear
exactly wherever FP8 does not run (evaluation, CPU, a GPU below compute capability 8.9).
"""
import torch
import torch.nn as nn

try:
    import triton
    import triton.language as tl
    from torch.library import custom_op, triton_op, wrap_triton
except ImportError:  # CPU builds of torch come without Triton; torch < 2.6 without triton_op
    triton = None

IGNORE = -100  # the target id that contributes no loss (prompt tokens, padding); model.py re-exports it
FWD_BLOCK, BWD_BLOCK = 4096, 4096  # columns per step; forward 4 warps (1.71 vs 1.90 ms with 8), backward 8


def available(logits):
    return triton is not None and logits.is_cuda


def decode_attention(q, k, v, bias, chunk=32, warps=1):
    """q (R, H, 1, D) over k, v (R, KV, L, D) (H a multiple of KV, unit stride in D), bias (R, 1, 1, L)
    added to the scores (0 or -inf; every row has a real key) -> (R, H, 1, D) in v's dtype, fp32 inside.
    chunk: keys per program (a power of two); warps: per program. The defaults were the fastest or
    within 20% of it at every KV length 128-320 of the 124M and ~1B shapes, B = 64 (BENCHMARKS.md).
    Why: SDPA's kernels tile 16-128 queries, and a decode step has one per head, so they spend well
    over the time the cache's bytes need (BENCHMARKS.md). Here one program per (row, kv head, chunk
    of keys) loads its keys and values at once and scores them for each of the kv head's query heads
    (GQA reads the cache once); a second kernel combines the chunks' softmaxes (flash-decoding), 16
    chunks at a time, skipped when one chunk holds every key. All math is on 2-D tiles (3-D
    broadcasts lost to cuDNN past 128 keys)."""
    return torch.ops.ingot.decode_attention(q, k, v, bias.reshape(bias.shape[0], -1), chunk, warps)


def cross_entropy(logits, targets, ignore_index=IGNORE, softcap=0.0):
    """logits (N, V) with unit column stride (a vocab slice of wider rows is fine), targets (N,) ->
    per-row nll in fp32 of softcap(logits, softcap) (below; 0: the logits as they are), 0 where the
    target is ignore_index. The cap is applied inside both kernels, on the fp32 values they load: the
    capped logits are never stored, and backward multiplies by the cap's derivative 1 - (capped / c)^2.
    Why: at the 124M shape the loss is a pure memory problem. Its logits (tokens x 50k: 3.3 GB of
    bf16 at batch 32) are read by the loss and its gradient written, and torch.compile's kernels for
    F.cross_entropy run well below the copy bandwidth there (BENCHMARKS.md).
      forward:  each row's logsumexp in one online pass (running max, sum rescaled when the max
                grows), plus the target's logit; stores the nll and one fp32 lse per row.
      backward: (softmax - one_hot) * the row's incoming gradient, computed from the logits and the
                saved lse and written in the logits' dtype: nothing fp32 of the logits' size exists."""
    return torch.ops.ingot.cross_entropy(logits, targets.contiguous(), ignore_index, float(softcap))[0]


def softcap(z, cap):
    """Logits z squashed into (-cap, cap): cap * tanh(z / cap) (Gemma 2, modded-nanogpt's tanh form), in z's
    dtype; cap 0: z itself. ModelConfig.logit_softcap: every path that makes logits applies it (model.py,
    tp.VocabParallelHead, memory/chunked.py)."""
    return cap * torch.tanh(z / cap) if cap else z


# ----------------------------------------------------------------------------- the head's matmul in FP8

def has_fp8(device):
    """Whether `device` runs FP8 matmuls (torch._scaled_mm): an NVIDIA GPU of compute capability >= 8.9 (Ada,
    Hopper and later). (torch.compile folds get_device_properties to a constant.)"""
    device = torch.device(device)
    if device.type != "cuda" or torch.version.hip is not None or not hasattr(torch, "_scaled_mm"):
        return False
    props = torch.cuda.get_device_properties(device)
    return (props.major, props.minor) >= (8, 9)


def to_fp8(t, dtype):
    """t -> (t / scale in the FP8 dtype, scale): one fp32 scale per tensor, amax(|t|) / the dtype's largest
    value, so the largest entry lands on the format's top (torchao's dynamic "tensorwise" scaling)."""
    top = torch.finfo(dtype).max
    scale = t.detach().abs().amax().float().clamp(min=1e-12) / top
    return (t.float() / scale).clamp(-top, top).to(dtype).contiguous(), scale  # (row-major, as _scaled_mm's a)


def scaled_mm(a8, b8, sa, sb, out_dtype, fast=False):
    """(a8 * sa) @ (b8 * sb) in out_dtype, a8 (M, K) row-major, b8 (K, N) column-major: torch._scaled_mm."""
    return torch._scaled_mm(a8, b8, scale_a=sa, scale_b=sb, out_dtype=out_dtype, use_fast_accum=fast)


class FP8Matmul(torch.autograd.Function):
    """x (N, C) @ w (V, C)^T with both cast to float8_e4m3fn (per-tensor scales: to_fp8), fp32 accumulation.
    Backward: the output gradient cast to float8_e5m2 (more range, less precision, as torchao and
    modded-nanogpt), then dx = g w and dw = g^T x as two more FP8 matmuls on the saved FP8 x and w (1 byte a
    value kept for backward). Output in out_dtype, dx in x's dtype, dw fp32 then w's dtype.
    modded-nanogpt fixes the scales by hand for its model (x 2, w 32, grad 2^29); here they follow the tensors."""

    @staticmethod
    def forward(ctx, x, w, out_dtype):
        x8, sx = to_fp8(x, torch.float8_e4m3fn)
        w8, sw = to_fp8(w, torch.float8_e4m3fn)
        ctx.save_for_backward(x8, sx, w8, sw)
        ctx.dtypes = x.dtype, w.dtype
        return scaled_mm(x8, w8.t(), sx, sw, out_dtype, fast=True)

    @staticmethod
    def backward(ctx, g):
        x8, sx, w8, sw = ctx.saved_tensors
        g8, sg = to_fp8(g, torch.float8_e5m2)
        dx = scaled_mm(g8, w8.t().contiguous().t(), sg, sw, ctx.dtypes[0]) if ctx.needs_input_grad[0] else None
        dw = scaled_mm(g8.t().contiguous(), x8.t().contiguous().t(), sg, sx, torch.float32).to(ctx.dtypes[1]) \
            if ctx.needs_input_grad[1] else None
        return dx, dw, None


def fp8_fits(x, w):
    """FP8Matmul can run x (..., C) @ w^T here: a device with FP8, every matmul dimension a multiple of 16."""
    return has_fp8(x.device) and x.shape[-1] % 16 == 0 and w.shape[0] % 16 == 0 and (x.numel() // x.shape[-1]) % 16 == 0


def fp8_matmul(x, w):
    """x (..., C) @ w (V, C)^T through FP8Matmul, out in the autocast dtype (else x's)."""
    dev = x.device.type
    out = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype
    with torch.autocast(dev, enabled=False):
        return FP8Matmul.apply(x.reshape(-1, x.shape[-1]), w, out).view(*x.shape[:-1], w.shape[0])


class FP8Linear(nn.Linear):
    """A bias-free nn.Linear whose matmul runs in FP8 (fp8_matmul) while it trains where fp8_fits; nn.Linear's
    own matmul otherwise: evaluation and generation (modded-nanogpt's rule), a CPU, an older GPU, odd shapes.
    model.py's head with fp8_head=True; tp.VocabParallelHead keeps the choice for its slice."""

    def forward(self, x):
        if self.training and self.bias is None and fp8_fits(x, self.weight):
            return fp8_matmul(x, self.weight)
        return super().forward(x)


if triton is not None:
    @triton.jit
    def _cap(x, CAP: tl.constexpr):
        """CAP * tanh(x / CAP) as 2 sigmoid(2y) - 1 = tanh(y) (no tanh in every Triton); CAP 0: x."""
        if CAP > 0:
            x = CAP * (2 * tl.sigmoid(2 * x / CAP) - 1)
        return x

    @triton.jit
    def _forward_kernel(logits, row_stride, targets, nll, lse, V, ignore_index, BLOCK: tl.constexpr,
                        CAP: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        base = logits + row * row_stride
        cols = tl.arange(0, BLOCK)
        m = tl.full([], float("-inf"), tl.float32)  # running max
        s = tl.full([], 0.0, tl.float32)  # running sum of exp(x - m)
        for start in tl.range(0, V, BLOCK):
            inside = start + cols < V
            x = tl.load(base + start + cols, mask=inside, other=float("-inf")).to(tl.float32)
            if CAP > 0:  # capped, the padding's -inf would be -CAP: padding again
                x = tl.where(inside, _cap(x, CAP), float("-inf"))
            m_new = tl.maximum(m, tl.max(x, 0))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # all -inf so far: exp(-inf - -inf) is nan
            s = s * tl.exp(m - m_safe) + tl.sum(tl.exp(x - m_safe), 0)
            m = m_new
        row_lse = m + tl.log(s)
        t = tl.load(targets + row)
        in_range = (t >= 0) & (t < V)
        x_t = _cap(tl.load(base + tl.where(in_range, t, 0)).to(tl.float32), CAP)
        # an ignored target counts 0; one outside [0, V) makes the loss NaN, loudly wrong
        tl.store(lse + row, row_lse)
        tl.store(nll + row, tl.where(t == ignore_index, 0.0, tl.where(in_range, row_lse - x_t, float("nan"))))

    @triton.jit
    def _backward_kernel(logits, row_stride, grad, targets, lse, dnll, V, ignore_index, BLOCK: tl.constexpr,
                         CAP: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < V
        t = tl.load(targets + row)
        x = _cap(tl.load(logits + row * row_stride + cols, mask=mask, other=0.0).to(tl.float32), CAP)
        d = (tl.exp(x - tl.load(lse + row)) - tl.where(cols == t, 1.0, 0.0)) * tl.load(dnll + row)
        if CAP > 0:  # through the cap: d(c tanh(z / c)) / dz = 1 - tanh^2
            d = d * (1 - (x / CAP) * (x / CAP))
        d = tl.where(t == ignore_index, 0.0, d)  # not d * 0: an ignored row's d may be nan
        tl.store(grad + row * V + cols, d.to(grad.dtype.element_ty), mask=mask)

    # custom ops, so torch.compile traces them as opaque calls into the two kernels
    @triton_op("ingot::cross_entropy", mutates_args=())
    def _cross_entropy(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int,
                       softcap: float) -> tuple[torch.Tensor, torch.Tensor]:
        N, V = logits.shape
        assert logits.stride(1) == 1 and targets.shape == (N,), "logits (N, V) with unit column stride, targets (N,)"
        nll = torch.empty(N, device=logits.device, dtype=torch.float32)
        lse = torch.empty_like(nll)
        wrap_triton(_forward_kernel)[(N,)](logits, logits.stride(0), targets, nll, lse, V, ignore_index,
                                           BLOCK=FWD_BLOCK, CAP=softcap, num_warps=4)
        return nll, lse

    @triton_op("ingot::cross_entropy_backward", mutates_args=())
    def _cross_entropy_backward(logits: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor,
                                dnll: torch.Tensor, ignore_index: int, softcap: float) -> torch.Tensor:
        N, V = logits.shape
        grad = torch.empty((N, V), device=logits.device, dtype=logits.dtype)
        wrap_triton(_backward_kernel)[(N, triton.cdiv(V, BWD_BLOCK))](
            logits, logits.stride(0), grad, targets, lse, dnll, V, ignore_index, BLOCK=BWD_BLOCK, CAP=softcap,
            num_warps=8)
        return grad

    def _setup_context(ctx, inputs, output):
        logits, targets, ctx.ignore_index, ctx.softcap = inputs
        ctx.save_for_backward(logits, targets, output[1])

    def _backward(ctx, dnll, _dlse):  # lse is an internal output: its gradient is never used
        logits, targets, lse = ctx.saved_tensors
        dnll = dnll.float().contiguous()  # a mean/sum's gradient arrives expanded (stride 0)
        grad = torch.ops.ingot.cross_entropy_backward(logits, targets, lse, dnll, ctx.ignore_index, ctx.softcap)
        return grad, None, None, None

    _cross_entropy.register_autograd(_backward, setup_context=_setup_context)

    # ------------------------------------------------------------------ one decode step's attention
    @triton.jit
    def _decode_chunk_kernel(q, k, v, bias, out, part_acc, part_max, part_sum, L, H, NS,
                             sq_r, sq_h, sk_r, sk_h, sk_l, sv_r, sv_h, sv_l, sb_r,
                             SCALE: tl.constexpr, G: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
                             CHUNK: tl.constexpr, ONE: tl.constexpr):
        r = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1).to(tl.int64)  # the kv head; its query heads are h*G .. h*G+G-1
        c = tl.program_id(2)  # the chunk of keys c*CHUNK .. c*CHUNK+CHUNK-1
        d = tl.arange(0, DP)
        j = c * CHUNK + tl.arange(0, CHUNK)
        okd, okj = d < D, j < L
        # keys, values and bias are loaded before any math: one memory round trip per program
        kb = tl.load(k + r * sk_r + h * sk_h + j[:, None] * sk_l + d[None, :], mask=okj[:, None] & okd[None, :], other=0.0)
        vb = tl.load(v + r * sv_r + h * sv_h + j[:, None] * sv_l + d[None, :], mask=okj[:, None] & okd[None, :], other=0.0)
        b = tl.load(bias + r * sb_r + j, mask=okj, other=float("-inf")).to(tl.float32)
        for g in tl.static_range(G):
            hq = h * G + g
            qg = tl.load(q + r * sq_r + hq * sq_h + d, mask=okd, other=0.0).to(tl.float32)
            x = tl.sum(kb.to(tl.float32) * qg[None, :], 1) * SCALE + b  # (CHUNK,) scores
            m = tl.max(x, 0)  # -inf when the chunk holds no real key
            p = tl.exp(x - tl.where(m == float("-inf"), 0.0, m))
            acc = tl.sum(vb.to(tl.float32) * p[:, None], 0)  # (DP,) not yet divided by the sum
            if ONE:  # one chunk holds every key: the output itself
                tl.store(out + (r * H + hq) * D + d, (acc / tl.sum(p, 0)).to(out.dtype.element_ty), mask=okd)
            else:
                at = (r * H + hq) * NS + c
                tl.store(part_acc + at * D + d, acc, mask=okd)
                tl.store(part_max + at, m)
                tl.store(part_sum + at, tl.sum(p, 0))

    @triton.jit
    def _decode_combine_kernel(out, part_acc, part_max, part_sum, NS,
                               D: tl.constexpr, DP: tl.constexpr, CB: tl.constexpr):
        rh = tl.program_id(0).to(tl.int64)  # row * H + head: out is (R, H, 1, D) contiguous
        d = tl.arange(0, DP)
        okd = d < D
        M = tl.full([], float("-inf"), tl.float32)  # running max over the chunks so far
        s = tl.full([], 0.0, tl.float32)
        acc = tl.zeros([DP], tl.float32)
        for c0 in range(0, NS, CB):  # CB chunks at a time: a long cache needs no larger tile
            c = c0 + tl.arange(0, CB)
            okc = c < NS
            m = tl.load(part_max + rh * NS + c, mask=okc, other=float("-inf"))
            M_new = tl.maximum(M, tl.max(m, 0))
            M_safe = tl.where(M_new == float("-inf"), 0.0, M_new)  # no real key yet: nothing to weigh
            w = tl.exp(m - M_safe)  # chunks without a real key (m = -inf) weigh 0
            a = tl.exp(M - M_safe)
            s = s * a + tl.sum(tl.load(part_sum + rh * NS + c, mask=okc, other=0.0) * w, 0)
            pa = tl.load(part_acc + (rh * NS + c[:, None]) * D + d[None, :], mask=okc[:, None] & okd[None, :], other=0.0)
            acc = acc * a + tl.sum(pa * w[:, None], 0)
            M = M_new
        tl.store(out + rh * D + d, (acc / s).to(out.dtype.element_ty), mask=okd)

    # An opaque custom op, not a triton_op: inductor then neither traces into the kernels nor analyses
    # them at every compile of a decode step (one per KV bucket), which made generate.decode's first
    # call, which compiles and captures every bucket, far slower (BENCHMARKS.md). Inside the CUDA
    # graph the same kernels run.
    @custom_op("ingot::decode_attention", mutates_args=())
    def _decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor,
                          chunk: int, warps: int) -> torch.Tensor:
        R, H, T, D = q.shape
        KV, L = k.shape[1], k.shape[2]
        assert T == 1 and H % KV == 0 and k.shape == v.shape == (R, KV, L, D) and bias.shape == (R, L), \
            f"q (R, H, 1, D), k and v (R, KV, L, D), bias (R, L): got {q.shape}, {k.shape}, {v.shape}, {bias.shape}"
        assert q.stride(-1) == k.stride(-1) == v.stride(-1) == bias.stride(-1) == 1, "unit stride in the last dimension"
        assert chunk > 0 and chunk & (chunk - 1) == 0, f"chunk={chunk} must be a power of two"
        DP = triton.next_power_of_2(D)
        # a program holds its chunk's keys and values in registers: far past that, Triton's compile alone
        # takes long (BENCHMARKS.md: 1024 x 64 on 1 warp against 256 x 64, 512 values per thread)
        assert chunk * DP <= 16384 * warps, (f"chunk={chunk} keys x {DP} (head dim, padded) over warps={warps}: more than "
                                             f"512 values per thread; use a smaller chunk or more warps")
        NS = triton.cdiv(L, chunk)
        out = torch.empty(R, H, 1, D, device=q.device, dtype=v.dtype)
        # the chunks' partial softmaxes; one chunk writes out itself (the pointers below go unused)
        part = [torch.empty(R, H, NS, *s, device=q.device, dtype=torch.float32) for s in ((D,), (), ())] if NS > 1 else [out] * 3
        _decode_chunk_kernel[(R, KV, NS)](
            q, k, v, bias, out, *part, L, H, NS, q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2), bias.stride(0),
            SCALE=D ** -0.5, G=H // KV, D=D, DP=DP, CHUNK=chunk, ONE=NS == 1, num_warps=warps)
        if NS > 1:
            _decode_combine_kernel[(R * H,)](out, *part, NS, D=D, DP=DP, CB=min(16, triton.next_power_of_2(NS)),
                                             num_warps=1 if D <= 64 else 2)
        return out

    @_decode_attention.register_fake
    def _decode_attention_shape(q, k, v, bias, chunk, warps):
        return q.new_empty(q.shape, dtype=v.dtype)
