"""The step-time cost of gradient statistics (gradstats.py), on and off, at a config's shape.

    torchrun --nproc_per_node=2 bench/bench_gradstats.py configs/small.py --every=100 --json=gs.json
    python bench/bench_gradstats.py configs/tiny.py --device=cpu --steps=6 --warmup=2 --every=3   # smoke test
    python bench/bench_gradstats.py configs/tiny.py --device=cpu --data_dir=data/<prepared> --out_dir=out/gs
        # real tokens, every statistic logged to out/gs/train_metrics.jsonl: python plots.py out/gs --heatmap=update_ratio

The training step of the stage scripts (micro-steps of forward + backward, finish, clip, AdamW /
Muon step, zero_grad) on the config's model, batch and layout (any --override), over random tokens
or a prepared train.bin (--data_dir). Three runs of the same steps: `off` (no statistics: no
hooks, nothing computed), `every` (statistics on every --every-th step) and `always` (every step:
the cost of one statistics step). A statistics step arms the activation hooks before the
micro-steps (a compiled forward: one extra eager no_grad forward of the last micro-batch instead,
hooks do not fire inside a compiled graph), takes GradStats.grads() before clipping, a snapshot
before the optimizer step, updates() and collect() after it, and the RatioWatch check. Reported:
median and mean step time of each run, the extra time of a statistics step over an `off` step, that
extra divided by --every as a share of the `off` step (the amortised cost; the goal is <= 2%), and
peak memory (CUDA) of each run.
"""
import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import config
import data
import fsdp
import gradstats
import logs
import optim
import parallel
from model import ModelConfig, Transformer


def batches(cfg, grid, T, data_dir):
    """An endless source of (x, y) micro-batches: random ids, or the prepared train.bin."""
    if data_dir:
        loader = data.Loader(os.path.join(data_dir, "train.bin"), cfg.micro_batch_size, T, grid.data_rank,
                             grid.data_world, seed=cfg.seed, device=grid.device)
        while True:
            yield loader.next()
    g = torch.Generator().manual_seed(cfg.seed + grid.data_rank)
    while True:
        x = torch.randint(0, cfg.vocab_size, (cfg.micro_batch_size, T + 1), generator=g).to(grid.device)
        yield x[:, :-1], x[:, 1:]


def run_steps(cfg, grid, mode, every, steps, warmup, data_dir, logger=None):
    """Step times (s) of `warmup + steps` steps, the timed ones only, and peak memory in GB."""
    torch.manual_seed(cfg.seed)
    T = cfg.seq_len or cfg.block_size
    raw = Transformer(ModelConfig.from_cfg(cfg)).to(grid.device)
    run = parallel.parallelize(raw, grid, cfg)
    stats = gradstats.GradStats(run.model, grid, owner=getattr(run.optimizer, "grad_owner", None))
    acts = gradstats.Activations(run.raw, grid)
    watch = gradstats.RatioWatch()
    accum = cfg.batch_size // (cfg.micro_batch_size * grid.data_world)
    dtype = parallel.amp_dtype(cfg, grid.device)
    autocast = torch.autocast(grid.device.type, dtype=dtype) if dtype == torch.bfloat16 else contextlib.nullcontext()
    src = batches(cfg, grid, T, data_dir)
    sync = torch.cuda.synchronize if grid.device.type == "cuda" else (lambda: None)
    times = []
    if grid.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(grid.device)
    for step in range(warmup + steps):
        on = mode == "always" or (mode == "every" and step % every == 0)
        for g in run.optimizer.param_groups:
            g["lr"] = optim.lr_at(step, cfg) * g.get("lr_scale", 1.0)
        sync()
        t0 = time.perf_counter()
        if on and not cfg.compile:
            acts.arm()
        for micro in range(accum):
            x, y = next(src)
            with run.model.no_sync() if micro < accum - 1 else contextlib.nullcontext():
                with autocast:
                    loss = run.fwd(x, y) / accum
                loss.backward()
        run.model.finish()
        if on:
            m = stats.grads()
            before = stats.snapshot()
        norm = run.clip_grad_norm_(cfg.grad_clip or float("inf"))
        run.optimizer.step()
        if on:
            m.update(stats.updates(before))
            if cfg.compile:  # the hooks see nothing inside the compiled graph: one eager forward
                acts.arm()
                with torch.no_grad(), autocast:
                    (run.model if isinstance(run.model, fsdp.FSDP) else run.raw)(x, y)
            m.update(acts.collect())
            for line in watch.check(step, m):
                if grid.is_main:
                    print(line)
        run.model.zero_grad(set_to_none=True)
        sync()
        if step >= warmup:
            times.append(time.perf_counter() - t0)
        if logger is not None:
            logger.log(step + 1, {"loss": loss.item() * accum, "grad_norm": norm.item(), **(m if on else {})})
    mem = torch.cuda.max_memory_allocated(grid.device) / 1e9 if grid.device.type == "cuda" else None
    del run, raw
    return times, mem


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config", help="a config file (its model, batch and layout), e.g. configs/small.py")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--every", type=int, default=100, help="statistics every N steps (the `every` run)")
    p.add_argument("--data_dir", default="", help="a prepared data folder (train.bin); default random ids")
    p.add_argument("--out_dir", default="", help="also log the `always` run's statistics to <out_dir>/train_metrics.jsonl")
    p.add_argument("--modes", default="off,every,always", help="which runs (the report needs off and always)")
    p.add_argument("--json", default="")
    a, overrides = p.parse_known_args(argv)
    cfg = config.load([a.config] + overrides)
    if not a.data_dir:
        cfg.vocab_size = cfg.tokenizer_vocab or cfg.vocab_size
    else:  # the tokenizer the folder was prepared with (the config's)
        cfg.vocab_size = data.tokenizer_for(cfg).n_vocab
    grid = parallel.init(cfg)
    rows = {}
    for mode in a.modes.split(","):
        logger = None
        if mode == "always" and a.out_dir:
            cfg.out_dir = a.out_dir
            logger = logs.Logger(cfg, grid)
        times, mem = run_steps(cfg, grid, mode, a.every, a.steps, a.warmup, a.data_dir, logger)
        if logger:
            logger.close()
        rows[mode] = {"median_ms": 1e3 * statistics.median(times), "mean_ms": 1e3 * statistics.mean(times),
                      "peak_gb": mem}
    rep = {"config": a.config, "overrides": overrides, "world": grid.world, "every": a.every, "steps": a.steps,
           "device": torch.cuda.get_device_name(grid.device) if grid.device.type == "cuda" else "cpu",
           "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                    cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip(),
           "rows": rows}
    if {"off", "always"} <= set(rows):
        off, one = rows["off"]["median_ms"], rows["always"]["median_ms"]
        rep.update(stats_step_extra_ms=one - off, amortised_pct=100 * (one - off) / a.every / off)
    if {"off", "every"} <= set(rows):
        rep["every_vs_off_pct"] = 100 * (rows["every"]["mean_ms"] / rows["off"]["mean_ms"] - 1)
    if grid.is_main:
        print("| run | median ms | mean ms | peak GB |\n|---|---|---|---|")
        for mode, r in rows.items():
            print(f"| {mode} | {r['median_ms']:.2f} | {r['mean_ms']:.2f} | {r['peak_gb'] if r['peak_gb'] is None else round(r['peak_gb'], 2)} |")
        if "amortised_pct" in rep:
            print(f"a statistics step costs {rep['stats_step_extra_ms']:.2f} ms more than an off step; every "
                  f"{a.every} steps that is {rep['amortised_pct']:.3f}% of a step")
        if "every_vs_off_pct" in rep:
            print(f"mean step of the every-{a.every} run vs the off run: {rep['every_vs_off_pct']:+.2f}%")
        if a.json:
            with open(a.json, "w") as f:
                json.dump(rep, f, indent=1)
    parallel.shutdown()


if __name__ == "__main__":
    main()
