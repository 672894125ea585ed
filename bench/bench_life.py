"""A model's life on one GPU, end to end: pretrain -> SFT -> DPO -> GRPO, then one report of it.

    python bench/bench_life.py --out=out/life_report                   # configs/life.py, sft_life, dpo_life, grpo_life
    python bench/bench_life.py --out=/tmp/r --extra="--device=cpu" --pretrain="--max_steps=5 ..."   # a dry run

Each stage runs as its users run it (`python <stage>.py configs/<config>.py`), its output in
<out>/<stage>.log and its metrics copied to <out>/<stage>_metrics.jsonl; then plots.life_report writes
<out>/report.md (held-out metric per stage, before -> after, and the minutes) and <out>/report.png.
--collapse also re-runs the case that collapsed before this recipe existed (a 15-step SFT model on the
Arithmetic task, GRPO at lr 2e-5: the issue's run) with today's defaults.
"""
import argparse
import os
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

STAGES = [("pretrain", "pretrain.py", "configs/life.py", "out/life"),
          ("sft", "sft.py", "configs/sft_life.py", "out/sft_life"),
          ("dpo", "dpo.py", "configs/dpo_life.py", "out/dpo_life"),
          ("grpo", "grpo.py", "configs/grpo_life.py", "out/grpo_life")]


def run(name, script, args, out):
    t = time.perf_counter()
    with open(os.path.join(out, f"{name}.log"), "w") as log:
        r = subprocess.run([sys.executable, os.path.join(ROOT, script), *args], cwd=ROOT, stdout=log,
                           stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    print(f"{name}: rc {r.returncode}, {time.perf_counter() - t:.0f} s", flush=True)
    if r.returncode:
        with open(os.path.join(out, f"{name}.log")) as f:
            print(f.read()[-3000:])
        raise SystemExit(f"{name} failed")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="where the logs, metrics and the report go")
    p.add_argument("--runs", default="out", help="the folder the stages' out_dirs go under")
    p.add_argument("--extra", default="", help="--key=value for every stage (space separated)")
    for name, *_ in STAGES:
        p.add_argument(f"--{name}", default="", help=f"--key=value for {name} only")
    p.add_argument("--collapse", action="store_true", help="also re-run the run that collapsed (see the docstring)")
    a = p.parse_args()
    os.makedirs(a.out, exist_ok=True)
    dirs = {}
    for name, script, cfg, out_dir in STAGES:
        out_dir = os.path.join(a.runs, os.path.basename(out_dir))
        prev = dirs.get({"sft": "pretrain", "dpo": "sft", "grpo": "dpo"}.get(name))
        args = [cfg, f"--out_dir={out_dir}", "--overwrite=True", "--progress=False"] + (
            [f"--init_from={prev}"] if prev else []) + a.extra.split() + getattr(a, name).split()
        run(name, script, args, a.out)
        dirs[name] = out_dir
        shutil.copy(os.path.join(out_dir, "train_metrics.jsonl"), os.path.join(a.out, f"{name}_metrics.jsonl"))
    if a.collapse:  # the collapse: SFT 15 steps on Arithmetic, GRPO lr 2e-5 from there
        sft, grpo = os.path.join(a.runs, "sft_collapse"), os.path.join(a.runs, "grpo_collapse")
        run("sft_collapse", "sft.py", ["configs/sft_small.py", f"--init_from={dirs['pretrain']}", f"--out_dir={sft}",
                                        "--max_steps=15", "--overwrite=True", "--progress=False", "--n_eval=100",
                                        *a.extra.split()], a.out)
        run("grpo_collapse", "grpo.py", ["configs/grpo_small.py", f"--init_from={sft}", f"--out_dir={grpo}",
                                          "--lr=2e-5", "--max_steps=60", "--overwrite=True", "--progress=False",
                                          *a.extra.split()], a.out)
        shutil.copy(os.path.join(grpo, "train_metrics.jsonl"), os.path.join(a.out, "grpo_collapse_metrics.jsonl"))
    from tools import plots
    print(plots.life_report({name: os.path.join(a.out, f"{name}_metrics.jsonl") for name in dirs}, a.out))


if __name__ == "__main__":
    main()
