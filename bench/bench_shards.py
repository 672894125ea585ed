"""Benchmark (not a test) of shards.py and stream.py: preparation, reading, and a model's step rate per loader.

    python bench/bench_shards.py [--config=configs/tiny.py] [--corpus=stdlib] [--processes=1,2] [--json=PATH]
    python bench/bench_shards.py --config=configs/small.py --corpus=python --device=cuda --compile=1 \\
        --processes=16 --shard_tokens=33554432 --steps=20 --rounds=3 --json=...     # one GPU

1. Preparation: MB/s (10^6 bytes of UTF-8 document text in, wall time; the best of --prep_rounds
   runs taking turns) of prepare.prepare (one memmap, tiktoken's threads) and of shards.prepare with
   each --processes, the same corpus and the config's tokenizer (no cleaning, no FIM), into fresh
   folders; the CPU seconds of this process and of its workers (getrusage) in that best run; the
   cores this process may use.
2. Reading: the shard set from 1 served by moto's S3 server in its own process on 127.0.0.1:
   whole-shard fetch MB/s from S3 and from local disk (page cache warm), and the loader's rate
   (tokens/s of next() batches of the config's micro_batch_size x block_size) for data.Loader
   (memmap), stream.Loader on the local folder and on s3:// (cache empty at the start).
3. Step rate: the config's model (AdamW; on cuda bf16 autocast, --compile: torch.compile) trained
   from each loader: --warmup steps, then --rounds rounds of --steps steps, the loaders taking turns
   (a shared machine's noise falls on each alike); tokens/s of each round (wall time, synchronised),
   the median over rounds, and the median time inside next().
4. Resume cost of mixing: mix.Mixture(3 sources).counts(10^7).
"""
import argparse
import contextlib
import importlib.util
import json
import os
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from types import SimpleNamespace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch  # noqa: E402

import config  # noqa: E402  (the repository root is not on sys.path when run as a script)
import data  # noqa: E402
import pretrain  # noqa: E402
import tokenizer  # noqa: E402
from corpora import corpus  # noqa: E402
from corpora import mix  # noqa: E402
from corpora import prepare  # noqa: E402
from corpora import shards  # noqa: E402
from corpora import stream  # noqa: E402
from model import ModelConfig, Transformer  # noqa: E402

KINDS = ("memmap", "local", "s3")  # s3 left out where moto or s3fs is not installed (a GPU box without network)


def timed(fn):
    t = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t


def prep(args, cfg, tmp):
    mb = sum(len(d.encode()) for d in corpus.iter_documents(args.corpus)) / 1e6
    tok = tokenizer.get_tokenizer(cfg.tokenizer, cfg.tokenizer_vocab)
    runs = {"prepare.prepare (memmap)": lambda out: prepare.prepare(args.corpus, tok, out, val_fraction=0.0, val_tokens=0,
                                                              verbose=False)}
    for p in args.processes:
        runs[f"shards.prepare processes={p}"] = lambda out, p=p: shards.prepare(
            args.corpus, out, cfg.tokenizer, cfg.tokenizer_vocab, shard_tokens=args.shard_tokens, processes=p,
            verbose=False)
    best, cpu = {}, {}
    for _ in range(args.prep_rounds):
        for i, (name, fn) in enumerate(runs.items()):
            out = os.path.join(tmp, f"prep{i}")  # fresh each time; the last round's stay for 2 and 3
            shutil.rmtree(out, ignore_errors=True)
            before = [resource.getrusage(w) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
            _, s = timed(lambda: fn(out))
            after = [resource.getrusage(w) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
            if s < best.get(name, float("inf")):  # CPU seconds (user + system) of the best run
                best[name] = s
                cpu[name] = [a.ru_utime - b.ru_utime + a.ru_stime - b.ru_stime for a, b in zip(after, before)]
    m = shards.read_manifest(os.path.join(tmp, "prep1"))
    rows = [dict(run=name, seconds=s, mb_per_s=mb / s, cpu_s_this_process=cpu[name][0], cpu_s_workers=cpu[name][1])
            for name, s in best.items()]
    return dict(corpus=args.corpus, mb=mb, cores=len(os.sched_getaffinity(0)), rounds=args.prep_rounds,
                tokens=m["n_tokens"], shards=len(m["shards"]), rows=rows)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def s3_server(folder):
    """moto's S3 server in a child process, the set uploaded to s3://bench/set."""
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


def loader_for(kind, sets, B, T, cache, device="cpu"):
    if kind == "memmap":
        return data.Loader(os.path.join(sets["mm"], "train.bin"), B, T, seed=0, device=device)
    url = "s3://bench/set" if kind == "s3" else sets["shards"]
    return stream.Loader(url, B, T, seed=0, device=device, cache_dir=cache, cache_bytes=1 << 36, shuffle_block=2)


def reading(args, tmp, sets, B, T, kinds):
    m = shards.read_manifest(sets["shards"])
    rows = []
    stores = [("local", stream.Store(sets["shards"]))]
    stores += [("s3", stream.Store("s3://bench/set"))] if "s3" in kinds else []
    for kind, store in stores:
        n, s = timed(lambda: sum(len(store.read(e["name"] + ".bin")) for e in m["shards"]))
        rows.append(dict(run=f"fetch whole shards, {kind}", mb_per_s=n / 1e6 / s, seconds=s))
    for kind in kinds:
        ld = loader_for(kind, sets, B, T, os.path.join(tmp, f"read_{kind}"))
        _, s = timed(lambda: [ld.next() for _ in range(args.batches)])
        rows.append(dict(run=f"loader next(), {kind}", tokens_per_s=args.batches * B * T / s, batches=args.batches,
                         seconds=s))
        if kind != "memmap":
            ld.close()
    return rows


def steps(args, cfg, tmp, sets, B, T, kinds):
    device = torch.device(args.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else contextlib.nullcontext())
    runs = {}
    for kind in kinds:
        torch.manual_seed(0)
        model = Transformer(ModelConfig.from_cfg(cfg)).to(device)
        fwd = torch.compile(model) if args.compile else model
        runs[kind] = dict(fwd=fwd, opt=torch.optim.AdamW(model.parameters(), lr=cfg.lr), rates=[], next=[],
                          loader=loader_for(kind, sets, B, T, os.path.join(tmp, f"steps_{kind}"), device))

    def step(r):
        t0 = time.perf_counter()
        x, y = r["loader"].next()
        r["next"].append(time.perf_counter() - t0)
        with autocast:
            loss = r["fwd"](x, y)
        loss.backward()
        r["opt"].step()
        r["opt"].zero_grad(set_to_none=True)

    for r in runs.values():
        for _ in range(args.warmup):
            step(r)
        r["next"].clear()
    for _ in range(args.rounds):
        for r in runs.values():
            sync()
            t0 = time.perf_counter()
            for _ in range(args.steps):
                step(r)
            sync()
            r["rates"].append(args.steps * B * T / (time.perf_counter() - t0))
    rows = []
    for kind, r in runs.items():
        rows.append(dict(run=f"step, {kind}", tokens_per_s=statistics.median(r["rates"]), rounds=r["rates"],
                         median_next_s=statistics.median(r["next"])))
        if kind != "memmap":
            r["loader"].close()
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="configs/tiny.py")
    p.add_argument("--corpus", default="stdlib")
    p.add_argument("--processes", default="1,2")
    p.add_argument("--prep_rounds", type=int, default=2)
    p.add_argument("--shard_tokens", type=int, default=1 << 20)
    p.add_argument("--batches", type=int, default=300)
    p.add_argument("--device", default="cpu")
    p.add_argument("--compile", type=int, default=0)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=30, help="steps per loader and round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", default="")
    args = p.parse_args()
    args.processes = [int(x) for x in args.processes.split(",")]
    if args.device == "cpu":
        torch.set_num_threads(1)
    d = config.defaults(pretrain.EXTRA)  # a pretraining config: its data and sample keys too
    d.update(config.read_file(args.config, d))
    cfg = SimpleNamespace(**d)
    cfg.vocab_size = tokenizer.get_tokenizer(cfg.tokenizer, cfg.tokenizer_vocab).n_vocab
    B, T = cfg.micro_batch_size, cfg.block_size
    rep = dict(date=time.strftime("%Y-%m-%d"), torch=torch.__version__, config=args.config, B=B, T=T,
               device=torch.cuda.get_device_name() if args.device == "cuda" else "cpu", compile=args.compile,
               commit=subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                     text=True).stdout.strip())
    with tempfile.TemporaryDirectory() as tmp:
        rep["prepare"] = prep(args, cfg, tmp)
        sets = dict(mm=os.path.join(tmp, "prep0"), shards=os.path.join(tmp, "prep1"))
        missing = [m for m in ("moto", "s3fs", "boto3") if importlib.util.find_spec(m) is None]
        kinds, server = [k for k in KINDS if k != "s3" or not missing], None
        if missing:
            rep["s3_skipped"] = f"{', '.join(missing)} not installed (pip install -r requirements-test.txt)"
            print(f"s3 rows skipped: {rep['s3_skipped']}")
        else:
            server = s3_server(sets["shards"])
        try:
            rep["read"] = reading(args, tmp, sets, B, T, kinds)
            rep["steps"] = steps(args, cfg, tmp, sets, B, T, kinds)
        finally:
            if server is not None:
                server.terminate()
                server.wait()
    m = mix.Mixture({"prose": 0.7, "code": 0.2, "math": 0.1}, seed=0)
    _, s = timed(lambda: m.counts(10 ** 7))
    rep["mix_counts_1e7_s"] = s
    pr = rep["prepare"]
    print(f"prepare {pr['corpus']} ({pr['mb']:.1f} MB -> {pr['tokens']:,} tokens, {pr['shards']} shards; "
          f"{pr['cores']} cores; best of {pr['rounds']}):")
    for r in pr["rows"]:
        print(f"  {r['run']:<32} {r['mb_per_s']:7.2f} MB/s  ({r['seconds']:.1f} s; CPU s: this process "
              f"{r['cpu_s_this_process']:.1f}, workers {r['cpu_s_workers']:.1f})")
    print("read:")
    for r in rep["read"]:
        print(f"  {r['run']:<32} " + (f"{r['mb_per_s']:9.1f} MB/s" if "mb_per_s" in r else
                                      f"{r['tokens_per_s']:12,.0f} tokens/s"))
    print(f"{args.config} steps (B={B}, T={T}, {rep['device']}, compile={args.compile}):")
    for r in rep["steps"]:
        print(f"  {r['run']:<32} {r['tokens_per_s']:12,.0f} tokens/s (rounds: "
              f"{', '.join(f'{x:,.0f}' for x in r['rounds'])})  next() {r['median_next_s'] * 1e3:6.2f} ms")
    print(f"mix counts over 10^7 samples (a resume's recount): {s:.2f} s")
    if args.json:
        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(rep, f, indent=1)
    return rep


if __name__ == "__main__":
    main()
