"""Pictures of a run: the curves of one or more run folders, and an attention map of a prompt.

    python plots.py out/small                          # out/small/run.png
    python plots.py out/small out/small_muon --out=compare.png
    python plots.py out/sft --log=sft                  # the stage's sft_metrics.jsonl
    python plots.py out/small --attention --prompt="def add(a, b):" --layer=3 --head=5 --out=attn.png

Curves come from logs.py's JSONL (<run>/<log>_metrics.jsonl, one record per log step): train and
validation loss against steps and against tokens (step x batch_size x sequence length, from the run's
newest checkpoint config), learning rate, gradient norm, tokens/s, MFU, validation bits per byte
when logged, SFT's held-out accuracy, for MoE models the busiest expert's load, the router losses and
dropped slots, for GRPO runs the reward (training samples, held-out sampled and greedy) and the step's
rollout / reward / learn seconds, for DPO runs rewards, margins, accuracies, log-probs, NLL and their
held-out eval_ twins; one colour per run in every panel (styles), legends beside the panels. A
resumed run appends to its file, repeating the steps after its checkpoint: the last record of a step
wins (what the surviving lineage logged). Panels with nothing logged are left out.

The attention map: one layer's softmax(q k^T / sqrt(D)) with the causal mask, recomputed from the
layer's own input, projections, q/k norms and RoPE (SDPA never materialises the weights), for a
model that sample.load reads (run, checkpoint or HF folder), with a colour bar. matplotlib is
imported lazily.
"""
import argparse
import glob
import json
import math
import os

import torch

import checkpoint
import sample

# (title, x axis, metrics); a panel is drawn when some run logged one of its metrics; each metric's
# held-out twin eval_<metric> (DPO's evaluation) is drawn in the same panel (held_out())
PANELS = [("loss", "step", ("loss", "val_loss")), ("loss", "tokens", ("loss", "val_loss")),
          ("learning rate", "step", ("lr",)), ("gradient norm", "step", ("grad_norm",)),
          ("tokens/s", "step", ("tok_s",)), ("MFU", "step", ("mfu",)),
          ("validation bits per byte", "step", ("val_bpb",)),
          ("held-out accuracy (SFT)", "step", ("accuracy",)),
          ("MoE: busiest expert's load x n_experts", "step", ("load_max",)),
          ("MoE: router losses", "step", ("aux_loss", "z_loss")), ("MoE: dropped share", "step", ("dropped",)),
          ("reward (GRPO)", "step", ("reward", "heldout_reward", "heldout_greedy")),
          ("GRPO step time, s", "step", ("t_rollout", "t_reward", "t_learn")),
          ("DPO: implicit rewards", "step", ("rewards/chosen", "rewards/rejected")),
          ("DPO: reward margin (chosen - rejected)", "step", ("rewards/margins",)),
          ("DPO: accuracies", "step", ("rewards/accuracies", "policy/accuracy")),
          ("DPO: log-probs of the answers", "step", ("logps/chosen", "logps/rejected")),
          ("DPO: NLL of the chosen answers", "step", ("nll",)), ("pairs/s", "step", ("pairs_s",))]
LOG_SCALE = ("loss", "gradient norm")
HELD_OUT = ("val_", "eval_", "heldout_", "accuracy")  # drawn with markers: evaluated every few steps
DASHES = ("-", "--", ":", "-.")            # the metrics of one panel, when colours tell the runs apart


def held_out(names):
    """A panel's metrics and their eval_ twins: (m1, eval_m1, m2, eval_m2, ...)."""
    return tuple(n for m in names for n in (m, "eval_" + m))


def styles(n_runs, run, slot, metric):
    """One colour per run in every panel when several runs are drawn (the metrics of a panel then
    differ by dash); one run: one colour per metric slot of the panel."""
    style = dict(color=f"C{run % 10}", linestyle=DASHES[slot % len(DASHES)]) if n_runs > 1 else dict(
        color=f"C{slot % 10}")
    if metric.startswith(HELD_OUT):
        style.update(marker="o", markersize=3)
    return style


def metrics_file(run_dir, log="train"):
    path = os.path.join(run_dir, f"{log}_metrics.jsonl")
    if os.path.isfile(path):
        return path
    found = sorted(glob.glob(os.path.join(run_dir, "*_metrics.jsonl")))
    raise FileNotFoundError(f"{path} not found" + (f"; this folder has {', '.join(map(os.path.basename, found))}: "
                                                   f"pass --log=<stage>" if found else ": is it a run folder?"))


def read_metrics(path):
    """{metric: {step: value}} of the numeric values of a logs.py JSONL file; a later record of a step
    replaces an earlier one (a resumed run repeats the steps after its checkpoint)."""
    out = {}
    with open(path) as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except ValueError:
                raise ValueError(f"{path}:{i}: not a JSON record") from None
            for k, v in rec.items():
                if k not in ("step", "time") and isinstance(v, (int, float)) and not isinstance(v, bool):
                    out.setdefault(k, {})[rec["step"]] = float(v)
    return out


def step_tokens(run_dir):
    """batch_size x sequence length of the run's newest checkpoint config (None without one)."""
    ckpt = checkpoint.latest(run_dir)
    if ckpt is None:
        return None
    with open(os.path.join(ckpt, "config.json")) as f:
        cfg = json.load(f)
    return cfg["batch_size"] * (cfg.get("seq_len") or cfg["block_size"])


def plot_runs(run_dirs, out, log="train", tokens_per_step=None):
    """One PNG of every panel with data, one line per run and metric; returns what was drawn,
    read back from the figure: {panel title (x axis): {"<run> <metric>": (xs, ys)}}.
    tokens_per_step: for metrics kept without their checkpoints (default: each run's config).
    out=None: nothing is rendered or written (the data only)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    runs = []
    for d in run_dirs:
        runs.append((os.path.basename(os.path.normpath(d)), read_metrics(metrics_file(d, log)),
                     tokens_per_step or step_tokens(d)))
    panels = [(t, x, held_out(names)) for t, x, names in PANELS
              if any(m in metrics for _, metrics, tps in runs for m in held_out(names) if x == "step" or tps)]
    if not panels:
        raise ValueError(f"nothing to plot in {', '.join(run_dirs)}: no logged metric")
    cols = 2
    rows = math.ceil(len(panels) / cols)
    # constrained layout: tick labels and the legends beside each panel get their room (nothing clipped)
    fig, axes = plt.subplots(rows, cols, figsize=(8 * cols, 3.2 * rows), squeeze=False, layout="constrained")
    drawn = {}
    for ax, (title, x, names) in zip(axes.flat, panels):
        for r, (run, metrics, tps) in enumerate(runs):
            for slot, m in enumerate(m for m in names if any(m in ms for _, ms, _ in runs)):
                if m not in metrics or (x == "tokens" and not tps):
                    continue
                steps = sorted(metrics[m])
                xs = [s * tps for s in steps] if x == "tokens" else steps
                ax.plot(xs, [metrics[m][s] for s in steps], label=f"{run} {m}", **styles(len(runs), r, slot, m))
        if title in LOG_SCALE:
            ax.set_yscale("log")
        ax.set(title=title, xlabel=x)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)  # beside, not on, the curves
        drawn[f"{title} ({x})"] = {ln.get_label(): (list(ln.get_xdata()), list(ln.get_ydata())) for ln in ax.lines}
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    if out:
        os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
        fig.savefig(out, dpi=100)
    plt.close(fig)
    return drawn


@torch.no_grad()
def attention_weights(model, ids, layer):
    """(heads, T, T) attention probabilities of layer `layer` for one prompt (a plain model)."""
    attn, seen = model.blocks[layer].attn, {}
    hook = attn.register_forward_pre_hook(lambda m, args: seen.update(args=args))
    try:
        model(torch.tensor([ids], device=next(model.parameters()).device))
    finally:
        hook.remove()
    x, cos, sin = seen["args"][:3]
    return attn.probs(x, cos, sin)[0]


def plot_attention(model, tok, prompt, layer, head, out):
    """A PNG of one head's attention map over the prompt's tokens; returns (token texts, (T, T) weights)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    L, H = len(model.blocks), model.blocks[0].attn.n_head
    if not (0 <= layer < L and 0 <= head < H):
        raise ValueError(f"layer={layer}, head={head}: this model has layers 0..{L - 1} and heads 0..{H - 1}")
    ids = tok.encode(prompt) or [tok.eos_id]
    w = attention_weights(model, ids, layer)[head].cpu()
    labels = [repr(tok.decode([i]))[1:-1] for i in ids]
    size = min(4 + 0.3 * len(ids), 30)
    fig, ax = plt.subplots(figsize=(size, size))
    image = ax.imshow(w.numpy(), cmap="viridis", vmin=0, vmax=1)
    fig.colorbar(image, ax=ax, shrink=0.8, label="attention weight (each row sums to 1)")
    ax.set_xticks(range(len(ids)), labels, rotation=90, fontsize=7)
    ax.set_yticks(range(len(ids)), labels, fontsize=7)
    ax.set(title=f"layer {layer}, head {head}", xlabel="key", ylabel="query")
    fig.tight_layout()
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return labels, w


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", help="run folders (out/<run>); --attention: one run, checkpoint or HF folder")
    p.add_argument("--out", default="", help="PNG path (default <first run>/run.png or <run>/attention.png)")
    p.add_argument("--log", default="train", help="which <log>_metrics.jsonl (train, sft, dpo, grpo, ...)")
    p.add_argument("--tokens_per_step", type=int, default=None,
                   help="batch_size x seq_len, for a metrics file kept without its checkpoints")
    p.add_argument("--attention", action="store_true", help="plot an attention map instead of the curves")
    p.add_argument("--prompt", default="def add(a, b):\n    return a + b\n")
    p.add_argument("--layer", type=int, default=0)
    p.add_argument("--head", type=int, default=0)
    p.add_argument("--device", default="cpu")
    a = p.parse_args(argv)
    try:
        if a.attention:
            model, tok, _ = sample.load(a.runs[0], a.device)
            out = a.out or os.path.join(a.runs[0], "attention.png")
            plot_attention(model, tok, a.prompt, a.layer, a.head, out)
        else:
            out = a.out or os.path.join(a.runs[0], "run.png")
            plot_runs(a.runs, out, a.log, a.tokens_per_step)
    except (FileNotFoundError, ValueError) as e:
        p.error(str(e))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
