"""Ablation sweeps: a grid of overrides of one config, one run folder each, then a comparison.

    python -m tools.sweep pretrain.py configs/tiny.py --sweep="lr=[3e-4,1e-3];norm=[layernorm,rmsnorm]"
    python -m tools.sweep pretrain.py configs/small.py --sweep="optimizer=[adamw,muon]" --gpus=0,1 --max_steps=500
    python -m tools.sweep sft.py configs/sft_tiny.py --sweep="lora_r=[0,16]" --nproc=2    # torchrun, 2 processes a run

Every combination of the --sweep lists (keys separated by ';', values by ',') is one run of the
stage script, a subprocess: `<stage> <config> <other --overrides> --<key>=<value>... --out_dir=<run>`,
where <run> is <sweep>/<key>=<value>_... and <sweep> is --out_dir (default out/sweep_<config>). Runs
go one after another, or as a queue over --gpus (each run sees its --gpus_per_run GPUs through
CUDA_VISIBLE_DEVICES; more than one: torchrun). Each run's output goes to <sweep>/logs/<run>.log.

Resumable: a run whose newest checkpoint verifies (checkpoint.verify: sizes and SHA-256) and is its
final step (its config's stop_at or max_steps) is finished and not run again; one with a verifying
earlier checkpoint continues with --resume; one with files but no usable checkpoint starts over with
--overwrite=True (the stage moves its files aside; nothing is deleted). Ctrl-C / SIGTERM reach the
running stages (they save and stop) and end the sweep; the same command continues it.

At the end: <sweep>/sweep.md (a table: each run's swept values, state and final metrics from its
train_metrics.jsonl) and sweep.json (the same, every final metric), and <sweep>/curves.png with every
run's curves overlaid (plots.plot_runs; needs matplotlib, skipped with a note without it).
"""
import itertools
import json
import os
import re
import signal
import subprocess
import sys
import time

import checkpoint
import config
import lifecycle
from tools import plots

TABLE = ("loss", "val_loss", "val_bpb")  # the final metrics the markdown table shows (sweep.json has all)
CONTROL = ("resume", "overwrite")  # decided per run by the sweep


def parse_sweep(spec):
    """'lr=[3e-4,1e-3];norm=[layernorm,rmsnorm]' -> [("lr", ["3e-4", "1e-3"]), ("norm", [...])]: each
    value as written (the stage parses it as an override)."""
    out = []
    for part in [p for p in spec.split(";") if p.strip()]:
        key, eq, values = part.partition("=")
        key, values = key.strip().lstrip("-"), values.strip()
        if not eq or not key or not (values.startswith("[") and values.endswith("]")):
            raise config.ConfigError(f"--sweep: '{part}' is not key=[v1,v2,...] (keys separated by ';')")
        items, depth, quote, cur = [], 0, "", ""
        for c in values[1:-1]:  # split at top-level commas: [1,2] or "a,b" inside a value stay whole
            if quote:
                quote = "" if c == quote else quote
            elif c in "\"'":
                quote = c
            elif c == "," and depth == 0:
                items.append(cur.strip())
                cur = ""
                continue
            else:
                depth += (c in "([{") - (c in ")]}")
            cur += c
        items.append(cur.strip())
        if not all(items):
            raise config.ConfigError(f"--sweep: '{part}' has an empty value")
        if key in [k for k, _ in out]:
            raise config.ConfigError(f"--sweep: key '{key}' is listed twice")
        out.append((key, items))
    if not out:
        raise config.ConfigError("--sweep is empty: give key=[v1,v2];key2=[...]")
    return out


def run_name(combo):
    """[("lr", "3e-4"), ("norm", "rmsnorm")] -> 'lr=3e-4_norm=rmsnorm' (other characters become '-')."""
    return "_".join(re.sub(r"[^A-Za-z0-9.+=-]", "-", f"{k}={v}") for k, v in combo)


def state(run_dir):
    """'finished', 'resume' (a verifying checkpoint before the final step), 'overwrite' (files but
    no usable checkpoint) or 'fresh'; and the newest verifying checkpoint (or None)."""
    if not lifecycle.run_files(run_dir):
        return "fresh", None
    for path in reversed(checkpoint.list_checkpoints(run_dir)):
        if checkpoint.verify(path) is None:
            with open(os.path.join(path, "config.json")) as f:
                saved = json.load(f)
            last = saved.get("stop_at") or saved["max_steps"]
            return ("finished" if checkpoint.step_of(path) >= last else "resume"), path
    return "overwrite", None


def command(stage, cfg_file, passthrough, combo, run_dir, how, nproc):
    launcher = [sys.executable, stage] if nproc == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", stage]
    args = ([cfg_file] if cfg_file else []) + passthrough + [f"--{k}={v}" for k, v in combo]
    extra = {"resume": ["--resume"], "overwrite": ["--overwrite=True"]}.get(how, [])
    return launcher + args + [f"--out_dir={run_dir}"] + extra


def final_metrics(run_dir, log="train"):
    """{metric: its value at the last step that logged it} of the run's <log>_metrics.jsonl ({} if none)."""
    try:
        metrics = plots.read_metrics(plots.metrics_file(run_dir, log))
    except FileNotFoundError:
        return {}
    out = {k: v[max(v)] for k, v in metrics.items()}
    steps = [s for v in metrics.values() for s in v]
    if steps:
        out["step"] = max(steps)
    return out


def table(rows, keys):
    """A markdown table of the runs: swept values, state, final step and TABLE metrics."""
    head = ["run"] + keys + ["state", "step"] + list(TABLE)
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        vals = [r["name"]] + [r["overrides"][k] for k in keys] + [r["state"], str(r["final"].get("step", ""))]
        vals += [f"{r['final'][m]:.4f}" if m in r["final"] else "" for m in TABLE]
        lines.append("| " + " | ".join(vals) + " |")
    return "\n".join(lines) + "\n"


def sweep(stage, cfg_file, grid, passthrough, sweep_dir, gpus=(), gpus_per_run=1, nproc=1, log="train",
          say=print, poll=0.2):
    """Run the grid (see the module docstring); returns the rows of the table (dicts)."""
    keys = [k for k, _ in grid]
    combos = [list(zip(keys, vals)) for vals in itertools.product(*[v for _, v in grid])]
    names = [run_name(c) for c in combos]
    if len(set(names)) != len(names):
        raise config.ConfigError("--sweep: two combinations give the same run folder name; use distinct values")
    os.makedirs(os.path.join(sweep_dir, "logs"), exist_ok=True)
    slots = [",".join(gpus[i:i + gpus_per_run]) for i in range(0, len(gpus) - gpus_per_run + 1, gpus_per_run)]
    if gpus and not slots:
        raise config.ConfigError(f"--gpus lists {len(gpus)} GPUs, fewer than --gpus_per_run={gpus_per_run}")
    per_run = gpus_per_run if gpus else nproc
    todo, rows = [], {}
    for combo, name in zip(combos, names):
        run_dir = os.path.join(sweep_dir, name)
        how, path = state(run_dir)
        rows[name] = {"name": name, "overrides": dict(combo), "dir": run_dir, "state": how}
        if how == "finished":
            say(f"{name}: finished ({os.path.basename(path)}), not run again")
        else:
            todo.append((combo, name, run_dir, how, path))
    running, stop, ended, told = {}, [], 0, set()  # running: slot -> (process, name, log file, start time)
    previous = {s: signal.signal(s, lambda signum, frame: stop.append(signum)) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        free = list(slots) or [None]
        while (todo and not stop) or running:
            while todo and free and not stop:
                combo, name, run_dir, how, path = todo.pop(0)
                slot = free.pop(0)
                env = dict(os.environ, **({"CUDA_VISIBLE_DEVICES": slot} if slot is not None else {}))
                cmd = command(stage, cfg_file, passthrough, combo, run_dir, how, per_run)
                logf = open(os.path.join(sweep_dir, "logs", f"{name}.log"), "a")
                logf.write(f"$ {' '.join(cmd)}\n")
                logf.flush()
                what = {"resume": f"resumes from {path}", "overwrite": "starts over (earlier files moved aside)",
                        "fresh": "starts"}[how]
                say(f"{name}: {what}" + (f" on GPU {slot}" if slot is not None else ""))
                proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, env=env, start_new_session=True)
                running[slot] = (proc, name, logf, time.time())
            if stop:  # forward the signal once (a second would stop a stage at once): it saves its step and stops
                for proc, *_ in running.values():
                    if proc.poll() is None and proc.pid not in told:
                        proc.send_signal(signal.SIGTERM)
                        told.add(proc.pid)
            for slot, (proc, name, logf, t0) in list(running.items()):
                if proc.poll() is None:
                    continue
                logf.close()
                del running[slot]
                free.append(slot)
                now, _ = state(rows[name]["dir"])
                rows[name].update(state="finished" if now == "finished" else "interrupted" if proc.returncode == 0
                                  else f"failed ({proc.returncode})", seconds=round(time.time() - t0, 1))
                say(f"{name}: {rows[name]['state']} after {rows[name]['seconds']} s"
                    + ("" if proc.returncode == 0 else f"; see {logf.name}"))
                ended += 1
                if proc.returncode == 2 and ended == 1:  # the first run refused its settings (a typo
                    todo.clear()  # in the overrides, a bad config): the others would refuse them too
                    say(f"stopped: the stage refused its settings: {last_line(logf.name)}")
            time.sleep(poll if running else 0)
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
    for r in rows.values():
        r["final"] = final_metrics(r["dir"], log)
    out = [rows[n] for n in names]
    write_report(out, keys, sweep_dir, log, say)
    if stop:
        say(f"interrupted ({signal.Signals(stop[0]).name}): run the same command to continue")
    return out


def last_line(path):
    with open(path) as f:
        lines = [ln.strip() for ln in f if ln.strip()]
    return next((ln for ln in reversed(lines) if ln.startswith("error:")), lines[-1] if lines else "")


def write_report(rows, keys, sweep_dir, log, say=print):
    with open(os.path.join(sweep_dir, "sweep.json"), "w") as f:
        json.dump(rows, f, indent=1)
    with open(os.path.join(sweep_dir, "sweep.md"), "w") as f:
        f.write(table(rows, keys))
    say(table(rows, keys))
    done = [r["dir"] for r in rows if r["final"]]
    if not done:
        return
    try:
        plots.plot_runs(done, os.path.join(sweep_dir, "curves.png"), log)
        say(f"wrote {os.path.join(sweep_dir, 'sweep.md')}, sweep.json and curves.png")
    except ImportError:
        say("curves.png skipped: pip install matplotlib")


def main(argv):
    if len(argv) < 1 or argv[0].startswith("--"):
        raise config.UserError("usage: python -m tools.sweep <stage.py> [config.py] --sweep=\"key=[a,b];key2=[c,d]\" "
                               "[--gpus=0,1] [--gpus_per_run=1] [--nproc=1] [--log=train] [--overrides]")
    stage, rest = argv[0], argv[1:]
    if not os.path.isfile(stage):
        raise config.MissingFileError(f"stage script '{stage}' not found (pretrain.py, sft.py, dpo.py, grpo.py)")
    cfg_file = rest.pop(0) if rest and not rest[0].startswith("--") else ""
    own = {"sweep": "", "gpus": "", "gpus_per_run": "1", "nproc": "1", "log": "train", "out_dir": ""}
    passthrough = []
    for a in rest:
        if not a.startswith("--"):
            raise config.ConfigError(f"expected --key=value after the config file, got '{a}'")
        key, _, value = a[2:].partition("=")
        key = key.replace("-", "_")
        if key in own:
            own[key] = value
        elif key in CONTROL:
            raise config.ConfigError(f"--{key}: sweep.py resumes or restarts each run itself; drop it")
        else:
            passthrough.append(a)
    grid = parse_sweep(own["sweep"])
    try:
        gpus_per_run, nproc = int(own["gpus_per_run"]), int(own["nproc"])
    except ValueError:
        raise config.ConfigError("--gpus_per_run and --nproc must be integers") from None
    gpus = [g.strip() for g in own["gpus"].split(",") if g.strip()]
    stem = os.path.splitext(os.path.basename(cfg_file or stage))[0]
    sweep_dir = own["out_dir"] or os.path.join("out", f"sweep_{stem}")
    rows = sweep(stage, cfg_file, grid, passthrough, sweep_dir, gpus, gpus_per_run, nproc, own["log"])
    if any(r["state"].startswith("failed") for r in rows):
        sys.exit(1)


if __name__ == "__main__":
    config.cli(main, sys.argv[1:])
