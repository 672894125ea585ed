"""Honest observability for every stage: metrics to stdout, JSONL, TensorBoard / W&B / MLflow; MFU.

Only rank 0 writes anything. MFU = tokens/s * FLOPs per token / (peak * GPUs), with the model's
own FLOPs formula (model.flops_per_token) and the GPU's dense bf16 peak (gpus.PEAK_TFLOPS).
MLflow (cfg.mlflow): one run per Logger in cfg.mlflow_experiment at cfg.mlflow_uri ("": MLflow's
default), through an MlflowClient (no global active run): the config as params, every numeric
metric, and at close config.json, the metrics file and out_dir's PNGs as artifacts.
"""
import glob
import json
import math
import os
import resource
import time

import torch

from config import UserError, need
from parallelism import gpus

# the logs' config keys (eval_every, how often a run evaluates: lifecycle.py)
LOGS_DEFAULTS = dict(
    log_every=10,            # steps between log lines
    progress=True,           # tqdm bar on rank 0
    peak_tflops=0.0,         # per-GPU peak for MFU; 0 -> look up the GPU in a table
    tensorboard=False,       # also log to out_dir/tb (needs tensorboard)
    wandb=False,             # also log to Weights & Biases (needs wandb)
    wandb_project="ingot",   # the W&B project
    mlflow=False,            # also log to MLflow (needs mlflow): params, metrics, config and PNGs as artifacts
    mlflow_uri="",           # MLflow tracking URI, e.g. sqlite:///mlflow.db ("": MLflow's default, MLFLOW_TRACKING_URI)
    mlflow_experiment="ingot",  # the MLflow experiment
)
RESUME_FREE = tuple(LOGS_DEFAULTS)  # a resumed run may change them (lifecycle.RESUME_FREE)


def check(cfg, world=1):
    need(cfg.peak_tflops >= 0, f"peak_tflops={cfg.peak_tflops} must be >= 0")


def peak_tflops(device, override=0.0):
    """Per-GPU peak for MFU, or None (CPU, unknown GPU without override)."""
    if override > 0:
        return override
    if device.type != "cuda":
        return None
    return gpus.peak(torch.cuda.get_device_name(device))


def peak_memory_gb(device):
    """A log line's mem_gb: on a GPU the peak memory allocated since the previous call (the steps
    since the previous log line; checkpoints and evaluations left out: lifecycle.Clock.paused), in
    GB; the peak counter then starts again. On the CPU: the process's peak RSS since its start."""
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device) / 1e9
        reset_peak_memory(device)
        return peak
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # CPU: peak RSS (kB on Linux)


def reset_peak_memory(device):
    """The GPU's peak-memory counter starts again from what is allocated now (CPU: nothing to do)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


class NonFiniteLoss(UserError, FloatingPointError):
    """The loss became inf or nan: the run cannot go on (a learning rate too high, bad data)."""


class Logger:
    """Metrics of rank 0 to out_dir/<name>_metrics.jsonl, TensorBoard, W&B and MLflow (when asked for)."""

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
        if cfg.mlflow:
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

    def report(self, step, metrics, last, write=print):
        """A log step: the metrics logged, one line written on rank 0 ('step 10/300 | loss ...'); a
        loss that is not finite stops the run with NonFiniteLoss, saying what to try."""
        self.log(step, metrics)
        if self.main:
            write(f"step {step}/{last} | " + fmt(metrics))
        loss = metrics.get("loss")
        if isinstance(loss, float) and not math.isfinite(loss):
            raise NonFiniteLoss(f"loss is {loss} at step {step}: lower lr (or warm up longer), or check the data")

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
        self.client = mlflow.MlflowClient(tracking_uri=cfg.mlflow_uri or None)
        name = cfg.mlflow_experiment
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


def add(tally, values):
    """Sum a step's values into tally (a dict, in place): numbers add, [sum, count] pairs add per entry."""
    for k, v in values.items():
        if isinstance(v, list):
            tally[k] = [a + b for a, b in zip(tally.get(k, [0] * len(v)), v)]
        else:
            tally[k] = tally.get(k, 0) + v
    return tally


def means(counted, group=None, device="cpu"):
    """{key: [sum, count]} of this rank -> {key: sum / count over every rank of group} (one all-reduce;
    keys whose count is 0 left out)."""
    flat = torch.tensor([x for v in counted.values() for x in v], device=device, dtype=torch.float64)
    if group is not None and torch.distributed.get_world_size(group) > 1:
        torch.distributed.all_reduce(flat, group=group)
    return {k: s / n for k, (s, n) in zip(counted, flat.view(-1, 2).tolist()) if n}


def fmt(metrics):
    """One log line: 'loss 3.2104 | lr 6.00e-04 | ...'."""
    parts = []
    for k, v in metrics.items():
        if isinstance(v, float):
            parts.append(f"{k} {v:.3e}" if (abs(v) < 1e-2 and v != 0) else f"{k} {v:.4g}")
        else:
            parts.append(f"{k} {v}")
    return " | ".join(parts)
