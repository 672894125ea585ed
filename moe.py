"""Mixture of experts: a routed feed-forward layer, its router losses, expert parallelism.

    cfg = ModelConfig(..., n_experts=8, moe_top_k=2)  # model.Block builds MoE(cfg, MLP, act) in the chosen layers
    model = Transformer(cfg)                          # the full model, same seed on every rank
    tp.tensor_parallel(model, grid)                   # optional: every expert cut like the dense MLP
    moe.expert_parallel(model, grid)                  # keep this rank's experts, set the groups
    model = dp.DataParallel(model, grid)        # experts synced over dp, the rest over dp x ep (or fsdp.FSDP)
    loss = model(x, y)                                # LM loss + every MoE layer's router losses
(parallel.parallelize applies these in this order; parallel.clip_grad_norm_ counts expert shards over EP.)
This module imports tp.py only: model.py imports it, and hands each layer its MLP class (for the
shared expert) and activation function. Layer i is MoE when moe_layer(cfg, i); the others keep model.MLP.

Where each part is explained: the layer (router, experts, shared experts, dtypes) in MoE; capacity
and dropless routing in MoE.forward; the two expert kernels in MoE._ffn; the router losses and what
they are invariant to in MoE._losses; expert parallelism (and TP x EP, FSDP x EP, gradient
normalisation) in expert_parallel; the token exchanges in AllToAll; checkpoints in gather_experts.

Invariants: for a fixed global micro-batch, outputs, router losses and gradients equal the one-process
ones whatever the EP / DP / TP split; what capacity drops depends on the sequence alone; an expert
without tokens gets an exact zero gradient; checkpoints hold the one-process layout, so a run
resumes under any ep.
"""
import math
from dataclasses import replace

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from parallelism import tp


def _size(group):
    return dist.get_world_size(group) if group is not None and dist.is_initialized() else 1


def _a2a(x, out_splits, in_splits, group):
    """all_to_all_single along dim 0 into a new tensor; splits None -> equal blocks. A functional
    collective, for the reason tp._collective gives."""
    if out_splits is None:
        out_splits = in_splits = [x.shape[0] // _size(group)] * _size(group)
    ops = torch.ops._c10d_functional
    return ops.wait_tensor(ops.all_to_all_single(x.contiguous(), out_splits, in_splits, group.group_name))


class AllToAll(torch.autograd.Function):
    """Send row blocks of x to every rank of the group (in_splits rows to each, in rank order) and
    receive out_splits rows from each; backward sends the gradients back the reverse way.

    How MoE layers use it over the EP group (expert_parallel):
      capacity  each rank sends its (E, B * cap, C) buffer split by owner (equal splits, no counts,
                no host sync), the owner runs its experts on (E/ep, ep * B * cap, C), sends results
                back (MoE._exchange).
      dropless  token counts per (rank, expert) exchanged with a small all_to_all_single (one host
                sync for the split sizes), then tokens sorted by expert travel with uneven splits
                (MoE._host_sized)."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        return _a2a(x, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx, g):
        out_splits, in_splits = ctx.splits
        return _a2a(g, in_splits, out_splits, ctx.group), None, None, None


def _count(idx, n):
    """torch.bincount(idx, minlength=n) for idx < n, without bincount's host sync on GPU."""
    return torch.zeros(n, dtype=torch.long, device=idx.device).scatter_add_(0, idx, torch.ones_like(idx))


def _fast_grouped(device, dtype):
    """Does torch._grouped_mm run its own kernel here (CUDA bf16 on compute capability 9.x), not a
    per-group fallback that reads the offsets on the host? (sm100 left out: pytorch issue 172439)"""
    return device.type == "cuda" and dtype == torch.bfloat16 and torch.cuda.get_device_properties(device).major == 9


def moe_layer(cfg, i):
    """Is layer i a mixture-of-experts layer under ModelConfig cfg?"""
    return cfg.n_experts > 0 and i >= cfg.moe_first_dense and (i - cfg.moe_first_dense) % cfg.moe_every == 0


class MoE(nn.Module):
    """A routed feed-forward layer, for x (B, T, C), N = B T tokens:
      router   logits = x W_r^T in fp32 (autocast off, fp32 copies of x and W_r), probs = softmax;
               the top moe_top_k probabilities are the weights (renormalised to sum to 1 when
               moe_renorm), y = sum_j w_j FFN_{e_j}(x) + shared(x).
      experts  one weight tensor per matrix, w1 (E, [2]H, C) (gated: rows [gate | up] like MLP.fc)
               and w2 (E, C, H), no biases. Slot rows sorted by expert form one block per expert,
               each multiplied by its expert's matrices: exactly the routed rows, no zero padding to
               the busiest expert, whose padded rows (and their hidden activations, kept for
               backward) cost up to E/k x the memory under imbalance. An expert without tokens gets
               an empty block and an exact zero gradient. The kernels: _ffn.
      shared   n_shared_experts always-on experts: one dense model.MLP of n_shared_experts * H units
               (the class is passed in by model.Block).
      dtypes   under autocast the slots are exchanged and multiplied in the autocast dtype (bf16);
               only the router (and its losses) is fp32. Init as MLP: w1 N(0, init_std), w2 (an
               output projection) N(0, init_std / sqrt(2 n_layer)).
      eval     Transformer.forward adds the router losses in training mode only (reduction "mean");
               capacity dropping applies in eval and generation too.
    Logged per layer after each forward in `stats` (detached, no host sync until read): aux_loss,
    z_loss, load (fraction of routed slots per expert, global), dropped (fraction of slots dropped,
    global); metrics(model) reads them."""
    is_moe = True

    def __init__(self, cfg, mlp, act):
        """cfg: model.ModelConfig; mlp: the dense MLP class (model.MLP, built for the shared
        experts); act: the activation function (model.activation_fn(cfg.activation))."""
        super().__init__()
        E, C, H = cfg.n_experts, cfg.n_embd, cfg.moe_hidden or cfg.hidden
        self.n_experts, self.top_k, self.renorm = E, cfg.moe_top_k, cfg.moe_renorm
        self.capacity_factor = cfg.capacity_factor
        self.aux_coeff, self.z_coeff = cfg.aux_loss_coeff, cfg.z_loss_coeff
        self.gated, self.act = cfg.gated, act
        self.router = nn.Linear(C, E, bias=False)
        self.w1 = nn.Parameter(torch.empty(E, 2 * H if cfg.gated else H, C))
        self.w2 = nn.Parameter(torch.empty(E, C, H))
        for p in (self.w1, self.w2):
            p.expert = True  # dp.DataParallel syncs these over their replicas only
        self.shared = (mlp(replace(cfg, n_experts=0, ffn_hidden=cfg.n_shared_experts * H))
                       if cfg.n_shared_experts else None)
        # layout, set by expert_parallel(): this rank holds experts [ep_rank * E/ep, ...)
        self.ep, self.ep_rank, self.ep_group, self.data_group = 1, 0, None, None
        self.tp_group = None  # set by tensor_parallel(): each rank holds a slice of every expert
        self.expert_mm = "auto"  # expert kernel: "auto" | "grouped" (torch._grouped_mm) | "loop"
        self.router_loss = None  # aux + z of the latest forward (differentiable)
        self.stats = {}
        self.init_experts(cfg.init_std, cfg.init_std)

    @torch.no_grad()
    def init_experts(self, std, out_std):
        nn.init.normal_(self.w1, 0.0, std)
        nn.init.normal_(self.w2, 0.0, out_std)

    def tensor_parallel(self, grid):
        """Cut every expert like the dense MLP, in place (called by tp.tensor_parallel): w1 rows
        [gate | up] column-parallel, w2 columns row-parallel (p.tp_split); the router replicated,
        the shared expert cut as a model.MLP. _ffn then sums the partial outputs over grid.tp_group."""
        E_h = self.w2.shape[-1]
        self.w1 = tp.shard(self.w1, grid, 1, [(E_h, grid.tp)] * (2 if self.gated else 1))
        self.w2 = tp.shard(self.w2, grid, 2, [(E_h, grid.tp)])
        self.w1.expert = self.w2.expert = True
        self.tp_group = grid.tp_group
        if self.shared is not None:
            tp.mlp_parallel(self.shared, grid)

    def expert_numel(self):
        """Parameters of one routed expert."""
        return self.w1[0].numel() + self.w2[0].numel()

    # ------------------------------------------------------------------ forward

    def forward(self, x):
        """x (B, T, C) -> (B, T, C); sets self.router_loss and self.stats.

        Slots: a token's k choices are k slots, ordered choice-major (every token's first choice,
        then every second choice, ...), which is the order capacity is granted in.
        capacity_factor > 0: each expert takes at most cap = ceil(cf * T * k / E) slots from each
          sequence of T tokens; later slots are dropped (their output is 0; a dropped slot still
          counts in the balance statistics). Per sequence, not per rank, so what is dropped depends
          on the sequence alone, never on micro-batch size or the EP/DP layout. Shapes are static
          (E, B * cap, C): no host sync.
        capacity_factor = 0: dropless. With the grouped kernel's fast path and ep = 1 no host sync
          at all (sync_free(device, dtype) says so: a CUDA graph can capture the layer); with the
          loop the per-expert block sizes cost one host sync per layer; under EP the all_to_all
          split sizes need the counts on the host: one small count exchange and one host sync per
          layer, either kernel."""
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        N, C = x.shape
        E, k = self.n_experts, self.top_k
        with torch.autocast(x.device.type, enabled=False):  # router in fp32 even under bf16 autocast
            logits = F.linear(x.float(), self.router.weight.float())
        probs = logits.softmax(dim=-1)
        w, e = probs.topk(k, dim=-1)  # (N, k)
        if self.renorm:
            w = w / w.sum(dim=-1, keepdim=True)
        e_s = e.t().reshape(-1)  # slot s = j * N + n: token n's j-th choice (choice-major)
        if torch.is_autocast_enabled(x.device.type):  # exchange and buffer in the compute dtype
            x = x.to(torch.get_autocast_dtype(x.device.type))
        xs = x.repeat(k, 1)  # (k N, C): the token of every slot
        counts = _count(e_s, E)  # routed slots per expert, on this rank
        if self.capacity_factor > 0:
            # capacity per sequence: slot s belongs to sequence (s mod N) // T
            B, T = (shape[0], shape[1]) if len(shape) == 3 else (1, N)
            cap = max(1, math.ceil(self.capacity_factor * T * k / E))
            seq = torch.arange(k * N, device=x.device) % N // T
            key = seq * E + e_s  # (sequence, expert) of every slot
            pos = self._position(key, _count(key, B * E))
            keep = pos < cap
            M = B * cap  # buffer rows per expert: [sequence 0's cap slots | sequence 1's | ...]
            dest = torch.where(keep, e_s * M + seq * cap + pos, E * M)  # dropped slots -> a trash row
            # index_put keeps only dest for backward (index_add would also keep xs, (k N, C)); kept
            # slots have distinct rows, dropped ones all write the trash row, whose value is never read
            buf = x.new_zeros(E * M + 1, C).index_put((dest,), xs)[:-1].view(E, M, C)
            out = self._exchange(buf)  # (E, M, C): every expert's outputs, from their owners
            ys = torch.cat([out.reshape(E * M, C), out.new_zeros(1, C)])[dest]  # dropped -> 0
            dropped = (~keep).sum()
        else:
            ys = self._dropless(xs, e_s, counts)
            dropped = counts.new_zeros(())
        y = (ys.view(k, N, C) * w.t().unsqueeze(-1).to(ys.dtype)).sum(0)
        if self.shared is not None:
            y = y + self.shared(x)
        self._losses(logits, probs, counts, dropped)
        return y.view(shape)

    @staticmethod
    def _position(e_s, counts):
        """Each slot's position among the slots routed to its expert, in slot order."""
        order = e_s.argsort(stable=True)
        starts = counts.cumsum(0) - counts
        pos = torch.empty_like(e_s)
        pos[order] = torch.arange(e_s.numel(), device=e_s.device) - starts[e_s[order]]
        return pos

    def _ffn(self, rows, sizes, counts=None):
        """rows (R, C) sorted by local expert, sizes[i] rows for local expert i -> (R, C). sizes:
        host ints, or None where the caller has only `counts`, the same as an (El,) device tensor
        (the loop then reads it: one host sync); the grouped kernel reads counts on the device.
        Under TP every rank holds a slice of each expert's hidden units: Copy sums the input
        gradient over TP; Reduce sums the partial outputs once, per slot, before the routing
        weights scale them, so the router's gradient is whole and the same on every TP rank.

        Two kernels compute the blocks (same numbers), chosen by _grouped from MoE.expert_mm:
          grouped  torch._grouped_mm: one kernel per matrix over all local experts; its fast path
                   reads the block ends (offs) on the device: sizes never reach the host;
          loop     one F.linear per expert (block sizes on the host: one sync per layer when
                   dropless), or one torch.bmm per matrix when the blocks are equal (capacity).
        "auto" (default) = grouped where its fast kernel runs (_fast_grouped), and only dropless
        (equal capacity blocks keep bmm); loop everywhere else (on CPU and other GPUs _grouped_mm
        is a per-group fallback that reads offs on the host). "grouped" forces it for every block
        layout and device (eager fp32 works on CPU; under torch.compile its meta function takes
        bf16 only), "loop" forces the loop. Grouped needs 16-byte aligned rows: n_embd and the
        expert hidden size (per TP rank) multiples of 16 / element size."""
        if self.tp_group is not None:
            rows = tp.Copy.apply(rows, self.tp_group)
        equal = sizes is not None and len(set(sizes)) == 1
        if self._grouped(rows.device, rows.dtype, equal):
            if counts is None:  # equal blocks are filled on the device: no copy from the host
                counts = (rows.new_full((len(sizes),), sizes[0], dtype=torch.long) if equal
                          else torch.tensor(sizes, device=rows.device))
            offs = counts.cumsum(0).to(torch.int32)  # block ends, on the device: no host sync
            w1, w2 = self.w1.to(rows.dtype), self.w2.to(rows.dtype)  # autocast does not cast it
            out = self._act(torch._grouped_mm(rows, w1.transpose(1, 2), offs=offs))
            out = torch._grouped_mm(out, w2.transpose(1, 2), offs=offs)
        else:
            sizes = counts.tolist() if sizes is None else sizes  # host sync: the block sizes
            if len(set(sizes)) == 1:  # equal blocks (capacity): one batched matmul per matrix
                out = self._act(torch.bmm(rows.view(len(sizes), sizes[0], rows.shape[1]), self.w1.transpose(1, 2)))
                out = torch.bmm(out, self.w2.transpose(1, 2)).view(rows.shape)
            else:  # unbind makes one backward node that stacks the experts' gradients
                out = torch.cat([F.linear(self._act(F.linear(part, w1)), w2) for w1, w2, part
                                 in zip(self.w1.unbind(0), self.w2.unbind(0), rows.split(sizes))])
        return out if self.tp_group is None else tp.Reduce.apply(out, self.tp_group)

    def _grouped(self, device, dtype, equal):
        """Run the experts with torch._grouped_mm on rows of this device and dtype? (MoE.expert_mm;
        equal: every block the same size)"""
        if self.expert_mm not in ("auto", "grouped", "loop"):
            raise ValueError(f"expert_mm={self.expert_mm!r}: choose 'auto', 'grouped' or 'loop'")
        if self.expert_mm == "loop":
            return False
        C, H = self.w2.shape[1:]
        align = 16 // dtype.itemsize  # _grouped_mm wants 16-byte aligned row strides
        ok = hasattr(torch, "_grouped_mm") and C % align == 0 and H % align == 0
        if self.expert_mm == "grouped":
            if not ok:
                raise ValueError(f"expert_mm='grouped' needs torch._grouped_mm (torch >= 2.8; this is "
                                 f"{torch.__version__}) and n_embd={C} and the expert hidden size per rank "
                                 f"{H} multiples of {align} in {dtype}: change them or set expert_mm='auto'")
            return True
        return ok and not equal and _fast_grouped(device, dtype)

    def sync_free(self, device, dtype):
        """Does a dropless forward of this layer on `device`, computing in `dtype` (the autocast
        dtype), run without any host sync (ep = 1, the grouped kernel, and its fast path, which
        reads offs on the device), so that a CUDA graph can capture it?"""
        device = torch.device(device)
        return self.ep == 1 and _fast_grouped(device, dtype) and self._grouped(device, dtype, equal=False)

    def _act(self, h):
        if self.gated:
            gate, up = h.chunk(2, dim=-1)
            return self.act(gate) * up
        return self.act(h)

    def _exchange(self, buf):
        """Fixed capacity: (E, cap, C) slots of this rank's tokens -> the experts' outputs for them."""
        E, cap, C = buf.shape
        if self.ep == 1:
            return self._ffn(buf.view(E * cap, C), [cap] * E).view(E, cap, C)
        ep, El = self.ep, E // self.ep
        # block s of the buffer (experts of EP rank s) goes to rank s; we receive every rank's block for ours
        r = AllToAll.apply(buf.reshape(E * cap, C), None, None, self.ep_group)
        r = r.view(ep, El, cap, C).transpose(0, 1).reshape(El * ep * cap, C)
        o = self._ffn(r, [ep * cap] * El).view(El, ep, cap, C).transpose(0, 1).reshape(E * cap, C)
        return AllToAll.apply(o, None, None, self.ep_group).view(E, cap, C)

    def _dropless(self, xs, e_s, counts):
        """Every slot computed: (k N, C) slot rows, expert ids (k N,) -> outputs (k N, C)."""
        order = e_s.argsort(stable=True)
        inv = order.argsort()
        xs = xs[order]
        if self.ep == 1 and self._grouped(xs.device, xs.dtype, False):
            return self._ffn(xs, None, counts)[inv]  # no host sync: torch.compile traces it whole
        host = self._host_sized
        if torch.compiler.is_compiling():  # (a decorator would import torch._dynamo with this module)
            host = torch.compiler.disable(host)
        return host(xs, counts)[inv]

    def _host_sized(self, xs, counts):
        """The dropless paths that read block sizes on the host: the loop's (ep = 1) and the
        all_to_all splits (ep > 1). They run eagerly under torch.compile (torch.compiler.disable: a
        graph break around them): traced, dynamo would specialise the graph on sizes that change
        every step and recompile until its limit, far slower than eager (BENCHMARKS.md, MoE)."""
        if self.ep == 1:
            return self._ffn(xs, None, counts)  # one host sync, for the block sizes
        ep, El, g = self.ep, self.n_experts // self.ep, self.ep_group
        recv = _a2a(counts, None, None, g)  # (ep * El,): rows each rank sends to each of our experts
        host = torch.cat([counts.view(ep, El).sum(1), recv]).tolist()  # one host sync per layer
        send, rc = host[:ep], host[ep:]
        got = [sum(rc[s * El:(s + 1) * El]) for s in range(ep)]
        xr = AllToAll.apply(xs, got, send, g)  # ordered (source rank, local expert)
        local = torch.arange(El, device=xs.device).repeat(ep).repeat_interleave(recv, output_size=sum(got))
        o2 = local.argsort(stable=True)  # regroup by local expert
        per_e = [sum(rc[s * El + i] for s in range(ep)) for i in range(El)]
        yr = self._ffn(xr[o2], per_e, recv.view(ep, El).sum(0))[o2.argsort()]
        return AllToAll.apply(yr, send, got, g)

    def _losses(self, logits, probs, counts, dropped):
        """The router losses (added to the training loss by Transformer.forward, and logged):
          balance  aux = aux_loss_coeff * E * sum_i f_i P_i. f_i = routed slots sent to expert i /
                   (tokens * top_k), counted before capacity drops and summed over the whole data
                   group (dp x ep ranks: the global micro-batch), no gradient; P_i = mean router
                   probability of expert i over this rank's tokens. A perfectly balanced router
                   gives exactly aux_loss_coeff.
          z-loss   z = z_loss_coeff * mean over this rank's tokens of logsumexp(logits)^2.
        What a user gets: per micro-step, the router losses of the global micro-batch (every data
        rank's current micro-batch together). Each rank's value uses the global f and its local P /
        z, so the mean of the ranks' values is the one-process value of that global micro-batch
        and, after the data-parallel gradient average, so are the gradients. Hence, for a fixed
        global micro-batch (micro_batch_size x dp x ep sequences), values and gradients do not
        depend on how it is split over EP / DP ranks, and a step with accumulation is the mean over
        its micro-batches. Changing the number of accumulation steps at a fixed global batch
        changes the micro-batch the balance is measured on (as in Megatron-LM / DeepSpeed): that is
        not invariant."""
        E = self.n_experts
        stats = torch.cat([counts, dropped.view(1)])  # global-batch statistics: sum over data ranks
        if _size(self.data_group) > 1:
            dist.all_reduce(stats, group=self.data_group)
        total = stats[:E].sum()
        f = stats[:E].float() / total  # fraction of routed slots per expert (no gradient)
        aux = self.aux_coeff * E * (f * probs.mean(0)).sum()
        z = self.z_coeff * logits.logsumexp(dim=-1).square().mean()
        self.router_loss = aux + z
        self.stats = {"aux_loss": aux.detach(), "z_loss": z.detach(), "load": f,
                      "dropped": stats[E].float() / total}


def layers(model):
    """The MoE layers of a model, in module order."""
    return [m for m in model.modules() if getattr(m, "is_moe", False)]


# ----------------------------------------------------------------------------- expert parallelism

def expert_parallel(model, grid):
    """Keep this rank's experts of every MoE layer (in place) and give the layers their groups.
    Call on the full model (same seed on every rank), after tp.tensor_parallel, before the
    optimizer and dp.DataParallel / fsdp.FSDP; also with ep = 1, so that the balance
    statistics span the data group.

    Rank ep_rank of an EP group keeps experts [ep_rank * E/ep, (ep_rank + 1) * E/ep). EP ranks see
    different data, so the data-parallel world is dp x ep (grid.data_group): non-expert parameters
    are replicated on all of it; an expert's replicas are its dp_group. Tokens travel with
    AllToAll, whose backward is the reverse exchange.
    Gradient normalisation: each rank's loss is the mean over its local batch; an expert on its
    owner receives the gradients of every EP rank's loss through the reverse exchange, so
    dp.DataParallel sums expert gradients over dp_group and divides by dp * ep, like every other
    gradient: each equals the one-process gradient of the global-batch mean.
    TP x EP (grid dp x ep x tp, TP innermost): MoE.tensor_parallel cuts every expert's hidden units
    like the dense MLP (p.tp_split, so checkpoints and Muon see whole matrices); the router stays
    replicated. Tokens travel over the ep group (ranks of one tp rank), identical on every TP rank.
    FSDP x EP (fsdp.py): non-expert parameters sharded over the data group, experts over dp_group.
    Muon trains the experts too (whole matrices per expert, gate|up split); the router stays on AdamW."""
    for m in layers(model):
        if m.n_experts % grid.ep:
            raise ValueError(f"n_experts={m.n_experts} is not divisible by ep={grid.ep}")
        m.data_group = getattr(grid, "data_group", None) or grid.dp_group
        m.ep, m.ep_rank, m.ep_group = grid.ep, grid.ep_rank, grid.ep_group
        if grid.ep > 1:
            El = m.n_experts // grid.ep
            for name in ("w1", "w2"):
                full = getattr(m, name)
                p = nn.Parameter(full.detach()[grid.ep_rank * El:(grid.ep_rank + 1) * El].clone(),
                                 requires_grad=full.requires_grad)
                p.expert, p.ep_split = True, grid.ep
                if hasattr(full, "tp_split"):  # TP cuts rows / columns, EP whole experts: both hold
                    p.tp_split = full.tp_split
                setattr(m, name, p)
    return model


def _expert_names(model):
    """[(name, MoE layer)] of the expert tensors of every expert-parallel layer (found by module,
    so they are found under fsdp.FSDP too, whose model holds no Parameters)."""
    return [(f"{mn}.{a}", m) for mn, m in model.named_modules() if getattr(m, "is_moe", False) and m.ep > 1
            for a in ("w1", "w2")]


def gather_experts(model, grid, weights, opt_state=None):
    """Net.full_state()'s output with every expert shard replaced by the full (E, ...) tensor,
    all-gathered over the EP group in rank order (state tensors shaped like the weight too: AdamW
    moments, Muon momentum): one-process names and shapes. Tensors already full are left alone.
    Collective over the EP group; returns (weights, opt_state). Called by parallel.Net.full_state;
    cut_experts (by load_full_state) is its inverse, so a run resumes under any ep."""
    def full(t):
        t = t.detach().to(grid.device).contiguous()
        parts = [torch.empty_like(t) for _ in range(grid.ep)]
        dist.all_gather(parts, t, group=grid.ep_group)
        return torch.cat(parts).cpu()

    for name, m in _expert_names(model):
        local = weights[name]
        if local.shape[0] == m.n_experts:
            continue
        weights[name] = full(local)
        for k, v in (opt_state or {}).get(name, {}).items():
            if torch.is_tensor(v) and v.shape == local.shape:
                opt_state[name][k] = full(v)
    return weights, opt_state


def cut_experts(model, grid, weights, opt_state=None):
    """The inverse, for loading: full (E, ...) expert tensors (weights and state shaped like them)
    -> this EP rank's experts; the rest untouched. New dicts; returns (weights, opt_state)."""
    weights = dict(weights)
    opt_state = None if opt_state is None else {k: dict(v) for k, v in opt_state.items()}
    for name, m in _expert_names(model):
        full, El = weights[name], m.n_experts // m.ep
        weights[name] = full[m.ep_rank * El:(m.ep_rank + 1) * El]
        for k, v in (opt_state or {}).get(name, {}).items():
            if torch.is_tensor(v) and v.shape == full.shape:
                opt_state[name][k] = v[m.ep_rank * El:(m.ep_rank + 1) * El]
    return weights, opt_state


def metrics(model, group=None):
    """Router statistics of the latest forward as floats, for logging (host sync: log steps only).
    aux_loss / z_loss: summed over layers, averaged over `group` (collective when given);
    load_max: the busiest expert's share x n_experts (1 = balanced), worst layer; dropped: mean."""
    moes = [m for m in layers(model) if m.stats]
    if not moes:
        return {}
    losses = torch.stack([sum(m.stats["aux_loss"] for m in moes), sum(m.stats["z_loss"] for m in moes)]).float()
    if _size(group) > 1:
        dist.all_reduce(losses, group=group)
        losses /= _size(group)
    load = max((m.stats["load"].max() * m.n_experts).item() for m in moes)
    dropped = sum(m.stats["dropped"].item() for m in moes) / len(moes)
    return {"aux_loss": losses[0].item(), "z_loss": losses[1].item(), "load_max": load, "dropped": dropped}
