"""toxicity.py and its place in clean.py: word-list scores equal the shares counted by hand (phrases,
case, whole words only); on a constructed corpus of 12 documents that pass every quality rule,
threshold 0 drops exactly the 5 holding a listed word, a threshold of 0.02 only the 2 above it
(counted in the cleaning report under "toxicity"), and toxicity_keep=0.5 keeps the flagged documents
whose text hash falls below 0.5 (counted as flagged); the streaming and the parallel cleaning paths
agree; the default list flags what better-profanity's own checker flags on plain sentences; a user
function and a Hugging Face classifier folder plug in (the classifier's score equals transformers'
text-classification pipeline); bad specs are refused with a message; through prepare.prepare
(pretraining's clean=True, toxicity=...) train.bin holds exactly the kept documents' tokens, meta.json
the removed and flagged counts and the settings, and the prepared folder is named -tox, apart per setting."""
import hashlib
import json
import random
from dataclasses import replace

import numpy as np
import pytest
from test_clean import sentences

import tokenizer
from corpora import clean, corpus, prepare, toxicity

LIST = "# a list of our own\ndarn\nheck\ngosh darn\nblast it\n"


@pytest.fixture
def wordlist(tmp_path):
    path = tmp_path / "list.txt"
    path.write_text(LIST)
    return f"wordlist:{path}"


@pytest.mark.parametrize("text, share", [
    ("Darn it, the heck!", 2 / 4),          # darn, it, the, heck: two listed
    ("Gosh darn you", 2 / 3),               # the phrase covers gosh + darn (darn counted once)
    ("blast it all", 2 / 3),                # a two-word phrase
    ("blast-it is one word", 0.0),          # 'blast-it' is one word, not the phrase
    ("darned heckling", 0.0),               # whole words only
    ("DARN", 1.0),
    ("A clean sentence with nothing in it.", 0.0),
    ("", 0.0),
])
def test_wordlist_scores_by_hand(wordlist, text, share):
    assert toxicity.scorer(wordlist)(text) == pytest.approx(share)


def corpus_docs():
    """12 prose documents (72 words each) that pass every quality rule; 5 get listed words:
    docs 1, 4, 7 one 'darn' each (1/72 of their words), docs 9 and 11 three words (3/72 > 0.02)."""
    docs = [" ".join(sentences(6, seed=i)) for i in range(12)]
    for i, n in ((1, 1), (4, 1), (7, 1), (9, 3), (11, 3)):
        ws = docs[i].split(" ")
        for j in range(n):
            ws[10 + 12 * j] = "heck" if j % 2 else "darn"
        docs[i] = " ".join(ws)
    return docs


def test_filter_counts_in_the_cleaning_report(wordlist):
    docs = corpus_docs()
    cfg = clean.CleanConfig(exact_dedup=False)
    assert len(list(clean.documents(docs, cfg))) == 12  # all pass the quality rules
    stats = clean.Stats()
    kept = list(clean.documents(docs, replace(cfg, toxicity=wordlist), stats))
    assert kept == [d for i, d in enumerate(docs) if i not in (1, 4, 7, 9, 11)]
    assert stats.removed == {"toxicity": 5} and stats.kept == 7 and "removed        5 toxicity" in stats.report()
    stats = clean.Stats()
    kept = list(clean.documents(docs, replace(cfg, toxicity=wordlist, toxicity_threshold=0.02), stats))
    assert len(kept) == 10 and stats.removed == {"toxicity": 2} and docs[9] not in kept and docs[1] in kept
    # down-weighting: a flagged document stays when BLAKE2b(text) / 2^64 < 0.5
    share = {i: int.from_bytes(hashlib.blake2b(docs[i].encode(), digest_size=8, person=b"ingottox").digest(),
                               "little") / 2 ** 64 for i in (1, 4, 7, 9, 11)}
    stays = [i for i, s in share.items() if s < 0.5]
    assert 0 < len(stays) < 5  # this corpus exercises both outcomes
    stats = clean.Stats()
    down = replace(cfg, toxicity=wordlist, toxicity_keep=0.5)
    kept = list(clean.documents(docs, down, stats))
    assert kept == [d for i, d in enumerate(docs) if i not in share or i in stays]
    assert stats.flagged == {"toxicity": len(stays)} and stats.removed == {"toxicity": 5 - len(stays)}
    assert f"flagged {len(stays):>8} toxicity" in stats.report()
    f = clean.features(docs, down)  # the parallel path's worker: the same decisions and counts
    assert [t is not None for t in f["text"]] == [d in kept for d in docs]
    assert f["stats"].flagged == stats.flagged and f["stats"].removed == stats.removed


def test_through_data_prepare(wordlist, tmp_path):
    docs = corpus_docs()
    src = tmp_path / "c.jsonl"
    src.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    tok = tokenizer.get_tokenizer("cl100k_base", 4096)
    kw = dict(val_fraction=0.0, val_tokens=0, clean=True, toxicity=wordlist, verbose=False)
    meta = prepare.prepare(str(src), tok, str(tmp_path / "drop"), **kw)
    kept = [d for i, d in enumerate(docs) if i not in (1, 4, 7, 9, 11)]
    ref = [t for d in kept for t in tok.encode(d) + [tok.eos_id]]
    assert np.fromfile(tmp_path / "drop" / "train.bin", meta["dtype"]).tolist() == ref
    assert meta["cleaned"]["removed"] == {"toxicity": 5} and meta["cleaned"]["flagged"] == {}
    assert (meta["n_docs"], meta["toxicity"], meta["toxicity_threshold"], meta["toxicity_keep"]) == (7, wordlist, 0.0, 0.0)
    stays = [i for i in (1, 4, 7, 9, 11) if int.from_bytes(hashlib.blake2b(docs[i].encode(), digest_size=8,
                                                                           person=b"ingottox").digest(), "little") < 2 ** 63]
    meta = prepare.prepare(str(src), tok, str(tmp_path / "keep"), **kw, toxicity_keep=0.5)
    assert meta["cleaned"]["flagged"] == {"toxicity": len(stays)} and meta["n_docs"] == 7 + len(stays)
    folder = lambda **k: prepare.default_data_dir(str(src), tok.name, 4096, clean=True, **k)  # noqa: E731
    names = {folder(), folder(toxicity=wordlist), folder(toxicity=wordlist, toxicity_keep=0.5),
             folder(toxicity=wordlist, toxicity_threshold=0.02)}
    assert len(names) == 4 and "-clean-tox-" in folder(toxicity=wordlist) and "-tox" not in folder()


def test_default_list_agrees_with_better_profanity():
    bp = pytest.importorskip("better_profanity")
    path = toxicity.default_wordlist()
    entries = [e for e in open(path).read().splitlines() if e.isalpha()]
    rng = random.Random(0)
    checker = bp.Profanity()
    score = toxicity.scorer("wordlist")
    for i, s in enumerate(sentences(40, seed=3)):
        text = s.replace("The", f"The {rng.choice(entries)}") if i % 2 else s
        assert (score(text) > 0) == checker.contains_profanity(text) == bool(i % 2), text


def user_score(text):
    return text.count("!") / max(len(text), 1)


def test_user_function_and_errors(tmp_path):
    assert toxicity.scorer("test_toxicity:user_score")("a!!b") == 0.5
    f = toxicity.Filter("test_toxicity:user_score", threshold=0.1)
    assert f.check("calm.") is None and f.check("!!!") == "toxicity"
    for spec, msg in [("nonsense", "use 'wordlist'"), ("no_such_module:f", "cannot import"),
                      (f"wordlist:{tmp_path}/missing.txt", "missing.txt")]:
        with pytest.raises(corpus.DataError, match=msg):
            toxicity.scorer(spec)
    with pytest.raises(corpus.DataError, match="toxicity_keep"):
        toxicity.Filter("test_toxicity:user_score", keep=1.0)


def test_hf_classifier_folder(tmp_path):
    transformers = pytest.importorskip("transformers")
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {w: i for i, w in enumerate(["[UNK]", "[PAD]", "[CLS]", "[SEP]"] + "you are a kind horrible person".split())}
    tk = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tk.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="[UNK]", pad_token="[PAD]",
                                                model_max_length=32)
    fast.save_pretrained(tmp_path)
    cfg = transformers.BertConfig(vocab_size=len(vocab), hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                  intermediate_size=32, max_position_embeddings=32,
                                  id2label={0: "toxic", 1: "non-toxic"}, label2id={"toxic": 0, "non-toxic": 1})
    transformers.set_seed(0)  # the same weights in any test order: their toxic score is not 0.5 by chance
    transformers.BertForSequenceClassification(cfg).save_pretrained(tmp_path)
    pipe = transformers.pipeline("text-classification", model=str(tmp_path), top_k=None)
    score = toxicity.scorer(str(tmp_path))
    for text in ("you are a kind person", "you are horrible", "person"):
        ref = {d["label"]: d["score"] for d in pipe([text])[0]}["toxic"]
        assert score(text) == pytest.approx(ref, abs=1e-6) and abs(ref - 0.5) > 1e-4  # the other label would fail
