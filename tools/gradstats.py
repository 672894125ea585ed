"""Gradient statistics: per-layer and per-kind gradient norms, update-to-weight ratios, activations.

    probe = gradstats.Probe(net, cfg)                    # after parallelize (grad_stats_every=0: inert)
    probe.before(step)                                   # a statistics step: activation hooks armed
    net.train_step(micro, loss_fn, autocast)
    grad_norm = net.step(cfg.grad_clip, *probe.hooks)    # grads before clipping, updates after the step
    step += 1; probe.after(step, logger, say)            # logged at step; the ratio warning said

Groups: a layer (emb: token and position tables; L<i>: block i; out: final norm and head) x a kind
(q, k, v: rows of attn.qkv; attn_proj, mlp, router, experts, norm, embedding, head, lora, other).
Keys <metric>/<layer>.<kind>, <metric>/<layer>, <metric>/<kind>, <metric>/total for grad_norm and
update_ratio (||W_after - W_before|| / ||W_before||), weight_norm per layer and kind; trainable
parameters only, a tied head is the embedding. Every layout gives the one-process numbers: each
element of the full model is counted on one rank (replicas on data rank 0, ZeRO-1 on the owner,
experts on dp rank 0 of their EP rank, FSDP where the shard lives, TP by tp.counted_pieces), the
per-group squares summed over the world. Pipelines are refused (config: a stage holds some layers).
Activations (forward hooks, armed on statistics steps only): each block's attention output,
dense-MLP hidden units (mlp.proj's input) and output: mean, rms, absmax, saturated (|x| >=
saturate), dead (channels with |x| <= dead_eps on every token), over the step's micro-steps and ranks.
Hooks do not fire in a compiled graph: a compiled DataParallel model runs its statistics steps eagerly;
compiled FSDP (blocks' forwards compiled) gives the L<i>.out sites only. Other steps cost nothing.
"""
import re

import torch
import torch.distributed as dist

from config import need
from parallelism import fsdp, tp

# the gradient statistics' config keys: logged on their own steps, read by plots.py --heatmap
GRADSTATS_DEFAULTS = dict(
    grad_stats_every=0,      # >0: per-layer/kind grad norms, update ratios, activation stats every N steps (0: none)
    ratio_low=1e-5,          # a warning when a layer's update ratio stays below ratio_low ...
    ratio_high=1e-1,         # ... or above ratio_high ...
    ratio_patience=3,        # ... for this many statistics steps in a row
    act_saturate=6.0,        # an activation counts as saturated at |x| >= act_saturate
    act_dead_eps=0.0,        # a channel counts as dead where |x| <= act_dead_eps on every token of the step
)
RESUME_FREE = tuple(GRADSTATS_DEFAULTS)  # a resumed run may change them (lifecycle.RESUME_FREE)


def check(cfg, world=1):
    need(cfg.grad_stats_every >= 0, f"grad_stats_every={cfg.grad_stats_every} must be >= 0 (0: no gradient statistics)")
    need(cfg.pp == 1 or not cfg.grad_stats_every, f"grad_stats_every={cfg.grad_stats_every} works with pp=1 only "
         f"(a stage holds some layers): set --grad_stats_every=0 or pp=1")
    need(0 < cfg.ratio_low < cfg.ratio_high, f"ratio_low={cfg.ratio_low}, ratio_high={cfg.ratio_high}: need "
         f"0 < ratio_low < ratio_high (the sane band of update ratios)")
    need(cfg.ratio_patience >= 1, f"ratio_patience={cfg.ratio_patience} must be >= 1")
    need(cfg.act_saturate > 0 and cfg.act_dead_eps >= 0,
         f"act_saturate={cfg.act_saturate} must be > 0 and act_dead_eps={cfg.act_dead_eps} >= 0")


KINDS = ("embedding", "q", "k", "v", "attn_proj", "mlp", "router", "experts", "norm", "head", "lora", "other")
BLOCK = re.compile(r"blocks\.(\d+)\.(.*)")
LAYER = re.compile(r"emb|out|L\d+")  # the layer labels


def classify(name):
    """A one-process parameter name -> (layer, kind); attn.qkv gets kind "qkv" (split by rows later)."""
    m = BLOCK.match(name)
    if m is None:
        if name.startswith(("tok_emb.", "pos_emb.")):
            return "emb", "embedding"
        return "out", "norm" if name.startswith("norm_f.") else "head" if name.startswith("head.") else "other"
    layer, rest = f"L{m.group(1)}", m.group(2)
    if ".lora_" in rest:
        return layer, "lora"
    if rest.startswith("attn.qkv."):
        return layer, "qkv"
    if rest.startswith("attn.proj."):
        return layer, "attn_proj"
    if rest.startswith(("norm1.", "norm2.", "attn.q_norm.", "attn.k_norm.")):
        return layer, "norm"
    if rest.startswith("mlp.router."):
        return layer, "router"
    if rest.startswith(("mlp.w1", "mlp.w2")):
        return layer, "experts"
    if rest.startswith("mlp."):
        return layer, "mlp"
    return layer, "other"


def layer_order(layers):
    """emb, L0, L1, ..., out: the order of the heat map's rows."""
    return sorted(layers, key=lambda s: (-1,) if s == "emb" else (1 << 30,) if s == "out" else (int(s[1:]),))


def _rows(shape):
    """Elements per index of dim 0 (a 1-D tensor: 1)."""
    n = 1
    for s in shape[1:]:
        n *= s
    return n


def pieces(name, shape, module):
    """[(first row, end row, kind)] of a parameter's local tensor (this rank's TP slice, of `shape`):
    attn.qkv's rows split into q, k, v by the attention module's (local) heads; one piece otherwise."""
    kind = classify(name)[1]
    rows = shape[0] if len(shape) else 1
    if kind != "qkv":
        return [(0, rows, kind)]
    a = module.get_submodule(name.rsplit(".", 2)[0])  # blocks.i.attn
    q, kv = a.n_head * a.head_dim, a.n_kv_head * a.head_dim
    return [(0, q, "q"), (q, q + kv, "k"), (q + kv, q + 2 * kv, "v")]


def counted_rows(name, p, shape, grid):
    """[(first row, end row)] of p's local tensor that this TP rank counts: a piece several TP ranks
    hold on its first holder (tp.counted_pieces), a replicated parameter on TP rank 0."""
    rows = shape[0] if len(shape) else 1
    if grid.tp == 1:
        return [(0, rows)]
    if not hasattr(p, "tp_split"):
        return [(0, rows)] if grid.tp_rank == 0 else []
    mine = [(off, off + n) for off, n, c in tp.counted_pieces(p, grid) if c]
    if p.tp_split[0] != 0:  # cuts along a later dim are always whole (chunks == tp): counted entirely
        if len(mine) != len(p.tp_split[1]):
            raise NotImplementedError(f"{name}: TP pieces shared along dim {p.tp_split[0]}")
        return [(0, rows)]
    return mine


def local_runs(name, p, shape, module, grid):
    """[(start, end, kind)]: the runs of p's local flat tensor that this rank counts (TP rule), by kind."""
    r = _rows(shape) if len(shape) else 1
    out = []
    for a0, a1, kind in pieces(name, shape, module):  # the kind's rows within the counted rows
        for b0, b1 in counted_rows(name, p, shape, grid):
            lo, hi = max(a0, b0), min(a1, b1)
            if lo < hi:
                out.append((lo * r, hi * r, kind))
    return out


class GradStats:
    """The (layer, kind) groups of a model under its layout, and their norms (see the module docstring).
    model: the wrapper (net.wrapper: dp.DataParallel, fsdp.FSDP) or a plain model. Holds no state but the map."""

    def __init__(self, model, grid, owner=None):
        self.grid, self.fsdp = grid, isinstance(model, fsdp.FSDP)
        self.runs = []  # (holder index, start, end, group index) in the holder's local flat tensor
        self.holders = []  # Parameters, or fsdp Units
        self.groups, index = [], {}

        def group(layer, kind):
            if (layer, kind) not in index:
                index[(layer, kind)] = len(self.groups)
                self.groups.append((layer, kind))
            return index[(layer, kind)]

        # every rank registers every group in the same order, counted here or not: one sum vector
        if self.fsdp:
            for u in [u for u in model.units if not u.frozen]:
                lo, off = u.rank * u.S, 0
                for (names, p, _), shape in zip(u.params, u.shapes):
                    for *_, kind in pieces(names[0], shape, model.module):
                        group(classify(names[0])[0], kind)
                    for s, e, kind in local_runs(names[0], p, shape, model.module, grid):
                        a, b = max(off + s, lo) - lo, min(off + e, lo + u.S) - lo  # within this shard
                        if a < b:
                            self.runs.append((len(self.holders), a, b, group(classify(names[0])[0], kind)))
                    off += shape.numel()
                self.holders.append(u)
        else:
            module = getattr(model, "module", model)
            for name, p in module.named_parameters():
                if not p.requires_grad:
                    continue
                if getattr(p, "expert", False):
                    replica = grid.dp_rank == 0  # experts: replicated over dp (each EP rank its own)
                else:
                    replica = grid.dp_rank == 0 and grid.ep_rank == 0
                mine = owner[id(p)] == grid.dp_rank if owner is not None else replica
                if owner is not None and grid.ep > 1:
                    raise ValueError("GradStats(owner=...): ZeRO-1 runs with ep = 1")
                for *_, kind in pieces(name, p.shape, module):
                    group(classify(name)[0], kind)
                for s, e, kind in local_runs(name, p, p.shape, module, grid) if mine else []:
                    self.runs.append((len(self.holders), s, e, group(classify(name)[0], kind)))
                self.holders.append(p)
        self.device = next(iter(h.shard.device if self.fsdp else h.device for h in self.holders), grid.device)

    # ------------------------------------------------------------------ sums of squares, every layout

    def flat(self, h, what):
        """Holder h's local flat tensor: its gradient, its weights, or None (no gradient)."""
        if self.fsdp:
            t = h.grad if what == "grad" else h.shard
        else:
            t = h.grad if what == "grad" else h.detach()
        return None if t is None else t.reshape(-1)

    def sq_sums(self, tensors):
        """tensors: [flat local tensor or None per holder] -> (groups,) fp32 sums of squares of the full
        model. Collective: summed over the world."""
        views, gid = [], []
        for h, s, e, g in self.runs:
            if tensors[h] is not None:
                views.append(tensors[h][s:e])
                gid.append(g)
        out = torch.zeros(len(self.groups), device=self.device)
        if views:
            sq = torch.stack(torch._foreach_norm(views)).float().square()
            out.index_add_(0, torch.tensor(gid, device=self.device), sq)
        return out

    def reduce(self, x):
        if self.grid.world > 1:
            dist.all_reduce(x)
        return x

    def grads(self):
        """{grad_norm/...} of the gradients now (reduced and unscaled, before clipping). Collective."""
        sq = self.reduce(self.sq_sums([self.flat(h, "grad") for h in self.holders]))
        return self.named("grad_norm", sq)

    def snapshot(self):
        """A copy of this rank's trainable weights (before optimizer.step())."""
        return [self.flat(h, "w").clone() for h in self.holders]

    def updates(self, before):
        """{update_ratio/..., weight_norm/...} of the step since `before` (a snapshot, consumed: it is
        overwritten in place, so the step's statistics need one copy of the weights). Collective."""
        wsq = self.sq_sums(before)
        for b, a in zip(before, (self.flat(h, "w") for h in self.holders)):
            b.sub_(a)  # W_before - W_after: the update's norm
        sq = self.reduce(torch.stack([self.sq_sums(before), wsq]))
        upd, w = self.named("", sq[0], root=False), self.named("", sq[1], root=False)
        out = {f"update_ratio/{k}": (upd[k] / w[k]) ** 0.5 if w[k] > 0 else float("nan") for k in upd}
        out.update({f"weight_norm/{k}": w[k] ** 0.5 for k in w if "." not in k})
        return out

    def named(self, metric, sq, root=True):
        """Per-group squared sums -> {<metric>/<key>: value}: groups, layers, kinds, total.
        root=False: the squared sums themselves, keyed without the metric."""
        vals = sq.tolist()  # one host sync
        agg = {}
        for (layer, kind), v in zip(self.groups, vals):
            for key in (f"{layer}.{kind}", layer, kind, "total"):
                agg[key] = agg.get(key, 0.0) + v
        if not root:
            return agg
        return {f"{metric}/{k}": v ** 0.5 for k, v in agg.items()}


# ---------------------------------------------------------------------------- activations

class Activations:
    """Forward hooks on each block's attention output, MLP hidden units and output; see the module
    docstring. model: the plain (TP / EP cut) module, net.raw. arm() before a step's forwards,
    collect() after them (collective: every rank calls it)."""

    def __init__(self, model, grid, saturate=6.0, dead_eps=0.0):
        self.model, self.grid, self.saturate, self.dead_eps = model, grid, saturate, dead_eps
        self.seq = any(getattr(m, "sequence_parallel", False) for m in model.modules())
        self.handles, self.acc = [], {}

    def arm(self):
        if self.handles:
            raise RuntimeError("Activations.arm(): already armed; collect() first")
        self.acc = {}
        for i, b in enumerate(self.model.blocks):
            self.handles.append(b.attn.register_forward_hook(self.hook(f"L{i}.attn", "rows")))
            self.handles.append(b.register_forward_hook(self.hook(f"L{i}.out", "rows")))
            if hasattr(b.mlp, "proj"):  # a dense MLP (MoE layers have no one hidden layer)
                self.handles.append(b.mlp.proj.register_forward_pre_hook(self.hook(f"L{i}.mlp_hidden", "cols")))

    def hook(self, site, split):
        """split: how TP cuts the tensor. rows: the residual stream, replicated over TP (or its
        sequence shard under sequence parallelism, in training); cols: hidden units cut over TP."""
        def fn(module, args, out=None):
            x = (args[0] if out is None else out).detach()
            # sequence parallelism shards the stream in forwards that record gradients (tp.sequence_sharded)
            self.add(site, x, split, sharded=split == "cols" or (self.seq and torch.is_grad_enabled()))
        return fn

    @torch.no_grad()
    def add(self, site, x, split, sharded):
        g = self.grid
        x = x.float().flatten(0, -2)  # (tokens, channels)
        a = x.abs()
        cols = x.shape[-1]
        chan = a.amax(0)
        if split == "cols" and g.tp > 1:  # this rank's contiguous slice of the hidden units
            full = torch.zeros(cols * g.tp, device=x.device)
            full[g.tp_rank * cols:(g.tp_rank + 1) * cols] = chan
            chan = full
        w = 1.0 if sharded or g.tp_rank == 0 else 0.0  # replicated over TP: counted on TP rank 0
        sums = torch.stack([x.sum(), x.square().sum(), torch.full((), float(x.numel()), device=x.device),
                            (a >= self.saturate).sum().float()]) * w
        if site in self.acc:
            s, m, c = self.acc[site]
            self.acc[site] = (s + sums, torch.maximum(m, a.max()), torch.maximum(c, chan))
        else:
            self.acc[site] = (sums, a.max(), chan)

    def collect(self):
        """Remove the hooks; {act/<site>.<stat>} over the step's micro-batches and ranks. Collective."""
        for h in self.handles:
            h.remove()
        self.handles = []
        if not self.acc:
            return {}
        sites = sorted(self.acc)
        sums = torch.stack([self.acc[s][0] for s in sites])
        maxes = torch.cat([torch.stack([self.acc[s][1] for s in sites])] + [self.acc[s][2] for s in sites])
        if self.grid.world > 1:
            dist.all_reduce(sums)
            dist.all_reduce(maxes, op=dist.ReduceOp.MAX)
        sums, maxes = sums.tolist(), maxes.tolist()
        out, off = {}, len(sites)
        for i, s in enumerate(sites):
            n = self.acc[s][2].numel()
            chan = maxes[off:off + n]
            off += n
            total, sq, count, sat = sums[i]
            out[f"act/{s}.mean"] = total / count
            out[f"act/{s}.rms"] = (sq / count) ** 0.5
            out[f"act/{s}.absmax"] = maxes[i]
            out[f"act/{s}.saturated"] = sat / count
            out[f"act/{s}.dead"] = sum(c <= self.dead_eps for c in chan) / n
        self.acc = {}
        return out


# ---------------------------------------------------------------------------- the warning

class RatioWatch:
    """A warning line when a layer's update ratio stays outside band = (low, high) for `patience`
    consecutive checks: once per excursion, again only after the ratio came back inside."""

    def __init__(self, band=(1e-5, 1e-1), patience=3):
        self.low, self.high = band
        self.patience = patience
        self.outside = {}  # layer -> consecutive checks outside the band

    def check(self, step, metrics):
        """metrics: a dict holding update_ratio/<layer> keys -> the warning lines of this check."""
        lines = []
        for key, r in metrics.items():
            layer = key[len("update_ratio/"):] if key.startswith("update_ratio/") else ""
            if not LAYER.fullmatch(layer):
                continue
            bad = not (self.low <= r <= self.high)  # NaN is outside too
            n = self.outside[layer] = self.outside.get(layer, 0) + 1 if bad else 0
            if n == self.patience:
                what = "exploding" if r > self.high else "vanishing" if r < self.low else "not a number"
                lines.append(f"warning: step {step}: layer {layer}'s update ratio {r:.2e} has been outside "
                             f"[{self.low:g}, {self.high:g}] for {n} checks ({what}): check lr, warmup, init")
        return lines


# ---------------------------------------------------------------------------- a stage's statistics steps

class Probe:
    """The statistics of every cfg.grad_stats_every-th step of a stage, in the calls of the module
    docstring; every rank makes them (collectives). grad_stats_every=0: nothing is built, the calls
    return at once. hooks: (grads, updates) for net.step's before_update / after_update; a stage
    that steps several times (GRPO's epochs) logs its last optimizer step's gradients and update,
    and the activations of all its forwards."""

    def __init__(self, net, cfg):
        self.every, self.on, self.metrics, self.w = cfg.grad_stats_every, False, {}, None
        self.hooks = (self.grads, self.updates)
        if not self.every:
            return
        self.net, self.fwd = net, None
        self.stats = GradStats(net.wrapper, net.grid, owner=getattr(net.optimizer, "grad_owner", None))
        self.acts = Activations(net.raw, net.grid, cfg.act_saturate, cfg.act_dead_eps)
        self.watch = RatioWatch((cfg.ratio_low, cfg.ratio_high), cfg.ratio_patience)
        self.compiled = net.fwd is not net.raw and net.fwd is not net.wrapper  # torch.compile(raw)

    def before(self, step):
        """Before the micro-steps of step `step` (0-based); it is a statistics step when (step + 1) %
        grad_stats_every == 0: the activation hooks are armed (compiled: the step runs eagerly)."""
        self.on = bool(self.every) and (step + 1) % self.every == 0
        if self.on:
            self.metrics = {}
            if self.compiled:
                self.fwd, self.net.fwd = self.net.fwd, self.net.raw
            self.acts.arm()

    def grads(self):
        """net.step's before_update: the gradient norms, and a snapshot of the weights."""
        if self.on:
            self.metrics.update(self.stats.grads())
            self.w = self.stats.snapshot()

    def updates(self):
        """net.step's after_update: the update ratios and weight norms (the snapshot consumed)."""
        if self.on and self.w is not None:
            self.metrics.update(self.stats.updates(self.w))
            self.w = None

    def after(self, step, logger, say):
        """After the step (step: the steps done): on a statistics step the hooks removed, its
        statistics logged at `step` (logger.log) and the ratio warnings said -> the statistics ({}
        on other steps)."""
        if not self.on:
            return {}
        self.on = False
        if self.compiled:
            self.net.fwd = self.fwd
        m = {**self.metrics, **self.acts.collect()}
        if m:  # (nothing when the step ran no forward: GRPO without a group left)
            logger.log(step, m)
        for line in self.watch.check(step, m):
            say(line)
        return m
