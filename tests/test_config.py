"""Configs: files and --key=value overrides parse to the right types; every mistake a user is
likely to make (typo, wrong type, impossible batch split, bad model shape, bad value) fails
early with a message that names the key and says what to change."""
import glob
import importlib
import os
import re
from types import SimpleNamespace

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
    cfg = config.load(["--lr=1"], extra=pretrain.EXTRA, world=1)  # an int literal is accepted for a float key
    assert cfg.lr == 1.0 and isinstance(cfg.lr, float)


def stage_keys(path):
    """configs/<stage>_x.py configures <stage>.py (sft_tiny.py: sft.py): that script's own keys, its
    EXTRA dict (what it passes to config.load), and its plugins hook (FAMILY_KEYS: a model family's
    keys); pretrain.py's for pretraining's configs."""
    stage = os.path.basename(path).split("_")[0]
    module = importlib.import_module(stage if os.path.isfile(os.path.join(ROOT, f"{stage}.py")) else "pretrain")
    return dict(extra=module.EXTRA, plugins=getattr(module, "FAMILY_KEYS", None))


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(ROOT, "configs", "*.py"))))
def test_shipped_configs_load(path):
    cfg = config.load([path], **stage_keys(path), world=2)
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
        config.load([arg], extra=pretrain.EXTRA, world=1)


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
        config.load(argv + ["--lr=-1"], extra=pretrain.EXTRA, world=1)
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
    cfg = config.load([], extra=pretrain.EXTRA, world=1)
    text = config.show(cfg)
    for k in vars(cfg):
        assert f"  {k} " in text


def test_each_stage_takes_its_own_keys():
    """A stage accepts the keys it reads: a pretraining key given to sft.py is refused, naming where it
    belongs; a typo names the closest key of that stage; --help lists the stage's keys with comments."""
    import sft
    with pytest.raises(KeyError, match="'dedup' is a setting of prepare.py"):
        config.load(["--dedup=exact"], extra=sft.EXTRA, world=1)
    with pytest.raises(KeyError, match="Did you mean n_train"):
        config.load(["--n_trian=5"], extra=sft.EXTRA, world=1)
    with pytest.raises(KeyError, match="Did you mean sample_tokens"):
        config.load(["--sample_token=5"], extra=pretrain.EXTRA, world=1)
    with pytest.raises(SystemExit) as e:
        config.load(["--help"], extra=sft.EXTRA, world=1, script="sft.py")
    assert e.value.code == 0


def test_help_lists_keys_with_comments(capsys):
    import sft
    with pytest.raises(SystemExit):
        config.load(["--help"], extra=sft.EXTRA, script=os.path.join(ROOT, "sft.py"))
    out = capsys.readouterr().out
    assert "sft.py's own keys" in out and "shared keys" in out and "model keys" in out
    line = next(ln for ln in out.splitlines() if ln.strip().startswith("n_train="))
    assert "20000" in line and "conversations the task generates" in line
    assert "dedup" not in out  # a pretraining key


@pytest.mark.parametrize("stage", ["pretrain", "sft", "dpo", "grpo"])
def test_no_arguments_asks_for_a_config(stage):
    """Each stage started without arguments asks for a config (naming its example) before any work, and
    writes by default into an out_dir of its own name."""
    import importlib
    mod = importlib.import_module(stage)
    with pytest.raises(config.UserError, match=f"no config: give one, e.g. `python {stage}.py configs/"):
        mod.main([])
    assert config.load(["--seed=1"], extra=mod.EXTRA, script=f"{stage}.py").out_dir == f"out/{stage}"


def test_resume_ignores_keys_this_stage_does_not_read(tmp_path):
    """An SFT checkpoint whose config holds pretraining keys (older ingot saved every key) resumes
    with this stage's config: keys only one side knows are listed, never refused."""
    import checkpoint
    import lifecycle
    import sft
    cfg = config.load(["--out_dir=" + str(tmp_path)], extra=sft.EXTRA, world=1)
    old = SimpleNamespace(**{**vars(cfg), "dedup": "near", "fim_rate": 0.5})
    path = checkpoint.save(str(tmp_path), 1, {"w": __import__("torch").zeros(1)}, None, old, run_id="A")
    notes = lifecycle.check_resume(path, cfg)
    assert any("dedup: 'near' in the checkpoint, not a setting now" in n for n in notes)
    changed = SimpleNamespace(**{**vars(cfg), "lr": cfg.lr * 2})
    with pytest.raises(lifecycle.ResumeMismatch, match="lr"):
        lifecycle.check_resume(path, changed)


@pytest.mark.parametrize("stage, args, match", [
    ("pretrain", ["--chat_data=x.jsonl"], "unknown config key 'chat_data': pretrain.py reads its corpus from data"),
    ("sft", ["--prompt_data=x.jsonl"], "unknown config key 'prompt_data': sft.py reads conversations from chat_data"),
    ("dpo", ["--prompt_data=x.jsonl"], "'prompt_data': dpo.py reads preference pairs from chat_data"),
    ("dpo", ["--pack=False"], "'pack' is a setting of chat.py, not of this stage"),  # dpo reads no pack
    ("grpo", ["--chat_data=x.jsonl"], "unknown config key 'chat_data': grpo.py reads prompts from prompt_data"),
    ("grpo", ["--chat_format=alpaca"], "'chat_format' is a setting of chat.py, not of this stage"),
    ("eval", ["--task=gsm8k"], "unknown config key 'task': eval.py runs tasks"),
    ("eval", ["--lr=1e-3"], "'lr' is a setting of optim.py, not of this stage"),  # eval trains nothing
])
def test_each_stage_refuses_keys_it_does_not_read(stage, args, match):
    """A stage accepts only the keys it reads: another stage's key for the same thing is refused in one line
    naming this stage's key (grpo.py's chat_data: prompt_data), any other key naming the file it belongs to;
    --help does not list them. (grpo.py once trained on its arithmetic task over a --chat_data it never read.)"""
    extra = importlib.import_module(stage).EXTRA
    with pytest.raises(config.ConfigKeyError, match=re.escape(match)) as e:
        config.load(args, extra=extra, world=1)
    assert "\n" not in str(e.value) and str(e.value).endswith("(--help lists this stage's keys)")
    key = args[0][2:].partition("=")[0]
    assert key not in extra and not any(ln.strip().startswith(f"{key}=") for ln in config.help_text(
        config.defaults(extra), f"{stage}.py").splitlines())


def test_prompt_data_on_the_command_line_replaces_the_files_task(tmp_path):
    """The command line wins over the config file: --prompt_data over configs/grpo_life.py (which sets task
    and task_args) drops the file's task and loads (it used to fail: "task_args set the task; prompt_data
    replaces the task: give one"); both in one file, or both on the command line, are still refused."""
    import grpo
    life = os.path.join(ROOT, "configs", "grpo_life.py")
    grid = SimpleNamespace(data_world=1)
    cfg = config.load([life, "--prompt_data=my_prompts.jsonl"], extra=grpo.EXTRA, world=1)
    grpo.check(cfg, grid)
    assert cfg.prompt_data == "my_prompts.jsonl" and cfg.task_args == {} and cfg.task == grpo.EXTRA["task"]
    assert {"task", "task_args"}.isdisjoint(cfg.given) and cfg.train_prompts == 16384  # the rest of the file holds
    with pytest.raises(config.ConfigError, match="prompt_data replaces the task: give one"):
        grpo.check(config.load([life, "--prompt_data=p.jsonl", "--task_args={'n': 3}"], extra=grpo.EXTRA), grid)
    both = tmp_path / "both.py"
    both.write_text("from configs.grpo_life import *\nprompt_data = 'p.jsonl'\n")
    with pytest.raises(config.ConfigError, match="prompt_data replaces the task: give one"):
        grpo.check(config.load([str(both)], extra=grpo.EXTRA, world=1), grid)
    cfg = config.load([str(both), "--prompt_data=q.jsonl"], extra=grpo.EXTRA, world=1)
    grpo.check(cfg, grid)
    assert cfg.prompt_data == "q.jsonl" and cfg.task_args == {}
