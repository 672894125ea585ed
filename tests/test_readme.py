"""The README runs as written, on a fresh copy of the repository: the Quick start, then each section.

Proves: every command line of the README's bash blocks that a CPU machine can run offline runs:
the Quick start's in order in a scratch copy of the repository, then each later block's in order on
its own copy of that folder (as a user follows the Quick start, then any section; two sections at a
time), with only shortening overrides added (--max_steps=2, or the largest --*_every=N the line
sets; evaluation off, --eval_every=0 and SFT's --n_eval=0, which other tests cover; less generated
data than a long run needs: SFT's --n_train=512, DPO's --n_pairs=128, GRPO's --train_prompts=128;
--sample_tokens=0 / --tokens=8 where a sample would be long; a config's init_from naming a step
folder that 2 steps did not write becomes its run folder), and exits 0: so no line reuses an
out_dir an earlier one filled, and each line's inputs exist when it runs. A line is passed over only
for a reason the test names (it needs GPUs, the network, or a path the user must fill in), and the
lines run are counted, so a README that stopped being runnable cannot pass for one.
"""
import concurrent.futures
import os
import re
import shlex
import shutil
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SKIP = [  # (reason, pattern of the line): what a CPU machine without network cannot run as written
    ("installs packages", r"^pip "),
    ("runs the whole test suite", r"pytest"),
    ("needs GPUs", r"configs/(small|gpt2|sft_small|grpo_small|life|sft_life|dpo_life|grpo_life)\.py|out/small\b|--nnodes"
                   r"|bench_life\.py"),
    ("needs more processes than this machine's 2 cores run well", r"--nproc_per_node=4"),
    ("needs the network (hub data, object storage)", r"hf:|s3://|--tasks=[^ ]*(hellaswag|arc_|piqa)\b|humaneval"),
    ("a path the user fills in", r"/path/to/|my\.jsonl|pairs\.jsonl|data/clean/mine|data/shards/mine|/local/ssd"),
    ("sends a signal", r"^kill "),
    ("starts a server that runs until stopped", r"^mlflow ui"),
]
STAGES = ("pretrain.py", "sft.py", "dpo.py", "grpo.py")


def blocks():
    """The README's bash blocks, each a list of its lines: continuations joined, comments dropped, in order."""
    text = open(os.path.join(ROOT, "README.md")).read()
    out = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        lines = []
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split("  #")[0].strip() if not line.lstrip().startswith("#") else ""
            if line:
                lines.append(re.sub(r"\s+", " ", line))
        out.append(lines)
    return out


def short_init(words, work):
    """[--init_from=<run folder>] where the line's config starts from a step folder (run/step_N) that
    the shortened earlier run did not write; [] otherwise."""
    cfgs = [w for w in words if w.startswith("configs/") and w.endswith(".py")]
    if not cfgs or any(w.startswith("--init_from") for w in words):
        return []
    keys = {}
    exec(open(os.path.join(work, cfgs[0])).read(), {}, keys)
    init = str(keys.get("init_from", ""))
    step = re.fullmatch(r"(.+)/step_\d+", init)
    return [f"--init_from={step.group(1)}"] if step and not os.path.isdir(os.path.join(work, init)) else []


def with_steps(cmd, work):
    """cmd with the step-count override added to each stage script it runs (`a && b` too)."""
    parts = []
    for piece in cmd.split("&&"):
        words = shlex.split(piece)
        if any(w.endswith(STAGES) for w in words):
            every = [int(w.split("=")[1]) for w in words if re.fullmatch(r"--\w+_every=\d+", w)]
            sft = any(w.endswith("sft.py") for w in words)
            words += [f"--max_steps={max([2, *every])}", "--progress=False", "--eval_every=0"]
            words += ["--n_eval=0", "--n_train=512"] if sft else []
            words += ["--n_pairs=128"] if any(w.endswith("dpo.py") for w in words) else []
            words += ["--train_prompts=128"] if any(w.endswith("grpo.py") for w in words) else []
            words += (["--sample_tokens=0"] if any(w.endswith("pretrain.py") for w in words) else [])
            words += short_init(words, work)
        elif any(w.endswith("sample.py") for w in words):
            words += ["--tokens=8"]
        parts.append(" ".join(shlex.quote(w) for w in words))
    return " && ".join(parts)


def run_block(lines, work, env):
    """Run a block's lines in order in the folder work -> ([(seconds, line)] run, [(line, reason)] passed
    over, the first failure's message or None)."""
    ran, skipped = [], []
    for cmd in lines:
        why = next((reason for reason, pat in SKIP if re.search(pat, cmd)), None)
        if why:
            skipped.append((cmd, why))
            continue
        line = with_steps(cmd, work).replace("python ", f"{sys.executable} ")
        t0 = time.time()
        r = subprocess.run(line, shell=True, cwd=work, env=env, capture_output=True, text=True, timeout=900)
        if r.returncode:
            return ran, skipped, f"README line failed ({r.returncode}): {cmd}\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
        ran.append((time.time() - t0, cmd))
    return ran, skipped, None


def test_readme_commands_run_in_order(tmp_path):
    if shutil.which("torchrun") is None:
        pytest.skip("torchrun is not on PATH")
    work = tmp_path / "repo"
    shutil.copytree(ROOT, work, ignore=shutil.ignore_patterns(".git", "out", "data", "__pycache__", ".old", ".whl"))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    first, *rest = blocks()
    ran, skipped, failed = run_block(first, work, env)  # the Quick start
    assert failed is None, failed
    copies = []
    for i, lines in enumerate(rest):  # each later section on its own copy of the Quick start's folder
        runs = [cmd for cmd in lines if not any(re.search(pat, cmd) for _, pat in SKIP)]
        if runs:  # (its cost guessed: a line, two for a torchrun or a sweep; the longest sections start first)
            cost = sum(1 + ("torchrun" in cmd or "sweep.py" in cmd) for cmd in runs)
            copies.append((cost, lines, shutil.copytree(work, tmp_path / f"block{i + 1}", symlinks=True)))
    copies = [(lines, folder) for _, lines, folder in sorted(copies, key=lambda c: -c[0])]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:  # two sections at a time: the 2 cores
        results = list(pool.map(lambda job: run_block(job[0], job[1], env), copies))
    for r, s, f in results:
        assert f is None, f
        ran, skipped = ran + r, skipped + s
    for seconds, cmd in ran:
        print(f"{seconds:6.1f} s  {cmd}")  # (pytest -s: where the test's time goes)
    assert len(ran) >= 12, (ran, skipped)  # the tiny path: pretrain, sample, SFT, chat, DPO x2, GRPO x2, eval, plots
