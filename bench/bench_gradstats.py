"""The step-time cost of gradient statistics (gradstats.py), on and off, at a config's shape.

    torchrun --nproc_per_node=2 bench/bench_gradstats.py configs/small.py --every=100 --json=gs.json
    python bench/bench_gradstats.py configs/small.py --every=100 --steps=40 --warmup=5   # one GPU
    python bench/bench_gradstats.py configs/tiny.py --device=cpu --steps=6 --warmup=2 --every=3   # smoke test
    python bench/bench_gradstats.py configs/tiny.py --device=cpu --data_dir=data/<prepared> --out_dir=out/gs
        # real tokens, every statistic logged to out/gs/always/train_metrics.jsonl: plots.py --heatmap=update_ratio

The stage scripts' step (gradstats.Probe.before, net.train_step, net.step with the probe's hooks,
Probe.after logging through logs.Logger) on the config's model, batch and layout (any --override,
pretrain.py's keys), over random tokens or a prepared train.bin (--data_dir). Three runs of the
same steps: `off` (grad_stats_every=0: no hooks, nothing computed), `every` (grad_stats_every=N)
and `always` (every step: the cost of one statistics step). Reported: median and mean step time of
each run, the extra time of a statistics step over an `off` step, that extra divided by --every as
a share of the `off` step (the amortised cost; the goal is <= 2%), and peak memory (CUDA) of each run.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import config
import data
import logs
import optim
import parallel
import pretrain
import tokenizer
import weights
from tools import gradstats


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


def run_steps(cfg, grid, every, steps, warmup, data_dir, logger):
    """Step times (s) of `warmup + steps` steps with grad_stats_every=every, the timed ones only, and
    peak memory in GB."""
    cfg.grad_stats_every = every
    T = cfg.seq_len or cfg.block_size
    net = parallel.parallelize(weights.build_model(cfg, grid), grid, cfg)
    probe = gradstats.Probe(net, cfg)
    accum = cfg.batch_size // (cfg.micro_batch_size * grid.data_world)
    autocast = parallel.autocast(cfg, grid.device)
    src = batches(cfg, grid, T, data_dir)
    sync = torch.cuda.synchronize if grid.device.type == "cuda" else (lambda: None)
    say = print if grid.is_main else (lambda line: None)
    times = []
    logs.reset_peak_memory(grid.device)
    for step in range(warmup + steps):
        optim.set_lr(net.optimizer, step, cfg)
        micro = [(*next(src), {}) for _ in range(accum)]
        sync()
        t0 = time.perf_counter()
        probe.before(step)
        net.train_step(micro, lambda i, loss: (loss / accum, loss.detach() / accum), autocast)
        net.step(cfg.grad_clip, *probe.hooks)
        probe.after(step + 1, logger, say)
        sync()
        if step >= warmup:
            times.append(time.perf_counter() - t0)
    mem = torch.cuda.max_memory_allocated(grid.device) / 1e9 if grid.device.type == "cuda" else None
    del net, probe
    return times, mem


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config", help="a config file (its model, batch and layout), e.g. configs/small.py")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--every", type=int, default=100, help="statistics every N steps (the `every` run)")
    p.add_argument("--data_dir", default="", help="a prepared data folder (train.bin); default random ids")
    p.add_argument("--out_dir", default="", help="each run's statistics to <out_dir>/<mode>/train_metrics.jsonl "
                   "(default: a temporary folder)")
    p.add_argument("--modes", default="off,every,always", help="which runs (the report needs off and always)")
    p.add_argument("--json", default="")
    a, overrides = p.parse_known_args(argv)
    cfg = config.load([a.config] + overrides, extra=pretrain.EXTRA)
    cfg.vocab_size = tokenizer.for_cfg(cfg).n_vocab  # the config's tokenizer (a prepared folder's ids)
    config.validate(cfg, int(os.environ.get("WORLD_SIZE", "1")))
    grid = parallel.init(cfg, cfg.threads)
    rows, out_dir = {}, a.out_dir or tempfile.mkdtemp(prefix="bench_gradstats_")
    for mode in a.modes.split(","):
        every = {"off": 0, "every": a.every, "always": 1}[mode]
        cfg.out_dir = os.path.join(out_dir, mode)
        logger = logs.Logger(cfg, grid)  # statistics steps write their record, as in a stage
        times, mem = run_steps(cfg, grid, every, a.steps, a.warmup, a.data_dir, logger)
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
