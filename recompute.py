"""Selective activation checkpointing: recompute in backward what a forward would otherwise keep,
for every k-th block, or only the attention or only the MLP of those blocks.

    recompute.apply(model, mode="mlp", every=1)   # in place, after the TP cut / LoRA, before FSDP, DP, compile
    python sft.py configs/sft_small.py --recompute=mlp --recompute_every=2    # parallelize calls it

Modes (config keys recompute / recompute_every; plan.py predicts per token and block what each keeps):
  "block"  the whole block keeps only its input (model.py's grad_checkpoint=True is this at every=1)
  "mlp"    the MLP keeps only its input: it holds most of a block's activations (gate, act(gate), up
           and their product, 4 x hidden values per token), for the price of recomputing its matmuls
  "attn"   the attention keeps only its input (q, k, v, rotations, the output recomputed; with
           flash / efficient SDPA there are no T x T scores to save, so this saves less)
every = k: blocks 0, k, 2k, ... are checkpointed, the others keep everything (memory between the
modes' extremes, recompute only where needed).

How: the chosen modules' forward is wrapped on the instance by Checkpointed, which calls
torch.utils.checkpoint (non-reentrant, RNG state preserved: dropout masks are drawn again the
same) in training forwards that record gradients and carry no KV cache, and the plain forward
otherwise (evaluation, generation). Parameter names, state dicts and hooks are unchanged;
fsdp.FSDP's hooks stay around the block (a recompute runs inside the block's backward, after FSDP
has gathered it again); copy.deepcopy(model) carries the wrappers along, pointing at the copy.
"""
import torch
from torch.utils.checkpoint import checkpoint

MODES = ("block", "attn", "mlp")


def has_cache(args, kwargs):
    return kwargs.get("cache") is not None or any(hasattr(a, "update") and hasattr(a, "length") for a in args)


class Checkpointed:
    """A module's forward, recomputed in backward when it trains (see the module docstring)."""

    def __init__(self, module, forward):
        self.module, self.forward = module, forward

    def __call__(self, *args, **kwargs):
        if self.module.training and torch.is_grad_enabled() and not has_cache(args, kwargs):
            return checkpoint(self.forward, *args, use_reentrant=False, **kwargs)
        return self.forward(*args, **kwargs)


def targets(model, mode, every):
    """The modules apply() wraps: mode's part of blocks 0, every, 2 every, ..."""
    if mode not in MODES:
        raise ValueError(f"recompute='{mode}' must be one of {', '.join(MODES)} (or '' for none)")
    if every < 1:
        raise ValueError(f"recompute_every={every} must be >= 1")
    blocks = [b for i, b in enumerate(model.blocks) if i % every == 0]
    return [b if mode == "block" else getattr(b, mode) for b in blocks]


def apply(model, mode="block", every=1):
    """Checkpoint `mode` ("block", "attn" or "mlp") of every `every`-th block of a model.Transformer,
    in place; mode "" does nothing. Returns model."""
    if not mode:
        return model
    if model.cfg.grad_checkpoint:
        raise ValueError("grad_checkpoint=True already recomputes every block: drop it, or set recompute=''")
    for m in targets(model, mode, every):
        if isinstance(m.forward, Checkpointed):
            raise ValueError("recompute.apply: this model is checkpointed already")
        m.forward = Checkpointed(m, m.forward)
    return model
