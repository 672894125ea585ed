"""QLoRA's base on a GPU: one NF4 weight dequantised, and one NF4 linear's forward + backward, ours next to bitsandbytes'.

    python bench/bench_nf4.py --json=nf4.json           # the Llama-3-8B MLP shapes, 4096 tokens, bf16
    python bench/bench_nf4.py --device=cpu --tiny       # smoke test

Rows per weight shape (out x in), median of --steps CUDA-synchronised calls after --warmup:
dequantise: qlora.NF4Weight.dequantize (quant.nf4_dequantize of the packed codes, double-quantised
absmaxes), bitsandbytes.functional.dequantize_4bit (nf4, compressed statistics); linear: qlora.NF4Linear's
forward + backward (dx; the weight is frozen) of x (tokens x in, bf16), bitsandbytes.matmul_4bit's, and
F.linear on the bf16 weight (the floor). Also how far our dequantised weight lands from bitsandbytes'
(both quantise the same weight).
"""
import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from memory import qlora  # noqa: E402
from memory import quant  # noqa: E402

SHAPES = {"gate/up": (14336, 4096), "down": (4096, 14336), "qkv": (6144, 4096)}


def timed(fn, args):
    for _ in range(args.warmup):
        fn()
    out = []
    for _ in range(args.steps):
        if args.device == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        if args.device == "cuda":
            torch.cuda.synchronize()
        out.append(1e3 * (time.perf_counter() - t))
    return round(statistics.median(out), 3)


class Weight:
    """The buffers qlora.QLoRALinear keeps, as NF4Weight reads them (module and prefix)."""

    def __init__(self, w):
        packed, absmax = quant.nf4_quantize(w, 64)
        self.weight_nf4 = packed
        self.weight_absmax, self.weight_absmax2, self.weight_offset = quant.double_quantize(absmax)
        self.weight_shape = tuple(w.shape)


def rows_for(name, shape, args):
    dev = torch.device(args.device)
    g = torch.Generator(device=dev).manual_seed(0)
    w = torch.randn(shape, device=dev, generator=g, dtype=torch.bfloat16) * 0.02
    x = torch.randn(args.tokens, shape[1], device=dev, generator=g, dtype=torch.bfloat16, requires_grad=True)
    nf4 = qlora.NF4Weight(Weight(w), "weight", 64, True)
    out = []

    def linear(weight):
        def run():
            y = qlora.NF4Linear.apply(x, weight, None, torch.bfloat16)
            y.backward(torch.ones_like(y))
            x.grad = None
        return run

    def dense():
        y = F.linear(x, w)
        y.backward(torch.ones_like(y))
        x.grad = None
    out.append({"shape": name, "row": "dequantise, ours", "ms": timed(lambda: nf4.dequantize(torch.bfloat16), args)})
    out.append({"shape": name, "row": "linear fwd+bwd, ours", "ms": timed(linear(nf4), args)})
    out.append({"shape": name, "row": "linear fwd+bwd, bf16 weight (F.linear)", "ms": timed(dense, args)})
    try:
        import bitsandbytes as bnb
        import bitsandbytes.functional as bf
    except ImportError as e:
        out.append({"shape": name, "row": "bitsandbytes", "skipped": f"needs {e.name}"})
        return out
    q, state = bf.quantize_4bit(w, blocksize=64, compress_statistics=True, quant_type="nf4")
    out.append({"shape": name, "row": "dequantise, bitsandbytes", "ms": timed(lambda: bf.dequantize_4bit(q, state, quant_type="nf4"), args)})

    def theirs():
        y = bnb.matmul_4bit(x, q.t(), quant_state=state)
        y.backward(torch.ones_like(y))
        x.grad = None
    out.append({"shape": name, "row": "linear fwd+bwd, bitsandbytes", "ms": timed(theirs, args)})
    diff = (nf4.dequantize(torch.float32) - bf.dequantize_4bit(q, state, quant_type="nf4").float()).abs()
    out.append({"shape": name, "row": "ours vs bitsandbytes' dequantised weight", "max_abs_diff": diff.max().item(),
                "weight_absmax": w.abs().max().item()})
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--tiny", action="store_true", help="small shapes (a smoke test)")
    p.add_argument("--json", default="")
    args = p.parse_args()
    shapes = {"tiny": (256, 128)} if args.tiny else SHAPES
    if args.tiny:
        args.tokens, args.steps, args.warmup = 64, 2, 1
    rows = [r for name, shape in shapes.items() for r in rows_for(name, shape, args)]
    for r in rows:
        print(json.dumps(r), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu",
                       "torch": torch.__version__, "tokens": args.tokens, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
