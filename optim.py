"""Optimizer construction and learning-rate schedules, shared by every stage.

AdamW with decoupled weight decay on matrices only: norms, biases and other 1-D parameters are
not decayed (decaying a gain towards 0 fights the normalisation it implements).
Muon for hidden matrices (and ZeRO-1) live in muon.py; build_optimizer picks it by config.
"""
import math

import torch

import muon
from config import need
from memory import optim_memory
from parallelism import fsdp

# the optimizer's and the schedule's config keys (every training stage reads them: lifecycle.TRAIN)
OPTIM_DEFAULTS = dict(
    max_steps=1000,          # optimizer steps (the schedule's length)
    stop_at=0,               # stop early at this step, e.g. to fit a job time limit (0: run to max_steps)
    max_minutes=0.0,         # stop after the first step past this many minutes of the training loop, saved and
                             # evaluated as a last step (0: no limit; loading and the first evaluation not counted)
    optimizer="adamw",       # adamw | muon (hidden matrices; the rest AdamW)
    lr=6e-4,                 # peak learning rate (after warmup)
    min_lr_ratio=0.1,        # final lr = lr * min_lr_ratio
    schedule="cosine",       # cosine | linear | wsd | constant (all after linear warmup)
    warmup_steps=100,        # linear warmup from 0
    wsd_decay_frac=0.2,      # WSD: fraction of steps spent decaying at the end
    weight_decay=0.1,        # decoupled, on matrices only (optim.py)
    beta1=0.9,               # AdamW's first-moment decay
    beta2=0.95,              # AdamW's second-moment decay
    eps=1e-8,                # AdamW's denominator floor
    grad_clip=1.0,           # 0: no clipping
)
RESUME_FREE = ("stop_at", "max_minutes")  # of these, the keys a resumed run may change (lifecycle.RESUME_FREE)


def check(cfg, world=1):
    """The optimizer's and the schedule's keys."""
    need(cfg.lr > 0, f"lr={cfg.lr} must be positive")
    need(0 <= cfg.min_lr_ratio <= 1, f"min_lr_ratio={cfg.min_lr_ratio} must be in [0, 1]")
    need(cfg.max_steps > 0, f"max_steps={cfg.max_steps} must be positive")
    need(0 <= cfg.stop_at <= cfg.max_steps, f"stop_at={cfg.stop_at} must be in [0, max_steps={cfg.max_steps}]")
    need(cfg.max_minutes >= 0, f"max_minutes={cfg.max_minutes} must be >= 0 (0: no limit)")
    need(cfg.warmup_steps >= 0, f"warmup_steps={cfg.warmup_steps} must be >= 0")
    need(cfg.schedule in ("cosine", "linear", "wsd", "constant"),
         f"schedule='{cfg.schedule}' is not one of cosine, linear, wsd, constant")
    need(0 < cfg.wsd_decay_frac <= 1, f"wsd_decay_frac={cfg.wsd_decay_frac} must be in (0, 1]")
    need(cfg.weight_decay >= 0, f"weight_decay={cfg.weight_decay} must be >= 0")
    need(0 <= cfg.beta1 < 1 and 0 <= cfg.beta2 < 1, f"beta1={cfg.beta1}, beta2={cfg.beta2} must be in [0, 1)")
    need(cfg.grad_clip >= 0, f"grad_clip={cfg.grad_clip} must be >= 0 (0 disables clipping)")
    need(cfg.optimizer in ("adamw", "muon"), f"optimizer='{cfg.optimizer}' is not available (choose adamw or muon)")


def param_groups(model, weight_decay):
    """[decayed matrices, not decayed 1-D parameters] of the trainable parameters (frozen ones,
    requires_grad=False, are left out)."""
    decay, no_decay = [], []
    for _, p in model.named_parameters():  # unique parameters: a tied weight appears once
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(model, cfg, grid=None):
    """AdamW (torch's; cfg.adamw_state 8bit or offload: optim_memory's, its AdamW part under Muon too;
    optimizer_in_backward: optim_memory.InBackwardAdamW), or muon.Muon when cfg.optimizer == "muon" or
    cfg.zero1 (grid needed for TP and ZeRO-1). model:
    the (cut) module or an fsdp.FSDP wrapper. Every group may carry "lr_scale": the loop sets
    lr = lr_at(step) * lr_scale."""
    if cfg.optimizer not in ("adamw", "muon"):
        raise ValueError(f"optimizer='{cfg.optimizer}' is not available (choose adamw or muon)")
    if cfg.optimizer == "muon" or cfg.zero1:
        return muon.build(model, cfg, grid)
    small = optim_memory.build(cfg.adamw_state, param_groups(model, cfg.weight_decay), lr=cfg.lr,
                               betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                               wrapper=model if isinstance(model, fsdp.FSDP) else None,
                               in_backward=cfg.optimizer_in_backward)
    if small is not None:
        return small
    on_cuda = next(model.parameters()).is_cuda
    # fused AdamW: one kernel for all parameters on GPU; foreach on CPU
    return torch.optim.AdamW(param_groups(model, cfg.weight_decay), lr=cfg.lr,
                             betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                             fused=on_cuda, foreach=None if on_cuda else True)


def set_lr(optimizer, step, cfg):
    """The learning rate of `step` (lr_at) into every parameter group, times its lr_scale (Muon's
    group: muon_lr / lr). Returns it."""
    lr = lr_at(step, cfg)
    for g in optimizer.param_groups:
        g["lr"] = lr * g.get("lr_scale", 1.0)
    return lr


def lr_at(step, cfg):
    """Linear warmup to cfg.lr, then cosine / linear / WSD decay to lr*min_lr_ratio, or constant."""
    lr, lo, n, w = cfg.lr, cfg.lr * cfg.min_lr_ratio, cfg.max_steps, cfg.warmup_steps
    if step < w:
        return lr * (step + 1) / w
    if cfg.schedule == "constant":
        return lr
    if cfg.schedule == "wsd":  # warmup-stable-decay: flat, then a linear ramp down at the end
        start = n - max(1, int(cfg.wsd_decay_frac * n))
        if step < start:
            return lr
        frac = (step - start) / max(1, n - 1 - start)
        return lr + (lo - lr) * min(frac, 1.0)
    frac = min((step - w) / max(1, n - 1 - w), 1.0)
    if cfg.schedule == "linear":
        return lr + (lo - lr) * frac
    return lo + 0.5 * (lr - lo) * (1 + math.cos(math.pi * frac))  # cosine
