"""GRPO across task families: from one pretrained base, SFT then GRPO on each family of posttrain/families.py
(and any other task), every setting as the life configs give it; each family's held-out accuracy in one row.

    python bench/grpo_families.py --out=bench/results/families/<date> --base=out/life      # one GPU
    python bench/grpo_families.py --out=/tmp/fam --tiny --families=strings,units            # CPU, ~1 minute
    python bench/grpo_families.py --out=<dir> --jobs=8 --tune=word_problems,units --variants='lr1e5:--lr=1e-5'

Each stage runs as users run it: `python sft.py configs/sft_life.py --init_from=<base> --task=<family>
--task_args={}`, then `python grpo.py configs/grpo_life.py --init_from=<that SFT> --task=<family> --task_args={}
--max_new_tokens=<n>` (n: the family's longest worked solution in the base's tokens plus a quarter, rounded up to
16), with --sft / --grpo appended (countdown keeps sft_life.py's task_args). Without --base, configs/life.py (tiny:
tiny.py, 20 steps) is pretrained into <runs>/base first. --minutes is each GRPO run's --max_minutes (the step past
it is the last, saved and evaluated; 5 minutes later a run still going gets SIGTERM). --jobs: runs side by side.
--stages=sft stops after the SFTs; --stages=grpo starts from the SFT runs already under --runs.
--variants runs GRPO several ways from each family's one SFT ('name:--key=value ...;...', a row each; defaults
writes grpo.*, another grpo_<name>.*). --tune=<families>: a recipe tuned on some families, judged on others: every
variant (and defaults) on those first; pick() chooses one by a rule fixed before any judged run; then --families
(default: the others) run with defaults and the pick (pick.json; each row names its wave).

Written under --out: <family>/{sft,grpo}.log and their metrics, rows.jsonl (a row per family and variant: SFT's
held-out greedy accuracy before -> after, GRPO's greedy and sampled accuracy at its first and last evaluation,
steps, minutes, equal-reward groups, the commands), report.md, curves.png and <family>/grpo.png.
"""
import argparse
import json
import math
import os
import re
import runpy
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

FAMILIES = ("word_problems", "long_arithmetic", "strings", "units", "shortest_path")
FULL = {"pretrain": ["configs/life.py"], "sft": ["configs/sft_life.py"], "grpo": ["configs/grpo_life.py"]}
TINY = {"pretrain": ["configs/tiny.py", "--max_steps=20", "--block_size=256", "--batch_size=8", "--micro_batch_size=8",
                     "--eval_every=0", "--ckpt_every=0", "--log_every=10"],
        "sft": ["configs/sft_tiny.py", "--max_steps=10", "--n_train=400", "--n_eval=16", "--eval_batch=16",
                "--log_every=5", "--ckpt_every=0"],
        "grpo": ["configs/grpo_tiny.py", "--max_steps=4", "--train_prompts=64", "--eval_prompts=8", "--eval_every=2",
                 "--batch_size=16", "--group_size=4", "--micro_batch_size=16", "--log_every=2"]}


def stage(name, args, log, minutes=0.0):
    """`python <args>` from the repository root, its output in log; at `minutes` (> 0) of wall clock it gets
    SIGTERM (a stage saves and stops), and is killed 5 minutes later. -> (return code, seconds, stopped)."""
    t, stopped = time.perf_counter(), False
    with open(log, "w") as f:
        f.write(f"$ python {' '.join(args)}\n")
        f.flush()
        env = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", **os.environ, "PYTHONUNBUFFERED": "1"}
        p = subprocess.Popen([sys.executable, *args], cwd=ROOT, stdout=f, stderr=subprocess.STDOUT,
                             env=env)  # (expandable segments: runs side by side strand no cache)
        try:
            p.wait(timeout=minutes * 60 if minutes else None)
        except subprocess.TimeoutExpired:
            p.send_signal(signal.SIGTERM)
            stopped = True
            try:
                p.wait(timeout=300)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
    seconds = time.perf_counter() - t
    print(f"{name}: rc {p.returncode}, {seconds:.0f} s{' (stopped at the time cap)' if stopped else ''}", flush=True)
    if p.returncode:
        with open(log) as f:
            print(f.read()[-3000:], flush=True)
    return p.returncode, seconds, stopped


def new_tokens(family, base, task_args=None):
    """max_new_tokens for a family: its longest worked solution (2,000 training items) in the base's tokens, plus
    its end of turn, plus a quarter, rounded up to a multiple of 16."""
    import checkpoint
    import tokenizer
    from posttrain import tasks
    with open(os.path.join(checkpoint.latest(base), "config.json")) as f:
        cfg = json.load(f)
    tok = tokenizer.get_tokenizer(cfg["tokenizer"], cfg.get("tokenizer_vocab", 0))
    longest = max(len(tok.encode(it["solution"])) for it in tasks.get(family, task_args or {}).train(2000, seed=0)) + 1
    return 16 * math.ceil(1.25 * longest / 16)


def settings(family, cfgs):
    """A family's task_args: the SFT config's own when it names that task (configs/sft_life.py's Countdown up to
    199, the family GRPO's recipe was tuned on), else {} (the family's defaults)."""
    own = runpy.run_path(os.path.join(ROOT, cfgs["sft"][0]))
    return dict(own.get("task_args", {})) if own.get("task") == family else {}


def records(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def first_last(recs, key):
    """(step, value) of the first and the last record holding key ((None, None) twice when none does)."""
    got = [(r["step"], r[key]) for r in recs if key in r] or [(None, None)]
    return got[0], got[-1]


def row(family, sft_dir, grpo_dir, log, seconds, stopped, n, commands):
    sft, grpo = records(os.path.join(sft_dir, "train_metrics.jsonl")), records(os.path.join(grpo_dir, "train_metrics.jsonl"))
    out = {"family": family, "max_new_tokens": n, "grpo_seconds": round(seconds, 1), "stopped": stopped,
           "grpo_dir": grpo_dir, "commands": commands}
    (_, a0), (s1, a1) = first_last(sft, "accuracy")
    out["sft"] = {"greedy_before": a0, "greedy_after": a1, "steps": s1}
    evals = [r for r in grpo if "heldout_greedy" in r]
    if evals:
        start, end = evals[0], evals[-1]
        out["grpo"] = {"start_step": start["step"], "end_step": end["step"],
                       **{f"{when}_{k}": r.get(f"heldout_{m}") for when, r in (("start", start), ("end", end))
                          for k, m in (("greedy", "greedy"), ("sampled", "reward"), ("strict", "strict"),
                                       ("lenient", "lenient"))},
                       "gain_greedy": end["heldout_greedy"] - start["heldout_greedy"],
                       "gain_sampled": end["heldout_reward"] - start["heldout_reward"],
                       "steps": max((r["step"] for r in grpo), default=0)}
        with open(log) as f:  # the stage's closing line: the steps it ran and its minutes (start-up included)
            done = re.findall(r"GRPO (done|stopped): (\d+) steps in ([\d.]+) min", f.read())
        if done:
            out["grpo"].update(steps=int(done[-1][1]), stage_minutes=float(done[-1][2]))
            out["stopped"] = stopped or done[-1][0] == "stopped"
        (_, e0), (_, e1) = first_last(grpo, "frac_equal_groups")
        out["grpo"].update(frac_equal_groups_first=e0, frac_equal_groups_last=e1)
    return out


def pct(x):
    return "-" if x is None else f"{100 * x:.1f}"


def report(rows, path, note=""):
    lines = [("| family | variant | SFT greedy before -> after (%) | GRPO start greedy / sampled (%) | GRPO end "
              "greedy / "
              "sampled (%) | gain greedy / sampled (points) | GRPO steps (last eval) | GRPO minutes | equal-reward "
              "groups first -> last log (%) |"),
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        g = r.get("grpo")
        if not g:
            lines.append(f"| {r['family']} | {r.get('variant', 'defaults')} | failed: "
                         f"{r.get('failed', 'no held-out evaluation')} |||||||")
            continue
        lines.append(f"| {r['family']} | {r.get('variant', 'defaults')} | {pct(r['sft']['greedy_before'])} -> "
                     f"{pct(r['sft']['greedy_after'])} | "
                     f"{pct(g['start_greedy'])} / {pct(g['start_sampled'])} | {pct(g['end_greedy'])} / "
                     f"{pct(g['end_sampled'])} | {100 * g['gain_greedy']:+.1f} / {100 * g['gain_sampled']:+.1f} | "
                     f"{g['steps']} ({g['end_step']}){' stopped' if r['stopped'] else ''} | "
                     f"{r['grpo_seconds'] / 60:.1f} | {pct(g['frac_equal_groups_first'])} -> "
                     f"{pct(g['frac_equal_groups_last'])} |")
    shared = sorted({r.get("jobs", 1) for r in rows} - {1})
    if shared:
        lines.append(f"\nGRPO minutes with {' or '.join(map(str, shared))} GRPO runs side by side on the one GPU (--jobs).")
    lines += [f"\n{note}"] if note else []
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    return "\n".join(lines)


def pick(rows, kinds, tuned, margin=0.01):
    """The tuning wave's rule: the variant with the highest mean held-out greedy gain over the tuning families (a
    row on each), unless it beats 'defaults' by under `margin` -> ((name, args), {variant: mean gain})."""
    gains = {}
    for r in rows:
        if "grpo" in r and "failed" not in r and r["family"] in tuned:
            gains.setdefault(r["variant"], {})[r["family"]] = r["grpo"]["gain_greedy"]
    mean = {v: sum(g.values()) / len(g) for v, g in gains.items() if set(g) == set(tuned)}
    best = max(mean, key=mean.get, default="defaults")
    if best != "defaults" and mean[best] < mean.get("defaults", -math.inf) + margin:
        best = "defaults"
    return (best, dict(kinds)[best]), mean


def variants(spec):
    """--variants 'name:--key=value ...;name2:...' -> [(name, [args])]; "" -> [("defaults", [])]."""
    out = []
    for part in filter(None, (x.strip() for x in spec.split(";"))):
        name, colon, args = part.partition(":")
        if not colon or not re.fullmatch(r"[a-z0-9_]+", name) or name in {n for n, _ in out}:
            raise SystemExit(f"--variants: {part!r} is not 'name:--key=value ...' with a new name of a-z, 0-9, _")
        out.append((name, args.split()))
    return out or [("defaults", [])]


def sft_run(family, n, base, cfgs, common, a):
    """SFT of one family from base -> (return code, its run folder, its command)."""
    here, sft_dir = os.path.join(a.out, family), os.path.join(a.runs, f"sft_{family}")
    os.makedirs(here, exist_ok=True)
    args = [*cfgs["sft"], f"--init_from={base}", f"--out_dir={sft_dir}", *task_keys(family, cfgs),
            f"--eval_tokens={n}", *common, *a.sft.split()]
    rc = stage(f"{family} sft", ["sft.py", *args], os.path.join(here, "sft.log"))[0]
    return rc, sft_dir, f"python sft.py {' '.join(args)}"


def task_keys(family, cfgs):
    return [f"--task={family}", f"--task_args={json.dumps(settings(family, cfgs))}"]


def grpo_run(family, variant, n, sft, cfgs, common, a, minutes):
    """GRPO of one family and variant from its SFT (max_minutes: the wave's), its curves -> its row."""
    (name, extra), (rc, sft_dir, sft_command) = variant, sft
    suffix = "" if name == "defaults" else f"_{name}"
    here, grpo_dir = os.path.join(a.out, family), os.path.join(a.runs, f"grpo_{family}{suffix}")
    os.makedirs(here, exist_ok=True)
    args = [*cfgs["grpo"], f"--init_from={sft_dir}", f"--out_dir={grpo_dir}", *task_keys(family, cfgs),
            f"--max_new_tokens={n}", *([f"--max_steps={a.grpo_steps}"] if a.grpo_steps else []),
            *([f"--max_minutes={minutes:g}"] if minutes else []), *common,
            *a.grpo.split(), *extra]
    commands = {"sft": sft_command, "grpo": f"python grpo.py {' '.join(args)}"}
    log = os.path.join(here, f"grpo{suffix}.log")
    rc, seconds, stopped = stage(f"{family} grpo{suffix}", ["grpo.py", *args], log, minutes and minutes + 5) if not rc \
        else (rc, 0.0, False)
    try:
        r = row(family, sft_dir, grpo_dir, log, seconds, stopped, n, commands)
        for s, d in (("sft", sft_dir), (f"grpo{suffix}", grpo_dir)):
            shutil.copy(os.path.join(d, "train_metrics.jsonl"), os.path.join(here, f"{s}_metrics.jsonl"))
    except (OSError, ValueError, KeyError, TypeError) as e:
        r = {"family": family, "failed": f"rc {rc}: {e}", "commands": commands}
    if rc:
        r["failed"] = f"rc {rc}"
    r.update(variant=name, variant_args=extra, jobs=a.jobs)
    if "grpo" in r:
        stage(f"{family} plot{suffix}", ["-m", "tools.plots", "--grpo", grpo_dir,
                                         f"--out={os.path.join(here, f'grpo{suffix}.png')}"],
              os.path.join(here, f"plot{suffix}.log"))
    return r


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="where the logs, metrics, rows, report and curves go")
    p.add_argument("--base", default="", help="a pretrained run folder (default: pretrain configs/life.py, tiny: "
                   "configs/tiny.py, into <runs>/base first)")
    p.add_argument("--runs", default="out/families", help="the folder the stages' out_dirs go under (checkpoints)")
    p.add_argument("--families", default="", help="comma-separated task names (any of tasks.TASKS; default: "
                   f"{','.join(FAMILIES)}, less --tune's)")
    p.add_argument("--tune_minutes", type=float, default=None, help="the tuning wave's --minutes (default: --minutes)")
    p.add_argument("--tune", default="", help="families to pick a variant on first (pick()); --families are then "
                   "judged with defaults and that variant")
    p.add_argument("--minutes", type=float, default=10.0, help="each GRPO run's --max_minutes (0: none)")
    p.add_argument("--grpo_steps", type=int, default=0, help="GRPO's max_steps (0: the config's)")
    p.add_argument("--sft", default="", help="--key=value for SFT (space separated)")
    p.add_argument("--grpo", default="", help="--key=value for GRPO (space separated)")
    p.add_argument("--variants", default="", help="GRPO variants from each family's one SFT, each a row: "
                   "'name:--key=value ...;name2:...' on top of --grpo (default: one, 'defaults')")
    p.add_argument("--jobs", type=int, default=1, help="families run side by side on the one GPU (their minutes then "
                   "share it: a cap met side by side is met alone; step times are not comparable). Four life-shape "
                   "GRPO runs held 16-24 GiB each and one ran out of memory on an 80 GB H100: there, add "
                   "--grpo=--micro_batch_size=128 (the same steps, in more micro-batches)")
    p.add_argument("--stages", default="sft,grpo", choices=("sft,grpo", "sft", "grpo"),
                   help="sft: stop after the SFTs; grpo: GRPO from the SFT runs already under --runs")
    p.add_argument("--tiny", action="store_true", help="CPU smoke run: configs/tiny.py, sft_tiny.py, grpo_tiny.py")
    a = p.parse_args(argv)
    cfgs, common = (TINY if a.tiny else FULL), ["--overwrite=True", "--progress=False"]
    tuned, kinds = [f for f in a.tune.split(",") if f], variants(a.variants)  # bad input: before any work
    families = [f for f in (a.families or ",".join(f for f in FAMILIES if f not in tuned)).split(",") if f]
    if set(tuned) & set(families):
        raise SystemExit(f"--tune: {', '.join(sorted(set(tuned) & set(families)))} also in --families: a family tuned "
                         "on is not judged")
    if tuned and "defaults" not in dict(kinds):
        kinds = [("defaults", []), *kinds]  # the rule's baseline
    from posttrain import tasks
    for f in tuned + families:
        try:
            tasks.get(f, settings(f, cfgs))
        except tasks.TaskError as e:
            raise SystemExit(f"--families: {e}") from None
    everyone = tuned + families
    base, sft_dirs = a.base, {f: os.path.join(a.runs, f"sft_{f}") for f in everyone}
    missing = [f for f in everyone if a.stages == "grpo" and not os.path.isfile(os.path.join(sft_dirs[f], "train_metrics.jsonl"))]
    if missing:
        raise SystemExit(f"--stages=grpo: no SFT run of {', '.join(missing)} under {a.runs}: run --stages=sft first")
    os.makedirs(a.out, exist_ok=True)
    if not base:
        base = os.path.join(a.runs, "base")
        if a.stages != "grpo" and stage("pretrain", ["pretrain.py", *cfgs["pretrain"], f"--out_dir={base}", *common],
                 os.path.join(a.out, "pretrain.log"))[0]:
            raise SystemExit("pretraining failed")
    lengths = {f: new_tokens(f, base, settings(f, cfgs)) for f in everyone}
    with ThreadPoolExecutor(max_workers=max(1, a.jobs)) as pool:  # each thread waits on its stage
        if a.stages == "grpo":
            sfts = {f: (0, sft_dirs[f], "(an earlier call's SFT: its sft.log)") for f in everyone}
        else:
            sfts = dict(zip(everyone, pool.map(lambda f: sft_run(f, lengths[f], base, cfgs, common, a), everyone)))
        if a.stages == "sft":
            bad = [f for f, (rc, _, _) in sfts.items() if rc]
            raise SystemExit(f"SFT failed: {', '.join(bad)}" if bad else 0)

        def wave(fams, ks, name):
            out = []
            minutes = a.minutes if name != "tune" or a.tune_minutes is None else a.tune_minutes
            runs = [(f, v) for f in fams for v in ks]
            for r in pool.map(lambda j: grpo_run(j[0], j[1], lengths[j[0]], sfts[j[0]], cfgs, common, a, minutes), runs):
                out.append({**r, "jobs": min(a.jobs, len(runs)), **({"wave": name} if name else {})})
                with open(os.path.join(a.out, "rows.jsonl"), "a") as f:  # appended: several calls add up
                    f.write(json.dumps(out[-1]) + "\n")
            return out
        if tuned:
            chosen, means = pick(wave(tuned, kinds, "tune"), kinds, tuned)
            with open(os.path.join(a.out, "pick.json"), "w") as f:
                json.dump({"tuned_on": tuned, "mean_gain_greedy": means, "picked": chosen[0], "args": chosen[1]}, f)
            print(f"picked {chosen[0]!r} on {', '.join(tuned)}: mean greedy gains {json.dumps(means)}", flush=True)
            kinds = [("defaults", []), *([chosen] if chosen[0] != "defaults" else [])]
        wave(families, kinds, "judge" if tuned else "")
    rows = list({(r["family"], r.get("variant", "defaults")): r  # each family and variant's latest
                 for r in records(os.path.join(a.out, "rows.jsonl"))}.values())
    runs = [r["grpo_dir"] for r in rows if "grpo" in r and os.path.isdir(r["grpo_dir"])]
    if runs:
        stage("curves", ["-m", "tools.plots", "--grpo", *runs, f"--out={os.path.join(a.out, 'curves.png')}"],
              os.path.join(a.out, "plot.log"))
    note = ""
    if os.path.isfile(os.path.join(a.out, "pick.json")):
        with open(os.path.join(a.out, "pick.json")) as f:
            k = json.load(f)
        note = (f"Tuned on {', '.join(k['tuned_on'])}: picked {k['picked']} (the highest mean greedy gain, "
                f"{', '.join(f'{v} {100 * g:+.1f}' for v, g in k['mean_gain_greedy'].items())}; defaults unless a "
                f"point better); the others judged with defaults{'' if k['picked'] == 'defaults' else ' and it'}.")
    print(report(rows, os.path.join(a.out, "report.md"), note))
    if any("failed" in r for r in rows):
        raise SystemExit("some families failed: " + ", ".join(r["family"] for r in rows if "failed" in r))


if __name__ == "__main__":
    main()
