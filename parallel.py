"""Process grid, data parallelism, and parallelize(): the one place every layout is applied.

    grid = parallel.init(cfg)                          # from torchrun's environment (or one plain process)
    run = parallel.parallelize(Transformer(mcfg), grid, cfg, load=...)   # TP, load, EP, FSDP or DP, compile
    with run.model.no_sync(): run.fwd(x, y).backward()  # (all but the last micro-step)
    run.model.finish(); run.clip_grad_norm_(1.0); run.optimizer.step(); run.model.zero_grad()

Ranks form arange(world).view(dp, ep, tp) with TP innermost, so tensor-parallel partners are
neighbouring GPUs. Tensor parallelism lives in tp.py, FSDP in fsdp.py, experts in moe.py.
EP ranks see different data: the data-parallel world (loader shards, gradient averaging of
non-expert parameters) is dp x ep, `grid.data_group` / `data_rank` / `data_world`; dp_group
holds the replicas of one expert shard (= data_group when ep = 1).

parallelize() applies, in the one order that works: the TP cut (tp.py), the initial weights (an
HF folder or a checkpoint, read after the cut so each rank reads only its slices, before the EP
cut which drops other ranks' experts), LoRA adapters (lora.py: on the cut, loaded base), the EP cut (moe.py), then FSDP (fsdp.py) and its optimizer,
or the optimizer and DataParallel (whose ZeRO-1 owner map comes from the optimizer), then
torch.compile (of the whole model under DataParallel, of each block's compute under FSDP). clip_grad_norm_ is the one gradient norm of every layout and their products.

Import graph of the top-level modules (lazy imports included; tests/test_imports.py checks
that it has no cycle and that no file uses another's _private names). Before issue 14 (4bce2c0):

    config -> model;  tp -> model;  moe -> tp, model (lazy);  model -> fused, moe (lazy)   <- cycles
    fsdp -> tp (lazy);  muon -> tp, fsdp (lazy);  optim -> muon (lazy);  parallel -> (none)
    checkpoint -> fsdp, moe, tp, model;  hf -> model;  data -> hf (lazy)
    (and muon / fsdp read fsdp's and tp's private helpers)

Now, imports at the top of each file (data.py's optional hf aside), and an order in which each
module imports only modules before it: fused, tp, moe, model, config, generate, fsdp, lora,
muon, optim, parallel, checkpoint, hf, corpus, data, clean, logs, then the scripts:

    tp -> (torch);  moe -> tp;  model -> fused, moe, tp;  config -> model;  generate -> (torch)
    fsdp -> tp;  lora -> fsdp, model, tp;  muon -> fsdp, tp;  optim -> muon
    parallel -> config, fsdp, lora, moe, optim, tp
    checkpoint -> config, fsdp, moe, parallel, tp, model;  hf -> checkpoint, model, tp
    corpus -> config;  data -> corpus, parallel, hf (lazy: optional);  clean -> (numpy);  logs -> (torch)
    pretrain / sample / bench* -> the concept modules above
"""
import contextlib
import datetime
import os
import signal
import time
import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn

import config
import fsdp
import lora
import moe
import optim
import tp


@dataclass
class Grid:
    world: int
    rank: int
    local_rank: int
    dp: int
    tp: int
    ep: int
    dp_rank: int
    tp_rank: int
    ep_rank: int
    dp_group: object  # process groups (None when one process)
    tp_group: object
    ep_group: object
    device: torch.device
    data_group: object = None  # dp x ep ranks sharing tp_rank: they all see different data

    @property
    def is_main(self):
        return self.rank == 0

    @property
    def data_world(self):
        return self.dp * self.ep

    @property
    def data_rank(self):
        return self.dp_rank * self.ep + self.ep_rank


def _groups(world, rank, dp, ep, tp):
    """Every rank must create every group (new_group is collective); keep the ones it is in."""
    ranks = torch.arange(world).view(dp, ep, tp)
    mine = {}
    groups = [("tp", ranks.reshape(-1, tp)),
              ("ep", ranks.transpose(1, 2).reshape(-1, ep)),
              ("dp", ranks.permute(1, 2, 0).reshape(-1, dp))]
    if ep > 1:  # ordered by data_rank = dp_rank * ep + ep_rank
        groups.append(("data", ranks.permute(2, 0, 1).reshape(tp, dp * ep)))
    for name, lines in groups:
        for line in lines.tolist():
            g = dist.new_group(line)
            if rank in line:
                mine[name] = (g, line.index(rank))
    return mine


def init(cfg):
    """Build the Grid from the torchrun environment: NCCL on GPUs, gloo on CPU.
    Without torchrun (no WORLD_SIZE) this is one process and no process group is created."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device='cuda' but no CUDA GPU is visible; use --device=cpu")
    if use_cuda:
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    tp, ep = cfg.tp, cfg.ep
    dp = world // (tp * ep)
    if world > 1:
        if not dist.is_initialized():
            dist.init_process_group("nccl" if use_cuda else "gloo", rank=rank, world_size=world,
                                    timeout=datetime.timedelta(minutes=30),
                                    device_id=device if use_cuda else None)
        g = _groups(world, rank, dp, ep, tp)
        return Grid(world, rank, local_rank, dp, tp, ep, g["dp"][1], g["tp"][1], g["ep"][1],
                    g["dp"][0], g["tp"][0], g["ep"][0], device, g.get("data", g["dp"])[0])
    return Grid(1, 0, 0, 1, 1, 1, 0, 0, 0, None, None, None, device)


def shutdown():
    if dist.is_initialized():
        dist.destroy_process_group()


def on_main(grid, fn):
    """Run fn() on rank 0 only and hand its result to every rank (broadcast, so pickled: keep it
    small and plain). A UserError raised there is raised on every rank, so all stop together with
    one message (config.run prints it on rank 0 only) instead of the others waiting forever in the
    next collective; any other exception stops the other ranks with a UserError that points to
    rank 0's traceback."""
    box = [None]
    if grid.rank == 0:
        try:
            box = [("ok", fn())]
        except config.UserError as e:
            box = [("user", str(e))]
        except BaseException:
            if grid.world > 1:
                dist.broadcast_object_list([("bug", None)], src=0)
            raise
    if grid.world > 1:
        dist.broadcast_object_list(box, src=0)
    kind, value = box[0]
    if kind == "user":
        raise config.UserError(value)
    if kind == "bug":
        raise config.UserError("rank 0 failed: its traceback says why")
    return value


class Interrupt:
    """SIGTERM / SIGINT during training: finish the current step on every rank, save, exit 0.

    The handler only raises a flag. `requested()` runs once per step on every rank: an all-reduce
    (MAX) of the flags over a gloo group on the CPU, so it never waits for the GPU, and every rank
    stops after the same step even when the signal reached only some of them. (torchrun forwards
    SIGTERM to every worker and kills them 30 s later: time to finish a step and save; Ctrl-C in a
    terminal reaches every process, and torchrun forwards it once more.) A repeat within `echo`
    seconds is that same event; a later one gives up: the previous handlers come back and the
    signal is raised again (Ctrl-C, then Ctrl-C again, stops at once).
    """

    def __init__(self, grid, signals=(signal.SIGTERM, signal.SIGINT), echo=2.0):
        self.flag, self.signum, self.when, self.echo = False, None, 0.0, echo
        # new_group is collective: every rank creates it, whatever the main backend is
        self.group = dist.new_group(backend="gloo") if grid.world > 1 else None
        self.previous = {s: signal.signal(s, self.handle) for s in signals}

    def handle(self, signum, frame):
        if self.flag and time.monotonic() - self.when > self.echo:  # asked twice: stop waiting for the step
            self.restore()
            signal.raise_signal(signum)
        elif not self.flag:
            self.flag, self.signum, self.when = True, signum, time.monotonic()

    def requested(self):
        """True on every rank once any rank got a signal. Collective: every rank calls it each step."""
        if self.group is None:
            return self.flag
        t = torch.tensor([int(self.flag)])
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return bool(t.item())

    def name(self):
        return signal.Signals(self.signum).name if self.signum else "a signal on another rank"

    def restore(self):
        for s, h in self.previous.items():
            signal.signal(s, h)


def end_of_step(step, last, cfg, interrupt, save, evaluate=None, say=print):
    """A stage script's work after optimizer step `step` (of `last`), in this order: a signal
    (every rank agrees) saves and stops; the checkpoint cadence (cfg.ckpt_every, and the last step);
    the evaluation (cfg.eval_every, and the last step) after the checkpoint, so that an evaluation
    that fails never costs the steps before it. Returns True when the run must stop."""
    if interrupt.requested():
        save()
        say(f"{interrupt.name()}: saved step {step} in {cfg.out_dir}; continue with --resume")
        return True
    if (cfg.ckpt_every and step % cfg.ckpt_every == 0) or step == last:
        save()
    if evaluate is not None and cfg.eval_every and (step % cfg.eval_every == 0 or step == last):
        evaluate()
    return False


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


# ---------------------------------------------------------------------------- gradient norm, every layout

def _sum(x, group):
    """x summed over the group (a new tensor; x itself unchanged)."""
    if group is not None and dist.get_world_size(group) > 1:
        x = x.clone()
        dist.all_reduce(x, group=group)
    return x


def grad_sq_norm(params, grid):
    """Squared gradient norm of the full model from this rank's parameters, every slice counted once:
    TP slices (p.tp_split) summed over the TP group, a piece several TP ranks share counted by its
    first holder only; expert shards (moe.py, p.ep_split) also summed over the EP group (under TP
    every expert is cut, so summing over EP, then TP, counts each slice once); replicated
    parameters counted locally (their gradients are identical on every rank)."""
    params = [p for p in params if p.grad is not None]
    dev = params[0].grad.device if params else grid.device
    shd = torch.zeros((), device=dev)

    def sq_norm(ps):  # unsplit gradients: one foreach norm, a few kernels for any number of them
        gs = [p.grad for p in ps if not hasattr(p, "tp_split")]
        return torch.stack(torch._foreach_norm(gs)).float().square().sum() if gs else torch.zeros((), device=dev)
    rep = sq_norm([p for p in params if getattr(p, "ep_split", 1) == 1])
    exp = sq_norm([p for p in params if getattr(p, "ep_split", 1) > 1])
    for p in params:
        if not hasattr(p, "tp_split"):
            continue
        g, sq = p.grad.float(), 0.0
        for off, n, counted in tp.counted_pieces(p, grid):
            if counted:
                sq = sq + g.narrow(p.tp_split[0], off, n).square().sum()
        if getattr(p, "ep_split", 1) > 1:
            exp = exp + sq
        else:
            shd = shd + sq
    return rep + _sum(shd + _sum(exp, grid.ep_group), grid.tp_group)


def clip_grad_norm_(model, max_norm, grid, owner=None):
    """torch.nn.utils.clip_grad_norm_ over the full model under any layout: every parameter counted
    once, every rank gets the same norm, hence the same scale. Returns the total norm (no host sync).

    model: the (TP / EP cut) module or its DataParallel: grad_sq_norm over its parameters. ZeRO-1
    (owner = the optimizer's grad_owner, {id(param): dp rank}): only owners hold reduced gradients
    (DataParallel dropped the others), so the owned ones' squares are summed over the dp group.
    An fsdp.FSDP wrapper: its shards are disjoint (padding is zero), so squares add up over the data
    group (an expert unit's shards cover its EP rank's experts over dp, the EP ranks the rest);
    under TP each rank adds the runs of its shard it counts (Unit.counted), summed over TP.
    Frozen parameters (no gradient) are left out."""
    if isinstance(model, fsdp.FSDP):
        units = [u for u in model.units if u.grad is not None and u.shards[0].grad is not None]
        sq = torch.zeros((), device=model.units[0].device)
        for u in units:
            for a, b in u.counted:
                sq += u.grad[a:b].square().sum()
        for size, group in ((grid.tp, grid.tp_group), (grid.data_world, grid.data_group or grid.dp_group)):
            if size > 1:
                dist.all_reduce(sq, group=group)
        grads = [u.grad for u in units]  # the shard Parameters' .grad are views of u.grad
    else:
        params = [p for p in model.parameters() if p.grad is not None
                  and (owner is None or owner[id(p)] == grid.dp_rank)]
        sq = grad_sq_norm(params, grid)
        if owner is not None:
            dist.all_reduce(sq, group=grid.dp_group)
        grads = [p.grad for p in params]
    norm = sq.sqrt()
    coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)  # as torch's: multiply even when it is 1
    if grads:
        torch._foreach_mul_(grads, coef)
    return norm


# ---------------------------------------------------------------------------- parallelize

def amp_dtype(cfg, device):
    """cfg.dtype -> the compute dtype: "auto" is bf16 autocast on CUDA, fp32 elsewhere."""
    return {"auto": torch.bfloat16 if device.type == "cuda" else torch.float32,
            "float32": torch.float32, "bfloat16": torch.bfloat16}[cfg.dtype]


@dataclass
class Parallel:
    """What parallelize() returns: the handles a training loop needs."""
    raw: nn.Module    # the cut model (this rank's TP slices and experts): checkpoints, generation, metrics
    model: nn.Module  # DataParallel or fsdp.FSDP around raw: no_sync(), finish(), zero_grad()
    fwd: object       # call forward on this: torch.compile(raw), raw, or the FSDP wrapper
    optimizer: object  # None when built without one (e.g. a frozen reference model)
    grid: Grid

    def clip_grad_norm_(self, max_norm):
        """The gradient norm of the whole model, clipped to max_norm, right for this layout."""
        return clip_grad_norm_(self.model, max_norm, self.grid, getattr(self.optimizer, "grad_owner", None))

    def full_params(self):
        """A context in which raw holds full parameters (FSDP gathers them: for generation)."""
        return self.model.summon_full_params() if isinstance(self.model, fsdp.FSDP) else contextlib.nullcontext()


def parallelize(model, grid, cfg, load=None, optimizer=True, compile_kwargs=None):
    """Apply the layout of cfg (grid's tp / ep, cfg.data_parallel) to a full model built from the
    same seed on every rank, in place, and build its optimizer (optimizer=False: none).

    load(model): the initial weights (hf.init_loader), called on the TP-cut model before the EP cut.
    cfg.lora_r > 0: then the base is frozen and LoRA adapters added (lora.apply), except on a model
    that is frozen already (a reference model).
    A model without trainable parameters (a frozen reference) gets no optimizer and stays
    replicated (DataParallel: broadcast once, nothing to reduce), also under data_parallel="fsdp".
    Partly frozen models work: frozen parameters are neither reduced nor optimised.
    cfg.compile: under DataParallel fwd = torch.compile(raw, **compile_kwargs), TP included (dynamo
    traces TP's collectives into the graph, forward and backward: tp.py); under FSDP each block's
    compute and the head (FSDP.compile: the gather hooks stay eager). compile_kwargs: torch.compile's
    keywords (tests: dict(backend="aot_eager") traces the same graphs without code generation)."""
    # TP: keep this rank's heads / MLP columns / vocabulary rows (tp=1: no-op)
    tp.tensor_parallel(model, grid, sequence_parallel=cfg.sequence_parallel)
    if load is not None:
        load(model)  # initial weights: each TP rank reads only its slices; every expert still here
    if cfg.lora_r and any(p.requires_grad for p in model.parameters()):
        lora.apply(model, cfg, grid)  # freeze the base, add adapters cut like their base (lora.py)
    moe.expert_parallel(model, grid)  # EP: keep this rank's experts, set the groups (dense: no-op)
    trainable = any(p.requires_grad for p in model.parameters())
    dtype = amp_dtype(cfg, grid.device)
    if cfg.data_parallel == "fsdp" and trainable:  # shard what TP left over the data-parallel ranks
        wrapper = fsdp.FSDP(model, grid, compute_dtype=dtype if dtype != torch.float32 else None)
        opt = optim.build_optimizer(wrapper, cfg, grid) if optimizer else None
        fwd = wrapper  # gathers each block's shards around its forward
        if cfg.compile:
            wrapper.compile(**(compile_kwargs or {}))
    else:  # replicate it (broadcasts rank 0's weights); ZeRO-1: each gradient is reduced to its owner
        opt = optim.build_optimizer(model, cfg, grid) if optimizer and trainable else None
        wrapper = DataParallel(model, grid, cfg.grad_bucket_mb, owner=getattr(opt, "grad_owner", None),
                               reduce_dtype=getattr(torch, cfg.grad_reduce_dtype))
        # DataParallel's hooks live on the parameters, outside the graph; TP's collectives inside it
        fwd = torch.compile(model, **(compile_kwargs or {})) if cfg.compile else model
    return Parallel(model, wrapper, fwd, opt, grid)
