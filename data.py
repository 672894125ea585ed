"""Data: a corpus as tokenized memmaps, the pretraining loaders over them, or streamed token shards.

    loader, val_path, meta = data.make_loader(cfg, grid, tok, T)   # what pretraining calls: either kind
    settings = data.data_settings(cfg)            # prepare()'s keywords from DATA_DEFAULTS' keys
    meta = data.prepare_everywhere(grid, cfg.data, tok, data_dir, **settings)  # rank 0 tokenizes, once
    loader = data.Loader(train_bin, B, T, rank, world, seed); x, y = loader.next()  # state_dict(): resume
    for x, y in data.eval_batches(val_bin, B, T, rank, world, n): ...

    corpus.iter_documents(source)  ->  clean.documents (clean=True / dedup, optional)
    ->  prepare(): tokenize (FIM layout for fim_rate of the training documents), append EOS, split
    ->  out_dir/{train,val}.bin (flat uint16/uint32 token streams) + meta.json
    ->  check_split / eval_plan at start-up  ->  Loader, eval_batches: (B, T) windows per rank

Where documents come from (embedded corpora, local files, hub datasets) is corpus.py's concern,
the tokenizer tokenizer.py's; prepare() prints once what intake skipped or repaired and keeps its
counts in meta.json. How FIM is baked into train.bin: prepare.

Invariants: a finished preparation is reused only when meta.json's settings and the corpus
fingerprint (corpus.source_fingerprint) match, and the settings name the folder (default_data_dir),
so changing one prepares other files; bins are written before meta.json, so a crash leaves no
meta.json that matches; validation is always plain text; data-parallel ranks read disjoint
windows whose union is what one process reads (Loader); user errors are corpus.DataError with one
message saying what to change. data="shards:<folder or URL>" or data_sources: stream.Loader over
shards.py's token shards instead (make_loader).
"""
import hashlib
import itertools
import json
import os
import re
from dataclasses import replace

import numpy as np
import torch

import config
import parallel
from config import need
from corpora import clean as clean_mod
from corpora import corpus
from corpora import fim as fim_mod
from corpora import mix, stream

# The data pipeline's config keys (pretraining and eval.py read them; config.load(extra=...))
DATA_DEFAULTS = dict(
    data="stdlib",           # "stdlib" | "python" (stdlib + site-packages) | a local file/folder (.txt .md .py .jsonl
                             # .parquet) | "hf:<name>[:<config>][@<split>]" | "shards:<folder or URL>" (shards.py's)
    text_field="text",       # the field holding a document's text in .jsonl / .parquet / hf: records
    data_dir="",             # where the tokenized memmaps go ("" -> data/<name>)
    val_fraction=0.01,       # validation share of the corpus: at least val_tokens, at most 10% (val_split)
    val_tokens=1 << 20,      # floor of the validation split in tokens (a small corpus still gets a real one)
    max_docs=0,              # read at most this many documents (0: all)
    # data quality and Fill-in-the-Middle (prepare(); each changes the prepared folder's name)
    clean=False,             # clean.py's normalisation + quality filters before tokenization
    dedup="none",            # "none" | "exact" (normalised content hash) | "near" (exact + MinHash LSH at Jaccard 0.8)
    toxicity="",             # clean=True: toxicity.py's scorer ("wordlist", "wordlist:<file>", "module:fn", an HF folder)
    toxicity_threshold=0.0,  # drop documents scoring above it (0 with "wordlist": any listed word, C4's rule)
    toxicity_keep=0.0,       # keep this share of those instead (down-weighting; chosen by a hash of the text)
    fim_rate=0.0,            # share of training documents in FIM layout (fim.py; 0.5 as Bavarian et al. 2022)
    fim_spm_rate=0.5,        # share of those in SPM order (the rest PSM)
    fim_seed=0,              # FIM draws are BLAKE2b(fim_seed, document index): fixed data across training seeds
    fim_fragment=0,          # >0: FIM per fragment of at most this many characters (fim.py), so that a FIM
                             # sequence fits a training window (small.py: 2000 ~ 600 of 1024 tokens); 0: whole documents
    # streamed token shards (shards.py prepares them, stream.py reads them): data="shards:..." or data_sources
    data_sources={},         # several shard sets, mixed: {name: folder or URL}, e.g. {"code": "s3://b/code", "prose": "d/p"}
    data_weights={},         # their proportions {name: weight}, or a schedule {step: {name: weight}} (linear between)
    shuffle_block=8,         # shards whose windows are shuffled together (blocks of consecutive shards)
    shard_cache="",          # local folder for remote shards, a subfolder per rank ("": a temporary one per process)
    shard_cache_gb=8.0,      # its bound per process: it must hold 2 x shuffle_block shards of every remote source
    shard_wait_s=3600.0,     # how long to wait for a shard still being prepared before giving up
)
RESUME_FREE = ("data_dir", "shard_cache", "shard_cache_gb", "shard_wait_s")  # data keys a resumed run may change
SHARDS = "shards:"  # data="shards:<folder or URL>": a shard set streamed, not a corpus to prepare


def check_settings(cfg):
    """The data keys of a config, before any work: one message saying what to change."""
    need(cfg.dedup in ("none", "exact", "near"), f"dedup='{cfg.dedup}' must be none, exact or near")
    need(0 <= cfg.fim_rate <= 1 and 0 <= cfg.fim_spm_rate <= 1,
         f"fim_rate={cfg.fim_rate} and fim_spm_rate={cfg.fim_spm_rate} must be in [0, 1]")
    need(cfg.fim_seed >= 0, f"fim_seed={cfg.fim_seed} must be >= 0")
    need(isinstance(cfg.fim_fragment, int) and cfg.fim_fragment >= 0,
         f"fim_fragment={cfg.fim_fragment} must be an integer >= 0 (characters per FIM fragment; 0: whole documents)")
    need(0 <= cfg.val_fraction < 1, f"val_fraction={cfg.val_fraction} must be in [0, 1)")
    need(cfg.val_tokens >= 0, f"val_tokens={cfg.val_tokens} must be >= 0")
    need(cfg.max_docs >= 0, f"max_docs={cfg.max_docs} must be >= 0 (0: all documents)")
    need(not cfg.toxicity or cfg.clean, f"toxicity={cfg.toxicity!r} runs inside clean.py's cleaning: set clean=True")
    need(cfg.toxicity or not (cfg.toxicity_threshold or cfg.toxicity_keep),
         "toxicity_threshold / toxicity_keep need a scorer: set toxicity (e.g. toxicity=wordlist)")
    need(0 <= cfg.toxicity_keep < 1, f"toxicity_keep={cfg.toxicity_keep} must be in [0, 1)")
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
# Tokenize a corpus into flat token files

FORMAT = "ingot-tokens-v2"  # bump when the file layout or the split changes: old preparations then rebuild
VAL_TOKENS = 1 << 20        # prepare()'s default floor of validation tokens (up to max_val_share)


# prepare()'s settings that change the tokens (besides source and tokenizer), with their defaults
VARIANT_DEFAULTS = dict(fim_rate=0.0, fim_spm_rate=0.5, fim_seed=0, fim_fragment=0, clean=False, dedup="none",
                        toxicity="", toxicity_threshold=0.0, toxicity_keep=0.0)


def data_settings(cfg):
    """prepare()'s keywords from a run's config: the split and size keys, then VARIANT_DEFAULTS'."""
    return dict(val_fraction=cfg.val_fraction, val_tokens=cfg.val_tokens, text_field=cfg.text_field,
                max_docs=cfg.max_docs, **{k: getattr(cfg, k) for k in VARIANT_DEFAULTS})


def default_data_dir(source, tokenizer_name, vocab=0, root="data", **settings):
    """Readable and unique: e.g. data/stdlib-cl100k_base-8192-1a2b3c4d. The VARIANT_DEFAULTS keys among
    `settings` (others are ignored) that differ from their default are in the hash, and named
    (-clean, -exact / -near, -tox, -fim): data/stdlib-cl100k_base-8192-clean-near-fim-5e6f7a8b. Changing
    them prepares another folder; switching back reuses the first."""
    key = corpus.source_key(source)
    readable = key if key in corpus.PYTHON_CORPORA or key.startswith("hf:") else os.path.basename(key.rstrip(os.sep))
    slug = re.sub(r"[^A-Za-z0-9_.]+", "-", readable).strip("-.")[:40] or "corpus"
    changed = {k: settings[k] for k, v in sorted(VARIANT_DEFAULTS.items()) if settings.get(k, v) != v}
    digest = hashlib.sha1(f"{key}|{tokenizer_name}|{vocab}{f'|{changed}' if changed else ''}".encode()).hexdigest()[:8]
    tags = "".join(f"-{t}" for t, on in (("clean", changed.get("clean")), (changed.get("dedup"), "dedup" in changed),
                                          ("tox", changed.get("toxicity")), ("fim", changed.get("fim_rate"))) if on)
    return os.path.join(root, f"{slug}-{tokenizer_name}{f'-{vocab}' if vocab else ''}{tags}-{digest}")


def _read_meta(out_dir):
    try:
        with open(os.path.join(out_dir, "meta.json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


# A cut just after a newline that a character other than whitespace or '/' follows: the cl100k,
# o200k and GPT-2 pre-tokenizers never join characters across it, so the parts of a long document
# encode to exactly the whole document's ids (o200k joins punctuation, newlines and '/').
_CUT = re.compile(r"\n(?=[^\s/])")


def _pieces(text, size=1 << 20):
    # A long document (one big .txt file) in parts of about `size` characters: all tokenizer
    # threads work on it, and no single list of ids holds the whole file
    parts, start = [], 0
    while len(text) - start > size:
        m = _CUT.search(text, start + size)
        if m is None:
            break
        parts.append(text[start:m.end()])
        start = m.end()
    parts.append(text[start:])
    return parts


def _batches(items, max_chars=1 << 23, max_items=4096):
    # items: (streams, parts) per document, parts str (text to encode) or int (a token id). Batches
    # of ~8 MB of text as (streams, piece, last piece of its document): enough work for every
    # tokenizer thread, bounded memory
    batch, chars = [], 0
    for streams, parts in items:
        pieces = [q for part in parts for q in (_pieces(part) if isinstance(part, str) else [part])]
        for i, piece in enumerate(pieces):
            batch.append((streams, piece, i == len(pieces) - 1))
            chars += len(piece) if isinstance(piece, str) else 0
            if chars >= max_chars or len(batch) >= max_items:
                yield batch
                batch, chars = [], 0
    if batch:
        yield batch


def _items(docs, transform, modes):
    # Stream 0: every document as plain text; stream 1 (with a FIM transform): what training reads,
    # a document's FIM layout or its plain text again. modes: per document 0 plain, 1 PSM, 2 SPM
    for i, text in enumerate(docs):
        mode, parts = transform.apply(text, i) if transform else (0, [text])
        modes.append(mode)
        if not mode:
            yield ((0, 1) if transform else (0,)), parts
        else:
            yield (0,), [text]
            yield (1,), parts


def _tokenize(docs, tokenizer, paths, dtype, num_threads, bar, transform=None):
    # Every document's ids then EOS into the file(s) at `paths` (see _items); returns the documents'
    # lengths per stream (EOS included) and their FIM modes
    lens, n, total, modes = [[] for _ in paths], [0] * len(paths), 0, []
    eos = np.array([tokenizer.eos_id], dtype=dtype).tobytes()
    files = [open(path, "wb") for path in paths]
    try:
        for batch in _batches(_items(docs, transform, modes)):
            texts = [piece for _, piece, _ in batch if isinstance(piece, str)]
            encoded = iter(tokenizer.encode_batch(texts, num_threads=num_threads))
            for streams, piece, last in batch:
                ids = next(encoded) if isinstance(piece, str) else [piece]
                buf = np.array(ids, dtype=dtype).tobytes()
                for s in streams:
                    files[s].write(buf)
                    n[s] += len(ids)
                    if last:
                        files[s].write(eos)
                        lens[s].append(n[s] + 1)
                        total += (n[s] + 1) * (s == len(paths) - 1)  # tokens training reads
                        n[s] = 0
            bar.update(sum(last and 0 in streams for streams, _, last in batch))
            bar.set_postfix(tokens=f"{total:,}", refresh=False)
    finally:
        for f in files:
            f.close()
    return [np.array(x, dtype=np.int64) for x in lens], np.array(modes, dtype=np.int8)


def _cleaned(docs, source, clean_docs, dedup, stats, toxicity="", toxicity_threshold=0.0, toxicity_keep=0.0):
    # clean.py between intake and tokenization: normalisation + quality filters (clean_docs), then
    # the toxicity filter (with clean_docs), and dedup ("exact" or "near", which is exact then
    # MinHash near-duplicates), counted in stats
    if not clean_docs and dedup == "none":
        return docs
    cfg = replace(clean_mod.CleanConfig(), exact_dedup=dedup != "none", near_dedup=dedup == "near",
                  toxicity=toxicity, toxicity_threshold=toxicity_threshold, toxicity_keep=toxicity_keep)
    if clean_docs:
        return clean_mod.documents(docs, cfg, stats, kind="code" if source in corpus.PYTHON_CORPORA else "auto")

    def dedup_only(dedup=clean_mod.Deduper(cfg)):
        for doc in docs:
            reason = dedup.check(doc)
            stats.count(len(doc), doc, reason)
            if reason is None:
                yield doc
    return dedup_only()


def val_split(doc_lens, val_fraction=0.01, val_tokens=VAL_TOKENS, max_val_share=0.1):
    """Validation's part of a stream of documents of doc_lens tokens, as ([(start, end) token
    ranges], mode). Target: val_fraction of the tokens, raised toward val_tokens but by that floor
    never past max_val_share. mode "documents": whole documents, each taken when validation is
    behind the target share of the tokens before it (spread through the stream, blind to the
    document's own size), if they land within 10% of the target and the share limit. Else (one long
    file, two documents, a few huge ones) mode "tokens": the last `target` tokens, cutting a document."""
    lens = np.asarray(doc_lens, dtype=np.int64)
    total = int(lens.sum())
    share = max(val_fraction, min(val_tokens / max(total, 1), max_val_share))
    target = min(max(round(share * total), 1 if share else 0), total - 1)
    ranges, v, start = [], 0, 0
    for n in lens.tolist():
        if v < share * start:
            v += n
            if ranges and ranges[-1][1] == start:
                ranges[-1] = (ranges[-1][0], start + n)
            else:
                ranges.append((start, start + n))
        start += n
    if 0.9 * target <= v <= min(1.1 * target, max(val_fraction, max_val_share) * total):
        return ranges, "documents"
    return [(total - target, total)], "tokens"


def _need(ok, message):
    if not ok:
        raise corpus.DataError(message)


def prepare(source, tokenizer, out_dir, val_fraction=0.01, text_field="text", max_docs=0, num_proc=None,
            verbose=True, val_tokens=VAL_TOKENS, max_val_share=0.1, fim_rate=0.0, fim_spm_rate=0.5, fim_seed=0,
            fim_fragment=0, clean=False, dedup="none", toxicity="", toxicity_threshold=0.0, toxicity_keep=0.0):
    """Tokenize `source` into out_dir/train.bin, val.bin (each document's tokens then EOS, in corpus
    order; validation chosen by val_split) and meta.json. Reuses a finished matching preparation.
    num_proc: tokenizer threads (default: all cores). clean / dedup: clean.py between intake and
    tokenization (_cleaned; max_docs counts the documents that pass; toxicity: toxicity.py's scorer, with
    clean, drops or keeps toxicity_keep of the documents above toxicity_threshold). fim_rate > 0: the training
    documents in FIM layout (fim.py; fim_fragment > 0: per fragment of that many characters).
    Returns the meta dict, which holds n_docs, n_train / n_val tokens, n_train_docs / n_val_docs (a
    document cut by a "tokens" split counts in both), val_split (the mode), intake
    (Intake.counts(): files read, skipped, repaired), cleaned (clean.Stats: documents in, kept,
    removed and flagged per reason) and fim_docs (train documents per FIM mode). A finished preparation is
    rebuilt when corpus.source_fingerprint() changes.

    Fill-in-the-Middle (fim.py) is baked into train.bin here, per document, before the documents
    are concatenated and cut into windows: the transform needs the document's text (the cuts are at
    characters, each part is encoded on its own), which only exists here; the Loader, its state and
    resume stay exactly as without FIM; and the settings (fim_rate, fim_spm_rate, fim_seed,
    fim_fragment) are in meta.json and in default_data_dir's name, so changing them prepares other
    files. Every document is tokenized plain into one stream and, when FIM picks it, also in FIM
    layout into a second; val_split chooses validation on the plain lengths, validation is written
    plain (its loss stays comparable with a run without FIM: the paper's "FIM for free" check) and
    the training documents from the FIM stream. The FIM index of a document is its position in the
    stream that reaches tokenization (after cleaning and max_docs)."""
    _need(0 <= val_fraction < 1, f"val_fraction={val_fraction} must be in [0, 1)")
    _need(isinstance(max_docs, int) and max_docs >= 0, f"max_docs={max_docs} must be an integer >= 0 (0: all)")
    _need(isinstance(val_tokens, int) and val_tokens >= 0, f"val_tokens={val_tokens} must be an integer >= 0")
    _need(0 <= max_val_share < 1, f"max_val_share={max_val_share} must be in [0, 1)")
    _need(dedup in ("none", "exact", "near"), f"dedup={dedup!r} must be 'none', 'exact' or 'near'")
    _need(not toxicity or clean, f"toxicity={toxicity!r} runs inside the cleaning: set clean=True")
    transform = fim_mod.Transform(tokenizer, fim_rate, fim_spm_rate, fim_seed, fim_fragment) if fim_rate > 0 else None
    dtype = np.dtype(np.uint16 if tokenizer.n_vocab <= 1 << 16 else np.uint32)
    meta = dict(format=FORMAT, source=corpus.source_key(source), text_field=text_field, tokenizer=tokenizer.name,
                vocab=tokenizer.vocab, n_vocab=tokenizer.n_vocab, eos_id=tokenizer.eos_id, dtype=dtype.name,
                val_fraction=val_fraction, val_tokens=val_tokens, max_val_share=max_val_share,
                max_docs=max_docs, fingerprint=corpus.source_fingerprint(source, FORMAT),
                fim_rate=fim_rate, fim_spm_rate=fim_spm_rate, fim_seed=fim_seed, fim_fragment=fim_fragment,
                clean=clean, dedup=dedup, toxicity=toxicity, toxicity_threshold=toxicity_threshold,
                toxicity_keep=toxicity_keep)
    old = _read_meta(out_dir)
    bins = {s: os.path.join(out_dir, f"{s}.bin") for s in ("train", "val")}
    if old is not None and all(old.get(k, VARIANT_DEFAULTS.get(k)) == v for k, v in meta.items()) and all(
            os.path.exists(p) and os.path.getsize(p) == old[f"n_{s}"] * dtype.itemsize for s, p in bins.items()):
        if verbose:
            print(f"data: reusing {out_dir} ({old['n_docs']:,} documents: {old['n_train']:,} train / "
                  f"{old['n_val']:,} val tokens)")
        return old

    report, stats = corpus.Intake(), clean_mod.Stats()
    docs = corpus.iter_documents(source, text_field, report)  # a bad source fails here, before anything is written
    docs = _cleaned(docs, meta["source"], clean, dedup, stats, toxicity, toxicity_threshold, toxicity_keep)
    os.makedirs(out_dir, exist_ok=True)
    if old is not None:  # the bins are about to change: never let an old meta.json describe them
        os.remove(os.path.join(out_dir, "meta.json"))
    from tqdm import tqdm
    if max_docs:
        docs = itertools.islice(docs, max_docs)
    tmp = {s: os.path.join(out_dir, f"{s}.tmp{os.getpid()}") for s in ("all", "fim", "train", "val", "meta")}
    try:
        with tqdm(desc=f"tokenizing {source}", unit="doc", total=max_docs or None, disable=not verbose) as bar:
            lens, modes = _tokenize(docs, tokenizer, [tmp["all"], tmp["fim"]][:1 + bool(transform)], dtype,
                                    num_proc or os.cpu_count() or 1, bar, transform)
        ranges, mode = val_split(lens[0], val_fraction, val_tokens, max_val_share)  # over the plain documents
        n_train, fim_docs = _write_splits(tmp, dtype, lens, modes, ranges)
        ends = np.cumsum(lens[0])
        # documents with tokens in each split: a "tokens" split cuts one document
        n_val_docs = sum(int(np.searchsorted(ends, b, "right") - np.searchsorted(ends, a, "right")) for a, b in ranges)
        n_val = sum(b - a for a, b in ranges)
        n_train_docs = len(ends) - n_val_docs + int(mode == "tokens" and ranges[0][0] not in ends)
        meta.update(n_docs=len(ends), n_train=n_train, n_val=n_val, n_train_docs=n_train_docs,
                    n_val_docs=n_val_docs, val_split=mode, intake=report.counts(),
                    cleaned=dict(docs=stats.docs, kept=stats.kept, chars_in=stats.chars_in, chars_out=stats.chars_out,
                                 removed=dict(stats.removed.most_common()), flagged=dict(stats.flagged)),
                    fim_docs=fim_docs)
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
        for line in report.summary() + (stats.report().splitlines() if clean or dedup != "none" else []):
            print(f"data: {line}")
        if transform:
            frag = f", in fragments of <= {fim_fragment} characters" if fim_fragment else ""
            print(f"data: FIM (rate {fim_rate}, SPM {fim_spm_rate} of them{frag}) on {sum(fim_docs.values()):,} of "
                  f"{n_train_docs:,} train documents: {fim_docs}; validation stays plain")
        print(f"data: {out_dir}: {meta['n_docs']:,} documents -> {meta['n_train']:,} train / {n_val:,} "
              f"val tokens (split by {mode}), {dtype.name}")
    return meta


def _write_splits(tmp, dtype, lens, modes, ranges):
    # tmp["all"] (plain documents) -> tmp["val"] by `ranges`, the rest -> tmp["train"], straight from
    # the memmaps (no copy in memory); with a FIM stream tmp["fim"] (lens[1]), train documents are
    # taken from it: a train range always starts at a document and may end inside one (a "tokens"
    # split), whose head then stays plain. Returns (train tokens, {FIM mode: train documents}).
    plain = np.memmap(tmp["all"], dtype=dtype, mode="r")
    starts = np.concatenate([[0], np.cumsum(lens[0])])
    fim = np.memmap(tmp["fim"], dtype=dtype, mode="r") if len(lens) > 1 else None
    fim_starts = np.concatenate([[0], np.cumsum(lens[-1])])
    n_train, counts, pos = 0, np.zeros(len(fim_mod.MODES), dtype=np.int64), 0
    with open(tmp["train"], "wb") as ftrain, open(tmp["val"], "wb") as fval:
        for a, b in ranges + [(int(starts[-1]),) * 2]:
            if fim is None:
                parts = [plain[pos:a]]
            else:  # whole documents i..j-1 from the FIM stream, then the head of document j
                i, j = int(np.searchsorted(starts, pos)), int(np.searchsorted(starts, a, "right")) - 1
                parts = [fim[fim_starts[i]:fim_starts[j]], plain[starts[j]:a]]
                counts += np.bincount(modes[i:j], minlength=len(counts))
            for part in parts:
                ftrain.write(part)
                n_train += len(part)
            fval.write(plain[a:b])
            pos = b
        for f in (ftrain, fval):  # durable before the renames make them visible
            f.flush()
            os.fsync(f.fileno())
    return n_train, {m: int(c) for m, c in zip(fim_mod.MODES[1:], counts[1:])} if fim is not None else {}


# -----------------------------------------------------------------------------
# Loading (B, T) batches

def _open_tokens(path):
    # Read-only memmap: the OS pages the file in on demand, RAM use stays flat for any corpus size.
    meta = _read_meta(os.path.dirname(os.path.abspath(path)))
    if meta is None:
        raise corpus.DataError(f"{path}: no meta.json next to it (create both with data.prepare)")
    if os.path.getsize(path) == 0:
        return np.zeros(0, dtype=meta["dtype"])
    return np.memmap(path, dtype=np.dtype(meta["dtype"]), mode="r")


def prepare_everywhere(grid, source, tokenizer, out_dir, **kw):
    """prepare() for a multi-process run; returns its meta dict on every rank. Rank 0 tokenizes
    (once: later runs reuse the memmaps) while the others wait, and a DataError there stops every
    rank with its message; then the first rank of every other node checks too (a no-op on a shared
    file system)."""
    meta = parallel.on_main(grid, lambda: prepare(source, tokenizer, out_dir, verbose=grid.is_main, **kw))
    if grid.local_rank == 0 and grid.rank != 0:
        prepare(source, tokenizer, out_dir, verbose=False, **kw)
    if grid.world > 1:
        torch.distributed.barrier()
    return meta


def check_split(path, T, global_batch, name=""):
    """The number of T-token windows in a token file, after checking that they fill one global
    micro-batch (B sequences x data-parallel ranks); else a DataError saying what to change. The
    stage script calls it at start-up, before any work is spent."""
    _need(T >= 1 and global_batch >= 1, f"T={T} and global_batch={global_batch} must be >= 1")
    n_tokens = len(_open_tokens(path))
    n = max(0, (n_tokens - 1) // T)  # window i: tokens [i*T, i*T + T + 1), x = w[:-1], y = w[1:]
    _need(n >= global_batch, f"{name or path}: {n_tokens:,} tokens make {n} windows of T={T}, but one global "
          f"batch needs {global_batch} (B*world): at least {global_batch * T + 1:,} tokens. Use a smaller "
          "micro_batch_size or fewer data-parallel ranks, a smaller seq_len/block_size, or more data")
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
        self.init_stream(B, T, rank, world, seed, device)
        self.path, self.tokens = path, _open_tokens(path)
        self.n_windows = check_split(path, T, B * world)

    def init_stream(self, B, T, rank, world, seed, device):
        """The stream's settings, checked, at its start. A loader of other items (chat.ChatLoader's
        packed rows) subclasses Loader: it calls this, sets path (a name), n_windows (its number of
        items), and reads its items at next_windows()."""
        _need(0 <= rank < world, f"rank={rank} must be in [0, world={world})")
        _need(B >= 1, f"B={B} sequences per batch must be >= 1")
        _need(isinstance(seed, int) and seed >= 0, f"seed={seed} must be an integer >= 0")
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


def _eval_layout(path, B, T, world, n_batches):
    # (tokens, windows, sequences per rank per batch, batches) of an evaluation: B per rank while
    # the windows allow, else one batch of what they hold; DataError below one window per rank
    _need(B >= 1 and T >= 1 and world >= 1 and n_batches >= 0,
          f"B={B}, T={T}, world={world} must be >= 1 and eval_batches={n_batches} >= 0")
    tokens = _open_tokens(path)
    n = max(0, (len(tokens) - 1) // T)
    _need(n >= world, f"{path}: {len(tokens):,} validation tokens make {n} windows of T={T}, fewer than one per "
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
    _need(0 <= rank < world, f"rank={rank} must be in [0, world={world})")
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
    rank: the prepared corpus' (prepare_everywhere: a finished preparation is reused) or, streaming,
    the first shard set's (downloaded into `folder` when remote)."""
    sources = streamed(cfg)
    if sources:
        return _shard_validation(grid, next(iter(sources.values())), folder)
    settings = data_settings(cfg)
    data_dir = cfg.data_dir or default_data_dir(cfg.data, tok.name, cfg.tokenizer_vocab, **settings)
    prepare_everywhere(grid, cfg.data, tok, data_dir, **settings)
    return os.path.join(data_dir, "val.bin")


def make_loader(cfg, grid, tok, T):
    """A pretraining run's data: (training loader, its validation split's path, meta), on every rank.

    A corpus (cfg.data) is tokenized once into memmaps (prepare_everywhere; reused after) and read
    by Loader; the path is its val.bin. Shard sets (data="shards:<folder or URL>", or data_sources
    mixed by data_weights) are streamed by stream.Loader from where they are (remote ones through
    a cache of shard_cache_gb per process in shard_cache/rank<r>); the path is the first set's
    val.bin (downloaded into out_dir/val when remote), None with eval_every=0. The shards must have
    been tokenized by the run's tokenizer (else ConfigError). meta: n_train (tokens; of shards, those
    prepared so far), n_val, and `about`: one line saying what is read."""
    sources = streamed(cfg)
    B, rank, world = cfg.micro_batch_size, grid.data_rank, grid.data_world
    if sources is None:
        settings = data_settings(cfg)
        data_dir = cfg.data_dir or default_data_dir(cfg.data, tok.name, cfg.tokenizer_vocab, **settings)
        meta = prepare_everywhere(grid, cfg.data, tok, data_dir, **settings)
        loader = Loader(os.path.join(data_dir, "train.bin"), B, T, rank, world, seed=cfg.seed, device=grid.device)
        about = f"{meta['n_docs']:,} documents, {meta['n_train']:,} train / {meta['n_val']:,} validation tokens"
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
    n_val = _read_meta(os.path.dirname(val_path))["n_val"] if val_path else 0
    unused = [f"{k}={getattr(cfg, k)!r}" for k in ("data", "text_field", "val_fraction", "val_tokens", "max_docs",
                                                   "data_dir", *VARIANT_DEFAULTS)
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
