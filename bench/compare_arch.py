"""Four design philosophies side by side: GPT-2-, LLaMA-, BERT- and T5-style models of matched size,
trained on the same tokens for the same steps, compared in one picture.

    python bench/compare_arch.py --shape=tiny --device=cpu --png=arch.png --json=arch.json     # CPU, minutes
    python bench/compare_arch.py --shape=gpu --png=bench/results/arch/arch.png --json=bench/results/arch/arch.json

Matched: the blocks' parameters (12 L C^2 each: GPT-2's and LLaMA's L blocks, BERT's L blocks,
T5's L/2 encoder and L/2 decoder blocks with d_ff = 3C, whose cross-attention the smaller MLP pays
for); the compute (--budget=flops, default: each trains for the training FLOPs of GPT-2's --steps,
so BERT, whose head runs on the masked 15%, and T5, whose decoder runs on the short targets, take
more steps; --budget=steps: the same steps); B rows of T tokens per step from the same random
offsets; AdamW with warmup + cosine over each model's steps; the seed. Embeddings and heads are each family's own (GPT-2, BERT and
T5 tie theirs; LLaMA's head is its own): the JSON reports every count and the FLOPs per step.
Each learns its own objective: GPT-2 / LLaMA the next token (causal LM), BERT the masked 15% (80/10/10,
bert.mask_tokens), T5 span corruption (t5.span_corrupt: an input of T tokens from the raw tokens
t5.corrupted_lengths(T) asks for, the targets: sentinels, noise spans, eos).
Measured on fixed held-out rows (the same masks and spans at every evaluation): validation loss
per predicted token for all four (each of its own objective: the curves show how each learns, not
which is better), bits per byte of the held-out text for the two causal LMs (comparable across
tokenizers and runs), and a downstream probe for all four: is a window of T held-out tokens one
passage, or its first half joined to another passage's second half? A logistic regression on the
frozen model's last hidden states (the encoder's for T5: each half's mean and their product), fit
on --probe_rows pairs and scored on as many others, before and after training (chance 50%).
Data: prepare.prepare of --data (default the standard library) with cl100k_base cut to --vocab ids;
BERT's [MASK] and T5's sentinels are ids past it.
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
from encoders import bert  # noqa: E402
from encoders import t5  # noqa: E402
from fused import IGNORE  # noqa: E402
from model import ModelConfig, Transformer  # noqa: E402
from tools import scoring  # noqa: E402

ARCHS = ("gpt2", "llama", "bert", "t5")
SHAPES = {
    "tiny": dict(n_layer=2, n_embd=64, n_head=4, seq_len=64, batch=8, vocab=2048, steps=40, eval_every=10,
                 eval_rows=32, probe_rows=128, lr=3e-3, warmup=5),
    "gpu": dict(n_layer=8, n_embd=512, n_head=8, seq_len=512, batch=64, vocab=32768, steps=2000, eval_every=250,
                eval_rows=512, probe_rows=2048, lr=1e-3, warmup=100),
}


def build(arch, s, V, n_sentinels):
    L, C, H, T = s["n_layer"], s["n_embd"], s["n_head"], s["seq_len"]
    if arch == "gpt2":
        return Transformer(ModelConfig(vocab_size=V, block_size=T, n_layer=L, n_head=H, n_embd=C, pos_emb="learned",
                                       norm="layernorm", activation="gelu", bias=True, tie_embeddings=True))
    if arch == "llama":
        return Transformer(ModelConfig(vocab_size=V, block_size=T, n_layer=L, n_head=H, n_embd=C, pos_emb="rope",
                                       norm="rmsnorm", activation="swiglu", ffn_hidden=4 * C * 2 // 3,
                                       tie_embeddings=False))
    if arch == "bert":  # one id past the tokenizer's: [MASK]
        return bert.Bert(bert.BertConfig(vocab_size=V + 1, block_size=T, n_layer=L, n_head=H, n_embd=C, dropout=0.0))
    return t5.T5(t5.T5Config(vocab_size=V + n_sentinels, n_layer=L // 2, n_decoder_layer=L - L // 2, n_head=H,
                             n_embd=C, head_dim=C // H, ffn_hidden=3 * C, dropout=0.0))


def block_params(model):
    return sum(p.numel() for p in model.blocks.parameters())


def linear_weights(modules):
    return sum(m.weight.numel() for m in modules if isinstance(m, torch.nn.Linear))


def flops_per_step(arch, model, s, t5_lengths):
    """Training FLOPs of one step, DESIGN.md's count by family: 6 x matmul weights x the tokens through
    them, plus attention (per row and layer: causal 6 T^2 C, bidirectional 12 T^2 C, cross 12 T_dec T_enc C)."""
    B, T, C, L = s["batch"], s["seq_len"], s["n_embd"], s["n_layer"]
    if arch in ("gpt2", "llama"):
        return B * (6 * linear_weights(model.modules()) * T + 6 * L * T * T * C)
    if arch == "bert":
        return B * T * bert.flops_per_token(model.cfg, T, predicted=0.15)
    return B * t5.flops_per_row(model.cfg, t5_input_len(t5_lengths), t5_lengths[1])


def t5_input_len(t5_lengths):
    """The corrupted input's length (every row the same: the counts depend on the length only)."""
    noise, spans = t5.span_counts(t5_lengths[0])
    return t5_lengths[0] - noise + spans + 1


class Batches:
    """The same random offsets for every architecture: step i's B rows start where they start for all."""

    def __init__(self, tokens, s, need, seed):
        self.tokens, self.B, self.need = tokens, s["batch"], need
        self.g = np.random.default_rng(seed)

    def offsets(self, n):
        return self.g.integers(0, len(self.tokens) - self.need - 1, size=n)

    def rows(self, offsets, length):
        return torch.from_numpy(np.stack([self.tokens[o:o + length].astype(np.int64) for o in offsets]))


def make_batch(arch, rows_of, offsets, s, V, eos, t5_lengths, gen):
    """(inputs, targets) for arch from the rows at offsets; gen: the masking / corruption generator."""
    T = s["seq_len"]
    if arch in ("gpt2", "llama"):
        r = rows_of(offsets, T + 1)
        return r[:, :-1], r[:, 1:]
    if arch == "bert":
        return bert.mask_tokens(rows_of(offsets, T), mask_id=V, vocab_size=V, rate=0.15, special_ids=[eos], generator=gen)
    raw = rows_of(offsets, t5_lengths[0])
    pairs = [t5.span_corrupt(r, vocab_size=model_vocab(arch, V, t5_lengths), eos_id=eos, generator=gen) for r in raw]
    return torch.stack([i for i, _ in pairs]), torch.stack([o for _, o in pairs])  # all rows of one length


def model_vocab(arch, V, t5_lengths):
    return V + t5.span_counts(t5_lengths[0])[1] if arch == "t5" else V


@torch.no_grad()
def evaluate(arch, model, held, nbytes, autocast):
    """-> (loss per predicted token, bits per byte or None) over the held-out batches."""
    model.eval()
    nll = count = text_nll = text_bytes = 0.0
    for x, y in held:
        with autocast:
            per = model(x, y, reduction="none").float()
        nll, count = nll + float(per.sum()), count + int((y != IGNORE).sum())
        if arch in ("gpt2", "llama"):
            b = nbytes[y.clamp(min=0).cpu()].to(per.device) * (y != IGNORE)
            text_nll, text_bytes = text_nll + float((per * (b > 0)).sum()), text_bytes + float(b.sum())
    model.train()
    return nll / count, (text_nll / math.log(2) / text_bytes if text_bytes else None)


def features(arch, model, x):
    """(B, 3C) of rows x: the mean last hidden state of each half (the decoder's for the causal LMs, the
    encoder's else) and their product, whose weighted sum is a similarity of the two halves."""
    h = (model.hidden_states(x) if arch in ("gpt2", "llama") else model.encode(x)).float()
    a, b = h[:, :h.shape[1] // 2].mean(1), h[:, h.shape[1] // 2:].mean(1)
    return torch.cat([a, b, a * b], 1)


def probe_rows(tokens, n, T, seed):
    """n windows of T tokens, half of them one passage (label 1), half a passage's first half joined to
    another's second half (label 0), from offsets drawn with seed; -> (rows (n, T), labels (n,))."""
    g = np.random.default_rng(seed)
    o, other = g.integers(0, len(tokens) - 2 * T, size=(2, n))
    rows = np.stack([tokens[a:a + T].astype(np.int64) for a in o])
    y = np.arange(n) % 2
    for i in np.flatnonzero(y == 0):
        rows[i, T // 2:] = tokens[other[i] + T // 2:other[i] + T]
    return torch.from_numpy(rows), torch.from_numpy(y).float()


@torch.no_grad()
def pooled(arch, model, rows, s, dev, autocast):
    model.eval()
    out = []
    for i in range(0, len(rows), s["batch"]):
        with autocast:
            out.append(features(arch, model, rows[i:i + s["batch"]].to(dev)))
    model.train()
    return torch.cat(out)


def probe(arch, model, fit, test, s, dev, autocast):
    """Held-out accuracy of a logistic regression on frozen features (standardised by the fit set's statistics)."""
    (xf, yf), (xt, yt) = fit, test
    f, t = pooled(arch, model, xf, s, dev, autocast), pooled(arch, model, xt, s, dev, autocast)
    mu, sd = f.mean(0), f.std(0) + 1e-6
    f, t, yf, yt = (f - mu) / sd, (t - mu) / sd, yf.to(dev), yt.to(dev)
    with torch.enable_grad():
        w = torch.zeros(f.shape[1], device=dev, requires_grad=True)
        b = torch.zeros((), device=dev, requires_grad=True)
        opt = torch.optim.Adam([w, b], lr=0.05)
        for _ in range(300):
            loss = torch.nn.functional.binary_cross_entropy_with_logits(f @ w + b, yf) + 1e-3 * w.square().sum()
            opt.zero_grad()
            loss.backward()
            opt.step()
    return float(((t @ w + b > 0).float() == yt).float().mean())


def lr_at(step, s):
    if step < s["warmup"]:
        return s["lr"] * (step + 1) / s["warmup"]
    frac = (step - s["warmup"]) / max(1, s["steps"] - s["warmup"])
    return s["lr"] * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="tiny", choices=SHAPES)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--data", default="stdlib", help="a corpus prepare.prepare reads (stdlib, python, a file or folder)")
    ap.add_argument("--data_root", default="data", help="where the tokenized corpus is cached")
    ap.add_argument("--archs", default=",".join(ARCHS))
    ap.add_argument("--budget", default="flops", choices=("flops", "steps"),
                    help="flops: each model trains for the FLOPs of GPT-2's --steps; steps: all the same steps")
    keys = ("steps", "eval_every", "batch", "seq_len", "vocab", "probe_rows")
    for k in keys:
        ap.add_argument(f"--{k}", type=int, default=None, help=f"override the shape's {k}")
    ap.add_argument("--png", default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    s = dict(SHAPES[args.shape], **{k: getattr(args, k) for k in keys if getattr(args, k) is not None})
    dev = torch.device(args.device)
    autocast = torch.autocast("cuda", torch.bfloat16) if dev.type == "cuda" else torch.autocast("cpu", enabled=False)
    tok = tokenizer.get_tokenizer("cl100k_base", vocab=s["vocab"])
    V, eos = tok.n_vocab, tok.eos_id
    folder = prepare.default_data_dir(args.data, tok.name, s["vocab"], root=args.data_root)
    prepare.prepare(args.data, tok, folder, val_fraction=0.1, verbose=False)
    train_tokens, val_tokens = (np.memmap(os.path.join(folder, f"{k}.bin"), dtype=np.uint16 if V <= 65536 else np.uint32,
                                          mode="r") for k in ("train", "val"))
    t5_lengths = t5.corrupted_lengths(s["seq_len"])
    need = max(s["seq_len"] + 1, t5_lengths[0])
    nbytes = scoring.token_bytes(tok)
    report = {"shape": s, "device": str(dev), "budget": args.budget, "data": args.data, "train_tokens": len(train_tokens),
              "val_tokens": len(val_tokens), "t5_raw_tokens_per_row": t5_lengths[0], "t5_target_len": t5_lengths[1],
              "rows": {}}
    n_sentinels = t5.span_counts(t5_lengths[0])[1]
    fit, test = (probe_rows(val_tokens, s["probe_rows"], s["seq_len"], seed) for seed in (2, 3))
    budget = s["steps"] * flops_per_step("gpt2", build("gpt2", s, V, 0), s, t5_lengths)  # GPT-2's steps set it
    for arch in args.archs.split(","):
        torch.manual_seed(0)
        model = build(arch, s, V, n_sentinels).to(dev)
        fps = flops_per_step(arch, model, s, t5_lengths)
        # the same compute: steps of this model that spend GPT-2's FLOPs (--budget=steps: the same steps)
        steps = max(1, round(budget / fps)) if args.budget == "flops" else s["steps"]
        every = max(1, round(steps * s["eval_every"] / s["steps"]))
        opt = torch.optim.AdamW(optim.param_groups(model, 0.1), lr=s["lr"], betas=(0.9, 0.95))
        train, val = Batches(train_tokens, s, need, 0), Batches(val_tokens, s, need, 1)
        gen, held_gen = torch.Generator().manual_seed(0), torch.Generator().manual_seed(1)
        held = []
        for i in range(0, s["eval_rows"], s["batch"]):
            x, y = make_batch(arch, val.rows, val.offsets(s["batch"]), s, V, eos, t5_lengths, held_gen)
            held.append((x.to(dev), y.to(dev)))
        row = dict(params=sum(p.numel() for p in model.parameters()), block_params=block_params(model),
                   flops_per_step=fps, steps=steps, curve=[])
        sched = dict(s, steps=steps, warmup=max(1, round(s["warmup"] * steps / s["steps"])))
        row["probe_before"] = probe(arch, model, fit, test, s, dev, autocast)
        t0 = time.perf_counter()
        for step in range(steps + 1):
            if step % every == 0 or step == steps:
                loss, bpb = evaluate(arch, model, held, nbytes, autocast)
                row["curve"].append(dict(step=step, flops=step * fps, val_loss=loss, val_bpb=bpb))
                print(f"{arch:6s} step {step:5d}  val loss/predicted token {loss:.4f}" + (f"  bpb {bpb:.4f}" if bpb else ""))
            if step == steps:
                break
            x, y = make_batch(arch, train.rows, train.offsets(s["batch"]), s, V, eos, t5_lengths, gen)
            for g in opt.param_groups:
                g["lr"] = lr_at(step, sched)
            with autocast:
                loss = model(x.to(dev), y.to(dev))
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        row["train_s"] = time.perf_counter() - t0  # includes the evaluations
        row["probe_after"] = probe(arch, model, fit, test, s, dev, autocast)
        print(f"{arch:6s} probe: one passage or two? held-out accuracy {row['probe_before']:.3f} -> {row['probe_after']:.3f}")
        report["rows"][arch] = row
        del model, opt
    print("\n| arch | params | block params | GFLOPs/step | steps | val loss/predicted token | val bpb | probe before -> after"
          " | seconds |")
    print("|---|---|---|---|---|---|---|---|---|")
    for arch, r in report["rows"].items():
        last = r["curve"][-1]
        bpb = f"{last['val_bpb']:.4f}" if last["val_bpb"] else "n/a"
        print(f"| {arch} | {r['params']:,} | {r['block_params']:,} | {r['flops_per_step'] / 1e9:.3f} | {r['steps']} | "
              f"{last['val_loss']:.4f} | {bpb} | {r['probe_before']:.1%} -> {r['probe_after']:.1%} | {r['train_s']:.1f} |")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    if args.png:
        plot(report, args.png)
    return report


def plot(report, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a, b, c) = plt.subplots(1, 3, figsize=(17, 4.5), gridspec_kw=dict(width_ratios=(1, 1, 0.7)))
    what = {"gpt2": "GPT-2 (next token)", "llama": "LLaMA (next token)", "bert": "BERT (masked tokens)",
            "t5": "T5 (span targets)"}
    for arch, r in report["rows"].items():
        flops = [c["flops"] / 1e12 for c in r["curve"]]
        a.plot(flops, [c["val_loss"] for c in r["curve"]], marker="o", ms=3, label=what[arch])
        if r["curve"][-1]["val_bpb"]:
            b.plot(flops, [c["val_bpb"] for c in r["curve"]], marker="o", ms=3, label=what[arch])
    a.set(xlabel="training TFLOPs", ylabel="validation loss per predicted token (nats)",
          title="each on its own objective (not comparable across)")
    b.set(xlabel="training TFLOPs", ylabel="bits per byte (held-out text)", title="causal LMs: bits per byte")
    names = list(report["rows"])
    xs = np.arange(len(names))
    c.bar(xs - 0.2, [report["rows"][n]["probe_before"] for n in names], 0.4, label="untrained")
    c.bar(xs + 0.2, [report["rows"][n]["probe_after"] for n in names], 0.4, label="trained")
    c.axhline(0.5, color="grey", ls="--", lw=1)
    c.set(xticks=xs, xticklabels=names, ylim=(0.4, 1.0), ylabel="held-out accuracy",
          title="probe: one passage or two? (frozen features)")
    for ax in (a, b, c):
        ax.grid(alpha=0.3)
        ax.legend()
    s = report["shape"]
    fig.suptitle(f"{s['n_layer']} layers x {s['n_embd']}, {s['batch']} x {s['seq_len']} tokens/step, the FLOPs of "
                 f"{s['steps']} GPT-2 steps each ({report['budget']}), {report['device']}")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
