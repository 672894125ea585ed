"""Checkpoints: weights and optimizer state round-trip exactly (keyed by name); only the newest
`keep_last` survive; a process SIGKILLed in the middle of a save leaves the previous checkpoint
as the latest and loadable; loading into a different model config fails naming the keys."""
import os
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest
import torch

import checkpoint
import config
import optim
import parallel
from model import ModelConfig, Transformer

GRID = parallel.init(SimpleNamespace(device="cpu", tp=1, ep=1))  # one plain process

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def make(**kw):
    d = config.defaults()
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
    path = checkpoint.save(str(tmp_path), 1, *checkpoint.gather(model, opt, GRID), cfg, {"pos": 5})
    _, model2, opt2 = make(tie_embeddings=tied, seed=999)
    with torch.no_grad():
        for p in model2.parameters():
            p.zero_()
    state = checkpoint.load(path, model2, opt2, GRID)
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
        checkpoint.save(str(tmp_path), s, *checkpoint.gather(model, opt, GRID), cfg, keep_last=2)
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
    cfg, model, opt = make()
    train_step(model, opt, 1)
    checkpoint.save({out!r}, 1, *checkpoint.gather(model, opt, GRID), cfg)
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
    checkpoint.save({out!r}, 2, *checkpoint.gather(model, opt, GRID), cfg)
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
    checkpoint.load(path, model, opt, GRID)
    expected = torch.load(os.path.join(out, "expected.pt"))
    for k, v in expected.items():
        assert torch.equal(model.state_dict()[k], v), k
    # the next save cleans the leftover up
    cfg, model, opt = make()
    checkpoint.save(out, 3, *checkpoint.gather(model, opt, GRID), cfg)
    assert not any(e.startswith(".tmp_") for e in os.listdir(out))


def test_mismatched_config_names_keys(tmp_path):
    cfg, model, opt = make()
    path = checkpoint.save(str(tmp_path), 1, *checkpoint.gather(model, opt, GRID), cfg)
    _, wider, _ = make(n_embd=32)
    with pytest.raises(ValueError, match=r"(?s)shape mismatch: blocks.0.attn.proj.weight: checkpoint \(16, 16\) vs model \(32, 32\).*n_embd=16 \(checkpoint\) vs 32 \(now\)"):
        checkpoint.load_model(path, wider)
    _, deeper, _ = make(n_layer=3)
    with pytest.raises(ValueError, match=r"missing in checkpoint: \['blocks.2"):
        checkpoint.load_model(path, deeper)
    with pytest.raises(FileNotFoundError, match="checkpoint folder"):
        checkpoint.load_model(str(tmp_path), model)
