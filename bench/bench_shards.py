"""Benchmark (not a test) of shards.py and stream.py on this machine's CPU.

    python bench/bench_shards.py [--corpus=stdlib] [--processes=1,2] [--steps=30] [--rounds=3] [--json=PATH]

1. Preparation: MB/s (10^6 bytes of UTF-8 document text in, wall time) of data.prepare (one memmap,
   tiktoken's threads) and of shards.prepare with each --processes, the same corpus and tokenizer
   (the tiny config's: cl100k_base cut to 4096), into fresh folders; the cores this process may use.
2. Reading: the shard set from 1 (--shard_tokens per shard) served by moto's S3 server in its own
   process on 127.0.0.1: whole-shard fetch MB/s from S3 and from local disk (page cache warm), and
   the loader's rate (tokens/s of next() batches of the tiny config's B x T) for data.Loader
   (memmap), stream.Loader on the local folder and on s3:// (cache empty at the start).
3. Step rate: the tiny config's model (configs/tiny.py's shape, AdamW, one process, fp32) trained
   from each loader, --rounds rounds of --steps steps with the loaders taking turns; median step
   time and median time inside next() (3 warm-up steps per round left out).
4. Resume cost of mixing: mix.Mixture(3 sources).counts(10^7).
"""
import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import numpy as np  # noqa: E402
import torch  # noqa: E402

import corpus  # noqa: E402  (the repository root is not on sys.path when run as a script)
import data  # noqa: E402
import mix  # noqa: E402
import shards  # noqa: E402
import stream  # noqa: E402
from model import ModelConfig, Transformer  # noqa: E402

TOK = ("cl100k_base", 4096)


def timed(fn):
    t = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t


def prep(args, tmp):
    mb = sum(len(d.encode()) for d in corpus.iter_documents(args.corpus)) / 1e6
    tok = data.get_tokenizer(*TOK)
    rows = []
    _, s = timed(lambda: data.prepare(args.corpus, tok, os.path.join(tmp, "mm"), val_fraction=0.0, val_tokens=0,
                                      verbose=False))
    rows.append(dict(run="data.prepare (memmap)", seconds=s, mb_per_s=mb / s))
    for p in args.processes:
        out = os.path.join(tmp, f"sh{p}")
        m, s = timed(lambda: shards.prepare(args.corpus, out, *TOK, shard_tokens=args.shard_tokens, processes=p,
                                            verbose=False))
        rows.append(dict(run=f"shards.prepare processes={p}", seconds=s, mb_per_s=mb / s, shards=len(m["shards"]),
                         tokens=m["n_tokens"]))
    return dict(corpus=args.corpus, mb=mb, cores=len(os.sched_getaffinity(0)), rows=rows)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def s3_server(folder):
    """moto's S3 server in a child process, the set uploaded to s3://bench/set; (process, env)."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    os.environ.update(AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1",
                      AWS_ENDPOINT_URL=f"http://127.0.0.1:{port}")
    import boto3
    import fsspec
    for _ in range(100):
        try:
            boto3.client("s3").create_bucket(Bucket="bench")
            break
        except Exception:
            time.sleep(0.1)
    fsspec.filesystem("s3").put(folder + "/", "bench/set", recursive=True)
    return proc


def loader_for(kind, folder, B, T, cache):
    if kind == "memmap":
        return data.Loader(os.path.join(folder, "train.bin"), B, T, seed=0)
    url = "s3://bench/set" if kind == "s3" else folder
    return stream.Loader(url, B, T, seed=0, cache_dir=cache, cache_bytes=1 << 34, shuffle_block=2)


def reading(args, tmp, sets, B, T):
    folder = sets["shards"]
    m = shards.read_manifest(folder)
    rows = []
    for kind, store in (("local", stream.Store(folder)), ("s3", stream.Store("s3://bench/set"))):
        raw, s = timed(lambda: sum(len(store.read(e["name"] + ".bin")) for e in m["shards"]))
        rows.append(dict(run=f"fetch whole shards, {kind}", mb_per_s=raw / 1e6 / s, seconds=s))
    for kind in ("memmap", "local", "s3"):
        cache = os.path.join(tmp, f"cache_{kind}")
        shutil.rmtree(cache, ignore_errors=True)
        ld = loader_for(kind, sets["mm"] if kind == "memmap" else folder, B, T, cache)
        n = args.batches
        _, s = timed(lambda: [ld.next() for _ in range(n)])
        rows.append(dict(run=f"loader next(), {kind}", tokens_per_s=n * B * T / s, batches=n, seconds=s))
        if kind != "memmap":
            ld.close()
    return rows


def steps(args, tmp, sets, B, T):
    # one model + optimizer + loader per kind; --rounds rounds of --steps steps, the kinds taking turns
    # (a shared machine's noise then falls on every kind alike)
    cfg = config_tiny()
    runs = {}
    for kind in ("memmap", "local", "s3"):
        torch.manual_seed(0)
        model = Transformer(ModelConfig.from_cfg(cfg))
        runs[kind] = dict(model=model, opt=torch.optim.AdamW(model.parameters(), lr=cfg.lr), step=[], next=[],
                          loader=loader_for(kind, sets["mm"] if kind == "memmap" else sets["shards"], B, T,
                                            os.path.join(tmp, f"steps_{kind}")))
    for _ in range(args.rounds):
        for kind, r in runs.items():
            for i in range(args.steps):
                t0 = time.perf_counter()
                x, y = r["loader"].next()
                t1 = time.perf_counter()
                r["model"](x, y).backward()
                r["opt"].step()
                r["opt"].zero_grad(set_to_none=True)
                if i >= 3:  # warm-up steps of each round left out
                    r["step"].append(time.perf_counter() - t0)
                    r["next"].append(t1 - t0)
    rows = []
    for kind, r in runs.items():
        med = statistics.median(r["step"])
        rows.append(dict(run=f"tiny step, {kind}", median_step_s=med, tokens_per_s=B * T / med,
                         median_next_s=statistics.median(r["next"]), steps=len(r["step"])))
        if kind != "memmap":
            r["loader"].close()
    return rows


def config_tiny():
    import config
    d = config.defaults()
    d.update(config.read_file(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                           "configs", "tiny.py"), d))
    d["vocab_size"] = data.get_tokenizer(*TOK).n_vocab
    from types import SimpleNamespace
    return SimpleNamespace(**d)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--corpus", default="stdlib")
    p.add_argument("--processes", default="1,2")
    p.add_argument("--shard_tokens", type=int, default=1 << 20)
    p.add_argument("--batches", type=int, default=300)
    p.add_argument("--steps", type=int, default=30, help="timed steps per kind and round (3 more warm up)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", default="")
    args = p.parse_args()
    args.processes = [int(x) for x in args.processes.split(",")]
    torch.set_num_threads(1)
    cfg = config_tiny()
    B, T = cfg.micro_batch_size, cfg.block_size
    rep = dict(date=time.strftime("%Y-%m-%d"), torch=torch.__version__, B=B, T=T,
               commit=subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip())
    with tempfile.TemporaryDirectory() as tmp:
        rep["prepare"] = prep(args, tmp)
        sets = dict(mm=os.path.join(tmp, "mm"), shards=os.path.join(tmp, f"sh{args.processes[0]}"))
        server = s3_server(sets["shards"])
        try:
            rep["read"] = reading(args, tmp, sets, B, T)
            rep["steps"] = steps(args, tmp, sets, B, T)
        finally:
            server.terminate()
            server.wait()
    m = mix.Mixture({"prose": 0.7, "code": 0.2, "math": 0.1}, seed=0)
    _, s = timed(lambda: m.counts(10 ** 7))
    rep["mix_counts_1e7_s"] = s
    pr = rep["prepare"]
    print(f"prepare {pr['corpus']} ({pr['mb']:.1f} MB, {pr['cores']} cores):")
    for r in pr["rows"]:
        print(f"  {r['run']:<32} {r['mb_per_s']:7.2f} MB/s  ({r['seconds']:.1f} s)")
    print("read:")
    for r in rep["read"]:
        print(f"  {r['run']:<32} " + (f"{r['mb_per_s']:9.1f} MB/s" if "mb_per_s" in r else
                                      f"{r['tokens_per_s']:12,.0f} tokens/s"))
    print(f"tiny config steps (B={B}, T={T}, 1 process):")
    for r in rep["steps"]:
        print(f"  {r['run']:<32} {r['median_step_s'] * 1e3:7.1f} ms/step  {r['tokens_per_s']:9,.0f} tokens/s  "
              f"next() {r['median_next_s'] * 1e3:6.2f} ms")
    print(f"mix counts over 10^7 samples (a resume's recount): {s:.2f} s")
    if args.json:
        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(rep, f, indent=1)
    return rep


if __name__ == "__main__":
    np.seterr(all="ignore")
    main()
