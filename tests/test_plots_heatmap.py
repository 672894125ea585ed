"""plots.plot_heatmap: the layers x steps picture of gradstats.py's metrics draws what was logged.

Proves: from a run folder written by logs.Logger (a resumed part repeating a step; one step
without a value for one layer), the rows are the layers in model order (emb, L0, L2, L10, out:
numeric, not text order), never a (layer, kind) group or another metric, each row the logged
values at the logged steps (the later record of a repeated step, NaN where none); the PNG is
written; a folder without the metric says so.
"""
import math
from types import SimpleNamespace

import pytest

import logs
from tools import plots

pytest.importorskip("matplotlib")


def test_heatmap_draws_the_log(tmp_path):
    cfg = SimpleNamespace(out_dir=str(tmp_path), tensorboard=False, wandb=False, mlflow=False)
    layers = ["L10", "emb", "L2", "out", "L0"]
    logger = logs.Logger(cfg, SimpleNamespace(is_main=True))
    for step in (10, 20, 30):
        m = {f"update_ratio/{layer}": step * 1e-4 + i * 1e-5 for i, layer in enumerate(layers)}
        m.update({"update_ratio/L0.q": 5.0, "grad_norm/L0": 7.0, "loss": 1.0})
        if step == 20:
            del m["update_ratio/L2"]
        logger.log(step, m)
    logger.close()
    logger = logs.Logger(cfg, SimpleNamespace(is_main=True))  # resumed: step 30 again, other values
    logger.log(30, {f"update_ratio/{layer}": 0.5 for layer in layers})
    logger.close()
    out = tmp_path / "heat.png"
    got_layers, steps, rows = plots.plot_heatmap(str(tmp_path), str(out), "update_ratio")
    assert got_layers == ["emb", "L0", "L2", "L10", "out"]
    assert steps == [10, 20, 30]
    for layer, row in zip(got_layers, rows):
        i = layers.index(layer)
        want = [10e-4 + i * 1e-5, math.nan if layer == "L2" else 20e-4 + i * 1e-5, 0.5]
        assert row[0] == pytest.approx(want[0]) and row[2] == 0.5
        assert math.isnan(row[1]) if layer == "L2" else row[1] == pytest.approx(want[1])
    assert out.stat().st_size > 1000
    assert plots.plot_heatmap(str(tmp_path), None, "grad_norm")[0] == ["L0"]
    with pytest.raises(ValueError, match="weight_norm/<layer>"):
        plots.plot_heatmap(str(tmp_path), None, "weight_norm")
