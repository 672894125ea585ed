"""Pictures of a run: the curves of one or more run folders, and an attention map of a prompt.

    python -m tools.plots out/small                          # out/small/run.png
    python -m tools.plots out/small out/small_muon --out=compare.png
    python -m tools.plots out/sft_tiny                       # any stage's run: its train_metrics.jsonl
    python -m tools.plots out/small --attention --prompt="def add(a, b):" --layer=3 --head=5 --out=attn.png
    python -m tools.plots out/small --heatmap=update_ratio   # layers x steps of gradient statistics
    python -m tools.plots --grpo out/grpo_tiny               # why a GRPO run does (not) learn: out/grpo_tiny/grpo.png
    python -m tools.plots --life out/life_small/pretrain out/life_small/sft out/life_small/dpo out/life_small/grpo   # report.md, .png

Curves come from logs.py's JSONL (<run>/<log>_metrics.jsonl, one record per log step): train and
validation loss against steps and against tokens (step x batch_size x sequence length, from the run's
newest checkpoint config), learning rate, gradient norm, tokens/s, MFU, validation bits per byte
when logged, SFT's held-out accuracy, for MoE models the busiest expert's load, the router losses and
dropped slots, for GRPO runs the reward (training samples, held-out sampled and greedy) and the step's
rollout / reward / learn seconds, for DPO runs rewards, margins, accuracies, log-probs, NLL and their
held-out eval_ twins; one colour per run in every panel (styles), legends beside the panels. A
resumed run appends to its file, repeating the steps after its checkpoint: the last record of a step
wins (what the surviving lineage logged). Panels with nothing logged are left out.

The heat map: one gradstats.py metric per layer (grad_norm, update_ratio, weight_norm: the keys
<metric>/emb, <metric>/L<i>, <metric>/out), layers down, logged steps across, log colour scale.

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
from tools import gradstats

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
# --grpo: why a GRPO run does (not) learn, one PNG (posttrain/diagnose.py's warnings read the same metrics)
GRPO_PANELS = [("GRPO: held-out accuracy (greedy, sampled) and training reward", "step",
                ("heldout_greedy", "heldout_reward", "reward")),
               ("GRPO: entropy of the samples, nats per token", "step", ("entropy",)),
               ("GRPO: share of informative groups (unequal rewards)", "step", ("informative_groups",))]
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


def plot_runs(run_dirs, out, log="train", tokens_per_step=None, panels=PANELS):
    """One PNG of every panel with data, one line per run and metric; returns what was drawn,
    read back from the figure: {panel title (x axis): {"<run> <metric>": (xs, ys)}}.
    tokens_per_step: for metrics kept without their checkpoints (default: each run's config).
    out=None: nothing is rendered or written (the data only). panels: PANELS, or GRPO_PANELS (--grpo)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    runs = []
    for d in run_dirs:
        metrics = read_metrics(metrics_file(d, log))
        if "frac_equal_groups" in metrics:
            metrics["informative_groups"] = {s: 1 - v for s, v in metrics["frac_equal_groups"].items()}
        runs.append((os.path.basename(os.path.normpath(d)), metrics, tokens_per_step or step_tokens(d)))
    panels = [(t, x, held_out(names)) for t, x, names in panels
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


def plot_heatmap(run_dir, out, metric="update_ratio", log="train"):
    """A PNG of <metric>/<layer> over layers x steps; returns (layers, steps, rows of values,
    NaN where a step has no value). out=None: the data only."""
    metrics = read_metrics(metrics_file(run_dir, log))
    layers = gradstats.layer_order([k.split("/", 1)[1] for k in metrics if k.startswith(metric + "/")
                                    and gradstats.LAYER.fullmatch(k.split("/", 1)[1])])
    if not layers:
        raise ValueError(f"no {metric}/<layer> metrics in {run_dir}: was it run with gradient statistics on?")
    steps = sorted({s for layer in layers for s in metrics[f"{metric}/{layer}"]})
    rows = [[metrics[f"{metric}/{layer}"].get(s, math.nan) for s in steps] for layer in layers]
    if out:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.colors import LogNorm
        fig, ax = plt.subplots(figsize=(min(4 + 0.15 * len(steps), 16), 1.5 + 0.3 * len(layers)))
        positive = [v for r in rows for v in r if v > 0]
        im = ax.imshow(rows, aspect="auto", cmap="magma", interpolation="nearest",
                       norm=LogNorm(min(positive), max(positive)) if positive else None)
        ax.set_yticks(range(len(layers)), layers, fontsize=7)
        ticks = list(range(0, len(steps), max(1, len(steps) // 10)))
        ax.set_xticks(ticks, [steps[i] for i in ticks], fontsize=7)
        ax.set(title=f"{os.path.basename(os.path.normpath(run_dir))}: {metric}", xlabel="step", ylabel="layer")
        fig.colorbar(im, ax=ax)
        fig.tight_layout()
        os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
        fig.savefig(out, dpi=100)
        plt.close(fig)
    return layers, steps, rows


@torch.no_grad()
def attention_weights(model, ids, layer):
    """(heads, T, T) attention probabilities of layer `layer` for one prompt (a plain model)."""
    attn, seen = model.blocks[layer].attn, {}
    hook = attn.register_forward_pre_hook(lambda m, args: seen.update(args=args))
    try:
        model(torch.tensor([ids], device=next(model.parameters()).device))
    finally:
        hook.remove()
    return attn.probs(*seen["args"][:5])[0]  # x, cos, sin and the forward's mask (ALiBi, sliding window)


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
    p.add_argument("--heatmap", default="", help="a gradstats metric (grad_norm, update_ratio, weight_norm): "
                   "layers x steps instead of the curves")
    p.add_argument("--prompt", default="def add(a, b):\n    return a + b\n")
    p.add_argument("--layer", type=int, default=0)
    p.add_argument("--head", type=int, default=0)
    p.add_argument("--device", default="cpu")
    p.add_argument("--grpo", action="store_true", help="a GRPO run's held-out greedy and sampled accuracy, training "
                   "reward, entropy and informative groups (default <first run>/grpo.png)")
    p.add_argument("--life", action="store_true", help="runs are a life's stages in order (pretrain, sft, dpo, "
                   "grpo): --out is a folder that gets report.md and report.png (life_report)")
    a = p.parse_args(argv)
    try:
        if a.life:
            out = a.out or os.path.join(os.path.dirname(os.path.abspath(a.runs[0])), "report")
            stages = dict(zip(("pretrain", "sft", "dpo", "grpo"), a.runs))
            os.makedirs(out, exist_ok=True)
            print(life_report({s: os.path.join(r, "train_metrics.jsonl") for s, r in stages.items()}, out))
        elif a.attention:
            model, tok, _ = sample.load(a.runs[0], a.device)
            out = a.out or os.path.join(a.runs[0], "attention.png")
            plot_attention(model, tok, a.prompt, a.layer, a.head, out)
        elif a.heatmap:
            out = a.out or os.path.join(a.runs[0], f"{a.heatmap}.png")
            plot_heatmap(a.runs[0], out, a.heatmap, a.log)
        else:
            out = a.out or os.path.join(a.runs[0], "grpo.png" if a.grpo else "run.png")
            plot_runs(a.runs, out, a.log, a.tokens_per_step, GRPO_PANELS if a.grpo else PANELS)
    except (FileNotFoundError, ValueError) as e:
        p.error(str(e))
    print(f"wrote {out}")


# ----------------------------------------------------------------------------- a model's life, one report

LIFE = {  # stage -> [(label, metric key)] of the held-out metrics its report row shows, before -> after
    "pretrain": [("validation loss (nats / token)", "val_loss")],
    "sft": [("held-out accuracy, greedy", "accuracy"), ("held-out loss", "val_loss")],
    "dpo": [("held-out reward accuracy", "eval_rewards/accuracies"),
            ("held-out policy preference accuracy", "eval_policy/accuracy")],
    "grpo": [("held-out accuracy, greedy (strict)", "heldout_strict"), ("held-out accuracy, greedy (lenient)",
             "heldout_lenient"), ("held-out reward, sampled", "heldout_reward")],
}


def life_report(metrics, out):
    """metrics: {stage: its train_metrics.jsonl} (pretrain, sft, dpo, grpo, in life order) -> the report's
    markdown table (also out/report.md): each stage's held-out metrics at its first and last evaluation,
    its steps and minutes; and out/report.png: each stage's training curve and held-out points."""
    rows, lines = {}, ["| stage | held-out metric | before | after | steps | minutes |", "|---|---|---:|---:|---:|---:|"]
    for stage, path in metrics.items():
        rows[stage] = [json.loads(line) for line in open(path)]
        recs = rows[stage]
        steps = max(r["step"] for r in recs)
        minutes = (recs[-1]["time"] - recs[0]["time"]) / 60
        for label, key in LIFE.get(stage, []):
            seen = [(r["step"], r[key]) for r in recs if key in r]
            if len(seen) < 2:
                continue
            (s0, v0), (s1, v1) = seen[0], seen[-1]
            f = (lambda v: f"{v:.1%}") if "accuracy" in label or "reward" in label else (lambda v: f"{v:.3f}")
            lines.append(f"| {stage} | {label} | {f(v0)} (step {s0}) | {f(v1)} (step {s1}) | {steps} | {minutes:.1f} |")
    text = "\n".join(lines) + "\n"
    with open(os.path.join(out, "report.md"), "w") as f:
        f.write(text)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(rows), figsize=(5 * len(rows), 3.8), layout="constrained", squeeze=False)
    for ax, (stage, recs) in zip(axes[0], rows.items()):
        train = "reward" if stage == "grpo" else "loss"
        pts = [(r["step"], r[train]) for r in recs if train in r and "lr" in r]
        ax.plot(*zip(*pts), color="0.6", label=f"training {train}") if pts else None
        ax.set(title=stage, xlabel="step")
        twin = ax.twinx()
        for i, (label, key) in enumerate(LIFE.get(stage, [])):
            seen = [(r["step"], r[key]) for r in recs if key in r]
            if seen:
                twin.plot(*zip(*seen), marker="o", color=f"C{i}", label=label)
        handles = ax.get_legend_handles_labels()[0] + twin.get_legend_handles_labels()[0]
        ax.legend(handles, [h.get_label() for h in handles], fontsize=7, loc="upper center",
                  bbox_to_anchor=(0.5, -0.18), ncol=1, frameon=False)
    fig.savefig(os.path.join(out, "report.png"), dpi=110)
    plt.close(fig)
    return text


if __name__ == "__main__":
    main()
