"""Fully sharded data parallelism (ZeRO-3), written with raw torch.distributed collectives.

    model = fsdp.FSDP(raw, grid, compute_dtype=torch.bfloat16)  # after tp.tensor_parallel, before the optimizer
    optimizer = optim.build_optimizer(model, cfg)                # AdamW over this rank's fp32 shards
    model.compile()                                              # optional: each block's compute (FSDP.compile)
    loss = model(x, y); loss.backward()                          # every micro-step (no_sync() is a no-op)
    model.finish(); parallel.clip_grad_norm_(model, cfg.grad_clip, grid); optimizer.step(); model.zero_grad()
(parallel.parallelize builds all of it in this order.)

What holds what: Unit, the flat fp32 shards of one block (or of the root: embeddings, final norm,
head), how they are cut, frozen (LoRA base) and expert (EP) units, the TP gradient-norm runs; FSDP,
the hooks that gather, free and reduce around each block in forward and backward, their overlap,
gradient accumulation and torch.compile; gather_by_name ... load_full_optim_state, full tensors
out of and into any shard layout (parallel.Net.full_state / load_full_state call them).

Invariants: a rank keeps only its shards between micro-steps (weights, gradients, AdamW state);
gradients reduce in fp32 and equal the one-process gradient of the global-batch mean; checkpoints
are full tensors under one-process names, so any layout resumes any other. On CPU (gloo) the same
code runs plain and synchronous, which is how the tests hold it to one process.
Limits: one backward per forward (no retain_graph, no torch.autograd.grad); nn.Module.compile()
on a block (its __call__) would trace the hooks: FSDP.compile overrides it on the wrapper.
"""
import contextlib
import functools

import torch
import torch.distributed as dist
import torch.nn as nn

from parallelism import tp


def all_gather_single(out, x, **kw):
    """dist.all_gather_into_tensor, under torch 2.13's new name when it has it (the old one warns)."""
    return (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(out, x, **kw)


def reduce_scatter_single(out, x, **kw):
    """dist.reduce_scatter_tensor, under torch 2.13's new name when it has it (the old one warns)."""
    return (getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)(out, x, **kw)


def run_of(name, ndim):
    """Which run of a unit's flat buffer a parameter goes to (each shard lies in one run, so each
    has one optimizer treatment): 0 decayed matrices, 1 MoE routers (decayed, but kept on AdamW
    when Muon trains the other matrices of their block), 2 the rest (not decayed)."""
    return 2 if ndim < 2 else 1 if name.endswith("router.weight") else 0  # (ndim < 2: optim.param_groups' rule)


def _counted(p, grid):
    """Bool mask, p's local shape: the elements this TP rank counts in the gradient norm."""
    if getattr(p, "pp_copy", False):  # a tied embedding's last pipeline stage copy: the first stage counts it
        return torch.zeros(p.shape, dtype=torch.bool)
    if grid.tp == 1 or not hasattr(p, "tp_split"):  # TP-replicated: TP rank 0 counts it
        return torch.full(p.shape, grid.tp_rank == 0, dtype=torch.bool)
    mask = torch.zeros(p.shape, dtype=torch.bool)
    for off, n, counted in tp.counted_pieces(p, grid):  # a piece several TP ranks hold: its first holder
        mask.narrow(p.tp_split[0], off, n).fill_(counted)
    return mask


class Unit:
    """The flattened, sharded parameters of one module (a block, or the root's leftovers), or of a
    block's experts under EP. self.group / dp / rank: the ranks it is sharded over (the data group,
    dp x ep ranks; an expert unit: grid.dp_group, its replicas).

    Units: each block, plus a root unit of everything else (embeddings, final norm, head; a tied
    head is stored once). A unit's parameters are flattened into one fp32 buffer padded to a
    multiple of dp (its group's size); rank r keeps elements [r*S, (r+1)*S) as its master shard.
    Decayed matrices come first, then MoE routers, then 1-D parameters (run_of), and a shard is cut
    where these runs meet, so each shard nn.Parameter has one weight-decay setting (and one
    optimizer under Muon); decayed shards are (1, n), so optim.param_groups' "p.dim() >= 2" rule
    holds. compute_dtype=bf16 all-gathers a bf16 copy of the fp32 shards; gradients reduce in fp32.
    Frozen parameters (a LoRA base, lora.py) form units of their own, sharded the same way in their
    own dtype (a bf16 base stays bf16): gathered with their block, never reduced, no optimizer
    state (FSDP.units holds the trainable units, FSDP.frozen these).
    TP x FSDP: the unit holds this TP rank's slices. Parameter hooks (tp.py sums gradients of pieces
    TP ranks share) move onto the views (install). For the gradient norm each unit knows the runs of
    its shard this TP rank counts (`counted`, read by parallel.clip_grad_norm_; p.tp_split:
    replicated parameters and shared pieces are counted by their first holder only).
    EP x FSDP (moe.py): with ep > 1 the data-parallel world is dp x ep (grid.data_group); a unit is
    sharded over it, except a block's experts (p.expert): they form a second unit of that block,
    sharded over grid.dp_group (their replicas), gathered and freed together with the block's
    first. Every gradient is divided by dp x ep (an expert's owner received every EP rank's tokens:
    accumulate); the gradient norm adds squares over the data group."""

    def __init__(self, params, grid, compute_dtype, expert=False, frozen=False):
        # params: [(names, parameter, [(module, attribute), ...])], one entry per unique tensor
        # frozen: parameters without gradients (a LoRA base): sharded and gathered, never reduced;
        # the master shard keeps their own dtype (a bf16 base stays bf16)
        self.frozen = frozen
        if expert:
            self.group, self.dp, self.rank = grid.dp_group, grid.dp, grid.dp_rank
        else:
            self.group, self.dp, self.rank = grid.data_group or grid.dp_group, grid.data_world, grid.data_rank
        self.world = grid.data_world  # gradients: mean over every data rank (an expert's owner got them all)
        self.params = sorted(params, key=lambda e: run_of(e[0][0], e[1].dim()))  # stable: model order otherwise
        p0 = self.params[0][1]
        keep = functools.reduce(torch.promote_types, [p.dtype for _, p, _ in params]) if frozen else torch.float32
        self.device, self.dtype = p0.device, compute_dtype or p0.dtype
        self.shapes = [p.shape for _, p, _ in self.params]
        numel = sum(p.numel() for _, p, _ in self.params)
        self.padded = -(-numel // self.dp) * self.dp
        self.S = self.padded // self.dp  # this rank's shard length
        self.sizes = [p.numel() for _, p, _ in self.params] + [self.padded - numel]  # padding last
        with torch.no_grad():
            flat = torch.cat([p.detach().reshape(-1).to(keep) for _, p, _ in self.params]
                             + [torch.zeros(self.padded - numel, dtype=keep, device=self.device)])
            if self.dp > 1:  # start identical everywhere: the group's first rank wins
                dist.broadcast(flat, src=dist.get_global_rank(self.group, 0), group=self.group)
            lo = self.rank * self.S
            self.shard = flat[lo:lo + self.S].clone()  # fp32 master (frozen: their dtype)
        # cut this rank's [lo, lo + S) where the runs meet; padding joins the last part
        ends = [sum(p.numel() for names, p, _ in self.params if run_of(names[0], p.dim()) <= k) for k in (0, 1)]
        ends.append(self.padded)
        self.shards, self.ranges = [], []  # shard Parameters; their [a, b) within self.shard
        for start, end, decay in ((0, ends[0], True), (ends[0], ends[1], True), (ends[1], ends[2], False)):
            a, b = max(start, lo) - lo, min(end, lo + self.S) - lo
            if a < b:
                t = self.shard[a:b]
                self.shards.append(nn.Parameter(t.view(1, -1) if decay else t, requires_grad=not frozen))  # shares self.shard's storage
                self.ranges.append((a, b))
        # the runs of this shard counted in the gradient norm (all of it without TP)
        mask = torch.cat([_counted(p, grid).reshape(-1) for _, p, _ in self.params]
                         + [torch.zeros(self.padded - numel, dtype=torch.bool)])[lo:lo + self.S]
        cuts = [0] + (torch.nonzero(mask[1:] != mask[:-1]).flatten() + 1).tolist() + [self.S]
        self.counted = [(a, b) for a, b in zip(cuts, cuts[1:]) if mask[a]]
        self.hooks = [list(p._backward_hooks.values()) if p._backward_hooks else [] for _, p, _ in self.params]
        for _, p, locs in self.params:  # the model keeps the Parameter objects, but no memory
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)
            for mod, attr in locs:
                mod._parameters[attr] = None
        self.full = self.work = None  # gathered flat buffer (compute dtype; autograd leaf), pending all-gather
        self.ready = self.in_backward = False  # ready: full's storage holds (or is receiving) the weights
        self.grad = None  # fp32 flat shard gradient; the shard Parameters' .grad are views of it
        self.op_avg = self.dp > 1 and dist.get_backend(self.group) == "nccl"  # gloo: SUM, then divide

    # ------------------------------------------------------------------ the collectives

    def gather(self, fresh):
        """Issue the all-gather of the full weights (async). fresh: a new leaf tensor (forward);
        otherwise refill the storage of the one autograd saved views of (backward)."""
        if fresh or self.full is None:
            self.full = torch.empty(self.padded, dtype=self.dtype, device=self.device)
        else:
            self.full.untyped_storage().resize_(self.padded * self.full.element_size())
        # write through an alias: an in-place write to `full` itself would bump the version
        # counter that autograd checks on the views it saved in forward
        out = torch.empty(0, dtype=self.dtype, device=self.device).set_(self.full.untyped_storage(), 0, (self.padded,))
        src = self.shard.to(self.dtype)  # the bf16 copy, or the fp32 shard itself
        if self.dp > 1:
            self.work = all_gather_single(out, src, group=self.group, async_op=True)
        else:
            out.copy_(src)
        self.ready = True

    def wait(self):
        if self.work is not None:
            self.work.wait()  # GPU: the compute stream waits, not the host
            self.work = None

    def install(self, hook):
        """Point the modules' parameters at views of the gathered buffer."""
        full = self.full
        if torch.is_grad_enabled() and not full.requires_grad and not self.frozen:
            full.requires_grad_(True)  # the views' gradients sum into full.grad: one flat tensor
            full.register_post_accumulate_grad_hook(hook)
        for (_, _, locs), v, shape, hooks in zip(self.params, full.split(self.sizes), self.shapes, self.hooks):
            v = v.view(shape)
            if full.requires_grad:
                for h in hooks:
                    v.register_hook(h)
            for mod, attr in locs:
                mod._parameters[attr] = v

    def release(self):
        """Free the gathered weights; the tensor (and autograd's views of it) stays, empty."""
        self.full.untyped_storage().resize_(0)
        self.ready = False

    def drop(self):
        for _, _, locs in self.params:
            for mod, attr in locs:
                mod._parameters[attr] = None
        if self.full is not None:
            self.wait()
            self.release()
        self.full, self.in_backward = None, False

    def reduce_scatter(self, g):
        """Flat full gradient -> (work, fp32 shard) summed or averaged over dp; async."""
        g = g.float()  # reduce in fp32 (a copy when computing in bf16)
        if self.dp == 1:
            return None, g
        out = torch.empty(self.S, dtype=torch.float32, device=self.device)
        op = dist.ReduceOp.AVG if self.op_avg else dist.ReduceOp.SUM
        return reduce_scatter_single(out, g, op=op, group=self.group, async_op=True), out

    def accumulate(self, work, out):
        if work is not None:
            work.wait()
        div = self.world // self.dp if self.op_avg else self.world  # AVG divided by dp already
        if div > 1:
            out.div_(div)
        if self.grad is None or self.shards[0].grad is None:  # first micro-step (or after zero_grad)
            self.grad = out
            for p, (a, b) in zip(self.shards, self.ranges):
                p.grad = out[a:b].view_as(p)
        else:
            self.grad.add_(out)

    def all_gather_fp32(self, local):
        """(S,) laid out like this rank's shard -> the full padded flat, fp32, synchronous."""
        local = local.float().contiguous()
        if self.dp == 1:
            return local.clone()
        out = torch.empty(self.padded, dtype=torch.float32, device=local.device)
        all_gather_single(out, local, group=self.group)
        return out


class _PreBackward(torch.autograd.Function):
    """Identity whose backward runs right before the backward of the block that produced x."""

    @staticmethod
    def forward(ctx, fsdp, i, x):
        ctx.fsdp, ctx.i = fsdp, i
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        ctx.fsdp._pre_backward(ctx.i)
        return None, None, g


class FSDP(nn.Module):
    """ZeRO-3 over grid.dp_group (the data group under EP): the model's blocks each get a Unit, and
    hooks around every block gather, free and reduce them. Same driving API as dp.DataParallel.

    One micro-step of block i (all-gather and reduce-scatter over the unit's group, async):
      forward   pre-hook: wait for block i's all-gather (issued while block i-1 ran), point the
                block's parameters at views of the gathered buffer, issue block i+1's all-gather.
                post-hook: free the buffer's storage (resize to 0: autograd keeps its views, now
                empty) and wrap the output in _PreBackward.
      backward  _PreBackward: refill the storage (all-gather issued one block earlier), issue block
                i-1's. The parameters are split() views of one leaf, so the gradient arrives as one
                flat tensor; the leaf's post-accumulate-grad hook casts it to fp32, reduce-scatters
                it (mean over dp) and frees the buffer. The result is added to the shard's .grad
                when the next unit's reduce-scatter is issued, so each one overlaps a block's backward.
    The root is gathered when forward starts and kept until its gradient is reduced at the end of
    backward: the head is the first thing backward needs (PyTorch FSDP2 does the same). Activation
    checkpointing recomputes a block inside backward, after _PreBackward refilled it: the hooks see
    `in_backward` and leave it alone. Frozen units have no gradient hook to free them: a block's are
    freed when the next backward block starts (its input gradient is complete), the rest in
    finish() or at the next forward.
    Gradient accumulation: every micro-step reduce-scatters and adds into the fp32 shard gradient,
    so no rank ever holds a full gradient between micro-steps (ZeRO-3's point); the price is one
    reduce-scatter per micro-step. no_sync() changes nothing, except under reshard_after_forward=False
    (a pipeline stage, pp.py, whose forwards of several micro-batches run before their backwards):
    each unit stays gathered from its first forward of a step until its backward outside no_sync()
    (the step's last), as torchtitan's FSDP under PP; gradients are still reduce-scattered every backward.
    Overlap: an async NCCL collective runs on the process group's internal stream after the work
    already queued on the compute stream, and work.wait() makes the compute stream (not the host)
    wait for it: that internal stream is the side stream prefetches run on, and the process group
    keeps a pending collective's tensors alive until it is waited for. On CPU (gloo) the same code
    is plain and synchronous."""

    def __init__(self, module, grid, compute_dtype=None, reshard_after_forward=True):
        super().__init__()
        self.module, self.grid = module, grid
        self.reshard, self.sync = reshard_after_forward, True
        self.summoned = False
        self.pending = []  # [(unit, work, out)]: issued reduce-scatters, oldest first
        self.sd_keys = list(module.state_dict().keys())
        entries = {}  # id(param) -> (names, param, homes): each unique tensor, every (module, attr) holding it
        for mname, mod in module.named_modules():
            for attr, p in mod._parameters.items():
                if p is not None:
                    e = entries.setdefault(id(p), ([], p, []))
                    e[0].append(f"{mname}.{attr}" if mname else attr)
                    e[2].append((mod, attr))
        L = len(module.blocks)
        kinds = [(False, False), (True, False), (False, True), (True, True)]  # (expert, frozen)
        groups = [{k: [] for k in kinds} for _ in range(L + 1)]  # 0: root; 1 + i: blocks[i]
        for e in entries.values():
            head = e[0][0].split(".")
            slot = 1 + int(head[1]) if head[0] == "blocks" else 0
            groups[slot][(grid.ep > 1 and getattr(e[1], "expert", False), not e[1].requires_grad)].append(e)
        # slots[i]: the units gathered together around block i - 1 (slot 0: the root), trainable first
        self.slots = [[Unit(g[k], grid, compute_dtype, expert=k[0], frozen=k[1]) for k in kinds if g[k]]
                      for g in groups]
        self.units = [u for s in self.slots for u in s if not u.frozen]  # what has gradients and optimizer state
        self.frozen = [u for s in self.slots for u in s if u.frozen]
        for kind, us in (("unit", self.units), ("frozen", self.frozen)):  # registered: .parameters() yields the shards
            for i, u in enumerate(us):
                for j, p in enumerate(u.shards):
                    self.register_parameter(f"{kind}{i}_shard{j}", p)
        for i, block in enumerate(module.blocks, start=1):
            block.register_forward_pre_hook(functools.partial(self._pre_forward, i))
            block.register_forward_hook(functools.partial(self._post_forward, i))
        data = grid.data_group or grid.dp_group
        if grid.data_world > 1:  # buffers too (DataParallel's rule); RoPE tables are derived anyway
            with torch.no_grad():
                for b in module.buffers():
                    dist.broadcast(b, src=dist.get_global_rank(data, 0), group=data)

    # ------------------------------------------------------------------ forward / backward choreography

    def forward(self, *args, **kwargs):
        if self.summoned:
            return self.module(*args, **kwargs)
        if self.reshard:
            self._drop_frozen()  # what the last backward left gathered (gradient accumulation)
        for u in self.slots[0]:
            if self.reshard or not u.ready:  # (kept: gathered once a step)
                u.drop()
                u.gather(fresh=True)
        for u in self.slots[0]:
            u.wait()
            u.install(functools.partial(self._post_backward, u))
        self._prefetch(1, fresh=True)  # block 0 while the embedding runs
        out = self.module(*args, **kwargs)
        if not (torch.is_grad_enabled() and out.requires_grad):
            for u in self.slots[0]:
                u.drop()  # no backward will come (evaluation)
        return out

    def _drop_frozen(self, slot=None):
        """Free frozen units (no gradient hook frees them): those of `slot`, or all gathered ones."""
        for u in self.frozen if slot is None else [u for u in self.slots[slot] if u.frozen]:
            if u.full is not None:
                u.drop()

    def _prefetch(self, i, fresh):
        for u in self.slots[i] if 0 < i < len(self.slots) else []:
            if not u.ready and (fresh or (u.full is not None and not u.in_backward)):
                u.gather(fresh)

    def _pre_forward(self, i, module, args):
        us = self.slots[i]
        if self.summoned or us[0].in_backward:  # recompute of a checkpointed block: already gathered
            return
        for u in us:
            if not u.ready:
                u.gather(fresh=True)
        for u in us:
            u.wait()
            u.install(functools.partial(self._post_backward, u))
        self._prefetch(i + 1, fresh=True)  # overlaps this block's compute

    def _post_forward(self, i, module, args, out):
        us = self.slots[i]
        if self.summoned or us[0].in_backward:
            return out
        if torch.is_grad_enabled() and out.requires_grad:
            for u in us if self.reshard else []:
                u.release()  # reshard after forward; backward gathers again
            return _PreBackward.apply(self, i, out)
        for u in us:
            u.drop()
        return out

    def _pre_backward(self, i):
        if i + 1 < len(self.slots) and self.reshard:  # the next block's backward is over (it produced this
            self._drop_frozen(i + 1)  # gradient): its frozen weights, read only for its input's gradient, are done
        for u in self.slots[i]:
            if not u.ready:
                u.gather(fresh=False)
        for u in self.slots[i]:
            u.wait()
            u.in_backward = True
        self._prefetch(i - 1, fresh=False)  # overlaps this block's backward

    def _post_backward(self, u, full):
        g, full.grad = full.grad, None
        work, out = u.reduce_scatter(g)
        del g
        if self.reshard or self.sync:
            u.drop()  # the full weights are not needed again this micro-step (kept: this step)
        self.pending.append((u, work, out))
        self._drain(keep=1)  # the older one had a block's backward to finish in

    def _drain(self, keep=0):
        while len(self.pending) > keep:
            u, work, out = self.pending.pop(0)
            u.accumulate(work, out)

    # ------------------------------------------------------------------ torch.compile

    def compile(self, **kwargs):
        """torch.compile the compute, in place: each block's forward, the final norm's, and the
        head's loss (model.head_loss). kwargs go to torch.compile (e.g. backend="aot_eager").
        Overrides nn.Module.compile, which would compile __call__ and trace the gather hooks.
        Called by parallel.parallelize with cfg.compile. Each block's forward is compiled, not its
        __call__, so the hooks (gathers, frees, prefetch, _PreBackward) stay eager around the graph
        and overlap as before; the embedding stays eager. The graph reads the parameters as inputs,
        fresh views of a new buffer each step with the same shapes, so one graph serves every block
        and every step (no recompilation); activation checkpointing recomputes through the same
        compiled forward. Inside summon_full_params (sampling, KV-cache decoding: generate.py) the
        eager forward runs (_compute)."""
        m = self.module
        for mod in list(m.blocks) + ([] if isinstance(m.norm_f, nn.Identity) else [m.norm_f]):
            mod.forward = functools.partial(self._compute, mod.forward, torch.compile(mod.forward, **kwargs))
        m.head_loss = functools.partial(self._compute, m.head_loss, torch.compile(m.head_loss, **kwargs))

    def _compute(self, eager, compiled, *args, **kwargs):
        """The compiled function; the eager one inside summon_full_params (sampling and KV-cache
        decoding, whose shapes change every call)."""
        return (eager if self.summoned else compiled)(*args, **kwargs)

    # ------------------------------------------------------------------ the DataParallel API

    @contextlib.contextmanager
    def no_sync(self):
        """Every micro-step reduce-scatters into the shard gradients (memory-lean) all the same; without
        reshard_after_forward the backwards inside keep the weights gathered for the next micro-batch."""
        self.sync = False
        try:
            yield
        finally:
            self.sync = True

    def finish(self):
        """Wait for the outstanding reduce-scatters: before clipping and the optimizer step."""
        self._drain()
        self._drop_frozen()
        for u in [] if self.reshard else self.units:  # (a step whose every backward ran inside no_sync)
            if u.full is not None:
                u.drop()

    def zero_grad(self, set_to_none=True):
        for u in self.units:  # the next reduce-scatter's output becomes the gradient: nothing to zero
            u.grad = None
            for p in u.shards:
                p.grad = None

    @contextlib.contextmanager
    def summon_full_params(self):
        """The model's own Parameters, gathered in fp32, for sampling or helpers that read the
        plain model (generate, tp's state helpers). Collective; changes inside are discarded."""
        for u in self.units + self.frozen:
            u.drop()
            for (_, p, locs), v, shape in zip(u.params, u.all_gather_fp32(u.shard).split(u.sizes), u.shapes):
                p.data = v.view(shape)
                for mod, attr in locs:
                    mod._parameters[attr] = p
        self.summoned = True
        try:
            yield self.module
        finally:
            self.summoned = False
            for u in self.units + self.frozen:
                u.drop()
                for _, p, _ in u.params:
                    p.data = torch.empty(0, dtype=p.dtype, device=p.device)


# ---------------------------------------------------------------------------- layout-independent state

def gather_by_name(model, local_of):
    """{first name: full fp32 tensor on CPU} from a per-unit (S,) local tensor laid out like the
    shard (skipped where local_of gives None). Collective over dp (and TP)."""
    out = {}
    for u in model.units + model.frozen:
        local = local_of(u)
        if local is None:
            continue
        for (names, p, _), v, shape in zip(u.params, u.all_gather_fp32(local).split(u.sizes), u.shapes):
            v = v.view(shape)
            if model.grid.tp > 1:  # this TP rank's slice -> the full tensor
                v = tp.full_tensor(p, v, model.grid)
            out[names[0]] = v.to("cpu", copy=True)
    return out


def local_flat(model, u, full_of):
    """This rank's (S,) slice of unit u's flat layout, from full tensors: full_of(names) -> tensor."""
    parts = []
    for (names, p, _), shape in zip(u.params, u.shapes):
        t = full_of(names)
        if model.grid.tp > 1:  # the full tensor -> this TP rank's slice
            t = tp.local_tensor(p, t, model.grid)
        if tuple(t.shape) != tuple(shape):
            raise ValueError(f"{names[0]}: state has shape {tuple(t.shape)}, this model {tuple(shape)}")
        parts.append(t.reshape(-1).float().to(u.device))
    lo = u.rank * u.S
    return torch.cat(parts + [torch.zeros(u.sizes[-1], device=u.device)])[lo:lo + u.S]


def pick(sd, names):
    """sd's entry for a unit parameter's names (a tied tensor may be saved under any of them)."""
    for n in names:
        if n in sd:
            return sd[n]
    raise KeyError(f"state lacks {names[0]}: is it from a different model config?")


def full_state_dict(model):
    """{name: full fp32 tensor on CPU}: the keys and order of the unwrapped one-process model's
    state_dict (tied names share one tensor). Collective over dp (and TP): every rank calls it.
    Under EP this rank's experts only: parallel.Net.full_state completes them over EP
    (moe.gather_experts), load_full_state cuts them again (moe.cut_experts)."""
    full = gather_by_name(model, lambda u: u.shard)
    for u in model.units + model.frozen:
        for names, _, _ in u.params:
            full.update({n: full[names[0]] for n in names[1:]})
    full.update({k: v.detach().cpu() for k, v in model.module.state_dict().items()})  # persistent buffers
    return {k: full[k] for k in model.sd_keys if k in full}


@torch.no_grad()
def load_full_state_dict(model, sd):
    """Every rank copies its slice of each unit out of full tensors (saved by any layout)."""
    for u in model.units + model.frozen:
        u.drop()
        u.shard.copy_(local_flat(model, u, lambda names: pick(sd, names)))
    for k, b in model.module.named_buffers():
        if k in sd:
            b.copy_(sd[k])


def full_optim_state(model, optimizer):
    """{param name: {"exp_avg": full, "exp_avg_sq": full, "step": tensor}}: the AdamW state of a
    one-process run over the unwrapped model. Collective over dp (and TP)."""
    out = {}
    for key in ("exp_avg", "exp_avg_sq"):
        def local(u):  # the unit's shard Parameters tile [0, S): concatenate their state
            st = [optimizer.state.get(p, {}) for p in u.shards]
            return torch.cat([s[key].reshape(-1) for s in st]) if all(key in s for s in st) else None
        for name, t in gather_by_name(model, local).items():
            out.setdefault(name, {})[key] = t
    for u in model.units:
        step = optimizer.state.get(u.shards[0], {}).get("step")
        for names, _, _ in u.params:
            if names[0] in out:
                out[names[0]]["step"] = step.detach().cpu().clone()
    return out


def load_full_optim_state(model, optimizer, state):
    """Slice full_optim_state's output (saved by any layout) into this rank's shards."""
    index = {id(p): i for i, p in enumerate(p for g in optimizer.param_groups for p in g["params"])}
    new = {}
    for u in model.units:
        if u.params[0][0][0] not in state:
            continue  # no state yet (saved before the first step)
        flats = {k: local_flat(model, u, lambda names: pick(state, names)[k]) for k in ("exp_avg", "exp_avg_sq")}
        step = state[u.params[0][0][0]]["step"]
        for p, (a, b) in zip(u.shards, u.ranges):
            new[index[id(p)]] = {"step": step.clone(), **{k: f[a:b].clone().view_as(p) for k, f in flats.items()}}
    optimizer.load_state_dict({"state": new, "param_groups": optimizer.state_dict()["param_groups"]})
