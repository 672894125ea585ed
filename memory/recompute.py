"""Selective activation checkpointing: recompute in backward what a forward would otherwise keep,
for every k-th block, or only the attention or only the MLP of those blocks; optionally what each
keeps (its input) waits in pinned host memory instead of on the GPU.

    recompute.apply(model, mode="mlp", every=1)   # in place, after the TP cut / LoRA, before FSDP, DP, compile
    recompute.apply(model, "block", offload=True)  # python sft.py ... --recompute=block --offload_activations=True

Modes (config keys recompute / recompute_every; plan.py predicts per token and block what each keeps):
  "block"  the whole block keeps only its input (model.py's grad_checkpoint=True is this at every=1)
  "mlp"    the MLP keeps only its input: it holds most of a block's activations (gate, act(gate), up
           and their product, 4 x hidden values per token), for the price of recomputing its matmuls
  "attn"   the attention keeps only its input (q, k, v, rotations, the output recomputed; with
           flash / efficient SDPA there are no T x T scores to save, so this saves less)
every = k: blocks 0, k, 2k, ... are checkpointed, the others keep everything.
mlp_tile = N (tokens; ALST's TiledMLP): every MLP runs over tiles of N tokens of the micro-batch and keeps
only its input; backward recomputes one tile at a time (Tiled), so a long row's MLP never holds more than
one tile's 4 x hidden values per token. With recompute=block the recomputed blocks' MLPs tile too.

How: the chosen modules' forward is wrapped on the instance by Checkpointed: torch.utils.checkpoint
(non-reentrant, RNG state preserved: dropout masks drawn again the same) in training forwards that
record gradients and carry no KV cache, the plain forward otherwise (evaluation, generation).
Parameter names, state dicts and hooks are unchanged; fsdp.FSDP's hooks stay around the block;
copy.deepcopy(model) carries the wrappers along, pointing at the copy. offload (offload_activations):
Offloaded instead, an autograd Function that copies the input to pinned host memory on a side stream,
and in backward copies it back (each backward first starts the copy the next one needs: Offloader),
recomputes the module and returns the gradients of the input and the parameters. On the CPU the
copy is a copy: the gradients equal checkpoint's bitwise (tests/test_recompute.py).
"""
import dataclasses

import torch
from torch.utils.checkpoint import checkpoint

from config import need

MODES = ("block", "attn", "mlp")
RECOMPUTE_DEFAULTS = dict(  # selective recompute's config keys
    recompute="",            # "" | block | attn | mlp: recompute that part of blocks in backward (recompute.py)
    recompute_every=1,       # recompute only blocks 0, k, 2k, ... (k = recompute_every)
    offload_activations=False,  # the inputs recomputed parts keep wait in pinned host memory (recompute.py)
    mlp_tile=0,              # >0: MLPs run over tiles of this many tokens, each recomputed in backward (long rows)
)
RESUME_FREE = tuple(RECOMPUTE_DEFAULTS)  # a resumed run may change them (lifecycle.RESUME_FREE)


def check(cfg, world=1):
    """recompute's keys, and grad_checkpoint (the model's: recompute='block' on every block)."""
    need(cfg.recompute in ("", "block", "attn", "mlp"), f"recompute='{cfg.recompute}' must be '', block, attn or mlp")
    need(cfg.recompute_every >= 1, f"recompute_every={cfg.recompute_every} must be >= 1")
    need(not (cfg.recompute and cfg.grad_checkpoint),
         f"recompute='{cfg.recompute}' and grad_checkpoint=True both recompute (grad_checkpoint is recompute='block' "
         f"on every block): drop one")
    need(cfg.mlp_tile >= 0, f"mlp_tile={cfg.mlp_tile} must be >= 0 (tokens per MLP tile; 0: no tiling)")
    need(not (cfg.mlp_tile and cfg.n_experts), f"mlp_tile={cfg.mlp_tile} tiles dense MLPs; a mixture of experts routes "
         f"over the whole micro-batch: drop mlp_tile")
    need(not (cfg.mlp_tile and cfg.recompute == "mlp"),
         f"mlp_tile={cfg.mlp_tile} already recomputes the MLPs (one tile at a time): drop recompute=mlp")
    need(not cfg.offload_activations or cfg.recompute or cfg.grad_checkpoint,
         "offload_activations=True moves what recomputed blocks keep to the host: set grad_checkpoint=True or "
         "recompute")


def has_cache(args, kwargs):
    return kwargs.get("cache") is not None or any(hasattr(a, "update") and hasattr(a, "length") for a in args)


class Offloader:
    """The host copies of one model's offloaded inputs in forward order, and the side stream that moves
    them: each backward fetches its own input and starts the copy of the one before it (the next
    backward's), so that the transfer overlaps this backward's compute."""

    def __init__(self):
        self.saved, self.stream = [], None

    def __deepcopy__(self, memo):  # a copied model (copy.deepcopy) gets its own, empty
        return Offloader()

    def side_stream(self, device):
        if device.type != "cuda":
            return None
        if self.stream is None:
            self.stream = torch.cuda.Stream(device)
        return self.stream

    def put(self, x):
        """x -> an entry {host, device, stream, index}: x copied to pinned host memory (off the compute stream)."""
        stream = self.side_stream(x.device)
        entry = {"device": x.device, "stream": stream, "back": None, "index": len(self.saved)}
        if stream is None:
            entry["host"] = x.detach().clone()
        else:
            entry["host"] = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
            stream.wait_stream(torch.cuda.current_stream(x.device))
            with torch.cuda.stream(stream):
                entry["host"].copy_(x.detach(), non_blocking=True)
            x.record_stream(stream)  # its GPU memory is not reused before the copy is done
        self.saved.append(entry)
        return entry

    def fetch(self, entry):
        """Start copying entry's input back to its device (once) -> the tensor it will be."""
        if entry["back"] is None:
            if entry["stream"] is None:
                entry["back"] = entry["host"]
            else:
                with torch.cuda.stream(entry["stream"]):
                    entry["back"] = entry["host"].to(entry["device"], non_blocking=True)
        return entry["back"]

    def take(self, entry):
        """entry's input on its device, ready for the compute stream; the previous entry's copy started."""
        x = self.fetch(entry)
        if entry["stream"] is not None:
            torch.cuda.current_stream(entry["device"]).wait_stream(entry["stream"])
            x.record_stream(torch.cuda.current_stream(entry["device"]))
        entry["host"] = entry["back"] = None  # from here on only the caller holds it: autograd keeps ctx to the end
        i = entry["index"]
        if 0 < i <= len(self.saved) and self.saved[i - 1] is not None:
            self.fetch(self.saved[i - 1])  # the next backward's input, while this one computes
        if i < len(self.saved):  # (a forward whose backward never ran may have been cleared under it)
            self.saved[i] = None
        if all(e is None for e in self.saved):
            self.saved.clear()  # a forward's inputs all consumed: the next forward starts at 0
        return x


class Offloaded(torch.autograd.Function):
    """y = fn(x) keeping nothing on x's device for backward: x waits on the host (Offloader.put); backward
    brings it back, recomputes fn under the forward's autocast and RNG state, and returns the gradients of
    x and of params (fn's parameters that train)."""

    @staticmethod
    def forward(ctx, fn, offloader, x, *params):
        dev = x.device
        ctx.fn, ctx.offloader = fn, offloader
        ctx.autocast = (torch.is_autocast_enabled(dev.type), torch.get_autocast_dtype(dev.type))
        ctx.rng = (torch.get_rng_state(), torch.cuda.get_rng_state(dev) if dev.type == "cuda" else None)
        ctx.entry, ctx.params = offloader.put(x), params
        ctx.x_grad = x.requires_grad
        with torch.no_grad():
            return fn(x)

    @staticmethod
    def backward(ctx, dy):
        x = ctx.offloader.take(ctx.entry).detach().requires_grad_(ctx.x_grad)
        dev = x.device
        with torch.random.fork_rng(devices=[dev] if dev.type == "cuda" else []):
            torch.set_rng_state(ctx.rng[0])
            if ctx.rng[1] is not None:
                torch.cuda.set_rng_state(ctx.rng[1], dev)
            with torch.enable_grad(), torch.autocast(dev.type, dtype=ctx.autocast[1], enabled=ctx.autocast[0]):
                y = ctx.fn(x)
        inputs = ((x,) if ctx.x_grad else ()) + tuple(ctx.params)
        grads = list(torch.autograd.grad(y, inputs, dy, allow_unused=True)) if inputs else []
        dx = grads.pop(0) if ctx.x_grad else None
        return (None, None, dx, *grads)


def tiled(fn, x, tile):
    """fn(x) computed `tile` tokens at a time into one output (no list of tiles and their concatenation)."""
    flat, out = x.reshape(-1, x.shape[-1]), None
    for start in range(0, flat.shape[0], tile):
        y = fn(flat[start:start + tile])
        if out is None:
            out = y.new_empty(flat.shape[0], y.shape[-1])
        out[start:start + tile] = y
    return out.view(*x.shape[:-1], -1)


class Tiled(torch.autograd.Function):
    """y = fn(x) over tiles of `tile` tokens (x: (..., C), tiled along its flattened tokens), keeping only x:
    backward recomputes each tile under the forward's autocast and returns the gradients of x and of params
    (fn's parameters that train), summed over the tiles. fn must act on each token alone (an MLP)."""

    @staticmethod
    def forward(ctx, fn, tile, x, *params):
        ctx.fn, ctx.tile, ctx.params, ctx.x_grad = fn, tile, params, x.requires_grad
        ctx.autocast = (torch.is_autocast_enabled(x.device.type), torch.get_autocast_dtype(x.device.type))
        ctx.save_for_backward(x)
        with torch.no_grad():
            return tiled(fn, x, tile)

    @staticmethod
    def backward(ctx, dy):
        (x,) = ctx.saved_tensors
        flat, dflat = x.reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1])
        dx = torch.empty_like(flat) if ctx.x_grad else None
        sums = [None] * len(ctx.params)
        for start in range(0, flat.shape[0], ctx.tile):
            part = flat[start:start + ctx.tile].detach().requires_grad_(ctx.x_grad)
            with torch.enable_grad(), torch.autocast(x.device.type, dtype=ctx.autocast[1], enabled=ctx.autocast[0]):
                y = ctx.fn(part)
            inputs = ((part,) if ctx.x_grad else ()) + tuple(ctx.params)
            grads = list(torch.autograd.grad(y, inputs, dflat[start:start + ctx.tile], allow_unused=True))
            if ctx.x_grad:
                dx[start:start + ctx.tile] = grads.pop(0)
            sums = [g if s is None else s if g is None else s.add_(g) for s, g in zip(sums, grads)]
        return (None, None, None if dx is None else dx.view_as(x), *sums)


class TiledForward:
    """A module's forward over token tiles in training: Tiled where it records gradients, and tile by tile
    without (a recomputed or offloaded block's first forward: no full-length intermediates there either).
    (torch.compiler.disable wraps per instance, not at class definition: it imports dynamo, ~1 s a process.)"""

    def __init__(self, module, forward, tile):
        self.module, self.forward, self.tile = module, forward, tile
        self.__setstate__({})

    def __setstate__(self, state):  # (a copy's wrapper runs the copy's own module)
        self.__dict__.update(state)
        self.eager = torch.compiler.disable(self.run)  # a Python loop over tiles: runs eagerly (compile skips it)

    def __getstate__(self):
        return {k: v for k, v in self.__dict__.items() if k != "eager"}

    def __call__(self, x):
        return self.eager(x)

    def run(self, x):
        if not self.module.training:
            return self.forward(x)
        if not torch.is_grad_enabled():
            return tiled(self.forward, x, self.tile)
        params = [p for p in self.module.parameters() if p.requires_grad]
        return Tiled.apply(self.forward, self.tile, x, *params)


class Checkpointed:
    """A module's forward, recomputed in backward when it trains (see the module docstring); offloader:
    its input kept on the host meanwhile (Offloaded), where no other argument needs a gradient."""

    def __init__(self, module, forward, offloader=None):
        self.module, self.forward, self.offloader = module, forward, offloader
        self.__setstate__({})

    def __setstate__(self, state):  # (a copy's wrapper runs the copy's own module)
        self.__dict__.update(state)
        if self.offloader is not None:  # host copies and side streams: the module runs eagerly (compile skips it)
            self.offloaded = torch.compiler.disable(self.offload)

    def __getstate__(self):
        return {k: v for k, v in self.__dict__.items() if k != "offloaded"}

    def __call__(self, *args, **kwargs):
        if self.module.training and torch.is_grad_enabled() and not has_cache(args, kwargs):
            if self.offloader is not None and not any(torch.is_tensor(a) and a.requires_grad
                                                      for a in list(args[1:]) + list(kwargs.values())):
                return self.offloaded(args, kwargs)
            return checkpoint(self.forward, *args, use_reentrant=False, **kwargs)
        return self.forward(*args, **kwargs)

    def offload(self, args, kwargs):
        params, forward, rest = [p for p in self.module.parameters() if p.requires_grad], self.forward, args[1:]
        # the closure holds the other arguments only: one holding args would keep x on the device to the end
        return Offloaded.apply(lambda x: forward(x, *rest, **kwargs), self.offloader, args[0], *params)


def targets(model, mode, every):
    """The modules apply() wraps: mode's part of blocks 0, every, 2 every, ..."""
    if mode not in MODES:
        raise ValueError(f"recompute='{mode}' must be one of {', '.join(MODES)} (or '' for none)")
    if every < 1:
        raise ValueError(f"recompute_every={every} must be >= 1")
    blocks = [b for i, b in enumerate(model.blocks) if i % every == 0]
    return [b if mode == "block" else getattr(b, mode) for b in blocks]


def apply(model, mode="block", every=1, offload=False, mlp_tile=0):
    """Checkpoint `mode` ("block", "attn" or "mlp") of every `every`-th block of a model.Transformer,
    in place; mode "" does nothing. offload: their inputs on the host until backward (with
    grad_checkpoint=True: every block's, which then goes through this file). mlp_tile > 0: every block's
    MLP runs over tiles of that many tokens (Tiled). Returns model."""
    if mlp_tile:
        if mode == "mlp":
            raise ValueError("mlp_tile already recomputes the MLPs: drop recompute='mlp'")
        for block in model.blocks:
            if isinstance(block.mlp.forward, (TiledForward, Checkpointed)):
                raise ValueError("recompute.apply: this model's MLPs are wrapped already")
            block.mlp.forward = TiledForward(block.mlp, block.mlp.forward, mlp_tile)
    if offload and model.cfg.grad_checkpoint and not mode:  # the same recompute, through Checkpointed
        model.cfg, mode, every = dataclasses.replace(model.cfg, grad_checkpoint=False), "block", 1
    if not mode:
        if offload:
            raise ValueError("offload_activations=True keeps checkpointed inputs on the host: set grad_checkpoint=True "
                             "or recompute (block, attn or mlp)")
        return model
    if model.cfg.grad_checkpoint:
        raise ValueError("grad_checkpoint=True already recomputes every block: drop it, or set recompute=''")
    offloader = Offloader() if offload else None
    for m in targets(model, mode, every):
        if isinstance(m.forward, Checkpointed):
            raise ValueError("recompute.apply: this model is checkpointed already")
        m.forward = Checkpointed(m, m.forward, offloader)
    return model
