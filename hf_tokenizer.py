"""Hugging Face tokenizers read through tiktoken, and tokenizers written as HF files (hf.py's half for text).

    tok = hf_tokenizer.load_hf_tokenizer("models/Llama-3.2-1B")   # data.Tokenizer's interface, tiktoken inside
    hf_tokenizer.save_tokenizer(tok, "out/hf")                     # what hf.export_hf writes next to the weights

Formats read: byte-level BPE from vocab.json + merges.txt (GPT-2), a tokenizer.json with a BPE
model and a ByteLevel pre-tokenizer (Llama-3, Qwen2, GPT-2), or a tiktoken rank file
(Llama-3's tokenizer.model). tiktoken merges the adjacent pair whose concatenation has the lowest
rank, HF the pair earliest in `merges`; using token ids as ranks gives the same result when ids
grow with merge order (true of these vocabularies, checked on load; otherwise ids are mapped).
SentencePiece, WordPiece and Unigram tokenizers are refused with the format named.

Why a file of its own: hf.py (configs and weights) and this (text) share nothing but the folder
they read, and together they were past a concept file's line budget.
"""
import base64
import hashlib
import json
import os
import re
import shutil
import unicodedata

import tiktoken

import config

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
    """data.Tokenizer's interface (name, n_vocab, eos_id, encode, encode_batch, decode) over a
    tiktoken Encoding built from HF tokenizer files, plus special_tokens (text -> id), bos_id,
    chat_template and files (the source files, copied by export_hf). encode() reads special-token
    text as plain text, as data.Tokenizer does; encode(text, special=True) turns it into the special
    ids, as HF tokenizers do (what a rendered chat template needs). The chat names are data.Tokenizer's:
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
    (data.Tokenizer) is written as a byte-level BPE tokenizer.json (merges recovered from the ranks as
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
