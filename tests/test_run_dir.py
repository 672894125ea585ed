"""The run folder belongs to one run (lifecycle.open_run / claim / save).

Proves: a second run into a locked out_dir refuses at once naming the holder's pid and host, and
the lock dies with its process; a fresh run into an out_dir holding an earlier run's checkpoints
or metrics refuses, and --overwrite=True moves those files byte for byte into old_<time>/ instead
of deleting them; pruning (keep_last) never deletes another run's checkpoints, and a resumed run
continues its checkpoint's lineage (prunes it); steps sort numerically (step_999999 before
step_1000000); a save removes only temporary folders whose writer is gone, never a live run's;
resuming an older checkpoint with newer ones beside it refuses rather than mixing two histories.
"""
import os
import signal
import socket
import subprocess
import sys
import textwrap

import pytest

import checkpoint
import config
import lifecycle
from test_checkpoint import GRID, ROOT, make
from distributed import full_state


def run_cfg(out, **kw):
    cfg, _, _ = make(out_dir=str(out), **kw)
    return cfg


def save(out, step, run_id, keep_last=2, sole_writer=False):
    cfg, model, opt = make(out_dir=str(out))
    return checkpoint.save(str(out), step, *full_state(model, opt, GRID), cfg, keep_last=keep_last,
                           run_id=run_id, sole_writer=sole_writer)


def names(out):
    return [os.path.basename(p) for p in checkpoint.list_checkpoints(str(out))]


LOCK_SCRIPT = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, {root!r})
    import lifecycle
    lock = lifecycle.RunLock({out!r})
    print("locked", flush=True)
    time.sleep(120)
""")


def test_second_run_refused_while_first_holds_lock(tmp_path):
    out = str(tmp_path / "run")
    first = subprocess.Popen([sys.executable, "-c", LOCK_SCRIPT.format(root=ROOT, out=out)],
                             stdout=subprocess.PIPE, text=True)
    try:
        assert first.stdout.readline().strip() == "locked"
        with pytest.raises(lifecycle.RunDirBusy, match=f"pid {first.pid} on host {socket.gethostname()}"):
            lifecycle.RunLock(out)
        with pytest.raises(config.UserError, match="in use by another run"):  # open_run takes the lock first
            lifecycle.open_run(run_cfg(out))
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    lifecycle.RunLock(out).release()  # the dead run's lock is gone with it
    # in one process: a second claim is refused until the first is released
    lock = lifecycle.RunLock(out)
    with pytest.raises(lifecycle.RunDirBusy, match=f"pid {os.getpid()}"):
        lifecycle.RunLock(out)
    lock.release()
    lifecycle.RunLock(out).release()


def test_fresh_run_into_used_dir_refused_and_overwrite_moves_aside(tmp_path):
    out = tmp_path / "run"
    save(out, 5, "A")
    (out / "train_metrics.jsonl").write_text('{"step": 5, "loss": 3.0}\n')
    before = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file() and p.name != ".lock"}
    with pytest.raises(lifecycle.RunDirNotEmpty, match=r"step_000005.*train_metrics.jsonl.*--resume.*--overwrite=True"):
        lifecycle.open_run(run_cfg(out))
    run = lifecycle.open_run(run_cfg(out, overwrite=True))
    assert run.resume_from is None and run.run_id != "A"
    assert lifecycle.run_files(str(out)) == [] and checkpoint.latest(str(out)) is None
    old = [d for d in os.listdir(out) if d.startswith("old_")]
    assert len(old) == 1 and any(old[0] in n for n in run.notes)
    for rel, data in before.items():  # every earlier file kept, byte for byte
        assert (out / old[0] / rel).read_bytes() == data, rel
    save(out, 1, run.run_id)
    assert names(out) == ["step_000001"] and checkpoint.verify(str(out / old[0] / "step_000005")) is None
    run.lock.release()
    # metrics alone (a run that died before its first checkpoint) also count as an earlier run
    other = tmp_path / "other"
    other.mkdir()
    (other / "train_metrics.jsonl").write_text("{}\n")
    (other / "notes.txt").write_text("mine")  # not a run's file: neither refused nor moved
    with pytest.raises(lifecycle.RunDirNotEmpty, match="train_metrics.jsonl"):
        lifecycle.open_run(run_cfg(other))
    (other / "train_metrics.jsonl").unlink()
    lifecycle.open_run(run_cfg(other)).lock.release()
    assert (other / "notes.txt").read_text() == "mine"


def test_pruning_only_touches_this_runs_checkpoints(tmp_path):
    out = tmp_path / "run"
    for s in (10, 20, 30):  # an earlier run A, further along
        save(out, s, "A")
    assert names(out) == ["step_000020", "step_000030"]
    for s in (1, 2, 3):  # run B in the same folder (open_run refuses this; save still must not lose data)
        path = save(out, s, "B")
        assert os.path.isfile(os.path.join(path, "model.safetensors"))  # what was just written survives pruning
    assert names(out) == ["step_000002", "step_000003", "step_000020", "step_000030"]
    with pytest.raises(checkpoint.RunDirError, match="another run"):  # B never replaces A's step
        save(out, 20, "B")
    # a resumed run adopts its checkpoint's run id: continuing A prunes A's older checkpoints only
    for p in checkpoint.list_checkpoints(str(out))[:2]:
        os.rename(p, str(tmp_path / os.path.basename(p)))  # (B's out of the way: open_run would refuse them)
    run = lifecycle.open_run(run_cfg(out, resume="latest"))
    assert run.resume_from.endswith("step_000030") and run.run_id == "A"
    save(out, 40, run.run_id)
    assert names(out) == ["step_000030", "step_000040"]


def test_steps_sort_numerically(tmp_path):
    out = tmp_path / "run"
    save(out, 999999, "A")
    save(out, 1000000, "A")
    assert names(out) == ["step_999999", "step_1000000"]
    assert checkpoint.latest(str(out)).endswith("step_1000000")
    save(out, 1000001, "A", keep_last=1)
    assert names(out) == ["step_1000001"]
    assert lifecycle.find_resume(run_cfg(out, resume="latest"))[0].endswith("step_1000001")


def test_save_removes_only_stale_temp_folders(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    host = socket.gethostname()
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    try:
        other_live = out / f".tmp_step_000007_{host}_{live.pid}"  # another run saving right now
        stale = out / f".tmp_step_000003_{host}_{dead.pid}"       # a save that was killed
        far = out / ".tmp_step_000004_otherhost_123"                 # cannot tell from here
        for d in (other_live, stale, far):
            d.mkdir()
            (d / "model.safetensors").write_bytes(b"x")
        save(out, 1, "A")
        assert other_live.exists() and far.exists() and not stale.exists()
        lock = lifecycle.RunLock(str(out))  # holding the lock, no other run can be writing here
        save(out, 2, "A", sole_writer=True)
        lock.release()
        assert not other_live.exists() and not far.exists()
    finally:
        live.kill()
        live.wait()


def test_resume_older_checkpoint_refuses_newer_ones(tmp_path):
    out = tmp_path / "run"
    for s in (1, 2):
        save(out, s, "A")
    older = str(out / "step_000001")
    with pytest.raises(lifecycle.RunDirNotEmpty, match=r"step_000002.*newer"):
        lifecycle.open_run(run_cfg(out, resume=older))
    run = lifecycle.open_run(run_cfg(out, resume=older, overwrite=True))
    assert run.resume_from == older and run.run_id == "A" and names(out) == ["step_000001"]
    assert any("step_000002" in n and "old_" in n for n in run.notes)
    run.lock.release()
    # resuming another folder's checkpoint into a used out_dir refuses too
    elsewhere = tmp_path / "elsewhere"
    save(elsewhere, 9, "C")
    with pytest.raises(lifecycle.RunDirNotEmpty):
        lifecycle.open_run(run_cfg(out, resume=str(elsewhere / "step_000009")))
    run = lifecycle.open_run(run_cfg(tmp_path / "fresh", resume=str(elsewhere)))  # a run folder: its newest
    assert run.resume_from.endswith("step_000009") and run.run_id == "C"
    run.lock.release()

