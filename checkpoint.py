"""Checkpoints: save and resume, atomically, independent of the parallel layout; the run folder.

    out/<run>/step_000500/
        model.safetensors   full (unsharded) weights by the one-process parameter names; tied once
        optimizer.pt        optimizer state by parameter *name*, full tensors: {name: {exp_avg, ...}}
        trainer.pt          step, loader position, every rank's RNG states, the config, the run id
        config.json         the config, for humans and for `sample.py`
        complete.json       written last: step, run id, and each file's size and sha256
    out/<run>/latest        the name of the newest checkpoint (for humans; latest() does not trust it)
    out/<run>/.lock         held (flock) by the run that writes here: its pid and host
    out/<run>/old_<time>/   an earlier run's files, moved aside by --overwrite=True (never deleted)

A checkpoint is written into a hidden temporary folder and renamed into place, and a folder
counts as a checkpoint only with its complete.json, whose sizes (and hashes, on resume) must
match: a process killed mid-save, a full disk or a truncated copy never yields a "checkpoint".
.pt files load with torch.load(weights_only=True): a crafted file cannot run code.

The run folder is owned by one run at a time (open_run: the lock, then the policy):
- a second run into the same out_dir refuses at once, naming the other run's pid and host;
- a fresh run into an out_dir holding an earlier run's checkpoints or metrics refuses, unless
  --resume (continue it) or --overwrite=True (its files move to out_dir/old_<time>/);
- every checkpoint carries a run id; a resumed run adopts its checkpoint's id (one lineage), and
  pruning (keep_last) only ever deletes checkpoints of this lineage at or below the step just saved;
- resume takes the newest checkpoint that verifies, names the ones it skipped and why, and refuses
  changed settings that break exactness (config.RESUME_FREE) unless --force_resume=True.

Layout independence: gather() turns any layout's weights and optimizer state (data parallel,
tensor parallel, FSDP, expert parallel, their products) into full tensors under the one-process
names, and load() cuts them back into whatever layout the resuming run uses (experts to this EP
rank's first, with their AdamW moments / Muon momentum, then TP slices / FSDP shards).
"""
import fcntl
import fnmatch
import hashlib
import json
import os
import pickle
import re
import shutil
import socket
import time
import uuid
from dataclasses import dataclass, field
from types import SimpleNamespace

import numpy as np
import torch
import torch.distributed as dist
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

import config
import fsdp
import lora
import moe
import parallel
import tp
from config import UserError
from model import Transformer

MANIFEST = "complete.json"
STEP_DIR = re.compile(r"step_(\d+)$")
TMP_DIR = re.compile(r"\.tmp_step_\d+_(.+)_(\d+)$")  # .tmp_step_<N>_<host>_<pid>
# what a run writes into out_dir: a fresh run refuses to start over these (or moves them aside)
RUN_FILES = ("step_*", ".tmp_step_*", "latest", "latest.tmp", "*_metrics.jsonl", "tb", "wandb")


class CheckpointError(UserError, ValueError):
    """A checkpoint that cannot be used: incomplete, corrupt, unsafe, or not for this model."""


class RunDirError(UserError):
    """out_dir cannot be used by this run as it stands."""


class RunDirBusy(RunDirError):
    """Another live run holds out_dir's lock."""


class RunDirNotEmpty(RunDirError):
    """out_dir holds an earlier run's files that this run would mix with."""


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


def save(out_dir, step, weights, optim_state, cfg, loader_state=None, keep_last=2, rank=0, run_id=None, extra=None):
    """Write gather()'s output as out_dir/step_<step>; returns its path on rank 0. Collective when
    distributed (RNG states are gathered); rank 0 writes. run_id: open_run(cfg).run_id, recorded
    in the checkpoint; pruning keeps the newest keep_last of this run id's checkpoints and never
    touches another run's. Temporary folders are removed only when they are this process's or
    their writer is verifiably gone. extra(folder) writes more files into it (a PEFT adapter), hashed too."""
    rngs = _gather_rng()
    if rank != 0:
        return None
    os.makedirs(out_dir, exist_ok=True)
    name = f"step_{step:06d}"
    final = os.path.join(out_dir, name)
    other = _manifest(final).get("run_id", run_id)
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
    trainer = {"step": step, "loader": _plain(loader_state), "rng": rngs, "cfg": _plain(vars(cfg)), "run_id": run_id}
    _fsync_write(os.path.join(tmp, "trainer.pt"), lambda f: torch.save(trainer, f))
    read_pt(os.path.join(tmp, "trainer.pt"))  # loads with weights_only=True now, not only at resume time
    _fsync_write(os.path.join(tmp, "config.json"), lambda f: f.write(json.dumps(vars(cfg), indent=1).encode()))
    if extra is not None:
        extra(tmp)
    files = {f: {"size": os.path.getsize(os.path.join(tmp, f)), "sha256": _sha256(os.path.join(tmp, f))}
             for f in sorted(os.listdir(tmp))}
    manifest = {"step": step, "run_id": run_id, "files": files}
    _fsync_write(os.path.join(tmp, MANIFEST), lambda f: f.write(json.dumps(manifest, indent=1).encode()))
    if os.path.exists(final):  # re-saving the same step of this run: move the old one aside first
        old = os.path.join(out_dir, f".tmp_{name}_old_{socket.gethostname()}_{os.getpid()}")
        os.rename(final, old)
        os.rename(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, final)
    _fsync_write(os.path.join(out_dir, "latest.tmp"), lambda f: f.write(name.encode()))
    os.replace(os.path.join(out_dir, "latest.tmp"), os.path.join(out_dir, "latest"))
    mine = [p for p in list_checkpoints(out_dir) if _manifest(p)["run_id"] == run_id and step_of(p) <= step]
    for old in mine[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)
    for entry in os.listdir(out_dir):  # leftovers of saves that were killed
        if entry.startswith(".tmp_step_") and _stale(out_dir, entry):
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


def _stale(out_dir, entry):
    """A temporary folder nobody is writing: this process's, or its writer's process is gone
    (same host), or this process holds out_dir's lock (so no other run writes here)."""
    m = TMP_DIR.match(entry)
    if m and m.group(1) == socket.gethostname() and (int(m.group(2)) == os.getpid() or not _alive(int(m.group(2)))):
        return True
    owner = _lock_owner(out_dir)
    return owner.get("pid") == os.getpid() and owner.get("host") == socket.gethostname()


def _manifest(path):
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


def _step_dirs(out_dir):
    """step_<N> folders, complete or not, by step number (step_999999 before step_1000000)."""
    if not os.path.isdir(out_dir):
        return []
    found = [(step_of(e), e) for e in os.listdir(out_dir)
             if step_of(e) is not None and os.path.isdir(os.path.join(out_dir, e))]
    return [os.path.join(out_dir, e) for _, e in sorted(found)]


def list_checkpoints(out_dir):
    """Checkpoints (step folders with a complete.json), oldest first by step number."""
    return [p for p in _step_dirs(out_dir) if _manifest(p)]


def latest(out_dir):
    """Path of the newest checkpoint in out_dir whose files all have their recorded sizes, or None."""
    return next((p for p in reversed(_step_dirs(out_dir)) if verify(p, hashes=False) is None), None)


def verify(path, hashes=True):
    """None if `path` is a complete checkpoint: complete.json present, every file it lists there
    with its size (and sha256, with hashes=True; then trainer.pt must also load safely), else the
    reason it is not."""
    if not os.path.isdir(path):
        return "no such folder"
    man = _manifest(path)
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


# ---------------------------------------------------------------------------- the run folder

def new_run_id():
    return f"{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:8]}"


def _lock_owner(out_dir):
    try:
        with open(os.path.join(out_dir, ".lock")) as f:
            owner = json.load(f)
        return owner if isinstance(owner, dict) else {}
    except (OSError, ValueError):
        return {}


class RunLock:
    """An exclusive flock on out_dir/.lock, held while this object lives (or until release()). The
    OS drops it when the process dies, so a crashed run never blocks the next one."""

    def __init__(self, out_dir):
        os.makedirs(out_dir, exist_ok=True)
        self.path = os.path.join(out_dir, ".lock")
        self.file = open(self.path, "a+")
        try:
            fcntl.flock(self.file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self.file.close()
            o = _lock_owner(out_dir)
            who = f"pid {o.get('pid')} on host {o.get('host')}, started {o.get('started')}" if o else "pid unknown"
            raise RunDirBusy(f"out_dir '{out_dir}' is in use by another run ({who}): wait for it to end or stop "
                             f"it, or choose another --out_dir") from None
        self.file.truncate(0)
        json.dump({"pid": os.getpid(), "host": socket.gethostname(),
                   "started": time.strftime("%Y-%m-%d %H:%M:%S")}, self.file)
        self.file.flush()

    def release(self):
        if not self.file.closed:
            fcntl.flock(self.file, fcntl.LOCK_UN)
            self.file.close()


def claim(out_dir):
    """Take out_dir for this run (rank 0 only): a RunLock, or RunDirBusy naming the run that holds it."""
    return RunLock(out_dir)


def run_files(out_dir):
    """The entries of out_dir a run writes (RUN_FILES: checkpoints, metrics, ...), sorted."""
    if not os.path.isdir(out_dir):
        return []
    return sorted(e for e in os.listdir(out_dir) if any(fnmatch.fnmatch(e, p) for p in RUN_FILES))


def move_aside(out_dir, names):
    """Move out_dir's entries `names` into a new out_dir/old_<time>/ (nothing is deleted); its path."""
    dest = os.path.join(out_dir, time.strftime("old_%Y%m%d-%H%M%S"))
    n = 1
    while os.path.exists(dest):
        n += 1
        dest = os.path.join(out_dir, time.strftime("old_%Y%m%d-%H%M%S") + f"-{n}")
    os.makedirs(dest)
    for name in names:
        os.rename(os.path.join(out_dir, name), os.path.join(dest, name))
    return dest


@dataclass
class Run:
    """open_run's decision. Keep it referenced while the run lasts: it holds out_dir's lock."""
    lock: RunLock
    resume_from: str | None  # the checkpoint to load, or None: start from scratch
    run_id: str | None       # pass to save(): the lineage this run's checkpoints belong to
    notes: list = field(default_factory=list)  # lines to print once: skipped checkpoints, moved files, changes


def open_run(cfg, free=()):
    """Rank 0, once cfg is final (vocab_size set): lock cfg.out_dir, pick the checkpoint to resume
    (find_resume), check changed settings (check_resume), and make sure out_dir holds only this
    run's history. What stands in the way (an earlier run's files for a fresh run; checkpoints newer
    than the resumed one or of another run) refuses with RunDirNotEmpty unless cfg.overwrite, which
    moves it into out_dir/old_<time>/; broken checkpoints resume skipped are moved there anyway.
    Raises a UserError before any work is spent (broadcast its message to the other ranks). free:
    a stage's own keys a resumed run may change (with config.RESUME_FREE)."""
    out = cfg.out_dir
    lock = claim(out)
    try:
        path, notes = find_resume(cfg)
        broken = []
        if path is None:
            if cfg.resume:
                notes.append(f"resume: no checkpoint in '{out}', starting from scratch")
            run_id, in_way = new_run_id(), run_files(out)
            listed = ", ".join(in_way[:6]) + (" ..." if len(in_way) > 6 else "")
            why = (f"out_dir '{out}' holds an earlier run ({listed}): "
                   f"continue it with --resume, choose another --out_dir, or start over with --overwrite=True")
        else:
            notes += check_resume(path, cfg, free)
            man = _manifest(path)
            run_id = man["run_id"]
            if os.path.realpath(os.path.dirname(os.path.abspath(path))) != os.path.realpath(out):
                in_way = run_files(out)  # resuming another folder's checkpoint: out_dir must hold no run
            else:
                in_way = [os.path.basename(p) for p in _step_dirs(out) if step_of(p) > man["step"]
                          or _manifest(p).get("run_id", run_id) != run_id]
                broken = [e for e in in_way if verify(os.path.join(out, e)) is not None]  # what resume skipped
                in_way = [e for e in in_way if e not in broken]
            why = (f"out_dir '{out}' holds checkpoints outside the history resumed from '{path}' "
                   f"({', '.join(in_way[:6])}: newer, or of another run): choose another --out_dir, or "
                   f"--overwrite=True")
        if in_way and not cfg.overwrite:
            raise RunDirNotEmpty(why + f" (moves them to '{out}/old_<time>/'; nothing is deleted)")
        if in_way or broken:
            dest = move_aside(out, in_way + broken)
            notes.append(f"moved {', '.join(in_way + broken)} to '{dest}' (delete it when you no longer need it)")
    except BaseException:
        lock.release()
        raise
    return Run(lock, path, run_id, notes)


def open_run_everywhere(cfg, grid, free=()):
    """open_run() on rank 0, its decision (checkpoint to resume, run id, notes) on every rank; a
    refusal raises the same UserError on all of them. Only rank 0's Run holds the lock: keep the
    returned Run referenced while the run lasts."""
    held = []

    def first():
        held.append(open_run(cfg, free))
        return held[0].resume_from, held[0].run_id, held[0].notes
    resume_from, run_id, notes = parallel.on_main(grid, first)
    return held[0] if held else Run(None, resume_from, run_id, notes)


# ---------------------------------------------------------------------------- resume

def find_resume(cfg):
    """(checkpoint to resume or None, notes) for cfg.resume: "" -> (None, []); "latest" -> the newest
    checkpoint in cfg.out_dir that verifies (sizes, sha256, trainer.pt loads), with a note for each
    newer one skipped and why; a path -> that checkpoint folder (it must verify) or, for a run folder,
    its newest that verifies. No checkpoint at all -> None (start fresh); only broken ones -> CheckpointError."""
    if not cfg.resume:
        return None, []
    where = cfg.out_dir if cfg.resume == "latest" else cfg.resume
    if cfg.resume != "latest":
        if not os.path.isdir(where):
            raise CheckpointError(f"--resume={where}: no such folder (name a checkpoint folder such as "
                                  f"out/run/step_000500, or a run folder; bare --resume takes out_dir's newest)")
        if step_of(where) is not None or os.path.exists(os.path.join(where, MANIFEST)):
            reason = verify(where)
            if reason:
                raise CheckpointError(f"--resume={where} is not a usable checkpoint: {reason}")
            return where, []
    notes = []
    for p in reversed(_step_dirs(where)):
        reason = verify(p)
        if reason is None:
            return p, notes
        notes.append(f"resume: skipped '{p}': {reason}")
    if notes:
        raise CheckpointError(f"no usable checkpoint in '{where}':\n  " + "\n  ".join(notes) +
                              "\nname a good one with --resume=<folder>, or drop --resume and start over "
                              "with --overwrite=True (moves them aside)")
    if cfg.resume != "latest":
        raise CheckpointError(f"--resume={where}: no checkpoint (step_<N> folder) in it")
    return None, []


def resume_changes(saved, cfg, free=()):
    """(refused, info): the settings that differ between a checkpoint's config (a dict) and this
    run's (a namespace or dict), as 'key: old -> new'. Keys in config.RESUME_FREE (or free) are info; every
    other changed key breaks exactness and is refused; keys only one side knows are info."""
    now = cfg if isinstance(cfg, dict) else vars(cfg)
    refused, info = [], []
    for k in sorted(set(saved) | set(now)):
        if k in config.RESUME_CONTROL:
            continue
        if k not in saved or k not in now:
            info.append(f"{k}: {saved[k]!r} in the checkpoint, not a setting now" if k in saved
                        else f"{k}: {now[k]!r} (the checkpoint does not record it)")
        elif saved[k] != now[k]:
            (info if k in config.RESUME_FREE or k in free else refused).append(f"{k}: {saved[k]!r} -> {now[k]!r}")
    return refused, info


def check_resume(path, cfg, free=()):
    """Compare the checkpoint's config with cfg: notes listing the harmless changes; ResumeMismatch
    for changes that break exactness, unless cfg.force_resume (then they are listed as forced)."""
    try:
        with open(os.path.join(path, "config.json")) as f:
            saved = json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"'{path}': cannot read config.json ({e})") from e
    refused, info = resume_changes(saved, cfg, free)
    if refused and not getattr(cfg, "force_resume", False):
        raise ResumeMismatch(f"resuming '{path}' with changed settings; the run would differ from an "
                             f"uninterrupted one:\n  " + "\n  ".join(refused) +
                             "\nset them back, or pass --force_resume=True to continue with the new values")
    return ([f"resume: changed (harmless): {x}" for x in info] +
            [f"resume: changed (forced by force_resume): {x}" for x in refused])


def read_weights(path, cfg):
    """model.safetensors -> full state dict with every name of model config `cfg` (tied names
    filled in; a LoRA run's adapters too); a mismatch with the config names the offending keys."""
    file = os.path.join(path, "model.safetensors")
    if not os.path.isfile(file):
        raise config.MissingFileError(f"no model.safetensors in '{path}': is it a checkpoint folder "
                                      f"(out/<run>/step_N)?")
    reason = verify(path, hashes=False) if _manifest(path) else None  # no complete.json: weights put there by hand
    if reason:
        raise CheckpointError(f"'{path}' is not a complete checkpoint: {reason}")
    try:
        saved = load_file(file)
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"cannot read '{file}': {e}") from e
    with torch.device("meta"):  # the one-process model's names and full shapes, no memory
        ref = Transformer(cfg).state_dict(keep_vars=True)
    alias = {}  # tied names -> the name the tensor is stored under
    for k, v in ref.items():
        alias.setdefault(id(v), k)
    need = {k for k, v in ref.items() if alias[id(v)] == k}
    missing = sorted(k for k in need if k not in saved and not any(
        alias[id(ref[o])] == k and o in saved for o in ref))
    unexpected = sorted(k for k in set(saved) - set(ref) if not lora.is_adapter(k))
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
        raise CheckpointError("\n".join(msg))
    for k, v in ref.items():  # every tied name gets the stored tensor
        if k not in saved:
            saved[k] = next(saved[o] for o in ref if o in saved and id(ref[o]) == id(v))
    return saved


def grow_vocab(t, n_old, n_new):
    """Rows n_old..n_new-1 (tokens just added) = the mean of the n_old real rows: an average token, not noise."""
    t = t.clone()
    t[n_old:n_new] = t[:n_old].float().mean(0).to(t.dtype)
    return t


def fit_weights(weights, saved, mcfg):
    """A checkpoint's full weights (`saved`: its config dict) -> model config mcfg's: LoRA adapters
    merged into their base, vocabulary grown (grow_vocab)."""
    if any(lora.is_adapter(k) for k in weights):
        weights = lora.merge_weights(weights, SimpleNamespace(**saved))
    out, n = dict(weights), saved["vocab_size"]
    for k in ("tok_emb.weight", "head.weight") if n < mcfg.vocab_size else ():
        grown = torch.cat([out[k][:n], out[k].new_zeros(mcfg.padded_vocab - n, mcfg.n_embd)])
        out[k] = grow_vocab(grown, n, mcfg.vocab_size)
    return out


def load_model(path, model):
    """Load a checkpoint's weights into a plain (unsharded) model (a LoRA run's: adapters merged)."""
    sd = read_weights(path, model.cfg)
    if any(lora.is_adapter(k) for k in sd):
        with open(os.path.join(path, "config.json")) as f:
            sd = fit_weights(sd, json.load(f), model.cfg)
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
    layout; returns the trainer dict (step, loader, cfg, run_id). Collective under FSDP. Only a
    complete checkpoint loads (sizes checked here; find_resume checks the hashes); .pt files load
    with weights_only=True."""
    reason = verify(path, hashes=False)
    if reason:
        raise CheckpointError(f"'{path}' is not a complete checkpoint: {reason}")
    weights = read_weights(path, model.cfg)
    have, got = ({k for k in sd if lora.is_adapter(k)} for sd in (model.state_dict(), weights))
    if have != got:  # (resume's config check refuses changed lora_* settings first)
        raise CheckpointError(f"'{path}' holds LoRA adapters {sorted(got)[:2]}, this model {sorted(have)[:2]}")
    opt_state = None
    if optimizer is not None:
        opt_file = os.path.join(path, "optimizer.pt")
        if not os.path.isfile(opt_file):
            raise CheckpointError(f"no optimizer.pt in '{path}': cannot resume optimizer state")
        opt_state = read_pt(opt_file)
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
    trainer = read_pt(os.path.join(path, "trainer.pt"))
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
    sd["state"] = {i: {k: (tp.local_tensor(p, v, grid) if v.dim() else v).clone() if torch.is_tensor(v) else v
                       for k, v in full[name].items()}  # copies: the optimizer's steps must not advance `full`
                   for i, name, p in _state_by_index(model, optimizer) if name in full}
    optimizer.load_state_dict(sd)  # casts to the parameters' devices and dtypes
