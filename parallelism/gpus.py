"""What this machine's GPUs can do, said once at start-up: bf16 or not, peer-to-peer between them or
not (and the NCCL setting that needs), their memory and the peak TFLOP/s that MFU is measured
against; and a one-line refusal when torchrun starts more processes than there are GPUs.

    gpus.check_local_ranks(local_world, torch.cuda.device_count(), use_cuda)  # parallel.init, first
    os.environ.update(gpus.nccl_env(info))       # before init_process_group: NCCL_P2P_DISABLE=1 without p2p
    for line in gpus.report(gpus.describe()): say(line)   # rank 0, once

describe() reads torch.cuda (names, capability, memory, can_device_access_peer for every pair);
report() and nccl_env() take its plain dict, so they run, and are tested, without a GPU. bf16 needs
compute capability 8.0 (Ampere) or newer: on a V100, T4 or RTX 20xx train with dtype float16 and
loss scaling (scaler.py) or float32. Consumer cards (RTX 3090 / 4090) often have no peer-to-peer
path between them; NCCL may then hang unless NCCL_P2P_DISABLE=1, which nccl_env() sets only where
a pair of visible GPUs has no peer access and the user has not set it. Peaks: PEAK_TFLOPS.
"""
import torch

import config

# dense bf16 tensor-core peak, TFLOP/s per GPU (no sparsity): what MFU is measured against
PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0, "RTX 4090": 165.0, "RTX 3090": 71.0}


def check_local_ranks(local_world, visible, use_cuda=True):
    """Refuse, in one line, more processes per machine than visible GPUs (each process takes one)."""
    if not use_cuda or local_world <= visible:
        return
    if visible == 0:
        raise config.UserError(f"torchrun started {local_world} processes for GPUs, but no GPU is visible: "
                               f"run on a GPU machine, or add --device=cpu")
    gpu = "1 GPU is" if visible == 1 else f"{visible} GPUs are"
    fix = "drop torchrun: python <script> ..." if visible == 1 else f"torchrun --nproc_per_node={visible} ..."
    raise config.UserError(f"torchrun started {local_world} processes on this machine but only {gpu} visible "
                           f"(CUDA_VISIBLE_DEVICES): use {fix} (or --nproc_per_node={visible})")


def describe(peers=True):
    """{"gpus": [{index, name, capability, memory_gib, bf16, peak_tflops}], "p2p": {(i, j): bool}}
    (peers=False: p2p left empty)."""
    out = {"gpus": [], "p2p": {}}
    if not torch.cuda.is_available():
        return out
    n = torch.cuda.device_count()
    for i in range(n):
        p = torch.cuda.get_device_properties(i)
        out["gpus"].append(dict(index=i, name=p.name, capability=(p.major, p.minor), memory_gib=p.total_memory / 2**30,
                                bf16=has_bf16(i), peak_tflops=peak(p.name)))
    for i in range(n if peers else 0):
        for j in range(n):
            if i != j:
                out["p2p"][(i, j)] = bool(torch.cuda.can_device_access_peer(i, j))
    return out


def has_bf16(device):
    """bf16 arithmetic in hardware: compute capability 8.0 (Ampere) or newer."""
    return torch.cuda.get_device_capability(device)[0] >= 8


def peak(name):
    """Dense bf16 peak TFLOP/s of a GPU by name (PEAK_TFLOPS), or None when unknown."""
    return next((v for k, v in PEAK_TFLOPS.items() if k in name), None)


def report(info):
    """Lines to print once: one per kind of GPU, then what the machine lacks and what to do about it."""
    gs = info["gpus"]
    if not gs:
        return ["no CUDA GPU visible: running on the CPU"]
    lines, kinds = [], {}
    for g in gs:
        kinds.setdefault((g["name"], round(g["memory_gib"], 1), g["bf16"], g["peak_tflops"]), []).append(g["index"])
    for (name, mem, bf16, tf), idx in kinds.items():
        which = f"GPU {idx[0]}" if len(idx) == 1 else f"GPUs {','.join(map(str, idx))}"
        lines.append(f"{which}: {name}, {mem:g} GiB, {'bf16' if bf16 else 'no bf16'}, "
                     + (f"MFU against {tf:g} TFLOP/s" if tf else "peak unknown: set --peak_tflops for MFU"))
        if not bf16:
            lines.append(f"{name} has no bf16 (compute capability < 8.0): use --dtype=float16 (loss scaling) "
                         f"or --dtype=float32")
    missing = sorted((i, j) for (i, j), ok in info["p2p"].items() if not ok and i < j)
    if missing:
        pairs = ", ".join(f"{i}-{j}" for i, j in missing[:6])
        lines.append(f"no peer-to-peer access between GPUs {pairs}: NCCL goes through host memory "
                     f"(NCCL_P2P_DISABLE=1, so that it cannot hang trying)")
    return lines


def nccl_env(info, environ=None):
    """{"NCCL_P2P_DISABLE": "1"} when some pair of visible GPUs lacks peer access and the variable is
    unset (environ: os.environ by default); {} otherwise. Apply before init_process_group."""
    import os
    environ = os.environ if environ is None else environ
    if "NCCL_P2P_DISABLE" in environ or all(info["p2p"].values()):
        return {}
    return {"NCCL_P2P_DISABLE": "1"}


def auto_dtype(info):
    """'bfloat16' when every visible GPU has it, else 'float16' (then scaler.py's loss scaling)."""
    return "bfloat16" if all(g["bf16"] for g in info["gpus"]) else "float16"
