"""gpus.py: the one-line refusal of too many local ranks, and the start-up report, from plain
descriptions of machines (no GPU needed).

Proves: more torchrun processes than visible GPUs (1 or 2 visible, or none) raise a UserError that
names the command to type; enough GPUs, or CPU processes, pass. Two RTX 4090s without peer access
are reported once as one kind, with 165 TFLOP/s (gpus.PEAK_TFLOPS) and the missing peer-to-peer
path, and nccl_env sets NCCL_P2P_DISABLE=1 unless the user set it; a T4 is reported without bf16
with what to use instead, and auto_dtype picks float16 for it; peer-connected H200s need nothing.
"""
import pytest

import config
from parallelism import gpus


def machine(name, n, mem=24.0, bf16=True, p2p=True):
    return {"gpus": [dict(index=i, name=name, capability=(8, 9) if bf16 else (7, 5), memory_gib=mem, bf16=bf16,
                          peak_tflops=gpus.peak(name)) for i in range(n)],
            "p2p": {(i, j): p2p for i in range(n) for j in range(n) if i != j}}


def test_too_many_local_ranks():
    with pytest.raises(config.UserError, match=r"2 processes on this machine but only 1 GPU is visible.*python <script>"):
        gpus.check_local_ranks(2, 1)
    with pytest.raises(config.UserError, match=r"--nproc_per_node=2"):
        gpus.check_local_ranks(4, 2)
    with pytest.raises(config.UserError, match="no GPU is visible.*--device=cpu"):
        gpus.check_local_ranks(2, 0)
    gpus.check_local_ranks(2, 2)
    gpus.check_local_ranks(8, 0, use_cuda=False)


def test_report_consumer_pair_without_p2p():
    info = machine("NVIDIA GeForce RTX 4090", 2, p2p=False)
    lines = gpus.report(info)
    assert lines[0] == "GPUs 0,1: NVIDIA GeForce RTX 4090, 24 GiB, bf16, MFU against 165 TFLOP/s"
    assert "no peer-to-peer access between GPUs 0-1" in lines[1] and len(lines) == 2
    assert gpus.nccl_env(info, environ={}) == {"NCCL_P2P_DISABLE": "1"}
    assert gpus.nccl_env(info, environ={"NCCL_P2P_DISABLE": "0"}) == {}  # the user's choice stands
    assert gpus.auto_dtype(info) == "bfloat16"


def test_report_old_and_datacenter_gpus():
    t4 = machine("Tesla T4", 1, mem=15.0, bf16=False)
    lines = gpus.report(t4)
    assert "no bf16" in lines[0] and "peak unknown" in lines[0] and "--dtype=float16" in lines[1]
    assert gpus.auto_dtype(t4) == "float16"
    h200 = machine("NVIDIA H200", 2, mem=139.8)
    assert gpus.report(h200) == ["GPUs 0,1: NVIDIA H200, 139.8 GiB, bf16, MFU against 989 TFLOP/s"]
    assert gpus.nccl_env(h200, environ={}) == {}
    assert gpus.report({"gpus": [], "p2p": {}}) == ["no CUDA GPU visible: running on the CPU"]
