"""Configs: files and --key=value overrides parse to the right types; every mistake a user is
likely to make (typo, wrong type, impossible batch split, bad model shape, bad value) fails
early with a message that names the key and says what to change."""
import glob
import os

import pytest

import config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_file_then_overrides(tmp_path):
    f = tmp_path / "c.py"
    f.write_text("import math\nn_layer = 3\nlr = 2 * 1e-3\n_private = 1\nout_dir = 'out/x'\n")
    cfg = config.load([str(f), "--lr=0.01", "--compile=True", "--data=/some/corpus", "--max_steps=7",
                       "--progress"], world=1)
    assert cfg.n_layer == 3 and cfg.lr == 0.01 and cfg.compile is True and cfg.progress is True
    assert cfg.data == "/some/corpus" and cfg.max_steps == 7 and cfg.out_dir == "out/x"
    assert isinstance(cfg.lr, float)
    cfg = config.load(["--lr=1"], world=1)  # an int literal is accepted for a float key
    assert cfg.lr == 1.0 and isinstance(cfg.lr, float)


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(ROOT, "configs", "*.py"))))
def test_shipped_configs_load(path):
    cfg = config.load([path], world=2)
    assert cfg.batch_size % (cfg.micro_batch_size * 2) == 0


def test_typo_names_closest_keys():
    with pytest.raises(KeyError, match="n_layer"):
        config.load(["--n_layers=4"], world=1)
    with pytest.raises(KeyError, match="learning|lr|unknown config key 'learning_rate'"):
        config.load(["--learning_rate=1e-3"], world=1)


def test_typo_in_file(tmp_path):
    f = tmp_path / "c.py"
    f.write_text("n_embed = 64\n")
    with pytest.raises(KeyError, match="n_embd"):
        config.load([str(f)], world=1)


@pytest.mark.parametrize("arg,match", [
    ("--n_layer=2.5", "n_layer.*int"),
    ("--compile=yes", "compile.*bool"),
    ("--lr='fast'", "lr.*float"),
])
def test_type_mismatch(arg, match):
    with pytest.raises(TypeError, match=match):
        config.load([arg], world=1)


@pytest.mark.parametrize("args,world,match", [
    (["--lr=-1e-3"], 1, "lr=-0.001 must be positive"),
    (["--batch_size=30", "--micro_batch_size=8"], 1, "batch_size=30 must be divisible"),
    (["--batch_size=16", "--micro_batch_size=4"], 3, "micro_batch_size\\*data_parallel=4\\*3"),
    (["--n_embd=100", "--n_head=12"], 1, "n_embd"),
    (["--n_head=12", "--n_kv_head=5"], 1, "n_kv_head"),
    (["--activation=swish"], 1, "activation"),
    (["--schedule=cosin"], 1, "schedule"),
    (["--seq_len=4096"], 1, "seq_len=4096"),
    (["--warmup_steps=-5"], 1, "warmup_steps"),
    (["--stop_at=200", "--max_steps=100"], 1, "stop_at"),
])
def test_invalid_values(args, world, match):
    with pytest.raises(ValueError, match=match):
        config.load(args, world=world)


def test_missing_config_file():
    with pytest.raises(FileNotFoundError, match="configs/"):
        config.load(["configs/nope.py"], world=1)


def test_show_lists_every_key():
    cfg = config.load([], world=1)
    text = config.show(cfg)
    for k in vars(cfg):
        assert f"  {k} " in text
