"""DataParallel: the model replicated on every data-parallel rank, gradients averaged during backward.

    model = dp.DataParallel(raw, grid, bucket_mb=25.0)       # broadcasts rank 0's weights
    with model.no_sync(): fwd(x, y).backward()                 # every micro-step but the last
    fwd(x, y).backward(); model.finish()                       # the last: wait for the reductions
    optimizer.step(); model.zero_grad()

Gradients live in flat buckets filled in the reverse order of registration; a post-accumulate
hook launches a bucket's all-reduce as soon as its last gradient arrives, so communication
overlaps the rest of backward. ZeRO-1 reduces each owner's segment to that owner only; bf16
reduction sends half the bytes. parallel.parallelize builds it; the class docstring has the rules.
"""
import contextlib
import weakref

import torch
import torch.distributed as dist
import torch.nn as nn


class DataParallel(nn.Module):
    """Replicated model; gradients averaged over the data-parallel ranks during backward.

    Every gradient is divided by the data world dp x ep (each rank's loss is the mean over its own
    batch). Parameters are summed over the ranks that hold them: non-expert ones over
    grid.data_group (dp x ep), expert shards (p.expert, moe.py) over grid.dp_group, their replicas;
    an expert's gradient on its owner already holds every EP rank's tokens (moe.py's exchange).
    With ep = 1 both groups are the dp group.

    Gradients live in flat buckets (p.grad is a view into one), in the reverse order of
    registration, which is roughly the order backward produces them. When every gradient of a
    bucket has been accumulated, a hook launches an async all-reduce of the whole bucket, so
    communication overlaps the rest of backward. Inside `no_sync()` (non-final
    gradient-accumulation micro-steps) nothing is launched; gradients just accumulate.
    `finish()` waits for the reductions and must run before clipping and the optimizer step.

    ZeRO-1 (owner = optimizer.grad_owner, {id(param): dp rank}, ep = 1): a bucket's parameters are
    laid out by owner and each owner's segment is reduced to that rank only (reduce, not
    all-reduce: half the traffic); finish() then drops the gradients this rank does not own, so
    nothing can read a partial sum. The optimizer all-gathers the updated parameters.

    reduce_dtype=torch.bfloat16: gradients accumulate in their own (fp32) buckets, but travel as a
    bf16 copy (half the bytes, the sum rounded to bf16) that finish() copies back.
    """

    def __init__(self, module, grid, bucket_mb=25.0, owner=None, reduce_dtype=None):
        super().__init__()
        self.world = grid.dp * grid.ep  # data-parallel world: every gradient is divided by it
        self.module, self.group = module, grid.data_group or grid.dp_group
        self.expert_group = grid.dp_group
        self.owner = owner if self.world > 1 else None
        self.reduce_dtype = reduce_dtype
        if self.owner is not None and grid.ep > 1:
            raise ValueError("DataParallel(owner=...) reduces over the dp group: not with ep > 1")
        self.sync = True
        self.handles = []
        self.buckets, self.bucket_of = [], {}
        if self.world == 1:
            return  # one replica: nothing to synchronise
        self.op = dist.ReduceOp.AVG if dist.get_backend(self.group) == "nccl" else dist.ReduceOp.SUM
        with torch.no_grad():  # start identical everywhere: the group's first rank wins
            for t in list(module.parameters()) + list(module.buffers()):
                g = self._group_of(t)
                if dist.get_world_size(g) > 1:
                    dist.broadcast(t, src=dist.get_global_rank(g, 0), group=g)
        params = [p for p in module.parameters() if p.requires_grad]  # unique: tied counted once
        # buckets: consecutive params (reverse order) until bucket_mb is reached, one dtype and
        # one group (expert or not) each
        limit = int(bucket_mb * 2**20)
        cur, size = [], 0
        for p in reversed(params):
            if cur and (size + p.numel() * p.element_size() > limit or p.dtype != cur[0].dtype
                        or self._group_of(p) is not self._group_of(cur[0])):
                self.buckets.append(cur)
                cur, size = [], 0
            cur.append(p)
            size += p.numel() * p.element_size()
        if cur:
            self.buckets.append(cur)
        self.buckets = [self._make_bucket(ps) for ps in self.buckets]
        # the hook holds this object weakly: a tensor's hooks live in C++, out of the garbage
        # collector's sight, so a bound method there would keep the model alive forever
        me = weakref.ref(self)
        for b in self.buckets:
            for p in b["params"]:
                self.bucket_of[p] = b
                p.register_post_accumulate_grad_hook(lambda p: me() is not None and me()._on_grad(p))

    def _group_of(self, t):
        return self.expert_group if getattr(t, "expert", False) else self.group

    def _make_bucket(self, params):
        if self.owner is not None:  # contiguous per owner: one reduce per (bucket, owner)
            params = sorted(params, key=lambda p: self.owner[id(p)])
        flat = torch.zeros(sum(p.numel() for p in params), dtype=params[0].dtype, device=params[0].device)
        off = 0
        for p in params:
            p.grad = flat[off:off + p.numel()].view_as(p)  # backward accumulates straight into the bucket
            off += p.numel()
        group = self._group_of(params[0])
        n = dist.get_world_size(group)
        # what is left to divide by after the reduction (AVG already divided by n)
        div = self.world // n if self.op == dist.ReduceOp.AVG else self.world
        segs, off = [], 0  # (owner dp rank, start, end) runs of the flat buffer
        for p in params:
            r = self.owner[id(p)] if self.owner is not None else None
            if segs and segs[-1][0] == r:
                segs[-1][2] = off + p.numel()
            else:
                segs.append([r, off, off + p.numel()])
            off += p.numel()
        low = None if self.reduce_dtype in (None, flat.dtype) else torch.empty_like(flat, dtype=self.reduce_dtype)
        return dict(flat=flat, params=params, ready=0, group=group, n=n, div=div, segs=segs, low=low)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        """Skip communication: for all but the last gradient-accumulation micro-step. Run the
        backward inside it too: the gradient hooks decide, during backward (DDP decides at forward)."""
        self.sync = False
        try:
            yield
        finally:
            self.sync = True

    def _on_grad(self, p):
        if not self.sync:
            return
        b = self.bucket_of[p]
        if b["ready"] < 0:  # a second backward into a bucket whose reduction is in flight: a race
            raise RuntimeError("DataParallel: a gradient arrived while its bucket was being reduced. Run "
                               "every micro-step's backward inside model.no_sync() except the last one "
                               "(DDP-style no_sync around the forward only is not enough here), and call "
                               "model.finish() before the next step's backward")
        b["ready"] += 1
        if b["ready"] == len(b["params"]):
            self._launch(b)

    def _launch(self, b):
        b["ready"] = -1  # launched
        if b["n"] == 1:
            self.handles.append((None, b))
            return
        buf = b["flat"] if b["low"] is None else b["low"].copy_(b["flat"])
        if self.owner is None:
            self.handles.append((dist.all_reduce(buf, op=self.op, group=b["group"], async_op=True), b))
        else:
            for r, s, e in b["segs"]:
                dst = dist.get_global_rank(b["group"], r)
                self.handles.append((dist.reduce(buf[s:e], dst, op=self.op, group=b["group"], async_op=True), b))

    def finish(self):
        """Wait for all reductions (launching buckets whose params got no gradient) and average."""
        if self.world == 1:
            return
        for b in self.buckets:
            if b["ready"] != -1:
                self._launch(b)
        for h, _ in self.handles:
            if h is not None:
                h.wait()
        for b in self.buckets:
            if b["low"] is not None and b["n"] > 1:
                b["flat"].copy_(b["low"])
            if b["div"] != 1:
                b["flat"].div_(b["div"])
            b["ready"] = 0
            if self.owner is not None:  # what others own holds partial sums: drop it
                rank = dist.get_rank(b["group"])
                for p in b["params"]:
                    if self.owner[id(p)] != rank:
                        p.grad = None
        self.handles = []

    def zero_grad(self, set_to_none=True):
        """Zero the buckets in place; the gradients must stay views into them."""
        if self.world == 1:
            return self.module.zero_grad(set_to_none)
        for b in self.buckets:
            b["flat"].zero_()
            b["ready"] = 0
            off = 0
            for p in b["params"]:
                if p.grad is None or p.grad.data_ptr() != b["flat"][off:].data_ptr():
                    p.grad = b["flat"][off:off + p.numel()].view_as(p)
                off += p.numel()

    # checkpoints and optimizers see the inner model's names
    def state_dict(self, *args, **kwargs):
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, *args, **kwargs):
        return self.module.load_state_dict(*args, **kwargs)
