"""Training steps of long rows straight through the model (no data loader), one process, lengths ascending
after a warm-up step that makes the optimizer state: each step's peak next to plan.predict at its length.
A probe for the plan's long-row terms (issue 58), before sft.py's long rows land.

    python bench/long_probe.py '{"lora_base_dtype": "nf4", "recompute": "block"}' 16384,32768 [--tiny] [--cap_gib=24]
"""
import copy
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch  # noqa: E402

import config  # noqa: E402
import parallel  # noqa: E402
import plan  # noqa: E402
import sft  # noqa: E402
import weights  # noqa: E402

SHAPE = dict(vocab_size=128256, n_layer=32, n_head=32, n_kv_head=8, n_embd=4096, ffn_hidden=14336, rope_theta=500000.0,
             tie_embeddings=False)
TINY = dict(vocab_size=512, n_layer=2, n_head=4, n_kv_head=2, n_embd=64, ffn_hidden=192, tie_embeddings=False)


def main():
    knobs, lengths = json.loads(sys.argv[1]), [int(t) for t in sys.argv[2].split(",")]
    T = max(lengths)
    tiny = "--tiny" in sys.argv
    cap = [float(a.split("=")[1]) for a in sys.argv if a.startswith("--cap_gib=")]
    shape = TINY if tiny else SHAPE
    args = [f"--{k}={v}" for k, v in {**shape, **knobs}.items()] + [
        "--lora_r=16", "--dtype=bfloat16", "--micro_batch_size=1", "--batch_size=1", "--init_from=",
        f"--block_size={T}"] + (["--device=cpu"] if tiny else [])
    cfg = config.load(args, extra=sft.EXTRA, plugins=sft.FAMILY_KEYS)
    cuda = torch.cuda.is_available() and not tiny
    if cuda and cap:
        torch.cuda.set_per_process_memory_fraction(cap[0] * 2 ** 30 / torch.cuda.get_device_properties(0).total_memory)
    grid = parallel.init(cfg)
    t0 = time.time()
    net = parallel.parallelize(weights.build_model(cfg, grid), grid, cfg)
    dev = "cuda" if cuda else "cpu"
    built = time.time() - t0
    for i, t in enumerate([lengths[0]] + lengths):
        x = torch.randint(0, shape["vocab_size"] - 1, (1, t), device=dev)
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        t0 = time.time()
        try:
            with torch.autocast(dev, torch.bfloat16):
                loss = net(x, x, reduction="sum")
            loss.backward()
            net.optimizer.step()
            net.optimizer.zero_grad(set_to_none=True)
            if cuda:
                torch.cuda.synchronize()
            err = ""
        except torch.OutOfMemoryError as e:
            err = "OOM: " + str(e).split(".")[0]
            loss = None
            net.optimizer.zero_grad(set_to_none=True)
        step = time.time() - t0
        peak = torch.cuda.max_memory_allocated() if cuda else 0
        if i == 0:
            continue  # the warm-up step: the optimizer state is made
        c = copy.copy(cfg)
        c.block_size = t
        table = plan.predict(c)
        print(json.dumps(dict(knobs=knobs, T=t, plan_gib=round(table["total"] / 2 ** 30, 3),
                              terms={n: round(b / 2 ** 30, 3) for n, b, _ in table["rows"]},
                              measured_gib=round(peak / 2 ** 30, 3), step_s=round(step, 2), tok_s=round(t / step),
                              build_s=round(built, 1), error=err)), flush=True)
        if err:
            break

if __name__ == "__main__":
    main()
