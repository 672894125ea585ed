"""Corpus: where documents come from. The data path's first stage, the intake of sources into a
stream of document strings:

    iter_documents(source)  ->  non-blank documents (str), in a fixed order
    iter_documents(source, groups=True)  ->  (group, document): a package's, a folder's, a file's together

Sources (SOURCES): the embedded corpora "stdlib" (the running interpreter's standard library) and
"python" (plus the installed packages: deduplicated by content, in a seeded order, no package above
10%), local .txt/.md/.py/.jsonl/.parquet files or folders of them, and `hf:` hub datasets (the same
`datasets` streaming path that local parquet files use). What intake skipped or repaired (binary,
undecodable, unsupported files) is counted in an Intake. source_fingerprint() tells a prepared
corpus that is stale. User errors are DataError with one message saying what to change.

Apart from data.py (tokenizer, token files, loaders) because reading and vetting sources is its own
concern that grows on its own: cleaning and deduplication (a future clean.py) plug in between this
stream of documents and tokenization.
"""
import collections
import functools
import hashlib
import itertools
import json
import os
import re
import sys
import sysconfig

from config import DataError, UserError  # noqa: F401  (DataError: this module's error, raised by its readers)

# -----------------------------------------------------------------------------
# Corpora: iterables of documents (strings)

TEXT_SUFFIXES = (".txt", ".md", ".py")    # one document per file (.txt: several, see DOC_SEPARATOR)
ROW_SUFFIXES = (".jsonl", ".parquet")     # one document per row
SUFFIXES = TEXT_SUFFIXES + ROW_SUFFIXES
SOURCES = ("'stdlib', 'python' (the standard library plus installed packages), "
           "'hf:<name>[:<config>][@<split>]', or a path to a .txt/.md/.py/.jsonl/.parquet file or a folder of them")
# Embedded corpora, the running interpreter's own .py files: name -> (read the site-packages /
# dist-packages folders on sys.path too, the largest share of the bytes one top-level package keeps)
PYTHON_CORPORA = {"stdlib": (False, 1.0), "python": (True, 0.1)}
CORPUS_SEED = 0         # the embedded corpora's fixed file order
DOC_SEPARATOR = re.compile(r"(?:<\|endoftext\|>|\f)(?:\r?\n)?")  # splits a .txt file into documents
MAX_INVALID = 0.1       # a file with more invalid UTF-8 than this share of its bytes is not text


def add_arguments(parser):
    """A CLI's corpus arguments (bpe.py, shards.py): SOURCE, OUT, --text_field, --max_docs (0: all)."""
    parser.add_argument("source", help=SOURCES)
    parser.add_argument("out")
    parser.add_argument("--text_field", default="text", help="the records' text field (jsonl, parquet, hf:)")
    parser.add_argument("--max_docs", type=int, default=0, help="read at most this many documents (0: all)")
    return parser


def _few(names, k=3):
    return ", ".join(names[:k]) + (", ..." if len(names) > k else "")


class Intake:
    """What reading a corpus skipped or repaired. Filled while the documents are read; prepare()
    prints summary() once at the end and stores counts() in meta.json."""

    def __init__(self):
        self.files = 0                                   # files read
        self.binary, self.undecodable, self.replaced = [], [], []  # paths
        self.unsupported = {}                            # suffix -> paths ignored in a folder
        self.duplicates = 0                              # embedded corpora: same content as an earlier file
        self.capped = collections.Counter()              # embedded corpora: package -> files over its cap

    def counts(self):
        return dict(files=self.files, binary=len(self.binary), undecodable=len(self.undecodable),
                    replaced=len(self.replaced), unsupported=sum(map(len, self.unsupported.values())),
                    duplicates=self.duplicates, capped=sum(self.capped.values()))

    def summary(self):
        """Lines worth printing (none when nothing was skipped or repaired)."""
        unsupported = sorted(n for names in self.unsupported.values() for n in names)
        return [line for happened, line in [
            (self.binary or self.undecodable, f"skipped {len(self.binary)} binary / {len(self.undecodable)} undecodable"
             f" files (NUL bytes / over {MAX_INVALID:.0%} invalid UTF-8): {_few(self.binary + self.undecodable)}"),
            (self.replaced, f"{len(self.replaced)} files with a few invalid UTF-8 bytes were read with U+FFFD in "
             f"their place: {_few(self.replaced)}"),
            (unsupported, f"{len(unsupported)} files with unsupported extensions {' '.join(sorted(self.unsupported))}"
             f" were ignored: {_few(unsupported)} (accepted: {' '.join(SUFFIXES)})"),
            (self.duplicates, f"{self.duplicates} duplicate files (same content as an earlier one) left out"),
            (self.capped, f"package cap: {sum(self.capped.values())} files of {len(self.capped)} packages left out "
             f"({_few([p for p, _ in self.capped.most_common()])})")] if happened]


def python_roots(site_packages=True):
    """The folders an embedded corpus reads: the standard library and, with site_packages, the
    site-packages / dist-packages folders on sys.path (the installed packages)."""
    roots = [sysconfig.get_paths()["stdlib"]]
    if site_packages:
        roots += [p for p in sys.path if os.path.basename(p.rstrip(os.sep)) in ("site-packages", "dist-packages")
                  and os.path.isdir(p)]
    return list(dict.fromkeys(os.path.realpath(r) for r in roots))


def _walk_py(roots):
    # (path, path under its root, top-level package, stat) of every non-empty .py file; nested
    # site-packages (read as roots of their own), __pycache__ and hidden folders are not entered
    found = []
    for root in roots:
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = sorted(d for d in dirnames if not d.startswith(".")
                                 and d not in ("site-packages", "dist-packages", "__pycache__"))
            for name in sorted(filenames):
                path = os.path.join(dirpath, name)
                if not name.endswith(".py") or not os.path.isfile(path):
                    continue
                st, rel = os.stat(path), os.path.relpath(path, root)
                if st.st_size:
                    found.append((path, rel, rel.split(os.sep)[0].removesuffix(".py"), st))
    return found


def package_cap(sizes, share):
    """The largest cap c (bytes) with c <= share * sum(min(s, c) for s in sizes): cutting every
    package to c leaves none above `share` of the cut corpus. None when no cut is needed, or none
    can work (fewer than 1/share packages)."""
    s = sorted(sizes)
    below = sum(s)
    if not s or s[-1] <= share * below:
        return None
    for k in range(len(s) - 1, -1, -1):  # caps between s[k-1] and s[k]: packages k.. are cut
        below -= s[k]
        denom = 1 - share * (len(s) - k)
        if denom > 0 and share * below / denom >= (s[k - 1] if k else 0):
            return int(share * below / denom) or None
    return None


def python_files(roots, seed=CORPUS_SEED, max_package_share=1.0, report=None):
    """An embedded corpus' files, in its order: every non-empty .py file under roots, in a fixed
    pseudo-random order (a hash of seed and the path under its root: not alphabetical, the same on
    every call, and a new file does not reorder the others), deduplicated by content (the first in
    that order stays), each top-level package (a folder or module under its root) cut to
    package_cap(bytes per package, max_package_share) bytes, its files taken in order while they fit."""
    report = Intake() if report is None else report
    found = sorted(_walk_py(roots), key=lambda f: (hashlib.sha1(f"{seed}/{f[1]}".encode()).digest(), f[0]))
    same_size = collections.Counter(f[3].st_size for f in found)  # only files of equal size can be equal
    seen, files, totals = set(), [], collections.Counter()
    for path, _, package, st in found:
        if same_size[st.st_size] > 1:
            with open(path, "rb") as fh:
                digest = hashlib.sha256(fh.read()).digest()
            if digest in seen:
                report.duplicates += 1
                continue
            seen.add(digest)
        files.append((path, package, st.st_size))
        totals[package] += st.st_size
    cap = package_cap(list(totals.values()), max_package_share) if max_package_share < 1 else None
    kept, used = [], collections.Counter()
    for path, package, size in files:
        if cap is not None and used[package] + size > cap:
            report.capped[package] += 1
            continue
        used[package] += size
        kept.append(path)
    return kept


def _corpus_files(path, report):
    # The file itself, or a folder's files with accepted suffixes (sorted; hidden names skipped,
    # other suffixes noted in the report)
    if os.path.isfile(path):
        if not path.endswith(SUFFIXES):
            raise DataError(f"corpus file {path!r} has an unsupported type; accepted sources: {SOURCES}")
        return [path]
    files = []
    for dirpath, dirnames, filenames in os.walk(path):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        for name in (n for n in filenames if not n.startswith(".")):
            if name.endswith(SUFFIXES):
                files.append(os.path.join(dirpath, name))
            else:
                rel = os.path.relpath(os.path.join(dirpath, name), path)
                report.unsupported.setdefault(os.path.splitext(name)[1] or "(none)", []).append(rel)
    if not files and report.unsupported:
        names = sorted(n for v in report.unsupported.values() for n in v)
        raise DataError(f"corpus folder {path!r} holds no {'/'.join(SUFFIXES)} file, only {len(names)} files with "
                        f"unsupported extensions {' '.join(sorted(report.unsupported))} ({_few(names, 5)}): convert "
                        "them (e.g. to .jsonl with a 'text' field) or point data at another folder")
    return sorted(files)


def _read_text(path, report):
    # A file's text; None when it is not UTF-8 text: a NUL byte (binary) or over MAX_INVALID of its
    # bytes invalid (another encoding, or binary). A few invalid bytes become U+FFFD, and are counted.
    with open(path, "rb") as f:
        raw = f.read()
    report.files += 1
    if b"\0" in raw:
        report.binary.append(path)
        return None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        invalid = len(re.findall("[\udc80-\udcff]", raw.decode("utf-8", "surrogateescape")))
    if invalid > MAX_INVALID * len(raw):
        report.undecodable.append(path)
        return None
    report.replaced.append(path)
    return raw.decode("utf-8", "replace")


def _row_text(row, text_field, where):
    if not isinstance(row, dict) or text_field not in row:
        got = f"fields: {sorted(row)}" if isinstance(row, dict) else f"a JSON {type(row).__name__}, not an object"
        raise DataError(f"{where}: no field {text_field!r} ({got}); set text_field to the field holding the text")
    text = row[text_field]
    if text is not None and not isinstance(text, str):
        raise DataError(f"{where}: field {text_field!r} holds a {type(text).__name__}, not text")
    return text or ""


def json_records(path, what="records"):
    """The records of a .json file that holds one list of them; anything else raises DataError
    naming the file (and the line, for text that is not JSON)."""
    with open(path, encoding="utf-8") as f:
        try:
            rows = json.load(f)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{e.lineno}: not valid JSON ({e.msg}, column {e.colno})") from None
    if not isinstance(rows, list):
        raise DataError(f"{path}: a .json file of {what} must hold a list of records, not a "
                        f"{type(rows).__name__} (one record per line: use .jsonl)")
    return rows


def jsonl_rows(path, report=None, bad=None):
    """(line number, JSON value) of each non-blank line of a .jsonl file, read line by line: a line
    that is not JSON raises DataError naming path:line, or, given a Counter `bad`, is counted under
    "not_json" and skipped. Undecodable bytes: given a report (a corpus), they become U+FFFD and the
    file is noted in report.replaced (the intake summary says so); otherwise (records: chat data,
    tasks) the line raises DataError naming path:line, or, given `bad`, is counted under "not_utf8"
    and skipped."""
    if report is not None:
        report.files += 1
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                if report is None and bad is None:
                    raise DataError(f"{path}:{lineno}: not valid UTF-8 (byte {raw[e.start]:#04x} at byte {e.start + 1} "
                                    "of the line): save the file as UTF-8 (chat data: skip_bad_records=True "
                                    "skips and counts such lines)") from None
                if report is None:
                    bad["not_utf8"] += 1
                    continue
                line = raw.decode("utf-8", "replace")
                if path not in report.replaced:
                    report.replaced.append(path)
            try:
                yield lineno, json.loads(line)
            except json.JSONDecodeError as e:
                if bad is None:
                    raise DataError(f"{path}:{lineno}: not valid JSON ({e.msg}, column {e.colno}): "
                                    f"{line[:60].strip()!r}; each line of a .jsonl file must be one JSON object") from None
                bad["not_json"] += 1


def _jsonl_documents(path, text_field, report):
    for lineno, row in jsonl_rows(path, report):
        yield _row_text(row, text_field, f"{path}:{lineno}")


def dataset_rows(path, config=None, split="train", where=None, **kwargs):
    """Rows (dicts) of a streamed `datasets` dataset. Hub datasets and local parquet files share this
    path, so the local tests cover the hub option too. where: the local file, named in errors."""
    import datasets  # slow to import: only when a row-based corpus is actually read
    try:
        yield from datasets.load_dataset(path, config, split=split, streaming=True, **kwargs)
    except Exception as e:
        if where is None:
            raise
        first = (str(e).strip().splitlines() or [""])[0][:200]
        raise DataError(f"{where}: cannot read it as parquet ({type(e).__name__}: {first})") from e


def _rows(text_field, path, config=None, split="train", where=None, **kwargs):
    for i, row in enumerate(dataset_rows(path, config, split, where, **kwargs)):
        yield _row_text(row, text_field, f"{where or path} row {i}")


def _file_documents(path, text_field, report):
    if path.endswith(".jsonl"):
        yield from _jsonl_documents(path, text_field, report)
    elif path.endswith(".parquet"):
        report.files += 1
        yield from _rows(text_field, "parquet", where=path, data_files=path)
    else:
        text = _read_text(path, report)
        if text is not None:
            yield from DOC_SEPARATOR.split(text) if path.endswith(".txt") else [text]


def _nonempty(docs, source, report):
    n = 0
    for doc in docs:
        text = doc[1] if isinstance(doc, tuple) else doc  # (group, text) pairs: iter_documents(groups=True)
        if text and not text.isspace():  # a blank document would train only on EOS
            n += 1
            yield doc
    if n == 0:
        skipped = "; ".join(report.summary())
        raise DataError(f"corpus {source!r} is empty: it yields no non-empty document" + (f" ({skipped})" * bool(skipped)))


def iter_documents(source="stdlib", text_field="text", report=None, groups=False):
    """Documents (non-blank strings) of a corpus, in a fixed order. Accepted sources: see SOURCES.
    A file is one document, except .txt (split at '<|endoftext|>' and form feeds) and .jsonl /
    .parquet (one per row). Checks the source now; reads lazily, noting skipped and repaired files
    in `report` (an Intake). groups=True: (group, document) pairs, a group's documents one after
    another (the files reordered by their group's first place, stable): an embedded corpus' file is
    in its top-level package's group, a .jsonl / .parquet file's records in that file's, any other
    file in its folder's; a hub dataset is one group (what prepare's join_docs joins)."""
    report = Intake() if report is None else report
    if source in PYTHON_CORPORA:
        site_packages, share = PYTHON_CORPORA[source]
        roots = python_roots(site_packages)
        files = python_files(roots, CORPUS_SEED, share, report)
        group = functools.partial(package_of, roots=roots)
    elif source.startswith("hf:"):
        name, config, split = parse_hf(source)
        docs = _rows(text_field, name, config, split)
        return _nonempty(((source, d) for d in docs) if groups else docs, source, report)
    elif os.path.exists(source):
        files = _corpus_files(source, report)

        def group(f):
            return f if f.endswith(ROW_SUFFIXES) else os.path.dirname(f)
    else:
        raise DataError(f"corpus {source!r} not found; accepted sources: {SOURCES}")
    if not groups:
        return _nonempty(itertools.chain.from_iterable(_file_documents(f, text_field, report) for f in files),
                         source, report)
    first = {}
    for f in files:
        first.setdefault(group(f), len(first))
    files = sorted(files, key=lambda f: first[group(f)])
    return _nonempty(((group(f), d) for f in files for d in _file_documents(f, text_field, report)), source, report)


def package_of(path, roots):
    """An embedded corpus' file's group: its top-level package (or module) under the deepest root holding it."""
    root = max((r for r in roots if path.startswith(r + os.sep)), key=len, default=os.path.dirname(path))
    return os.path.join(root, os.path.relpath(path, root).split(os.sep)[0].removesuffix(".py"))


def parse_hf(source):
    """'hf:<name>[:<config>][@<split>]' -> (name, config or None, split, default "train")."""
    rest = source[len("hf:"):]
    rest, _, split = rest.partition("@")
    name, _, config = rest.partition(":")
    if not name:
        raise DataError(f"bad hub source {source!r}: expected 'hf:<name>[:<config>][@<split>]'")
    return name, config or None, split or "train"


# -----------------------------------------------------------------------------
# A source's identity: a prepared corpus knows when it is stale

def source_key(source):
    """The identity of a source: an embedded corpus' or hub dataset's name, else the absolute path."""
    return source if source in PYTHON_CORPORA or source.startswith("hf:") else os.path.abspath(source)


def source_fingerprint(source, salt=""):
    """Cheap identity of a corpus' contents (file names, sizes, mtimes, the Python version and the
    cap for the embedded corpora): a changed corpus is prepared again instead of silently reusing
    stale tokens. salt: the caller's format tag, so a new format also changes the fingerprint."""
    h = hashlib.sha256(salt.encode())
    if source in PYTHON_CORPORA:
        h.update(f"{sys.version}|{PYTHON_CORPORA[source]}|{CORPUS_SEED}".encode())
        files = [(path, st) for path, _, _, st in _walk_py(python_roots(PYTHON_CORPORA[source][0]))]
    else:  # hub: trust the name
        files = [] if source.startswith("hf:") else [(f, os.stat(f)) for f in _corpus_files(source, Intake())]
    for f, st in files:
        h.update(f"{f}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:16]
