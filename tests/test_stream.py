"""stream.py: the streaming loader over token shards. What these tests prove:
- every x, y is the window of the shard the loader names, read straight from shards.tokens (y is x
  shifted), and one epoch of a complete set visits every window of every shard exactly once;
- the order is world-size free: stopped at step N on 2 ranks and resumed on 1 rank (B*2, or B with
  2 micro-steps) and on 4 ranks (B/2) reads exactly the ids an uninterrupted 1-process run reads;
  the state is the global sample index only;
- preparation and training overlap: on a set whose manifest grows shard by shard, the first batch
  is read before the set is complete, and the ids equal those read from the complete set;
- a real S3 API (moto's server, started here) serves the same ids as the local folder, through a
  cache that never holds more than cache_bytes and evicts the least recently used shards (and takes in
  a previous run's files, oldest evicted first); an altered object in the bucket is named and
  refused; the validation file comes down whole (a set whose one document fell to training is refused
  with that cause); a 2-process gloo run reading from it equals the
  1-process local run;
- two sources mixed 0.7 / 0.3: each sample comes from the source the mixture names, the report's
  shares match its counts."""
import json
import os
import shutil
import threading
import time

import numpy as np
import pytest
import torch
import torch.distributed as dist
from distributed import spawn
from test_shards import TOK, make_corpus

from corpora import shards, stream

T = 16


@pytest.fixture(scope="module")
def sets(tmp_path_factory):
    """Two complete shard sets on local disk: a, and b with a validation split."""
    root = tmp_path_factory.mktemp("sets")
    out = {}
    for name, seed, n, val in (("a", 0, 24, 0.0), ("b", 1, 12, 0.2)):
        src = make_corpus(root / f"corpus_{name}", n_files=n, seed=seed)
        shards.prepare(src, str(root / name), *TOK, shard_tokens=300, processes=1, val_fraction=val, verbose=False)
        out[name] = str(root / name)
    return out


def window(folder, k, w):
    """Tokens [w*T, w*T+T+1) of shard k, read independently of stream.py."""
    m = shards.read_manifest(folder)
    start = sum(e["tokens"] for e in m["shards"][:k]) + w * T
    return shards.tokens(folder)[start:start + T + 1].astype(np.int64)


def run(loader, steps, micro=1):
    """x of every next() for `steps` optimizer steps of `micro` micro-batches: [step][micro] tensors."""
    return [[loader.next()[0] for _ in range(micro)] for _ in range(steps)]


def step_ids(per_rank):
    """One step's global batch in sample order: rank-major, then micro-batches."""
    return torch.cat([x for rank in per_rank for x in rank])


def test_windows_and_one_epoch(sets):
    loader = stream.Loader(sets["a"], 4, T, shuffle_block=3)
    src = loader.sources[0]
    n = src.n_windows
    assert src.complete and n == sum((e["tokens"] - 1) // T for e in src.entries) and n > 40
    seen = []
    for _ in range(n // 4):
        where = loader.locate(loader.pos, loader.pos + 4)
        x, y = loader.next()
        for row, (_, k, w, _, _) in enumerate(where):
            ref = torch.from_numpy(window(sets["a"], k, w))
            assert torch.equal(x[row], ref[:-1]) and torch.equal(y[row], ref[1:])
        seen += [(k, w) for _, k, w, _, _ in where]
    assert len(set(seen)) == len(seen) == n // 4 * 4
    assert set(seen) <= {(k, w) for k, e in enumerate(src.entries) for w in range((e["tokens"] - 1) // T)}
    blocks = [src.locate(j)[2] for j in range(n)]
    assert blocks == sorted(blocks)  # epoch 0 reads the blocks in order
    epoch1 = [src.locate(n + j)[:2] for j in range(n)]
    assert sorted(epoch1) == sorted(src.locate(j)[:2] for j in range(n)) and epoch1 != [src.locate(j)[:2] for j in range(n)]
    loader.close()


def test_resume_on_other_world_sizes(sets):
    N, M, B = 3, 4, 4  # 2 ranks of B=4: global batch 8
    ref = [step_ids([s]) for s in run(stream.Loader(sets["a"], 2 * B, T, seed=5, shuffle_block=2), N + M)]
    two = [stream.Loader(sets["a"], B, T, r, 2, seed=5, shuffle_block=2) for r in range(2)]
    first = list(zip(*[run(ld, N) for ld in two]))
    assert all(torch.equal(step_ids(s), r) for s, r in zip(first, ref[:N]))
    state = two[0].state_dict()
    assert state == two[1].state_dict() and state["sample"] == 8 * N and set(state) == {"sample", "seed", "T", "sources"}
    layouts = {"1 rank, B=8": (1, 2 * B, 1), "1 rank, B=4 x 2 micro": (1, B, 2), "4 ranks, B=2": (4, B // 2, 1)}
    for what, (world, b, micro) in layouts.items():
        loaders = [stream.Loader(sets["a"], b, T, r, world, seed=0, shuffle_block=2) for r in range(world)]
        for ld in loaders:
            ld.load_state_dict(json.loads(json.dumps(state)))  # as a checkpoint stores it
        got = [step_ids(s) for s in zip(*[run(ld, M, micro) for ld in loaders])]
        assert len(got) == M and all(torch.equal(g, r) for g, r in zip(got, ref[N:])), what


def grow(src_folder, dst, started, shards_first=2, delay=0.05):
    """Copy a complete set into dst shard by shard, its manifest listing only what is copied; the
    rest waits for `started` (the reader's first batch)."""
    m = shards.read_manifest(src_folder)
    os.makedirs(dst, exist_ok=True)
    for k, entry in enumerate(m["shards"]):
        if k == shards_first:
            started.wait(30)
        for ext in (".bin", ".idx"):
            shutil.copy(os.path.join(src_folder, entry["name"] + ext), os.path.join(dst, entry["name"] + ext))
        part = dict(m, shards=m["shards"][:k + 1], complete=False)
        shards.write_atomic(os.path.join(dst, shards.MANIFEST), json.dumps(part).encode())
        time.sleep(delay)
    shards.write_atomic(os.path.join(dst, shards.MANIFEST), json.dumps(m).encode())


def test_reads_while_preparing(sets, tmp_path):
    started = threading.Event()
    dst = str(tmp_path / "growing")
    writer = threading.Thread(target=grow, args=(sets["a"], dst, started))
    writer.start()
    try:
        loader = stream.Loader(dst, 4, T, seed=3, shuffle_block=2, poll_s=0.01, wait_s=30)
        got = [loader.next()[0]]
        assert not loader.sources[0].complete and len(loader.sources[0].entries) == 2
        started.set()
        n = stream.Loader(sets["a"], 4, T, shuffle_block=2).sources[0].n_windows // 4 + 3  # into epoch 1
        got += [loader.next()[0] for _ in range(n)]
    finally:
        started.set()
        writer.join()
    ref = stream.Loader(sets["a"], 4, T, seed=3, shuffle_block=2)
    assert all(torch.equal(g, ref.next()[0]) for g in got)
    assert loader.sources[0].complete and loader.sources[0].grew >= 3 and loader.waited_s > 0  # it waited, often


@pytest.fixture(scope="module")
def s3(sets):
    """A real S3 API (moto's server on 127.0.0.1) holding set a under s3://ingot/a."""
    pytest.importorskip("s3fs")
    server_mod = pytest.importorskip("moto.server")
    boto3 = pytest.importorskip("boto3")
    server = server_mod.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    env = dict(AWS_ACCESS_KEY_ID="test", AWS_SECRET_ACCESS_KEY="test", AWS_DEFAULT_REGION="us-east-1",
               AWS_ENDPOINT_URL=f"http://{host}:{port}")
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        boto3.client("s3").create_bucket(Bucket="ingot")
        import fsspec
        fs = fsspec.filesystem("s3")
        for name in ("a", "b"):
            fs.put(sets[name] + "/", f"ingot/{name}", recursive=True)
        yield fs
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        server.stop()


def on_disk(folder):
    """Bytes of the cached shards in a folder now (a file evicted while we look counts 0)."""
    total = 0
    for p in folder.glob("*.bin"):
        try:
            total += p.stat().st_size
        except FileNotFoundError:
            pass
    return total


def test_s3_equals_local_with_bounded_cache(sets, s3, tmp_path):
    m = shards.read_manifest(sets["a"])
    shard_bytes = 300 * 2
    cap = 5 * shard_bytes  # two blocks of 2 shards + one more
    loader = stream.Loader("s3://ingot/a", 4, T, seed=1, shuffle_block=2, cache_dir=str(tmp_path / "cache"),
                           cache_bytes=cap)
    local = stream.Loader(sets["a"], 4, T, seed=1, shuffle_block=2)
    n = loader.sources[0].n_windows // 4 + 5  # past one epoch
    peak = 0
    for _ in range(n):
        assert torch.equal(loader.next()[0], local.next()[0])
        peak = max(peak, loader.cache.nbytes(), on_disk(tmp_path / "cache"))
    assert peak <= cap and loader.cache.evicted >= len(m["shards"]) - 5
    for f in loader.fetching.values():
        f.result()
    used = [loader.sources[0].entries[k]["sha256"] for (_, k) in loader.fetching]
    assert set(used) <= set(loader.cache.files)  # what is in use stays cached
    with pytest.raises(ValueError, match="shuffle_block"):
        stream.Loader("s3://ingot/a", 4, T, shuffle_block=2, cache_bytes=shard_bytes)
    raw = bytearray(s3.cat_file("ingot/a/shard_000001.bin"))
    raw[3] ^= 1
    s3.pipe_file("ingot/bad/shard_000001.bin", bytes(raw))
    for e in m["shards"]:
        if e["name"] != "shard_000001":
            s3.put_file(os.path.join(sets["a"], e["name"] + ".bin"), f"ingot/bad/{e['name']}.bin")
        s3.put_file(os.path.join(sets["a"], e["name"] + ".idx"), f"ingot/bad/{e['name']}.idx")
    s3.put_file(os.path.join(sets["a"], "manifest.json"), "ingot/bad/manifest.json")
    bad = stream.Loader("s3://ingot/bad", 4, T, shuffle_block=2, cache_dir=str(tmp_path / "c2"))
    with pytest.raises(shards.ShardError, match=r"s3://ingot/bad/shard_000001\.bin: sha256 differs"):
        for _ in range(n):
            bad.next()
    loader.close(), local.close(), bad.close()
    path = stream.validation_file("s3://ingot/b", str(tmp_path / "val"))
    assert open(path, "rb").read() == open(os.path.join(sets["b"], "val.bin"), "rb").read() and os.path.getsize(path)
    assert stream.validation_file(sets["b"], "unused") == os.path.join(sets["b"], "val.bin")
    with pytest.raises(ValueError, match="no validation split"):
        stream.validation_file("s3://ingot/a", str(tmp_path / "val_a"))


def test_no_validation_names_the_cause(tmp_path):
    """A set whose val_fraction > 0 sent no document to validation (one document: the hash split is by
    document) is refused with that cause, not with advice to set the val_fraction it was prepared with."""
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "a.py").write_text("def f():\n    return 1\n")
    shards.prepare(str(tmp_path / "c"), str(tmp_path / "s"), *TOK, processes=1, val_fraction=0.1, verbose=False)
    with pytest.raises(ValueError, match=r"val_fraction=0.1 sends whole documents to validation by a hash, and none "
                                         r"of this set's fell there"):
        stream.validation_file(str(tmp_path / "s"), "unused")


def test_cache_evicts_least_recently_used(tmp_path):
    cache = stream.Cache(str(tmp_path), max_bytes=30)
    e = [dict(sha256=f"{i:064x}") for i in range(4)]
    for i in range(3):
        cache.put(e[i], bytes([i]) * 10)
    assert cache.get(e[0]) == str(tmp_path / f"{0:064x}.bin")  # 0 used again: 1 is now the oldest
    cache.put(e[3], b"x" * 10)
    assert list(cache.files) == [e[2]["sha256"], e[0]["sha256"], e[3]["sha256"]] and cache.get(e[1]) is None
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(f"{i:064x}.bin" for i in (0, 2, 3))
    cache.put(e[1], b"y" * 10, keep={e[2]["sha256"]})  # 2 is in use: 0 goes instead
    assert list(cache.files) == [e[2]["sha256"], e[3]["sha256"], e[1]["sha256"]] and cache.nbytes() == 30
    os.utime(tmp_path / f"{3:064x}.bin", (1, 1))  # the oldest file on disk
    again = stream.Cache(str(tmp_path), max_bytes=20)  # a restart with less room: the oldest file goes
    assert set(again.files) == {e[1]["sha256"], e[2]["sha256"]} and not (tmp_path / f"{3:064x}.bin").exists()


def _gloo_rank(rank, out, cache):
    dist.init_process_group("gloo")
    loader = stream.Loader("s3://ingot/a", 2, T, rank, 2, seed=7, shuffle_block=2, cache_dir=f"{cache}/{rank}")
    xs = torch.stack([loader.next()[0] for _ in range(6)])
    parts = [torch.zeros_like(xs) for _ in range(2)]
    dist.all_gather(parts, xs)
    if rank == 0:
        torch.save(dict(x=torch.cat(parts, dim=1), state=loader.state_dict()), out)


def test_two_processes_from_s3(sets, s3, tmp_path):
    spawn(_gloo_rank, 2, str(tmp_path / "x.pt"), str(tmp_path / "cache"))
    got = torch.load(tmp_path / "x.pt")
    local = stream.Loader(sets["a"], 4, T, seed=7, shuffle_block=2)
    ref = torch.stack([local.next()[0] for _ in range(6)])
    assert torch.equal(got["x"], ref) and got["state"]["sample"] == 24
    local.load_state_dict(got["state"])  # resumed in one process after the 2-process run
    cont = stream.Loader(sets["a"], 4, T, seed=7, shuffle_block=2)
    for _ in range(6):
        cont.next()
    assert torch.equal(local.next()[0], cont.next()[0])


def test_mixture_sources(sets):
    loader = stream.Loader({"a": sets["a"], "b": sets["b"]}, 8, T, weights={"a": 0.7, "b": 0.3}, seed=2,
                           shuffle_block=2)
    toks = {n: shards.tokens(sets[n]) for n in "ab"}
    starts = {n: np.concatenate([[0], np.cumsum([e["tokens"] for e in shards.read_manifest(sets[n])["shards"]])])
              for n in "ab"}
    names = loader.mixture.names
    for _ in range(30):
        where = loader.locate(loader.pos, loader.pos + 8)
        x, _ = loader.next()
        for row, (s, k, w, _, _) in enumerate(where):
            a = starts[names[s]][k] + w * T
            assert x[row].tolist() == toks[names[s]][a:a + T].tolist()
    rep = loader.report()
    counts = loader.mixture.counts(240)
    assert [rep[n]["samples"] for n in names] == counts.tolist() and sum(counts) == 240
    assert abs(rep["a"]["share"] - 0.7) < 0.1 and rep["a"]["target"] == pytest.approx(0.7)
    assert rep["b"]["tokens"] == counts[1] * T
