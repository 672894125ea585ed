"""Memory on a 24 GiB card through sft.py itself: each row is the command a user types, run in a child
process capped with torch.cuda.set_per_process_memory_fraction, next to what that command's own
--gpu_memory plan predicts, with the time from start to the first step.

    python bench/bench_sft_memory.py make /tmp/llama8b            # a random Llama-3-8B-shaped HF folder (bf16)
    python bench/bench_sft_memory.py rows /tmp/llama8b --cap_gib=24 --json=bench/results/memory/sft_8b.json
    python bench/bench_sft_memory.py all /tmp/tiny_hf --tiny       # CPU smoke test: tiny shapes, no cap
    python bench/bench_sft_memory.py rows /tmp/llama8b --rows=1 --lengths=155648,167936 \
        --knobs="--loss_chunk=1024 --recompute=block --offload_activations=True --mlp_tile=4096"  # longest row

Rows (ROWS): LoRA r=16 on a bf16 base and QLoRA on an NF4 base from the HF folder, each with the knobs
the plan itself recommends for cap_gib (`sft.py ... --gpu_memory=24`, applied in its order until it
fits), and LoRA from `--init_from=` (random weights of the same shape: the model keys given). A row's
child prints sft.py's log; the parent reads its "first step done" line, the peak (mem_gb: the
allocator's max over the logged steps, weights and optimizer state included, the CUDA context not)
and tokens/s of the steps after the first, then kills the child (no final checkpoint is written).
An OOM is a result: the row says so.
"""
import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAPES = {
    "8b": dict(vocab_size=128256, n_layer=32, n_head=32, n_kv_head=8, n_embd=4096, ffn_hidden=14336, block_size=2048,
               rope_theta=500000.0, tie_embeddings=False, norm="rmsnorm", activation="swiglu", pos_emb="rope",
               bias=False),
    "tiny": dict(vocab_size=512, n_layer=2, n_head=4, n_kv_head=2, n_embd=64, ffn_hidden=192, block_size=64,
                 norm="rmsnorm", activation="swiglu", pos_emb="rope", bias=False, tie_embeddings=False),
}
ROWS = [  # (row, sft.py overrides); the plan's knobs for cap_gib are added to each
    ("lora8b bf16 base", ["--lora_r=16", "--lora_base_dtype=bfloat16"]),
    ("qlora8b nf4 base", ["--lora_r=16", "--lora_base_dtype=nf4"]),
    ("lora8b bf16 base, --init_from= (random weights)", ["--lora_r=16", "--lora_base_dtype=bfloat16", "--init_from="]),
]
# a row's capped child: sft.py run as a user runs it, after the cap (0: none)
CHILD = ("import runpy, sys, torch\n"
         "gib = float(sys.argv[1]); sys.argv = sys.argv[2:]\n"
         "if gib and torch.cuda.is_available():\n"
         "    torch.cuda.set_per_process_memory_fraction(gib * 2**30 / torch.cuda.get_device_properties(0).total_memory)\n"
         "runpy.run_path(sys.argv[0], run_name='__main__')\n")


def make(folder, shape, positions=0):
    """A random model of `shape` written as an HF folder with our tokenizer (bf16 on a GPU); positions: its
    max_position_embeddings (default: the shape's block_size)."""
    sys.path.insert(0, ROOT)
    import torch

    import hf
    import tokenizer
    from memory import materialize
    from model import ModelConfig
    cuda = torch.cuda.is_available()
    torch.manual_seed(0)
    model = materialize.build(ModelConfig(**{**SHAPES[shape], "block_size": positions or SHAPES[shape]["block_size"]}),
                              "cuda" if cuda else "cpu",
                              torch.bfloat16 if cuda else torch.float32)
    hf.export_hf(model, folder, tokenizer=tokenizer.get_tokenizer("cl100k_base", 0 if shape == "8b" else 500))
    return folder


def long_data(path, tokens, shape, n=3):
    """n conversations of one long user turn of filler words and a short answer, each within 96 tokens of
    `tokens` (the turn's words counted with the folder's tokenizer, bisected; the chat template adds fewer):
    one row each with pack=False, which chat.batch cuts to its longest row rounded up to tokens/16, so a
    step computes `tokens` positions."""
    sys.path.insert(0, ROOT)
    import tokenizer
    words = "the of and to in a is that for it as was with be by on not he this are or his from at which".split()
    rng = random.Random(0)
    tok = tokenizer.get_tokenizer("cl100k_base", 0 if shape == "8b" else 500)
    with open(path, "w") as f:
        for _ in range(n):
            pool = [rng.choice(words) for _ in range(tokens)]
            lo, hi = 1, tokens  # the most words whose text has at most tokens - 96 tokens
            while lo < hi:
                mid = (lo + hi + 1) // 2
                lo, hi = (mid, hi) if len(tok.encode(" ".join(pool[:mid]))) <= tokens - 96 else (lo, mid - 1)
            f.write(json.dumps({"messages": [{"role": "user", "content": " ".join(pool[:lo])},
                                             {"role": "assistant", "content": "done"}]}) + "\n")
    return path


def base_args(folder, shape, args):
    if args.block_size != 2048:  # long rows: one conversation of about block_size tokens per row, causal
        data = long_data(os.path.join(args.work, "long.jsonl"), args.block_size, shape)
        return (["sft.py", "configs/sft_small.py" if shape == "8b" else "configs/sft_tiny.py", f"--init_from={folder}",
                 "--micro_batch_size=1", "--batch_size=1", f"--max_steps={args.steps + 5}", "--log_every=1",
                 "--eval_every=0", "--n_eval=0", "--ckpt_every=0", "--compile=False", "--progress=False",
                 "--warmup_steps=1", f"--out_dir={args.work}/run", "--overwrite=True", "--dtype=bfloat16",
                 f"--block_size={args.block_size}", "--task=", f"--chat_data={data}", "--pack=False"]
                + ([] if shape == "8b" else ["--device=cpu"]), [])
    tokens = ["--block_size=2048"] if shape == "8b" else []
    keys = [f"--{k}={v}" for k, v in SHAPES[shape].items() if k not in ("vocab_size",)]
    return (["sft.py", "configs/sft_tiny.py" if shape == "tiny" else "configs/sft_small.py", f"--init_from={folder}",
             f"--micro_batch_size={args.micro}", f"--batch_size={args.micro}", f"--max_steps={args.steps + 5}",
             "--log_every=1", "--eval_every=0", "--n_eval=0", "--ckpt_every=0", "--compile=False", "--progress=False",
             "--warmup_steps=1", "--n_train=2000", f"--out_dir={args.work}/run", "--overwrite=True"]
            + ["--dtype=bfloat16"] + ([] if shape == "8b" else ["--device=cpu"]) + tokens, keys)


def planned(cmd, cap, fixed=False):
    """The command's own --gpu_memory plan -> (predicted peak GiB of the recommendation, the knobs it adds);
    fixed: the peak of the command as given (no knobs added)."""
    out = subprocess.run([sys.executable, *cmd, f"--gpu_memory={cap}"], cwd=ROOT, capture_output=True, text=True,
                         timeout=900).stdout
    peak = float(re.search(r"^  peak\s+([\d.]+) GiB", out, re.M).group(1))
    if fixed:
        return peak, [], out
    steps = re.findall(r"^  \+ .*->\s+([\d.]+) GiB", out, re.M)
    run_with = re.search(r"^  run with: (.*)$", out, re.M)
    return (float(steps[-1]) if steps else peak), (run_with.group(1).split() if run_with else []), out


def measure(cmd, cap, steps, timeout):
    """Run the capped child until `steps` steps after the first are logged -> the row's measurements."""
    t0 = time.time()
    p = subprocess.Popen([sys.executable, "-c", CHILD, str(cap), *cmd], cwd=ROOT, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, start_new_session=True, env={**os.environ,
                                                                                          "PYTHONUNBUFFERED": "1"})
    row, lines = {"steps": []}, []
    try:
        for line in p.stdout:
            lines.append(line.rstrip())
            if m := re.search(r"first step done ([\d.]+) s after start", line):
                row["first_step_s"] = float(m.group(1))
            if m := re.match(r"step (\d+)/\d+ \| .*tok_s ([\d.e+]+) .*mem_gb ([\d.]+)", line):
                row["steps"].append((int(m.group(1)), float(m.group(2)), float(m.group(3))))
                if len(row["steps"]) > steps:
                    break
            if time.time() - t0 > timeout:
                row["error"] = f"timeout after {timeout} s"
                break
    finally:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
    if "OutOfMemoryError" in "\n".join(lines) or "CUDA out of memory" in "\n".join(lines):
        row["error"] = "OOM"
    timed = row["steps"][1:]
    if timed:
        row["tok_s"] = sum(t for _, t, _ in timed) / len(timed)
        row["peak_gib"] = max(m for _, _, m in row["steps"]) * 1e9 / 2**30
    elif "error" not in row:
        row["error"] = "no step logged: " + " | ".join(lines[-5:])
    row["wall_s"] = time.time() - t0
    row["log_tail"] = lines[-8:]
    return row


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("what", choices=["make", "rows", "all"])
    p.add_argument("folder")
    p.add_argument("--cap_gib", type=float, default=24.0)
    p.add_argument("--micro", type=int, default=1, help="rows of 2048 tokens per step")
    p.add_argument("--block_size", type=int, default=2048, help="!= 2048: long rows of this many tokens (micro 1), "
                   "and `make` writes a folder of this many positions")
    p.add_argument("--lengths", default="", help="comma-separated long-row lengths probed in turn (ascending: the "
                   "probes stop at the first that does not fit); `make` writes a folder of the largest's positions")
    p.add_argument("--knobs", default="", help="sft.py keys every row runs with, instead of the plan's "
                   "recommendation (the plan's peak for them is printed beside)")
    p.add_argument("--steps", type=int, default=3, help="steps measured after the first")
    p.add_argument("--timeout", type=float, default=420.0, help="seconds a row may take")
    p.add_argument("--rows", default="", help="comma-separated row numbers (default: all)")
    p.add_argument("--work", default="/tmp/bench_sft_memory")
    p.add_argument("--tiny", action="store_true", help="tiny shapes on the CPU (a smoke test)")
    p.add_argument("--json", default="")
    args = p.parse_args()
    shape = "tiny" if args.tiny else "8b"
    lengths = sorted(int(t) for t in args.lengths.split(",")) if args.lengths else [args.block_size]
    if args.what in ("make", "all"):
        t = time.time()
        make(args.folder, shape, max(lengths) if max(lengths) != 2048 else 0)
        print(f"made {args.folder} in {time.time() - t:.0f} s", flush=True)
    if args.what == "make":
        return
    os.makedirs(args.work, exist_ok=True)
    results = []
    picked = [int(i) for i in args.rows.split(",")] if args.rows else range(len(ROWS))
    for i in picked:
        for length in lengths:
            args.block_size = length
            cmd0, keys = base_args(args.folder, shape, args)
            name, extra = ROWS[i]
            cmd = cmd0 + extra + (keys if "--init_from=" in extra else []) + args.knobs.split()
            cap = args.cap_gib if not args.tiny else 0.0
            predicted, knobs, plan_out = planned(cmd, args.cap_gib, fixed=bool(args.knobs))
            row = {"row": name, "tokens": length, "command": " ".join(cmd + knobs), "plan_gib": predicted,
                   "plan_knobs": knobs, **measure(cmd + knobs, cap, args.steps, args.timeout)}
            results.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "log_tail"}), flush=True)
            if args.json:  # after every row: a call cut short keeps what it measured
                os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
                with open(args.json, "w") as f:
                    json.dump({"cap_gib": args.cap_gib, "rows": results}, f, indent=1)
            if "error" in row:
                print("\n".join(row["log_tail"]), flush=True)
                break  # a longer row does not fit either


if __name__ == "__main__":
    main()
