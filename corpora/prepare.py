"""Corpus preparation: a corpus tokenized once into flat token files, and the data keys only it reads.

    meta = prepare.prepare(source, tok, out_dir, **prepare.data_settings(cfg))  # reused when finished and matching
    data_dir, meta = prepare.prepared(cfg, grid, tok)  # a run's corpus: rank 0 tokenizes, once; every rank waits

    corpus.iter_documents(source)  ->  joined (join_docs > 0: long documents)  ->  clean.documents (optional)
    ->  prepare(): tokenize (FIM layout for fim_rate of the training documents), append EOS, split
    ->  out_dir/{train,val}.bin (flat uint16/uint32 token streams) + meta.json, which data.py's loaders read

Where documents come from (embedded corpora, local files, hub datasets) is corpus.py's concern,
the tokenizer tokenizer.py's; prepare() prints once what intake skipped or repaired and keeps its
counts in meta.json. How FIM is baked into train.bin: prepare. PREPARE_DEFAULTS: the keys only
preparation reads (data.DATA_DEFAULTS holds them too, for the stages that read a corpus).

Invariants: a finished preparation is reused only when meta.json's settings and the corpus
fingerprint (corpus.source_fingerprint) match, and the settings name the folder (default_data_dir),
so changing one prepares other files; bins are written before meta.json, so a crash leaves no
meta.json that matches; validation is always plain text; user errors are corpus.DataError with one
message saying what to change.
"""
import collections
import hashlib
import itertools
import json
import os
import re
from dataclasses import replace

import numpy as np
import torch

import parallel
from config import need
from corpora import clean as clean_mod
from corpora import corpus
from corpora import fim as fim_mod

# The keys of a corpus' preparation (pretraining and eval.py read them through data.DATA_DEFAULTS)
PREPARE_DEFAULTS = dict(
    text_field="text",       # the field holding a document's text in .jsonl / .parquet / hf: records
    data_dir="",             # where the tokenized memmaps go ("" -> data/<name>)
    val_fraction=0.01,       # validation share of the corpus: at least val_tokens, at most 10% (val_split)
    val_tokens=1 << 20,      # floor of the validation split in tokens (a small corpus still gets a real one)
    max_docs=0,              # read at most this many documents (0: all)
    join_docs=0,             # >0: long documents, a source's documents joined in order (a blank line between) into
                             # ones of at least this many tokens (joined(); pretraining's rows="documents" at long T)
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
)
FORMAT = "ingot-tokens-v2"  # bump when the file layout or the split changes: old preparations then rebuild
VAL_TOKENS = PREPARE_DEFAULTS["val_tokens"]  # prepare()'s default floor of validation tokens (up to max_val_share)
# prepare()'s settings that change the tokens (besides source and tokenizer), with their defaults
VARIANT_DEFAULTS = {k: PREPARE_DEFAULTS[k] for k in ("fim_rate", "fim_spm_rate", "fim_seed", "fim_fragment", "clean",
                                                     "dedup", "toxicity", "toxicity_threshold", "toxicity_keep",
                                                     "join_docs")}
JOIN = "\n\n"  # between the documents joined() joins


def need_data(ok, message):
    """Raise corpus.DataError(message) unless ok (a problem with the data or its settings)."""
    if not ok:
        raise corpus.DataError(message)


def check_settings(cfg):
    """The preparation keys of a config, before any work: one message saying what to change."""
    need(cfg.dedup in ("none", "exact", "near"), f"dedup='{cfg.dedup}' must be none, exact or near")
    need(0 <= cfg.fim_rate <= 1 and 0 <= cfg.fim_spm_rate <= 1,
         f"fim_rate={cfg.fim_rate} and fim_spm_rate={cfg.fim_spm_rate} must be in [0, 1]")
    need(cfg.fim_seed >= 0, f"fim_seed={cfg.fim_seed} must be >= 0")
    need(isinstance(cfg.fim_fragment, int) and cfg.fim_fragment >= 0,
         f"fim_fragment={cfg.fim_fragment} must be an integer >= 0 (characters per FIM fragment; 0: whole documents)")
    need(0 <= cfg.val_fraction < 1, f"val_fraction={cfg.val_fraction} must be in [0, 1)")
    need(cfg.val_tokens >= 0, f"val_tokens={cfg.val_tokens} must be >= 0")
    need(cfg.max_docs >= 0, f"max_docs={cfg.max_docs} must be >= 0 (0: all documents)")
    need(isinstance(cfg.join_docs, int) and cfg.join_docs >= 0,
         f"join_docs={cfg.join_docs} must be an integer >= 0 (tokens of a joined document; 0: no joining)")
    need(not cfg.toxicity or cfg.clean, f"toxicity={cfg.toxicity!r} runs inside clean.py's cleaning: set clean=True")
    need(cfg.toxicity or not (cfg.toxicity_threshold or cfg.toxicity_keep),
         "toxicity_threshold / toxicity_keep need a scorer: set toxicity (e.g. toxicity=wordlist)")
    need(0 <= cfg.toxicity_keep < 1, f"toxicity_keep={cfg.toxicity_keep} must be in [0, 1)")


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
                                          ("tox", changed.get("toxicity")), ("fim", changed.get("fim_rate")),
                                          (f"join{changed.get('join_docs')}", changed.get("join_docs"))) if on)
    return os.path.join(root, f"{slug}-{tokenizer_name}{f'-{vocab}' if vocab else ''}{tags}-{digest}")


def read_meta(out_dir):
    """A prepared folder's meta.json as a dict, or None (none yet, or unreadable)."""
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


def joined(items, tokenizer, min_tokens, stats, num_threads=1, batch=256):
    """(group, text) pairs, each group's together (corpus.iter_documents(groups=True)) -> long documents:
    a group's texts joined in order with JOIN between them, a document closed once its texts hold at least
    min_tokens tokens (each text counted as it encodes alone: a join may shift the total by a token); a
    group's tail below min_tokens joins its last document, a whole group below it stays one shorter
    document. stats (a Counter): texts read, documents made, short (those below min_tokens)."""
    group, held, cur, n = object(), None, [], 0  # held: the group's last closed document, until its tail is known

    def close():
        if held is not None or cur:
            stats["documents"] += 1
            stats["short"] += held is None
            yield JOIN.join((held or []) + cur)
    items = iter(items)
    while chunk := list(itertools.islice(items, batch)):
        encoded = tokenizer.encode_batch([text for _, text in chunk], num_threads=num_threads)
        for (g, text), ids in zip(chunk, encoded):
            stats["texts"] += 1
            if g != group:
                yield from close()
                group, held, cur, n = g, None, [], 0
            cur.append(text)
            n += len(ids)
            if n >= min_tokens:
                if held is not None:
                    stats["documents"] += 1
                    yield JOIN.join(held)
                held, cur, n = cur, [], 0
    yield from close()


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


def prepare(source, tokenizer, out_dir, val_fraction=0.01, text_field="text", max_docs=0, num_proc=None,
            verbose=True, val_tokens=VAL_TOKENS, max_val_share=0.1, fim_rate=0.0, fim_spm_rate=0.5, fim_seed=0,
            fim_fragment=0, clean=False, dedup="none", toxicity="", toxicity_threshold=0.0, toxicity_keep=0.0,
            join_docs=0):
    """Tokenize `source` into out_dir/train.bin, val.bin (each document's tokens then EOS, in corpus
    order; validation chosen by val_split) and meta.json. Reuses a finished matching preparation.
    num_proc: tokenizer threads (default: all cores). clean / dedup: clean.py between intake and
    tokenization (_cleaned; max_docs counts the documents that pass; toxicity: toxicity.py's scorer, with
    clean, drops or keeps toxicity_keep of the documents above toxicity_threshold). fim_rate > 0: the training
    documents in FIM layout (fim.py; fim_fragment > 0: per fragment of that many characters). join_docs > 0:
    long documents, joined() per group of the corpus into ones of at least join_docs tokens, before
    cleaning (which then sees the joined documents, as max_docs counts them); meta's `joined` counts them.
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
    need_data(0 <= val_fraction < 1, f"val_fraction={val_fraction} must be in [0, 1)")
    need_data(isinstance(max_docs, int) and max_docs >= 0, f"max_docs={max_docs} must be an integer >= 0 (0: all)")
    need_data(isinstance(val_tokens, int) and val_tokens >= 0, f"val_tokens={val_tokens} must be an integer >= 0")
    need_data(0 <= max_val_share < 1, f"max_val_share={max_val_share} must be in [0, 1)")
    need_data(dedup in ("none", "exact", "near"), f"dedup={dedup!r} must be 'none', 'exact' or 'near'")
    need_data(not toxicity or clean, f"toxicity={toxicity!r} runs inside the cleaning: set clean=True")
    need_data(isinstance(join_docs, int) and join_docs >= 0, f"join_docs={join_docs} must be an integer >= 0")
    transform = fim_mod.Transform(tokenizer, fim_rate, fim_spm_rate, fim_seed, fim_fragment) if fim_rate > 0 else None
    dtype = np.dtype(np.uint16 if tokenizer.n_vocab <= 1 << 16 else np.uint32)
    meta = dict(format=FORMAT, source=corpus.source_key(source), text_field=text_field, tokenizer=tokenizer.name,
                vocab=tokenizer.vocab, n_vocab=tokenizer.n_vocab, eos_id=tokenizer.eos_id, dtype=dtype.name,
                val_fraction=val_fraction, val_tokens=val_tokens, max_val_share=max_val_share,
                max_docs=max_docs, fingerprint=corpus.source_fingerprint(source, FORMAT),
                fim_rate=fim_rate, fim_spm_rate=fim_spm_rate, fim_seed=fim_seed, fim_fragment=fim_fragment,
                clean=clean, dedup=dedup, toxicity=toxicity, toxicity_threshold=toxicity_threshold,
                toxicity_keep=toxicity_keep, join_docs=join_docs)
    old = read_meta(out_dir)
    bins = {s: os.path.join(out_dir, f"{s}.bin") for s in ("train", "val")}
    if old is not None and all(old.get(k, VARIANT_DEFAULTS.get(k)) == v for k, v in meta.items()) and all(
            os.path.exists(p) and os.path.getsize(p) == old[f"n_{s}"] * dtype.itemsize for s, p in bins.items()):
        if verbose:
            print(f"data: reusing {out_dir} ({old['n_docs']:,} documents: {old['n_train']:,} train / "
                  f"{old['n_val']:,} val tokens)")
        return old

    report, stats, joins = corpus.Intake(), clean_mod.Stats(), collections.Counter()
    threads = num_proc or os.cpu_count() or 1
    docs = corpus.iter_documents(source, text_field, report, groups=bool(join_docs))  # a bad source fails here
    if join_docs:
        docs = joined(docs, tokenizer, join_docs, joins, threads)
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
                                    threads, bar, transform)
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
                    fim_docs=fim_docs, **({"joined": dict(joins)} if join_docs else {}))
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
        if join_docs:
            print(f"data: join_docs={join_docs}: {joins['texts']:,} documents joined per group into "
                  f"{joins['documents']:,} of >= {join_docs:,} tokens ({joins['short']:,} of them shorter: a whole "
                  "group below that)")
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
# A run's corpus

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


def prepared(cfg, grid, tok):
    """(data_dir, meta) of a run's corpus cfg.data, on every rank: its folder (cfg.data_dir, else
    default_data_dir's name for the settings), prepared by prepare_everywhere (a finished one reused)."""
    settings = data_settings(cfg)
    data_dir = cfg.data_dir or default_data_dir(cfg.data, tok.name, cfg.tokenizer_vocab, **settings)
    return data_dir, prepare_everywhere(grid, cfg.data, tok, data_dir, **settings)
