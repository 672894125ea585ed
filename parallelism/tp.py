"""Tensor parallelism (Megatron style), written with plain collectives (functional ops: _collective).

    model = tp.tensor_parallel(Transformer(cfg), grid)  # full model (same seed on every rank), cut in place
    # (parallel.parallelize does this, then loading, EP, FSDP or DP; parallel.clip_grad_norm_ counts the slices)

attn.qkv and mlp.fc are column-parallel (each rank computes its heads / its slice of the hidden
units), attn.proj and mlp.proj row-parallel (each rank multiplies its input columns; one all-reduce
sums the partial outputs): two all-reduces per block forward, two backward. Embedding and head are
split over the (padded) vocabulary; the loss never gathers the logits. Value embeddings
(value_embeds) keep their columns of this rank's kv heads, as v's rows. MoE layers cut their own
experts (moe.MoE.tensor_parallel). Sequence parallelism (cfg.sequence_parallel): tensor_parallel.

Every cut parameter carries `p.tp_split = (dim, segments)`: along `dim` the full tensor is the
concatenation of segments (size, chunks); each is cut into `chunks` equal pieces, rank r holding
piece r * chunks // tp. chunks == tp: a plain shard; chunks < tp: ranks share a piece (kv heads
replicated when n_kv_head < tp; chunks == 1: q/k-norm weights). Slicing, gathering, checkpoints,
norm counting and the gradient sum of shared pieces all follow from it. Parameters without
tp_split (norms, row-parallel biases, positions) are replicated with identical gradients.
full_tensor / local_tensor turn a parameter's slices into its full tensor and back: the layout-free
state (parallel.py's full_state_dict and kin, checkpoints), hf_shard_fn reads an HF folder's slices.

Invariants: parameter names stay those of the one-process model; forward, gradients and loss equal
one process's; under torch.compile the training forward is one graph (_collective says how).
Not here: attention dropout draws the same masks on every TP rank; the gradient norm over every
layout (parallel.py).
"""
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import fused
from fused import IGNORE


def _size(group):
    return dist.get_world_size(group) if group is not None and dist.is_initialized() else 1


def _rank(group):
    return dist.get_rank(group) if group is not None and dist.is_initialized() else 0


def _collective(op, x, *args, group):
    """torch.ops._c10d_functional.<op>(x, *args, group's name), waited on at once: a new tensor.
    Every collective that can run inside a compiled graph (the autograd Functions below) is one of
    these functional ops, which torch.compile records as a collective op and a wait, in forward and,
    through AOTAutograd, in backward, rather than breaking the graph around them: the training
    forward is one graph, compiled once (tests/test_tp.py, with gloo on CPU; bench/bench_parallel.py
    check-compile, with NCCL on GPUs); inductor may move the waits to overlap compute. The ops
    themselves, not funcol's Python wrappers, whose names differ between torch versions; not the
    in-place dist.all_reduce, which compiled to wrong gradients on torch 2.11 (BENCHMARKS.md). An
    autograd input or incoming gradient is never mutated. The gradient hooks of shared pieces
    (shard) and DataParallel's run outside the graph, as in eager."""
    ops = torch.ops._c10d_functional
    return ops.wait_tensor(getattr(ops, op)(x.contiguous(), *args, group.group_name))


def _reduce(x, group, op="sum"):
    """Sum (or max: op="max") over the group into a new tensor."""
    return x if _size(group) == 1 else _collective("all_reduce", x, op, group=group)


def _gather(x, group):
    """Concatenate the ranks' tensors along the last dim, in rank order."""
    n = _size(group)
    if n == 1:
        return x
    out = _collective("all_gather_into_tensor", x, n, group=group)  # (n * B, ...) in rank order
    return torch.cat(out.chunk(n, dim=0), dim=-1)


def _split(x, group, dim=-1):
    """This rank's slice of dimension dim."""
    return x if _size(group) == 1 else x.chunk(_size(group), dim=dim)[_rank(group)].contiguous()


def _seq_gather(x, group):
    """(B, T/n, ...) sequence shards -> (B, T, ...), in rank order (sequence parallelism)."""
    n = _size(group)
    if n == 1:
        return x
    if x.dim() < 3:  # e.g. the head on one position of each row: which rank holds it?
        raise ValueError(f"sequence_parallel: expected (batch, sequence shard, ...) hidden states, got shape "
                         f"{tuple(x.shape)}: run this forward under torch.no_grad() (plain tensor parallelism)")
    out = _collective("all_gather_into_tensor", x, n, group=group)  # the ranks' shards one after the other
    return out.unflatten(0, (n, x.shape[0])).movedim(0, 1).flatten(1, 2)


def _seq_reduce_scatter(x, group):
    """(B, T, ...) partial sums -> this rank's sequence shard (B, T/n, ...) of their sum over the group."""
    n = _size(group)
    if n == 1:
        return x
    if x.shape[1] % n:
        raise ValueError(f"sequence_parallel: the sequence length {x.shape[1]} is not divisible by tp={n}: "
                         f"pad the batch, or set sequence_parallel=False")
    parts = x.unflatten(1, (n, x.shape[1] // n)).movedim(1, 0)  # (n, B, T/n, ...): rank r's part is [r]
    return _collective("reduce_scatter_tensor", parts.flatten(0, 1), "sum", n, group=group)


# ----------------------------------------------------------------------------- forward/backward pairs

class Copy(torch.autograd.Function):
    """Enter a column-parallel region: identity; backward sums the input gradients, because every
    rank's slice of the output depends on the same replicated input."""
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x
    @staticmethod
    def backward(ctx, g):
        return _reduce(g, ctx.group), None


class Reduce(torch.autograd.Function):
    """Leave a row-parallel region: sum the ranks' partial outputs; backward is identity (the
    sum's gradient reaches every partial unchanged)."""
    @staticmethod
    def forward(ctx, x, group):
        return _reduce(x, group)
    @staticmethod
    def backward(ctx, g):
        return g, None


class Gather(torch.autograd.Function):
    """All-gather the last dim; backward keeps this rank's slice of the gradient."""
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather(x, group)
    @staticmethod
    def backward(ctx, g):
        return _split(g, ctx.group), None


def sequence_sharded(module):
    """A layer's sequence_parallel applies to forwards that record gradients (training): one rule
    every layer of a forward agrees on. Without gradients (evaluation, generation with a KV cache:
    a single new token has no sequence to split) the layers run plain tensor parallelism, the same math."""
    return module.sequence_parallel and torch.is_grad_enabled()


class SequenceParallel(torch.autograd.Function):
    """Sequence parallelism's two transitions, each the other's backward. gather=True, entering a
    column-parallel matmul: all-gather the sequence shards (backward: reduce-scatter, summing every
    rank's gradient of the whole sequence). gather=False, leaving a row-parallel matmul or the
    embedding: reduce-scatter the partial sums over the sequence (backward: all-gather)."""
    @staticmethod
    def forward(ctx, x, group, gather):
        ctx.group, ctx.gather = group, gather
        return _seq_gather(x, group) if gather else _seq_reduce_scatter(x, group)
    @staticmethod
    def backward(ctx, g):
        return (_seq_reduce_scatter(g, ctx.group) if ctx.gather else _seq_gather(g, ctx.group)), None, None


# ----------------------------------------------------------------------------- cutting shards

def _piece(r, chunks, tp):
    return r * chunks // tp  # which piece of a segment rank r holds


def _first_holder(k, chunks, tp):
    return -(-k * tp // chunks)  # the lowest rank holding piece k


def counted_pieces(p, grid):
    """[(offset, length, counted)] along dim p.tp_split[0] of p's local tensor, one per segment:
    counted = this TP rank is the first holder of its piece, so that summing the counted pieces
    over the TP group covers every slice of the full tensor exactly once (gradient norms)."""
    dim, segments = p.tp_split
    out, off = [], 0
    for size, chunks in segments:
        first = _first_holder(_piece(grid.tp_rank, chunks, grid.tp), chunks, grid.tp)
        out.append((off, size // chunks, first == grid.tp_rank))
        off += size // chunks
    return out


def cut(full, dim, segments, r, tp):
    """Rank r's local tensor of `full` under the layout (dim, segments)."""
    assert sum(s for s, _ in segments) == full.shape[dim], (full.shape, dim, segments)
    out, off = [], 0
    for size, chunks in segments:
        n = size // chunks
        out.append(full.narrow(dim, off + _piece(r, chunks, tp) * n, n))
        off += size
    return torch.cat(out, dim)


def assemble(locals_, dim, segments, tp):
    """The full tensor from every rank's local tensor (shared pieces taken from their first holder)."""
    out, off = [], 0
    for size, chunks in segments:
        n = size // chunks
        out += [locals_[_first_holder(k, chunks, tp)].narrow(dim, off, n) for k in range(chunks)]
        off += n
    return torch.cat(out, dim)


def _sum_shared_grad(grad, dim, segments, group):
    """Pieces held by several ranks: each rank's gradient holds only its own heads' share, so sum
    over the holders. Each rank writes its piece into its slot of a zero buffer of the whole
    segment; one all-reduce over the TP group sums every slot over exactly its holders."""
    tp, r = _size(group), _rank(group)
    out, off = [], 0
    for size, chunks in segments:
        n, g = size // chunks, grad.narrow(dim, off, size // chunks)
        if chunks < tp:
            buf = g.new_zeros(g.shape[:dim] + (size,) + g.shape[dim + 1:])
            slot = buf.narrow(dim, _piece(r, chunks, tp) * n, n)
            slot.copy_(g)
            dist.all_reduce(buf, group=group)
            g = slot
        out.append(g)
        off += n
    return torch.cat(out, dim)


def shard(full, grid, dim, segments):
    """A new Parameter holding this rank's slices of `full`, tagged with its layout."""
    p = nn.Parameter(cut(full.detach(), dim, segments, grid.tp_rank, grid.tp).clone(),
                     requires_grad=full.requires_grad)
    p.tp_split = (dim, segments)
    if any(c < grid.tp for _, c in segments):
        p.register_hook(lambda g: _sum_shared_grad(g, dim, segments, grid.tp_group))
    return p


# ----------------------------------------------------------------------------- layers

class ColumnParallelLinear(nn.Module):
    """y_local = x W_local^T + b_local: this rank's output features (rows of W), cut from `linear`.
    segments: the row layout (default: one segment, plain shard)."""

    sequence_parallel = False  # True: x holds this rank's sequence shard, gathered first

    def __init__(self, linear, grid, segments=None):
        super().__init__()
        self.group = grid.tp_group
        segments = segments or [(linear.out_features, grid.tp)]
        self.weight = shard(linear.weight, grid, 0, segments)
        self.bias = None if linear.bias is None else shard(linear.bias, grid, 0, segments)

    def forward(self, x):
        x = SequenceParallel.apply(x, self.group, True) if sequence_sharded(self) else Copy.apply(x, self.group)
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """y = all_reduce(x_local W_local^T) + b: this rank's input features (columns of W). The bias
    is replicated and added once, after the sum."""

    sequence_parallel = False  # True: reduce-scatter the sum over the sequence instead

    def __init__(self, linear, grid):
        super().__init__()
        self.group = grid.tp_group
        self.weight = shard(linear.weight, grid, 1, [(linear.in_features, grid.tp)])
        self.bias = linear.bias

    def forward(self, x):
        y = F.linear(x, self.weight)
        y = SequenceParallel.apply(y, self.group, False) if sequence_sharded(self) else Reduce.apply(y, self.group)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Each rank owns a contiguous range of (padded) vocabulary rows; ids outside it look up
    zeros, and the all-reduce fills in every id from its owner."""

    sequence_parallel = False  # True: each rank keeps its sequence shard of the sum

    def __init__(self, emb, grid):
        super().__init__()
        self.group = grid.tp_group
        self.weight = shard(emb.weight, grid, 0, [(emb.num_embeddings, grid.tp)])
        self.start = grid.tp_rank * self.weight.shape[0]

    def forward(self, idx):
        local = idx - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        x = F.embedding(local.masked_fill(outside, 0), self.weight).masked_fill(outside[..., None], 0.0)
        return SequenceParallel.apply(x, self.group, False) if sequence_sharded(self) else Reduce.apply(x, self.group)


class SequenceShardEmbedding(nn.Module):
    """Learned positions under sequence parallelism: the embeddings of this rank's shard of the
    positions (dim -2 of the output), to add to its shard of the token embeddings. The weight stays
    replicated (its gradient is summed over the group, see tensor_parallel)."""

    sequence_parallel = True

    def __init__(self, emb, grid):
        super().__init__()
        self.group = grid.tp_group
        self.weight = emb.weight

    def forward(self, pos):
        x = F.embedding(pos, self.weight)
        return _split(x, self.group, dim=-2) if sequence_sharded(self) else x


# ----------------------------------------------------------------------------- vocab-parallel loss

class _VocabParallelLogProb(torch.autograd.Function):
    """log softmax(logits)[target] over a vocabulary split across the group, never gathering it:
    global max (all-reduce MAX), global sum of exp (all-reduce SUM), the target's logit from the
    rank that owns it (all-reduce SUM). Backward, on the local shard only: onehot - softmax."""

    @staticmethod
    def forward(ctx, local_logits, targets, group, vocab_size, ignore_index):
        x = local_logits.float()  # fp32: a softmax over a large vocabulary in bf16 is visibly wrong
        Vl = x.shape[-1]
        start = _rank(group) * Vl
        if vocab_size is not None and start + Vl > vocab_size:  # padding columns: never counted
            pad = torch.arange(start, start + Vl, device=x.device) >= vocab_size
            x = x.masked_fill(pad, float("-inf"))
        m = x.max(dim=-1, keepdim=True).values
        m = _reduce(m, group, "max")
        x = x - m
        e = x.exp()
        s = e.sum(dim=-1, keepdim=True)
        t = targets - start
        mine = (t >= 0) & (t < Vl) & (targets != ignore_index)
        t = t.clamp(0, Vl - 1).masked_fill(~mine, 0)
        tl = x.gather(-1, t[..., None]).squeeze(-1).masked_fill(~mine, 0.0)
        s, tl = _reduce(s, group), _reduce(tl, group)
        valid = targets != ignore_index
        logp = (tl - s.squeeze(-1).log()).masked_fill(~valid, 0.0)
        ctx.save_for_backward(e.div_(s), t, mine, valid)
        ctx.dtype = local_logits.dtype
        return logp

    @staticmethod
    def backward(ctx, g):
        softmax, t, mine, valid = ctx.saved_tensors
        g = g.float().masked_fill(~valid, 0.0)[..., None]
        grad = softmax * -g
        grad.scatter_add_(-1, t[..., None], g * mine[..., None])
        return grad.to(ctx.dtype), None, None, None, None


def vocab_parallel_logprobs(local_logits, targets, group, vocab_size=None, ignore_index=IGNORE):
    """Per-token log p(target) (..., ) from this rank's logits (..., V/tp) of the vocab split
    over `group` in rank order; 0 where targets == ignore_index. Columns >= vocab_size (padding)
    are excluded. Differentiable; what DPO / GRPO need. group None: one process."""
    return _VocabParallelLogProb.apply(local_logits, targets, group, vocab_size, ignore_index)


def vocab_parallel_cross_entropy(local_logits, targets, group, vocab_size=None, ignore_index=IGNORE,
                                 reduction="mean"):
    """F.cross_entropy over the split vocabulary: reduction 'none' (-logprob, 0 at ignored
    positions, shape of targets), 'sum', or 'mean' over the non-ignored positions."""
    nll = -vocab_parallel_logprobs(local_logits, targets, group, vocab_size, ignore_index)
    if reduction == "none":
        return nll
    if reduction == "sum":
        return nll.sum()
    return nll.sum() / (targets != ignore_index).sum()


class VocabParallelHead(ColumnParallelLinear):
    """The output layer, column-parallel over the padded vocabulary; its loss never gathers. Each rank
    soft-caps its own logits (softcap: the model's logit_softcap) and, when cut from a fused.FP8Linear,
    runs its slice's matmul in FP8 where that one would."""

    def __init__(self, linear, grid, vocab_size, softcap=0.0):
        super().__init__(linear, grid)
        self.vocab_size, self.softcap, self.fp8 = vocab_size, softcap, isinstance(linear, fused.FP8Linear)

    def forward(self, x):
        if not (self.fp8 and self.training and fused.fp8_fits(x, self.weight)):
            return super().forward(x)
        x = SequenceParallel.apply(x, self.group, True) if sequence_sharded(self) else Copy.apply(x, self.group)
        return fused.fp8_matmul(x, self.weight)

    def logits(self, x):
        """Full logits (..., vocab_size): gathers the shards (generation / evaluation only)."""
        return Gather.apply(fused.softcap(self(x), self.softcap), self.group)[..., :self.vocab_size]

    def loss(self, x, targets, reduction="mean", temperature=1.0):
        """Cross-entropy of this rank's logits / temperature (each rank divides its own columns)."""
        logits = fused.softcap(self(x), self.softcap)
        logits = logits if temperature == 1.0 else logits / temperature
        return vocab_parallel_cross_entropy(logits, targets, self.group, self.vocab_size, IGNORE, reduction)


# ----------------------------------------------------------------------------- the model

def mlp_parallel(m, grid):
    """model.MLP (or moe.MoE's shared expert), in place: rows [gate | up] -> [this rank's gate
    slice | the matching up slice] column-parallel; proj row-parallel."""
    m.fc = ColumnParallelLinear(m.fc, grid, [(m.proj.in_features, grid.tp)] * (2 if m.gated else 1))
    m.proj = RowParallelLinear(m.proj, grid)


def tensor_parallel(model, grid, sequence_parallel=False):
    """Turn a full model.Transformer (built with the same seed on every TP rank) into its TP form,
    in place. Parameter names stay those of the one-process model.

    sequence_parallel: between the TP matmuls the residual stream (B, T/tp, C) holds this rank's
    sequence shard: the embedding and each row-parallel matmul reduce-scatter over the sequence
    instead of all-reducing, each column-parallel matmul (head included) all-gathers its input
    (backward: the reverse). Norms, biases, residual adds and dropout then run on T/tp positions and
    the activations between blocks take 1/tp of the memory, for the same bytes on the wire (an
    all-reduce is a reduce-scatter plus an all-gather); each collective costs one extra copy here,
    to and from the (B, T) layout. Every parameter outside the TP cut (norms, row-parallel biases,
    learned positions) sees only this rank's positions: a hook sums its gradient over the TP group
    (one small all-reduce per parameter and backward), so it stays identical on every rank. Dense
    models only; the sequence length of a training forward must be divisible by tp. Forwards without
    gradients (evaluation, generation) run plain tensor parallelism (sequence_sharded)."""
    tp = grid.tp
    if tp == 1:
        return model
    if isinstance(model.tok_emb, VocabParallelEmbedding):
        raise ValueError("tensor_parallel: this model is already tensor-parallel")
    cfg = model.cfg
    if sequence_parallel and cfg.n_experts:
        raise ValueError("sequence_parallel=True works with dense models only: set sequence_parallel=False")
    H, KV, D, hidden = cfg.n_head, cfg.kv_heads, cfg.head_dim, cfg.hidden
    for bad, msg in [
        (H % tp, f"n_head={H} is not divisible by tp={tp}: each rank needs whole attention heads"),
        ((KV >= tp and KV % tp) or (KV < tp and tp % KV),
         f"n_kv_head={KV} and tp={tp}: need n_kv_head a multiple of tp, or tp a multiple of n_kv_head "
         f"(then each kv head is replicated on tp/n_kv_head ranks)"),
        (hidden % tp, f"MLP hidden size {hidden} is not divisible by tp={tp}: set ffn_hidden"),
        (cfg.n_experts and (cfg.moe_hidden or hidden) % tp,
         f"expert hidden size {cfg.moe_hidden or hidden} is not divisible by tp={tp}: set moe_hidden"),
        (cfg.padded_vocab % tp, f"padded vocabulary {cfg.padded_vocab} (vocab_size={cfg.vocab_size} rounded up "
         f"to pad_vocab_multiple={cfg.pad_vocab_multiple}) is not divisible by tp={tp}: set "
         f"pad_vocab_multiple to a multiple of tp")]:
        if bad:
            raise ValueError(msg)
    ckv = min(KV, tp)  # pieces of the k (and v) rows: one per rank, or one per kv head when shared
    for block in model.blocks:
        a = block.attn
        # rows [q | k | v] -> [this rank's q heads | the kv heads they use (k) | (v)]
        a.qkv = ColumnParallelLinear(a.qkv, grid, [(H * D, tp), (KV * D, ckv), (KV * D, ckv)])
        a.proj = RowParallelLinear(a.proj, grid)
        a.n_head, a.n_kv_head = H // tp, KV // ckv  # Attention.forward reads these
        if a.qk_norm:  # replicated, but each rank applies them to its own heads: sum their grads
            for norm in (a.q_norm, a.k_norm):
                norm.weight = shard(norm.weight, grid, 0, [(D, 1)])
        if hasattr(a, "ve_lambdas"):  # the same: replicated, applied to this rank's v heads
            a.ve_lambdas = shard(a.ve_lambdas, grid, 0, [(2, 1)])
        if hasattr(block.mlp, "tensor_parallel"):  # moe.MoE: cuts its experts like the MLP (moe.py)
            block.mlp.tensor_parallel(grid)
        else:
            mlp_parallel(block.mlp, grid)
    if cfg.pos_emb == "alibi":  # the slopes of this rank's heads
        model.alibi_heads = slice(grid.tp_rank * (H // tp), (grid.tp_rank + 1) * (H // tp))
    for ve in model.value_embeds:  # value embeddings (vocab x kv width): the columns of this rank's kv heads, as v's
        ve.weight = shard(ve.weight, grid, 1, [(KV * D, ckv)])
    model.tok_emb = VocabParallelEmbedding(model.tok_emb, grid)
    head = VocabParallelHead(model.head, grid, cfg.vocab_size, cfg.logit_softcap)
    if cfg.tie_embeddings:
        head.weight = model.tok_emb.weight  # keep the tie: the same shard Parameter
    model.head = head
    model.logits, model.head_loss = head.logits, head.loss  # instance attributes shadow the methods
    if sequence_parallel:
        for p in model.parameters():
            if not hasattr(p, "tp_split") and p.requires_grad:
                p.register_hook(lambda g: _reduce(g, grid.tp_group))
        for m in model.modules():
            if isinstance(m, (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding)):
                m.sequence_parallel = True
        if cfg.pos_emb == "learned":
            model.pos_emb = SequenceShardEmbedding(model.pos_emb, grid)
    return model


# ----------------------------------------------------------------------------- full <-> local tensors

def full_tensor(p, local, grid):
    """The full tensor of parameter p (or of a tensor shaped like it: a gradient, an optimizer
    moment) from every TP rank's local one. Collective over the TP group."""
    if grid.tp == 1 or not hasattr(p, "tp_split"):
        return local.detach().clone()
    parts = [torch.empty_like(local) for _ in range(grid.tp)]
    dist.all_gather(parts, local.detach().contiguous(), group=grid.tp_group)
    return assemble(parts, *p.tp_split, grid.tp)


def local_tensor(p, full, grid):
    """This rank's slices of a full tensor shaped like parameter p's full form."""
    if grid.tp == 1 or not hasattr(p, "tp_split"):
        return full
    return cut(full, *p.tp_split, grid.tp_rank, grid.tp)


def hf_shard_fn(model, grid):
    """A shard_fn for hf.load_weights(path, tp_model, shard_fn=...): reads only this rank's rows /
    columns of each HF tensor. load_weights hands over the parts of a fused parameter (q, k, v;
    gate, up) in order, one per segment of its layout, so parts are counted per name."""
    params = dict(model.named_parameters())
    seen = {}

    def fn(name, part):
        p = params[name]
        if grid.tp == 1 or not hasattr(p, "tp_split"):
            return part[:]
        dim, segments = p.tp_split
        j = seen.get(name, 0)
        seen[name] = (j + 1) % len(segments)
        size, chunks = segments[j]
        n = size // chunks
        a = _piece(grid.tp_rank, chunks, grid.tp) * n
        return part[a:a + n] if dim == 0 else part[:, a:a + n]
    return fn
