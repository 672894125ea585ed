"""pretrain.py end to end, as a user runs it.

Proves: a run stopped at step k and resumed from its checkpoint logs exactly the same losses as
an uninterrupted run (model, optimizer, loader position and dropout RNG all restored), also when
it moves between layouts (TP=2 -> one process -> FSDP=2); the tiny
config on 2 gloo processes (torchrun) learns (loss falls by a clear margin) and prints a sample;
bad data paths and empty corpora stop the script with a message that names the problem.
"""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}

SMALL = ["--max_docs=40", "--tokenizer_vocab=512", "--n_layer=2", "--n_head=2", "--n_embd=32",
         "--block_size=32", "--batch_size=4", "--micro_batch_size=2", "--lr=3e-3", "--warmup_steps=2",
         "--log_every=1", "--eval_every=0", "--sample_tokens=0", "--progress=False", "--dropout=0.1"]


def pretrain(args, nproc=1, check=True):
    cmd = ([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
           if nproc > 1 else [sys.executable]) + [os.path.join(ROOT, "pretrain.py")] + args
    r = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
    if check and r.returncode != 0:
        raise AssertionError(f"pretrain failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    return r


def losses(out_dir):
    with open(os.path.join(out_dir, "train_metrics.jsonl")) as f:
        return {r["step"]: r["loss"] for r in map(json.loads, f) if "loss" in r}


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("data"))


def test_exact_resume(tmp_path, data_dir):
    common = SMALL + [f"--data_dir={data_dir}", "--max_steps=6", "--ckpt_every=3"]
    full, part = str(tmp_path / "full"), str(tmp_path / "part")
    pretrain(common + [f"--out_dir={full}"])
    pretrain(common + [f"--out_dir={part}", "--stop_at=3"])
    assert sorted(losses(part)) == [1, 2, 3]
    pretrain(common + [f"--out_dir={part}", "--resume=True"])
    a, b = losses(full), losses(part)
    assert sorted(b) == [1, 2, 3, 4, 5, 6]
    for s in range(1, 7):
        assert a[s] == b[s], f"step {s}: uninterrupted {a[s]!r} vs resumed {b[s]!r}"
    assert a[6] < a[1]


def test_tiny_config_two_processes_learns(tmp_path, data_dir):
    out = str(tmp_path / "tiny")
    r = pretrain(["configs/tiny.py", f"--out_dir={out}", f"--data_dir={data_dir}/tiny", "--max_steps=60",
                  "--log_every=10", "--eval_every=60", "--ckpt_every=0", "--sample_tokens=24",
                  "--progress=False"], nproc=2)
    ls = losses(out)
    assert ls[60] < ls[10] - 1.0, ls  # from ~ln(4096)=8.3 down by well over a nat
    assert "--- sample after 60 steps ---" in r.stdout
    assert r.stdout.count("--- sample") == 1  # printed once, by rank 0
    with open(os.path.join(out, "train_metrics.jsonl")) as f:
        val = [json.loads(line)["val_loss"] for line in f if "val_loss" in line]
    assert len(val) == 2 and val[0] > 8.0 > val[1]  # before training (~ln 4096) and after


def test_missing_data_path(tmp_path):
    r = pretrain(SMALL + ["--data=/no/such/corpus", f"--out_dir={tmp_path}"], check=False)
    assert r.returncode != 0 and "/no/such/corpus" in r.stderr


def test_empty_corpus(tmp_path):
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.txt").write_text("")
    r = pretrain(SMALL + [f"--data={tmp_path}/corpus", f"--out_dir={tmp_path}/out",
                          f"--data_dir={tmp_path}/d"], check=False)
    assert r.returncode != 0 and "empty" in r.stderr


def test_config_typo_stops_early(tmp_path):
    r = pretrain(["configs/tiny.py", "--n_layers=2"], check=False)
    assert r.returncode != 0 and "n_layer" in r.stderr


def test_resume_across_layouts(tmp_path, data_dir):
    """Checkpoints hold full tensors: a run saved under TP=2 resumes in one process, which saves and
    resumes under FSDP=2; the continued losses equal an uninterrupted one-process run's."""
    common = SMALL + [f"--data_dir={data_dir}", "--max_steps=6", "--ckpt_every=2", "--dropout=0.0"]
    ref, run = str(tmp_path / "ref"), str(tmp_path / "run")
    pretrain(common + [f"--out_dir={ref}"])
    pretrain(common + ["--tp=2", f"--out_dir={run}", "--stop_at=2"], nproc=2)
    pretrain(common + [f"--out_dir={run}", "--resume=True", "--stop_at=4"])
    pretrain(common + ["--data_parallel=fsdp", f"--out_dir={run}", "--resume=True"], nproc=2)
    a, b = losses(ref), losses(run)
    assert sorted(b) == [1, 2, 3, 4, 5, 6]
    for s in range(1, 7):
        assert abs(a[s] - b[s]) <= 1e-5 * abs(a[s]), f"step {s}: one process {a[s]!r} vs {b[s]!r}"


def test_init_from_shape_the_layout_cannot_take(tmp_path):
    """--init_from a checkpoint with 3 heads and --tp=2 on 2 ranks: the model keys come from the
    checkpoint, validation runs again after them, so the user gets the one-line error (from rank
    0, no traceback of ours) before anything is written, not tp.py's ValueError on both ranks."""
    from types import SimpleNamespace
    import checkpoint
    import config
    import pretrain as stage
    from model import ModelConfig, Transformer
    cfg = SimpleNamespace(**{**config.defaults(stage.EXTRA), "n_layer": 1, "n_head": 3, "n_embd": 24,
                             "tokenizer_vocab": 512, "vocab_size": 512, "block_size": 32})
    init = checkpoint.save(str(tmp_path / "init"), 1, Transformer(ModelConfig.from_cfg(cfg)).state_dict(), None, cfg,
                           run_id="init")
    out = tmp_path / "out"
    r = pretrain(["configs/tiny.py", f"--init_from={init}", "--tp=2", f"--out_dir={out}"], nproc=2, check=False)
    ours = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert r.returncode != 0 and ours == ["error: n_head=3 is not divisible by tp=2: each rank needs whole heads"], r.stderr
    assert "tp.py" not in r.stderr and not out.exists()


def test_a_decoder_run_imports_no_family(tmp_path, data_dir):
    """configs/tiny.py (tiny overrides) through pretrain.main for one step in a fresh interpreter: no module
    of encoders/ is imported (the other families are found through weights.FAMILIES only when a run asks)."""
    code = ("import sys, pretrain; pretrain.main(sys.argv[1:]); "
            "print('ENCODERS', sorted(m for m in sys.modules if m.split('.')[0] == 'encoders'))")
    r = subprocess.run([sys.executable, "-c", code, "configs/tiny.py", *SMALL, f"--data_dir={data_dir}",
                        "--max_steps=1", "--ckpt_every=0", f"--out_dir={tmp_path / 'one'}"],
                       cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "ENCODERS []" in r.stdout.splitlines(), r.stdout[-2000:]
