"""Toxicity: a score per document, and the filter that drops or down-weights documents above a threshold.

    score = toxicity.scorer("wordlist")       # text -> float in [0, 1]
    f = toxicity.Filter("wordlist", threshold=0.0, keep=0.0)
    f.check(text, stats)   # None (keep) or "toxicity" (drop); kept-but-flagged counted in stats.flagged

clean.py runs the filter after the quality rules when CleanConfig.toxicity is set, so its counts
are in the cleaning report (Stats.removed["toxicity"], Stats.flagged["toxicity"]).

Scorers (`scorer(spec)`):
- "wordlist": the share of a document's words covered by listed words or phrases. The list is
  better-profanity's profanity_wordlist.txt (MIT licence; 916 English words and phrases of up to
  4 words), read as data from the installed package (pip install better-profanity), its code
  unused. "wordlist:/path/list.txt": your own list, one word or phrase per line. Words: runs of
  letters, digits, ' - _ (lower-cased, outer ' - _ stripped); a phrase matches consecutive words.
  threshold=0 is C4's rule (Raffel et al. 2020, sec. 2.2: a page holding any listed word is dropped).
- "module:function": your callable text -> score, imported.
- a folder: a Hugging Face sequence-classification model (transformers); the score is the
  softmax probability of its label whose name contains "toxic" (not "non"), else of label 1;
  the text is cut to the model's maximum length.
Down-weighting: keep > 0 keeps that share of the documents above the threshold, chosen by a hash of
their text (the same documents on every run), instead of dropping them all.
"""
import functools
import hashlib
import importlib
import importlib.util
import os
import re

from corpora import corpus

WORD = re.compile(r"[\w'\-]+")
STRIP = "'-_"


def words(text):
    """Lower-cased words: runs of letters, digits and ' - _, those outer characters stripped."""
    return [w for w in (m.strip(STRIP) for m in WORD.findall(text.lower())) if w]


def default_wordlist():
    """The path of better-profanity's word list (the data file inside the installed package)."""
    spec = importlib.util.find_spec("better_profanity")
    if spec is None or not spec.submodule_search_locations:
        raise corpus.DataError("toxicity='wordlist' reads the word list of the better-profanity package: "
                               "pip install better-profanity (or give toxicity='wordlist:/path/list.txt')")
    return os.path.join(list(spec.submodule_search_locations)[0], "profanity_wordlist.txt")


class WordList:
    """Score: the share of words covered by a listed word or phrase (overlapping matches counted once)."""

    def __init__(self, entries):
        self.phrases = {tuple(words(e)) for e in entries if words(e)}
        self.longest = max(map(len, self.phrases), default=0)

    @classmethod
    def from_file(cls, path):
        try:
            with open(path, encoding="utf-8") as f:
                return cls(line for line in f.read().splitlines() if line.strip() and not line.startswith("#"))
        except OSError as e:
            raise corpus.DataError(f"toxicity word list {path!r}: {e.strerror}") from None

    def matches(self, text):
        """(words of the text, positions covered by a listed phrase)."""
        ws, covered = words(text), set()
        for n in range(1, self.longest + 1):
            for i in range(len(ws) - n + 1):
                if tuple(ws[i:i + n]) in self.phrases:
                    covered.update(range(i, i + n))
        return ws, covered

    def __call__(self, text):
        ws, covered = self.matches(text)
        return len(covered) / len(ws) if ws else 0.0


class Classifier:
    """A Hugging Face sequence-classification folder: the probability of its toxic label."""

    def __init__(self, folder):
        import torch
        import transformers
        self.torch = torch
        self.tok = transformers.AutoTokenizer.from_pretrained(folder)
        self.model = transformers.AutoModelForSequenceClassification.from_pretrained(folder).eval()
        labels = {i: str(n).lower() for i, n in self.model.config.id2label.items()}
        toxic = [i for i, n in labels.items() if "toxic" in n and "non" not in n]
        self.label = toxic[0] if toxic else 1
        if self.label >= len(labels):
            raise corpus.DataError(f"toxicity classifier {folder!r} has {len(labels)} label(s): it needs a 'toxic' "
                                   "label or at least 2")

    def __call__(self, text):
        with self.torch.no_grad():
            enc = self.tok(text, truncation=True, return_tensors="pt")
            return float(self.model(**enc).logits.float().softmax(-1)[0, self.label])


@functools.lru_cache(maxsize=8)  # one scorer per spec and process: a list or a model is read once
def scorer(spec):
    """The scorer a spec names (module docstring): a callable text -> float."""
    if spec == "wordlist":
        return WordList.from_file(default_wordlist())
    if spec.startswith("wordlist:"):
        return WordList.from_file(spec[len("wordlist:"):])
    if os.path.isdir(spec):
        return Classifier(spec)
    module, _, name = spec.partition(":")
    if name:
        try:
            fn = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError) as e:
            raise corpus.DataError(f"toxicity={spec!r}: cannot import {name} from {module} ({e})") from None
        return fn
    raise corpus.DataError(f"toxicity={spec!r}: use 'wordlist', 'wordlist:/path/list.txt', 'module:function' "
                           "or a Hugging Face classifier folder")


def kept_share(text):
    """A document's place in [0, 1) for down-weighting: BLAKE2b of its text as a fraction of 2^64."""
    h = hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8, person=b"ingottox").digest()
    return int.from_bytes(h, "little") / 2.0 ** 64


class Filter:
    """Drop documents scoring above threshold; keep > 0 keeps that share of them (down-weighting)."""

    def __init__(self, spec, threshold=0.0, keep=0.0):
        if not 0 <= keep < 1:
            raise corpus.DataError(f"toxicity_keep={keep} must be in [0, 1) (the share of flagged documents kept)")
        self.score, self.threshold, self.keep = scorer(spec), threshold, keep

    def check(self, text, stats=None):
        """None to keep the text, "toxicity" to drop it; a flagged text kept is counted in stats.flagged."""
        if self.score(text) <= self.threshold:
            return None
        if self.keep and kept_share(text) < self.keep:
            if stats is not None:
                stats.flagged["toxicity"] += 1
            return None
        return "toxicity"
