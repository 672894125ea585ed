"""Honest observability for every stage: metrics to stdout, JSONL, TensorBoard / W&B / MLflow; MFU.

Only rank 0 writes anything. MLflow (cfg.mlflow): one MLflow run per Logger in experiment
cfg.mlflow_experiment at cfg.mlflow_uri ("": MLflow's default, MLFLOW_TRACKING_URI), through an
MlflowClient (no global active run): the config as params, every numeric metric, and at close the
resolved config (config.json), the metrics file and the PNGs in out_dir as artifacts. MFU = tokens/s * FLOPs per token / (peak * GPUs), with the model's
own FLOPs formula (model.flops_per_token) and the GPU's dense bf16 peak from the table below.
"""
import glob
import json
import os
import resource
import time

import torch

# dense bf16 tensor-core peak, TFLOP/s per GPU (no sparsity)
PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0, "RTX 4090": 165.0, "RTX 3090": 71.0}


def peak_tflops(device, override=0.0):
    """Per-GPU peak for MFU, or None (CPU, unknown GPU without override)."""
    if override > 0:
        return override
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, v in PEAK_TFLOPS.items():
        if key in name:
            return v
    return None


def peak_memory_gb(device):
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e9
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # CPU: peak RSS (kB on Linux)


class Logger:
    def __init__(self, cfg, grid, name="train"):
        self.main = grid.is_main
        self.tb = self.wandb = self.file = self.mlflow = None
        if not self.main:
            return
        os.makedirs(cfg.out_dir, exist_ok=True)
        self.file = open(os.path.join(cfg.out_dir, f"{name}_metrics.jsonl"), "a")
        if cfg.tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
                self.tb = SummaryWriter(os.path.join(cfg.out_dir, "tb"))
            except ImportError:
                print("tensorboard=True but tensorboard is not installed (pip install tensorboard); skipping")
        if cfg.wandb:
            try:
                import wandb
                self.wandb = wandb.init(project=cfg.wandb_project, config=vars(cfg), dir=cfg.out_dir)
            except ImportError:
                print("wandb=True but wandb is not installed (pip install wandb); skipping")
        if getattr(cfg, "mlflow", False):
            try:
                self.mlflow = MLflowRun(cfg)
            except ImportError:
                print("mlflow=True but mlflow is not installed (pip install mlflow); skipping")

    def log(self, step, metrics):
        if not self.main:
            return
        rec = {"step": step, "time": time.time(), **metrics}
        self.file.write(json.dumps(rec) + "\n")
        self.file.flush()
        for k, v in metrics.items():
            if isinstance(v, (int, float)):
                if self.tb:
                    self.tb.add_scalar(k, v, step)
        if self.wandb:
            self.wandb.log({k: v for k, v in metrics.items() if isinstance(v, (int, float))}, step=step)
        if self.mlflow:
            self.mlflow.log(step, rec["time"], metrics)

    def close(self):
        if self.file:
            self.file.close()
        if self.tb:
            self.tb.close()
        if self.wandb:
            self.wandb.finish()
        if self.mlflow:
            self.mlflow.close(self.file.name)


class MLflowRun:
    """One MLflow run of a Logger (see the module docstring); mlflow is imported here, lazily."""

    def __init__(self, cfg):
        import mlflow
        from mlflow.entities import Param
        self.entities = mlflow.entities
        self.client = mlflow.MlflowClient(tracking_uri=getattr(cfg, "mlflow_uri", "") or None)
        name = getattr(cfg, "mlflow_experiment", "ingot")
        exp = self.client.get_experiment_by_name(name)
        exp_id = exp.experiment_id if exp else self.client.create_experiment(name)
        self.cfg, self.out_dir = dict(vars(cfg)), cfg.out_dir
        run = self.client.create_run(exp_id, run_name=os.path.basename(os.path.normpath(cfg.out_dir)),
                                     tags={"out_dir": os.path.abspath(cfg.out_dir)})
        self.run_id = run.info.run_id
        params = [Param(k, str(v)[:6000]) for k, v in sorted(self.cfg.items())]
        for i in range(0, len(params), 100):  # MLflow's batch limit
            self.client.log_batch(self.run_id, params=params[i:i + 100])

    def log(self, step, time_s, metrics):
        ms = [self.entities.Metric(k, float(v), int(time_s * 1000), step) for k, v in metrics.items()
              if isinstance(v, (int, float)) and not isinstance(v, bool)]
        for i in range(0, len(ms), 1000):
            self.client.log_batch(self.run_id, metrics=ms[i:i + 1000])

    def close(self, metrics_path=None):
        self.client.log_dict(self.run_id, self.cfg, "config.json")
        for path in sorted(glob.glob(os.path.join(self.out_dir, "*.png"))) + ([metrics_path] if metrics_path else []):
            self.client.log_artifact(self.run_id, path)
        self.client.set_terminated(self.run_id)


def fmt(metrics):
    """One log line: 'loss 3.2104 | lr 6.00e-04 | ...'."""
    parts = []
    for k, v in metrics.items():
        if isinstance(v, float):
            parts.append(f"{k} {v:.3e}" if (abs(v) < 1e-2 and v != 0) else f"{k} {v:.4g}")
        else:
            parts.append(f"{k} {v}")
    return " | ".join(parts)
