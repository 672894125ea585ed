"""Launch a function on N CPU processes with the gloo backend, the way torchrun would."""
import os
import socket

import torch
import torch.multiprocessing as mp


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, fn, world, port, args):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    import parallel
    try:
        fn(rank, *args)
    finally:
        parallel.shutdown()


def spawn(fn, world, *args):
    """Run fn(rank, *args) in `world` fresh processes; raises if any of them fails."""
    mp.start_processes(_entry, args=(fn, world, free_port(), args), nprocs=world, join=True,
                       start_method="spawn")
