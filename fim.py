"""Fill-in-the-Middle (Bavarian et al. 2022, "Efficient Training of Language Models to Fill in the
Middle"): a per-document transform of the pretraining data, and the matching infilling prompt.

A document chosen for FIM (probability `rate`) is cut at two character positions drawn uniformly
from 0..len(text) (sorted; they may coincide), into prefix | middle | suffix. Each part is encoded
on its own (a cut may fall inside what would have been one token) and the parts are laid out as

    PSM:  <PRE> prefix <SUF> suffix <MID> middle <EOS>
    SPM:  <PRE> <SUF> suffix <MID> prefix middle <EOS>      (probability `spm_rate` of FIM documents)

SPM is the paper's appendix variant, the one SantaCoder/StarCoder train on ("SPM variant 2"):
after <MID> the prefix and the middle follow each other, so the middle continues the prefix exactly
as in ordinary left-to-right text (the paper's main-text SPM, <SUF> suffix <PRE> prefix <MID>
middle, is not implemented). Every token is trained on, sentinels included (the data path has no
loss mask); the document's EOS comes after the middle, which teaches the model to stop when the
middle is done: infilling generates after <MID> until EOS. Other documents stay plain text.

Deterministic per (seed, document index): the draws come from BLAKE2b(seed, index), so any one
document's transform is known without the others, on any machine, numpy version or process count.
The sentinels are the tokenizer's own: <|fim_prefix|>, <|fim_middle|>, <|fim_suffix|> (tiktoken's
cl100k_base, Qwen2.5-Coder) or <fim_prefix>, <fim_middle>, <fim_suffix> (SantaCoder/StarCoder); a
tokenizer without them (o200k_base) is refused. data.py applies this at tokenization (prepare).
"""
import hashlib

import numpy as np

from corpus import DataError

SENTINEL_NAMES = (("<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>"),
                  ("<fim_prefix>", "<fim_middle>", "<fim_suffix>"))


def sentinels(tok):
    """(prefix_id, middle_id, suffix_id) of a tokenizer with `special_tokens` (text -> id), all below
    its n_vocab; DataError naming the tokenizer when it has none."""
    special = getattr(tok, "special_tokens", {}) or {}
    for names in SENTINEL_NAMES:
        if all(n in special for n in names):
            ids = tuple(special[n] for n in names)
            if max(ids) >= tok.n_vocab:
                raise DataError(f"tokenizer {tok.name}: FIM sentinels {ids} do not fit its n_vocab={tok.n_vocab}")
            return ids
    raise DataError(f"tokenizer {tok.name} has no fill-in-the-middle sentinels ({', '.join(SENTINEL_NAMES[0])}): "
                    "set fim_rate=0, or use a tokenizer that defines them (cl100k_base does, o200k_base does not)")


def draws(seed, index):
    """Four uniforms in [0, 1) for document `index`: FIM?, SPM?, and the two cut points."""
    digest = hashlib.blake2b(f"fim:{seed}:{index}".encode(), digest_size=32).digest()
    return np.frombuffer(digest, dtype="<u8") / 2.0 ** 64


def plan(text, index, rate, spm_rate, seed=0):
    """None (the document stays plain) or (mode, prefix, middle, suffix) with mode "psm" or "spm"
    and prefix + middle + suffix == text."""
    u_fim, u_spm, u_a, u_b = draws(seed, index)
    if u_fim >= rate:
        return None
    a, b = sorted(int(u * (len(text) + 1)) for u in (u_a, u_b))  # uniform over 0..len(text)
    return ("spm" if u_spm < spm_rate else "psm"), text[:a], text[a:b], text[b:]


def layout(mode, prefix, middle, suffix, ids):
    """The training sequence before its EOS, as a list of text parts (str, encoded each on its own)
    and sentinel ids (int); ids = sentinels(tok)."""
    pre, mid, suf = ids
    if mode == "spm":
        return [pre, suf, suffix, mid, prefix, middle]
    return [pre, prefix, suf, suffix, mid, middle]


def prompt(tok, prefix, suffix):
    """Token ids of a PSM infilling prompt: <PRE> prefix <SUF> suffix <MID>; the model then writes
    the middle and EOS."""
    pre, mid, suf = sentinels(tok)
    return [pre, *tok.encode(prefix), suf, *tok.encode(suffix), mid]


MODES = ("plain", "psm", "spm")


class Transform:
    """The document transform prepare() applies: apply(text, index) -> (mode, parts), mode an index
    into MODES, parts a list of str (text) and int (sentinel id) parts, [text] when plain."""

    def __init__(self, tok, rate, spm_rate, seed=0):
        if not (0 <= rate <= 1 and 0 <= spm_rate <= 1):
            raise DataError(f"fim_rate={rate} and fim_spm_rate={spm_rate} must be in [0, 1]")
        self.ids = sentinels(tok)
        self.rate, self.spm_rate, self.seed = rate, spm_rate, seed

    def apply(self, text, index):
        p = plan(text, index, self.rate, self.spm_rate, self.seed)
        return (0, [text]) if p is None else (MODES.index(p[0]), layout(*p, self.ids))
