"""The race to a loss (issue 56): nanoGPT's own GPT-2 recipe, then ingot's configs/speedrun.py, on one GPU.

    python bench/speedrun.py --nanogpt=/path/to/nanoGPT [--nanogpt_tokens=150e6] [--results=<dir>]
    python bench/speedrun.py --nanogpt=... --rows=ingot --ablate=muon,qk_norm --seeds=3 --cap_gib=24  # more rows
    python bench/speedrun.py --nanogpt=... --rows=ingot --ablate=wsd --nanogpt_from=<results>/nanogpt  # a later call
    python bench/speedrun.py --nanogpt=... --tiny                                           # CPU smoke test

Each row is a child process run as a user runs it; its result is kept in OUT/<row>/result.json and reused by a
later call with the same setup (a race may span calls; --fresh runs it again). nanogpt: `python train.py
config/train_gpt2.py OUT/nanogpt/race.py` in the checkout (never copied): GPT-2 124M, AdamW 6e-4 (0.9, 0.95),
weight decay 0.1, 491,520 tokens a step, bf16, compiled; race.py only cuts it to --nanogpt_tokens (cosine over
all of it, warmup at llm.c's GPT-2 share, 700 of 19,073 steps), points it at the data and prints its peak
memory. Its final model scored on the held-out windows is the target L. ingot: `pretrain.py configs/speedrun.py
--max_steps=m --target_loss=L --eval_every=k` (m: its schedule spans --ingot_share of nanoGPT's tokens, 1/3;
k times L within --resolution for a run --goal times nanoGPT's speed);
ingot-no-<name>: an --ablate technique off (TECHNIQUES); ingot-seed<n>: --seeds more runs of ingot's row, the
spread an ablation's cost must clear; ingot-<cap>gib: under set_per_process_memory_fraction with what its own
--gpu_memory plan adds, beside the peak that plan predicts.
Same tokens: the config's corpus and tokenizer (cl100k_base cut to 50,257 ids: offline, below nanoGPT's uint16
limit), tokenized once (corpora/prepare.py); nanoGPT reads that train.bin, in its own order (random offsets
from torch's generator; ingot: a seeded permutation of windows: another order would mean patching train.py).
Same held-out tokens: the validation split's first --eval_windows windows, nanoGPT's val.bin exactly, both
scored as the mean loss over their tokens. Time to L is training time: the first step (compilation) counted at
the median step, its excess reported as warm-up; evaluations and checkpoints left out (nanoGPT's evaluating
steps at the median step). Also: tokens, tokens/s, MFU, peak memory, wall time; OUT/speedrun.json, and
OUT/speedrun.png (held-out loss against training time and against tokens).
"""
import argparse
import ast
import hashlib
import json
import math
import os
import pickle
import re
import runpy
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import asdict

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import data
import parallel
import tokenizer
from corpora import prepare
from model import ModelConfig, round_up

CONFIG = "configs/speedrun.py"
LINES = re.MULTILINE  # ^ and $ at each line of a log
# --ablate=<name>: the keys that switch a technique of configs/speedrun.py off (GPT-2's or nanoGPT's choice)
TECHNIQUES = {
    "muon": {"optimizer": "adamw"},          # AdamW everywhere, at the config's lr
    "qk_norm": {"qk_norm": False},
    "untied_head": {"tie_embeddings": True},
    "rope": {"pos_emb": "learned"},
    "rmsnorm": {"norm": "layernorm"},
    "bf16_residual": {"fp32_residual": True},
    "wsd": {"schedule": "cosine"},
    "compile": {"compile": False},
    "logit_softcap": {"logit_softcap": 0.0},
    "value_embeds": {"value_embeds": 0},
    "unet_skips": {"unet_skips": False},
    "fp8_head": {"fp8_head": False},
}
TINY_INGOT = ["--n_layer=2", "--n_head=2", "--n_embd=64", "--value_embeds=1", "--block_size=64", "--batch_size=16",
              "--micro_batch_size=8", "--compile=False", "--warmup_steps=3", "--tokenizer_vocab=2048",
              "--max_docs=200"]
TINY_NANOGPT = {"n_layer": 2, "n_head": 2, "n_embd": 64, "batch_size": 8, "gradient_accumulation_steps": 2,
                "device": "cpu", "compile": False, "dtype": "float32"}
# appended to nanoGPT's race.py: it observes only (the process's peak memory, printed at exit for this script)
PEAK_HOOK = """import atexit as _atexit, resource as _resource
def _peak():
    gb = (torch.cuda.max_memory_allocated() / 1e9 if torch.cuda.is_available() else
          _resource.getrusage(_resource.RUSAGE_SELF).ru_maxrss / 1e6)
    print(f'speedrun: peak memory {gb:.4f} GB', flush=True)
_atexit.register(_peak)"""
# a capped row's child: pretrain.py run as a user runs it, after the cap (bench_sft_memory.py's way)
CHILD = ("import runpy, sys, torch\n"
         "gib = float(sys.argv[1]); sys.argv = sys.argv[2:]\n"
         "if gib and torch.cuda.is_available():\n"
         "    total = torch.cuda.get_device_properties(0).total_memory\n"
         "    torch.cuda.set_per_process_memory_fraction(min(1.0, gib * 2**30 / total))\n"
         "runpy.run_path(sys.argv[0], run_name='__main__')\n")


def overrides(items):
    """['--k=v', ...] -> {k: value} (a Python literal where it parses, else the text)."""
    out = {}
    for a in items:
        k, _, v = a[2:].partition("=")
        try:
            out[k] = ast.literal_eval(v)
        except (ValueError, SyntaxError):
            out[k] = v
    return out


def ingot_settings(args, extra=()):
    """The ingot run's values of the keys the race reads: the defaults, configs/speedrun.py, then the overrides."""
    values = {**asdict(ModelConfig()), **data.DATA_DEFAULTS, **tokenizer.TOKENIZER_DEFAULTS,
              **parallel.PARALLEL_DEFAULTS}
    values.update({k: v for k, v in runpy.run_path(os.path.join(ROOT, CONFIG)).items()
                   if not k.startswith("_") and not callable(v) and type(v).__name__ != "module"})
    return {**values, **overrides(ingot_args(args) + list(extra))}


def ingot_args(args):
    return (TINY_INGOT if args.tiny else []) + shlex.split(args.ingot_args)


def run_logged(cmd, log_path, env=None, cwd=ROOT, show=lambda line: True):
    """Run cmd, its output into log_path (and the lines `show` picks to stdout); (exit code, wall seconds)."""
    t0 = time.perf_counter()
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    with open(log_path, "w") as log:
        p = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             start_new_session=True)
        try:
            for line in p.stdout:
                log.write(line)
                if show(line):
                    print("  | " + line, end="", flush=True)
            rc = p.wait()
        except BaseException:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
            raise
    return rc, time.perf_counter() - t0


def tail(path, n=15):
    with open(path) as f:
        return "".join(f.readlines()[-n:])


def commit(where):
    r = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=where, capture_output=True, text=True, check=False)
    return r.stdout.strip() or None


def checksum(folder, names):
    h = hashlib.sha256()
    for name in names:
        with open(os.path.join(folder, name), "rb") as f:
            h.update(f.read())
    return h.hexdigest()[:16]


def cached(path, setup, fresh):
    """A row's result.json when it was measured with this setup (and --fresh is off), else None."""
    if fresh or not os.path.exists(path):
        return None
    with open(path) as f:
        res = json.load(f)
    return res if res.get("setup") == setup else None


WHERE = {"knobs": ("out_dir", "dataset"), "race": ("data_dir", "nano_dir")}  # where a call ran, not what it ran


def setup_differs(saved, setup):
    """The keys in which an earlier call's nanoGPT setup differs from this one's, its paths left out."""
    def what(s):
        return {f"{part}.{k}" if k else part: v for part, d in s.items()
                for k, v in (d.items() if isinstance(d, dict) else [("", d)]) if k not in WHERE.get(part, ())}
    a, b = what(saved), what(setup)
    return sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))


def save_json(path, obj):
    with open(path, "w") as f:
        json.dump(obj, f, indent=1)

# ---------------------------------------------------------------------------- the data, once for both


def prepare_race(args):
    """The corpus tokenized once (the config's data keys and tokenizer), the held-out windows, and nanoGPT's
    data folder: train.bin linked to ours, val.bin the held-out windows' tokens, meta.pkl its vocab_size."""
    cfg = ingot_settings(args)
    vocab, T = cfg["tokenizer_vocab"], cfg["seq_len"] or cfg["block_size"]
    if not 0 < vocab <= 1 << 16:
        raise SystemExit(f"tokenizer_vocab={vocab}: nanoGPT reads uint16 token files, so the race needs a vocabulary "
                         f"cut below 65,536 ids (configs/speedrun.py: tokenizer_vocab=50257)")
    tok = tokenizer.get_tokenizer(cfg["tokenizer"], vocab)
    settings = prepare.data_settings(argparse.Namespace(**cfg))
    data_dir = os.path.abspath(args.data_dir or cfg["data_dir"] or
                               prepare.default_data_dir(cfg["data"], tok.name, vocab, **settings))
    meta = prepare.prepare(cfg["data"], tok, data_dir, **settings)
    val = np.memmap(os.path.join(data_dir, "val.bin"), dtype=meta["dtype"], mode="r")
    n = min(args.eval_windows, (len(val) - 1) // T)
    if n < args.eval_windows:
        print(f"held-out: the validation split holds {n} windows of {T} tokens, not --eval_windows={args.eval_windows}")
    nano = os.path.join(args.out, "nanogpt_data")
    os.makedirs(nano, exist_ok=True)
    link = os.path.join(nano, "train.bin")
    if os.path.islink(link) or os.path.exists(link):
        os.remove(link)
    os.symlink(os.path.join(data_dir, "train.bin"), link)
    np.asarray(val[:n * T + 1], dtype=np.uint16).tofile(os.path.join(nano, "val.bin"))
    with open(os.path.join(nano, "meta.pkl"), "wb") as f:  # padded as nanoGPT pads GPT-2's 50,257 to 50,304
        pickle.dump({"vocab_size": round_up(vocab, 64)}, f)
    race = {"data_dir": data_dir, "nano_dir": nano, "T": T, "windows": n, "vocab": vocab, "tokenizer": tok.name,
            "n_train": meta["n_train"], "n_val": meta["n_val"], "fingerprint": meta["fingerprint"]}
    print(f"data: {cfg['data']} in {data_dir}: {meta['n_train']:,} train tokens ({tok.name}); held out: the first {n} "
          f"windows of {T} tokens = {n * T:,} tokens of the validation split")
    return race

# ---------------------------------------------------------------------------- scoring a model on the held-out windows


def score_main(a):
    """The `score` subcommand (a child process, so the race's own process never holds the GPU): each held-out
    window's mean loss under a model (nanoGPT's ckpt.pt, or an ingot run folder), with the device's peak."""
    import torch
    import torch.nn.functional as F

    import logs
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if a.kind == "nanogpt":
        import importlib.util
        spec = importlib.util.spec_from_file_location("nanogpt_model", os.path.join(a.nanogpt, "model.py"))
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        ck = torch.load(a.path, map_location="cpu", weights_only=True)
        net = mod.GPT(mod.GPTConfig(**ck["model_args"]))
        net.load_state_dict({k.removeprefix("_orig_mod."): v for k, v in ck["model"].items()})
        net = net.to(dev).eval()

        def losses(x, y):
            logits = net(x, y)[0]
            return F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), reduction="none").view(y.shape)
    else:
        import sample
        net = sample.load(a.path, dev)[0]

        def losses(x, y):
            return net(x, y, reduction="none").float()
    amp = torch.autocast("cuda", torch.bfloat16) if dev.type == "cuda" else torch.autocast("cpu", enabled=False)
    per = []
    with torch.no_grad(), amp:
        for x, y in data.eval_batches(a.val, a.batch, a.T, n_batches=math.ceil(a.windows / a.batch), device=dev):
            per += losses(x, y).mean(1).tolist()
    out = {"windows": per[:a.windows], "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
           "peak_tflops": logs.peak_tflops(dev)}
    save_json(a.json, out)


def score(args, race, kind, path, into):
    cmd = [sys.executable, os.path.abspath(__file__), "score", kind, path, f"--val={race['data_dir']}/val.bin",
           f"--windows={race['windows']}", f"--T={race['T']}", f"--nanogpt={args.nanogpt}", f"--json={into}"]
    rc, _ = run_logged(cmd, into + ".log")
    if rc:
        raise SystemExit(f"scoring {path} failed:\n{tail(into + '.log')}")
    with open(into) as f:
        return json.load(f)

# ---------------------------------------------------------------------------- nanoGPT's recipe: the target


def nanogpt_settings(args, race):
    """The race's changes to nanoGPT's config/train_gpt2.py: its length (tokens per step x steps ~ the budget,
    the cosine over all of it, warmup at llm.c's GPT-2 share), the data, the evaluations; --tiny's shapes."""
    knobs = {**(TINY_NANOGPT if args.tiny else {}), **overrides(shlex.split(args.nanogpt_args))}
    per_iter = knobs.get("batch_size", 12) * knobs.get("gradient_accumulation_steps", 40) * race["T"]
    every = max(1, round(args.nanogpt_tokens / per_iter / args.nanogpt_evals))
    iters = every * args.nanogpt_evals  # the last evaluation is the final model's
    knobs.update(block_size=race["T"], max_iters=iters, lr_decay_iters=iters,
                 warmup_iters=max(1, round(iters * 700 / 19073)), eval_interval=every,
                 eval_iters=max(1, math.ceil(race["windows"] / knobs.get("batch_size", 12))),  # ~ the held-out windows
                 log_interval=1, always_save_checkpoint=True, wandb_log=False,
                 out_dir=os.path.join(args.out, "nanogpt"),
                 dataset=race["nano_dir"])  # absolute: train.py's os.path.join('data', dataset) is then dataset
    return knobs, per_iter


def nanogpt_times(text, iters):
    """nanoGPT's log -> (training time after i steps for i = 0..iters, the median step, the compile warm-up, the
    evaluations {step: val loss}, the evaluations' and checkpoints' time). Each step's time is train.py's own dt;
    the first (compilation, and the first evaluation) and the evaluating ones (an evaluation and a checkpoint
    before the step) are counted at the median step."""
    dts = {int(i): float(ms) / 1e3 for i, ms in re.findall(r"^iter (\d+): loss \S+, time ([\d.]+)ms", text, LINES)}
    evals = {int(i): float(v) for i, v in re.findall(r"^step (\d+): train loss \S+, val loss ([\d.]+)", text, LINES)}
    med = statistics.median(dts[i] for i in range(1, iters) if i not in evals)
    at = np.concatenate([[0.0], np.cumsum([med if i == 0 or i in evals else dts[i] for i in range(iters)])])
    extra = [dts[i] - med for i in evals if 0 < i < iters]
    warmup = dts[0] - med - (statistics.median(extra) if extra else 0.0)
    return at, med, warmup, evals, sum(extra)


def nanogpt_row(args, race):
    """nanoGPT's train.py on the race's data for --nanogpt_tokens; L = its final model's held-out loss."""
    out = os.path.join(args.out, "nanogpt")
    os.makedirs(out, exist_ok=True)
    knobs, per_iter = nanogpt_settings(args, race)
    iters = knobs["max_iters"]
    setup = {"knobs": knobs, "race": race, "nanogpt": checksum(args.nanogpt, ("train.py", "model.py"))}
    res = cached(os.path.join(out, "result.json"), setup, args.fresh)
    if res:
        print(f"nanogpt: reusing {out}/result.json (L = {res['L']:.4f}); --fresh runs it again")
        return res
    if args.nanogpt_from:  # an earlier call's row (e.g. a committed race): the same recipe on the same tokens
        with open(os.path.join(args.nanogpt_from, "result.json")) as f:
            res = json.load(f)
        differs = setup_differs(res["setup"], setup)
        if differs:
            raise SystemExit(f"--nanogpt_from={args.nanogpt_from}: its race differs from this one in "
                             f"{', '.join(differs)}: leave --nanogpt_from out to run nanoGPT here")
        shutil.copy(os.path.join(args.nanogpt_from, "windows.json"), os.path.join(out, "windows.json"))
        res.update(setup=setup, reused_from=os.path.abspath(args.nanogpt_from))
        save_json(os.path.join(out, "result.json"), res)
        print(f"nanogpt: from {args.nanogpt_from} (L = {res['L']:.4f}, measured on {res['device']})")
        return res
    with open(os.path.join(out, "race.py"), "w") as f:
        f.write("\n".join(["# the race's changes to config/train_gpt2.py (bench/speedrun.py writes this file)",
                           *(f"{k} = {v!r}" for k, v in knobs.items()), PEAK_HOOK]) + "\n")
    cmd = [sys.executable, "train.py", "config/train_gpt2.py", os.path.join(out, "race.py")]
    print(f"nanogpt: {iters} steps of {per_iter:,} tokens = {iters * per_iter / 1e6:.1f}M tokens "
          f"({iters * per_iter / race['n_train']:.2f} epochs), evaluating every {knobs['eval_interval']}: "
          f"{' '.join(cmd)}", flush=True)
    show = re.compile(r"^(step \d+:|iter \d*0: |speedrun|Traceback|\w*Error)").match
    rc, wall = run_logged(cmd, os.path.join(out, "train.log"), cwd=args.nanogpt, show=show)
    if rc:
        raise SystemExit(f"nanoGPT's train.py failed ({rc}):\n{tail(os.path.join(out, 'train.log'))}")
    with open(os.path.join(out, "train.log")) as f:
        text = f.read()
    at, med, warmup, evals, overhead = nanogpt_times(text, iters)
    peak = re.search(r"^speedrun: peak memory ([\d.]+) GB", text, LINES)
    scored = score(args, race, "nanogpt", os.path.join(out, "ckpt.pt"), os.path.join(out, "windows.json"))
    w = np.array(scored["windows"])
    L = float(w.mean())
    curve = [[i, i * per_iter, float(at[i]), v] for i, v in sorted(evals.items()) if i <= iters]
    curve[-1][3] = L  # the last point: the final model on the held-out windows themselves (not train.py's estimate)
    res = {"row": "nanogpt", "command": " ".join(cmd), "cwd": args.nanogpt, "setup": setup, "L": L,
           "L_se": float(w.std(ddof=1) / math.sqrt(len(w))) if len(w) > 1 else None, "reached": True,
           "time_to_L_s": float(at[iters]), "tokens_to_L": iters * per_iter, "steps_to_L": iters, "warmup_s": warmup,
           "eval_overhead_s": overhead, "tok_s": per_iter / med, "peak_mem_gb": float(peak.group(1)) if peak else None,
           "process_wall_s": wall, "device": scored["device"], "peak_tflops": scored["peak_tflops"],
           "final_val_loss": L, "eval_every": knobs["eval_interval"], "curve": curve}
    res["mfu"] = per_iter / med * gpt2_flops(race, knobs) / (res["peak_tflops"] * 1e12) if res["peak_tflops"] else None
    save_json(os.path.join(out, "result.json"), res)
    print(f"nanogpt: L = {L:.4f} (the final model on the {len(w)} held-out windows, standard error "
          f"{res['L_se'] or 0:.4f}) after {iters} steps, {res['time_to_L_s']:.1f} s of training")
    return res


def gpt2_flops(race, knobs):
    """nanoGPT's model's training FLOPs per token, counted as ours are (model.flops_per_token on its shape)."""
    import torch

    from model import Transformer
    shape = ModelConfig(vocab_size=round_up(race["vocab"], 64), block_size=race["T"], n_layer=knobs.get("n_layer", 12),
                        n_head=knobs.get("n_head", 12), n_embd=knobs.get("n_embd", 768), pos_emb="learned",
                        norm="layernorm", activation="gelu", bias=knobs.get("bias", False), tie_embeddings=True)
    with torch.device("meta"):
        return Transformer(shape).flops_per_token(race["T"])

# ---------------------------------------------------------------------------- ingot's rows: to L


def gpu_plan(base, cap):
    """The command's own --gpu_memory plan for a card of cap GiB: its predicted peak and the keys it adds to fit."""
    r = subprocess.run([sys.executable, *base, f"--gpu_memory={cap}"], cwd=ROOT, capture_output=True, text=True,
                       check=False)
    peaks = re.findall(r"^  (?:peak\s+|\+ .*->\s+)([\d.]+) GiB", r.stdout, LINES)  # the plan's, then each key's
    if r.returncode or not peaks:
        raise SystemExit(f"the --gpu_memory={cap} plan failed:\n{r.stdout[-2000:]}{r.stderr[-2000:]}")
    knobs = re.search(r"^  run with: (.*)$", r.stdout, LINES)
    return {"predicted_peak_gib": float(peaks[-1]), "knobs": knobs.group(1).split() if knobs else [],
            "lines": r.stdout.strip().splitlines()}


def ingot_times(recs, per_step):
    """pretrain.py's metrics -> (training time after s steps for s = 0..n, the median step, the warm-up). With
    log_every=1 each step's tok_s is its tokens / its time, evaluations and checkpoints left out
    (lifecycle.Clock); the first step (compilation) is counted at the median step."""
    step_s = {r["step"]: per_step / r["tok_s"] for r in recs if "tok_s" in r}
    later = [step_s[s] for s in range(2, max(step_s) + 1)]
    med = statistics.median(later or [step_s[1]])
    return np.concatenate([[0.0], np.cumsum([med, *later])]), med, step_s[1] - med


def ingot_row(args, race, nano, name, extra=(), cap=0.0):
    """configs/speedrun.py through pretrain.py until its validation loss <= L (or its max_steps)."""
    out, plan = os.path.join(args.out, name), None
    os.makedirs(out, exist_ok=True)
    more = list(extra)
    if args.ingot_share and "max_steps" not in overrides(ingot_args(args) + more):  # the schedule's length
        per_step = ingot_settings(args, more)["batch_size"] * race["T"]
        more.append(f"--max_steps={math.ceil(args.ingot_share * nano['tokens_to_L'] / per_step)}")
    if cap:
        plan = gpu_plan(["pretrain.py", CONFIG, *ingot_args(args), *more], cap)
        more += plan["knobs"]
        print(f"{name}: the plan for {cap:g} GiB predicts a peak of {plan['predicted_peak_gib']:.2f} GiB"
              + (f" with {' '.join(plan['knobs'])}" if plan["knobs"] else ""))
    cfg = ingot_settings(args, more)
    T, micro, per_step = cfg["seq_len"] or cfg["block_size"], cfg["micro_batch_size"], cfg["batch_size"] * race["T"]
    if T != race["T"] or race["windows"] % micro:
        raise SystemExit(f"{name}: the held-out windows are {race['windows']} of {race['T']} tokens; this row reads "
                         f"{T} and evaluates {micro} at a time: keep block_size and make --eval_windows a multiple")
    # from the earliest step the row may reach L at (--goal times nanoGPT's speed in tokens), an evaluation
    # every `every` steps times it to within --resolution
    every = max(1, int(args.resolution * nano["tokens_to_L"] / args.goal / per_step))
    run = os.path.join(out, "run")
    cmd = ["pretrain.py", CONFIG, *ingot_args(args), *more, f"--out_dir={run}", "--overwrite=True",
           f"--data_dir={race['data_dir']}", f"--target_loss={nano['L']!r}", f"--eval_every={every}",
           f"--eval_batches={race['windows'] // micro}", "--log_every=1", "--progress=False", "--sample_tokens=0",
           "--ckpt_every=0"]
    setup = {"command": cmd, "cap": cap, "L": nano["L"], "race": race}
    res = cached(os.path.join(out, "result.json"), setup, args.fresh)
    if res:
        print(f"{name}: reusing {out}/result.json; --fresh runs it again")
        return res
    bins = [os.path.join(race["data_dir"], f) for f in ("train.bin", "val.bin")]
    stamp = [os.path.getmtime(b) for b in bins]
    print(f"{name}: {' '.join(cmd)}", flush=True)
    show = re.compile(r"^(step \d*0 \| val|step \d*0/|held-out|first step|pretraining|Traceback|\w*Error)").match
    rc, wall = run_logged([sys.executable, *(["-c", CHILD, str(cap)] if cap else []), *cmd],
                          os.path.join(out, "train.log"), show=show)
    if stamp != [os.path.getmtime(b) for b in bins]:
        raise SystemExit(f"{name} prepared the data again: {CONFIG}'s data keys must be the race's")
    if rc:
        log = tail(os.path.join(out, "train.log"), 40)
        res = {"row": name, "setup": setup, "plan": plan, "log_tail": log,
               "error": "out of memory" if "out of memory" in log.lower() else f"exit code {rc}"}
        save_json(os.path.join(out, "result.json"), res)
        print(f"{name}: failed ({res['error']}):\n{log}")
        return res
    with open(os.path.join(run, "train_metrics.jsonl")) as f:
        recs = [json.loads(line) for line in f]
    at, med, warmup = ingot_times(recs, per_step)
    vals = [(r["step"], r["val_loss"]) for r in recs if "val_loss" in r]
    hit = next((s for s, v in vals if s > 0 and v <= nano["L"]), None)
    mfus = [r["mfu"] for r in recs if isinstance(r.get("mfu"), float)]
    res = {"row": name, "command": " ".join(cmd), "setup": setup, "reached": hit is not None, "eval_every": every,
           "warmup_s": warmup, "tok_s": per_step / med, "mfu": statistics.median(mfus) if mfus else None,
           "peak_mem_gb": max(r["mem_gb"] for r in recs if "mem_gb" in r), "process_wall_s": wall, "plan": plan,
           "final_val_loss": vals[-1][1], "curve": [[s, s * per_step, float(at[s]), v] for s, v in vals]}
    if hit:
        prev = max(s for s, _ in vals if s < hit)
        scored = score(args, race, "ingot", run, os.path.join(out, "windows.json"))
        with open(os.path.join(args.out, "nanogpt", "windows.json")) as f:
            d = np.array(scored["windows"]) - np.array(json.load(f)["windows"])  # the same windows, paired
        res.update(device=scored["device"], time_to_L_s=float(at[hit]), tokens_to_L=hit * per_step, steps_to_L=hit,
                   time_bracket_s=[float(at[prev]), float(at[hit])], resolution=float((at[hit] - at[prev]) / at[hit]),
                   final_minus_L=float(d.mean()), paired_se=float(d.std(ddof=1) / math.sqrt(len(d))))
    save_json(os.path.join(out, "result.json"), res)
    print(f"{name}: " + (f"L reached at step {hit}: {res['time_to_L_s']:.1f} s of training, "
                         f"{res['tokens_to_L'] / 1e6:.2f}M tokens" if hit else
                         f"L not reached in {len(at) - 1} steps (final {vals[-1][1]:.4f} > {nano['L']:.4f})"))
    return res

# ---------------------------------------------------------------------------- the report


def seed_spread(rows):
    """ingot's times to L over its seed rows (ingot, ingot-seed<n>) -> (the times, (fastest, slowest) or None)."""
    times = [r["time_to_L_s"] for r in rows if re.fullmatch(r"ingot(-seed\d+)?", r["row"]) and r.get("reached")]
    return times, ((min(times), max(times)) if len(times) > 1 else None)


def against_seeds(t, spread):
    """An ablation row's time to L against ingot's seeds' (fastest, slowest): 'slower' (the technique pays: keep it),
    'faster' (ingot is faster without it: it does not pay in this race) or 'within' (not resolved by this race)."""
    return "slower" if t > spread[1] else "faster" if t < spread[0] else "within"


def report(args, race, rows):
    nano = rows[0]
    print(f"\ntarget L = {nano['L']:.4f}: nanoGPT's final loss on {race['windows']} held-out windows of {race['T']} "
          f"tokens (standard error {nano['L_se'] or 0:.4f})")
    if nano.get("reused_from"):
        print(f"nanoGPT's row is an earlier call's ({nano['reused_from']}, {nano['device']}): its times are not this "
              "call's, so compare ingot's rows with each other; the race itself is one call without --nanogpt_from")
    print("| row | reached | time to L s | ×nanoGPT | tokens to L | ×nanoGPT | warm-up s | tok/s | MFU | peak GB "
          "| wall s |\n|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        if "error" in r:
            print(f"| {r['row']} | {r['error']} |" + " |" * 9)
            continue
        if r["reached"]:
            r["time_ratio"] = r["time_to_L_s"] / nano["time_to_L_s"]
            r["tokens_ratio"] = r["tokens_to_L"] / nano["tokens_to_L"]
        cells = [r["row"], "yes" if r["reached"] else f"no ({r['final_val_loss']:.4f})",
                 f"{r['time_to_L_s']:.1f}" if r["reached"] else "", f"{r['time_ratio']:.3f}" if r["reached"] else "",
                 f"{r['tokens_to_L'] / 1e6:.2f}M" if r["reached"] else "",
                 f"{r['tokens_ratio']:.3f}" if r["reached"] else "", f"{r['warmup_s']:.1f}", f"{r['tok_s']:,.0f}",
                 f"{r['mfu']:.1%}" if r.get("mfu") else "n/a",
                 f"{r['peak_mem_gb']:.2f}" if r.get("peak_mem_gb") is not None else "n/a", f"{r['process_wall_s']:.0f}"]
        print("| " + " | ".join(cells) + " |")
    ours = next((r for r in rows if r["row"] == "ingot" and r.get("reached")), None)
    seeds, spread = seed_spread(rows)
    if spread:
        print(f"ingot over {len(seeds)} seeds: L in {spread[0]:.1f}-{spread[1]:.1f} s of training: an ablation's cost "
              "counts where its time is above the slowest seed's")
    for r in rows[1:]:
        if r.get("reached"):  # a win in time at more tokens shows as a speed-up below 1x in tokens
            cost = f"; {r['time_to_L_s'] / ours['time_to_L_s']:.3f}x ingot's time" if ours and r is not ours else ""
            if spread and r["row"].startswith("ingot-no-"):
                r["against_seeds"] = against_seeds(r["time_to_L_s"], spread)
                cost += {"slower": " (slower than every seed: the technique pays)", "within": " (within the seeds' "
                         "spread)", "faster": " (faster than every seed: the technique does not pay)"}[r["against_seeds"]]
            print(f"{r['row']}: {1 / r['time_ratio']:.2f}x nanoGPT's speed to L in training time, "
                  f"{1 / r['tokens_ratio']:.2f}x in tokens{cost}; final loss - L = {r['final_minus_L']:+.4f} "
                  f"(paired standard error {r['paired_se'] or 0:.4f}); L crossed between {r['time_bracket_s'][0]:.1f} "
                  f"and {r['time_bracket_s'][1]:.1f} s, evaluations {r['resolution']:.1%} of its time to L apart"
                  + ("" if r["resolution"] <= args.resolution else " (above --resolution: raise --goal)"
                     if r["eval_every"] > 1 else " (every step evaluated: smaller steps, --ingot_args=--batch_size=..., "
                     "time it finer)"))
        if r.get("plan"):
            measured = f"{r['peak_mem_gb'] * 1e9 / 2**30:.2f} GiB" if r.get("peak_mem_gb") is not None else "no peak"
            print(f"{r['row']}: the plan predicts {r['plan']['predicted_peak_gib']:.2f} GiB "
                  f"{' '.join(r['plan']['knobs']) or '(no keys added)'}; measured {measured}")
    ingot_device = next((r["device"] for r in rows[1:] if "device" in r), None)  # where nanoGPT's is an earlier call's
    device = ingot_device if nano.get("reused_from") else nano["device"]
    summary = {"commit": commit(ROOT), "date": time.strftime("%Y-%m-%d"), "device": device, "race": race,
               "nanogpt_from": nano.get("reused_from"),
               "L": nano["L"], "L_se": nano["L_se"], "seeds_time_to_L_s": seeds,
               "goal": "ingot's time to L <= 1/3 of nanoGPT's (stretch: 1/5)",
               "rows": [{k: v for k, v in r.items() if k != "setup"} for r in rows]}
    save_json(os.path.join(args.out, "speedrun.json"), summary)
    print(f"results: {os.path.join(args.out, 'speedrun.json')}")
    plot(rows, nano["L"], os.path.join(args.out, "speedrun.png"))
    if args.results:  # the small files (no checkpoints): e.g. a GPU call's $OUT
        for row in ["", *(r["row"] for r in rows)]:
            for name in ("speedrun.json", "speedrun.png", "result.json", "train.log", "race.py", "windows.json",
                         "run/train_metrics.jsonl"):
                if os.path.isfile(os.path.join(args.out, row, name)):
                    os.makedirs(os.path.join(args.results, row, os.path.dirname(name)), exist_ok=True)
                    shutil.copy(os.path.join(args.out, row, name), os.path.join(args.results, row, name))
        print(f"copied the results to {args.results}")


def plot(rows, L, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib)")
        return
    fig, axes = plt.subplots(1, 2, figsize=(13, 5), sharey=True)
    for r in rows:
        if not r.get("curve"):
            continue
        _, tokens, secs, val = zip(*r["curve"])
        lead = r["row"] in ("nanogpt", "ingot")
        for ax, x in zip(axes, (secs, np.array(tokens) / 1e6)):
            ax.plot(x, val, marker="o" if lead else None, ms=3, lw=2 if lead else 1, alpha=1 if lead else 0.6,
                    label=r["row"])
    lo = min([L] + [v for r in rows for *_, v in r.get("curve", [])])
    for ax, label in zip(axes, ("training time, s (compile warm-up, evaluations left out)", "tokens, millions")):
        ax.axhline(L, color="gray", ls="--", lw=1)
        ax.set_xlabel(label)
        ax.set_ylim(lo - 0.05, L + 2.0)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("held-out loss")
    axes[0].legend()
    fig.suptitle(f"time to nanoGPT's final held-out loss L = {L:.4f} (dashed), same tokens")
    fig.savefig(path, dpi=120, bbox_inches="tight")
    print(f"curves: {path}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("what", nargs="?", default="race", choices=["race", "score"])
    p.add_argument("--nanogpt", default=os.environ.get("INGOT_NANOGPT", ""), help="a checkout of karpathy/nanoGPT")
    p.add_argument("--out", default="out/speedrun", help="the rows' runs and results, speedrun.json, speedrun.png")
    p.add_argument("--results", default="", help="also copy the results (not the checkpoints) into this folder")
    p.add_argument("--data_dir", default="", help="the tokenized corpus' folder (default: data/<its settings>)")
    p.add_argument("--rows", default="nanogpt,ingot", help="nanogpt, ingot (any ingot row runs nanogpt first)")
    p.add_argument("--ablate", default="", help=f"techniques switched off in turn: {', '.join(TECHNIQUES)}")
    p.add_argument("--cap_gib", type=float, default=0.0, help="> 0: a row of ingot under this memory cap")
    p.add_argument("--seeds", type=int, default=1, help="> 1: ingot's row at that many seeds (ingot-seed<n> rows): the "
                   "spread of its time to L, which an --ablate row's cost must clear to count")
    p.add_argument("--nanogpt_from", default="", help="an earlier call's nanogpt/ folder (result.json, windows.json; "
                   "e.g. --results'): its L, for ingot's rows (ablations, a cap) without running nanoGPT again")
    p.add_argument("--nanogpt_tokens", type=float, default=150e6, help="nanoGPT's token budget (its steps: rounded)")
    p.add_argument("--nanogpt_evals", type=int, default=12, help="nanoGPT's evaluations (its curve's points)")
    p.add_argument("--nanogpt_args", default="", help="more of nanoGPT's --key=value settings")
    p.add_argument("--ingot_share", type=float, default=1 / 3, help="ingot's schedule (max_steps, so its decay) spans "
                   "this share of nanoGPT's tokens: the goal's; 0 (or --max_steps in --ingot_args): the config's")
    p.add_argument("--ingot_args", default="", help="more pretrain.py --key=value settings for every ingot row")
    p.add_argument("--eval_windows", type=int, default=512, help="held-out windows (of block_size tokens)")
    p.add_argument("--resolution", type=float, default=0.02, help="the time to L within this share")
    p.add_argument("--goal", type=float, default=16.0, help="how many times faster than nanoGPT ingot may be "
                   "(in tokens): sets how often it evaluates (it was 10.6x at 150M tokens, 15.8x at 80M: H100)")
    p.add_argument("--prepare_only", action="store_true", help="tokenize the corpus and stop")
    p.add_argument("--fresh", action="store_true", help="run every row again, cached results or not")
    p.add_argument("--tiny", action="store_true", help="tiny models on the CPU: a smoke test")
    # the score subcommand's (a child of the race)
    p.add_argument("kind", nargs="?", choices=["nanogpt", "ingot"])
    p.add_argument("path", nargs="?")
    p.add_argument("--val", default="")
    p.add_argument("--windows", type=int, default=0)
    p.add_argument("--T", type=int, default=0)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--json", default="")
    args = p.parse_args(argv)
    if args.what == "score":
        return score_main(args)
    if args.tiny:
        args.nanogpt_tokens = min(args.nanogpt_tokens, 40 * 1024)
        args.nanogpt_evals, args.eval_windows = 4, min(args.eval_windows, 64)
    if not all(os.path.isfile(os.path.join(args.nanogpt, f)) for f in ("train.py", "model.py", "configurator.py")):
        raise SystemExit(f"--nanogpt={args.nanogpt!r}: give a checkout of karpathy/nanoGPT (train.py, model.py, "
                         "configurator.py), or set INGOT_NANOGPT")
    args.nanogpt, args.out = os.path.abspath(args.nanogpt), os.path.abspath(args.out)
    unknown = [t for t in filter(None, args.ablate.split(",")) if t not in TECHNIQUES]
    if unknown:
        raise SystemExit(f"--ablate: unknown {unknown}; known: {', '.join(TECHNIQUES)}")
    if args.nanogpt_from and not all(os.path.isfile(os.path.join(args.nanogpt_from, f))
                                     for f in ("result.json", "windows.json")):
        raise SystemExit(f"--nanogpt_from={args.nanogpt_from}: give an earlier race's nanogpt/ folder, with its "
                         "result.json and windows.json (--results copies both)")
    os.makedirs(args.out, exist_ok=True)
    race = prepare_race(args)
    if args.prepare_only:
        return
    rows = [nanogpt_row(args, race)]
    asked = [r for r in args.rows.split(",") if r]
    if "ingot" in asked:
        rows.append(ingot_row(args, race, rows[0], "ingot"))
    seed = ingot_settings(args)["seed"]
    for k in range(1, args.seeds):  # the same row at other seeds (initial weights, data order): its spread
        rows.append(ingot_row(args, race, rows[0], f"ingot-seed{seed + k}", [f"--seed={seed + k}"]))
    for t in filter(None, args.ablate.split(",")):
        rows.append(ingot_row(args, race, rows[0], f"ingot-no-{t}", [f"--{k}={v}" for k, v in TECHNIQUES[t].items()]))
    if args.cap_gib:
        rows.append(ingot_row(args, race, rows[0], f"ingot-{args.cap_gib:g}gib", cap=args.cap_gib))
    report(args, race, rows)


if __name__ == "__main__":
    main()
