"""logs.py's MLflow backend: a tiny run's params, metrics and artifacts, read back through MLflow.

Proves, against a real local tracking store (sqlite in a temporary folder): a Logger with
cfg.mlflow creates one MLflow run in cfg.mlflow_experiment named after out_dir; every config key
is a param (its str); each numeric metric of every logged step of a 3-step training of a tiny model
is in the metric history at its step with its value (strings such as "n/a" and booleans are left
out; a second Logger on the same experiment is a second run); at close the resolved config
(config.json, equal to the config), the metrics file and the run's PNGs are artifacts, and the run
is FINISHED.
"""
import json
import os
from types import SimpleNamespace

import pytest
import torch

import logs
from distributed import train_cfg
from model import ModelConfig, Transformer

mlflow = pytest.importorskip("mlflow")


def test_mlflow_holds_a_tiny_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the sqlite store's default artifact root is relative to the cwd
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    cfg = train_cfg(dict(vocab_size=64, n_layer=1, n_head=2, n_embd=16, block_size=8),
                    out_dir=str(tmp_path / "tiny"), mlflow=True, mlflow_uri=uri, mlflow_experiment="ingot-test")
    torch.manual_seed(0)
    model = Transformer(ModelConfig.from_cfg(cfg))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    logger = logs.Logger(cfg, SimpleNamespace(is_main=True))
    logged = []
    for step in range(1, 4):
        x = torch.randint(0, 64, (2, 8))
        loss = model(x, x)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).item()
        opt.step()
        opt.zero_grad()
        m = {"loss": loss.item(), "grad_norm": norm, "grad_norm/L0.q": norm / 3, "mfu": "n/a", "flag": True, "n": step}
        logger.log(step, m)
        logged.append((step, m))
    (tmp_path / "tiny" / "run.png").write_bytes(b"\x89PNG\r\n\x1a\nnot really")
    logger.close()
    logs.Logger(cfg, SimpleNamespace(is_main=True)).close()  # a second run of the same experiment

    client = mlflow.MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name("ingot-test")
    runs = client.search_runs([exp.experiment_id], order_by=["attributes.start_time ASC"])
    assert len(runs) == 2
    run = runs[0]
    assert run.info.run_name == "tiny" and run.info.status == "FINISHED"
    assert run.data.params == {k: str(v) for k, v in vars(cfg).items()}
    for key in ("loss", "grad_norm", "grad_norm/L0.q", "n"):
        hist = sorted((h.step, h.value) for h in client.get_metric_history(run.info.run_id, key))
        assert hist == [(s, pytest.approx(float(m[key]))) for s, m in logged], key
    assert "mfu" not in run.data.metrics and "flag" not in run.data.metrics
    arts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert arts == {"config.json", "run.png", "train_metrics.jsonl"}
    local = client.download_artifacts(run.info.run_id, "config.json", str(tmp_path / "dl"))
    assert json.load(open(local)) == json.loads(json.dumps(vars(cfg)))
    png = client.download_artifacts(run.info.run_id, "run.png", str(tmp_path / "dl"))
    assert open(png, "rb").read() == (tmp_path / "tiny" / "run.png").read_bytes()
    assert os.path.getsize(client.download_artifacts(run.info.run_id, "train_metrics.jsonl", str(tmp_path / "dl"))) > 0
