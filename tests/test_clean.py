"""clean.py: every filter on hand-written documents that must pass and must fail (with the reason
it names); bad input (binary, invalid UTF-8, empty, an enormous line, not text) counted and
skipped; n-gram repetition worked by hand; exact dedup keeps the first copy; MinHash signatures,
the bands x rows choice and the LSH candidate pairs equal datasketch's (the test-only reference)
bit for bit; on a corpus with planted near-duplicates, recall >= 0.95 against exact Jaccard
similarity of the same shingle sets at the stated threshold; the streaming and the parallel
two-phase paths remove the same documents; the CLI writes the cleaned corpus and the counts."""
import json
import random
from collections import defaultdict
from dataclasses import fields, replace
from itertools import combinations

import numpy as np
import pytest

from corpora import clean

CFG = clean.CleanConfig()

PROSE = """The river runs through the old town and past the mill, where the water has turned the
great wheel for more than two hundred years. People come from the villages to buy flour, and
they stay to talk with the miller about the weather and the price of grain.

In the spring the water rises with the melting snow from the hills. The miller watches the
banks closely, because a flood can carry away the sluice gates and stop the work for weeks.
His daughter keeps the accounts and knows every farmer by name.

When the harvest is good the mill works day and night, and the sound of the stones can be
heard from the bridge. Children like to stand there and watch the wheel turn in the dark."""

CODE = '''import os


def walk(root, suffix=".py"):
    """Yield the paths under root that end in suffix, sorted for a stable order."""
    for folder, _, names in sorted(os.walk(root)):
        for name in sorted(names):
            if name.endswith(suffix):
                yield os.path.join(folder, name)


class Counter:
    def __init__(self):
        self.n = 0

    def add(self, k=1):
        self.n += k
        return self.n
'''

WORDS = ("time person year way day thing man world life hand part child eye woman place work week "
         "case point government company number group problem fact house river stone market water "
         "garden window letter music paper story table light night money field").split()


def sentences(n, seed=0):
    """n distinct plain sentences of 12 words with stop words (pass every Gopher rule)."""
    rng = random.Random(seed)
    return [" ".join(["The"] + [rng.choice(WORDS) for _ in range(5)] + ["and", "the"]
                     + [rng.choice(WORDS) for _ in range(3)] + [f"{rng.choice(WORDS)}{i}."])
            for i in range(n)]


def test_hand_written_documents_pass():
    assert clean.prose_reason(PROSE, CFG) is None
    assert clean.code_reason(CODE, CFG) is None
    assert clean.guess_kind(PROSE) == "prose" and clean.guess_kind(CODE) == "code"
    assert list(clean.documents([PROSE, CODE])) == [PROSE, CODE]


@pytest.mark.parametrize("reason, text", [
    ("words", "Too short to be a document, with the words that matter."),
    ("words", "word " * 100_001),
    ("mean_word_length", " ".join(f"internationalisationalist{i} and the" for i in range(30))),
    ("mean_word_length", " ".join("a an to of it is by we do go" for _ in range(6)) + " the and"),
    ("symbols", PROSE + " #tag" * 20),
    ("symbols", PROSE + " and so on..." * 20),
    ("bullets", "\n".join("• " + s for s in sentences(20))),
    ("ellipsis", "\n".join(s[:-1] + " ..." for s in sentences(20))),
    ("alpha_words", PROSE + " " + " ".join(str(i) for i in range(60))),
    ("stop_words", " ".join(f"Stones rivers{i} markets gardens windows letters." for i in range(12))),
    ("dup_lines", "\n".join(sentences(10) + ["The same line again and again with the market."] * 6)),
    ("dup_line_chars", "\n".join(sentences(12) + ["A long repeated line " + "with the river and stone " * 8] * 3)),
    ("dup_paragraphs", "\n\n".join(["\n".join(sentences(5, i)) for i in range(4)] + ["Same with the mill."] * 4)),
    ("dup_paragraph_chars", "\n\n".join(sentences(10) + ["\n".join(sentences(6, 1))] * 2)),
    ("top_2gram", " ".join(sentences(6)) + " the river" * 60),
    ("dup_5gram", " ".join(sentences(6)) + " " + " ".join(sentences(4, 3)) + " " + " ".join(sentences(4, 3))),
])
def test_prose_filters_fail(reason, text):
    assert clean.prose_reason(text, CFG) == reason


def test_sentences_pass():
    """The building block of the failing examples passes on its own."""
    assert clean.prose_reason("\n".join(sentences(20)), CFG) is None


def test_ngram_chars_by_hand():
    ids, ones = np.array([0, 1, 0, 1, 2], np.int32), np.ones(5, np.int64)
    assert clean.ngram_chars(ids, ones, 2) == (4, 4)      # "a b" twice: 2 x 2 chars; words 0..3
    assert clean.ngram_chars(ids, ones, 3) == (0, 0)      # aba bab abc: all unique
    ids, lens = np.array([0, 1, 0, 1, 0], np.int32), np.array([1, 2, 1, 2, 1])
    assert clean.ngram_chars(ids, lens, 2) == (6, 7)      # x yy (3 chars) twice; every word covered
    assert clean.ngram_chars(ids, lens, 4) == (0, 0)
    assert clean.ngram_chars(ids, lens, 6) == (0, 0)      # fewer words than n


def encoded_file(lines):
    return CODE + "\nDATA = [\n" + "".join(lines) + "]\n"


@pytest.mark.parametrize("reason, text", [
    ("long_line", CODE + "x = '" + "ab cd " * 300 + "'\n"),
    ("mean_line_length", "\n".join("value = compute(" + ", ".join(["argument"] * 14) + ")" for _ in range(30))),
    ("low_alnum", "\n".join(["{}();[]<>+-*/=" * 4] * 20) + "\nx = 1\n"),
    ("autogenerated", "# Generated by the protocol buffer compiler.  DO NOT EDIT!\n" + CODE),
    ("autogenerated", "// This file is auto-generated\n" + CODE),
    ("encoded_data", CODE + 'BLOB = """\n' + ("QUJDRGVmZ2hpams0NTY3+/" * 3 + "\n") * 20 + '"""\n'),
    ("encoded_data", encoded_file(["    " + "0x3f, " * 12 + "\n" for _ in range(20)])),
    ("mostly_data", "T = [\n" + "".join("    1, 22, 333, 4.5, -6, 7e3, 8, 9,\n" for _ in range(25)) + "]\n"),
    ("mostly_data", "S = (\n" + "    '\\u00e9\\u00e8\\u00e9\\u00e8\\u00e9\\u00e8\\u00e9\\u00e8'\n" * 15 + ")\n"),
])
def test_code_filters_fail(reason, text):
    assert clean.code_reason(text, CFG) == reason


def test_code_with_small_tables_passes():
    text = CODE + "PRIMES = [2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41, 43, 47, 53, 59, 61]\n"
    assert clean.code_reason(text, CFG) is None


def test_normalise():
    pad = " and more" * 20
    text, reason = clean.normalise("\ufeffcafe\u0301\r\nline\x07 two\rthree\tend" + pad, CFG)
    assert reason is None and text == "caf\u00e9\nline two\nthree\tend" + pad  # NFC, newlines, no Cc
    assert clean.normalise("\x07" * 3 + "x" * 200, CFG) == (None, "binary")   # over 1% control
    assert clean.normalise("caf\u00e9".encode(), CFG) == ("caf\u00e9", None)
    text, reason = clean.normalise("x" * 500 + "\ud800" + "y", CFG)           # a lone surrogate
    assert reason is None and text.encode("utf-8") == b"x" * 500 + b"y"


def test_bad_input_counted_and_skipped():
    rng = np.random.default_rng(0)
    binary = bytes(rng.integers(0, 256, 5000, dtype=np.uint8))
    docs = [
        PROSE,
        b"\xff\xfe\xfa invalid utf-8 \xc3\x28",                 # invalid_utf8
        binary,                                                 # invalid_utf8 (random bytes)
        bytes(range(32)) * 50,                                  # valid UTF-8, all control: binary
        "".join(map(chr, rng.integers(0, 0x30, 3000))),         # a binary-ish str
        "", "  \n\t\n ", b"",                                   # empty
        None, 12345, ["a list"],                                # not_text
        "x" * (CFG.max_chars + 1),                              # too_long, before any other work
        b"y" * (4 * CFG.max_chars + 1),
        ("word " * 150_000).strip(),                            # one enormous prose line: too many words
        "x = [\n" + "'ab', " * 100_000 + "]\n",                 # one enormous code line
        CODE,
    ]
    stats = clean.Stats()
    out = list(clean.documents(docs, stats=stats))
    assert out == [PROSE, CODE]
    assert stats.docs == len(docs) and stats.kept == 2
    assert stats.removed == {"invalid_utf8": 2, "binary": 2, "empty": 3, "not_text": 3,
                             "too_long": 2, "words": 1, "long_line": 1}


def test_exact_dedup_keeps_first():
    a, b = PROSE, CODE
    a_spaces = a.replace(" ", "  ").replace("\n", " \n")       # same content, other whitespace
    stats = clean.Stats()
    out = list(clean.documents([a, b, a_spaces, b, a], stats=stats))
    assert out == [a, b] and stats.removed == {"exact_duplicate": 3}
    no_dedup = replace(CFG, exact_dedup=False)
    assert len(list(clean.documents([a, b, a], no_dedup))) == 3


# ---------------------------------------------------------------- MinHash, LSH vs datasketch

def planted_corpus(seed=0, n_base=60, length=250):
    """Random-word documents, near-duplicates edited at 0.5..3% of their words (some of them
    copies of copies), 15%-edited documents (Jaccard ~0.3, not duplicates) and unrelated ones."""
    rng = random.Random(seed)
    vocab = [f"w{i}" for i in range(3000)]
    base = [[rng.choice(("the", "and", "of", "with")) if i % 6 == 0 else rng.choice(vocab)
             for i in range(length)] for _ in range(n_base)]          # stop words: Gopher passes

    def edit(words, frac):
        words = list(words)
        for i in rng.sample(range(len(words)), max(1, round(frac * len(words)))):
            words[i] = rng.choice(vocab)
        return words
    docs = list(base)
    for i in range(n_base):
        near = edit(base[i], rng.choice([0.005, 0.01, 0.02, 0.03]))
        docs += [near, edit(near, 0.005)] if i % 4 == 0 else [near]
        docs.append(edit(base[i], 0.15))
    rng.shuffle(docs)
    return [" ".join(d) for d in docs]


def candidate_pairs(keys):
    """Pairs i < j that share a key in some band (column of `keys`)."""
    pairs = set()
    for column in keys.T:
        groups = defaultdict(list)
        for i, k in enumerate(column.tolist()):
            groups[k].append(i)
        pairs.update(p for g in groups.values() for p in combinations(g, 2))
    return pairs


def test_lsh_params_equal_datasketch():
    lsh = pytest.importorskip("datasketch.lsh")
    for t in (0.3, 0.5, 0.75, 0.8, 0.85, 0.95):
        for num_perm in (16, 64, 128):
            for w in (0.5, 0.2):
                assert clean.lsh_params(t, num_perm, w) == lsh._optimal_param(t, num_perm, w, 1 - w)
    assert clean.lsh_params(0.8, 128, 0.5) == (9, 13) and clean.lsh_params(0.8, 128, 0.1) == (14, 9)


@pytest.mark.parametrize("scheme", ["affine32", "legacy"])
def test_signatures_and_candidates_equal_datasketch(scheme):
    datasketch = pytest.importorskip("datasketch")
    cfg = replace(CFG, near_dedup=True, scheme=scheme, num_perm=64, seed=3, threshold=0.7)
    docs = planted_corpus(1, n_base=25)[:60] + [CODE, PROSE, "tiny doc", ""]
    hasher = clean.MinHasher(cfg)
    sigs = np.stack([hasher.signature(d) for d in docs])
    lsh = datasketch.MinHashLSH(threshold=0.7, num_perm=64, weights=(0.1, 0.9))
    assert (lsh.b, lsh.r) == (hasher.bands, hasher.rows)
    theirs = []
    for i, d in enumerate(docs):
        m = datasketch.MinHash(num_perm=64, seed=3, scheme=scheme)
        m.update_batch(list(clean.shingles(d, cfg.shingle_words)))
        assert np.array_equal(sigs[i], m.hashvalues), i
        lsh.insert(i, m)
        theirs.append(m)
    their_pairs = {(min(i, j), max(i, j)) for i, m in enumerate(theirs) for j in lsh.query(m) if j != i}
    ours = candidate_pairs(clean.band_keys(sigs, hasher.bands, hasher.rows))
    assert ours == their_pairs and len(ours) > 20


def test_shingles():
    assert clean.shingles("A b, c! D e f", 5) == {b"a b c d e", b"b c d e f"}
    assert clean.shingles("Only three words", 5) == {b"only three words"}
    assert clean.shingles(" ,; ", 5) == set()


def test_near_dedup_recall_precision_against_exact_jaccard():
    """Ground truth: exact Jaccard of the shingle sets for every pair. LSH candidates must find
    >= 95% of the pairs at J >= 0.8; its false positives are pairs just under the threshold."""
    cfg = replace(CFG, near_dedup=True)
    docs = planted_corpus(0)
    sets = [clean.shingles(d, cfg.shingle_words) for d in docs]
    truth = {(i, j): len(sets[i] & sets[j]) / len(sets[i] | sets[j])
             for i, j in combinations(range(len(docs)), 2)}
    positives = {p for p, jac in truth.items() if jac >= cfg.threshold}
    hasher = clean.MinHasher(cfg)
    keys = clean.band_keys(np.stack([hasher.signature(d) for d in docs]), hasher.bands, hasher.rows)
    found = candidate_pairs(keys)
    recall = len(found & positives) / len(positives)
    precision = len(found & positives) / len(found)
    print(f"{len(docs)} docs, {len(positives)} pairs at J >= 0.8: recall {recall:.3f} precision {precision:.3f}")
    assert len(positives) >= 60 and recall >= 0.95 and precision >= 0.85
    assert min(truth[p] for p in found) > 0.6          # no candidate far below the threshold

    # the removal rule: a document goes when it is a candidate of an earlier one
    stats = clean.Stats()
    kept = list(clean.documents(docs, cfg, stats))
    expected = [d for j, d in enumerate(docs) if not any((i, j) in found for i in range(j))]
    assert kept == expected and stats.removed["near_duplicate"] == len(docs) - len(kept)
    kept_ids = [docs.index(d) for d in kept]
    assert not any((i, j) in found for i, j in combinations(kept_ids, 2))


def test_streaming_and_two_phase_parallel_agree(tmp_path):
    """clean_corpus (Pool, shards on disk, np.unique per band) == documents (one pass, sets)."""
    cfg = replace(CFG, near_dedup=True, min_words=10)
    docs = planted_corpus(2, n_base=20) + [PROSE, PROSE, CODE, b"\xff bad", ""]
    stream_stats = clean.Stats()
    expected = list(clean.documents(docs, cfg, stream_stats))
    records = ((f"doc{i}", d, "auto") for i, d in enumerate(docs))
    out = tmp_path / "out.jsonl"
    stats = clean.clean_corpus(records, str(out), cfg, processes=2, workdir=str(tmp_path),
                               chunk=7, shard_docs=20)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["text"] for r in rows] == expected
    assert stats.removed == stream_stats.removed and stats.kept == len(expected)
    assert stats.chars_out == stream_stats.chars_out == sum(map(len, expected))
    assert stats.removed["near_duplicate"] > 10 and stats.removed["exact_duplicate"] == 1


def test_sharded_through_datasets():
    """The docstring's recipe: datasets' map over shards, then `duplicates` on the gathered keys,
    removes what the one-pass stream removes."""
    datasets = pytest.importorskip("datasets")
    cfg = replace(CFG, near_dedup=True)
    docs = planted_corpus(3, n_base=12) + [PROSE, b"\xff", PROSE]
    stats = clean.Stats()
    expected = list(clean.documents(docs, cfg, stats))
    ds = datasets.Dataset.from_dict({"text": [d if isinstance(d, str) else "" for d in docs]})
    ds = ds.map(clean.feature_columns, batched=True, batch_size=8, fn_kwargs=dict(cfg=cfg))
    ds = ds.filter(lambda r: r["reason"] == "")
    exact = np.array(ds["exact"], dtype=np.uint64)
    bands = np.array(ds["bands"], dtype=np.uint64)
    exact_dup, near_dup = clean.duplicates(exact, bands.T, len(ds))
    assert [t for t, d in zip(ds["clean_text"], exact_dup | near_dup) if not d] == expected
    assert (exact_dup.sum(), near_dup.sum()) == (stats.removed["exact_duplicate"], stats.removed["near_duplicate"])


def test_cli(tmp_path, capsys):
    src = tmp_path / "corpus"
    (src / "pkg").mkdir(parents=True)
    (src / "a.py").write_text(CODE)
    (src / "pkg" / "copy.py").write_text(CODE)                        # exact duplicate
    (src / "pkg" / "near.py").write_text(CODE.replace("self.n += k", "self.n += 2 * k"))
    (src / "gen.py").write_text("# Code generated by a tool. DO NOT EDIT.\n" + CODE)
    (src / "notes.md").write_text(PROSE)
    (src / "blob.txt").write_bytes(b"\x00\x01\xff" * 100)
    (src / "image.png").write_bytes(b"\x89PNG")                       # not a corpus extension
    stats = clean.main([str(src), str(tmp_path / "out"), "--dedup", "--threshold=0.7", "--processes=1"])
    rows = [json.loads(x) for x in (tmp_path / "out" / "clean.jsonl").read_text().splitlines()]
    assert [r["source"].rsplit("/", 1)[1] for r in rows] == ["a.py", "notes.md"]
    assert rows[0]["text"] == CODE and rows[1]["text"] == PROSE
    assert dict(stats.removed) == {"autogenerated": 1, "invalid_utf8": 1, "exact_duplicate": 1,
                                   "near_duplicate": 1}
    saved = json.loads((tmp_path / "out" / "stats.json").read_text())
    assert saved["docs"] == 6 and saved["kept"] == 2
    assert "near_duplicate" in capsys.readouterr().out

    jsonl = tmp_path / "in.jsonl"
    jsonl.write_text(json.dumps({"text": PROSE}) + "\nnot json\n" + json.dumps({"body": 1}) + "\n"
                     + json.dumps({"text": CODE, "kind": "code"}) + "\n")
    stats = clean.main([str(jsonl), str(tmp_path / "out2"), "--processes=1"])
    assert stats.kept == 2 and stats.removed == {"not_text": 2}


def test_cli_errors(tmp_path, capsys):
    """A mistyped or mistyped-value rule key stops with its name; --help lists every rule key (--toxicity too)."""
    with pytest.raises(SystemExit, match="unknown option '--treshold=0.5'"):
        clean.main([str(tmp_path), str(tmp_path / "o"), "--treshold=0.5"])
    with pytest.raises(SystemExit, match="--num_perm='many' must be a int"):
        clean.main([str(tmp_path), str(tmp_path / "o"), "--num_perm=many"])
    with pytest.raises(SystemExit, match="threshold=1.5 must be in"):
        clean.main([str(tmp_path), str(tmp_path / "o"), "--threshold=1.5"])
    with pytest.raises(SystemExit, match="does not exist"):
        clean.main([str(tmp_path / "missing"), str(tmp_path / "o")])
    with pytest.raises(SystemExit):  # --help lists the rules' settings, every CleanConfig field
        clean.main(["--help"])
    shown = capsys.readouterr().out
    assert all(f"--{f.name}=" in shown for f in fields(clean.CleanConfig) if f.name != "near_dedup"), shown
    assert "--toxicity=''" in shown
