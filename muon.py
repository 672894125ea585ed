"""Muon for hidden matrices, AdamW for everything else: one optimizer; optional ZeRO-1.

    opt = optim.build_optimizer(raw, cfg, grid)   # cfg.optimizer == "muon" (or cfg.zero1)
    ...; model.finish(); parallel.clip_grad_norm_(...); opt.step()

Groups (param_groups): kind "muon" (2-D weights inside the blocks: attention and MLP matrices,
expert stacks treated as a batch of matrices) and kind "adamw" (embeddings, the output head, norms,
biases, scalars, MoE routers; decayed if >= 2-D, as optim.param_groups). Every group has
`lr_scale`: the training loop sets g["lr"] = lr_at(step) * g["lr_scale"], so cfg.muon_lr follows
the same schedule. The AdamW groups are stepped by torch.optim.AdamW itself.

Muon, per matrix W with gradient G (momentum mu, Nesterov, as torch.optim.SGD(nesterov=True)):
    B <- mu B + G;   U = G + mu B       (nesterov)
    O = NS5(U)                          (newton_schulz, per logical matrix: orthogonalize)
    W <- W (1 - lr wd) - lr s O         (s: shape_scale)

Read top to bottom: the algorithm (newton_schulz, orthogonalize, nesterov), the Muon optimizer
(plain, TP, ZeRO-1, EP: its docstring), parameter groups and build(); at the end, apart, FSDPMuon:
the same update on fsdp.py's flat shards.

Invariants: Newton-Schulz always sees a whole logical matrix (gathered over TP, one expert, fused
[q|k|v] and [gate|up] rows split), so every layout computes the one-process update; checkpoints
hold the one-process state (full_optim_state), which parallel.Net.load_full_state cuts into any
layout.
"""
import re

import torch
import torch.distributed as dist

from config import need
from memory import optim_memory
from parallelism import fsdp, gpus, tp

NS_COEFFS = (3.4445, -4.7750, 2.0315)
# Muon's config keys (optimizer="muon"): hidden matrices; embeddings, head, norms, biases stay on AdamW
MUON_DEFAULTS = dict(
    muon_lr=0.0,             # 0 -> lr (with muon_scale="rms" AdamW's lr and weight decay carry over)
    muon_momentum=0.95,      # Nesterov momentum
    muon_scale="rms",        # rms: update * 0.2*sqrt(max(rows, cols)) | shape: * sqrt(max(1, rows/cols))
    ns_dtype="bfloat16",     # Newton-Schulz precision: bfloat16 (float32 on GPUs without bf16) | float32 (exact tests)
    zero1=False,             # ZeRO-1: optimizer state sharded over data-parallel ranks (ddp only)
)
RESUME_FREE = ("ns_dtype", "zero1")  # of these, the keys a resumed run may change (lifecycle.RESUME_FREE)


def check(cfg, world=1):
    """Muon's keys (and ZeRO-1's: not under FSDP, which shards the state already)."""
    need(cfg.muon_lr >= 0, f"muon_lr={cfg.muon_lr} must be >= 0 (0 means lr)")
    need(0 <= cfg.muon_momentum < 1, f"muon_momentum={cfg.muon_momentum} must be in [0, 1)")
    need(cfg.muon_scale in ("rms", "shape"), f"muon_scale='{cfg.muon_scale}' must be rms or shape")
    need(cfg.ns_dtype in ("bfloat16", "float32"), f"ns_dtype='{cfg.ns_dtype}' must be bfloat16 or float32")
    need(not (cfg.zero1 and cfg.data_parallel == "fsdp"),
         "zero1=True shards optimizer state over ddp replicas; data_parallel='fsdp' already shards it: drop one")


def newton_schulz(G, steps=5, dtype=torch.bfloat16, eps=1e-7):
    """Approximately orthogonalise G (..., rows, cols): U V^T of its SVD, singular values pushed
    into roughly [0.7, 1.2]. Returns G's dtype. NS5: X = G / (|G|_F + 1e-7), transposed when tall;
    5 x { A = X X^T; X = a X + (b A + c A A) X } with (a, b, c) = NS_COEFFS, in bf16 (Muon's
    ns_dtype; fp32 for exact tests)."""
    a, b, c = NS_COEFFS
    X = G.to(dtype)
    tall = X.size(-2) > X.size(-1)
    if tall:
        X = X.mT
    X = X / (X.norm(dim=(-2, -1), keepdim=True) + eps)
    X = X.reshape(-1, *X.shape[-2:])  # a batch of matrices: baddbmm fuses the scalings into the matmuls
    for _ in range(steps):
        A = X @ X.mT
        B = torch.baddbmm(A, A, A, beta=b, alpha=c)  # b A + c A A
        X = torch.baddbmm(X, B, X, beta=a)  # a X + B X
    if tall:
        X = X.mT
    return X.reshape(G.shape).to(G.dtype)


def shape_scale(rows, cols, mode):
    """The update's scale s: 0.2 sqrt(max(rows, cols)) for muon_scale "rms" (the update's RMS is
    AdamW's typical 0.2, so AdamW's lr and wd carry over); sqrt(max(1, rows / cols)) for "shape"."""
    return 0.2 * max(rows, cols) ** 0.5 if mode == "rms" else max(1.0, rows / cols) ** 0.5


def orthogonalize(us, splits, steps, dtype, mode):
    """Scaled NS updates of full tensors us (per logical matrix: rows split by splits[i]; expert
    stacks (E, rows, cols) are E matrices). Matrices of one shape run as one batched NS, so a
    model's dozens of matrices cost a few kernels per iteration, not a few per matrix (tall ones
    transposed: a 124M LLaMA's 84 logical matrices make two batches). splits: p.muon_split, the row
    sizes of fused [q|k|v] and [gate|up] weights (set by build / mark_splits)."""
    mats = []  # (tensor index, its logical matrices as one (n, rows, cols) batch, wide: rows <= cols)
    for i, (u, split) in enumerate(zip(us, splits)):
        for m in (u.split(split, dim=-2) if split else [u]):
            m, tall = m.reshape(-1, *m.shape[-2:]), m.shape[-2] > m.shape[-1]
            mats.append((i, m.mT if tall else m, tall))  # NS(X^T) = NS(X)^T
    by_shape = {}
    for k, (_, m, _) in enumerate(mats):
        by_shape.setdefault(tuple(m.shape[-2:]), []).append(k)
    out = [None] * len(mats)
    for ks in by_shape.values():
        o = newton_schulz(torch.cat([mats[k][1].to(dtype) for k in ks]), steps, dtype)
        for k, piece in zip(ks, o.split([mats[k][1].shape[0] for k in ks])):
            out[k] = piece
    res = [[] for _ in us]
    for (i, _, tall), o in zip(mats, out):
        o = o.mT if tall else o
        res[i].append(o * shape_scale(o.shape[-2], o.shape[-1], mode))
    return [torch.cat([o.reshape(*u.shape[:-2], -1, u.shape[-1]) for o in r], dim=-2).to(u.dtype)
            for u, r in zip(us, res)]


def nesterov(bufs, grads, mu):
    """B <- mu B + G (in place); returns U = G + mu B (Nesterov)."""
    torch._foreach_mul_(bufs, mu)
    torch._foreach_add_(bufs, grads)
    return torch._foreach_add(grads, bufs, alpha=mu)


def nesterov_ns(bufs, grads, mu, splits, steps, dtype, mode):
    return orthogonalize(nesterov(bufs, grads, mu), splits, steps, dtype, mode)


def compile_options(version):
    """Inductor options for the compiled NS step under torch `version`. Before 2.12, inductor's loop
    reordering asserts on some fused nodes of this graph (FusedSchedulerNode.reorder_loops_by_dep_pair;
    configs/speedrun.py's shapes on torch 2.11, an H100): it is switched off there. 2.12 fixed it."""
    old = tuple(int(p) for p in re.findall(r"\d+", version)[:2]) < (2, 12)
    return {"loop_ordering_after_fusion": False} if old else None


class Muon(torch.optim.Optimizer):
    """param groups with "kind": "muon" | "adamw" (see the module docstring). grid: needed for TP
    and ZeRO-1 (None: one process).

    TP: a sharded parameter (p.tp_split) has U gathered to its full form over the TP group (every
    TP rank computes the same O), and each rank keeps its own slice.
    ZeRO-1 (zero1=True, dp > 1): every parameter has one owner in the data-parallel group (greedy by
    size, largest first, onto the least loaded rank): DataParallel(owner=opt.grad_owner) reduces
    each gradient to its owner only (a reduce per owner and bucket, half an all-reduce), the owner
    keeps the optimizer state and updates the whole matrix, then the parameters are all-gathered
    from their owners in fp32 (_sync_params): DDP's traffic in total, state memory ~1/dp per rank.
    parallel.clip_grad_norm_(owner=...) sums the owned gradients' norms over dp.
    EP (moe.py): expert stacks (E_local, rows, cols) are whole per rank; NS runs batched per
    expert, gate|up split; the router stays on AdamW. With ZeRO-1 the owners are chosen within
    grid.dp_group (the replicas of one expert shard), and gradients stay all-reduced (non-expert
    ones span dp x ep ranks, not one owner's group).
    The AdamW groups are stepped by torch.optim.AdamW (fused on GPU, foreach on CPU) over the
    parameters this rank owns; it shares this optimizer's `state`, so checkpoints see one optimizer."""

    def __init__(self, groups, lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0, momentum=0.95,
                 scale="rms", ns_steps=5, ns_dtype=torch.bfloat16, grid=None, zero1=False, compile_ns=True,
                 adamw=None):
        # adamw: None (torch.optim.AdamW) or a factory (groups, lr, betas, eps) -> the optimizer of the
        # AdamW groups, e.g. optim_memory.AdamW8bit / OffloadAdamW (its standard_state(p) gives checkpoints)
        if scale not in ("rms", "shape"):
            raise ValueError(f"muon scale '{scale}' must be rms or shape")
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, momentum=momentum,
                        scale=scale, ns_steps=ns_steps, kind="adamw", lr_scale=1.0)
        super().__init__(groups, defaults)
        self.grid, self.ns_dtype = grid, ns_dtype
        # on GPU, one compiled graph for the whole batched NS: the splits, transposes, casts and
        # scalings fuse around the batched matmuls instead of costing a launch per matrix each
        # (not under FSDP: each unit hands over a different set of matrices, a graph each)
        cuda = any(p.is_cuda for g in self.param_groups for p in g["params"])
        opts = compile_options(torch.__version__)
        maybe_compile = (lambda f: torch.compile(f, options=opts)) if cuda and compile_ns else (lambda f: f)
        self.orthogonalize, self.nesterov_ns = maybe_compile(orthogonalize), maybe_compile(nesterov_ns)
        self.zero1 = bool(zero1) and grid is not None and grid.dp > 1
        self.owner = {}  # id(param) -> owning dp rank (ZeRO-1)
        if self.zero1:
            ps = [p for g in self.param_groups for p in g["params"]]
            load = [0] * grid.dp
            for i in sorted(range(len(ps)), key=lambda i: (-ps[i].numel(), i)):  # same on every rank
                r = min(range(grid.dp), key=lambda r: (load[r], r))
                self.owner[id(ps[i])] = r
                load[r] += ps[i].numel()
            self.by_owner = [[p for p in ps if self.owner[id(p)] == r] for r in range(grid.dp)]  # fixed
        # the AdamW groups are stepped by torch's own AdamW (fused on GPU), over the parameters this
        # rank owns, sharing this optimizer's state dict (checkpoints see one optimizer)
        self.adamw, self.adamw_groups = None, []
        pairs = [(g, [p for p in g["params"] if self.owns(p)]) for g in self.param_groups if g["kind"] == "adamw"]
        pairs = [(g, ps) for g, ps in pairs if ps]
        if pairs:
            cuda = pairs[0][1][0].is_cuda
            self.adamw_groups = [g for g, _ in pairs]
            inner = [dict(params=ps, weight_decay=g["weight_decay"]) for g, ps in pairs]
            self.adamw = (adamw(inner, lr=lr, betas=betas, eps=eps) if adamw is not None else
                          torch.optim.AdamW(inner, lr=lr, betas=betas, eps=eps, fused=cuda or None,
                                            foreach=None if cuda else True))
            self.adamw.state = self.state

    # ------------------------------------------------------------------ ownership

    @property
    def grad_owner(self):
        """ZeRO-1 with ep = 1: {id(param): dp rank} for DataParallel(owner=...), which then reduces
        each gradient to its owner only (the other half of DDP's all-reduce is _sync_params'
        all-gather), and for parallel.clip_grad_norm_. None otherwise (with EP, non-expert
        gradients span dp x ep: all-reduced)."""
        return self.owner if self.zero1 and self.grid.ep == 1 else None

    def owns(self, p):
        """Does this rank keep p's state and update it (always, without ZeRO-1)?"""
        return not self.zero1 or self.owner[id(p)] == self.grid.dp_rank

    def state_bytes(self):
        """Bytes of optimizer state held by this rank."""
        return sum(v.numel() * v.element_size() for s in self.state.values() for v in s.values()
                   if torch.is_tensor(v))

    # ------------------------------------------------------------------ the step

    @torch.no_grad()
    def step(self, closure=None):
        loss = optim_memory.closure_loss(closure)
        for group in self.param_groups:
            if group["kind"] == "muon":
                self._muon(group)
        if self.adamw is not None:  # torch.optim.AdamW's arithmetic: it is torch's AdamW
            for g, inner in zip(self.adamw_groups, self.adamw.param_groups):
                inner["lr"], inner["weight_decay"] = g["lr"], g["weight_decay"]
            self.adamw.step()
        if self.zero1:
            self._sync_params()
        return loss

    def _muon(self, group):
        """Momentum and update for every matrix this rank owns; NS batched over equal shapes."""
        ps = [p for p in group["params"] if p.grad is not None and self.owns(p)]
        if not ps:
            return
        mu, lr, grid = group["momentum"], group["lr"], self.grid
        for p in ps:
            if "momentum_buffer" not in self.state[p]:
                self.state[p]["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        bufs, grads = [self.state[p]["momentum_buffer"] for p in ps], [p.grad for p in ps]
        ns = ([getattr(p, "muon_split", None) for p in ps], group["ns_steps"], self.ns_dtype, group["scale"])
        sharded = [grid is not None and grid.tp > 1 and hasattr(p, "tp_split") for p in ps]
        if not any(sharded):  # one (compiled, on GPU) function: the momentum passes fuse with NS's casts
            os = self.nesterov_ns(bufs, grads, mu, *ns)
        else:  # NS needs whole matrices: gather U over the TP group, keep our slice after
            us = nesterov(bufs, grads, mu)
            us = [tp.full_tensor(p, u, grid) if s else u for p, u, s in zip(ps, us, sharded)]
            os = self.orthogonalize(us, *ns)
            os = [tp.local_tensor(p, o, grid) if s else o for p, o, s in zip(ps, os, sharded)]
        torch._foreach_mul_(ps, 1 - lr * group["weight_decay"])
        torch._foreach_add_(ps, os, alpha=-lr)

    def _sync_params(self):
        """Every parameter from its owner: one all-gather of each rank's owned parameters, packed
        into one flat fp32 buffer (padded to the largest rank's share), unpacked by one foreach copy."""
        grid, mine = self.grid, self.by_owner
        sizes = [sum(p.numel() for p in m) for m in mine]
        n, me = max(sizes), grid.dp_rank
        parts = [p.detach().reshape(-1).float() for p in mine[me]]
        flat = torch.cat(parts + [parts[0].new_zeros(n - sizes[me])] if parts else
                         [self.param_groups[0]["params"][0].new_zeros(n)])
        out = flat.new_empty(grid.dp * n)
        fsdp.all_gather_single(out, flat, group=grid.dp_group)
        dst, src = [], []
        for r, m in enumerate(mine):
            if r != me and m:
                dst += m
                src += [t.view_as(p) for t, p in zip(out[r * n:r * n + sizes[r]].split([p.numel() for p in m]), m)]
        if dst:
            torch._foreach_copy_(dst, src)

    # ------------------------------------------------------------------ checkpoints

    def load_state_dict(self, state_dict):
        super().load_state_dict(state_dict)  # (a new self.state: share it with the inner AdamW again)
        if self.adamw is not None:
            self.adamw.state = self.state
            if self.adamw.defaults.get("fused"):  # fused AdamW keeps its step count on the parameter's device
                for g in self.adamw.param_groups:
                    for p in g["params"]:
                        if "step" in self.state.get(p, {}):
                            self.state[p]["step"] = self.state[p]["step"].to(p.device, torch.float32)
        if self.zero1:  # full state loaded: keep what this rank owns
            for g in self.param_groups:
                for p in g["params"]:
                    if not self.owns(p):
                        self.state.pop(p, None)

    def full_optim_state(self, model, grid):
        """{param name: {state key: full tensor / value}} on CPU, as a one-process run's optimizer:
        ZeRO-1 owners broadcast their state over dp, TP shards are gathered. Collective.
        {name: {"momentum_buffer"}} for Muon matrices, {name: {"step", "exp_avg", "exp_avg_sq"}}
        for AdamW parameters, as torch's AdamW. (Loading needs nothing of its own: Net.load_full_state
        cuts the full state and load_state_dict keeps what this rank owns.) Not here: gathering
        expert state over EP (moe.gather_experts / cut_experts do that)."""
        names = {id(p): n for n, p in model.named_parameters()}
        out = {}
        for group in self.param_groups:
            for p in group["params"]:
                st = self._from_owner(p, group, grid) if self.zero1 else self.state_of(p, group)
                for k, v in st.items():
                    full = tp.full_tensor(p, v, grid) if torch.is_tensor(v) and v.shape == p.shape else v
                    out.setdefault(names[id(p)], {})[k] = full.detach().clone().cpu() if torch.is_tensor(full) else full
        return out

    def state_of(self, p, group):
        """p's state in torch's form: an AdamW part that stores it otherwise (8-bit, on the host) converts."""
        if group["kind"] == "adamw" and hasattr(self.adamw, "standard_state"):
            return self.adamw.standard_state(p)
        return self.state.get(p, {})

    def _from_owner(self, p, group, grid):
        """ZeRO-1: p's state (local shapes) on every dp rank, broadcast by its owner; {} before the
        first step."""
        keys = ["momentum_buffer"] if group["kind"] == "muon" else ["step", "exp_avg", "exp_avg_sq"]
        src = dist.get_global_rank(grid.dp_group, self.owner[id(p)])
        st = self.state_of(p, group) if self.owns(p) else {}
        has = torch.tensor([1.0 if st else 0.0], device=p.device)
        dist.broadcast(has, src=src, group=grid.dp_group)
        if not has.item():
            return {}
        out = {}
        for k in keys:
            if k == "step":
                t = st[k].clone().float().to(p.device) if st else torch.zeros((), device=p.device)
            else:
                t = st[k].detach().clone() if st else torch.empty_like(p)
            dist.broadcast(t, src=src, group=grid.dp_group)
            out[k] = t
        return out


# ----------------------------------------------------------------------------- parameter groups

def _is_muon(name, ndim):
    return name.startswith("blocks.") and ndim >= 2 and "router" not in name


def _full_rows(p, shape):
    """Rows of p's full (TP-gathered) matrices; expert stacks (E, rows, cols) keep whole matrices."""
    if hasattr(p, "tp_split") and p.tp_split[0] == len(shape) - 2:
        return sum(size for size, _ in p.tp_split[1])
    return shape[-2]


def _split(name, rows, cfg):
    """Row sizes of the logical matrices in a fused weight of `rows` full rows: attn.qkv
    [q | k | v] (from the model config), gated MLP fc / expert w1 [gate | up] (equal halves, so
    shared experts of another width work too); None for a plain matrix."""
    if name.endswith("attn.qkv.weight"):
        return [cfg.n_head * cfg.head_dim, cfg.kv_heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim]
    if cfg.gated and (name.endswith(".fc.weight") or name.endswith(".w1")):
        return [rows // 2, rows // 2]
    return None


def mark_splits(model):
    """p.muon_split on the fused weights (see _split)."""
    for name, p in model.named_parameters():
        split = _split(name, _full_rows(p, p.shape), model.cfg) if p.dim() >= 2 else None
        if split:
            p.muon_split = split


def param_groups(model, cfg, use_muon=True):
    """[muon, adamw decayed, adamw not decayed] (empty groups dropped)."""
    muon_lr = cfg.muon_lr or cfg.lr
    m, decay, no_decay = [], [], []
    for name, p in model.named_parameters():  # unique: a tied weight appears once
        if not p.requires_grad:
            continue
        if use_muon and _is_muon(name, p.dim()):
            m.append(p)
        else:
            (decay if p.dim() >= 2 else no_decay).append(p)
    groups = [dict(params=m, kind="muon", weight_decay=cfg.weight_decay, lr=muon_lr, lr_scale=muon_lr / cfg.lr),
              dict(params=decay, kind="adamw", weight_decay=cfg.weight_decay),
              dict(params=no_decay, kind="adamw", weight_decay=0.0)]
    return [g for g in groups if g["params"]]


def build(model, cfg, grid=None):
    """The Muon(+AdamW) optimizer of cfg; optimizer="adamw" with zero1 gives AdamW-only groups.
    model: the plain / TP / EP model, or an fsdp.FSDP wrapper (-> FSDPMuon)."""
    use_muon = cfg.optimizer == "muon"
    if isinstance(model, fsdp.FSDP):
        return build_fsdp(model, cfg, use_muon)
    if use_muon:
        mark_splits(model)
    if any(hasattr(p, "tp_split") for p in model.parameters()) and grid is None:
        raise ValueError("a tensor-parallel model needs build_optimizer(model, cfg, grid)")
    return Muon(param_groups(model, cfg, use_muon), grid=grid, zero1=cfg.zero1,
                adamw=optim_memory.factory(cfg.adamw_state), **_hyper(cfg, next(model.parameters()).device))


def _hyper(cfg, device):
    """Muon's keyword arguments from the config (shared by build and build_fsdp). Newton-Schulz runs in
    fp32 on a GPU without bf16 (V100, T4, RTX 20xx), whatever ns_dtype says."""
    ns = "float32" if device.type == "cuda" and not gpus.has_bf16(device) else cfg.ns_dtype
    return dict(lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, weight_decay=cfg.weight_decay,
                momentum=cfg.muon_momentum, scale=cfg.muon_scale,
                ns_dtype={"bfloat16": torch.bfloat16, "float32": torch.float32}[ns])


# ----------------------------------------------------------------------------- FSDP: FSDPMuon

class FSDPMuon(Muon):
    """Muon on fsdp.FSDP's flat shards (build_optimizer(fsdp_wrapper, cfg, grid)): the muon group
    holds the shard Parameters of each block unit's first run, which holds only its hidden
    matrices, cut anywhere (fsdp.py puts MoE routers in a run of their own: AdamW). Each matrix has
    one owner in its unit's group (balanced by size; with EP an expert unit's group is dp, the
    others' dp x ep), which keeps its momentum as a whole matrix; per unit the step all-gathers the
    flat gradient, the owners orthogonalise their matrices (TP-gathered when cut by TP too) into a
    zero flat buffer, and one reduce-scatter hands each rank the update of its shard. The AdamW
    part runs on the shards. Checkpoints: full_optim_state / load_full_optim_state.
    fsdp_muon: {(unit index, parameter index): True} for the unit parameters Muon trains."""

    def __init__(self, groups, wrapper, fsdp_muon, **kw):
        super().__init__(groups, grid=wrapper.grid, **kw)
        self.fsdp, self.fsdp_owner, self.fsdp_bufs = wrapper, {}, {}
        load = {}  # whole-matrix owners per unit group (with EP, expert units: dp; the others dp x ep)
        mats = [(ui, i, u.shapes[i].numel()) for ui, u in enumerate(wrapper.units) for i in range(len(u.params))
                if fsdp_muon.get((ui, i))]  # (the model's Parameters are empty under FSDP: use shapes)
        for ui, i, n in sorted(mats, key=lambda m: (-m[2], m[0], m[1])):
            u = wrapper.units[ui]
            lo = load.setdefault(id(u.group), [0] * u.dp)
            r = min(range(u.dp), key=lambda r: (lo[r], r))
            self.fsdp_owner[(ui, i)] = r
            lo[r] += n

    def state_bytes(self):
        return super().state_bytes() + sum(v.numel() * v.element_size() for v in self.fsdp_bufs.values())

    def _muon(self, group):
        """FSDP: per unit, all-gather the flat gradient; each matrix's owner updates its momentum
        and orthogonalises the whole matrix (gathered over TP too); a reduce-scatter of the updates
        (zero where not owned) hands every rank the slice its shard needs."""
        mu, grid = group["momentum"], self.fsdp.grid
        for ui, u in enumerate(self.fsdp.units):
            mine = [i for i in range(len(u.params)) if self.fsdp_owner.get((ui, i)) is not None]
            if not mine or u.grad is None:
                continue
            full_g = u.all_gather_fp32(u.grad)
            upd, off, todo = torch.zeros_like(full_g), 0, []  # todo: (offset, n, param, its U)
            for i, ((names, p, _), shape, n) in enumerate(zip(u.params, u.shapes, u.sizes)):
                if self.fsdp_owner.get((ui, i)) == u.rank:
                    g = full_g[off:off + n].view(shape)
                    buf = self.fsdp_bufs.get((ui, i))
                    if buf is None:
                        buf = self.fsdp_bufs[(ui, i)] = torch.zeros_like(g)
                    buf.mul_(mu).add_(g)
                    v = g.add(buf, alpha=mu)
                    if grid.tp > 1 and hasattr(p, "tp_split"):
                        v = tp.full_tensor(p, v, grid)
                    todo.append((off, n, p, v))
                off += n
            os = orthogonalize([v for *_, v in todo], [getattr(p, "muon_split", None) for _, _, p, _ in todo],
                               group["ns_steps"], self.ns_dtype, group["scale"]) if todo else []
            for (off, n, p, _), o in zip(todo, os):
                if grid.tp > 1 and hasattr(p, "tp_split"):
                    o = tp.local_tensor(p, o, grid)
                upd[off:off + n] = o.reshape(-1)
            if u.dp > 1:
                out = torch.empty(u.S, dtype=upd.dtype, device=upd.device)
                fsdp.reduce_scatter_single(out, upd, op=dist.ReduceOp.SUM, group=u.group)
            else:
                out = upd
            for sp, (a, b) in zip(u.shards, u.ranges):
                if any(sp is q for q in group["params"]):
                    sp.mul_(1 - group["lr"] * group["weight_decay"])
                    sp.add_(out[a:b].view_as(sp), alpha=-group["lr"])

    def full_optim_state(self, model=None, grid=None):
        """The one-process optimizer state, from the shards (AdamW) and the owners' momentum."""
        w, grid, out = self.fsdp, self.fsdp.grid, {}
        root = w.units[0].shards[0]
        if not self.state.get(root):  # no step yet (the root's shards are AdamW on every rank)
            return out
        skip = {self.fsdp.units[ui].params[i][0][0] for ui, i in self.fsdp_owner}
        for key in ("exp_avg", "exp_avg_sq"):
            def local(u):
                return torch.cat([self.state[sp][key].reshape(-1) if key in self.state.get(sp, {})
                                  else torch.zeros(sp.numel(), device=sp.device) for sp in u.shards])
            for name, t in fsdp.gather_by_name(w, local).items():
                if name not in skip:
                    out.setdefault(name, {})[key] = t
        for name in out:
            out[name]["step"] = self.state[root]["step"].detach().cpu().clone()
        for (ui, i), r in sorted(self.fsdp_owner.items()):
            u = w.units[ui]
            names, p, _ = u.params[i]
            t = self.fsdp_bufs[(ui, i)].clone() if r == u.rank else torch.empty(u.shapes[i], device=u.device)
            if u.dp > 1:
                dist.broadcast(t, src=dist.get_global_rank(u.group, r), group=u.group)
            out[names[0]] = {"momentum_buffer": tp.full_tensor(p, t, grid).cpu()}
        return out

    def load_full_optim_state(self, model, grid, state):
        """full_optim_state()'s output (saved by any layout) into this rank's shards and owned
        momentum. Collective."""
        w = self.fsdp
        if not state:
            return
        index = {id(p): i for i, p in enumerate(p for g in self.param_groups for p in g["params"])}
        kind = {id(p): g["kind"] for g in self.param_groups for p in g["params"]}
        step = next(v["step"] for v in state.values() if "step" in v)
        new = {}
        for ui, u in enumerate(w.units):
            def of(key):
                def f(names):
                    e = fsdp.pick(state, names)
                    return e[key] if key in e else torch.zeros(e["momentum_buffer"].shape)
                return f
            flats = {k: fsdp.local_flat(w, u, of(k)) for k in ("exp_avg", "exp_avg_sq")}
            for sp, (a, b) in zip(u.shards, u.ranges):
                if kind[id(sp)] == "adamw":
                    new[index[id(sp)]] = {"step": step.clone(), **{k: f[a:b].clone().view_as(sp) for k, f in flats.items()}}
            for i, (names, p, _) in enumerate(u.params):
                if self.fsdp_owner.get((ui, i)) == u.rank:
                    t = tp.local_tensor(p, fsdp.pick(state, names)["momentum_buffer"], grid)
                    self.fsdp_bufs[(ui, i)] = t.float().to(u.device).clone()
        self.load_state_dict({"state": new, "param_groups": self.state_dict()["param_groups"]})


def build_fsdp(wrapper, cfg, use_muon):
    """Under FSDP the optimizer sees each unit's flat shards: a block unit's decayed shard holds
    only hidden matrices (Muon, updated through whole-matrix owners), the rest is AdamW."""
    if cfg.zero1:
        raise ValueError("zero1 with FSDP: FSDP already shards the optimizer state")
    fsdp_muon, m, decay, no_decay = {}, [], [], []
    for ui, u in enumerate(wrapper.units):
        flags = [use_muon and _is_muon(names[0], len(shape)) for (names, _, _), shape in zip(u.params, u.shapes)]
        first_run = [fsdp.run_of(names[0], len(shape)) == 0 for (names, _, _), shape in zip(u.params, u.shapes)]
        if any(flags) and flags != first_run:
            raise NotImplementedError(f"FSDP unit {ui} mixes Muon and AdamW matrices in one run")
        for i, ((names, p, _), f) in enumerate(zip(u.params, flags)):
            if f:
                fsdp_muon[(ui, i)] = True
                split = _split(names[0], _full_rows(p, u.shapes[i]), wrapper.module.cfg)
                if split:
                    p.muon_split = split
        n_muon = sum(n for n, f in zip(u.sizes, flags) if f)
        for sp, (a, _) in zip(u.shards, u.ranges):  # a shard lies in one run: where does it start?
            (no_decay if sp.dim() < 2 else m if u.rank * u.S + a < n_muon else decay).append(sp)
    muon_lr = cfg.muon_lr or cfg.lr
    groups = [dict(params=decay, kind="adamw", weight_decay=cfg.weight_decay),
              dict(params=no_decay, kind="adamw", weight_decay=0.0)]
    if use_muon:  # present (maybe empty) on every rank: its lr / momentum drive the owners
        groups.insert(0, dict(params=m, kind="muon", weight_decay=cfg.weight_decay, lr=muon_lr,
                              lr_scale=muon_lr / cfg.lr))
    return FSDPMuon(groups, wrapper, fsdp_muon, **_hyper(cfg, wrapper.units[0].device))
