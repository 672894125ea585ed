"""The process grid and parallelize(): the one place every layout is applied.

    grid = parallel.init(cfg)                        # from torchrun's environment (or one plain process)
    net = parallel.parallelize(weights.build_model(cfg, grid), grid, cfg, load=weights.loader(cfg, grid))
    tally = net.train_step(micro, loss_fn, autocast)  # every micro-step's forward and backward (pp: the schedule)
    grad_norm = net.step(cfg.grad_clip)               # reduce, (fp16: unscale,) clip, optimizer step, zero
    weights, optim_state = net.full_state()          # layout-free: full tensors, one-process names

Ranks form arange(world).view(pp, dp, ep, tp): TP innermost, so tensor-parallel partners are
neighbouring GPUs; pipeline stages outermost (stage s: ranks s * world/pp ...). EP ranks see different
data: the data-parallel world (loader shards, gradient averaging of non-expert parameters) is dp x ep
(grid.data_group / data_rank / data_world); dp_group holds the replicas of one expert shard (=
data_group when ep = 1). The stages of one pipeline read the same data (grid.pp_group).

parallelize() applies, in the one order that works: the TP cut (tp.py) and the chunked loss
(chunked.py); the initial weights (read after the cut, so each rank reads only its slices, and
before the EP cut, which drops other ranks' experts); LoRA adapters (lora.py: on the cut, loaded
base) and the NF4 base (qlora.py); selective recompute (recompute.py); the EP cut (moe.py); the
pipeline cut (pp.py: after the forms that rewrite modules in place, which need not know of stages;
before the ones that wrap, reduce and optimise what a rank keeps); then FSDP (fsdp.py) and its optimizer, or the optimizer and DataParallel (dp.py; its ZeRO-1 owner map
comes from the optimizer); then torch.compile (the whole model under DataParallel, each block's
compute under FSDP). Net is the one handle a loop needs, and the one home of layout-free state: every
form's full-state functions are called from Net.full_state / load_full_state and nowhere else; those of
every layout but FSDP (full_state_dict, full_optim_state and their loads) are this file's.
"""
import contextlib
import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn

import config
import lora
import moe
import optim
from config import need
from memory import chunked, materialize, qlora, recompute, scaler
from parallelism import dp, fsdp, gpus, pp, tp

# the batch, the processes and the layout: config keys (the pipeline's: pp.PP_DEFAULTS)
PARALLEL_DEFAULTS = dict(
    # batch: batch_size sequences per optimizer step, split over data-parallel ranks and
    # gradient-accumulation micro-steps of micro_batch_size sequences each
    batch_size=32,           # sequences (SFT: rows, DPO: pairs, GRPO: completions) per optimizer step
    micro_batch_size=8,      # sequences per forward on one rank (the rest is gradient accumulation)
    seq_len=0,               # 0 -> block_size
    # system
    seed=1337,               # weights, data order and sampling follow from it
    device="auto",           # auto | cpu | cuda
    dtype="auto",            # auto (bf16 on GPUs with it, float16 on GPUs without, fp32 on CPU) | float32 | bfloat16 |
                             # float16 (with loss scaling: scaler.py)
    compile=False,           # torch.compile the model (the whole model under ddp, each block under fsdp)
    threads=0,               # CPU threads per process (0: the cores / local processes; said at start-up)
    # layout
    grad_bucket_mb=25.0,     # data-parallel all-reduce bucket size
    grad_reduce_dtype="float32",  # ddp: gradients travel as float32 | bfloat16 (half the bytes, rounded)
    tp=1,                    # tensor-parallel size (Megatron style, innermost: neighbouring GPUs)
    sequence_parallel=False,  # tp > 1: norms, residual and dropout on T/tp positions (tp.py); dense, ddp
    data_parallel="ddp",     # how the world // tp replicas split the batch: ddp (replicated) | fsdp (sharded)
    ep=1,                    # expert-parallel size: experts sharded over ep ranks that see different data (moe.py)
)
RESUME_FREE = ("micro_batch_size", "device", "dtype", "compile", "threads", "grad_bucket_mb", "grad_reduce_dtype", "tp",
               "sequence_parallel", "data_parallel", "ep")  # a resumed run may change them (lifecycle.RESUME_FREE)


def check(cfg, world=1):
    """The batch, the processes and the grid of `world` of them (the pipeline's keys too: pp.check)."""
    need(cfg.device in ("auto", "cpu", "cuda"), f"device='{cfg.device}' must be auto, cpu or cuda")
    need(cfg.dtype in ("auto", "float32", "bfloat16", "float16"),
         f"dtype='{cfg.dtype}' must be auto, float32, bfloat16 or float16")
    need(cfg.threads >= 0, f"threads={cfg.threads} must be >= 0 (0: the cores divided among the local processes)")
    need(cfg.tp >= 1, f"tp={cfg.tp} must be >= 1")
    need(cfg.ep >= 1, f"ep={cfg.ep} must be >= 1")
    need(cfg.ep == 1 or cfg.n_experts > 0, f"ep={cfg.ep} shards experts: set n_experts > 0 (a MoE model) or ep=1")
    need(cfg.n_experts % cfg.ep == 0, f"n_experts={cfg.n_experts} is not divisible by ep={cfg.ep}: each rank needs whole experts")
    need(cfg.grad_reduce_dtype in ("float32", "bfloat16"),
         f"grad_reduce_dtype='{cfg.grad_reduce_dtype}' must be float32 or bfloat16")
    need(cfg.data_parallel in ("ddp", "fsdp"), f"data_parallel='{cfg.data_parallel}' must be ddp or fsdp")
    need(not (cfg.compile and cfg.data_parallel == "fsdp" and cfg.tp > 1),
         "compile=True works with tp > 1 under data_parallel='ddp', and with data_parallel='fsdp' at tp=1; "
         "TP x FSDP compiled together is untested: set --compile=False or --data_parallel=ddp")
    need(not cfg.sequence_parallel or (cfg.data_parallel == "ddp" and not cfg.n_experts
                                       and not getattr(cfg, "lora_r", 0)),  # (a stage without LoRA keys: eval)
         "sequence_parallel=True works with dense models, data_parallel='ddp' and no LoRA only: "
         "set --sequence_parallel=False")
    need(not cfg.sequence_parallel or (cfg.seq_len or cfg.block_size) % cfg.tp == 0,
         f"sequence_parallel=True: the sequence length {cfg.seq_len or cfg.block_size} (seq_len, or block_size) "
         f"must be divisible by tp={cfg.tp}")
    need(cfg.n_head % cfg.tp == 0, f"n_head={cfg.n_head} is not divisible by tp={cfg.tp}: each rank needs whole heads")
    need(cfg.pp >= 1, f"pp={cfg.pp} must be >= 1")
    need(world % (cfg.pp * cfg.tp * cfg.ep) == 0,
         f"world size {world} is not divisible by pp*tp*ep={cfg.pp * cfg.tp * cfg.ep}")
    ranks = world // (cfg.pp * cfg.tp * cfg.ep) * cfg.ep  # data-parallel ranks: EP ranks see different data too
    pp.check(cfg, ranks)
    need(cfg.micro_batch_size > 0 and cfg.batch_size > 0, "batch_size and micro_batch_size must be positive")
    need(cfg.batch_size % (cfg.micro_batch_size * ranks) == 0,
         f"batch_size={cfg.batch_size} must be divisible by micro_batch_size*data_parallel="
         f"{cfg.micro_batch_size}*{ranks}={cfg.micro_batch_size * ranks}: change batch_size or micro_batch_size")
    need(0 <= cfg.seq_len <= cfg.block_size, f"seq_len={cfg.seq_len} must be in [0, block_size={cfg.block_size}] (0 means block_size)")
    need(cfg.grad_bucket_mb > 0, f"grad_bucket_mb={cfg.grad_bucket_mb} must be positive")
    # found here, not after training: numpy's generators take seeds in [0, 2**32)
    need(0 <= cfg.seed < 2**32, f"seed={cfg.seed} must be in [0, 2**32)")


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
    pp: int = 1                # pipeline stages (pp.py), outermost: a stage is pp_rank's dp x ep x tp ranks
    pp_rank: int = 0
    pp_group: object = None    # the pp ranks sharing (dp, ep, tp) coordinates: one pipeline
    tie_group: object = None   # the first and the last stage's dp ranks sharing (ep, tp): tied embeddings

    @property
    def is_main(self):
        return self.rank == 0

    @property
    def data_world(self):
        return self.dp * self.ep

    @property
    def data_rank(self):
        return self.dp_rank * self.ep + self.ep_rank


def _groups(world, rank, pp, dp, ep, tp):
    """Every rank must create every group (new_group is collective); keep the ones it is in."""
    ranks = torch.arange(world).view(pp, dp, ep, tp)
    mine = {}
    groups = [("tp", ranks.reshape(-1, tp)),
              ("ep", ranks.transpose(2, 3).reshape(-1, ep)),
              ("dp", ranks.permute(0, 2, 3, 1).reshape(-1, dp))]
    if ep > 1:  # ordered by data_rank = dp_rank * ep + ep_rank
        groups.append(("data", ranks.permute(0, 3, 1, 2).reshape(pp * tp, dp * ep)))
    if pp > 1:  # one pipeline (ordered by stage); the first and last stages' replicas of a tied embedding
        groups.append(("pp", ranks.permute(1, 2, 3, 0).reshape(-1, pp)))
        groups.append(("tie", ranks[[0, pp - 1]].permute(2, 3, 0, 1).reshape(ep * tp, 2 * dp)))
    for name, lines in groups:
        for line in lines.tolist():
            g = dist.new_group(line)
            if rank in line:
                mine[name] = (g, line.index(rank))
    return mine


def init(cfg, threads=None):
    """Build the Grid from the torchrun environment: NCCL on GPUs, gloo on CPU. Without torchrun (no
    WORLD_SIZE) this is one process and no process group is created. threads (a stage passes
    cfg.threads): CPU threads per process; 0: OMP_NUM_THREADS where it is set (torchrun sets 1),
    else the available cores shared among this node's processes; None leaves torch's setting.
    TF32 matmuls on for fp32 work on GPUs. Refused in one line, before anything starts: more
    processes on this machine than visible GPUs (gpus.check_local_ranks), a precision this device
    cannot run (check_precision). GPUs without peer-to-peer get the NCCL setting they need (gpus.nccl_env)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise config.UserError("device='cuda' but no CUDA GPU is visible: use --device=cpu (or auto)")
    gpus.check_local_ranks(int(os.environ.get("LOCAL_WORLD_SIZE", "1")), torch.cuda.device_count(), use_cuda)
    if threads or (threads is not None and "OMP_NUM_THREADS" not in os.environ):
        local = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
        torch.set_num_threads(threads or max(1, len(os.sched_getaffinity(0)) // local))
    if use_cuda:
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    else:
        device = torch.device("cpu")
    check_precision(cfg, device)
    tp, ep, pp = cfg.tp, cfg.ep, getattr(cfg, "pp", 1)  # (a bare namespace without pp: no pipeline)
    dp = world // (pp * tp * ep)
    if world > 1:
        if use_cuda:  # consumer GPUs without peer-to-peer: NCCL through host memory (unless the user chose)
            os.environ.update(gpus.nccl_env(gpus.describe()))
        if not dist.is_initialized():
            dist.init_process_group("nccl" if use_cuda else "gloo", rank=rank, world_size=world,
                                    timeout=datetime.timedelta(minutes=30),
                                    device_id=device if use_cuda else None)
        g = _groups(world, rank, pp, dp, ep, tp)
        none = (None, 0)
        return Grid(world, rank, local_rank, dp, tp, ep, g["dp"][1], g["tp"][1], g["ep"][1],
                    g["dp"][0], g["tp"][0], g["ep"][0], device, g.get("data", g["dp"])[0],
                    pp, g.get("pp", none)[1], g.get("pp", none)[0], g.get("tie", none)[0])
    return Grid(1, 0, 0, 1, 1, 1, 0, 0, 0, None, None, None, device)


def shutdown():
    if dist.is_initialized():
        dist.destroy_process_group()


def on_main(grid, fn):
    """Run fn() on rank 0 only and hand its result to every rank (broadcast, so pickled: keep it
    small and plain). A UserError raised there is raised on every rank, so all stop together with
    one message (config.cli prints it on rank 0 only) instead of the others waiting forever in the
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


def data_sum(x, grid):
    """x summed over the data ranks, in place (nothing to do on one); returns x."""
    if grid.data_world > 1:
        dist.all_reduce(x, group=grid.data_group)
    return x


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
    Pipeline stages (pp.py) add their squares over grid.pp_group.

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
        sq = grad_sq_norm([p for p in params if not getattr(p, "pp_copy", False)], grid)
        if owner is not None:
            dist.all_reduce(sq, group=grid.dp_group)
        grads = [p.grad for p in params]
    if grid.pp > 1:  # every stage's parameters (a tied embedding's last-stage copy, p.pp_copy, not counted)
        dist.all_reduce(sq, group=grid.pp_group)
    norm = sq.sqrt()
    coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)  # as torch's: multiply even when it is 1
    if grads:
        torch._foreach_mul_(grads, coef)
    return norm


# ---------------------------------------------------------------------------- parallelize

# ---------------------------------------------------------------------------- precision

def amp_dtype(cfg, device):
    """cfg.dtype -> the compute dtype: "auto" is bf16 autocast on GPUs that have bf16, fp16 (with loss
    scaling) on GPUs that have not (gpus.auto_dtype: every visible GPU, so every rank picks the same),
    fp32 on the CPU."""
    if cfg.dtype == "auto":
        return getattr(torch, gpus.auto_dtype(gpus.describe(peers=False))) if device.type == "cuda" else torch.float32
    return getattr(torch, cfg.dtype)


def check_precision(cfg, device):
    """Refuse (one line) what cfg's compute dtype on this device cannot run: an NF4 base computed in
    fp32 (dtype auto on the CPU; lora.apply refuses a bf16 base there), and the settings fp16 cannot
    work with (scaler.fp16_refusals; dtype auto on a GPU without bf16 is fp16 too). A bare grid
    config (tests: device, tp, ep and no dtype) has nothing to check."""
    if not hasattr(cfg, "dtype"):
        return
    dtype = amp_dtype(cfg, device)
    if dtype == torch.float32 and getattr(cfg, "lora_r", 0) and getattr(cfg, "lora_base_dtype", "") == "nf4":
        raise config.ConfigError(f"lora_base_dtype='nf4' computes in 16 bits, but dtype='{cfg.dtype}' is fp32 on "
                                 f"the {device.type}: set dtype='bfloat16' (float16 on GPUs without bf16)")
    if dtype == torch.float16:
        scaler.fp16_refusals(cfg, dtype="float16")


def autocast(cfg, device):
    """The context every forward of a stage runs in: bf16 or fp16 autocast (matmuls in 16 bits;
    master weights, optimizer state and reductions fp32) where cfg.dtype asks for it, else nothing.
    Re-enterable."""
    dtype = amp_dtype(cfg, device)
    if dtype != torch.float32:
        return torch.autocast(device.type, dtype=dtype)
    return contextlib.nullcontext()


# ---------------------------------------------------------------------------- layout-free state, every layout but FSDP
# (Net.full_state / load_full_state call these for DP, ZeRO-1, TP, EP and their products; fsdp.py has FSDP's:
# a replicated tensor is the full one, a TP slice is gathered and cut by tp.full_tensor / local_tensor)

def full_state_dict(model, grid):
    """{name: full tensor on CPU}, as the one-process model's state_dict (tied names, padded
    vocabulary rows included). Collective over the TP group: every TP rank must call it."""
    params = dict(model.named_parameters(remove_duplicate=False))
    out, done = {}, {}
    for k, v in model.state_dict().items():
        p = params.get(k, v)
        if id(p) not in done:  # a tied weight: gathered once, both names share the tensor (as in one process)
            done[id(p)] = tp.full_tensor(p, v, grid).cpu()
        out[k] = done[id(p)]
    return out


@torch.no_grad()
def load_full_state_dict(model, grid, full_sd):
    """Copy a one-process state dict into the (TP) model: each rank keeps only its slices."""
    params = dict(model.named_parameters(remove_duplicate=False))
    sd = model.state_dict()
    missing = sorted(set(sd) - set(full_sd))
    if missing:
        raise ValueError(f"full state dict lacks {missing[:8]}")
    for k, t in sd.items():
        t.copy_(tp.local_tensor(params.get(k, t), full_sd[k], grid))  # slice first, then move


def _state_by_index(model, optimizer):
    names = {id(p): n for n, p in model.named_parameters()}
    ps = [p for g in optimizer.param_groups for p in g["params"]]
    return [(i, names[id(p)], p) for i, p in enumerate(ps)]


def full_optim_state(model, optimizer, grid):
    """{param name: {"exp_avg": full, "exp_avg_sq": full, "step": ...}} on CPU: state tensors shaped
    like their parameter are gathered like it, the rest (step) copied. Collective over the TP group."""
    out = {}
    for _, name, p in _state_by_index(model, optimizer):
        for k, v in optimizer.state.get(p, {}).items():
            full = tp.full_tensor(p, v, grid) if torch.is_tensor(v) and v.shape == p.shape else v
            out.setdefault(name, {})[k] = full.detach().clone().cpu() if torch.is_tensor(full) else full
    return out


def load_full_optim_state(model, optimizer, grid, full):
    """Load full_optim_state's output (saved from any TP layout) into this rank's optimizer."""
    sd = optimizer.state_dict()
    sd["state"] = {i: {k: (tp.local_tensor(p, v, grid) if v.dim() else v).clone() if torch.is_tensor(v) else v
                       for k, v in full[name].items()}  # copies: the optimizer's steps must not advance `full`
                   for i, name, p in _state_by_index(model, optimizer) if name in full}
    optimizer.load_state_dict(sd)  # casts to the parameters' devices and dtypes


# ---------------------------------------------------------------------------- the network in its layout

@dataclass
class Net:
    """What parallelize() returns: the network in its layout, the one handle a training loop needs.
    net(x, y, ...) runs the forward (compiled, FSDP-gathered or plain, as laid out; a pipeline's
    without gradients, through its stages); train_step (the micro-steps' forwards and backwards, fp16
    loss scaling included; pp: the schedule) and step(max_norm) are the rest of a step."""
    raw: nn.Module      # the cut module (this rank's TP slices and experts): generation, metrics, hooks
    wrapper: nn.Module  # dp.DataParallel or fsdp.FSDP around raw: gradient synchronisation
    fwd: object         # what net(...) calls: torch.compile(raw), raw, or the FSDP wrapper (a stage's part under pp)
    optimizer: object   # None when built without one (e.g. a frozen reference model)
    grid: Grid
    pipe: object = None  # pp.Pipeline: this rank's pipeline stage (pp > 1), else None
    scaler: object = None  # scaler.LossScaler when the compute dtype is fp16 (and there is an optimizer)

    def __call__(self, *args, **kwargs):
        if self.pipe is not None:  # evaluation through the stages (training: train_step)
            return self.pipe.forward(self.fwd, *args, **kwargs)
        return self.fwd(*args, **kwargs)

    def train_step(self, micro, loss_fn, autocast=contextlib.nullcontext()):
        """The forwards and backwards of one optimizer step over this rank's micro-batches, gradients
        left for step(). micro: [(x, y, kwargs)], each net(x, y, **kwargs); loss_fn(i, out) -> (the loss
        to backward, a tally: a tensor or a dict of tensors) for micro-batch i's output. Returns the
        tallies' sum (on every rank). Under a pipeline the schedule runs them (pp.train_step); otherwise
        one after the other, gradients reduced during the last backward."""
        if self.pipe is not None:
            return pp.train_step(self, micro, loss_fn, autocast)
        tallies = []
        for i, (x, y, kwargs) in enumerate(micro):
            with self.no_sync() if i < len(micro) - 1 else contextlib.nullcontext():
                with autocast:
                    loss, tally = loss_fn(i, self(x, y, **kwargs))
                self.backward(loss)
            tallies.append(tally)
        return pp.add_up(tallies)

    def no_sync(self):
        """Gradients accumulate locally: wrap every micro-step's forward and backward but the last."""
        return self.wrapper.no_sync()

    def backward(self, loss):
        """loss.backward(); under fp16, of the loss times the loss scale (net.step divides it out)."""
        (loss if self.scaler is None else self.scaler.scale(loss)).backward()

    def clip_grad_norm_(self, max_norm):
        """The gradient norm of the whole model, clipped to max_norm, right for this layout."""
        return clip_grad_norm_(self.wrapper, max_norm, self.grid, getattr(self.optimizer, "grad_owner", None))

    def step(self, max_norm=0.0, before_update=None, after_update=None):
        """The end of an optimizer step: wait for the gradient reductions, clip to max_norm (0: no
        clipping), step the optimizer, zero the gradients. Returns the gradient norm (no host sync).
        Under fp16 the gradients are unscaled first; an inf or NaN on any rank skips the step on
        every rank (the norm returned is then inf) and the scale backs off (scaler.py; its flag,
        all-reduced, is read on the host: one sync a step). before_update() runs on the reduced,
        unscaled gradients before clipping, after_update() after the optimizer step (every rank:
        they may be collective; gradstats.Probe.hooks); a skipped step calls neither."""
        self.wrapper.finish()
        if self.pipe is not None:  # tied embeddings: the first and last stage's gradients summed
            pp.sum_tied_grads(self)
        skip = self.scaler is not None and self.scaler.unscale_(self.scaler.grads(self.wrapper))  # collective
        if skip:
            norm = torch.full((), float("inf"), device=self.grid.device)
        elif getattr(self.optimizer, "in_backward", False):  # optim_memory.InBackwardAdamW: updated already
            norm = self.optimizer.grad_norm()
        else:
            if before_update is not None:
                before_update()
            norm = self.clip_grad_norm_(max_norm or float("inf"))
            self.optimizer.step()
            if after_update is not None:
                after_update()
        if self.scaler is not None:
            self.scaler.update(skip)
        self.wrapper.zero_grad(set_to_none=True)
        return norm

    @contextlib.contextmanager
    def full_params(self):
        """A context in which raw holds the full model (FSDP gathers its shards; a pipeline stage
        receives every other stage's modules): for generation. Collective."""
        with self.wrapper.summon_full_params() if isinstance(self.wrapper, fsdp.FSDP) else contextlib.nullcontext():
            with pp.summon(self.pipe, self.raw) if self.pipe is not None else contextlib.nullcontext():
                yield self.raw

    def state_names(self):
        """The one-process model's state-dict names, whatever the layout (a pipeline stage holds only
        some of them, FSDP holds flat shards)."""
        if self.pipe is not None:
            return list(self.pipe.names)
        return list(self.wrapper.sd_keys) if isinstance(self.wrapper, fsdp.FSDP) else list(self.raw.state_dict())

    def full_state(self, optimizer=True):
        """(weights, optimizer state or None) as full tensors on CPU under the one-process names, from
        any layout (DP, ZeRO-1, TP, FSDP, EP and their products). Collective: every rank calls it.
        Optimizer state: {param name: {"exp_avg": ..., "exp_avg_sq": ..., "step": ...}} (Muon: its keys)."""
        w, opt, grid = self.wrapper, self.optimizer if optimizer else None, self.grid
        sharded = isinstance(w, fsdp.FSDP)
        weights = fsdp.full_state_dict(w) if sharded else full_state_dict(self.raw, grid)
        weights.update(qlora.dequantized_state(self.raw, grid))  # QLoRA: the base as it computes (checkpoints)
        if opt is None:
            state = None
        elif hasattr(opt, "full_optim_state"):  # muon.Muon / FSDPMuon: any layout, ZeRO-1 included
            state = opt.full_optim_state(self.raw, grid)
        else:
            state = fsdp.full_optim_state(w, opt) if sharded else full_optim_state(self.raw, opt, grid)
        weights, state = moe.gather_experts(self.raw, grid, weights, state)  # EP: every rank's experts
        return (weights, state) if self.pipe is None else pp.gather_stages(self.pipe, weights, state)  # every stage's

    def load_full_state(self, weights, optim_state=None):
        """full_state()'s output (saved by any layout) into this one: experts cut to this EP rank's
        first (with their optimizer state), then TP slices / FSDP shards. Collective under FSDP."""
        w, opt, grid = self.wrapper, self.optimizer, self.grid
        weights, optim_state = moe.cut_experts(self.raw, grid, weights, optim_state)
        if self.pipe is not None:  # each stage loads the tensors it holds (a tied copy: the first stage's state)
            optim_state = pp.stage_state(self.pipe, optim_state)
        sharded = isinstance(w, fsdp.FSDP)
        if sharded:
            fsdp.load_full_state_dict(w, weights)
        else:
            load_full_state_dict(self.raw, grid, weights)
        if optim_state is None or opt is None:
            return
        if hasattr(opt, "load_full_optim_state"):  # muon.FSDPMuon: its owners' momentum
            opt.load_full_optim_state(self.raw, grid, optim_state)
        elif sharded:
            fsdp.load_full_optim_state(w, opt, optim_state)
        else:  # muon.Muon's load_state_dict keeps what this rank owns under ZeRO-1
            load_full_optim_state(self.raw, opt, grid, optim_state)


def parallelize(model, grid, cfg, load=None, optimizer=True, compile_kwargs=None):
    """Apply the layout of cfg (grid's pp / tp / ep, cfg.data_parallel) to a full model built from the
    same seed on every rank, in place, and build its optimizer (optimizer=False: none) -> Net.

    The order, and why: the TP cut first (everything after sees this rank's slices; the loss method
    chunked.use installs reads the cut head); the initial weights next (each rank reads its slices;
    every expert still here); LoRA on the loaded base (adapters cut like it), then NF4 (qlora.quantize
    replaces LoRA's linears: it needs them and the loaded weights, and must precede every wrapper so
    that FSDP / DataParallel see the 4-bit buffers); recompute wraps blocks' forwards on the instance
    (after the modules it wraps are final, before FSDP's hooks go around the blocks and compile
    traces them); then the EP cut, FSDP or DataParallel, compile.

    load(model): the initial weights (weights.loader), called on the TP-cut model before the EP cut.
    cfg.lora_r > 0: then the base is frozen and LoRA adapters added (lora.apply), except on a model
    that is frozen already (a reference model); lora_base_dtype="nf4": the base quantised to 4 bits
    (qlora.py) and moved to grid.device (materialize.build may keep it on the host until then).
    cfg.loss_chunk > 0: the loss in chunks (chunked.py); cfg.recompute: selective activation
    checkpointing (recompute.py); cfg.embed_on_host: a frozen token embedding moved to the host
    (materialize.host_embedding) once DataParallel has broadcast it. An fp16 compute dtype gives the
    Net a loss scaler (scaler.py).
    A model without trainable parameters (a frozen reference) gets no optimizer and stays
    replicated (DataParallel: broadcast once, nothing to reduce), also under data_parallel="fsdp".
    Partly frozen models work: frozen parameters are neither reduced nor optimised.
    cfg.compile: under DataParallel fwd = torch.compile(raw, **compile_kwargs), TP included (dynamo
    traces TP's collectives into the graph, forward and backward: tp.py); under FSDP each block's
    compute and the head (FSDP.compile: the gather hooks stay eager). compile_kwargs: torch.compile's
    keywords (tests: dict(backend="aot_eager") traces the same graphs without code generation)."""
    # TP: keep this rank's heads / MLP columns / vocabulary rows (tp=1: no-op)
    tp.tensor_parallel(model, grid, sequence_parallel=cfg.sequence_parallel)
    chunked.use(model, cfg.loss_chunk)  # the loss from the last hidden state, N tokens at a time (0: no-op)
    if load is not None:
        load(model)  # initial weights: each TP rank reads only its slices; every expert still here
    dtype = amp_dtype(cfg, grid.device)
    if cfg.optimizer_in_backward and dtype == torch.float16:  # dtype=auto on a GPU without bf16
        raise config.ConfigError("optimizer_in_backward=True cannot run with fp16 loss scaling (a step it skips has "
                                 "already been taken): set dtype=float32 or bfloat16")
    if cfg.lora_r and any(p.requires_grad for p in model.parameters()):
        lora.apply(model, cfg, grid)  # freeze the base, add adapters cut like their base (lora.py)
        if cfg.lora_base_dtype == "nf4":  # the base in 4 bits, the rest frozen in the compute dtype
            qlora.quantize(model, double=cfg.qlora_double, rest_dtype=dtype, device=grid.device)
    recompute.apply(model, cfg.recompute, cfg.recompute_every, cfg.offload_activations, cfg.mlp_tile)  # "": no-op
    moe.expert_parallel(model, grid)  # EP: keep this rank's experts, set the groups (dense: no-op)
    trainable = any(p.requires_grad for p in model.parameters())
    dtype = amp_dtype(cfg, grid.device)
    # PP: keep this stage's blocks (the forms above rewrite whole modules and need not know of stages;
    # the data-parallel forms below wrap, reduce and optimise only what this stage keeps)
    pipe = pp.cut(model, grid, cfg, pp.activation_dtype(cfg, dtype)) if grid.pp > 1 else None
    if cfg.data_parallel == "fsdp" and trainable:  # shard what TP left over the data-parallel ranks
        # (a pipeline stage runs several forwards before their backwards: it keeps the weights gathered)
        wrapper = fsdp.FSDP(model, grid, compute_dtype=dtype if dtype != torch.float32 else None,
                            reshard_after_forward=pipe is None)
        opt = optim.build_optimizer(wrapper, cfg, grid) if optimizer else None
        fwd = wrapper  # gathers each block's shards around its forward
        if cfg.compile:
            wrapper.compile(**(compile_kwargs or {}))
    else:  # replicate it (broadcasts rank 0's weights); ZeRO-1: each gradient is reduced to its owner
        opt = optim.build_optimizer(model, cfg, grid) if optimizer and trainable else None
        wrapper = dp.DataParallel(model, grid, cfg.grad_bucket_mb, owner=getattr(opt, "grad_owner", None),
                                  reduce_dtype=getattr(torch, cfg.grad_reduce_dtype))
        # DataParallel's hooks live on the parameters, outside the graph; TP's collectives inside it
        fwd = torch.compile(model, **(compile_kwargs or {})) if cfg.compile else model
    if cfg.embed_on_host:  # after DataParallel's broadcast, which reads every tensor on the GPU
        materialize.host_embedding(model)
    loss_scaler = scaler.LossScaler(device=grid.device) if opt is not None and dtype == torch.float16 else None
    return Net(model, wrapper, fwd, opt, grid, pipe, loss_scaler)
