"""A run's life: the run folder it owns, the checkpoint it resumes, its signals, the end of each step.

    lease = lifecycle.claim(cfg, grid, free=RESUME_FREE)   # out_dir locked, resume picked, settings checked
    trainer, step = lifecycle.resume(lease, net, say)      # weights, optimizer, RNG of the checkpoint (or None, 0)
    clock, interrupt = lifecycle.Clock(device), lifecycle.Interrupt(grid, cfg.max_minutes)
    while step < last: ...; step += 1
        if lifecycle.end_of_step(step, last, cfg, interrupt, save, evaluate, say, clock): break

The run folder is owned by one run at a time (claim: the lock, then the policy):
- a second run into the same out_dir refuses at once, naming the other run's pid and host;
- a fresh run into an out_dir holding an earlier run's checkpoints or metrics refuses, unless
  --resume (continue it) or --overwrite=True (its files move to out_dir/old_<time>/);
- every checkpoint carries a run id; a resumed run adopts its checkpoint's id (one lineage), and
  pruning (keep_last) only ever deletes checkpoints of this lineage at or below the step just saved;
- resume takes the newest checkpoint that verifies, names the ones it skipped and why, and refuses
  changed settings that break exactness (RESUME_FREE, a stage's own) unless --force_resume.
end_of_step: a signal (every rank agrees) saves and stops; then the checkpoint cadence, then the
evaluation (a failing evaluation never costs the steps before it; one at a target loss saves and stops;
past max_minutes the step is the last); all of it off the throughput clock.
"""
import contextlib
import fcntl
import fnmatch
import json
import os
import signal
import socket
import time
import uuid
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

import checkpoint
import config
import fused
import logs
import lora
import muon
import optim
import parallel
import plan
import tokenizer
import weights
from checkpoint import CheckpointError, ResumeMismatch, RunDirError
from config import need
from memory import chunked, materialize, optim_memory, qlora, recompute
from parallelism import gpus, pp
from tools import gradstats

# the run folder's config keys: where a run writes, how it starts, when it saves and evaluates
RUN_DEFAULTS = dict(
    out_dir="out/run",       # checkpoints and metrics (each stage has its own default)
    resume="",               # "": start fresh | "latest" (bare --resume): the newest complete checkpoint in
                             # out_dir, falling back past broken ones | a checkpoint (or run) folder
    overwrite=False,         # a fresh run into an out_dir holding an earlier run moves that run's files to
                             # out_dir/old_<time>/ (nothing is deleted); without it such a run refuses
    force_resume=False,      # resume even where settings changed that break exactness (lifecycle.RESUME_FREE)
    init_from="",            # start from the weights of a checkpoint folder or a local HF model folder
    ckpt_every=500,          # steps between checkpoints (0: only at the end)
    keep_last=2,             # checkpoints kept on disk
    eval_every=250,          # steps between held-out evaluations (0: none)
)
RESUME_CONTROL = frozenset({"resume", "overwrite", "force_resume"})  # how to start, not settings


def check(cfg, world=1):
    """The run folder's keys (and log_every, whose cadence they share)."""
    need(cfg.keep_last >= 1, f"keep_last={cfg.keep_last} must be >= 1")
    need(cfg.ckpt_every >= 0 and cfg.eval_every >= 0 and cfg.log_every > 0,
         "ckpt_every and eval_every must be >= 0 and log_every > 0")


# The keys every training stage reads (pretrain, sft, dpo, grpo), each concept's in its own file beside its
# check, in --help's order; a stage adds its own: config.Keys(lifecycle.TRAIN, its keys, ...).
TRAIN = config.Keys(
    (RUN_DEFAULTS, check), (tokenizer.TOKENIZER_DEFAULTS, tokenizer.check), (optim.OPTIM_DEFAULTS, optim.check),
    (muon.MUON_DEFAULTS, muon.check), (parallel.PARALLEL_DEFAULTS, parallel.check), pp.PP_DEFAULTS,
    (lora.LORA_DEFAULTS, lora.check), qlora.QLORA_DEFAULTS, (chunked.CHUNKED_DEFAULTS, chunked.check),
    (recompute.RECOMPUTE_DEFAULTS, recompute.check), (materialize.MATERIALIZE_DEFAULTS, materialize.check),
    (optim_memory.OPTIM_MEMORY_DEFAULTS, optim_memory.check), (plan.PLAN_DEFAULTS, plan.check),
    (logs.LOGS_DEFAULTS, logs.check), (gradstats.GRADSTATS_DEFAULTS, gradstats.check))
# The training keys a resumed run may change freely: they do not alter the math of the steps to come
# (layout, precision and speed knobs, logging, evaluation, checkpoint cadence, paths; each file lists its
# own). Any other changed key (model, data, batch_size, seq_len, optimizer, lr, schedule, max_steps, seed,
# ...) makes the continued run differ from an uninterrupted one: resume refuses it unless
# --force_resume=True. A key unknown here counts as one that matters; a stage names its own free keys
# (claim(free=...)).
RESUME_FREE = frozenset((
    "out_dir", "init_from", "ckpt_every", "keep_last", "eval_every",  # the run folder's
    "grad_checkpoint", "fp32_residual",  # the model's speed knobs
    *optim.RESUME_FREE, *muon.RESUME_FREE, *parallel.RESUME_FREE, *pp.RESUME_FREE, *chunked.RESUME_FREE,
    *recompute.RESUME_FREE, *materialize.RESUME_FREE, *optim_memory.RESUME_FREE, *plan.RESUME_FREE,
    *logs.RESUME_FREE, *gradstats.RESUME_FREE))

# what a run writes into out_dir: a fresh run refuses to start over these (or moves them aside)
RUN_FILES = ("step_*", ".tmp_step_*", "latest", "latest.tmp", "*_metrics.jsonl", "tb", "wandb")


class RunDirBusy(RunDirError):
    """Another live run holds out_dir's lock."""


class RunDirNotEmpty(RunDirError):
    """out_dir holds an earlier run's files that this run would mix with."""


def say(grid):
    """print on rank 0, nothing elsewhere: what a stage prints once."""
    return print if grid.is_main else (lambda *a, **k: None)


def layout(cfg, grid):
    """One line: the world, its layout, the device (CPU: threads per process), the compute dtype and, with
    fp8_head, which head matmul runs (fused.FP8Linear: FP8 where the device has it)."""
    where = f"{grid.device}" + (f" ({torch.get_num_threads()} threads per process)" if grid.device.type == "cpu" else "")
    pipe = f"pp {grid.pp} {cfg.pp_schedule}, " if grid.pp > 1 else ""
    dtype, head = parallel.amp_dtype(cfg, grid.device), ""
    if getattr(cfg, "fp8_head", False):  # (a stage without the model's keys has no fp8_head)
        head = (" | fp8_head: the head's matmul in FP8 while training" if fused.has_fp8(grid.device) else
                f" | fp8_head: no FP8 on {grid.device} (needs compute capability >= 8.9): the head's matmul in {dtype}")
    return (f"world {grid.world} ({pipe}dp {grid.dp} {cfg.data_parallel}, ep {grid.ep}, tp {grid.tp}) on {where} | "
            f"{dtype}{head}")


def preflight(cfg, grid):
    """Before any work, once cfg is final (init_from's model keys and the vocabulary set, validated):
    on a GPU, say once what the machine is (gpus.report: bf16, peer-to-peer, the MFU peak) and the
    predicted peak memory per GPU (plan.py). cfg.gpu_memory > 0: print the plan for GPUs of that
    many GiB and the knobs that make the run fit, then exit 0 on every rank (SystemExit), out_dir
    untouched: a plan costs no work."""
    if cfg.gpu_memory:
        for line in plan.advice(cfg, grid.world, cfg.gpu_memory):
            say(grid)(line)
        raise SystemExit(0)
    if grid.device.type == "cuda" and grid.is_main:
        lines = gpus.report(gpus.describe())
        try:
            lines += plan.advice(cfg, grid.world)
        except config.UserError:
            lines.append("memory plan: mixture-of-experts models and the encoder families are not modelled (plan.py)")
        for line in lines:
            print(line)


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
class Lease:
    """claim()'s decision. Keep it referenced while the run lasts: it holds out_dir's lock."""
    lock: RunLock
    resume_from: str | None  # the checkpoint to load, or None: start from scratch
    run_id: str | None       # pass to save(): the lineage this run's checkpoints belong to
    notes: list = field(default_factory=list)  # lines to print once: skipped checkpoints, moved files, changes
    held: dict = field(default_factory=dict)   # the held-out metric (track_held): its first value is in checkpoints


def open_run(cfg, free=()):
    """Rank 0, once cfg is final (vocab_size set): lock cfg.out_dir, pick the checkpoint to resume
    (find_resume), check changed settings (check_resume), and make sure out_dir holds only this
    run's history. What stands in the way (an earlier run's files for a fresh run; checkpoints newer
    than the resumed one or of another run) refuses with RunDirNotEmpty unless cfg.overwrite, which
    moves it into out_dir/old_<time>/; broken checkpoints resume skipped are moved there anyway.
    Raises a UserError before any work is spent (broadcast its message to the other ranks). free:
    a stage's own keys a resumed run may change (with RESUME_FREE)."""
    out = cfg.out_dir
    lock = RunLock(out)
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
            man = checkpoint.manifest(path)
            run_id = man["run_id"]
            if os.path.realpath(os.path.dirname(os.path.abspath(path))) != os.path.realpath(out):
                in_way = run_files(out)  # resuming another folder's checkpoint: out_dir must hold no run
            else:
                in_way = [os.path.basename(p) for p in checkpoint.step_dirs(out) if checkpoint.step_of(p) > man["step"]
                          or checkpoint.manifest(p).get("run_id", run_id) != run_id]
                broken = [e for e in in_way if checkpoint.verify(os.path.join(out, e)) is not None]  # what resume skipped
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
    return Lease(lock, path, run_id, notes)


def claim(cfg, grid, free=()):
    """open_run() on rank 0, its decision (checkpoint to resume, run id, notes) on every rank; a
    refusal raises the same UserError on all of them. Only rank 0's Lease holds the lock: keep the
    returned Lease referenced while the run lasts."""
    held = []

    def first():
        held.append(open_run(cfg, free))
        return held[0].resume_from, held[0].run_id, held[0].notes
    resume_from, run_id, notes = parallel.on_main(grid, first)
    return held[0] if held else Lease(None, resume_from, run_id, notes)

# ---------------------------------------------------------------------------- resume and save

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
        if checkpoint.step_of(where) is not None or os.path.exists(os.path.join(where, checkpoint.MANIFEST)):
            reason = checkpoint.verify(where)
            if reason:
                raise CheckpointError(f"--resume={where} is not a usable checkpoint: {reason}")
            return where, []
    notes = []
    for p in reversed(checkpoint.step_dirs(where)):
        reason = checkpoint.verify(p)
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
    run's (a namespace or dict), as 'key: old -> new'. Keys in RESUME_FREE (or free) are info; every
    other changed key breaks exactness and is refused; keys only one side knows are info."""
    now = cfg if isinstance(cfg, dict) else vars(cfg)
    refused, info = [], []
    for k in sorted(set(saved) | set(now)):
        if k in RESUME_CONTROL:
            continue
        if k not in saved or k not in now:
            info.append(f"{k}: {saved[k]!r} in the checkpoint, not a setting now" if k in saved
                        else f"{k}: {now[k]!r} (the checkpoint does not record it)")
        elif saved[k] != now[k]:
            (info if k in RESUME_FREE or k in free else refused).append(f"{k}: {saved[k]!r} -> {now[k]!r}")
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
    if refused and not cfg.force_resume:
        raise ResumeMismatch(f"resuming '{path}' with changed settings; the run would differ from an "
                             f"uninterrupted one:\n  " + "\n  ".join(refused) +
                             "\nset them back, or pass --force_resume=True to continue with the new values")
    return ([f"resume: changed (harmless): {x}" for x in info] +
            [f"resume: changed (forced by force_resume): {x}" for x in refused])

def resume(lease, net, say):
    """Load lease.resume_from (a checkpoint saved by any layout) into net: weights, optimizer state,
    the fp16 loss scale (a checkpoint saved without one leaves the scaler fresh) and this rank's
    RNG, and say so (say: the stage's rank-0 line writer). Returns (the trainer dict (step, loader,
    cfg, run_id), its step), or (None, 0) for a fresh run. Collective under FSDP and EP."""
    if not lease.resume_from:
        return None, 0
    names = set(net.state_names())  # (beside the model's own: its adapters, LoRA's or a tuned prefix)
    ref = weights.reference(net.raw.cfg, type(net.raw), keep=lambda k: lora.is_adapter(k) or k in names)
    full, optim_state, trainer = checkpoint.load(lease.resume_from, **ref, optimizer=net.optimizer is not None)
    have, got = ({k for k in keys if lora.is_adapter(k)} for keys in (names, full))
    if have != got:  # (resume's config check refuses changed lora_* settings first)
        raise CheckpointError(f"'{lease.resume_from}' holds LoRA adapters {sorted(got)[:2]}, this model {sorted(have)[:2]}")
    net.load_full_state(full, optim_state)
    if net.scaler is not None and "scaler" in trainer:
        net.scaler.load_state_dict(trainer["scaler"])
    checkpoint.set_rng_state(trainer, net.grid.rank)
    if trainer.get("held_before"):  # the run's first held-out value: summary's "before", not the resumed step's
        lease.held["before"] = tuple(trainer["held_before"])
    say(f"resumed from {lease.resume_from} at step {trainer['step']}")
    return trainer, trainer["step"]


def save(net, cfg, lease, step, loader_state=None, extra=None, optimizer=True):
    """The full state of net (any layout) as out_dir/step_<step>; collective, rank 0 writes. Returns
    (its path on rank 0, the full weights). extra(weights) -> a function writing more files into the
    checkpoint folder (a LoRA run's PEFT adapter), or None."""
    full, optim_state = net.full_state(optimizer)
    state = {"scaler": net.scaler.state_dict()} if net.scaler is not None else {}  # fp16: resume exactly
    if "before" in lease.held:
        state["held_before"] = list(lease.held["before"])
    path = checkpoint.save(cfg.out_dir, step, full, optim_state, cfg, loader_state, cfg.keep_last, net.grid.rank,
                           run_id=lease.run_id, extra=extra(full) if extra else None,
                           sole_writer=lease.lock is not None, state=state)
    return path, full


# ---------------------------------------------------------------------------- signals, the end of a step, the clock

class Interrupt:
    """SIGTERM / SIGINT during training: finish the current step on every rank, save, exit 0.

    The handler only raises a flag. `requested()` runs once per step on every rank: an all-reduce
    (MAX) of the flags over a gloo group on the CPU, so it never waits for the GPU, and every rank
    stops after the same step even when the signal reached only some of them. (torchrun forwards
    SIGTERM to every worker and kills them 30 s later: time to finish a step and save; Ctrl-C in a
    terminal reaches every process, and torchrun forwards it once more.) A repeat within `echo`
    seconds is that same event; a later one gives up: the previous handlers come back and the
    signal is raised again (Ctrl-C, then Ctrl-C again, stops at once). minutes > 0 (max_minutes):
    the same all-reduce says when any rank is past that many minutes since this was made (`late`).
    """

    def __init__(self, grid, minutes=0.0, signals=(signal.SIGTERM, signal.SIGINT), echo=2.0):
        self.flag, self.signum, self.when, self.echo, self.late = False, None, 0.0, echo, False
        self.deadline = time.monotonic() + 60 * minutes if minutes else None
        # new_group is collective: every rank creates it, whatever the main backend is
        self.group = dist.new_group(backend="gloo") if grid.world > 1 else None
        self.previous = {s: signal.signal(s, self.handle) for s in signals}

    def handle(self, signum, frame):
        if self.flag and time.monotonic() - self.when > self.echo:  # asked twice: stop waiting for the step
            self.restore()
            signal.raise_signal(signum)
        elif not self.flag:
            self.flag, self.signum, self.when = True, signum, time.monotonic()

    def requested(self):
        """True on every rank once any rank got a signal; sets `late` (max_minutes) on every rank alike.
        Collective: every rank calls it each step."""
        t = torch.tensor([int(self.flag), int(self.deadline is not None and time.monotonic() > self.deadline)])
        if self.group is not None:
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        self.late = bool(t[1])
        return bool(t[0])

    def name(self):
        return signal.Signals(self.signum).name if self.signum else "a signal on another rank"

    def restore(self):
        for s, h in self.previous.items():
            signal.signal(s, h)

def end_of_step(step, last, cfg, interrupt, save, evaluate, say, clock=None, target=0.0):
    """A stage script's work after optimizer step `step` (of `last`), in this order: a signal
    (every rank agrees) saves and stops; the checkpoint cadence (cfg.ckpt_every, and the last step);
    the evaluation (every cfg.eval_every steps, and always at the last step: pass evaluate=None for
    none) after the checkpoint, so that an evaluation that fails never costs the steps before it.
    target > 0 (pretraining's target_loss): an evaluation that returns a held-out loss <= target saves
    (unless the cadence just did) and stops the run. Past max_minutes (interrupt.late) the step is the
    last: saved, evaluated, the run stops. All of it stays off clock (the throughput timer);
    say is the stage's rank-0 line writer. Returns True when the run must stop."""
    if interrupt.requested():
        save()
        say(f"{interrupt.name()}: saved step {step} in {cfg.out_dir}; continue with --resume")
        return True
    if interrupt.late:
        last = step
        say(f"max_minutes={cfg.max_minutes:g} reached: step {step} is the last (saved{', evaluated' * bool(evaluate)})")
    do_save = (cfg.ckpt_every and step % cfg.ckpt_every == 0) or step == last
    do_eval = evaluate is not None and (step == last or (cfg.eval_every and step % cfg.eval_every == 0))
    if do_save or do_eval:  # (the clock waits for the GPU: never on a plain step)
        with clock.paused() if clock is not None else contextlib.nullcontext():
            if do_save:
                save()
            held_out = evaluate() if do_eval else None  # every rank gets the same value (all-reduced)
            if target and held_out is not None and held_out <= target:
                if not do_save:
                    save()
                say(f"held-out loss {held_out:.4f} <= target_loss {target:g} at step {step}: saved in "
                    f"{cfg.out_dir}, stopping")
                return True
    return interrupt.late


def track_held(held, step, value):
    """An evaluation's held-out metric into held, for summary(): the first as "before", the latest as "after"."""
    held.setdefault("before", (step, value))
    held["after"] = (step, value)


def summary(say, stage, step, clock, path, metric, held, stopped=False):
    """The last line of a stage: where its final checkpoint is, its held-out metric before -> after
    (held: {"before": (step, value), "after": (step, value)}, either may be missing), the time."""
    parts = [f"{stage} {'stopped' if stopped else 'done'}: {step} steps in {clock.since_start() / 60:.1f} min"]
    if "before" in held and "after" in held:
        (s0, v0), (s1, v1) = held["before"], held["after"]
        fmt = (lambda v: f"{v:.1%}") if "accuracy" in metric or "reward" in metric else (lambda v: f"{v:.4f}")
        parts.append(f"held-out {metric} {fmt(v0)} (step {s0}) -> {fmt(v1)} (step {s1})")
    if path:
        parts.append(f"final checkpoint {path}")
    say(" | ".join(parts))


class Clock:
    """Wall time for throughput: lap() is the time since the previous lap (or the start) with the
    paused() stretches (checkpoints, evaluations) left out. On CUDA it waits for the GPU first, so
    read it at log steps only. The memory those stretches take is left out of the next log line's
    mem_gb too: paused() resets the peak when it ends (logs.peak_memory_gb)."""

    def __init__(self, device):
        self.device = device
        self.start = self.last = self.now()
        self.skipped = 0.0

    def now(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def since_start(self):
        return self.now() - self.start

    def lap(self):
        t = self.now()
        dt, self.last, self.skipped = t - self.last - self.skipped, t, 0.0
        return dt

    @contextlib.contextmanager
    def paused(self):
        t = self.now()
        try:
            yield
        finally:
            self.skipped += self.now() - t
            logs.reset_peak_memory(self.device)
