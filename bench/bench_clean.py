"""Benchmark (not a test) of clean.py on this machine's CPU: documents/s and MB/s for cleaning
alone, and for cleaning + MinHash near-dedup, on >= 500 MB of text, plus peak RAM.

    python bench/bench_clean.py [--mb=500] [--processes=N] [--root=DIR]

Corpus: every code/prose file under the Python installation's lib folder (stdlib and
site-packages, sorted); when that is under --mb, edited copies (every 40th line dropped, ~2.5%
of the lines: near-duplicates; a new offset per round) of the same files follow until --mb is reached. MB = 10^6 bytes
of input. Peak RAM: ru_maxrss of this process and of the largest worker.
"""
import argparse
import os
import resource
import sys
import sysconfig
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from corpora import clean  # noqa: E402  (the repository root is not on sys.path when run as a script)


def corpus(root, limit):
    """(name, bytes, kind) records: all files once, then edited copies up to `limit` bytes."""
    total, files = 0, []
    for name, doc, kind in clean.read_corpus(root):
        files.append(name)
        total += len(doc)
        yield name, doc, kind
    for copy in range(1, 40 if files else 1):   # copy k drops lines i with i % 40 == 40 - k
        for name in files:
            if total >= limit:
                return
            with open(name, "rb") as f:
                lines = f.read().split(b"\n")
            doc = b"\n".join(ln for i, ln in enumerate(lines) if i % 40 != 40 - copy)
            total += len(doc)
            ext = os.path.splitext(name)[1].lower()
            yield f"{name}#edit{copy}", doc, "code" if ext in clean.CODE_EXT else "prose"


def run(cfg, args):
    t = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        stats = clean.clean_corpus(corpus(args.root, args.mb * 10**6), os.path.join(tmp, "out.jsonl"), cfg,
                                   processes=args.processes, workdir=tmp)
    return stats, time.perf_counter() - t


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--mb", type=int, default=500)
    p.add_argument("--processes", type=int, default=len(os.sched_getaffinity(0)))
    p.add_argument("--root", default=sysconfig.get_paths()["stdlib"], help="stdlib + site-packages here")
    args = p.parse_args()
    print(f"root {args.root}, {args.processes} processes, load average {os.getloadavg()}")
    base = None
    for name, cfg in (("clean + exact dedup", clean.CleanConfig()),
                      ("clean + exact + MinHash near-dedup", clean.CleanConfig(near_dedup=True))):
        stats, seconds = run(cfg, args)
        mb = stats.chars_in / 1e6
        print(f"\n{name}: {stats.docs} docs, {mb:.0f} MB in {seconds:.1f} s: "
              f"{stats.docs / seconds:.0f} docs/s, {mb / seconds:.2f} MB/s")
        if base is not None:
            extra = seconds - base[1]
            print(f"MinHash near-dedup alone (the difference): {extra:.1f} s for {base[0].kept} docs, "
                  f"{base[0].kept / extra:.0f} docs/s, {base[0].chars_out / 1e6 / extra:.2f} MB/s of cleaned text")
        print(stats.report())
        base = (stats, seconds)
        print(f"load average {os.getloadavg()}")
    to_mb = 1 / 1024
    print(f"\npeak RSS: main {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * to_mb:.0f} MB, "
          f"largest worker {resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * to_mb:.0f} MB")


if __name__ == "__main__":
    main()
