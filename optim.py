"""Optimizer construction and learning-rate schedules, shared by every stage.

AdamW with decoupled weight decay on matrices only: norms, biases and other 1-D parameters are
not decayed (decaying a gain towards 0 fights the normalisation it implements).
Muon for hidden matrices (and ZeRO-1) live in muon.py; build_optimizer picks it by config.
"""
import math

import torch

import muon
from memory import optim_memory
from parallelism import fsdp


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
