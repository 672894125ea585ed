"""Checkpoint files: written atomically, verified before use, read back as full tensors.

    out/<run>/step_000500/
        model.safetensors   full (unsharded) weights by the one-process parameter names; tied once
        optimizer.pt        optimizer state by parameter *name*, full tensors: {name: {exp_avg, ...}}
        trainer.pt          step, loader position, every rank's RNG states, the config, the run id
        config.json         the config, for humans and for `sample.py`
        complete.json       written last: step, run id, and each file's size and sha256
    out/<run>/latest        the name of the newest checkpoint (for humans; latest() does not trust it)

A checkpoint is written into a hidden temporary folder and renamed into place, and a folder
counts as a checkpoint only with its complete.json, whose sizes (and hashes, on resume) must
match: a process killed mid-save, a full disk or a truncated copy never yields a "checkpoint".
.pt files load with torch.load(weights_only=True): a crafted file cannot run code.

This file knows files, not layouts or models: save() takes full tensors and load() returns them,
checked against the names, shapes and tied weights its caller passes (weights.reference);
parallel.Net.full_state / load_full_state turn any layout into them and back. Which folder a run
owns and which checkpoint it resumes is lifecycle.py's.
"""
import hashlib
import json
import os
import pickle
import re
import shutil
import socket

import numpy as np
import torch
import torch.distributed as dist
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

import config
from config import UserError

MANIFEST = "complete.json"
STEP_DIR = re.compile(r"step_(\d+)$")
TMP_DIR = re.compile(r"\.tmp_step_\d+_(.+)_(\d+)$")  # .tmp_step_<N>_<host>_<pid>


class CheckpointError(UserError, ValueError):
    """A checkpoint that cannot be used: incomplete, corrupt, unsafe, or not for this model."""


class RunDirError(UserError):
    """out_dir cannot be used by this run as it stands."""


class ResumeMismatch(UserError):
    """Settings changed on resume that break exactness."""


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


def rng_state():
    s = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        s["cuda"] = torch.cuda.get_rng_state()
    return s


def set_rng_state(trainer, rank):
    """Restore rank `rank`'s RNG states from a trainer dict (load()'s); a rank the checkpoint did not
    have keeps its own."""
    rngs = trainer.get("rng") or []
    if rank < len(rngs):
        torch.set_rng_state(rngs[rank]["cpu"])
        if "cuda" in rngs[rank] and torch.cuda.is_available():
            torch.cuda.set_rng_state(rngs[rank]["cuda"])


def _gather_rng():
    """Every rank's RNG state, collected on rank 0 (no shared file system needed)."""
    mine = rng_state()
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [mine]
    out = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(mine, out, dst=0)
    return out


def _plain(x):
    """Tensors and plain values only (what torch.load(weights_only=True) accepts): numpy scalars
    and arrays become Python numbers and tensors; anything else is a bug in the caller."""
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_plain(v) for v in x)
    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, np.ndarray):
        return torch.from_numpy(x.copy())
    if x is None or isinstance(x, (bool, int, float, str, torch.Tensor)):
        return x
    raise TypeError(f"cannot save {x!r} ({type(x).__name__}) in trainer.pt: only tensors and plain values "
                    f"load with weights_only=True")


def save(out_dir, step, weights, optim_state, cfg, loader_state=None, keep_last=2, rank=0, run_id=None, extra=None,
         sole_writer=False, state=None):
    """Write full weights and optimizer state (parallel.Net.full_state's) as out_dir/step_<step>;
    returns its path on rank 0. Collective when distributed (RNG states are gathered); rank 0
    writes. run_id: the run's lineage (lifecycle.claim), recorded in the checkpoint; pruning keeps
    the newest keep_last of this run id's checkpoints and never touches another run's. Temporary
    folders are removed only when they are this process's, their writer is verifiably gone, or
    sole_writer (the caller holds out_dir's lock: nobody else writes here). extra(folder) writes
    more files into it (a PEFT adapter), hashed too. state: more plain entries for trainer.pt (the
    fp16 loss scaler's)."""
    rngs = _gather_rng()
    if rank != 0:
        return None
    os.makedirs(out_dir, exist_ok=True)
    name = f"step_{step:06d}"
    final = os.path.join(out_dir, name)
    other = manifest(final).get("run_id", run_id)
    if other != run_id:
        raise RunDirError(f"'{final}' is a checkpoint of another run ({other}); this run ({run_id}) will not "
                          f"replace it: use another out_dir")
    tmp = os.path.join(out_dir, f".tmp_{name}_{socket.gethostname()}_{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    save_file(_dedupe(weights), os.path.join(tmp, "model.safetensors"))
    _fsync(os.path.join(tmp, "model.safetensors"))
    if optim_state is not None:
        _fsync_write(os.path.join(tmp, "optimizer.pt"), lambda f: torch.save(optim_state, f))
    trainer = {"step": step, "loader": _plain(loader_state), "rng": rngs, "cfg": _plain(vars(cfg)), "run_id": run_id,
               **_plain(state or {})}
    _fsync_write(os.path.join(tmp, "trainer.pt"), lambda f: torch.save(trainer, f))
    read_pt(os.path.join(tmp, "trainer.pt"))  # loads with weights_only=True now, not only at resume time
    _fsync_write(os.path.join(tmp, "config.json"), lambda f: f.write(json.dumps(vars(cfg), indent=1).encode()))
    if extra is not None:
        extra(tmp)
    files = {f: {"size": os.path.getsize(os.path.join(tmp, f)), "sha256": _sha256(os.path.join(tmp, f))}
             for f in sorted(os.listdir(tmp))}
    record = {"step": step, "run_id": run_id, "files": files}
    _fsync_write(os.path.join(tmp, MANIFEST), lambda f: f.write(json.dumps(record, indent=1).encode()))
    if os.path.exists(final):  # re-saving the same step of this run: move the old one aside first
        old = os.path.join(out_dir, f".tmp_{name}_old_{socket.gethostname()}_{os.getpid()}")
        os.rename(final, old)
        os.rename(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, final)
    _fsync_write(os.path.join(out_dir, "latest.tmp"), lambda f: f.write(name.encode()))
    os.replace(os.path.join(out_dir, "latest.tmp"), os.path.join(out_dir, "latest"))
    mine = [p for p in list_checkpoints(out_dir) if manifest(p)["run_id"] == run_id and step_of(p) <= step]
    for old in mine[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)
    for entry in os.listdir(out_dir):  # leftovers of saves that were killed
        if entry.startswith(".tmp_step_") and _stale(out_dir, entry, sole_writer):
            shutil.rmtree(os.path.join(out_dir, entry), ignore_errors=True)
    return final


def _fsync(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, another user's
        return True
    return True


def _stale(out_dir, entry, sole_writer=False):
    """A temporary folder nobody is writing: this process's, or its writer's process is gone
    (same host), or sole_writer (this process holds out_dir's lock, so no other run writes here)."""
    m = TMP_DIR.match(entry)
    if m and m.group(1) == socket.gethostname() and (int(m.group(2)) == os.getpid() or not _alive(int(m.group(2)))):
        return True
    return sole_writer


def manifest(path):
    """complete.json of a checkpoint folder, or {} when there is none (or it is unreadable)."""
    try:
        with open(os.path.join(path, MANIFEST)) as f:
            m = json.load(f)
        return m if isinstance(m, dict) and isinstance(m.get("files"), dict) and "run_id" in m else {}
    except (OSError, ValueError):
        return {}


def step_of(path):
    """step_000500 -> 500 (None for other names)."""
    m = STEP_DIR.match(os.path.basename(os.path.normpath(path)))
    return int(m.group(1)) if m else None


def step_dirs(out_dir):
    """step_<N> folders, complete or not, by step number (step_999999 before step_1000000)."""
    if not os.path.isdir(out_dir):
        return []
    found = [(step_of(e), e) for e in os.listdir(out_dir)
             if step_of(e) is not None and os.path.isdir(os.path.join(out_dir, e))]
    return [os.path.join(out_dir, e) for _, e in sorted(found)]


def list_checkpoints(out_dir):
    """Checkpoints (step folders with a complete.json), oldest first by step number."""
    return [p for p in step_dirs(out_dir) if manifest(p)]


def latest(out_dir):
    """Path of the newest checkpoint in out_dir whose files all have their recorded sizes, or None."""
    return next((p for p in reversed(step_dirs(out_dir)) if verify(p, hashes=False) is None), None)


def verify(path, hashes=True):
    """None if `path` is a complete checkpoint: complete.json present, every file it lists there
    with its size (and sha256, with hashes=True; then trainer.pt must also load safely), else the
    reason it is not."""
    if not os.path.isdir(path):
        return "no such folder"
    man = manifest(path)
    if not man:
        return f"no valid {MANIFEST} (the save did not finish, or an older version of ingot wrote it)"
    for name in ("model.safetensors", "trainer.pt"):
        if name not in man["files"]:
            return f"{MANIFEST} lists no {name}"
    for name, info in man["files"].items():
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            return f"{name} is missing"
        if os.path.getsize(file) != info["size"]:
            return (f"{name} has {os.path.getsize(file):,} bytes, {MANIFEST} says {info['size']:,} "
                    f"(truncated or altered)")
        if hashes and _sha256(file) != info["sha256"]:
            return f"{name}'s sha256 differs from {MANIFEST} (corrupt or altered)"
    if hashes:
        try:
            read_pt(os.path.join(path, "trainer.pt"))
        except CheckpointError as e:
            return str(e)
    return None


def read_pt(file):
    """torch.load(weights_only=True): tensors and plain containers only. A file that needs anything
    else (a crafted pickle can run code) is refused, never executed."""
    try:
        return torch.load(file, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:  # torch's text: advice to retry unsafely, then what it met
        what = [ln.strip() for ln in str(e).splitlines() if "GLOBAL" in ln or "Unsupported" in ln]
        raise CheckpointError(f"'{file}' holds objects other than tensors and plain values; refused to load "
                              f"it (unpickling them could run code){': ' + what[0] if what else ''}") from e
    except (RuntimeError, EOFError, ValueError) as e:
        raise CheckpointError(f"'{file}' is not a readable checkpoint file: {str(e).splitlines()[0][:200]}") from e


def read_weights(path, expected, mcfg=None, keep=None):
    """model.safetensors -> full state dict with every name of `expected` (the one-process model's
    state dict, tensors on any device, meta included: its names, full shapes, and tied names sharing one
    tensor; weights.reference builds it), tied names filled in, and the saved names beyond them that
    keep(name) accepts (a PEFT adapter's). A mismatch names the offending keys (and, given the model
    config mcfg, how it differs from the checkpoint's config.json)."""
    file = os.path.join(path, "model.safetensors")
    if not os.path.isfile(file):
        raise config.MissingFileError(f"no model.safetensors in '{path}': is it a checkpoint folder "
                                      f"(out/<run>/step_N)?")
    reason = verify(path, hashes=False) if manifest(path) else None  # no complete.json: weights put there by hand
    if reason:
        raise CheckpointError(f"'{path}' is not a complete checkpoint: {reason}")
    try:
        saved = load_file(file)
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"cannot read '{file}': {e}") from e
    alias = {}  # tied names -> the name the tensor is stored under
    for k, v in expected.items():
        alias.setdefault(id(v), k)
    need = {k for k, v in expected.items() if alias[id(v)] == k}
    missing = sorted(k for k in need if k not in saved and not any(
        alias[id(expected[o])] == k and o in saved for o in expected))
    unexpected = sorted(k for k in set(saved) - set(expected) if not (keep and keep(k)))
    shapes = [f"{k}: checkpoint {tuple(saved[k].shape)} vs model {tuple(expected[k].shape)}"
              for k in sorted(set(expected) & set(saved)) if saved[k].shape != expected[k].shape]
    if missing or unexpected or shapes:
        msg = [f"checkpoint '{path}' does not fit this model config:"]
        if missing:
            msg.append(f"  missing in checkpoint: {missing[:10]}{' ...' if len(missing) > 10 else ''}")
        if unexpected:
            msg.append(f"  not in model: {unexpected[:10]}{' ...' if len(unexpected) > 10 else ''}")
        if shapes:
            msg.append("  shape mismatch: " + "; ".join(shapes[:10]))
        diff = _config_diff(path, mcfg) if mcfg is not None else []
        if diff:
            msg.append("  model config differs: " + ", ".join(diff))
        raise CheckpointError("\n".join(msg))
    for k, v in expected.items():  # every tied name gets the stored tensor
        if k not in saved:
            saved[k] = next(saved[o] for o in expected if o in saved and id(expected[o]) == id(v))
    return saved


def _config_diff(path, mcfg):
    try:
        with open(os.path.join(path, "config.json")) as f:
            saved = json.load(f)
    except (OSError, ValueError):
        return []
    return [f"{k}={saved[k]!r} (checkpoint) vs {v!r} (now)" for k, v in vars(mcfg).items()
            if k in saved and saved[k] != v]


def load(path, expected, mcfg=None, keep=None, optimizer=True):
    """(weights, optimizer state or None, trainer dict) of a complete checkpoint: full tensors on
    CPU under the one-process names, checked against the model's (read_weights: expected, mcfg, keep);
    trainer: step, loader, rng, cfg, run_id. Sizes are checked here (lifecycle.find_resume checks hashes)."""
    reason = verify(path, hashes=False)
    if reason:
        raise CheckpointError(f"'{path}' is not a complete checkpoint: {reason}")
    weights, opt_state = read_weights(path, expected, mcfg, keep), None
    if optimizer:
        opt_file = os.path.join(path, "optimizer.pt")
        if not os.path.isfile(opt_file):
            raise CheckpointError(f"no optimizer.pt in '{path}': cannot resume optimizer state")
        opt_state = read_pt(opt_file)
    return weights, opt_state, read_pt(os.path.join(path, "trainer.pt"))
