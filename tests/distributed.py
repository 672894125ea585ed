"""Helpers shared by the tests: launch a function on N CPU processes with the gloo backend, the
way torchrun would, compare results with a one-process run by relative error, record the
matrices Newton-Schulz sees, and build the tiny training configs and global batches the
equivalence tests train on."""
import collections
import contextlib
import os
import socket
from types import SimpleNamespace

import torch
import torch.multiprocessing as mp

import config
import lifecycle
import muon
import parallel

G = 8  # sequences in the global batch of the equivalence tests


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, fn, world, port, args, env, cwd):
    os.environ.clear()  # the caller's environment and folder now, as a spawned process would have them
    os.environ.update(env, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    os.chdir(cwd)
    torch.set_num_threads(1)
    try:
        fn(rank, *args)
    finally:
        parallel.shutdown()


PRELOAD = ("torch", "torch.distributed", "config", "model", "parallel", "fsdp", "tp", "muon", "lora", "moe")


def spawn(fn, world, *args):
    """Run fn(rank, *args) in `world` fresh processes; raises if any of them fails. They fork from
    multiprocessing's forkserver, a clean process that imported torch and the modules the tests train
    with once (PRELOAD) and ran nothing: each rank starts in milliseconds instead of re-importing torch,
    without a fork of the test process's threads. Each rank takes the caller's environment variables
    and working folder of the moment (a spawned process's), not the server's."""
    mp.set_forkserver_preload(list(PRELOAD))
    mp.start_processes(_entry, args=(fn, world, free_port(), args, dict(os.environ), os.getcwd()), nprocs=world,
                       join=True, start_method="forkserver")


def rel_err(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-12)).item()


def assert_close(got, ref, what, tol=1e-5):
    """Tensors, or (nested) dicts of them: same keys, same shapes, relative error <= tol."""
    if isinstance(ref, dict):
        assert got.keys() == ref.keys(), f"{what}: keys differ {sorted(set(got) ^ set(ref))}"
        for k in ref:
            assert_close(got[k], ref[k], f"{what}: {k}", tol)
    else:
        assert got.shape == ref.shape, f"{what}: shape {tuple(got.shape)} vs {tuple(ref.shape)}"
        err = rel_err(got, ref)
        assert err <= tol, f"{what}: relative error {err:.2e}"


@contextlib.contextmanager
def ns_calls():
    """Counter of the (rows, cols) of every matrix muon.newton_schulz orthogonalises in the block
    (a batched call on (n, rows, cols) counts n)."""
    calls, orig = collections.Counter(), muon.newton_schulz

    def spy(X, *a, **k):
        calls[tuple(X.shape[-2:])] += X[..., 0, 0].numel()
        return orig(X, *a, **k)
    muon.newton_schulz = spy
    try:
        yield calls
    finally:
        muon.newton_schulz = orig


def train_cfg(base, **kw):
    """A full training config (lifecycle.TRAIN's keys: config.validate(cfg, world) checks them) on CPU,
    updated with the dict `base` (a test file's tiny model and optimizer), then with kw."""
    d = config.defaults(lifecycle.TRAIN)
    cfg = config.Config(**{**d, "device": "cpu", **base, **kw})
    cfg.keys = d
    return cfg


def global_batch(step, T, vocab, ignore=0):
    """Step `step`'s global batch (x, y): G rows of T random ids < vocab, the same in every process
    (seeded by the step); the first `ignore` targets of each row are -100 (no loss)."""
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randint(0, vocab, (G, T), generator=g)
    y = torch.randint(0, vocab, (G, T), generator=g)
    y[:, :ignore] = -100
    return x, y


def full_state(raw, optimizer, grid, wrapper=None):
    """parallel.Net.full_state of a model laid out by hand (no parallelize): (weights, optimizer state)."""
    return parallel.Net(raw, wrapper, raw, optimizer, grid).full_state()


def load_checkpoint(path, raw, optimizer, grid, wrapper=None):
    """lifecycle.resume into a model laid out by hand: weights, optimizer state, RNG; the trainer dict."""
    import lifecycle
    return lifecycle.resume(lifecycle.Lease(None, path, None), parallel.Net(raw, wrapper, raw, optimizer, grid),
                            say=lambda line: None)[0]
