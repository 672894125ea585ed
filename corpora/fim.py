"""Fill-in-the-Middle (Bavarian et al. 2022, "Efficient Training of Language Models to Fill in the
Middle"): a per-document transform of the pretraining data, and the matching infilling prompt.

    t = fim.Transform(tok, rate, spm_rate, seed, fragment)  # prepare.prepare, from fim_rate, fim_spm_rate, ...
    mode, parts = t.apply(text, index)     # parts: str (each encoded on its own) and sentinel ids
    ids = fim.prompt(tok, prefix, suffix)  # sample.py: then generate the middle until EOS

A document chosen for FIM (probability `rate`) is cut at two character positions into prefix |
middle | suffix (cut) and laid out (layout) as

    PSM:  <PRE> prefix <SUF> suffix <MID> middle <EOS>
    SPM:  <PRE> <SUF> suffix <MID> prefix middle <EOS>      (probability `spm_rate` of FIM documents)

Which SPM this is and why: layout; why long documents are cut into fragments first: fragments;
which sentinels: sentinels.

Invariants: every token is trained on, sentinels included (the data path has no loss mask); the
infilling prompt is exactly the context a training middle has; the fragments' prefix + middle +
suffix concatenate back to the text; deterministic per (seed, document index): the draws come from
BLAKE2b(seed, index[, fragment]) (draws), so any one document's transform is known without the
others, on any machine, numpy version or process count.
"""
import hashlib

import numpy as np

import tokenizer
from config import DataError


def draws(seed, index, fragment=0):
    """Four uniforms in [0, 1) for document `index` (its fragment `fragment`): FIM?, SPM?, and the two
    cut points. Fragment 0 is keyed as a whole document always was; only its first two draws decide
    the document's FIM and SPM."""
    key = f"fim:{seed}:{index}" + (f":{fragment}" if fragment else "")
    digest = hashlib.blake2b(key.encode(), digest_size=32).digest()
    return np.frombuffer(digest, dtype="<u8") / 2.0 ** 64


def fragments(text, size):
    """text cut into consecutive pieces of at most `size` characters, each ending at a line end where
    one lies in its last half (else cut at `size`); [text] when size is 0 or the text fits.

    Why (fim_fragment > 0): each fragment gets its own cuts and layout, the fragments separated by
    EOS, as if each were a document. Without them a document much longer than the training window
    is laid out across several windows: a window holding <MID> and the start of a PSM middle rarely
    also holds the end of the prefix or the start of the suffix, so the tokens that make infilling
    learnable are seldom seen together, while SPM's <MID> is always followed by the start of a file
    (BENCHMARKS.md: a model that writes a file header after <MID>). Megatron-LM's FIM dataset
    (bigcode's, which trained SantaCoder/StarCoder) avoids it by applying FIM to each document piece
    of an already-cut context; fragments give the same short, complete FIM sequences before the
    documents are packed. FIM and PSM/SPM are decided per document, the cuts per fragment."""
    if not size or len(text) <= size:
        return [text]
    out, start = [], 0
    while len(text) - start > size:
        end = text.rfind("\n", start + size // 2, start + size) + 1 or start + size
        out.append(text[start:end])
        start = end
    return out + [text[start:]]


def cut(text, u_a, u_b):
    """(prefix, middle, suffix) of text at two character positions uniform over 0..len(text)
    (sorted; they may coincide). Each part is encoded on its own: a cut may fall inside what would
    have been one token."""
    a, b = sorted(int(u * (len(text) + 1)) for u in (u_a, u_b))
    return text[:a], text[a:b], text[b:]


def plan(text, index, rate, spm_rate, seed=0, fragment=0):
    """None (the document stays plain) or (mode, [(prefix, middle, suffix) per fragment]) with mode
    "psm" or "spm" for the whole document and the fragments' prefix + middle + suffix, concatenated
    in order, == text. fragment: at most that many characters per fragment (0: the whole document)."""
    u_fim, u_spm, u_a, u_b = draws(seed, index)
    if u_fim >= rate:
        return None
    pieces = fragments(text, fragment)
    cuts = [cut(piece, *(draws(seed, index, k)[2:] if k else (u_a, u_b))) for k, piece in enumerate(pieces)]
    return ("spm" if u_spm < spm_rate else "psm"), cuts


def layout(mode, prefix, middle, suffix, ids):
    """One fragment's training sequence before its EOS, as a list of text parts (str, encoded each on
    its own) and sentinel ids (int); ids = tokenizer.fim_sentinels(tok).
    SPM is the paper's appendix variant, the one SantaCoder/StarCoder train on ("SPM variant 2"):
    after <MID> the prefix and the middle follow each other, so the middle continues the prefix
    exactly as in ordinary left-to-right text (the paper's main-text SPM, <SUF> suffix <PRE> prefix
    <MID> middle, is not implemented). The EOS after the middle teaches the model to stop when the
    middle is done: infilling generates after <MID> until EOS."""
    pre, mid, suf = ids
    if mode == "spm":
        return [pre, suf, suffix, mid, prefix, middle]
    return [pre, prefix, suf, suffix, mid, middle]


def prompt(tok, prefix, suffix, max_len=0, spm=False):
    """Token ids of an infilling prompt, exactly the context a training middle has (every FIM sequence
    follows an EOS): PSM  EOS <PRE> prefix <SUF> suffix <MID>,  or with spm=True  EOS <PRE> <SUF>
    suffix <MID> prefix (a model trained on both can be asked either way); the model then writes
    the middle and EOS. max_len > 0: at most that many ids, by dropping prefix ids from the left
    and suffix ids from the right (each keeps at least half of what is left for both), never a
    sentinel."""
    pre, mid, suf = tokenizer.fim_sentinels(tok)
    p, s = tok.encode(prefix), tok.encode(suffix)
    room = max_len - 4 if max_len else len(p) + len(s)
    if room < 0:
        raise DataError(f"an infilling prompt needs 4 tokens (EOS and 3 sentinels); max_len={max_len}")
    keep_s = min(len(s), max(room // 2, room - len(p)))
    p, s = p[len(p) - min(len(p), room - keep_s):], s[:keep_s]
    return [tok.eos_id, pre, suf, *s, mid, *p] if spm else [tok.eos_id, pre, *p, suf, *s, mid]


MODES = ("plain", "psm", "spm")


class Transform:
    """The document transform prepare() applies: apply(text, index) -> (mode, parts), mode an index
    into MODES, parts a list of str (text) and int (token id) parts, [text] when plain. A fragmented
    document's fragments follow each other with an EOS between them (prepare adds the last EOS)."""

    def __init__(self, tok, rate, spm_rate, seed=0, fragment=0):
        if not (0 <= rate <= 1 and 0 <= spm_rate <= 1):
            raise DataError(f"fim_rate={rate} and fim_spm_rate={spm_rate} must be in [0, 1]")
        if not (isinstance(fragment, int) and fragment >= 0):
            raise DataError(f"fim_fragment={fragment} must be an integer >= 0 (characters; 0: whole documents)")
        self.ids, self.eos = tokenizer.fim_sentinels(tok), tok.eos_id
        self.rate, self.spm_rate, self.seed, self.fragment = rate, spm_rate, seed, fragment

    def apply(self, text, index):
        p = plan(text, index, self.rate, self.spm_rate, self.seed, self.fragment)
        if p is None:
            return 0, [text]
        mode, cuts = p
        parts = []
        for k, (prefix, middle, suffix) in enumerate(cuts):
            parts += ([self.eos] if k else []) + layout(mode, prefix, middle, suffix, self.ids)
        return MODES.index(mode), parts


if __name__ == "__main__":  # a library module, not a script: running it (--help or not) says what it holds
    print(__doc__)
