"""Data: the pretraining loaders, over a corpus' tokenized memmaps (corpora/prepare.py) or streamed token shards.

    loader, val_path, meta = data.make_loader(cfg, grid, tok, T)   # what pretraining calls: either kind
    loader = data.Loader(train_bin, B, T, rank, world, seed); x, y = loader.next()  # state_dict(): resume
    loader = data.Documents(train_bin, B, T, rank, world, seed, cut="split")  # rows="documents": one per row
    batches, note = data.eval_plan(val_bin, B, T, world, n)        # what the validation split holds
    for x, y in data.eval_batches(val_bin, B, T, rank, world, n): ...

A corpus (data=...) is tokenized once by prepare.prepare into out_dir/{train,val}.bin + meta.json;
check_split / eval_plan at start-up, then Loader and eval_batches read (B, T) windows per rank. Shard
sets (data="shards:<folder or URL>" or data_sources) are streamed by stream.Loader over shards.py's
token shards instead (make_loader). DATA_DEFAULTS: a run's data keys, preparation's among them
(prepare.PREPARE_DEFAULTS); ROWS_DEFAULTS: what a row holds (rows="windows" | "documents", doc_cut).

Invariants: data-parallel ranks read disjoint windows whose union is what one process reads (Loader);
evaluation batches are the same on every run; user errors are corpus.DataError with one message
saying what to change.
"""
import os

import numpy as np
import torch

import config
import parallel
from config import need
from corpora import corpus, mix, prepare, stream
from corpora.prepare import need_data
from model import IGNORE

# The data pipeline's config keys (pretraining and eval.py read them; config.load(extra=...))
DATA_DEFAULTS = dict(
    data="stdlib",           # "stdlib" | "python" (stdlib + site-packages) | a local file/folder (.txt .md .py .jsonl
                             # .parquet) | "hf:<name>[:<config>][@<split>]" | "shards:<folder or URL>" (shards.py's)
    **prepare.PREPARE_DEFAULTS,  # how a corpus is tokenized (text_field, the split, cleaning, dedup, FIM)
    # streamed token shards (shards.py prepares them, stream.py reads them): data="shards:..." or data_sources
    data_sources={},         # several shard sets, mixed: {name: folder or URL}, e.g. {"code": "s3://b/code", "prose": "d/p"}
    data_weights={},         # their proportions {name: weight}, or a schedule {step: {name: weight}} (linear between)
    shuffle_block=8,         # shards whose windows are shuffled together (blocks of consecutive shards)
    shard_cache="",          # local folder for remote shards, a subfolder per rank ("": a temporary one per process)
    shard_cache_gb=8.0,      # its bound per process: it must hold 2 x shuffle_block shards of every remote source
    shard_wait_s=3600.0,     # how long to wait for a shard still being prepared before giving up
)
# What a pretraining row holds (pretrain.py reads them; Documents)
ROWS_DEFAULTS = dict(
    rows="windows",          # "windows": the token stream cut into T-token rows (documents run into each other) |
                             # "documents": one document per row (never two), padded (no loss there), plain causal
                             # attention; a prepared corpus (not shards). Long ones: join_docs builds them
    doc_cut="split",         # rows="documents", a document longer than a row: "split" into consecutive rows (every
                             # token trained) | "truncate" (its first row only); the data line says how many
)
RESUME_FREE = ("data_dir", "shard_cache", "shard_cache_gb", "shard_wait_s")  # data keys a resumed run may change
SHARDS = "shards:"  # data="shards:<folder or URL>": a shard set streamed, not a corpus to prepare


def check_rows(cfg, world=1):
    """ROWS_DEFAULTS' keys (a Keys part's check): one message saying what to change."""
    need(cfg.rows in ("windows", "documents"), f"rows={cfg.rows!r} must be 'windows' or 'documents'")
    need(cfg.doc_cut in ("split", "truncate"), f"doc_cut={cfg.doc_cut!r} must be 'split' or 'truncate'")
    need(cfg.rows == "windows" or not streamed(cfg), f"rows='documents' reads a prepared corpus' documents; "
         f"shard sets are streamed as windows: set rows='windows', or data=<the corpus> instead of shards")


def check_settings(cfg):
    """The data keys of a config, before any work: one message saying what to change."""
    prepare.check_settings(cfg)
    need(isinstance(cfg.shuffle_block, int) and cfg.shuffle_block >= 1, f"shuffle_block={cfg.shuffle_block} must be >= 1")
    need(cfg.shard_cache_gb > 0, f"shard_cache_gb={cfg.shard_cache_gb} must be > 0")
    need(cfg.shard_wait_s >= 0, f"shard_wait_s={cfg.shard_wait_s} must be >= 0")
    sources = cfg.data_sources
    need(not (sources and cfg.data.startswith(SHARDS)),
         f"data={cfg.data!r} and data_sources={sources!r}: name the shard sets in one of them")
    need(not cfg.data_weights or sources, "data_weights mixes data_sources: set data_sources={name: folder or URL}")
    need(all(isinstance(k, str) and isinstance(v, str) and v for k, v in sources.items()),
         f"data_sources={sources!r} must map names to folders or URLs (strings)")
    need(len(sources) < 2 or cfg.data_weights, f"data_sources {sorted(sources)}: give data_weights={{name: weight}}")
    if cfg.data_weights:
        w = cfg.data_weights
        if all(isinstance(v, dict) for v in w.values()):  # a schedule: steps as strings, as config.json holds them
            need(all(str(k).isdigit() for k in w), f"data_weights' steps {sorted(map(str, w))} must be integers >= 0")
            cfg.data_weights = w = {str(k): v for k, v in sorted(w.items(), key=lambda kv: int(kv[0]))}
        names = mix.Mixture(mixture_weights(cfg)).names  # a DataError (one line) when the weights cannot work
        need(sorted(names) == sorted(sources), f"data_weights name {sorted(names)}, data_sources {sorted(sources)}: "
             "name the same sources")
    if streamed(cfg):
        need(cfg.fim_rate == 0, f"fim_rate={cfg.fim_rate}: FIM is laid out when pretraining prepares a corpus; "
             "shards.py writes plain documents: set fim_rate=0")


# -----------------------------------------------------------------------------
# Loading (B, T) batches

def _open_tokens(path):
    # Read-only memmap: the OS pages the file in on demand, RAM use stays flat for any corpus size.
    meta = prepare.read_meta(os.path.dirname(os.path.abspath(path)))
    if meta is None:
        raise corpus.DataError(f"{path}: no meta.json next to it (corpora/prepare.py's prepare() makes both)")
    if os.path.getsize(path) == 0:
        return np.zeros(0, dtype=meta["dtype"])
    return np.memmap(path, dtype=np.dtype(meta["dtype"]), mode="r")


def check_split(path, T, global_batch, name=""):
    """The number of T-token windows in a token file, after checking that they fill one global
    micro-batch (B sequences x data-parallel ranks); else a DataError saying what to change. The
    stage script calls it at start-up, before any work is spent."""
    need_data(T >= 1 and global_batch >= 1, f"T={T} and global_batch={global_batch} must be >= 1")
    n_tokens = len(_open_tokens(path))
    n = max(0, (n_tokens - 1) // T)  # window i: tokens [i*T, i*T + T + 1), x = w[:-1], y = w[1:]
    need_data(n >= global_batch, f"{name or path}: {n_tokens:,} tokens make {n} windows of T={T}, but one global "
             f"batch needs {global_batch} (B*world): at least {global_batch * T + 1:,} tokens. Use a smaller "
             "micro_batch_size or fewer data-parallel ranks, a smaller seq_len/block_size, or more data")
    return n


def _batch(tokens, windows, T, device):
    buf = np.empty((len(windows), T + 1), dtype=np.int64)
    for row, w in enumerate(windows):
        buf[row] = tokens[w * T: w * T + T + 1]
    xy = torch.from_numpy(buf)
    return _to_device(xy[:, :-1].contiguous(), xy[:, 1:].contiguous(), device)


def _to_device(x, y, device):
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
        self.init_stream(B, T, rank, world, seed, device)
        self.path, self.tokens = path, _open_tokens(path)
        self.n_windows = check_split(path, T, B * world)

    def init_stream(self, B, T, rank, world, seed, device):
        """The stream's settings, checked, at its start. A loader of other items (chat.ChatLoader's
        packed rows) subclasses Loader: it calls this, sets path (a name), n_windows (its number of
        items), and reads its items at next_windows()."""
        need_data(0 <= rank < world, f"rank={rank} must be in [0, world={world})")
        need_data(B >= 1, f"B={B} sequences per batch must be >= 1")
        need_data(isinstance(seed, int) and seed >= 0, f"seed={seed} must be an integer >= 0")
        self.B, self.T, self.rank, self.world, self.seed = B, T, rank, world, seed
        self.device = torch.device(device)
        self.epoch, self.pos = 0, 0  # pos: windows of this epoch's permutation consumed by all ranks
        self._perm, self._perm_epoch = None, -1

    def _permutation(self):
        if self._perm_epoch != self.epoch:
            self._perm = np.random.default_rng([self.seed, self.epoch]).permutation(self.n_windows)
            self._perm_epoch = self.epoch
        return self._perm

    def next_windows(self):
        """This rank's B window indices of the next global batch (advances the stream)."""
        G = self.B * self.world
        if self.pos + G > self.n_windows:
            self.epoch, self.pos = self.epoch + 1, 0
        start = self.pos + self.rank * self.B
        windows = self._permutation()[start: start + self.B]
        self.pos += G
        return windows

    def next(self):
        return _batch(self.tokens, self.next_windows(), self.T, self.device)

    def state_dict(self):
        return dict(epoch=self.epoch, pos=self.pos, seed=self.seed, T=self.T, n_windows=self.n_windows,
                    B=self.B, world=self.world)

    def load_state_dict(self, d):
        """Continue the saved stream. The position counts windows of the global stream, so B and world
        may change (same B*world -> the same global batches); T and the data may not."""
        if d["T"] != self.T or d["n_windows"] != self.n_windows:
            raise corpus.DataError(f"loader state is for T={d['T']} over {d['n_windows']} windows; this loader has "
                            f"T={self.T} over {self.n_windows} windows of {self.path} (different T or data)")
        self.epoch, self.pos, self.seed = d["epoch"], d["pos"], d["seed"]
        self._perm_epoch = -1

    def close(self):
        """Nothing to release (stream.Loader's: its fetching threads and temporary cache)."""


def document_rows(tokens, eos_id, T, cut="split", chunk=1 << 26):
    """(starts, lengths, counts): the rows of a token file of documents, each ending in EOS (the last may
    not: a validation split cut it), one document per row of at most T + 1 tokens (x = row[:-1], y =
    row[1:]). A longer document is split (cut="split") into consecutive rows that share one token, as
    windows do (each of its tokens after the first is a target exactly once), or truncated to its first
    row ("truncate"). A one-token document (a lone EOS: FIM's SPM layout starts with one) has no target
    and no row. counts: documents, long (longer than a row), rows, cut_tokens (left out by truncate)."""
    ends = [np.flatnonzero(tokens[i:i + chunk] == eos_id) + (i + 1) for i in range(0, len(tokens), chunk)]
    ends = np.concatenate([np.zeros(0, np.int64), *ends]).astype(np.int64)
    if not len(ends) or ends[-1] != len(tokens):
        ends = np.append(ends, len(tokens))
    starts = np.concatenate([[0], ends[:-1]]).astype(np.int64)
    starts, lens = starts[ends - starts >= 2], (ends - starts)[ends - starts >= 2]
    n = T + 1
    pieces = np.ones_like(lens) if cut == "truncate" else -(-(lens - 1) // T)  # ceil((length - 1) / T)
    doc = np.repeat(np.arange(len(lens)), pieces)
    k = np.arange(len(doc)) - np.repeat(np.cumsum(pieces) - pieces, pieces)  # the piece's index in its document
    row_starts, row_lens = starts[doc] + k * T, np.minimum(n, lens[doc] - k * T)
    counts = dict(documents=len(lens), long=int((lens > n).sum()), rows=len(doc),
                  cut_tokens=int(lens.sum() - row_lens.sum()) if cut == "truncate" else 0)
    return row_starts, row_lens, counts


def length_summary(lengths, n):
    """One line on rows of n slots holding `lengths` real tokens each: their distribution and the padding."""
    lengths = np.asarray(lengths, dtype=np.int64)
    low, mid, p90, high = np.percentile(lengths, [0, 50, 90, 100]) if len(lengths) else (0, 0, 0, 0)
    return (f"min {low:,.0f} / median {mid:,.0f} / p90 {p90:,.0f} / max {high:,.0f} tokens a row of {n:,}, "
            f"{1 - lengths.sum() / max(len(lengths) * n, 1):.1%} padding")


class Documents(Loader):
    """One document per row (rows="documents"): Loader's stream (a permutation per epoch, B*world rows per
    global batch, ranks disjoint, state_dict / load_state_dict exact) over document_rows' rows of a
    prepared token file instead of its windows. next() -> (x, y): x padded with EOS after the document,
    y its next tokens and IGNORE on the padding; no attention mask, so the model keeps its plain causal
    path (flash / SDPA: memory linear in T), which is exact: a row holds one document and the padding
    comes after it. cut: what a document longer than a row becomes (document_rows); describe(): the
    data line's part."""

    def __init__(self, path, B, T, rank=0, world=1, seed=0, device="cpu", cut="split"):
        self.init_stream(B, T, rank, world, seed, device)
        self.path, self.tokens, self.cut = path, _open_tokens(path), cut
        self.eos_id = prepare.read_meta(os.path.dirname(os.path.abspath(path)))["eos_id"]
        self.starts, self.lengths, self.counts = document_rows(self.tokens, self.eos_id, T, cut)
        self.n_windows = len(self.starts)
        need_data(self.n_windows >= B * world, f"{path}: its {self.counts['documents']:,} documents make "
                  f"{self.n_windows} rows of T={T}, but one global batch needs {B * world} (B*world): a smaller "
                  "micro_batch_size or fewer data-parallel ranks, or more data")

    def next(self):
        rows = self.next_windows()
        buf = np.full((len(rows), self.T + 1), self.eos_id, dtype=np.int64)
        for r, i in enumerate(rows):
            buf[r, :self.lengths[i]] = self.tokens[self.starts[i]:self.starts[i] + self.lengths[i]]
        xy = torch.from_numpy(buf)
        y = xy[:, 1:].clone()
        y[torch.arange(self.T)[None, :] >= torch.from_numpy(self.lengths[rows] - 1)[:, None]] = IGNORE
        return _to_device(xy[:, :-1].contiguous(), y, self.device)

    def describe(self):
        """What the rows hold: the documents, the rows' length distribution, what was split or truncated."""
        c, n = self.counts, self.T + 1
        if not c["long"]:
            cut = f"none longer than a row of {n:,}"
        elif self.cut == "split":
            cut = (f"{c['long']:,} longer than a row of {n:,} split into consecutive rows "
                   f"({c['rows'] - c['documents']:,} more)")
        else:
            cut = (f"{c['long']:,} longer than a row of {n:,} truncated to it: {c['cut_tokens']:,} tokens "
                   f"({c['cut_tokens'] / max(len(self.tokens), 1):.1%} of the train split) left out")
        return f"one document per row: {c['documents']:,} training documents ({cut}) -> {c['rows']:,} rows: " + \
            length_summary(self.lengths, n)


def _eval_layout(path, B, T, world, n_batches):
    # (tokens, windows, sequences per rank per batch, batches) of an evaluation: B per rank while
    # the windows allow, else one batch of what they hold; DataError below one window per rank
    need_data(B >= 1 and T >= 1 and world >= 1 and n_batches >= 0,
             f"B={B}, T={T}, world={world} must be >= 1 and eval_batches={n_batches} >= 0")
    tokens = _open_tokens(path)
    n = max(0, (len(tokens) - 1) // T)
    need_data(n >= world, f"{path}: {len(tokens):,} validation tokens make {n} windows of T={T}, fewer than one per "
             f"data-parallel rank ({world}): raise val_tokens or val_fraction (or use more data), lower "
             "seq_len/block_size, or set eval_every=0")
    b = min(B, n // world)
    available = n // (b * world)
    return tokens, n, b, min(n_batches, available) if n_batches else available


def eval_plan(val_path, B, T, world=1, eval_batches=0):
    """(batches, message or None): the evaluation the validation split holds, for eval_batches global
    batches of B sequences per rank (0: all windows). A smaller split gives fewer batches, or one
    batch of fewer sequences per rank, and a message saying so (print it once); DataError when not
    even one window per rank exists. eval_batches(..., n_batches=batches) then yields exactly that."""
    tokens, n, b, batches = _eval_layout(val_path, B, T, world, eval_batches)
    if b == B and (batches == eval_batches or not eval_batches):
        return batches, None
    return batches, (f"evaluation: {val_path} holds {len(tokens):,} tokens = {n:,} windows of T={T}, so it uses "
                     f"{batches} batch(es) of {b} sequence(s) per rank instead of {eval_batches or 'all'} x {B}; "
                     "raise val_tokens or val_fraction for a fuller evaluation")


def eval_batches(path, B, T, rank=0, world=1, n_batches=0, device="cpu"):
    """Deterministic batches for validation: windows 0, 1, 2, ... in order; with b = min(B, windows //
    world) sequences per rank, global batch j is windows [j*b*world, (j+1)*b*world) and rank r takes
    its b. n_batches=0 (or too many): all full global batches. Identical on every run, and every rank
    yields the same number of batches (eval_plan says how many)."""
    need_data(0 <= rank < world, f"rank={rank} must be in [0, world={world})")
    tokens, _, b, n = _eval_layout(path, B, T, world, n_batches)
    device = torch.device(device)

    def gen():
        for j in range(n):
            start = j * b * world + rank * b
            yield _batch(tokens, range(start, start + b), T, device)
    return gen()


# -----------------------------------------------------------------------------
# A pretraining run's data: memmaps prepared here, or token shards streamed (stream.py)

def streamed(cfg):
    """{name: folder or URL} of the shard sets a config streams (data_sources, or data="shards:..."
    as the one source "data"), or None: a corpus that prepare() tokenizes."""
    if cfg.data_sources:
        return dict(cfg.data_sources)
    return {"data": cfg.data[len(SHARDS):]} if cfg.data.startswith(SHARDS) else None


def mixture_weights(cfg):
    """cfg.data_weights as mix.Mixture takes them: {name: weight} or a schedule {step: {name: weight}}
    (steps as ints); one source and no weights: {name: 1.0}."""
    w = cfg.data_weights or {name: 1.0 for name in cfg.data_sources}
    return {int(k): v for k, v in w.items()} if w and all(isinstance(v, dict) for v in w.values()) else w


def _shard_validation(grid, url, folder):
    # stream.validation_file on rank 0 (a DataError stops every rank), then on the first rank of every
    # other node (a download of the same file where the file system is not shared)
    path = parallel.on_main(grid, lambda: stream.validation_file(url, folder))
    if grid.local_rank == 0 and grid.rank != 0:
        stream.validation_file(url, folder)
    if grid.world > 1:
        torch.distributed.barrier()
    return path


def validation_split(cfg, grid, tok, folder):
    """The path of a run's validation split (a val.bin that eval_plan / eval_batches read), on every
    rank: the prepared corpus' (prepare.prepared: a finished preparation is reused) or, streaming,
    the first shard set's (downloaded into `folder` when remote)."""
    sources = streamed(cfg)
    if sources:
        return _shard_validation(grid, next(iter(sources.values())), folder)
    return os.path.join(prepare.prepared(cfg, grid, tok)[0], "val.bin")


def make_loader(cfg, grid, tok, T):
    """A pretraining run's data: (training loader, its validation split's path, meta), on every rank.

    A corpus (cfg.data) is tokenized once into memmaps (prepare.prepared; reused after) and read
    by Loader (rows="documents": by Documents, one document per row; meta's n_rows counts them);
    the path is its val.bin. Shard sets (data="shards:<folder or URL>", or data_sources
    mixed by data_weights) are streamed by stream.Loader from where they are (remote ones through
    a cache of shard_cache_gb per process in shard_cache/rank<r>); the path is the first set's
    val.bin (downloaded into out_dir/val when remote), None with eval_every=0. The shards must have
    been tokenized by the run's tokenizer (else ConfigError). meta: n_train (tokens; of shards, those
    prepared so far), n_val, and `about`: one line saying what is read."""
    sources = streamed(cfg)
    B, rank, world = cfg.micro_batch_size, grid.data_rank, grid.data_world
    if sources is None:
        data_dir, meta = prepare.prepared(cfg, grid, tok)
        train = os.path.join(data_dir, "train.bin")
        about = f"{meta['n_docs']:,} documents, {meta['n_train']:,} train / {meta['n_val']:,} validation tokens"
        if getattr(cfg, "rows", "windows") == "documents":
            loader = Documents(train, B, T, rank, world, seed=cfg.seed, device=grid.device, cut=cfg.doc_cut)
            about += f"; {loader.describe()} (validation: windows of T)"
            return loader, os.path.join(data_dir, "val.bin"), dict(meta, about=about, n_rows=loader.n_windows)
        loader = Loader(train, B, T, rank, world, seed=cfg.seed, device=grid.device)
        return loader, os.path.join(data_dir, "val.bin"), dict(meta, about=about)
    loader = stream.Loader(
        sources if cfg.data_sources else sources["data"], B, T, rank, world, seed=cfg.seed, device=grid.device,
        weights=mixture_weights(cfg) if cfg.data_sources else None, samples_per_step=cfg.batch_size,
        shuffle_block=cfg.shuffle_block, cache_dir=cfg.shard_cache and os.path.join(cfg.shard_cache, f"rank{grid.rank}"),
        cache_bytes=int(cfg.shard_cache_gb * 2 ** 30), wait_s=cfg.shard_wait_s)
    try:
        s = loader.sources[0].settings
        fim = getattr(tok, "fim", False) and getattr(tok, "vocab", 0)  # a truncated vocabulary with FIM sentinels
        if (s["tokenizer"], s["n_vocab"], s["eos_id"], False) != (tok.name, tok.n_vocab, tok.eos_id, bool(fim)):
            named = s["tokenizer"] if not s["tokenizer"].startswith("hf-") else f"<the folder {s['tokenizer']} was read from>"
            raise config.ConfigError(
                f"the shards were tokenized by {s['tokenizer']} (n_vocab {s['n_vocab']}, EOS {s['eos_id']}), this run's "
                f"tokenizer is {tok.name} (n_vocab {tok.n_vocab}, EOS {tok.eos_id}{', FIM sentinels' if fim else ''}): "
                f"set them as shards.py prepare had them: --tokenizer={named} --tokenizer_vocab={s['vocab']}")
        val_path = _shard_validation(grid, next(iter(sources.values())), os.path.join(cfg.out_dir, "val")) \
            if cfg.eval_every else None
    except BaseException:
        loader.close()
        raise
    n_val = prepare.read_meta(os.path.dirname(val_path))["n_val"] if val_path else 0
    unused = [f"{k}={getattr(cfg, k)!r}" for k in ("data", *prepare.PREPARE_DEFAULTS)
              if getattr(cfg, k) != DATA_DEFAULTS[k] and not (k == "data" and cfg.data.startswith(SHARDS))]
    report, n_samples = loader.report(), cfg.max_steps * cfg.batch_size
    expected = loader.mixture.expected(n_samples)
    parts = []
    for (name, r), share in zip(report.items(), expected):
        size = f"{r['available_tokens']:,} tokens ({'complete' if r['complete'] else 'so far: still being prepared'})"
        epochs = share * n_samples * T / max(r["available_tokens"], 1)
        parts.append(f"{name} = {sources[name]}: {size}, {share:.1%} of the samples = {epochs:.2f} epochs"
                     if len(report) > 1 else f"{sources[name]}: {size}")
    about = (f"shards {'; '.join(parts)}; " + (f"{n_val:,} validation tokens" if val_path else "no evaluation")
             + (f" ({next(iter(sources))}'s)" if len(sources) > 1 and val_path else "")
             + (f" (not applied to shards, shards.py prepared them: {', '.join(unused)})" if unused else ""))
    return loader, val_path, dict(n_train=sum(r["available_tokens"] for r in report.values()), n_val=n_val, about=about)


def read_metrics(loader):
    """A log step's data metrics (all ranks' samples): of streamed shards the seconds this rank waited
    for them, and with several sources each one's tokens read so far and its share; {} otherwise."""
    if not isinstance(loader, stream.Loader):
        return {}
    m = {"data/wait_s": loader.waited_s}
    if len(loader.sources) > 1:
        total = max(int(loader.counts.sum()), 1)
        for src, n in zip(loader.sources, loader.counts.tolist()):
            m[f"data/{src.name}_tokens"] = n * loader.T
            m[f"data/{src.name}_share"] = n / total
    return m


def read_report(loader):
    """The lines a run ends with about its streamed data: per source the tokens read, their share of
    the samples and the share the weights asked for, and the time waited; [] for a memmap."""
    if not isinstance(loader, stream.Loader):
        return []
    report = loader.report()
    lines = [f"data read: {name} {r['tokens']:,} tokens, {r['share']:.2%} of the samples (asked {r['target']:.2%})"
             for name, r in report.items()] if len(report) > 1 else []
    total = sum(r["tokens"] for r in report.values())
    return lines + [f"data: {total:,} tokens read from shards; rank 0 waited {loader.waited_s:.1f} s for them"]
