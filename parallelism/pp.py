"""Pipeline parallelism: the model cut into pp stages by blocks, micro-batches through them (GPipe, 1F1B).

    net = parallel.parallelize(model, grid, cfg)     # cfg.pp > 1: cut() keeps this stage's part (net.pipe)
    tally = net.train_step(micro, loss_fn, autocast)  # every micro-batch's forward and backward, by the schedule
    net.step(cfg.grad_clip)                           # tied embedding summed, norm over every stage, step

Stage s holds blocks [b_s, b_s+1) (boundaries: even, or cfg.pp_cut="3,5", where stages 1.. start), the
first also the embeddings, the last the final norm, head and loss (model.forward becomes Stage: its part);
other stages' modules are Elsewhere placeholders, so names stay the one-process model's. Every stage reads
the same micro-batches; only activations move: stage s's output (B, T, C) to s + 1, its gradient back.
Schedules, m micro-batches on p stages, t_f / t_b: one micro-batch's forward / backward on one stage:
  gpipe  all forwards, then all backwards: a step takes (m + p - 1)(t_f + t_b), the bubble (p - 1)(t_f +
         t_b) is (p - 1) / m of the ideal step. Activations: all m micro-batches in flight on every stage.
  1f1b   stage s: min(p - s - 1, m) forwards, then one forward one backward, then the backwards left
         (Megatron's non-interleaved schedule). The same bubble, (p - 1) / m; activations: min(p - s, m)
         <= p micro-batches in flight on stage s, however large m is.
Within a stage the other forms compose: TP (sequence-parallel shards travel as they are), DataParallel,
ZeRO-1 or FSDP over the stage's data ranks (FSDP keeps the stage's weights gathered through a step),
LoRA. Tied embeddings: first and last stage each hold a copy, its gradients summed over both
(sum_tied_grads, Megatron's embedding group), counted once in the norm. net(x, y) without gradients:
the last stage's loss, broadcast. net.full_params() (generation) broadcasts every stage's modules to
every stage: decoding is sequential, a pipeline would only idle, and generate.py runs unchanged (the
whole model's memory while it lasts). Net.full_state gathers every stage's tensors (one-process names).
pretrain.py, sft.py and dpo.py (its reference through net(x, y)) run under it; grpo.py refuses pp > 1:
its rollouts decode with the whole model every step. Not here: MoE, torch.compile, value_embeds, unet_skips.
"""
import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn

from config import need
from parallelism import fsdp

SCHEDULES = ("1f1b", "gpipe")
PP_DEFAULTS = dict(  # the pipeline's config keys (parallel.check checks them, with the grid's)
    pp=1,                    # pipeline stages (pp.py): blocks cut into pp stages, outermost in the grid
    pp_schedule="1f1b",      # 1f1b (<= pp micro-batches' activations in flight per stage) | gpipe (all of them)
    pp_cut="",               # where stages 1.. start, e.g. "3,5" for pp=3 ("": blocks split evenly)
    pp_micro=0,              # micro-batches per step and data rank (0: batch_size / (micro_batch_size x data
                             # ranks)); > 0 sets micro_batch_size to batch_size / (pp_micro x data ranks)
)
RESUME_FREE = tuple(PP_DEFAULTS)  # a resumed run may change them (lifecycle.RESUME_FREE)


def check(cfg, dp):
    """The pipeline keys, on dp data-parallel ranks. pp_micro > 0 sets micro_batch_size (the micro-batch count
    fixes its size)."""
    need(cfg.pp_schedule in ("1f1b", "gpipe"), f"pp_schedule='{cfg.pp_schedule}' must be 1f1b or gpipe")
    need(cfg.n_layer >= cfg.pp, f"pp={cfg.pp} stages need n_layer >= pp blocks (n_layer={cfg.n_layer})")
    need(not cfg.pp_cut or cfg.pp > 1, f"pp_cut='{cfg.pp_cut}' cuts a pipeline: set pp > 1, or pp_cut=''")
    if cfg.pp_cut:
        try:
            cut = [int(b) for b in cfg.pp_cut.split(",")]
        except ValueError:
            cut = None
        need(cut is not None and len(cut) == cfg.pp - 1 and all(0 < a < b < cfg.n_layer for a, b in
                                                                zip(cut, cut[1:] + [cfg.n_layer])),
             f"pp_cut='{cfg.pp_cut}' must be {cfg.pp - 1} increasing block indices in 1..{cfg.n_layer - 1}, "
             f"where stages 1..{cfg.pp - 1} start, e.g. pp_cut='{','.join(str(cfg.n_layer * s // cfg.pp) for s in range(1, cfg.pp))}'")
    need(cfg.pp == 1 or not cfg.n_experts, "pp > 1 works with dense models (n_experts=0): MoE router losses "
         "on every stage are not summed yet")
    need(cfg.pp == 1 or not cfg.compile, "pp > 1 with compile=True is untested: set --compile=False")
    need(cfg.pp == 1 or not (cfg.unet_skips or cfg.value_embeds), f"pp > 1 with unet_skips={cfg.unet_skips}, "
         f"value_embeds={cfg.value_embeds}: both tie the first blocks to the last, across stages: set pp=1 or them off")
    need(cfg.pp_micro >= 0, f"pp_micro={cfg.pp_micro} must be >= 0 (0: from the batch split)")
    if cfg.pp_micro:
        need(cfg.batch_size % (cfg.pp_micro * dp) == 0,
             f"batch_size={cfg.batch_size} must be divisible by pp_micro*data_parallel={cfg.pp_micro}*{dp}")
        mbs = cfg.batch_size // (cfg.pp_micro * dp)
        need("micro_batch_size" not in getattr(cfg, "given", ()) or cfg.micro_batch_size == mbs,
             f"pp_micro={cfg.pp_micro} sets micro_batch_size={mbs}: drop micro_batch_size={cfg.micro_batch_size}, "
             f"or pp_micro")
        cfg.micro_batch_size = mbs


class Elsewhere(nn.Module):
    """Where a module held by another pipeline stage sits in this stage's model: no parameters."""

    def __init__(self, path, stage):
        super().__init__()
        self.path, self.stage = path, stage

    def forward(self, *args, **kwargs):
        raise RuntimeError(f"{self.path} is held by pipeline stage {self.stage}, not by this one")


class Stage:
    """A pipeline stage's model.forward (cut() puts it on the model; summon() takes it off while the model
    is whole): model.Transformer.forward's pieces for this stage's blocks (`layers`), from the previous
    stage's hidden states (`hidden`; the first stage embeds idx); only the last stage applies the final
    norm and the head (logits, or the loss with targets), the others return their last block's output."""

    def __init__(self, model, layers, first, last):
        self.model, self.layers, self.first, self.last = model, layers, first, last

    def __call__(self, idx, targets=None, *, hidden=None, reduction="mean", pos=None, attn_mask=None, temperature=1.0):
        m, T = self.model, idx.shape[1]
        start, pos = m.positions(T, None, pos, attn_mask)
        x = m.embed(idx, start, pos) if self.first else hidden
        x = m.run_blocks(x, T, start, pos, attn_mask, layers=self.layers)
        return m.output(m.norm_f(x), targets, reduction, temperature) if self.last else x


def boundaries(n_layer, pp, cut=""):
    """[0, b_1, ..., b_pp-1, n_layer]: stage s holds blocks [b_s, b_s+1). cut: "3,5", the b_s themselves
    (check() checked them); "": as even as n_layer allows, the extra blocks on the first stages
    (the last one also runs the head and the loss)."""
    if cut:
        return [0, *(int(b) for b in cut.split(",")), n_layer]
    q, r = divmod(n_layer, pp)
    sizes = [q + (s < r) for s in range(pp)]
    return [sum(sizes[:s]) for s in range(pp + 1)]


def stage_paths(model, bounds, s):
    """The modules stage s holds, as paths in the one-process model."""
    first = ["tok_emb"] + (["pos_emb"] if isinstance(getattr(model, "pos_emb", None), nn.Module) else [])
    last = ["norm_f", "head"]
    return (first if s == 0 else []) + [f"blocks.{i}" for i in range(bounds[s], bounds[s + 1])] + (
        last if s == len(bounds) - 2 else [])


def tensors(module):
    """A module's parameters, then its buffers, each once, in module order (the same on every stage)."""
    return list(module.parameters()) + list(module.buffers())


def activation_dtype(cfg, compute_dtype):
    """What travels between stages: the residual stream's dtype. The compute dtype where the stream is
    kept in it (fp32_residual=False) or starts in it (the bf16 embedding of FSDP's bf16 gathers, of a
    bf16 LoRA base); float32 otherwise."""
    low = compute_dtype != torch.float32 and (not cfg.fp32_residual or cfg.data_parallel == "fsdp"
                                              or cfg.lora_base_dtype != "float32")
    return compute_dtype if low else torch.float32


@dataclass
class Pipeline:
    """One rank's place in its pipeline: cut() builds it, parallel.Net holds it (Net.pipe)."""
    grid: object
    bounds: list            # boundaries(): stage s holds blocks [bounds[s], bounds[s + 1])
    schedule: str           # "1f1b" | "gpipe"
    paths: list             # paths[s]: the modules stage s holds (stage_paths)
    away: dict              # path -> another stage's module, its tensors emptied (full_params fills them)
    places: dict            # path -> the Elsewhere standing in for it in this stage's model
    shapes: dict            # id(tensor) -> shape, for the emptied tensors of `away`
    names: list             # the one-process state_dict's names, every stage's
    width: int              # n_embd
    act_dtype: torch.dtype  # activation_dtype()
    seq_split: int          # sequence parallelism: training activations hold 1 / seq_split of the positions
    tie: bool = False       # tied embeddings (the model config's tie_embeddings)
    tied: str = ""          # the tied embedding this stage holds: "tok_emb.weight" (first), "head.weight" (last)
    tied_numel: int = 0     # its (TP-local) number of elements
    tied_trains: bool = False

    @property
    def stage(self):
        return self.grid.pp_rank

    @property
    def stages(self):
        return self.grid.pp

    @property
    def first(self):
        return self.stage == 0

    @property
    def last(self):
        return self.stage == self.stages - 1

    def rank_of(self, s):
        """The global rank of stage s in this rank's pipeline (pp is the grid's outermost dimension)."""
        return self.grid.rank + (s - self.stage) * (self.grid.world // self.stages)

    def hidden_shape(self, idx):
        """The activation a stage sends for token ids idx (B, T): (B, T, C), or the sequence shard."""
        split = self.seq_split if torch.is_grad_enabled() else 1  # (tp.sequence_sharded: training only)
        return (idx.shape[0], idx.shape[1] // split, self.width)

    def p2p(self, send_next=None, send_prev=None, recv_prev=None, recv_next=None):
        """One batch of point-to-point operations with the neighbouring stages, waited for: the isends
        and irecvs are posted together (batch_isend_irecv), so two stages sending to each other never
        wait on each other. send_*: a tensor; recv_*: the shape to receive. Returns the received
        tensor (or None). Operations past either end of the pipeline are skipped."""
        ops, got = [], None
        for t, s in ((send_next, self.stage + 1), (send_prev, self.stage - 1)):
            if t is not None and 0 <= s < self.stages:
                if t.dtype != self.act_dtype:
                    raise RuntimeError(f"pipeline stage {self.stage} sends {t.dtype}, its neighbours expect "
                                       f"{self.act_dtype}: a layout pp.activation_dtype does not know")
                ops.append(dist.P2POp(dist.isend, t.detach().contiguous(), self.rank_of(s), self.grid.pp_group))
        for shape, s in ((recv_prev, self.stage - 1), (recv_next, self.stage + 1)):
            if shape is not None and 0 <= s < self.stages:
                got = torch.empty(shape, dtype=self.act_dtype, device=self.grid.device)
                ops.append(dist.P2POp(dist.irecv, got, self.rank_of(s), self.grid.pp_group))
        for req in dist.batch_isend_irecv(ops) if ops else []:
            req.wait()
        return got

    def forward(self, fwd, idx, targets=None, **kwargs):
        """net(x, y, ...) without gradients (evaluation): through the stages, each running fwd (its
        part); the last stage's loss (fp32) broadcast to every stage."""
        if torch.is_grad_enabled():
            raise RuntimeError("under pp > 1 a training forward runs in net.train_step (the pipeline schedule); "
                               "net(x, y) evaluates, under torch.no_grad()")
        if targets is None:
            raise ValueError("under pp > 1 net(x, y) returns losses only; for logits or generation use "
                             "net.full_params() and net.raw")
        out = fwd(idx, targets if self.last else None, hidden=self.p2p(recv_prev=self.hidden_shape(idx)), **kwargs)
        if not self.last:
            self.p2p(send_next=out)
            shape = targets.shape if kwargs.get("reduction", "mean") == "none" else ()
            out = torch.empty(shape, device=self.grid.device)
        out = out.float()
        dist.broadcast(out, src=self.rank_of(self.stages - 1), group=self.grid.pp_group)
        return out


def cut(model, grid, cfg, act_dtype):
    """Keep this stage's part of a full model.Transformer, in place (the forms before the pipeline
    applied: the TP cut, the initial weights, LoRA): other stages' modules become Elsewhere, their
    tensors freed, model.forward this stage's (Stage). A tied embedding's last-stage copy is marked
    p.pp_copy (the gradient norm counts the first stage's). -> Pipeline"""
    mcfg, s = model.cfg, grid.pp_rank
    bounds = boundaries(mcfg.n_layer, grid.pp, cfg.pp_cut)
    names = list(model.state_dict().keys())
    paths = [stage_paths(model, bounds, k) for k in range(grid.pp)]
    keep = {id(t) for path in paths[s] for t in tensors(model.get_submodule(path))}
    away, places, shapes = {}, {}, {}
    for k, stage in enumerate(paths):
        for path in stage if k != s else []:
            mod = model.get_submodule(path)
            for t in tensors(mod):
                if id(t) not in keep and id(t) not in shapes:  # (a tied tensor this stage keeps stays)
                    shapes[id(t)] = t.shape
                    t.data = torch.empty(0, dtype=t.dtype, device=t.device)
            away[path], places[path] = mod, Elsewhere(path, k)
            model.set_submodule(path, places[path])
    model.forward = Stage(model, range(bounds[s], bounds[s + 1]), s == 0, s == grid.pp - 1)
    # the pipeline group's first operation: a collective (torch's batch_isend_irecv asks that, when it
    # is a group's first, every rank of the group take part; after this one it need not)
    dist.all_reduce(torch.zeros(1, device=grid.device), group=grid.pp_group)
    pipe = Pipeline(grid, bounds, cfg.pp_schedule, paths, away, places, shapes, names, mcfg.n_embd, act_dtype,
                    grid.tp if cfg.sequence_parallel else 1)
    pipe.tie = mcfg.tie_embeddings
    if pipe.tie and s in (0, grid.pp - 1):
        pipe.tied = "tok_emb.weight" if s == 0 else "head.weight"
        p = model.get_parameter(pipe.tied)
        pipe.tied_numel, pipe.tied_trains = p.numel(), p.requires_grad
        p.pp_copy = s == grid.pp - 1
    return pipe


# ---------------------------------------------------------------------------- the schedules

def gpipe(pipe, shapes, forward, backward):
    """All forwards, then all backwards (in the same order). forward(i, input) -> output to send on;
    backward(i, output gradient) -> input gradient to send back; shapes[i]: micro-batch i's activation."""
    for i in range(len(shapes)):
        pipe.p2p(send_next=forward(i, pipe.p2p(recv_prev=shapes[i])))
    for i in range(len(shapes)):
        pipe.p2p(send_prev=backward(i, pipe.p2p(recv_next=shapes[i])))


def one_f_one_b(pipe, shapes, forward, backward):
    """Warm-up forwards until the last stage's first backward can come back, then one forward and one
    backward (micro-batches warm + k and k), then the backwards left. Arguments as gpipe's."""
    m = len(shapes)
    warm = min(pipe.stages - pipe.stage - 1, m)
    for i in range(warm):
        pipe.p2p(send_next=forward(i, pipe.p2p(recv_prev=shapes[i])))
    inp = pipe.p2p(recv_prev=shapes[warm]) if warm < m else None
    for k in range(m - warm):
        i = warm + k
        grad = pipe.p2p(send_next=forward(i, inp), recv_next=shapes[k])  # output on, micro-batch k's gradient back
        if i + 1 < m:
            inp = pipe.p2p(send_prev=backward(k, grad), recv_prev=shapes[i + 1])
        else:
            pipe.p2p(send_prev=backward(k, grad))
    for k in range(m - warm, m):
        pipe.p2p(send_prev=backward(k, pipe.p2p(recv_next=shapes[k])))


def train_step(net, micro, loss_fn, autocast=contextlib.nullcontext()):
    """parallel.Net.train_step under a pipeline: micro [(x, y, kwargs)] through the schedule. Each stage
    runs net.fwd on its blocks; the last also calls loss_fn(i, out) -> (loss to backward, tally) on
    micro-batch i's output. The data-parallel reduction runs in the last backward (micro-batch m - 1 in
    both schedules; the others in net.no_sync()). Returns the tallies' sum, on every stage."""
    pipe, m = net.pipe, len(micro)
    held, total = {}, []  # micro-batch -> (its input, its output): alive from its forward to its backward

    def forward(i, inp):
        x, y, kwargs = micro[i]
        if inp is not None:
            inp.requires_grad_()
        with autocast:
            out = net.fwd(x, y if pipe.last else None, hidden=inp, **kwargs)
            if pipe.last:
                out, tally = loss_fn(i, out)
                total.append(tally)
                if net.scaler is not None:  # fp16: the loss scaled (the gradients sent back are, then)
                    out = net.scaler.scale(out)
        held[i] = (inp, out)
        return None if pipe.last else out

    def backward(i, grad):
        inp, out = held.pop(i)
        with net.no_sync() if i < m - 1 else contextlib.nullcontext():
            torch.autograd.backward(out, None if grad is None else grad.to(out.dtype))
        return None if inp is None else inp.grad

    shapes = [pipe.hidden_shape(x) for x, _, _ in micro]
    (gpipe if pipe.schedule == "gpipe" else one_f_one_b)(pipe, shapes, forward, backward)
    return share(pipe, add_up(total) if total else None, pipe.stages - 1)


def add_up(tallies):
    """The sum of a list of tallies (tensors, or dicts of them with the same keys)."""
    if isinstance(tallies[0], dict):
        return {k: add_up([t[k] for t in tallies]) for k in tallies[0]}
    return sum(tallies[1:], tallies[0])


# ---------------------------------------------------------------------------- tied embeddings, state, generation

def sum_tied_grads(net):
    """Tied embeddings: the first stage's tok_emb.weight is the last stage's head.weight; both copies'
    gradients become their sum, as one process accumulates both uses into one tensor. Each rank holding
    a piece of its copy's reduced gradient writes it into its place in a zero buffer of the whole (TP-
    local) weight, one all-reduce over grid.tie_group (both stages' dp ranks) sums each stage's pieces
    once, and every holder takes its piece back. After the data-parallel reduction, before clipping."""
    pipe, grid = net.pipe, net.grid
    if not (pipe.tied and pipe.tied_trains):
        return
    pieces = []  # (this rank's piece of the reduced gradient, its offset in the flat weight, added here)
    if isinstance(net.wrapper, fsdp.FSDP):  # this rank's shard of the unit holding it
        for u in net.wrapper.units:
            off, lo = 0, u.rank * u.S
            for (names, _, _), n in zip(u.params, u.sizes):
                a, b = max(off, lo), min(off + n, lo + u.S)
                if names[0] == pipe.tied and u.grad is not None and a < b:
                    pieces.append((u.grad[a - lo:b - lo], a - off, True))
                off += n
    else:  # replicated: every dp rank holds it, the first adds it; ZeRO-1: its owner alone holds it
        p = net.raw.get_parameter(pipe.tied)
        owner = getattr(net.optimizer, "grad_owner", None)
        if p.grad is not None:
            pieces.append((p.grad.view(-1), 0, owner is not None or grid.dp_rank == 0))
    buf = torch.zeros(pipe.tied_numel, dtype=torch.float32, device=grid.device)
    for g, off, added in pieces:
        if added:
            buf[off:off + g.numel()] += g.float()
    dist.all_reduce(buf, group=grid.tie_group)
    for g, off, _ in pieces:
        g.copy_(buf[off:off + g.numel()])


class _Tensor:
    """A tensor's place in share()'s broadcast layout."""

    def __init__(self, t):
        self.shape, self.dtype, self.device = tuple(t.shape), t.dtype, t.device.type


def share(pipe, tree, s):
    """`tree` (a tensor, or nested dicts of tensors and plain values) of stage s, on every stage of the
    pipeline: its layout broadcast as an object, then each tensor (via the device, back to its own)."""
    grid, src, mine = pipe.grid, pipe.rank_of(s), pipe.stage == s
    flat = []

    def layout(t):
        if isinstance(t, dict):
            return {k: layout(v) for k, v in t.items()}
        if torch.is_tensor(t):
            flat.append(t)
            return _Tensor(t)
        return t
    box = [layout(tree) if mine else None]
    dist.broadcast_object_list(box, src=src, group=grid.pp_group)
    given = iter(flat)

    def fill(t):
        if isinstance(t, dict):
            return {k: fill(v) for k, v in t.items()}
        if not isinstance(t, _Tensor):
            return t
        own = next(given) if mine else None
        buf = own.to(grid.device) if mine else torch.empty(t.shape, dtype=t.dtype, device=grid.device)
        dist.broadcast(buf.contiguous() if mine else buf, src=src, group=grid.pp_group)
        return own if mine else buf.to(t.device)
    return fill(box[0])


def gather_stages(pipe, weights, optim_state):
    """Net.full_state under a pipeline: this stage's full tensors (weights, optimizer state or None) ->
    every stage's, on every rank. A tied embedding: one tensor under both names (checkpoints store it
    once), its optimizer state the first stage's, under the one-process name tok_emb.weight."""
    if pipe.tied == "head.weight" and optim_state is not None:
        optim_state = {k: v for k, v in optim_state.items() if k != pipe.tied}
    all_w, all_s = {}, None if optim_state is None else {}
    for s in range(pipe.stages):
        all_w.update(share(pipe, weights if s == pipe.stage else None, s))
        if optim_state is not None:
            all_s.update(share(pipe, optim_state if s == pipe.stage else None, s))
    if pipe.tie:
        all_w["head.weight"] = all_w["tok_emb.weight"]
    return {k: all_w[k] for k in pipe.names if k in all_w}, all_s


def stage_state(pipe, optim_state):
    """load_full_state under a pipeline: a tied embedding's one-process optimizer state (tok_emb.weight)
    is also the last stage's copy's (head.weight)."""
    if optim_state is not None and pipe.tied == "head.weight" and "tok_emb.weight" in optim_state:
        optim_state = {**optim_state, pipe.tied: optim_state["tok_emb.weight"]}
    return optim_state


@contextlib.contextmanager
def summon(pipe, model):
    """A context in which this stage's model holds every stage's modules, each tensor broadcast from the
    stage holding it over the pipeline group, and runs every block: for generation (Net.full_params).
    Collective; changes inside are discarded and the other stages' tensors freed after."""
    grid, seen, filled = pipe.grid, set(), []
    mine = {id(t) for path in pipe.paths[pipe.stage] for t in tensors(model.get_submodule(path))}
    for s, paths in enumerate(pipe.paths):
        for path in paths:
            for t in tensors(model.get_submodule(path) if s == pipe.stage else pipe.away[path]):
                if id(t) in seen:  # a tied tensor: sent once, by the first stage
                    continue
                seen.add(id(t))
                if id(t) not in mine:
                    t.data = torch.empty(pipe.shapes[id(t)], dtype=t.dtype, device=t.device)
                    filled.append(t)
                buf = t.data if s == pipe.stage or id(t) not in mine else torch.empty_like(t.data)
                dist.broadcast(buf, src=pipe.rank_of(s), group=grid.pp_group)  # (a copy this stage holds: kept)
    for path, mod in pipe.away.items():
        model.set_submodule(path, mod.train(model.training))
    stage = model.forward
    del model.forward  # the model's own forward, over every block
    try:
        yield model
    finally:
        for path, place in pipe.places.items():
            model.set_submodule(path, place)
        for t in filled:
            t.data = torch.empty(0, dtype=t.dtype, device=t.device)
        model.forward = stage
