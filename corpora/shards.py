"""Token shards: a corpus tokenized once into fixed-size shards that training streams (stream.py).

    python -m corpora.shards prepare SOURCE OUT [--tokenizer=cl100k_base] [--vocab=0] [--shard_tokens=33554432]
                                                [--processes=N] [--val_fraction=0.0] [--text_field=text] [--max_docs=0]
    python -m corpora.shards verify OUT          # every shard's size and sha256 against the manifest

OUT holds shard_000000.bin, ... (raw little-endian uint16/uint32 tokens: shard k is tokens
[k*shard_tokens, (k+1)*shard_tokens) of the stream "encode(doc) + [eos]" over the corpus' documents
in order, the last one shorter), shard_000000.idx (int64: the offsets in the shard where a document
starts) and manifest.json (settings, then per shard its tokens, documents, sha256 of both files and
where the next shard starts), written again after every shard: a reader may start on the shards
listed while preparation goes on, and `complete` says when the set is whole. With val_fraction > 0
each document is validation with that probability (BLAKE2b of its index) and goes to OUT/val.bin
(+ meta.json, the form data.eval_batches reads) instead of the shards.

Same tokens as prepare.prepare: the shards joined are its train.bin for the same corpus and
tokenizer when it keeps no validation (val_fraction=0, val_tokens=0). Parallel: the parent reads the
documents (corpus.iter_documents) and hands ranges of them to a pool of `processes` tokenizing
workers, in order; it only cuts and writes. Resumable: a restart verifies the listed shards (size,
sha256), keeps every good one up to the first bad one, and goes on from there; a finished set is
returned as it is. Settings that differ from the manifest's are refused (another OUT, or delete it).
Cleaning and dedup: run clean.py on the corpus first and shard its clean.jsonl.
"""
import argparse
import collections
import hashlib
import json
import multiprocessing
import os
import sys

import numpy as np

import tokenizer as tokenizer_mod
from corpora import corpus

FORMAT = "ingot-shards-v1"
SHARD_TOKENS = 1 << 25            # 32M tokens: 64 MB of uint16 per shard
MANIFEST = "manifest.json"


class ShardError(corpus.DataError):
    """A shard that is missing, truncated or altered (named), or a shard set that does not fit."""


def shard_name(k):
    return f"shard_{k:06d}"


def sha256(raw):
    return hashlib.sha256(raw).hexdigest()


def check_shard(entry, tokens_raw, index_raw, dtype, where=""):
    """Raise ShardError naming the shard when its bytes do not match its manifest entry."""
    name = f"{where}{entry['name']}"
    want = entry["tokens"] * np.dtype(dtype).itemsize
    if len(tokens_raw) != want:
        raise ShardError(f"{name}.bin: {len(tokens_raw):,} bytes, the manifest says {want:,} "
                         f"({'truncated' if len(tokens_raw) < want else 'too long'}); prepare it again "
                         "(python -m corpora.shards prepare resumes from the first bad shard)")
    if sha256(tokens_raw) != entry["sha256"]:
        raise ShardError(f"{name}.bin: sha256 differs from the manifest's (the file was altered); prepare it again")
    if len(index_raw) != 8 * entry["docs"] or sha256(index_raw) != entry["index_sha256"]:
        raise ShardError(f"{name}.idx: does not match the manifest ({len(index_raw):,} bytes, "
                         f"{8 * entry['docs']:,} expected, or another sha256); prepare it again")


def read_manifest(folder):
    path = os.path.join(folder, MANIFEST)
    try:
        with open(path) as f:
            m = json.load(f)
    except FileNotFoundError:
        return None
    except ValueError as e:
        raise ShardError(f"{path}: not valid JSON ({e}); delete the folder and prepare again") from None
    if m.get("format") != FORMAT:
        raise ShardError(f"{path}: format {m.get('format')!r}, this code reads {FORMAT!r}")
    return m


def read_bytes(path):
    """A file's bytes; b"" when it is missing."""
    try:
        with open(path, "rb") as f:
            return f.read()
    except FileNotFoundError:
        return b""


def verify(folder):
    """Check every listed shard of a local folder (size, sha256); ShardError names the first bad one.
    Returns the manifest."""
    m = read_manifest(folder)
    if m is None:
        raise ShardError(f"{folder}: no {MANIFEST} (prepare it with python -m corpora.shards prepare)")
    for entry in m["shards"]:
        base = os.path.join(folder, entry["name"])
        check_shard(entry, read_bytes(base + ".bin"), read_bytes(base + ".idx"), m["settings"]["dtype"], f"{folder}/")
    return m


def write_atomic(path, raw):
    """Write via a temporary file, synced, renamed: readers see the old file or the whole new one."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(raw)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _write_manifest(folder, m):
    write_atomic(os.path.join(folder, MANIFEST), json.dumps(m, indent=1).encode())


def is_val(i, val_fraction):
    """Document i goes to validation: BLAKE2b(i) as a fraction of 2^64 below val_fraction."""
    if val_fraction <= 0:
        return False
    h = int.from_bytes(hashlib.blake2b(str(i).encode(), digest_size=8, person=b"ingotval").digest(), "little")
    return h < val_fraction * 2.0 ** 64


def encode_documents(args):
    """A worker's task: (tokenizer, vocab, texts) -> (ids of every text followed by EOS, one array; lengths)."""
    spec, vocab, texts = args
    tok = tokenizer_mod.get_tokenizer(spec, vocab)  # the BPE is cached per process
    ids = [tok.encode(t) for t in texts]
    lens = np.array([len(x) + 1 for x in ids], dtype=np.int64)
    out = np.empty(int(lens.sum()), dtype=np.uint32)
    ends = np.cumsum(lens)
    for x, end, n in zip(ids, ends, lens):
        out[end - n:end - 1] = x
        out[end - 1] = tok.eos_id
    return out, lens


def _chunks(docs, start, chunk_chars, max_docs=4096):
    # (index of the first document, [texts]) of about chunk_chars characters each, from document `start` on
    batch, chars, first = [], 0, start
    for i, text in enumerate(docs, start):
        batch.append(text)
        chars += len(text)
        if chars >= chunk_chars or len(batch) >= max_docs:
            yield first, batch
            batch, chars, first = [], 0, i + 1
    if batch:
        yield first, batch


def _encoded(chunks, spec, vocab, processes):
    # (first document, ids, lengths) per chunk, in order; a bounded window of chunks in flight
    if processes <= 1:
        for first, texts in chunks:
            yield (first, *encode_documents((spec, vocab, texts)))
        return
    methods = multiprocessing.get_all_start_methods()
    with multiprocessing.get_context("fork" if "fork" in methods else "spawn").Pool(processes) as pool:
        pending = collections.deque()
        for first, texts in chunks:
            pending.append((first, pool.apply_async(encode_documents, ((spec, vocab, texts),))))
            if len(pending) >= 2 * processes:
                first, res = pending.popleft()
                yield (first, *res.get())
        while pending:
            first, res = pending.popleft()
            yield (first, *res.get())


def _settings(source, tok, spec, vocab, shard_tokens, text_field, max_docs, val_fraction):
    return dict(source=corpus.source_key(source), fingerprint=corpus.source_fingerprint(source, FORMAT),
                text_field=text_field, max_docs=max_docs, tokenizer=tok.name,
                vocab=vocab, n_vocab=tok.n_vocab, eos_id=tok.eos_id,
                dtype=np.dtype(np.uint16 if tok.n_vocab <= 1 << 16 else np.uint32).name,
                shard_tokens=shard_tokens, val_fraction=val_fraction)


def _resumed(out, settings, verbose):
    # The manifest to continue: its verified shards up to the first bad one (others dropped), or a new one
    m = read_manifest(out)
    if m is None:
        return dict(format=FORMAT, settings=settings, complete=False, shards=[], n_docs=0, n_tokens=0, n_val=0)
    if m["settings"] != settings:
        diff = {k: (m["settings"].get(k), v) for k, v in settings.items() if m["settings"].get(k) != v}
        raise ShardError(f"{out} holds shards of other settings {diff} (theirs, yours): prepare into another folder "
                         "or delete this one")
    for k, entry in enumerate(m["shards"]):
        base = os.path.join(out, entry["name"])
        try:
            check_shard(entry, read_bytes(base + ".bin"), read_bytes(base + ".idx"), settings["dtype"], f"{out}/")
        except ShardError as e:
            if verbose:
                print(f"shards: {e}; preparing again from shard {k}")
            m["shards"], m["complete"] = m["shards"][:k], False
            break
    return m


def prepare(source, out, tokenizer="cl100k_base", vocab=0, shard_tokens=SHARD_TOKENS, processes=None,
            text_field="text", max_docs=0, val_fraction=0.0, chunk_chars=1 << 22, verbose=True):
    """Tokenize `source` (any corpus.iter_documents source) into token shards in the local folder `out`
    (see the module docstring). tokenizer / vocab: as tokenizer.get_tokenizer. processes: tokenizing
    workers (default: the cores). max_docs > 0: only the first max_docs documents. Resumes an
    interrupted preparation; returns the manifest (a dict)."""
    if not (isinstance(shard_tokens, int) and shard_tokens >= 2):
        raise ShardError(f"shard_tokens={shard_tokens} must be an integer >= 2")
    if not 0 <= val_fraction < 1:
        raise ShardError(f"val_fraction={val_fraction} must be in [0, 1)")
    tok = tokenizer_mod.get_tokenizer(tokenizer, vocab)
    settings = _settings(source, tok, tokenizer, vocab, shard_tokens, text_field, max_docs, val_fraction)
    os.makedirs(out, exist_ok=True)
    m = _resumed(out, settings, verbose)
    if m["complete"]:
        if verbose:
            print(f"shards: reusing {out} ({len(m['shards'])} shards, {m['n_tokens']:,} tokens)")
        return m
    dtype = np.dtype(settings["dtype"])
    last = m["shards"][-1] if m["shards"] else dict(end=[0, 0], n_tokens=0, n_val=0)
    start_doc, skip = last["end"]
    m.update(n_tokens=last["n_tokens"], n_val=last["n_val"])
    val_path = os.path.join(out, "val.bin")
    with open(val_path, "ab") as f:  # back to its length at the last good shard
        f.truncate(last["n_val"] * dtype.itemsize)
    report = corpus.Intake()
    docs = corpus.iter_documents(source, text_field, report)
    for _ in range(start_doc):  # read, not tokenized again
        next(docs)
    if max_docs:
        docs = (d for d, _ in zip(docs, range(max_docs - start_doc)))
    processes = processes or len(os.sched_getaffinity(0))
    buf, held, starts, doc_no = [], 0, [], start_doc  # tokens not yet in a shard, their count, doc starts in them

    def write_shard(n, end):
        nonlocal buf, held, starts
        flat = np.concatenate(buf) if buf else np.zeros(0, np.uint32)
        raw = flat[:n].astype(dtype).tobytes()
        idx = np.array([s for s in starts if s < n], np.int64).tobytes()
        k = len(m["shards"])
        base = os.path.join(out, shard_name(k))
        write_atomic(base + ".idx", idx)
        write_atomic(base + ".bin", raw)
        vf.flush()
        os.fsync(vf.fileno())
        m["n_tokens"] += n
        m["shards"].append(dict(name=shard_name(k), tokens=n, docs=len(idx) // 8, sha256=sha256(raw),
                                index_sha256=sha256(idx), end=end, n_tokens=m["n_tokens"], n_val=m["n_val"]))
        _write_manifest(out, m)  # last: a shard is listed only once its files are whole
        buf, held, starts = [flat[n:]], held - n, [s - n for s in starts if s >= n]

    with open(val_path, "ab") as vf:
        for first, ids, lens in _encoded(_chunks(docs, start_doc, chunk_chars), tokenizer, vocab, processes):
            offsets = np.concatenate([[0], np.cumsum(lens)])
            for j in range(len(lens)):
                doc, part = first + j, ids[offsets[j]:offsets[j + 1]]
                if is_val(doc, val_fraction):
                    vf.write(part.astype(dtype).tobytes())
                    m["n_val"] += len(part)
                    continue
                cut = skip if doc == start_doc else 0  # resuming inside this document: its head is in a shard
                if not cut:
                    starts.append(held)
                doc_pos = held - cut  # where the document's first token would be in the buffer
                buf.append(part[cut:])
                held += len(part) - cut
                while held >= shard_tokens:  # the next shard starts at token (shard_tokens - doc_pos) of doc
                    write_shard(shard_tokens, [doc, shard_tokens - doc_pos] if held > shard_tokens else [doc + 1, 0])
                    doc_pos -= shard_tokens
            doc_no = first + len(lens)
            if verbose:
                print(f"shards: {doc_no:,} documents, {m['n_tokens'] + held:,} tokens, {len(m['shards'])} shards",
                      end="\r", flush=True)
        if held:
            write_shard(held, [doc_no, 0])
    m["n_docs"] = doc_no
    m["complete"], m["intake"] = True, report.counts()
    with open(os.path.join(out, "meta.json"), "w") as f:  # val.bin's dtype, for data.eval_batches
        json.dump(dict(dtype=dtype.name, n_val=m["n_val"], n_vocab=tok.n_vocab, eos_id=tok.eos_id), f)
    _write_manifest(out, m)
    if verbose:
        print(f"\nshards: {out}: {m['n_docs']:,} documents -> {m['n_tokens']:,} tokens in {len(m['shards'])} shards"
              f" of {shard_tokens:,}, {m['n_val']:,} validation tokens, {dtype.name}")
        for line in report.summary():
            print(f"shards: {line}")
    return m


def tokens(folder):
    """All tokens of a local shard set, joined (a test's and a small corpus' view; verified first)."""
    m = verify(folder)
    dtype = m["settings"]["dtype"]
    parts = [np.fromfile(os.path.join(folder, e["name"] + ".bin"), dtype=dtype) for e in m["shards"]]
    return np.concatenate(parts) if parts else np.zeros(0, dtype)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    pp = corpus.add_arguments(sub.add_parser("prepare", help="tokenize a corpus into shards (resumes)"))
    pp.add_argument("--tokenizer", default="cl100k_base", help="a tiktoken name or a folder with tokenizer.json")
    pp.add_argument("--vocab", type=int, default=0, help="> 0: the first N tokens of the BPE (as tokenizer_vocab)")
    pp.add_argument("--shard_tokens", type=int, default=SHARD_TOKENS)
    pp.add_argument("--processes", type=int, default=0, help="tokenizing workers (0: every core)")
    pp.add_argument("--val_fraction", type=float, default=0.0)
    pv = sub.add_parser("verify", help="check every shard's size and sha256")
    pv.add_argument("out")
    args = p.parse_args(argv)
    try:
        if args.cmd == "verify":
            m = verify(args.out)
            print(f"{args.out}: {len(m['shards'])} shards, {m['n_tokens']:,} tokens, all match the manifest"
                  + ("" if m["complete"] else " (preparation not finished)"))
            return m
        return prepare(args.source, args.out, args.tokenizer, args.vocab, args.shard_tokens, args.processes or None,
                       args.text_field, args.max_docs, args.val_fraction)
    except corpus.DataError as e:
        raise SystemExit(f"shards.py: {e}")


if __name__ == "__main__":
    main(sys.argv[1:])
