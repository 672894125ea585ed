"""The manual runs as written, on a fresh copy of the repository: the README's Quick start, then every page.

Proves: every command line of the bash blocks of README.md, each wing's or folder's README.md and
docs/*.md that a CPU machine can run offline runs: the Quick start (README.md's first block) in order
in a scratch copy of the repository, then each page's blocks in order on its own copy of that folder
(as a user follows the Quick start, then any page; two pages at a time), with only shortening
overrides added (--max_steps=2, or the largest --*_every=N the line sets, and a line's --stop_at=1;
evaluation off, --eval_every=0 and SFT's --n_eval=0, which other tests cover; less generated data than
a long run needs: SFT's --n_train=512, DPO's --n_pairs=128, GRPO's --train_prompts=128;
--sample_tokens=0 / --tokens=8 where a sample would be long; eval.py's --bpb_tokens=8192 and
--limit=8; `runs/life.sh` gets --max_steps=2 --eval_every=0, which it hands to every stage; a
config's init_from naming a step folder that 2 steps did not write becomes its run folder), and
exits 0: so no line reuses an out_dir an earlier one filled, and each line's inputs exist when it
runs. A line is passed over only for a reason the test names (it needs GPUs, the network, or a path
the user must fill in), and each page's lines run are counted against RUNS, so a page that stopped
being runnable, or a new page, cannot pass unnoticed.
"""
import concurrent.futures
import glob
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
    ("needs GPUs", r"^(?!python plan\.py).*(configs/(small|gpt2|sft_small|grpo_small|life|sft_life|dpo_life|grpo_life)\.py"
                   r"|out/small\b|--nnodes|bench_life\.py|runs/life\.sh$)"),
    ("needs more processes than this machine's 2 cores run well", r"--nproc_per_node=4"),
    ("needs the network (hub data, object storage)", r"hf:|s3://|--tasks=[^ ]*(hellaswag|arc_|piqa)\b"),
    ("generates 164 x n programs: hours on a CPU", r"humaneval"),
    ("a path the user fills in", r"/path/to/|my\.jsonl|pairs\.jsonl|data/clean/mine|/local/ssd"),
    ("needs a container runtime", r"^docker "),
    ("starts a server that runs until stopped", r"^mlflow ui"),
]
STAGES = ("pretrain.py", "sft.py", "dpo.py", "grpo.py")
# page -> how many of its lines run (the rest are passed over for SKIP's reasons): the Quick start's
# life chain, tiny pretraining and SFT with their samples; then what each page shows on a CPU
RUNS = {
    "README.md": 6,              # runs/life.sh --tiny, a chat with its result; tiny pretraining, a sample; SFT, a chat
    "docs/runs.md": 4,           # --help, a run from the Quick start's weights, stop_at, --resume
    "docs/stages.md": 6,         # LoRA SFT with merge and HF export; DPO x2; GRPO x2; its plot
    "docs/life.md": 0,           # one GPU
    "corpora/README.md": 4,      # own BPE, shards with it, verify, pretraining on them
    "encoders/README.md": 6,     # BERT, T5, T5 SFT, prefix tuning, ALiBi with a window, compare_arch
    "memory/README.md": 1,       # the plan for a GPU you are not on
    "parallelism/README.md": 2,  # TP = 2, resumed under FSDP
    "posttrain/README.md": 2,    # another task, a weighted reward
    "tools/README.md": 9,        # eval x2, plots x2, gradient statistics, heat map, embedding map, MLflow, sweep
    "bench/README.md": 0,        # a table of commands (GPU)
    "docker/README.md": 0,       # needs docker
}


def pages():
    """The manual's pages: README.md, then every folder's README.md and docs/*.md, sorted (in a git checkout,
    the tracked ones: a user's ignored folder, a venv or another project's checkout, is not a page)."""
    found = [os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "*", "README.md"))
             + glob.glob(os.path.join(ROOT, "docs", "*.md"))]
    git = subprocess.run(["git", "-C", ROOT, "ls-files", "-z"], capture_output=True, text=True)
    if git.returncode == 0 and git.stdout:
        tracked = set(git.stdout.split("\0"))
        found = [p for p in found if p in tracked]
    return ["README.md"] + sorted(p for p in found if not p.startswith(("out/", "data/", "tests/")))


def blocks(page):
    """A page's bash blocks, each a list of its lines: continuations joined, comments dropped, in order."""
    text = open(os.path.join(ROOT, page)).read()
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
    """cmd with the shortening overrides added to each stage script, eval.py or runs/life.sh it runs."""
    parts = []
    for piece in cmd.split("&&"):
        words = shlex.split(piece)
        sets = lambda key: any(w.startswith(f"--{key}=") for w in words)  # noqa: E731
        if "--help" in words:
            pass
        elif any(w.endswith("runs/life.sh") for w in words):
            words += ["--max_steps=2", "--eval_every=0"]
        elif any(w.endswith(STAGES) for w in words):
            every = [int(w.split("=")[1]) for w in words if re.fullmatch(r"--\w+_every=\d+", w)]
            sft = any(w.endswith("sft.py") for w in words)
            words += [f"--max_steps={max([2, *every])}", "--progress=False", "--eval_every=0"]
            words += ["--stop_at=1"] if sets("stop_at") else []
            words += ["--n_eval=0", "--n_train=512"] if sft else []
            words += ["--n_pairs=128"] if any(w.endswith("dpo.py") for w in words) else []
            words += ["--train_prompts=128"] if any(w.endswith("grpo.py") for w in words) else []
            words += (["--sample_tokens=0"] if any(w.endswith("pretrain.py") for w in words) else [])
            words += short_init(words, work)
        elif any(w.endswith("eval.py") for w in words):
            words += [] if sets("bpb_tokens") else ["--bpb_tokens=8192"]
            words += [] if sets("limit") else ["--limit=8"]
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
            return ran, skipped, f"line failed ({r.returncode}): {cmd}\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
        ran.append((time.time() - t0, cmd))
    return ran, skipped, None


def runnable(lines):
    """The lines no SKIP pattern passes over."""
    return [c for c in lines if not any(re.search(p, c) for _, p in SKIP)]


def run_page(blocks_, work, env):
    """Every block of a page in order in one folder -> (ran, skipped, failure, seconds)."""
    t0, ran, skipped = time.time(), [], []
    for lines in blocks_:
        r, s, failed = run_block(lines, work, env)
        ran, skipped = ran + r, skipped + s
        if failed:
            return ran, skipped, failed, time.time() - t0
    return ran, skipped, None, time.time() - t0


def test_pages_are_counted():
    """Every page of the manual has its count of runnable lines in RUNS (a new page is added there)."""
    assert sorted(pages()) == sorted(RUNS), "the pages and RUNS differ: add a new page's count to RUNS"
    for page in pages():
        lines = runnable([c for b in blocks(page) for c in b])
        assert len(lines) == RUNS[page], (page, lines)


def test_manual_commands_run_in_order(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")}  # python, torchrun
    if shutil.which("torchrun", path=env["PATH"]) is None:
        pytest.skip("torchrun is not on PATH")
    work = tmp_path / "repo"
    shutil.copytree(ROOT, work, ignore=shutil.ignore_patterns(".git", "out", "data", "__pycache__", ".old", ".whl"))
    quick, *rest = blocks("README.md")
    ran, skipped, failed, seconds = run_page([quick], work, env)  # the Quick start
    assert failed is None, f"README.md (Quick start): {failed}"
    assert len(ran) == len(runnable(quick)), ran
    took, count = {"README.md (Quick start)": (seconds, len(ran))}, {"README.md": len(ran)}
    jobs = [("README.md", rest)] + [(page, blocks(page)) for page in pages() if page != "README.md"]
    copies = []
    for i, (page, bl) in enumerate(jobs):  # each page on its own copy of the Quick start's folder
        lines = runnable([c for b in bl for c in b])
        if lines:  # (its cost guessed: a line, two for a torchrun or a sweep; the longest pages start first)
            cost = sum(1 + ("torchrun" in c or "sweep" in c) for c in lines)
            copies.append((cost, page, bl, shutil.copytree(work, tmp_path / f"page{i}", symlinks=True)))
    copies.sort(key=lambda c: -c[0])
    with concurrent.futures.ThreadPoolExecutor(2) as pool:  # two pages at a time: the 2 cores
        results = list(pool.map(lambda job: (job[1], *run_page(job[2], job[3], env)), copies))
    for page, r, s, failed, seconds in results:
        assert failed is None, f"{page}: {failed}"
        ran, skipped, took[page] = ran + r, skipped + s, (seconds, len(r))
        count[page] = count.get(page, 0) + len(r)
    for seconds, cmd in ran:
        print(f"{seconds:6.1f} s  {cmd}")  # (pytest -s: where the test's time goes)
    for page, (seconds, n) in took.items():
        print(f"{seconds:6.1f} s  {n:2d} lines  {page}")
    assert count == {page: n for page, n in RUNS.items() if n}, (count, skipped)  # each page ran what it should
