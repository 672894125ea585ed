"""ALiBi's extrapolation claim, measured: validation loss at 1x, 2x and 4x the training length, ALiBi vs RoPE.

    python bench/alibi_extrapolation.py --shape=tiny --device=cpu --json=alibi.json        # CPU, minutes
    python bench/alibi_extrapolation.py --shape=gpu --json=bench/results/arch/alibi.json   # one GPU

Two LLaMA-style models (RMSNorm, SwiGLU, untied head), identical but for positions: pos_emb="rope"
and pos_emb="alibi" (MPT's slopes), the same seed, trained on the same batches of T tokens with
block_size = 4T (RoPE's tables reach there; ALiBi has none). Evaluated on the last T, 2T and 4T
tokens of the same held-out windows of 4T: the loss per token over every position ("all") and over
the last T positions ("last T": the same target tokens in every column, with T, 2T, 4T of context). A third row is
the trained RoPE model evaluated with sliding_window = T (at T the window changes nothing, so it
is the same weights; past T it keeps every query within the training distance). Data as
bench/compare_arch.py: prepare.prepare of --data with cl100k_base cut to --vocab ids.
"""
import argparse
import json
import math
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import optim  # noqa: E402
import tokenizer  # noqa: E402
from corpora import prepare  # noqa: E402
from model import ModelConfig, Transformer  # noqa: E402

SHAPES = {
    "tiny": dict(n_layer=2, n_embd=64, n_head=4, seq_len=32, batch=16, vocab=2048, steps=60, eval_rows=32, lr=3e-3,
                 warmup=5),
    "gpu": dict(n_layer=8, n_embd=512, n_head=8, seq_len=512, batch=32, vocab=32768, steps=3000, eval_rows=256, lr=1e-3,
                warmup=100),
}
FACTORS = (1, 2, 4)


def lr_at(step, s):
    if step < s["warmup"]:
        return s["lr"] * (step + 1) / s["warmup"]
    frac = (step - s["warmup"]) / max(1, s["steps"] - s["warmup"])
    return s["lr"] * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))


def windows(tokens, n, length, seed):
    g = np.random.default_rng(seed)
    offsets = g.integers(0, len(tokens) - length - 1, size=n)
    return torch.from_numpy(np.stack([tokens[o:o + length + 1].astype(np.int64) for o in offsets]))


@torch.no_grad()
def evaluate(model, held, T, B, dev, autocast):
    """{factor: (loss over all positions, loss over the last T)} on the last factor x T tokens of each
    held-out window: the last T targets are the same tokens in every column, seen with more context."""
    model.eval()
    out = {}
    for f in FACTORS:
        rows, nll = held[:, -(f * T + 1):], []
        for i in range(0, len(rows), B):
            r = rows[i:i + B].to(dev)
            with autocast:
                nll.append(model(r[:, :-1], r[:, 1:], reduction="none").float().cpu())
        nll = torch.cat(nll)
        out[f] = (float(nll.mean()), float(nll[:, -T:].mean()))
    model.train()
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="tiny", choices=SHAPES)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--data", default="stdlib")
    ap.add_argument("--data_root", default="data")
    for k in ("steps", "batch", "seq_len", "vocab"):
        ap.add_argument(f"--{k}", type=int, default=None, help=f"override the shape's {k}")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    s = dict(SHAPES[args.shape], **{k: getattr(args, k) for k in ("steps", "batch", "seq_len", "vocab")
                                    if getattr(args, k) is not None})
    dev = torch.device(args.device)
    autocast = torch.autocast("cuda", torch.bfloat16) if dev.type == "cuda" else torch.autocast("cpu", enabled=False)
    tok = tokenizer.get_tokenizer("cl100k_base", vocab=s["vocab"])
    folder = prepare.default_data_dir(args.data, tok.name, s["vocab"], root=args.data_root)
    prepare.prepare(args.data, tok, folder, val_fraction=0.1, verbose=False)
    dtype = np.uint16 if tok.n_vocab <= 65536 else np.uint32
    train_tokens, val_tokens = (np.memmap(os.path.join(folder, f"{k}.bin"), dtype=dtype, mode="r") for k in ("train", "val"))
    T, B = s["seq_len"], s["batch"]
    held = windows(val_tokens, s["eval_rows"], max(FACTORS) * T, 100)
    report = {"shape": s, "device": str(dev), "data": args.data, "rows": {}}
    for pos in ("rope", "alibi"):
        torch.manual_seed(0)
        cfg = ModelConfig(vocab_size=tok.n_vocab, block_size=max(FACTORS) * T, n_layer=s["n_layer"], n_head=s["n_head"],
                          n_embd=s["n_embd"], pos_emb=pos, norm="rmsnorm", activation="swiglu", tie_embeddings=False)
        model = Transformer(cfg).to(dev)
        opt = torch.optim.AdamW(optim.param_groups(model, 0.1), lr=s["lr"], betas=(0.9, 0.95))
        g = np.random.default_rng(0)  # the same batches for both
        t0 = time.perf_counter()
        for step in range(s["steps"]):
            offsets = g.integers(0, len(train_tokens) - T - 1, size=B)
            r = torch.from_numpy(np.stack([train_tokens[o:o + T + 1].astype(np.int64) for o in offsets])).to(dev)
            for group in opt.param_groups:
                group["lr"] = lr_at(step, s)
            with autocast:
                loss = model(r[:, :-1], r[:, 1:])
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
        train_s = time.perf_counter() - t0
        report["rows"][pos] = {"train_loss": float(loss.detach()), "train_s": train_s, **evaluate(model, held, T, B, dev, autocast)}
        if pos == "rope":  # the same weights, each query kept within T keys
            model.cfg.sliding_window = T
            report["rows"]["rope, window T"] = {"train_loss": float(loss.detach()), "train_s": train_s,
                                                **evaluate(model, held, T, B, dev, autocast)}
    head = " | ".join(f"{f}x ({f * T}) all / last {T}" for f in FACTORS)
    print(f"\ntrained at T = {T}, {s['steps']} steps of {B} x {T} tokens; validation loss per token\n")
    print(f"| positions | {head} |")
    print("|---|" + "---|" * len(FACTORS))
    for name, r in report["rows"].items():
        print(f"| {name} | " + " | ".join(f"{r[f][0]:.4f} / {r[f][1]:.4f}" for f in FACTORS) + " |")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return report


if __name__ == "__main__":
    main()
