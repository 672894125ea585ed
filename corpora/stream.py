"""Streaming shards: the pretraining loader over token shards (shards.py), local or in object storage.

    loader = stream.Loader("s3://bucket/corpus", B, T, rank, world, seed=0, device="cuda",
                           cache_dir="/local/cache", cache_bytes=16 << 30)
    loader = stream.Loader({"prose": "s3://b/prose", "code": "/data/code"}, B, T, rank, world,
                           weights={"prose": 0.8, "code": 0.2}, samples_per_step=batch_size)
    x, y = loader.next()          # data.Loader's interface: (B, T) on the device, state_dict / load_state_dict

Sources: a local folder (read in place) or a URL that fsspec opens (s3:// through s3fs, gs://,
az://, ...; storage_options passed on). Remote shards are fetched whole by a background thread pool
ahead of their use (the block being read and the next one), checked against the manifest's sha256,
and kept in cache_dir, least recently used evicted past cache_bytes. A source whose preparation is
still running is read as it grows: a sample in a block not yet written waits for it (manifest
polled every poll_s, up to wait_s).

Order (a function of the seed, the sample index and the shard layout; never of ranks or timing):
global sample i is source mix.Mixture(...).sources(i) (one source: always 0) and the j-th sample of
that source, j = how many of samples 0..i-1 it got. A source's samples are T-token windows
(T + 1 tokens, x and y) inside one shard, (tokens - 1) // T per shard. Shards form blocks of
shuffle_block consecutive shards; an epoch visits the blocks (in order in epoch 0, so reading can
start before the set is complete; a permutation seeded by (seed, epoch) after), and inside a block
every window once, in a permutation seeded by (seed, epoch, block). next() takes the next B * world
global samples; data-parallel rank r reads samples r*B .. r*B+B-1 of them. A state is the global
sample index: stopped on 2 ranks and resumed on 1 or 4 (same global batch), the same tokens.
"""
import collections
import concurrent.futures
import json
import os
import shutil
import tempfile
import threading
import time
import weakref

import numpy as np
import torch

from corpora import corpus
from corpora import mix as mix_mod
from corpora import shards


def _remote(url):
    return "://" in str(url) and not str(url).startswith("file://")


class Store:
    """A shard set's folder: local (read in place, each shard's sha256 checked on first use) or fsspec."""

    def __init__(self, url, storage_options=None):
        self.url = str(url).rstrip("/")
        self.remote = _remote(self.url)
        if self.remote:
            try:
                import fsspec  # only for object storage
                self.fs, self.root = fsspec.core.url_to_fs(self.url, **(storage_options or {}))
            except ImportError as e:
                raise corpus.DataError(f"{self.url}: reading object storage needs fsspec and its backend "
                                       f"({e.name}): pip install fsspec s3fs (gcsfs, adlfs for gs://, az://)") from e
        else:
            self.fs, self.root = None, self.url.removeprefix("file://")

    def read(self, name):
        """The bytes of a file of the set (b"" when missing)."""
        path = f"{self.root}/{name}"
        if not self.remote:
            return shards.read_bytes(path)
        try:
            return self.fs.cat_file(path)
        except FileNotFoundError:
            return b""

    def manifest(self):
        if self.remote:
            self.fs.invalidate_cache()  # a growing set: never a cached listing
        raw = self.read(shards.MANIFEST)
        if not raw:
            return None
        m = json.loads(raw)
        if m.get("format") != shards.FORMAT:
            raise shards.ShardError(f"{self.url}: manifest format {m.get('format')!r}, this code reads "
                                    f"{shards.FORMAT!r}")
        return m


class Cache:
    """Remote shards on local disk, least recently used evicted past max_bytes. One folder per
    process (the accounting is this process'); files are named by their sha256, and a previous
    run's files are taken in (oldest first) at the start. An evicted file stays readable through
    a memmap already open on it."""

    def __init__(self, folder, max_bytes):
        self.folder, self.max_bytes = folder, max_bytes
        os.makedirs(folder, exist_ok=True)
        self.files = collections.OrderedDict()  # sha256 -> bytes, least recently used first
        self.lock = threading.Lock()
        self.evicted = 0
        found = sorted((e.stat().st_mtime, e.name[:-4], e.stat().st_size) for e in os.scandir(folder)
                       if e.name.endswith(".bin") and len(e.name) == 68)
        for _, sha, size in found:  # a previous run's shards, oldest first: kept within max_bytes
            self.files[sha] = size
        self._evict(keep=())

    def _evict(self, keep):
        # least recently used first, never one in keep, until the cache fits max_bytes (lock held or unshared)
        for sha in list(self.files):
            if sum(self.files.values()) <= self.max_bytes:
                break
            if sha in keep:
                continue
            del self.files[sha]
            self.evicted += 1
            try:
                os.remove(os.path.join(self.folder, sha + ".bin"))
            except FileNotFoundError:
                pass

    def path(self, entry):
        return os.path.join(self.folder, entry["sha256"] + ".bin")

    def get(self, entry):
        """The local path of a cached shard, or None (and marks it used)."""
        with self.lock:
            if entry["sha256"] in self.files and os.path.exists(self.path(entry)):
                self.files.move_to_end(entry["sha256"])
                return self.path(entry)
            self.files.pop(entry["sha256"], None)
        return None

    def put(self, entry, raw, keep=()):
        """Evict least recently used shards (never those in keep) until a verified shard fits max_bytes, then
        write it: the folder never holds more (the prefetch threads take turns)."""
        path = self.path(entry)
        with self.lock:
            self.files[entry["sha256"]] = len(raw)
            self.files.move_to_end(entry["sha256"])
            self._evict(set(keep) | {entry["sha256"]})
            if not os.path.exists(path):
                shards.write_atomic(path, raw)
        return path

    def nbytes(self):
        with self.lock:
            return sum(self.files.values())


class Source:
    """One shard set's order: where its j-th sample is, given the seed and the shards listed so far."""

    def __init__(self, name, store, T, seed, shuffle_block):
        self.name, self.store, self.T, self.seed, self.K = name, store, T, seed, shuffle_block
        self.entries, self.complete, self.settings = [], False, None
        self.grew = 0  # refreshes that found more shards (a set still being prepared)
        self._perms = collections.OrderedDict()  # (epoch, block) -> permutation, a few kept
        self._orders = {}
        self.refresh()

    def refresh(self):
        """Read the manifest again; True when it lists more shards than before (or became complete)."""
        m = self.store.manifest()
        if m is None:
            self.settings = None
            return False
        before = (len(self.entries), self.complete)
        self.settings, self.entries, self.complete = m["settings"], m["shards"], m["complete"]
        wins = np.array([max(0, (e["tokens"] - 1) // self.T) for e in self.entries], dtype=np.int64)
        self.shard_start = np.concatenate([[0], np.cumsum(wins)])  # windows before shard k
        n_blocks = -(-len(wins) // self.K) if self.complete else len(wins) // self.K
        edges = np.minimum(np.arange(n_blocks + 1) * self.K, len(wins))
        self.block_windows = self.shard_start[edges[1:]] - self.shard_start[edges[:-1]]
        self.n_windows = int(self.block_windows.sum()) if self.complete else None  # per epoch, once complete
        self._orders = {}
        self.grew += (len(self.entries), self.complete) != before and before != (0, False)
        return (len(self.entries), self.complete) != before


    def _order(self, epoch):
        # (block order, windows before each position in it) for an epoch
        if epoch not in self._orders:
            n = len(self.block_windows)
            order = np.arange(n) if epoch == 0 else np.random.default_rng([self.seed, epoch]).permutation(n)
            self._orders[epoch] = order, np.concatenate([[0], np.cumsum(self.block_windows[order])])
        return self._orders[epoch]

    def _perm(self, epoch, block):
        key = (epoch, block)
        if key not in self._perms:
            self._perms[key] = np.random.default_rng([self.seed, epoch, block]).permutation(
                int(self.block_windows[block]))
            while len(self._perms) > 4:
                self._perms.popitem(last=False)
        return self._perms[key]

    def locate_many(self, js):
        """(n, 4) int64 rows (shard, window, block, epoch) of the source's samples js; None while the
        block of one of them is not written yet."""
        js = np.asarray(js, dtype=np.int64)
        if self.complete:
            if self.n_windows == 0:
                raise shards.ShardError(f"{self.store.url}: no shard holds a window of T+1={self.T + 1} tokens")
            epochs, r = np.divmod(js, self.n_windows)
        else:
            epochs, r = np.zeros_like(js), js
        out = np.empty((len(js), 4), dtype=np.int64)
        for epoch in sorted(set(epochs.tolist())):  # small arrays: a set is faster than np.unique
            sel = epochs == epoch
            order, before = self._order(epoch)
            if len(js) and r[sel].max() >= before[-1]:
                return None
            q = np.searchsorted(before, r[sel], side="right") - 1
            blocks = order[q]
            w = np.empty(len(q), dtype=np.int64)
            for b in sorted(set(blocks.tolist())):
                at = blocks == b
                w[at] = self._perm(epoch, b)[r[sel][at] - before[q[at]]] + self.shard_start[b * self.K]
            k = np.searchsorted(self.shard_start, w, side="right") - 1
            out[sel] = np.stack([k, w - self.shard_start[k], blocks, np.full(len(q), epoch)], axis=1)
        return out

    def locate(self, j):
        """(shard, window, block, epoch) of the source's j-th sample; None while its block is not written."""
        rows = self.locate_many([j])
        return None if rows is None else tuple(int(x) for x in rows[0])

    def next_block(self, block, epoch):
        """The (block, epoch) read after `block` of `epoch`, or None when not known yet."""
        order, _ = self._order(epoch)
        q = int(np.flatnonzero(order == block)[0]) + 1
        if q < len(order):
            return int(order[q]), epoch
        return (int(self._order(epoch + 1)[0][0]), epoch + 1) if self.complete and len(order) else None

    def block_shards(self, block):
        return range(block * self.K, min((block + 1) * self.K, len(self.entries)))


def _need(ok, message):
    if not ok:
        raise corpus.DataError(message)


class Loader:
    """(B, T) training batches from one or several shard sets; see the module docstring.

    sources: a folder / URL, or a dict name -> folder / URL (then weights: a dict or a schedule,
    see mix.Mixture; samples_per_step: the global batch, for a schedule over steps). cache_dir /
    cache_bytes: where remote shards are kept (one folder per process, e.g. .../rank3; default: a
    temporary folder removed by close()) and how much (default 8 GiB); it must hold two blocks of
    every remote source. prefetch_threads: parallel shard fetches.
    verify: check local shards' sha256 on first use (remote ones are always checked)."""

    def __init__(self, sources, B, T, rank=0, world=1, seed=0, device="cpu", weights=None, samples_per_step=1,
                 shuffle_block=8, cache_dir=None, cache_bytes=8 << 30, prefetch_threads=4, storage_options=None,
                 poll_s=2.0, wait_s=3600.0, verify=True):
        _need(0 <= rank < world, f"rank={rank} must be in [0, world={world})")
        _need(B >= 1 and T >= 1, f"B={B} and T={T} must be >= 1")
        _need(isinstance(seed, int) and seed >= 0, f"seed={seed} must be an integer >= 0")
        _need(isinstance(shuffle_block, int) and shuffle_block >= 1, f"shuffle_block={shuffle_block} must be >= 1")
        if not isinstance(sources, dict):
            _need(weights is None, "weights need several sources: give sources as a dict name -> folder or URL")
            sources, weights = {"data": sources}, {"data": 1.0}
        _need(weights is not None, f"sources {sorted(sources)}: give their weights (a dict or a schedule)")
        self.B, self.T, self.rank, self.world, self.seed = B, T, rank, world, seed
        self.device, self.poll_s, self.wait_s, self.verify = torch.device(device), poll_s, wait_s, verify
        self.waited_s = 0.0  # time spent waiting for shards: being prepared, or being fetched
        self.mixture = mix_mod.Mixture(weights, seed, samples_per_step)
        _need(sorted(self.mixture.names) == sorted(sources),
              f"weights name {sorted(self.mixture.names)}, sources are {sorted(sources)}: name the same ones")
        self.sources = [Source(n, Store(sources[n], storage_options), T, seed, shuffle_block)
                        for n in self.mixture.names]
        self._wait(lambda: all(s.settings is not None for s in self.sources), "a manifest.json")
        first = self.sources[0].settings
        for s in self.sources[1:]:
            _need(all(s.settings[k] == first[k] for k in ("tokenizer", "vocab", "n_vocab", "eos_id")),
                  f"source {s.name} was tokenized by {s.settings['tokenizer']} (n_vocab {s.settings['n_vocab']}), "
                  f"{self.sources[0].name} by {first['tokenizer']} (n_vocab {first['n_vocab']}): use one tokenizer")
        self.n_vocab, self.eos_id = first["n_vocab"], first["eos_id"]
        remote = [s for s in self.sources if s.store.remote]
        if remote:
            need = sum(2 * shuffle_block * s.settings["shard_tokens"] * np.dtype(s.settings["dtype"]).itemsize
                       for s in remote)
            _need(cache_bytes >= need, f"cache_bytes={cache_bytes:,} cannot hold two blocks of shards of every remote "
                  f"source ({need:,} bytes): raise it or lower shuffle_block")
        self.tmp_cache = tempfile.mkdtemp(prefix="ingot-shards-") if remote and not cache_dir else None
        # removed by close(), or when the loader is collected or the interpreter exits (a run that failed)
        self._remove_tmp = weakref.finalize(self, shutil.rmtree, self.tmp_cache, True) if self.tmp_cache else None
        self.cache = Cache(cache_dir or self.tmp_cache, cache_bytes) if remote else None
        self.pool = concurrent.futures.ThreadPoolExecutor(prefetch_threads, thread_name_prefix="shards")
        self.fetching = {}   # (source, shard) -> Future of its local path
        self.keep = set()    # sha256 of the shards in use: the cache keeps them
        self.blocks = None   # the (source, block, epoch) of the last batch
        self.opened = {}     # (source, shard) -> memmap, the shards of the blocks in use
        self.pos = 0         # global samples consumed (all ranks)
        self.counts = np.zeros(len(self.sources), dtype=np.int64)  # samples per source among 0 .. pos-1

    # ---------------------------------------------------------------- shards

    def _wait(self, ready, what):
        t0 = time.monotonic()
        while not ready():
            if time.monotonic() - t0 > self.wait_s:
                raise shards.ShardError(f"waited {self.wait_s:.0f} s for {what} of "
                                        f"{', '.join(s.store.url for s in self.sources)}: is its preparation running?")
            time.sleep(self.poll_s)
            for s in self.sources:
                s.refresh()
        self.waited_s += time.monotonic() - t0

    def _fetch(self, si, k):
        # runs in a pool thread: the local path of shard k of source si, its bytes checked
        src = self.sources[si]
        entry = src.entries[k]
        if not src.store.remote:
            path = f"{src.store.root}/{entry['name']}.bin"
            if self.verify:
                shards.check_shard(entry, shards.read_bytes(path), src.store.read(entry["name"] + ".idx"),
                                   src.settings["dtype"], f"{src.store.url}/")
            return path
        path = self.cache.get(entry)
        if path is not None:
            return path
        raw = src.store.read(entry["name"] + ".bin")
        shards.check_shard(entry, raw, src.store.read(entry["name"] + ".idx"), src.settings["dtype"],
                           f"{src.store.url}/")
        return self.cache.put(entry, raw, self.keep)

    def _want(self, si, ks):
        for k in ks:
            if (si, k) not in self.fetching:
                self.fetching[(si, k)] = self.pool.submit(self._fetch, si, k)

    def _tokens(self, si, k):
        key = (si, k)
        if key not in self.opened:
            self._want(si, [k])
            t0 = time.monotonic()
            path = self.fetching[key].result()
            self.waited_s += time.monotonic() - t0
            mm = np.memmap(path, dtype=np.dtype(self.sources[si].settings["dtype"]), mode="r")
            self.opened[key] = mm.view(np.ndarray)  # plain array slices: no memmap object per window
        return self.opened[key]

    def _in_use(self, blocks):
        # fetch / keep open the shards of the blocks being read and of the next one; forget the others
        if blocks == self.blocks:
            return
        self.blocks, keep = blocks, set()
        for si in {si for si, _, _ in blocks}:
            src, mine = self.sources[si], [(b, e) for s, b, e in blocks if s == si]
            if len(mine) == 1:  # a batch across two blocks waits with the next one: two blocks at most
                nxt = src.next_block(*mine[0])
                mine += [nxt] if nxt else []
            keep |= {(si, k) for b, _ in mine for k in src.block_shards(b)}
        for key in [key for key in self.fetching if key not in keep]:
            self.fetching.pop(key)
            self.opened.pop(key, None)
        self.keep = {self.sources[si].entries[k]["sha256"] for si, k in keep}  # never evicted (read by pool threads)
        for si, k in sorted(keep):
            self._want(si, [k])

    # ---------------------------------------------------------------- batches

    def _rows(self, srcs, before):
        # (n, 5) rows (source, shard, window, block, epoch) of samples of sources srcs, the first of
        # source s being its before[s]-th; waits for shards still being prepared
        out = np.empty((len(srcs), 5), dtype=np.int64)
        out[:, 0] = srcs
        for s in sorted(set(srcs.tolist())):
            at = srcs == s
            js = before[s] + np.arange(int(at.sum()))
            src = self.sources[s]
            rows = src.locate_many(js)
            if rows is None:
                self._wait(lambda: src.locate_many(js) is not None, f"the shards of samples {js[0]}..{js[-1]} of "
                           f"source {src.name}")
                rows = src.locate_many(js)
            out[at, 1:] = rows
        return out

    def locate(self, i0, i1):
        """(n, 5) int64 rows (source, shard, window, block, epoch) of global samples i0 .. i1-1 (waits for
        shards not yet prepared). Advances nothing; from i0 < pos it recounts the sources from 0."""
        if i0 < self.pos:
            self.counts, self.pos = np.zeros_like(self.counts), 0
        srcs = self.mixture.sources(self.pos, i1)
        return self._rows(srcs[i0 - self.pos:], self.counts + np.bincount(srcs[:i0 - self.pos],
                                                                          minlength=len(self.sources)))

    def next_samples(self):
        """This rank's B rows (source, shard, window, block, epoch) of the next global batch; advances the stream."""
        G, a = self.B * self.world, self.rank * self.B
        srcs = self.mixture.sources(self.pos, self.pos + G)  # every rank draws the whole global batch
        mine = self._rows(srcs[a:a + self.B], self.counts + np.bincount(srcs[:a], minlength=len(self.sources)))
        self.counts += np.bincount(srcs, minlength=len(self.sources))
        self.pos += G
        return mine

    def next(self):
        samples = self.next_samples()
        self._in_use(set(map(tuple, samples[:, [0, 3, 4]].tolist())))
        buf = np.empty((self.B, self.T + 1), dtype=np.int64)
        for row, (s, k, w) in enumerate(samples[:, :3].tolist()):
            buf[row] = self._tokens(s, k)[w * self.T: w * self.T + self.T + 1]
        xy = torch.from_numpy(buf)
        x, y = xy[:, :-1].contiguous(), xy[:, 1:].contiguous()
        if self.device.type == "cuda":  # pinned host memory lets the copy run asynchronously
            return x.pin_memory().to(self.device, non_blocking=True), y.pin_memory().to(self.device, non_blocking=True)
        return x.to(self.device), y.to(self.device)

    def state_dict(self):
        return dict(sample=self.pos, seed=self.seed, T=self.T, sources=list(self.mixture.names))

    def load_state_dict(self, d):
        """Continue at global sample d["sample"] (any world size or micro-batch: same global batch, same tokens)."""
        if d["T"] != self.T or d["sources"] != self.mixture.names:
            raise corpus.DataError(f"loader state is for T={d['T']} over sources {d['sources']}; this loader has "
                                   f"T={self.T} over {self.mixture.names}")
        if d["seed"] != self.seed:  # the saved stream's seed wins, as in data.Loader
            self.seed = self.mixture.seed = d["seed"]
            for s in self.sources:
                s.seed, s._perms, s._orders = d["seed"], collections.OrderedDict(), {}
        self.counts, self.pos = self.mixture.counts(d["sample"]), d["sample"]

    def report(self):
        """Per source: samples and tokens read so far (all ranks), the share of them and the share asked."""
        total = max(int(self.counts.sum()), 1)
        asked = self.mixture.expected(self.pos)
        return {s.name: dict(samples=int(n), tokens=int(n) * self.T, share=int(n) / total, target=float(a),
                             available_tokens=int(s.entries[-1]["n_tokens"]) if s.entries else 0,
                             complete=s.complete)
                for s, n, a in zip(self.sources, self.counts, asked)}

    def close(self):
        self.pool.shutdown(wait=True, cancel_futures=True)
        if self._remove_tmp:
            self._remove_tmp()


def validation_file(url, folder, storage_options=None):
    """The local path of a shard set's val.bin (shards.prepare with val_fraction > 0), which
    data.eval_plan / eval_batches read: the set's own file when local, else downloaded with its
    meta.json into `folder`. The split is whole once the preparation has ended (meta.json, written
    last): before, a DataError."""
    store = Store(url, storage_options)
    meta = store.read("meta.json")
    _need(meta, f"{url}: still being prepared, and its validation split is whole only when the preparation ends: "
          "train with eval_every=0 until then (eval.py scores it afterwards)")
    if not store.remote:
        path = os.path.join(store.root, "val.bin")
    else:
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, "val.bin")
        shards.write_atomic(os.path.join(folder, "val.bin"), store.read("val.bin"))
        shards.write_atomic(os.path.join(folder, "meta.json"), meta)
    if not (os.path.exists(path) and os.path.getsize(path)):
        frac = (store.manifest() or {}).get("settings", {}).get("val_fraction", 0)
        why = (f"val_fraction={frac} sends whole documents to validation by a hash, and none of this set's fell "
               f"there: more documents, a larger --val_fraction" if frac else "prepare the shards with --val_fraction > 0")
        raise corpus.DataError(f"{url}: no validation split ({why}, or train with eval_every=0)")
    return path
