"""Context extension of a small model (issue 58), through the commands a user types: a ~124M RoPE model pretrained at
1,024 positions (pretrain.py configs/small.py on --data, shortened), extended to --length tokens with
each rope_scaling type by a short full fine-tune on long documents (sft.py --task=retrieval --pack=False: a pass key
buried in filler, 64 to length-512 tokens back, log-uniformly: most rows short), all types at once on the one GPU.
Judged on held-out keys (never trained on: the task's hash split) at least --far tokens back, greedy, by depth; the
base is each fine-tune's step-0 accuracy (sft.py's own line: the pretrained weights under that scaling, before
training). --lm_steps: each type first extends the language model (pretrain.py from the base at --length, its
scaling, the base's corpus), then the retrieval fine-tune starts there.

    python bench/long_extend.py --out=out/long_extend [--types=linear,dynamic,yarn,llama3] [--length=16384]
    python bench/long_extend.py --out=/tmp/long_extend --tiny      # CPU smoke test: tiny shapes, minutes

First the base's copy loss (random tokens, then the same again: a base that cannot copy has nothing to extend; a
warning says so). Also the held-out loss by position (the base unscaled, the base under each scaling before any
fine-tune, and each extension, on windows of --length tokens of the base's validation split). --base: one base
for several runs. Writes OUT/long_extend.json (per type: the base's and the extended model's accuracy, by depth;
the loss by position) and the runs' logs. Chance: a blind 5-digit guess, ~0; copying the one number in the prompt
is the skill itself.
"""
import argparse
import glob
import json
import os
import re
import shlex
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TYPES = ("linear", "dynamic", "yarn", "llama3")


def run(cmd, log, wait=True):
    """A stage script as a user runs it (cwd: the repo), its output to log."""
    f = open(log, "w")
    p = subprocess.Popen([sys.executable, *cmd], cwd=ROOT, stdout=f, stderr=subprocess.STDOUT,
                         env={"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", **os.environ,
                              "PYTHONUNBUFFERED": "1"})  # (expandable: runs side by side, no stranded cache)
    if wait:
        if p.wait():
            sys.exit(f"{' '.join(cmd[:2])} failed: see {log}\n" + "".join(open(log).readlines()[-15:]))
    return p


def score(path, depth, far, n, device):
    """Greedy answers of the fine-tuned checkpoint at path to n held-out items whose key lies far..depth
    tokens back -> (accuracy, Retrieval.by_depth rows)."""
    sys.path.insert(0, ROOT)
    from types import SimpleNamespace

    import torch

    import sample
    import weights
    from posttrain.retrieval import Retrieval
    model, _, cfg = sample.load(path, device)
    tok, template = sample.chat_setup(path, cfg)
    task = Retrieval(depth=depth, min_depth=far, tokenizer_vocab=cfg.tokenizer_vocab, answer="sentence")
    items = task.test(n)
    got = []
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    run_cfg = SimpleNamespace(block_size=cfg.block_size, eval_tokens=12, micro_batch_size=1)
    with torch.autocast(device, dtype=dtype, enabled=device == "cuda"):
        for i in range(0, len(items), 8):
            chunk = items[i:i + 8]
            for it, ids in zip(chunk, weights.DECODER.answers(model, tok, template, [it["prompt"] for it in chunk],
                                                               run_cfg)):
                got.append(task.reward(tok.decode(ids), it))
    return sum(got) / len(got), task.by_depth(items, got)


def load(path, length, device, scaling=""):
    """A checkpoint (a folder or a run's latest step) built at max(its positions, length), in eval mode: as it
    was trained, or with rope_scaling `scaling` (a type's name: rope.resolve's dict, no fine-tune)."""
    sys.path.insert(0, ROOT)
    from types import SimpleNamespace

    import checkpoint
    import hf
    import rope
    import weights
    from model import ModelConfig, Transformer
    ckpt = path if os.path.isfile(os.path.join(path, "model.safetensors")) else checkpoint.latest(path)
    cfg = hf.read_config(ckpt)
    if scaling:
        cfg["rope_scaling"] = rope.resolve(scaling, length, cfg["block_size"], cfg.get("rope_scaling"))
    model = Transformer(ModelConfig.from_cfg(SimpleNamespace(**{**cfg, "block_size": max(cfg["block_size"], length)})))
    weights.load_model(ckpt, model)
    return model.to(device).eval()


def copy_loss(path, device, n=32, span=100):
    """Can the base copy? Its mean loss on a random token sequence and on the same sequence repeated right after
    (induction): without a drop, nothing in the base finds an earlier token to copy, and fine-tuning has no skill
    to stretch to long range (a 4M model on CPU had none after 400 steps: 11.65 and 11.59)."""
    import torch
    model = load(path, 0, device)
    span = min(span, model.cfg.block_size // 2)
    x = torch.randint(1000, 4000, (n, span), generator=torch.Generator().manual_seed(0)).to(device)
    seq = torch.cat([x, x], 1)
    with torch.no_grad(), torch.autocast(device, torch.bfloat16, enabled=device == "cuda"):
        loss = model(seq[:, :-1], seq[:, 1:], reduction="none").float().view(n, -1)
    return round(loss[:, :span - 1].mean().item(), 3), round(loss[:, span:].mean().item(), 3)


def loss_by_position(path, val_bin, length, n, device, bins=8, scaling=""):
    """Mean next-token loss of the checkpoint at path over n held-out windows of `length` tokens of the base's
    validation split (code the model never trained on), in `bins` equal position ranges: a model that uses
    the positions keeps its loss flat or falling; one that cannot, rises past its trained length. A
    pretraining checkpoint is built at `length` positions, unscaled (the base as it is) or with `scaling`."""
    sys.path.insert(0, ROOT)
    import torch

    import data
    model = load(path, length, device, scaling)
    total, count = torch.zeros(length), 0
    with torch.no_grad(), torch.autocast(device, torch.bfloat16, enabled=device == "cuda"):
        for x, y in data.eval_batches(val_bin, 1, length, n_batches=n, device=device):
            total += model(x, y, reduction="none").float()[0].cpu()
            count += 1
    per = total / max(count, 1)
    edges = [length * b // bins for b in range(bins + 1)]
    return count, [(a, b - 1, round(per[a:b].mean().item(), 4)) for a, b in zip(edges, edges[1:])]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--types", default=",".join(TYPES), help="rope_scaling types (empty: pretrain the base only)")
    p.add_argument("--length", type=int, default=16384, help="positions after extension (the base has 1,024)")
    p.add_argument("--far", type=int, default=8192, help="judged on keys at least this many tokens back")
    p.add_argument("--pretrain_steps", type=int, default=1000, help="of 128 x 1,024 tokens (400 on python: copy "
                   "loss 12.04 -> 11.03 nats, barely copying)")
    p.add_argument("--steps", type=int, default=1000, help="fine-tuning steps of --rows rows each (1,000 of 4 at lr "
                   "1e-4: 89-92%% right at 8k+ back, still rising; 600 at 5e-4: 42-53%%)")
    p.add_argument("--rows", type=int, default=4, help="a step's rows (a row's cost is mostly fixed: more steps)")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--sft_args", default="", help="more sft.py flags for every fine-tune, e.g. \"--schedule=linear "
                   "--min_lr_ratio=0.02\"")
    p.add_argument("--lm_steps", type=int, default=0, help="first extend the language model: pretrain.py from the "
                   "base at --length with the type's scaling on its corpus, this many steps of --lm_rows rows "
                   "(0: none, the retrieval fine-tune starts from the base)")
    p.add_argument("--lm_rows", type=int, default=8)
    p.add_argument("--lm_lr", type=float, default=1e-4)
    p.add_argument("--n_eval", type=int, default=64)
    p.add_argument("--n_loss", type=int, default=8, help="held-out windows of --length tokens for the loss by position")
    p.add_argument("--data", default="python", help="the base's corpus (pretrain.py's data): stdlib alone is ~2.6M "
                   "tokens, memorised within a few hundred steps")
    p.add_argument("--base", default="", help="the pretrained base's folder (default OUT/base: made when missing)")
    p.add_argument("--tiny", action="store_true", help="tiny shapes on the CPU (a smoke test)")
    a = p.parse_args()
    import torch  # noqa: F401  (loaded before the runs start: a first import after them once failed to load on the GPU)
    os.makedirs(a.out, exist_ok=True)
    out, types = os.path.abspath(a.out), [t for t in a.types.split(",") if t]  # none: the base alone
    base = os.path.abspath(a.base) if a.base else os.path.join(out, "base")
    if a.tiny:
        a.length, a.far, a.pretrain_steps, a.steps, a.rows, a.n_eval, a.n_loss = 512, 256, 30, 4, 2, 4, 2
        pre = ["configs/tiny.py", "--max_docs=100", "--block_size=64", f"--max_steps={a.pretrain_steps}",
               "--eval_every=0", "--sample_tokens=0", "--device=cpu"]
        ft = ["configs/sft_tiny.py", "--device=cpu", "--micro_batch_size=1"]
    else:
        pre = ["configs/small.py", f"--data={a.data}", f"--max_steps={a.pretrain_steps}", "--batch_size=128",
               "--fim_rate=0", "--eval_every=0", "--warmup_steps=30", "--clean=False", "--dedup=none"]
        ft = ["configs/sft_small.py", "--micro_batch_size=1", "--loss_chunk=1024", "--compile=False"]
    t0 = time.time()
    home = os.path.dirname(base)  # the base's data and log beside it
    os.makedirs(home, exist_ok=True)
    if not os.path.isdir(base):
        run(["pretrain.py", *pre, f"--out_dir={base}", f"--ckpt_every={a.pretrain_steps}", f"--data_dir={home}/data",
             "--val_fraction=0.05"], os.path.join(home, "base.log"))
    pretrain_s = time.time() - t0
    first, second = copy_loss(base, "cpu" if a.tiny else "cuda")
    print(f"base copy loss: {first} nats a token on random tokens, {second} on their repeat", flush=True)
    if second > first - 1:
        print("warning: the base does not copy (its repeat's loss is not a nat lower): retrieval needs that skill; "
              "pretrain longer (--pretrain_steps)", flush=True)
    vocab = 4096 if a.tiny else 32768  # the base's tokenizer_vocab: depths in its tokens
    depth = a.length - min(512, a.length // 8)  # the prompt's template and question fit beside
    result = {"length": a.length, "far": a.far, "pretrain_steps": a.pretrain_steps, "pretrain_s": round(pretrain_s),
              "base_copy_loss": [first, second], "lm_steps": a.lm_steps, "lm_rows": a.lm_rows, "lm_lr": a.lm_lr,
              "steps": a.steps, "rows": a.rows, "lr": a.lr, "sft_args": a.sft_args, "types": {}}
    start = {t: (base, [f"--rope_scaling={t}"]) for t in types}  # each fine-tune's init_from and its scaling
    if a.lm_steps:  # the language model extended first (all at once), on the base's corpus and split
        lms = {t: run(["pretrain.py", *pre, f"--init_from={base}", f"--out_dir={out}/lm_{t}", "--overwrite=True",
                       f"--data_dir={home}/data", "--val_fraction=0.05", f"--block_size={a.length}",
                       f"--rope_scaling={t}", f"--max_steps={a.lm_steps}", f"--batch_size={a.lm_rows}",
                       "--micro_batch_size=1", f"--lr={a.lm_lr}", f"--warmup_steps={max(1, a.lm_steps // 10)}",
                       f"--ckpt_every={a.lm_steps}", "--compile=False", "--progress=False"],
                      os.path.join(out, f"lm_{t}.log"), wait=False) for t in types}
        for t, proc in lms.items():
            if proc.wait():
                result["types"][t] = {"error": "".join(open(os.path.join(out, f"lm_{t}.log")).readlines()[-5:])}
            start[t] = (f"{out}/lm_{t}", [])  # its positions are --length now: no scaling asked again
    runs = {}
    for t in [t for t in types if t not in result["types"]]:  # all at once: one GPU, shared
        runs[t] = run(["sft.py", *ft, f"--init_from={start[t][0]}", f"--out_dir={out}/ft_{t}", "--overwrite=True",
                       f"--block_size={a.length}", *start[t][1], "--task=retrieval",
                       "--task_args=" + json.dumps({"depth": depth, "min_depth": 64, "spread": "log",
                                                    "tokenizer_vocab": vocab, "answer": "sentence"}),
                       "--pack=False",
                       f"--n_train={a.steps * a.rows}", f"--batch_size={a.rows}", f"--max_steps={a.steps}",
                       f"--lr={a.lr}", f"--warmup_steps={max(1, a.steps // 10)}", f"--n_eval={a.n_eval}",
                       "--eval_tokens=12", f"--eval_every={max(1, a.steps // 4)}", f"--ckpt_every={a.steps}",
                       "--log_every=5", "--progress=False", *shlex.split(a.sft_args)],
                      os.path.join(out, f"ft_{t}.log"), wait=False)
    for t, proc in runs.items():
        log = os.path.join(out, f"ft_{t}.log")
        if proc.wait():
            result["types"][t] = {"error": "".join(open(log).readlines()[-5:])}
            continue
        text = open(log).read()
        acc = [float(x) / 100 for x in re.findall(r"^step \d+ \| held-out accuracy ([\d.]+)%", text, re.M)]
        acc_far, bins = score(f"{out}/ft_{t}", depth, a.far, a.n_eval, "cpu" if a.tiny else "cuda")
        first_acc, last_acc = (acc[0], acc[-1]) if acc else (None, None)  # step 0 (the base, or lm_steps' start)
        result["types"][t] = {"start_accuracy" if a.lm_steps else "base_accuracy": first_acc,
                              "after_accuracy": last_acc, f"accuracy_at_{a.far}_plus": acc_far, "by_depth": bins}
        print(t, json.dumps(result["types"][t]), flush=True)
        with open(os.path.join(out, "long_extend.json"), "w") as f:  # each type as it is scored
            json.dump(result, f, indent=1)
    val = sorted(glob.glob(os.path.join(home, "data", "**", "val.bin"), recursive=True))
    if val:  # the held-out loss by position: the base unscaled, then each extension
        done = [t for t in runs if "error" not in result["types"][t]]
        lm = [(f"lm_{t}", f"{out}/lm_{t}", "") for t in types if a.lm_steps and os.path.exists(f"{out}/lm_{t}/latest")]
        for name, path, scaling in [("base", base, "")] + [(f"base+{t}", base, t) for t in types] + lm + \
                [(t, f"{out}/ft_{t}", "") for t in done]:  # the base, scaled untrained, its LM extended, fine-tuned
            n, bins = loss_by_position(path, val[0], a.length, a.n_loss, "cpu" if a.tiny else "cuda", scaling=scaling)
            result.setdefault("loss_by_position", {})[name] = bins
            print(name, "loss by position", n, "windows:", " ".join(f"{b[2]:.3f}" for b in bins), flush=True)
    result["wall_s"] = round(time.time() - t0)
    with open(os.path.join(out, "long_extend.json"), "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
