"""pretrain.py on streamed token shards (data.make_loader -> stream.Loader). What these tests prove:
- a pretraining run mixing two local shard sets by a weight schedule (given on the command line
  with integer steps), stopped at step 3 and resumed, logs exactly the losses of the uninterrupted
  run; each log step's per-source token counts equal mix.Mixture's counts for the run's seed and
  global batch (so the loader got the config's seed, weights and batch), the shares sum to 1, and
  the end report names each source's share;
- the mixed stream stopped at step N on 2 ranks and resumed on 1 rank and on 4 ranks reads exactly
  the ids of the uninterrupted 1-process stream (the mixture's recount included);
- a pretraining run on them stopped at step 3 on 2 data-parallel processes (torchrun, gloo) and
  resumed in one process logs the losses of the uninterrupted one-process run (within 1e-5);
- the same run reading its shards from a real S3 API (moto's server, started here) logs the losses of
  the local run; its cache holds shards named by their manifest sha256, its val.bin comes down whole;
- eval.py's bits-per-byte split of such a run is the first source's val.bin, window by window;
- shards tokenized by another tokenizer, and the data keys that cannot work together, stop the
  run before training with a message saying what to change."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from test_shards import TOK, make_corpus

import config
import data
import eval as eval_mod
import parallel
import pretrain
import tokenizer
from corpora import mix, shards, stream

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
T = 16
RUN = ["--tokenizer_vocab=4096", "--n_layer=1", "--n_head=2", "--n_kv_head=1", "--n_embd=32", f"--block_size={T}",
       "--batch_size=8", "--micro_batch_size=4", "--lr=3e-3", "--warmup_steps=2", "--max_steps=6", "--log_every=1",
       "--eval_every=3", "--eval_batches=2", "--ckpt_every=3", "--sample_tokens=0", "--progress=False", "--dropout=0.1",
       "--device=cpu", "--seed=7"]
SCHEDULE = {0: {"a": 0.8, "b": 0.2}, 4: {"a": 0.2, "b": 0.8}}


@pytest.fixture(scope="module")
def sets(tmp_path_factory):
    """Two complete shard sets on local disk: a with a validation split, b without."""
    root = tmp_path_factory.mktemp("sets")
    out = {}
    for name, seed, n, val in (("a", 0, 18, 0.2), ("b", 1, 12, 0.0)):
        src = make_corpus(root / f"corpus_{name}", n_files=n, seed=seed)
        shards.prepare(src, str(root / name), *TOK, shard_tokens=400, processes=1, val_fraction=val, verbose=False)
        out[name] = str(root / name)
    return out


def mixed(sets):
    return [f"--data_sources={ {'a': sets['a'], 'b': sets['b']} !r}", f"--data_weights={SCHEDULE!r}"]


def metrics(out_dir):
    with open(os.path.join(out_dir, "train_metrics.jsonl")) as f:
        return [r for r in map(json.loads, f) if "loss" in r]


def test_exact_resume_on_mixed_shards(sets, tmp_path, capsys):
    full, part = str(tmp_path / "full"), str(tmp_path / "part")
    pretrain.main(RUN + mixed(sets) + [f"--out_dir={full}"])
    report = capsys.readouterr().out
    pretrain.main(RUN + mixed(sets) + [f"--out_dir={part}", "--stop_at=3"])
    pretrain.main(RUN + mixed(sets) + [f"--out_dir={part}", "--resume"])
    a, b = metrics(full), metrics(part)
    assert [r["step"] for r in a] == list(range(1, 7)) == [r["step"] for r in b]
    assert [r["loss"] for r in a] == [r["loss"] for r in b]
    ref = mix.Mixture(SCHEDULE, seed=7, samples_per_step=8)
    for r in a:
        want = ref.counts(r["step"] * 8) * T
        assert (r["data/a_tokens"], r["data/b_tokens"]) == tuple(want.tolist())
        assert r["data/a_share"] + r["data/b_share"] == pytest.approx(1.0)
    n_a, n_b = ref.counts(48)
    assert f"data read: a {n_a * T:,} tokens, {n_a / 48:.2%} of the samples" in report
    assert f"data read: b {n_b * T:,} tokens, {n_b / 48:.2%} of the samples" in report
    n_tokens = {k: shards.read_manifest(v)["n_tokens"] for k, v in sets.items()}
    n_val = os.path.getsize(os.path.join(sets["a"], "val.bin")) // 2
    assert (f"corpus: shards a = {sets['a']}: {n_tokens['a']:,} tokens (complete), {ref.expected(48)[0]:.1%} of the "
            f"samples" in report and f"b = {sets['b']}: {n_tokens['b']:,} tokens (complete)" in report
            and f"{n_val:,} validation tokens (a's)" in report)
    with open(os.path.join(full, "step_000006", "config.json")) as f:
        assert json.load(f)["data_weights"] == {"0": SCHEDULE[0], "4": SCHEDULE[4]}  # steps as config.json holds them


def test_mixed_stream_resumes_on_other_world_sizes(sets):
    N, M, B = 3, 4, 4  # 2 ranks of B=4: global batch 8
    srcs = {"a": sets["a"], "b": sets["b"]}

    def loader(b, rank=0, world=1, seed=3):
        return stream.Loader(srcs, b, T, rank, world, seed=seed, weights=SCHEDULE, samples_per_step=2 * B,
                             shuffle_block=2)

    def ids(loaders, steps):  # per step: the global batch, rank-major
        return [torch.cat([ld.next()[0] for ld in loaders]) for _ in range(steps)]
    ref = ids([loader(2 * B)], N + M)
    two = [loader(B, r, 2) for r in range(2)]
    assert all(torch.equal(g, r) for g, r in zip(ids(two, N), ref[:N]))
    state = json.loads(json.dumps(two[0].state_dict()))  # as a checkpoint stores it
    for world in (1, 4):
        loaders = [loader(2 * B // world, r, world, seed=0) for r in range(world)]
        for ld in loaders:
            ld.load_state_dict(state)
        assert all(torch.equal(g, r) for g, r in zip(ids(loaders, M), ref[N:])), f"{world} rank(s)"


def test_two_processes_then_one(sets, tmp_path):
    args = RUN + mixed(sets) + ["--dropout=0.0", "--eval_every=0"]
    ref, run = tmp_path / "ref", tmp_path / "run"
    pretrain.main(args + [f"--out_dir={ref}"])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           os.path.join(ROOT, "pretrain.py"), *args, f"--out_dir={run}", "--stop_at=3"]
    r = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    pretrain.main(args + [f"--out_dir={run}", "--resume"])
    a, b = metrics(ref), metrics(run)
    assert [r["step"] for r in b] == list(range(1, 7))
    for x, y in zip(a, b):
        assert abs(x["loss"] - y["loss"]) <= 1e-5 * abs(x["loss"]), (x["step"], x["loss"], y["loss"])
        assert (x["data/a_tokens"], x["data/b_tokens"]) == (y["data/a_tokens"], y["data/b_tokens"])


@pytest.fixture
def s3_url(sets, monkeypatch):
    """Set a under s3://ingot/a on moto's S3 server (127.0.0.1), found through the AWS_* variables."""
    s3fs = pytest.importorskip("s3fs")
    server_mod = pytest.importorskip("moto.server")
    boto3 = pytest.importorskip("boto3")
    server = server_mod.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    for k, v in dict(AWS_ACCESS_KEY_ID="test", AWS_SECRET_ACCESS_KEY="test", AWS_DEFAULT_REGION="us-east-1",
                     AWS_ENDPOINT_URL=f"http://{host}:{port}").items():
        monkeypatch.setenv(k, v)
    s3fs.S3FileSystem.clear_instance_cache()  # none made for another server earlier in this process
    try:
        boto3.client("s3").create_bucket(Bucket="ingot")
        s3fs.S3FileSystem().put(sets["a"] + "/", "ingot/a", recursive=True)
        yield "s3://ingot/a"
    finally:
        s3fs.S3FileSystem.clear_instance_cache()
        server.stop()


def test_s3_run_equals_local_run(sets, s3_url, tmp_path):
    args = RUN + ["--max_steps=4", "--eval_every=2"]
    pretrain.main(args + [f"--data=shards:{sets['a']}", f"--out_dir={tmp_path / 'local'}"])
    pretrain.main(args + [f"--data=shards:{s3_url}", f"--out_dir={tmp_path / 's3'}", f"--shard_cache={tmp_path / 'c'}"])
    a, b = metrics(tmp_path / "local"), metrics(tmp_path / "s3")
    assert len(a) == 4 and [r["loss"] for r in a] == [r["loss"] for r in b]
    with open(tmp_path / "local" / "train_metrics.jsonl") as f, open(tmp_path / "s3" / "train_metrics.jsonl") as g:
        val = [[r["val_loss"] for r in map(json.loads, h) if "val_loss" in r] for h in (f, g)]
    assert len(val[0]) == 3 and val[0] == val[1]
    cached = sorted(p.name[:-4] for p in (tmp_path / "c" / "rank0").glob("*.bin"))
    assert cached and set(cached) <= {e["sha256"] for e in shards.read_manifest(sets["a"])["shards"]}
    with open(tmp_path / "s3" / "val" / "val.bin", "rb") as f, open(os.path.join(sets["a"], "val.bin"), "rb") as g:
        assert f.read() == g.read()


def test_eval_bpb_split_is_the_first_sources_val(sets, tmp_path):
    out = str(tmp_path / "run")
    pretrain.main(RUN + mixed(sets) + [f"--out_dir={out}", "--max_steps=2", "--eval_every=0", "--ckpt_every=0"])
    cfg = eval_mod.load_config([out, "--tasks=bpb", "--bpb_tokens=0", "--device=cpu"])
    tok = tokenizer.for_cfg(cfg)
    windows = eval_mod.split_windows(cfg, parallel.init(cfg), tok, T)
    val = np.fromfile(os.path.join(sets["a"], "val.bin"), np.uint16).astype(np.int64)
    n = (len(val) - 1) // T
    assert n > 10 and windows == [val[i * T:i * T + T + 1].tolist() for i in range(n)]


def test_other_tokenizer_refused(sets, tmp_path):
    with pytest.raises(config.ConfigError, match="tokenizer_vocab=4096"):
        pretrain.main(RUN + [f"--data=shards:{sets['a']}", "--tokenizer_vocab=2048", f"--out_dir={tmp_path}"])


@pytest.mark.parametrize("keys, message", [
    (dict(data_weights={"a": 1.0}), "data_weights mixes data_sources"),
    (dict(data_sources={"a": "x", "b": "y"}), "give data_weights"),
    (dict(data_sources={"a": "x", "b": "y"}, data_weights={"a": 1.0, "c": 1.0}), "name the same sources"),
    (dict(data_sources={"a": "x"}, data="shards:y"), "name the shard sets in one of them"),
    (dict(data_sources={"a": "x", "b": "y"}, data_weights={"one": {"a": 1, "b": 1}}), "must be integers"),
    (dict(data="shards:x", fim_rate=0.5), "set fim_rate=0"),
    (dict(toxicity="wordlist"), "set clean=True"),
    (dict(toxicity_threshold=0.5), "need a scorer"),
    (dict(shuffle_block=0), "shuffle_block=0"),
])
def test_settings_that_cannot_work(keys, message):
    cfg = config.load([f"--{k}={v!r}" if not isinstance(v, str) else f"--{k}={v}" for k, v in keys.items()],
                      extra=pretrain.EXTRA)
    with pytest.raises(config.UserError, match=message):
        data.check_settings(cfg)
