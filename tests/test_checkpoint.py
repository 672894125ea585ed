"""Checkpoints: weights and optimizer state round-trip exactly (keyed by name); only the newest
`keep_last` survive; a process SIGKILLed in the middle of a save leaves the previous checkpoint
as the latest and loadable; loading into a different model config fails naming the keys.

Safety and recovery: every saved .pt loads with weights_only=True, and a crafted pickle put in
optimizer.pt / trainer.pt (with a matching complete.json) is refused without running its payload;
a folder counts as a checkpoint only with its complete.json and matching files, so resume skips a
truncated or corrupted newest checkpoint, says which and why, and takes the previous one;
--resume=<path> takes that checkpoint or refuses (no silent fallback); changed settings on resume
are listed, refused where they break exactness, accepted with force_resume; bare --resume parses;
user mistakes raise config.UserError subclasses that keep their built-in types."""
import hashlib
import json
import os
import pickle
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import checkpoint
import config
import lifecycle
import optim
import parallel
import weights
from model import ModelConfig, Transformer
from distributed import full_state, load_checkpoint

GRID = parallel.init(SimpleNamespace(device="cpu", tp=1, ep=1))  # one plain process

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def make(**kw):
    d = config.defaults(lifecycle.TRAIN)
    d.update(vocab_size=61, pad_vocab_multiple=16, n_layer=2, n_head=2, n_embd=16, block_size=8, lr=1e-2)
    d.update(kw)
    cfg = SimpleNamespace(**d)
    torch.manual_seed(0)
    model = Transformer(ModelConfig.from_cfg(cfg))
    return cfg, model, optim.build_optimizer(model, cfg)


def train_step(model, opt, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 61, (2, 8), generator=g)
    model(x, x).backward()
    opt.step()
    opt.zero_grad()


@pytest.mark.parametrize("tied", [False, True])
def test_round_trip_and_continue(tmp_path, tied):
    cfg, model, opt = make(tie_embeddings=tied)
    train_step(model, opt, 1)
    path = checkpoint.save(str(tmp_path), 1, *full_state(model, opt, GRID), cfg, {"pos": 5})
    _, model2, opt2 = make(tie_embeddings=tied, seed=999)
    with torch.no_grad():
        for p in model2.parameters():
            p.zero_()
    state = load_checkpoint(path, model2, opt2, GRID)
    assert state["step"] == 1 and state["loader"] == {"pos": 5}
    for (k, a), b in zip(model.state_dict().items(), model2.state_dict().values()):
        assert torch.equal(a, b), k
    if tied:
        assert model2.head.weight is model2.tok_emb.weight
    # the restored optimizer continues exactly like the original
    train_step(model, opt, 2)
    train_step(model2, opt2, 2)
    for (k, a), b in zip(model.state_dict().items(), model2.state_dict().values()):
        assert torch.equal(a, b), k


def test_keep_last_and_latest(tmp_path):
    cfg, model, opt = make()
    for s in (1, 2, 3, 4):
        checkpoint.save(str(tmp_path), s, *full_state(model, opt, GRID), cfg, keep_last=2)
    names = [os.path.basename(p) for p in checkpoint.list_checkpoints(str(tmp_path))]
    assert names == ["step_000003", "step_000004"]
    assert checkpoint.latest(str(tmp_path)).endswith("step_000004")
    assert (tmp_path / "latest").read_text() == "step_000004"
    assert checkpoint.latest(str(tmp_path / "none")) is None


KILL_SCRIPT = textwrap.dedent("""
    import os, signal, sys
    sys.path.insert(0, {root!r}); sys.path.insert(0, {tests!r})
    import torch, checkpoint
    from test_checkpoint import GRID, make, train_step
    from distributed import full_state
    cfg, model, opt = make()
    train_step(model, opt, 1)
    checkpoint.save({out!r}, 1, *full_state(model, opt, GRID), cfg)
    torch.save(model.state_dict(), os.path.join({out!r}, "expected.pt"))
    train_step(model, opt, 2)
    real = checkpoint._fsync_write
    def dying_write(path, write):  # die half-way through writing trainer.pt of step 2
        if path.endswith("trainer.pt"):
            with open(path, "wb") as f:
                f.write(b"partial")
                f.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        real(path, write)
    checkpoint._fsync_write = dying_write
    checkpoint.save({out!r}, 2, *full_state(model, opt, GRID), cfg)
""")


def test_killed_mid_save_keeps_previous(tmp_path):
    out = str(tmp_path / "run")
    script = KILL_SCRIPT.format(root=ROOT, tests=os.path.join(ROOT, "tests"), out=out)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert r.returncode == -9, r.stderr  # really killed
    assert any(e.startswith(".tmp_step_000002") for e in os.listdir(out))  # the half-written save
    path = checkpoint.latest(out)
    assert path.endswith("step_000001")
    _, model, opt = make()
    load_checkpoint(path, model, opt, GRID)
    expected = torch.load(os.path.join(out, "expected.pt"))
    for k, v in expected.items():
        assert torch.equal(model.state_dict()[k], v), k
    # the next save cleans the leftover up
    cfg, model, opt = make()
    checkpoint.save(out, 3, *full_state(model, opt, GRID), cfg)
    assert not any(e.startswith(".tmp_") for e in os.listdir(out))


def test_mismatched_config_names_keys(tmp_path):
    cfg, model, opt = make()
    path = checkpoint.save(str(tmp_path), 1, *full_state(model, opt, GRID), cfg)
    _, wider, _ = make(n_embd=32)
    with pytest.raises(ValueError, match=r"(?s)shape mismatch: blocks.0.attn.proj.weight: checkpoint \(16, 16\) vs model \(32, 32\).*n_embd=16 \(checkpoint\) vs 32 \(now\)"):
        weights.load_model(path, wider)
    _, deeper, _ = make(n_layer=3)
    with pytest.raises(ValueError, match=r"missing in checkpoint: \['blocks.2"):
        weights.load_model(path, deeper)
    with pytest.raises(FileNotFoundError, match="checkpoint folder"):
        weights.load_model(str(tmp_path), model)


def refresh_manifest(path):
    """What an attacker who rewrites files can also do: make complete.json match them again."""
    if not os.path.exists(os.path.join(path, "complete.json")):
        return
    man = json.loads(open(os.path.join(path, "complete.json")).read())
    for name in man["files"]:
        data = open(os.path.join(path, name), "rb").read()
        man["files"][name] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    with open(os.path.join(path, "complete.json"), "w") as f:
        json.dump(man, f)


class Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):  # unpickling this runs a shell command
        return os.system, (f"touch {self.marker}",)


@pytest.mark.parametrize("fmt", ["torch", "pickle"])
@pytest.mark.parametrize("victim", ["optimizer.pt", "trainer.pt"])
def test_pickle_payload_is_not_executed(tmp_path, victim, fmt):
    cfg, model, opt = make()
    path = checkpoint.save(str(tmp_path / "run"), 1, *full_state(model, opt, GRID), cfg, run_id="A")
    marker = tmp_path / "pwned"
    evil = {"step": 1, "state": Payload(str(marker))}
    with open(os.path.join(path, victim), "wb") as f:
        torch.save(evil, f) if fmt == "torch" else pickle.dump(evil, f)
    refresh_manifest(path)
    with pytest.raises(Exception) as e:
        load_checkpoint(path, model, opt, GRID)
    assert not marker.exists(), "the crafted pickle ran its payload"
    assert type(e.value).__name__ == "CheckpointError" and f"{victim}' holds objects other than" in str(e.value)
    if victim == "trainer.pt":  # resume's check reads trainer.pt (the large optimizer.pt only load reads)
        with pytest.raises(checkpoint.CheckpointError, match="(?s)skipped.*trainer.pt.*refused to load"):
            lifecycle.find_resume(SimpleNamespace(resume="latest", out_dir=str(tmp_path / "run")))
    assert not marker.exists()


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_saved_files_load_with_weights_only(tmp_path, optimizer):
    cfg, model, opt = make(optimizer=optimizer, ns_dtype="float32")
    train_step(model, opt, 1)
    loader = {"epoch": np.int64(2), "pos": np.int32(5), "seen": np.arange(3)}  # numpy values become plain
    path = checkpoint.save(str(tmp_path), 1, *full_state(model, opt, GRID), cfg, loader, run_id="A")
    for name in ("optimizer.pt", "trainer.pt"):
        torch.load(os.path.join(path, name), weights_only=True)
    _, model2, opt2 = make(optimizer=optimizer, ns_dtype="float32")
    state = load_checkpoint(path, model2, opt2, GRID)
    assert state["loader"]["pos"] == 5 and type(state["loader"]["pos"]) is int
    assert torch.equal(state["loader"]["seen"], torch.arange(3)) and state["run_id"] == "A"
    with pytest.raises(TypeError, match="weights_only"):  # caught when saving, not at resume time
        checkpoint.save(str(tmp_path), 2, *full_state(model, opt, GRID), cfg, {"f": open})


def test_truncated_newest_checkpoint_falls_back(tmp_path):
    out = str(tmp_path / "run")
    cfg, model, opt = make(out_dir=out)
    for s in (1, 2, 3):
        train_step(model, opt, s)
        checkpoint.save(out, s, *full_state(model, opt, GRID), cfg, {"pos": s}, keep_last=3, run_id="A")
    newest = os.path.join(out, "step_000003")
    wfile = os.path.join(newest, "model.safetensors")
    data = open(wfile, "rb").read()
    open(wfile, "wb").write(data[: len(data) // 2])
    assert checkpoint.latest(out).endswith("step_000002")
    path, notes = lifecycle.find_resume(SimpleNamespace(resume="latest", out_dir=out))
    assert path.endswith("step_000002") and len(notes) == 1
    assert "step_000003" in notes[0] and "model.safetensors" in notes[0] and "truncated" in notes[0]
    with pytest.raises(checkpoint.CheckpointError, match="step_000003.*model.safetensors.*truncated"):
        load_checkpoint(newest, model, opt, GRID)
    with pytest.raises(checkpoint.CheckpointError, match="step_000003"):
        weights.load_model(newest, model)
    # same size, one byte flipped: only the hash sees it; resume falls back once more
    optf = os.path.join(out, "step_000002", "optimizer.pt")
    raw = bytearray(open(optf, "rb").read())
    raw[len(raw) // 2] ^= 0xFF
    open(optf, "wb").write(bytes(raw))
    path, notes = lifecycle.find_resume(SimpleNamespace(resume="latest", out_dir=out))
    assert path.endswith("step_000001") and len(notes) == 2 and "optimizer.pt's sha256" in notes[1]
    # open_run resumes from step 1 and moves the broken ones aside (kept, not deleted)
    run = lifecycle.open_run(make(out_dir=out, resume="latest")[0])
    run.lock.release()
    assert run.resume_from.endswith("step_000001") and run.run_id == "A"
    assert [os.path.basename(p) for p in checkpoint.list_checkpoints(out)] == ["step_000001"]
    assert any("step_000002" in n and "step_000003" in n and "old_" in n for n in run.notes)
    _, model1, opt1 = make()
    assert load_checkpoint(run.resume_from, model1, opt1, GRID)["loader"] == {"pos": 1}
    # a hand-made folder without complete.json: safetensors' error, with the path
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "model.safetensors").write_bytes(data[:100])
    with pytest.raises(checkpoint.CheckpointError, match="cannot read.*bare"):
        checkpoint.read_weights(str(bare), **weights.reference(model.cfg))


def test_incomplete_folders_are_not_checkpoints(tmp_path):
    out = tmp_path / "run"
    cfg, model, opt = make()
    good = checkpoint.save(str(out), 1, *full_state(model, opt, GRID), cfg, run_id="A")
    (out / "step_000009").mkdir()  # a save that lost its weights: trainer.pt only
    (out / "step_000009" / "trainer.pt").write_bytes(open(os.path.join(good, "trainer.pt"), "rb").read())
    assert [os.path.basename(p) for p in checkpoint.list_checkpoints(str(out))] == ["step_000001"]
    assert checkpoint.latest(str(out)) == good
    path, notes = lifecycle.find_resume(SimpleNamespace(resume="latest", out_dir=str(out)))
    assert path == good and "step_000009" in notes[0] and "complete.json" in notes[0]
    with pytest.raises(checkpoint.CheckpointError, match="complete.json"):
        load_checkpoint(str(out / "step_000009"), model, opt, GRID)
    os.remove(os.path.join(good, "complete.json"))
    with pytest.raises(checkpoint.CheckpointError, match="no usable checkpoint.*\n.*step_000009"):
        lifecycle.find_resume(SimpleNamespace(resume="latest", out_dir=str(out)))
    assert lifecycle.find_resume(SimpleNamespace(resume="latest", out_dir=str(tmp_path / "new"))) == (None, [])


def test_resume_names_one_checkpoint(tmp_path):
    out = str(tmp_path / "run")
    cfg, model, opt = make()
    for s in (1, 2):
        checkpoint.save(out, s, *full_state(model, opt, GRID), cfg, keep_last=5, run_id="A")
    first = os.path.join(out, "step_000001")
    assert lifecycle.find_resume(SimpleNamespace(resume=first, out_dir="elsewhere")) == (first, [])
    assert lifecycle.find_resume(SimpleNamespace(resume="", out_dir=out)) == (None, [])
    with pytest.raises(checkpoint.CheckpointError, match="no such folder"):
        lifecycle.find_resume(SimpleNamespace(resume=out + "/step_7", out_dir=out))
    os.remove(os.path.join(first, "optimizer.pt"))
    with pytest.raises(checkpoint.CheckpointError, match="step_000001 is not a usable checkpoint: optimizer.pt is mis"):
        lifecycle.find_resume(SimpleNamespace(resume=first, out_dir=out))  # named: no silent fallback


def test_resume_with_changed_settings(tmp_path):
    out = str(tmp_path / "run")
    cfg, model, opt = make(out_dir=out, lr=1e-2, batch_size=32, max_steps=100)
    checkpoint.save(out, 1, *full_state(model, opt, GRID), cfg, run_id="A")
    changed = make(out_dir=out, resume="latest", lr=2e-2, batch_size=64, max_steps=200, log_every=1, tp=2)[0]
    with pytest.raises(checkpoint.ResumeMismatch, match=r"(?s)batch_size: 32 -> 64.*lr: 0.01 -> 0.02.*"
                                                         r"max_steps: 100 -> 200.*--force_resume=True") as e:
        lifecycle.open_run(changed)
    assert "log_every" not in str(e.value) and "tp:" not in str(e.value)
    refused, info = lifecycle.resume_changes(vars(cfg), changed)
    assert [r.split(":")[0] for r in refused] == ["batch_size", "lr", "max_steps"]
    assert [r.split(":")[0] for r in info] == ["log_every", "tp"]
    same = make(out_dir=out, lr=1e-2, batch_size=32, max_steps=100, resume="latest", overwrite=True)[0]
    assert lifecycle.resume_changes(vars(cfg), same) == ([], [])  # how to start is not a setting
    assert lifecycle.resume_changes({"lr": 0.01, "old_key": 1}, {"lr": 0.01, "new_key": 2}) == (
        [], ["new_key: 2 (the checkpoint does not record it)", "old_key: 1 in the checkpoint, not a setting now"])
    changed.force_resume = True  # the refusal released the lock; forced, the changes are listed
    run = lifecycle.open_run(changed)
    run.lock.release()
    assert run.resume_from.endswith("step_000001")
    assert sum("forced" in n for n in run.notes) == 3 and sum("harmless" in n for n in run.notes) == 2


def test_resume_flag_and_user_errors(tmp_path):
    assert config.load(["--resume"], extra=lifecycle.TRAIN, world=1).resume == "latest"
    assert config.load(["--resume=True"], extra=lifecycle.TRAIN, world=1).resume == "latest"
    assert config.load(["--resume=False"], extra=lifecycle.TRAIN, world=1).resume == ""
    assert config.load(["--resume=out/a/step_000100"], extra=lifecycle.TRAIN, world=1).resume == "out/a/step_000100"
    assert config.load([], extra=lifecycle.TRAIN, world=1).resume == "" and not config.load([], extra=lifecycle.TRAIN, world=1).overwrite
    f = tmp_path / "c.py"
    f.write_text("resume = True\n")
    assert config.load([str(f)], extra=lifecycle.TRAIN, world=1).resume == "latest"
    with pytest.raises(config.UserError, match="--seed=...") as e:  # non-bool, non-BARE_FLAG keys still need a value
        config.load(["--seed"], extra=lifecycle.TRAIN, world=1)
    assert isinstance(e.value, ValueError)
    for args, builtin in ((["--n_layers=4"], KeyError), (["--lr=fast"], TypeError), (["--lr=-1.0"], ValueError),
                          (["--n_head=5"], ValueError), (["nope.py"], FileNotFoundError)):
        with pytest.raises(config.UserError) as e:
            config.load(args, extra=lifecycle.TRAIN, world=1)
        assert isinstance(e.value, builtin), args
    assert str(e.value).startswith("config file") and not str(e.value).startswith("'")
    with pytest.raises(config.UserError) as e:
        config.load(["--n_layers=4"], extra=lifecycle.TRAIN, world=1)
    assert str(e.value).startswith("unknown config key 'n_layers'")  # not wrapped in KeyError's quotes
    assert issubclass(checkpoint.CheckpointError, ValueError) and issubclass(checkpoint.RunDirError, config.UserError)
