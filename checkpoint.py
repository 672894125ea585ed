"""Checkpoints: save and resume, atomically, independent of the parallel layout.

    out/<run>/step_000500/
        model.safetensors   full (unsharded) weights by the one-process parameter names; tied once
        optimizer.pt        optimizer state by parameter *name*, full tensors: {name: {exp_avg, ...}}
        trainer.pt          step, loader position, every rank's RNG states, the config
        config.json         the config, for humans and for `sample.py`
    out/<run>/latest        the name of the newest complete checkpoint

A checkpoint is written into a hidden temporary folder and renamed into place, and `latest` is
replaced atomically afterwards, so a process killed mid-save leaves the previous checkpoint
intact and loadable. Only the newest `keep_last` checkpoints are kept.

Layout independence: gather() turns any layout's weights and optimizer state (data parallel,
tensor parallel, FSDP, expert parallel, their products) into full tensors under the one-process
names, and load() cuts them back into whatever layout the resuming run uses (experts to this EP
rank's first, with their AdamW moments / Muon momentum, then TP slices / FSDP shards).
"""
import json
import os
import shutil

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

import fsdp
import moe
import tp
from model import Transformer


def _dedupe(sd):
    """Drop the second name of tied tensors (safetensors refuses shared storage)."""
    out, seen = {}, set()
    for name, t in sd.items():
        key = (t.data_ptr(), t.shape, t.dtype)
        if key not in seen:
            seen.add(key)
            out[name] = t.detach().contiguous().cpu()
    return out


def _fsync_write(path, write):
    with open(path, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())


def gather(model, optimizer, grid, wrapper=None):
    """(weights, optimizer state) as full tensors under the one-process names, from any layout
    (plain, data parallel, TP, FSDP, EP, and their products). Collective: every rank calls it.
    optimizer state: {param name: {"exp_avg": ..., "exp_avg_sq": ..., "step": ...}}."""
    weights = fsdp.full_state_dict(wrapper) if isinstance(wrapper, fsdp.FSDP) else full_state_dict(model, grid)
    if optimizer is None:
        state = None
    elif hasattr(optimizer, "full_optim_state"):  # muon.Muon / FSDPMuon: any layout, ZeRO-1 included
        state = optimizer.full_optim_state(model, grid)
    elif isinstance(wrapper, fsdp.FSDP):
        state = fsdp.full_optim_state(wrapper, optimizer)
    else:
        state = full_optim_state(model, optimizer, grid)
    return moe.gather_experts(model, grid, weights, state)  # EP: every rank's experts (no-op otherwise)


def rng_state():
    s = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        s["cuda"] = torch.cuda.get_rng_state()
    return s


def set_rng_state(s):
    torch.set_rng_state(s["cpu"])
    if "cuda" in s and torch.cuda.is_available():
        torch.cuda.set_rng_state(s["cuda"])


def _gather_rng():
    """Every rank's RNG state, collected on rank 0 (no shared file system needed)."""
    mine = rng_state()
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [mine]
    out = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(mine, out, dst=0)
    return out


def save(out_dir, step, weights, optim_state, cfg, loader_state=None, keep_last=2, rank=0):
    """Write gather()'s output. Collective when distributed (RNG states are gathered); rank 0 writes."""
    rngs = _gather_rng()
    if rank != 0:
        return None
    os.makedirs(out_dir, exist_ok=True)
    name = f"step_{step:06d}"
    final = os.path.join(out_dir, name)
    tmp = os.path.join(out_dir, f".tmp_{name}_{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    save_file(_dedupe(weights), os.path.join(tmp, "model.safetensors"))
    if optim_state is not None:
        _fsync_write(os.path.join(tmp, "optimizer.pt"), lambda f: torch.save(optim_state, f))
    trainer = {"step": step, "loader": loader_state, "rng": rngs, "cfg": vars(cfg)}
    _fsync_write(os.path.join(tmp, "trainer.pt"), lambda f: torch.save(trainer, f))
    _fsync_write(os.path.join(tmp, "config.json"), lambda f: f.write(json.dumps(vars(cfg), indent=1).encode()))
    if os.path.exists(final):  # re-saving the same step: move the old one aside first
        old = final + f".old_{os.getpid()}"
        os.rename(final, old)
        os.rename(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, final)
    _fsync_write(os.path.join(out_dir, "latest.tmp"), lambda f: f.write(name.encode()))
    os.replace(os.path.join(out_dir, "latest.tmp"), os.path.join(out_dir, "latest"))
    for old in list_checkpoints(out_dir)[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)
    for entry in os.listdir(out_dir):  # leftovers of saves that were killed
        if entry.startswith(".tmp_step_") and not entry.endswith(f"_{os.getpid()}"):
            shutil.rmtree(os.path.join(out_dir, entry), ignore_errors=True)
    return final


def list_checkpoints(out_dir):
    """Complete checkpoints (renamed into place), oldest first."""
    if not os.path.isdir(out_dir):
        return []
    steps = [e for e in os.listdir(out_dir) if e.startswith("step_") and "." not in e
             and os.path.isfile(os.path.join(out_dir, e, "trainer.pt"))]
    return [os.path.join(out_dir, e) for e in sorted(steps)]


def latest(out_dir):
    """Path of the newest complete checkpoint in out_dir, or None."""
    ckpts = list_checkpoints(out_dir)
    return ckpts[-1] if ckpts else None


def read_weights(path, cfg):
    """model.safetensors -> full state dict with every name of model config `cfg` (tied names
    filled in); a mismatch with the config names the offending keys."""
    file = os.path.join(path, "model.safetensors")
    if not os.path.isfile(file):
        raise FileNotFoundError(f"no model.safetensors in '{path}': is it a checkpoint folder (out/<run>/step_N)?")
    saved = load_file(file)
    with torch.device("meta"):  # the one-process model's names and full shapes, no memory
        ref = Transformer(cfg).state_dict(keep_vars=True)
    alias = {}  # tied names -> the name the tensor is stored under
    for k, v in ref.items():
        alias.setdefault(id(v), k)
    need = {k for k, v in ref.items() if alias[id(v)] == k}
    missing = sorted(k for k in need if k not in saved and not any(
        alias[id(ref[o])] == k and o in saved for o in ref))
    unexpected = sorted(set(saved) - set(ref))
    shapes = [f"{k}: checkpoint {tuple(saved[k].shape)} vs model {tuple(ref[k].shape)}"
              for k in sorted(set(ref) & set(saved)) if saved[k].shape != ref[k].shape]
    if missing or unexpected or shapes:
        msg = [f"checkpoint '{path}' does not fit this model config:"]
        if missing:
            msg.append(f"  missing in checkpoint: {missing[:10]}{' ...' if len(missing) > 10 else ''}")
        if unexpected:
            msg.append(f"  not in model: {unexpected[:10]}{' ...' if len(unexpected) > 10 else ''}")
        if shapes:
            msg.append("  shape mismatch: " + "; ".join(shapes[:10]))
        diff = _config_diff(path, cfg)
        if diff:
            msg.append("  model config differs: " + ", ".join(diff))
        raise ValueError("\n".join(msg))
    for k, v in ref.items():  # every tied name gets the stored tensor
        if k not in saved:
            saved[k] = next(saved[o] for o in ref if o in saved and id(ref[o]) == id(v))
    return saved


def load_model(path, model):
    """Load a checkpoint's weights into a plain (unsharded) model."""
    sd = read_weights(path, model.cfg)
    with torch.no_grad():
        for k, t in model.state_dict().items():
            t.copy_(sd[k])
    return sd


def _config_diff(path, cfg):
    try:
        with open(os.path.join(path, "config.json")) as f:
            saved = json.load(f)
    except (OSError, ValueError):
        return []
    return [f"{k}={saved[k]!r} (checkpoint) vs {v!r} (now)" for k, v in vars(cfg).items()
            if k in saved and saved[k] != v]


def load(path, model, optimizer, grid, wrapper=None):
    """Restore weights, optimizer state (saved by any layout) and this rank's RNG into this
    layout; returns the trainer dict (step, loader, cfg). Collective under FSDP."""
    weights = read_weights(path, model.cfg)
    opt_state = None
    if optimizer is not None:
        opt_file = os.path.join(path, "optimizer.pt")
        if not os.path.isfile(opt_file):
            raise FileNotFoundError(f"no optimizer.pt in '{path}': cannot resume optimizer state")
        opt_state = torch.load(opt_file, map_location="cpu", weights_only=False)
    weights, opt_state = moe.cut_experts(model, grid, weights, opt_state)  # EP: this rank's experts
    if isinstance(wrapper, fsdp.FSDP):
        fsdp.load_full_state_dict(wrapper, weights)
    else:
        load_full_state_dict(model, grid, weights)
    if opt_state is not None:
        if hasattr(optimizer, "load_full_optim_state"):  # muon.FSDPMuon: its owners' momentum
            optimizer.load_full_optim_state(model, grid, opt_state)
        elif isinstance(wrapper, fsdp.FSDP):
            fsdp.load_full_optim_state(wrapper, optimizer, opt_state)
        else:  # muon.Muon's load_state_dict keeps what this rank owns under ZeRO-1
            load_full_optim_state(model, optimizer, grid, opt_state)
    trainer = torch.load(os.path.join(path, "trainer.pt"), map_location="cpu", weights_only=False)
    rngs = trainer.get("rng") or []
    if grid.rank < len(rngs):
        set_rng_state(rngs[grid.rank])
    return trainer


# ----------------------------------------------------------------------------- full state of a plain / TP model
# (moved here from tp.py by issue 14: layout-free state, used by gather() / load() at any tp)

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
    sd["state"] = {i: {k: tp.local_tensor(p, v, grid).clone() if torch.is_tensor(v) and v.dim() else v
                       for k, v in full[name].items()}
                   for i, name, p in _state_by_index(model, optimizer) if name in full}
    optimizer.load_state_dict(sd)  # casts to the parameters' devices and dtypes
