"""Chunked linear + cross-entropy: the loss from the last hidden state and the head's weight, never
holding tokens x vocab logits (Liger-Kernel's fused linear cross-entropy, in plain PyTorch).

    chunked.use(model, 1024)          # model.head_loss -> this file's head_loss (plain or TP head)
    loss = model(x, y)                # same losses and gradients as the materialised head, in chunks
    logp = -model(x, y, reduction="none", temperature=0.7)   # GRPO / DPO per-token log-probs

LinearCrossEntropy (an autograd Function) runs over `chunk` tokens at a time. Forward: the chunk's
logits z = x_c W^T / temperature, their logsumexp and the target's logit; only one fp32 logsumexp
per token is kept for backward. Backward recomputes each chunk's logits and turns them into
dz = (softmax(z) - onehot(target)) * g / temperature, then dx_c = dz W and dW += dz^T x_c: the
largest tensor alive is one chunk's logits, (chunk, vocab) instead of (tokens, vocab), before and
after the gradient. The price is one extra head matmul per chunk in backward (the recompute).

Under tensor parallelism (tp.VocabParallelHead) each rank holds a slice of the padded vocabulary,
rows [rank * V_local, (rank + 1) * V_local): each computes its chunk statistics, and three
all-reduces per forward (max, sum of exp, the target's logit) combine them, as tp.py's
vocab-parallel cross-entropy does; backward needs no collective (dx is a partial sum, completed by
the head's own tp.Copy / sequence-parallel entry, which head_loss applies first). Padding rows
(>= vocab_size) are never part of the softmax. Under bf16 autocast the matmuls run in bf16 and the
softmax in fp32; on a GPU with Triton a one-rank chunk goes through fused.py's kernels instead.
The head weight's gradient is computed only when it requires one (a frozen LoRA head skips it).
LoRA's token rows (lora.train_tokens) enter through head.token_rows_weight: the weight copied
with the rows in it, so its gradient (fp32, the head's size) is then computed. A soft cap
(logit_softcap = c) applies to each chunk's logits before the temperature, z -> c tanh(z / c), and
backward multiplies dz by its derivative 1 - (capped z / c)^2. The head's matmuls here are the
compute dtype's: fp8_head is refused with loss_chunk (check).
"""
import types

import torch
import torch.distributed as dist

import fused
from config import need
from parallelism import tp
from parallelism.tp import IGNORE

CHUNKED_DEFAULTS = dict(  # the chunked loss's config key
    loss_chunk=0,            # >0: the loss in chunks of N tokens from the last hidden state, no logits held (chunked.py)
)
RESUME_FREE = ("loss_chunk",)  # a resumed run may change it (lifecycle.RESUME_FREE)


def check(cfg, world=1):
    need(cfg.loss_chunk >= 0, f"loss_chunk={cfg.loss_chunk} must be >= 0 (0: the logits are materialised)")
    need(not (cfg.loss_chunk and getattr(cfg, "fp8_head", False)), f"fp8_head=True runs the head's matmul in FP8, "
         f"loss_chunk={cfg.loss_chunk} runs the head in chunks of its own (bf16): set fp8_head=False or loss_chunk=0")


def _world(group):
    return dist.get_world_size(group) if group is not None and dist.is_initialized() else 1


def _all_reduce(x, op, group):
    """Functional all-reduce (a new tensor), as tp.py's collectives: torch.compile traces it."""
    if _world(group) == 1:
        return x
    ops = torch.ops._c10d_functional
    return ops.wait_tensor(ops.all_reduce(x.contiguous(), op, group.group_name))


def _compute_dtype(x, weight):
    dev = x.device.type
    if torch.is_autocast_enabled(dev):
        return torch.get_autocast_dtype(dev)
    return torch.promote_types(x.dtype, weight.dtype)


def _fused_ok(z, group):
    """fused.py's Triton kernels for a one-rank chunk on a GPU."""
    return _world(group) == 1 and fused.available(z)


class LinearCrossEntropy(torch.autograd.Function):
    """x (N, C), weight (V_local, C) -> nll (N,) fp32 of softcap(x W^T, cap) / temperature over the whole
    (split) vocabulary; 0 where targets == ignore_index. See the module docstring."""

    @staticmethod
    def forward(ctx, x, weight, targets, temperature, chunk, vocab_size, ignore_index, group, cap=0.0):
        cd = _compute_dtype(x, weight)
        Vl = weight.shape[0]
        start = (dist.get_rank(group) if _world(group) > 1 else 0) * Vl
        n_real = max(0, min(Vl, vocab_size - start))  # rows of this slice that are real vocabulary
        w = weight[:n_real].to(cd)
        N = x.shape[0]
        m = torch.full((N,), float("-inf"), device=x.device)  # per-token max over this rank's columns
        s = torch.zeros(N, device=x.device)  # sum of exp(z - m)
        tl = torch.zeros(N, device=x.device)  # the target's logit, where this rank owns it
        fused_lse = None
        with torch.autocast(x.device.type, enabled=False):
            for a in range(0, N, chunk):
                b = min(a + chunk, N)
                if n_real == 0:
                    continue
                z = x[a:b].to(cd) @ w.T
                if _fused_ok(z, group):  # one rank: the Triton loss on the chunk's logits (cd, no fp32 copy)
                    z = fused.softcap(z, cap)
                    z = z if temperature == 1.0 else z / temperature
                    nll_c, lse_c = torch.ops.ingot.cross_entropy(z, targets[a:b].contiguous(), ignore_index, 0.0)
                    fused_lse = torch.empty(N, device=x.device) if fused_lse is None else fused_lse
                    fused_lse[a:b] = lse_c
                    tl[a:b] = lse_c - nll_c  # so that lse - tl is the kernel's nll
                    continue
                z = fused.softcap(z.float(), cap)
                if temperature != 1.0:
                    z = z / temperature
                t = targets[a:b] - start
                mine = (t >= 0) & (t < n_real)
                tl[a:b] = z.gather(-1, t.clamp(0, n_real - 1)[:, None]).squeeze(-1).masked_fill(~mine, 0.0)
                m[a:b] = z.max(dim=-1).values
                s[a:b] = z.sub_(m[a:b, None]).exp_().sum(dim=-1)  # in place: one chunk of logits alive
        if fused_lse is not None:
            lse = fused_lse
        else:
            M = _all_reduce(m, "max", group)
            s = _all_reduce(s * (m - M).exp(), "sum", group)
            lse = M + s.log()
            tl = _all_reduce(tl, "sum", group)
        valid = targets != ignore_index
        nll = (lse - tl).masked_fill(~valid, 0.0)
        ctx.save_for_backward(x, weight, targets, lse)
        ctx.conf = (temperature, chunk, start, n_real, ignore_index, cd, group, cap)
        return nll

    @staticmethod
    def backward(ctx, g):
        x, weight, targets, lse = ctx.saved_tensors
        temperature, chunk, start, n_real, ignore_index, cd, group, cap = ctx.conf
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        w = weight[:n_real].to(cd)
        g = g.float().masked_fill(targets == ignore_index, 0.0) / temperature  # d nll / d z, per token
        dx = torch.zeros(x.shape, dtype=torch.float32, device=x.device) if need_x else None
        dw = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        part = torch.empty(w.shape, dtype=cd, device=w.device) if need_w else None  # a chunk's dW, then added up
        N = x.shape[0]
        with torch.autocast(x.device.type, enabled=False):
            for a in range(0, N, chunk):
                b = min(a + chunk, N)
                if n_real == 0:
                    break
                xc = x[a:b].to(cd)
                z = xc @ w.T
                if _fused_ok(z, group):
                    z = fused.softcap(z, cap)
                    capped = 1 - (z / cap).square() if cap else None  # d softcap(z) / dz, before z is reused
                    zt = z if temperature == 1.0 else z / temperature
                    # the kernel's (softmax - onehot) * g_row, in cd; g already holds 1 / temperature
                    dz = torch.ops.ingot.cross_entropy_backward(zt, targets[a:b].contiguous(), lse[a:b].contiguous(),
                                                                g[a:b].contiguous(), ignore_index, 0.0)
                else:
                    z = fused.softcap(z.float(), cap)
                    capped = 1 - (z / cap).square() if cap else None
                    if temperature != 1.0:
                        z = z / temperature
                    dz = z.sub_(lse[a:b, None]).exp_()  # softmax, in place of the logits
                    t = targets[a:b] - start
                    mine = (t >= 0) & (t < n_real) & (targets[a:b] != ignore_index)
                    rows = mine.nonzero().squeeze(-1)
                    dz[rows, t[rows]] -= 1.0
                    dz = dz * g[a:b, None]
                if cap:
                    dz = dz * capped  # through the soft cap
                dz = dz.to(cd)
                if need_x:
                    dx[a:b] = (dz @ w).float()
                if need_w:
                    dw[:n_real] += torch.mm(dz.T, xc, out=part)  # (no fp32 copy of it: the add upcasts)
        return (dx.to(x.dtype) if need_x else None, dw.to(weight.dtype) if need_w else None,
                None, None, None, None, None, None, None)


def linear_cross_entropy(x, weight, targets, reduction="mean", temperature=1.0, chunk=1024,
                         vocab_size=None, ignore_index=IGNORE, group=None, softcap=0.0):
    """F.cross_entropy(fused.softcap(x W^T, softcap) / temperature, targets) without the logits. x (..., C),
    targets (...), weight (V_local, C): the head's rows (group None: every row; padded rows >= vocab_size
    are left out). Under TP (group: the TP group) x must already have entered the column-parallel region
    (tp.Copy, or the sequence-parallel gather): head_loss does that. reduction "none" (-> targets'
    shape, fp32, 0 where ignored: the negative log-probs), "sum" or "mean" (over counted tokens)."""
    if chunk <= 0:
        raise ValueError(f"chunk={chunk} must be a positive number of tokens")
    V = weight.shape[0] * _world(group) if vocab_size is None else vocab_size
    nll = LinearCrossEntropy.apply(x.reshape(-1, x.shape[-1]), weight, targets.reshape(-1), float(temperature),
                                   int(chunk), V, ignore_index, group, float(softcap))
    if reduction == "none":
        return nll.view(targets.shape)
    if reduction == "sum":
        return nll.sum()
    return nll.sum() / (targets != ignore_index).sum()


def head_loss(model, x, targets, reduction="mean", temperature=1.0):
    """model.Transformer.head_loss's contract, chunked: x (B, T, C) final hidden states -> the loss
    (or per-token nll) of the head's logits / temperature. Reads model.loss_chunk (set by use())."""
    head = model.head
    weight = head.weight
    if hasattr(head, "token_rows_weight"):  # lora.train_tokens: trainable rows of tokens just added
        weight = head.token_rows_weight(weight)
    if isinstance(head, tp.VocabParallelHead):
        g = head.group  # enter the column-parallel region as the head's own forward does
        x = tp.SequenceParallel.apply(x, g, True) if tp.sequence_sharded(head) else tp.Copy.apply(x, g)
        return linear_cross_entropy(x, weight, targets, reduction, temperature, model.loss_chunk,
                                    head.vocab_size, IGNORE, g, model.cfg.logit_softcap)
    return linear_cross_entropy(x, weight, targets, reduction, temperature, model.loss_chunk,
                                model.cfg.vocab_size, IGNORE, None, model.cfg.logit_softcap)


def use(model, chunk):
    """Compute model's loss in chunks of `chunk` tokens from now on (0: leave the materialised head).
    In place, on the instance, after tp.tensor_parallel and before FSDP / compile; a bound method,
    so copy.deepcopy(model) keeps it pointing at the copy. Returns model."""
    if chunk < 0:
        raise ValueError(f"loss_chunk={chunk} must be >= 0 (0: materialise the logits)")
    if chunk:
        model.loss_chunk = int(chunk)
        model.head_loss = types.MethodType(head_loss, model)
    return model
