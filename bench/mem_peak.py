"""What holds a stage's GPU memory at its peak: the stage script runs in this process (capped at CAP_GIB,
0: no cap) with CUDA's allocation history recorded (Python stacks); at exit (an OOM included) the history is
replayed and what was live at its peak is written to OUT, grouped by the innermost three frames in the repo
(file:line function), largest first: the terms a plan.py prediction missed, by name.

    python bench/mem_peak.py 24 peak.txt sft.py configs/sft_small.py --init_from=<8B folder> --max_steps=2 ...

Recording slows allocations; the peak is the replay's (max_memory_allocated printed beside). GPU only."""
import atexit
import collections
import os
import runpy
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def key(frames):
    own = [f for f in frames if f["filename"].startswith(ROOT) and "mem_peak" not in f["filename"]]
    chain = [f"{os.path.relpath(f['filename'], ROOT)}:{f['line']} {f['name']}" for f in own[:3]]
    return " <- ".join(chain) or (frames[0]["filename"].split("/")[-1] + ":" + frames[0]["name"] if frames else "?")


def dump(out):
    snap = torch.cuda.memory._snapshot()
    ev = snap["device_traces"][0]
    live, total, peak, at = {}, 0, 0, 0
    for i, e in enumerate(ev):
        if e["action"] == "alloc":
            live[e["addr"]] = e["size"]
            total += e["size"]
        elif e["action"] == "free_completed" and e["addr"] in live:
            total -= live.pop(e["addr"])
        if total > peak:
            peak, at = total, i
    live = {}
    for e in ev[:at + 1]:
        if e["action"] == "alloc":
            live[e["addr"]] = e
        elif e["action"] == "free_completed":
            live.pop(e["addr"], None)
    groups = collections.Counter()
    count = collections.Counter()
    for e in live.values():
        k = key(e.get("frames", []))
        groups[k] += e["size"]
        count[k] += 1
    with open(out, "w") as f:
        f.write(f"events {len(ev)} | peak of the replay {peak / 2**30:.3f} GiB at event {at} | "
                f"max_memory_allocated {torch.cuda.max_memory_allocated() / 2**30:.3f} GiB\n")
        f.write(f"peak event: {key(ev[at].get('frames', []))}\n")
        for k, b in groups.most_common(40):
            f.write(f"{b / 2**30:8.3f} GiB {count[k]:6d}x  {k}\n")


def main():
    if len(sys.argv) < 4 or not torch.cuda.is_available():
        sys.exit(__doc__.split("\n\n")[1] + "\n(needs a CUDA GPU)")
    gib, out = float(sys.argv[1]), sys.argv[2]
    sys.argv = sys.argv[3:]
    if gib:
        torch.cuda.set_per_process_memory_fraction(gib * 2**30 / torch.cuda.get_device_properties(0).total_memory)
    torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="python")
    atexit.register(dump, out)
    sys.path.insert(0, ROOT)
    runpy.run_path(os.path.join(ROOT, sys.argv[0]) if not os.path.isabs(sys.argv[0]) else sys.argv[0],
                   run_name="__main__")


if __name__ == "__main__":
    main()
