"""plots.py's pictures as a reader sees them (issue 32): what is drawn where, read back from the figure.

Proves, for two DPO run folders logged by logs.Logger with dpo.py's metric names (training records
and held-out eval_ records):
- the DPO panels exist (implicit rewards chosen / rejected, margin, accuracies, log-probs, NLL) and
  draw the logged values, each metric with its eval_ twin in the same panel;
- one colour per run in every panel: every line of run A has one colour, every line of run B
  another, in all panels; the metrics of a panel differ by dash; one run alone: one colour per
  metric of a panel;
- after drawing, no legend overlaps its panel's plotting area, and every y tick label lies inside
  the figure (nothing clipped);
- the attention map has a colour bar (a second axes, labelled) next to the map.
"""
from types import SimpleNamespace

import pytest
import torch

import logs
import tokenizer
from model import ModelConfig, Transformer
from tools import plots

pytest.importorskip("matplotlib")
import matplotlib.colors  # noqa: E402
import matplotlib.figure  # noqa: E402
from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: E402

DPO = ("loss", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
       "logps/rejected", "policy/accuracy", "nll")


def log_dpo(folder, scale):
    """A DPO run folder: training records every 10 steps, held-out (eval_) records every 20."""
    logger = logs.Logger(SimpleNamespace(out_dir=str(folder), tensorboard=False, wandb=False, mlflow=False),
                         SimpleNamespace(is_main=True))
    written = {}
    for s in range(0, 61, 10):
        m = {k: scale * (i + 1) * (1 + s / 60) for i, k in enumerate(DPO)}
        if s:
            logger.log(s, {**m, "lr": 5e-5, "grad_norm": 1.0 + s / 60, "pairs_s": 30.0})
            written.update({(k, s): v for k, v in m.items()})
        if s % 20 == 0:
            logger.log(s, {"eval_" + k: v / 2 for k, v in m.items()})
            written.update({("eval_" + k, s): v / 2 for k, v in m.items()})
    logger.close()
    return written


@pytest.fixture
def figures(monkeypatch):
    """Every figure plots.py saves (savefig still writes the file)."""
    saved, save = [], matplotlib.figure.Figure.savefig

    def spy(fig, *args, **kwargs):
        saved.append(fig)
        return save(fig, *args, **kwargs)
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", spy)
    return saved


def overlaps(a, b):
    return a.x0 < b.x1 and b.x0 < a.x1 and a.y0 < b.y1 and b.y0 < a.y1


def test_dpo_panels_colours_legends(tmp_path, figures):
    a, b = tmp_path / "dpo_a", tmp_path / "dpo_b"
    wa, _ = log_dpo(a, 1.0), log_dpo(b, 2.0)
    drawn = plots.plot_runs([str(a), str(b)], str(tmp_path / "compare.png"), log="train")
    assert (tmp_path / "compare.png").read_bytes()[:4] == b"\x89PNG"
    for panel, metrics in [("DPO: implicit rewards (step)", ("rewards/chosen", "rewards/rejected")),
                           ("DPO: reward margin (chosen - rejected) (step)", ("rewards/margins",)),
                           ("DPO: accuracies (step)", ("rewards/accuracies", "policy/accuracy")),
                           ("DPO: log-probs of the answers (step)", ("logps/chosen", "logps/rejected")),
                           ("DPO: NLL of the chosen answers (step)", ("nll",)), ("loss (step)", ("loss",))]:
        for m in metrics:
            for name in (m, "eval_" + m):
                steps = sorted(s for k, s in wa if k == name)
                assert drawn[panel][f"dpo_a {name}"] == (steps, [wa[name, s] for s in steps]), (panel, name)
    fig = figures[-1]
    canvas = FigureCanvasAgg(fig)  # plt.close() took the saved figure's canvas away: draw it again
    canvas.draw()
    renderer, box = canvas.get_renderer(), fig.bbox
    colours = {"dpo_a": set(), "dpo_b": set()}
    for ax in fig.axes:
        if not ax.lines:
            continue
        dashes = {}
        for ln in ax.lines:
            run, metric = ln.get_label().split(" ", 1)
            colours[run].add(matplotlib.colors.to_hex(ln.get_color()))
            dashes.setdefault(metric, set()).add(ln.get_linestyle())
        assert all(len(d) == 1 for d in dashes.values())  # a metric has one dash in both runs
        legend = ax.get_legend().get_window_extent(renderer)
        assert not overlaps(legend, ax.get_window_extent(renderer)), ax.get_title()
        lo, hi = sorted(ax.get_ylim())
        for loc, label in zip(ax.get_yticks(), ax.get_yticklabels()):
            if lo <= loc <= hi and label.get_text():  # the ticks drawn (matplotlib keeps some beyond the limits)
                e = label.get_window_extent(renderer)
                assert box.x0 <= e.x0 and e.x1 <= box.x1 and box.y0 <= e.y0 and e.y1 <= box.y1, ax.get_title()
    assert len(colours["dpo_a"]) == len(colours["dpo_b"]) == 1 and colours["dpo_a"] != colours["dpo_b"]
    plots.plot_runs([str(a)], str(tmp_path / "one.png"))  # one run: one colour per metric of a panel
    rewards = next(ax for ax in figures[-1].axes if ax.get_title() == "DPO: implicit rewards")
    assert len({matplotlib.colors.to_hex(ln.get_color()) for ln in rewards.lines}) == 4


def test_attention_has_a_colour_bar(tmp_path, figures):
    tok = tokenizer.get_tokenizer("cl100k_base", 300)
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=tok.n_vocab, block_size=32, n_layer=1, n_head=2, n_embd=16)).eval()
    plots.plot_attention(model, tok, "def add(a, b):", 0, 1, str(tmp_path / "attn.png"))
    fig = figures[-1]
    assert len(fig.axes) == 2 and fig.axes[1].get_ylabel().startswith("attention weight")
    assert fig.axes[1].get_ylim() == (0.0, 1.0)
