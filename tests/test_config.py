"""Configs: files and --key=value overrides parse to the right types; every mistake a user is
likely to make (typo, wrong type, impossible batch split, bad model shape, bad value) fails
early with a message that names the key and says what to change."""
import glob
import importlib
import os

import pytest

import config
import pretrain

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_file_then_overrides(tmp_path):
    f = tmp_path / "c.py"
    f.write_text("import math\nn_layer = 3\nlr = 2 * 1e-3\n_private = 1\nout_dir = 'out/x'\n")
    cfg = config.load([str(f), "--lr=0.01", "--compile=True", "--data=/some/corpus", "--max_steps=7",
                       "--progress"], extra=pretrain.EXTRA, world=1)
    assert cfg.n_layer == 3 and cfg.lr == 0.01 and cfg.compile is True and cfg.progress is True
    assert cfg.data == "/some/corpus" and cfg.max_steps == 7 and cfg.out_dir == "out/x"
    assert isinstance(cfg.lr, float)
    cfg = config.load(["--lr=1"], world=1)  # an int literal is accepted for a float key
    assert cfg.lr == 1.0 and isinstance(cfg.lr, float)


def stage_keys(path):
    """configs/<stage>_x.py configures <stage>.py (sft_tiny.py: sft.py): that script's own keys, its
    EXTRA dict (what it passes to config.load); pretrain.py's for pretraining's configs."""
    stage = os.path.basename(path).split("_")[0]
    if not os.path.isfile(os.path.join(ROOT, f"{stage}.py")):
        return pretrain.EXTRA
    return importlib.import_module(stage).EXTRA


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(ROOT, "configs", "*.py"))))
def test_shipped_configs_load(path):
    cfg = config.load([path], extra=stage_keys(path), world=2)
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
    # found at load time, not after training (they used to fail late inside numpy / the sampler)
    (["--seed=-1"], 1, "seed=-1 must be in"),
    (["--max_docs=-1"], 1, "max_docs=-1"),
    (["--val_tokens=-5"], 1, "val_tokens=-5"),
    (["--sample_tokens=-3"], 1, "sample_tokens=-3"),
    (["--sample_temperature=-0.5"], 1, "sample_temperature=-0.5"),
    (["--sample_top_k=-1"], 1, "sample_top_k=-1"),
    (["--eval_batches=-2"], 1, "eval_batches=-2"),
])
def test_invalid_values(args, world, match):
    with pytest.raises(config.ConfigError, match=match):  # a UserError that is also a ValueError
        pretrain.check(config.load(args, extra=pretrain.EXTRA, world=world))  # shared keys, then the stage's


def test_run_prints_user_errors_once_without_traceback(capsys, monkeypatch):
    """config.run: a UserError is one `error:` line on rank 0 and exit status 2; other ranks exit
    quietly with 0; --debug re-raises it with its traceback; a bug is never swallowed."""
    def bad(argv):
        assert "--debug" not in argv  # the flag is config.run's, not the stage's
        config.load(argv + ["--lr=-1"], world=1)
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(SystemExit) as e:
        config.cli(bad, ["--max_steps=3"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err == "error: lr=-1.0 must be positive\n"
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(SystemExit) as e:
        config.cli(bad, [])
    assert e.value.code == 0 and capsys.readouterr().err == ""
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(config.ConfigError, match="lr=-1.0"):
        config.cli(bad, ["--debug"])

    def bug(argv):
        raise ZeroDivisionError("a bug")
    with pytest.raises(ZeroDivisionError):
        config.cli(bug, [])


def test_missing_config_file():
    with pytest.raises(FileNotFoundError, match="configs/"):
        config.load(["configs/nope.py"], world=1)


def test_show_lists_every_key():
    cfg = config.load([], world=1)
    text = config.show(cfg)
    for k in vars(cfg):
        assert f"  {k} " in text
