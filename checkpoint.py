"""Checkpoints: save and resume, atomically, independent of the parallel layout.

    out/<run>/step_000500/
        model.safetensors   full (unsharded) weights by parameter name; tied weights stored once
        optimizer.pt        optimizer state keyed by parameter *name*, not position
        trainer.pt          step, loader position, every rank's RNG states, the config
        config.json         the config, for humans and for `sample.py`
    out/<run>/latest        the name of the newest complete checkpoint

A checkpoint is written into a hidden temporary folder and renamed into place, and `latest` is
replaced atomically afterwards, so a process killed mid-save leaves the previous checkpoint
intact and loadable. Only the newest `keep_last` checkpoints are kept.
"""
import json
import os
import shutil

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file


def _unique_state(model):
    """State dict without the second name of tied tensors (safetensors refuses shared storage)."""
    out, seen = {}, set()
    for name, t in model.state_dict().items():
        key = (t.data_ptr(), t.shape, t.dtype)
        if key in seen:
            continue
        seen.add(key)
        out[name] = t.detach().contiguous().cpu()
    return out


def _fsync_write(path, write):
    with open(path, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())


def optimizer_state(model, optimizer):
    """torch.optim state keyed by parameter name, so any layout can load it."""
    names = {id(p): n for n, p in model.named_parameters()}
    sd = optimizer.state_dict()
    idx_to_name = {}
    groups = []
    for g_live, g in zip(optimizer.param_groups, sd["param_groups"]):
        for p, i in zip(g_live["params"], g["params"]):
            idx_to_name[i] = names[id(p)]
        groups.append({**{k: v for k, v in g.items() if k != "params"},
                       "params": [names[id(p)] for p in g_live["params"]]})
    state = {idx_to_name[i]: {k: (v.cpu() if torch.is_tensor(v) else v) for k, v in s.items()}
             for i, s in sd["state"].items()}
    return {"state": state, "param_groups": groups}


def load_optimizer_state(model, optimizer, saved):
    names = {id(p): n for n, p in model.named_parameters()}
    live_groups = optimizer.param_groups
    if len(saved["param_groups"]) != len(live_groups):
        raise ValueError(f"checkpoint has {len(saved['param_groups'])} optimizer parameter groups, "
                         f"this run has {len(live_groups)}: was the optimizer config changed?")
    sd = {"state": {}, "param_groups": []}
    i = 0
    for g_live, g in zip(live_groups, saved["param_groups"]):
        live_names = [names[id(p)] for p in g_live["params"]]
        if live_names != g["params"]:
            diff = sorted(set(live_names) ^ set(g["params"]))
            raise ValueError(f"optimizer parameters differ from the checkpoint's: {diff[:8]}")
        ids = list(range(i, i + len(live_names)))
        for n, j in zip(live_names, ids):
            if n in saved["state"]:
                sd["state"][j] = saved["state"][n]
        sd["param_groups"].append({**{k: v for k, v in g.items() if k != "params"}, "params": ids})
        i += len(live_names)
    optimizer.load_state_dict(sd)


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


def save(out_dir, step, model, optimizer, cfg, loader_state=None, keep_last=2, rank=0):
    """Collective when distributed (RNG states are gathered); rank 0 writes."""
    rngs = _gather_rng()
    if rank != 0:
        return None
    os.makedirs(out_dir, exist_ok=True)
    name = f"step_{step:06d}"
    final = os.path.join(out_dir, name)
    tmp = os.path.join(out_dir, f".tmp_{name}_{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    save_file(_unique_state(model), os.path.join(tmp, "model.safetensors"))
    if optimizer is not None:
        _fsync_write(os.path.join(tmp, "optimizer.pt"), lambda f: torch.save(optimizer_state(model, optimizer), f))
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


def load_model(path, model, strict=True):
    """Load weights by name into `model`; a mismatch names the offending keys."""
    file = os.path.join(path, "model.safetensors")
    if not os.path.isfile(file):
        raise FileNotFoundError(f"no model.safetensors in '{path}': is it a checkpoint folder (out/<run>/step_N)?")
    saved = load_file(file)
    want = _unique_state(model)
    missing = sorted(set(want) - set(saved))
    unexpected = sorted(set(saved) - set(want))
    shapes = [f"{k}: checkpoint {tuple(saved[k].shape)} vs model {tuple(want[k].shape)}"
              for k in sorted(set(want) & set(saved)) if saved[k].shape != want[k].shape]
    if strict and (missing or unexpected or shapes):
        msg = [f"checkpoint '{path}' does not fit this model config:"]
        if missing:
            msg.append(f"  missing in checkpoint: {missing[:10]}{' ...' if len(missing) > 10 else ''}")
        if unexpected:
            msg.append(f"  not in model: {unexpected[:10]}{' ...' if len(unexpected) > 10 else ''}")
        if shapes:
            msg.append("  shape mismatch: " + "; ".join(shapes[:10]))
        diff = _config_diff(path, model)
        if diff:
            msg.append("  model config differs: " + ", ".join(diff))
        raise ValueError("\n".join(msg))
    sd = model.state_dict()
    with torch.no_grad():
        for k, v in saved.items():
            if k in sd:
                sd[k].copy_(v)
    return saved


def _config_diff(path, model):
    try:
        with open(os.path.join(path, "config.json")) as f:
            saved = json.load(f)
    except (OSError, ValueError):
        return []
    mine = vars(model.cfg) if hasattr(model, "cfg") else {}
    return [f"{k}={saved[k]!r} (checkpoint) vs {v!r} (now)" for k, v in mine.items()
            if k in saved and saved[k] != v]


def load(path, model, optimizer=None, rank=0):
    """Restore model, optimizer and this rank's RNG; returns the trainer dict (step, loader, cfg)."""
    load_model(path, model)
    if optimizer is not None:
        opt_file = os.path.join(path, "optimizer.pt")
        if not os.path.isfile(opt_file):
            raise FileNotFoundError(f"no optimizer.pt in '{path}': cannot resume optimizer state")
        load_optimizer_state(model, optimizer, torch.load(opt_file, map_location="cpu", weights_only=False))
    trainer = torch.load(os.path.join(path, "trainer.pt"), map_location="cpu", weights_only=False)
    rngs = trainer.get("rng") or []
    if rank < len(rngs):
        set_rng_state(rngs[rank])
    return trainer
