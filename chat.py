"""Chat data: records in the standard formats -> messages -> a chat template's text -> token ids and
a loss mask -> packed rows -> (x, y, pos, attn_mask) batches. SFT, DPO, GRPO, evaluation and chat
sampling share it.

    read_conversations / read_pairs / read_prompts(source)   Alpaca, ShareGPT, OpenAI messages,
        prompt/completion (auto-detected from the first record); .json / .jsonl / .parquet files or
        folders of them, or hf:<name>[:<config>][@<split>] through `datasets` (corpus.py's readers)
    ChatTemplate / default_template / template_for    jinja2, rendered the way transformers renders
    encode(tok, template, messages) -> (ids, mask)
    pack(examples, T) -> rows;  batch(rows) -> (x, y, pos, attn_mask);  ChatLoader(rows, B, ...)
    setup(cfg) -> (tok, template);  CHAT_DEFAULTS: the chat config keys (a stage takes those it reads)

A message is {"role": "system" | "user" | "assistant", "content": str}. The rules, in order, each
in the docstring of the code that applies it: rendering (compile_template), special tokens
(ChatTemplate), loss spans (ChatTemplate.parts), the loss mask (encode), packing (pack, batch).

Invariants: the text, its special-token ids and the trained tokens are what transformers'
apply_chat_template (and TRL's assistant_only_loss) give; special tokens become single ids only
where the TEMPLATE wrote them (a user typing '<|im_start|>' gets the ids of those characters, never
the control token); a BPE merge across a prompt/answer border moves nothing; examples are packed
whole, never cut, and neither attention nor targets cross examples.
"""
import bisect
import collections
import datetime
import json
import os
import pathlib
import re
import unicodedata
from dataclasses import dataclass

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes
import numpy as np
import torch
from jinja2.sandbox import ImmutableSandboxedEnvironment

import data
import tokenizer
from corpora import corpus
from model import IGNORE

FORMATS = ("alpaca", "sharegpt", "messages", "prompt_completion")
FORMAT_KEYS = (("messages", {"messages"}), ("sharegpt", {"conversations"}), ("alpaca", {"instruction", "output"}),
               ("prompt_completion", {"prompt", "completion"}))
ROLES = {"system": "system", "user": "user", "human": "user", "assistant": "assistant", "gpt": "assistant"}
SUFFIXES = (".json", ".jsonl", ".parquet")
EOT_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>")  # end-of-turn tokens known by name
PROTECT, UNPROTECT, GEN, END_GEN = "\ue000", "\ue001", "\ue002", "\ue003"  # private-use markers
MARKERS = PROTECT + UNPROTECT + GEN + END_GEN
MARKER_RE = re.compile(f"[{MARKERS}]")

# the chat data's config keys: sft.py reads them all, dpo.py and grpo.py some (their EXTRA)
CHAT_DEFAULTS = dict(
    chat_data="",            # a .json/.jsonl/.parquet file or folder, or hf:<name>[:<config>][@<split>]
                             # ("": the stage's offline default)
    chat_format="auto",      # auto (from the first record) | alpaca | sharegpt | messages | prompt_completion
    chat_template="",        # "": init_from's own (an HF folder's chat_template), else ours (ChatML) |
                             # "default" (ours) | a .jinja file
    skip_bad_records=False,  # skip malformed records (counted per reason) instead of stopping at the first
    chat_limit=0,            # read the first N good records (0: all)
    pack=True,               # several whole conversations per row (block-diagonal attention); False: one per row
                             # (padded, plain causal attention: long rows; one longer than a row is dropped, counted)
)


class ChatDataError(corpus.DataError):
    """Chat data or a chat template the user gave cannot work: the message says where and what to change."""


class BadRecord(ValueError):
    """One malformed record: kind (the Counter key when skipped) and what is wrong."""

    def __init__(self, kind, message):
        super().__init__(message)
        self.kind = kind


def _bad(ok, kind, message):
    if not ok:
        raise BadRecord(kind, message)


# -----------------------------------------------------------------------------
# Records -> messages

def _files(path):
    if os.path.isfile(path):
        if not path.endswith(SUFFIXES):
            raise ChatDataError(f"chat data {path!r}: unsupported file type (accepted: {' '.join(SUFFIXES)})")
        return [path]
    files = sorted(str(p) for p in pathlib.Path(path).rglob("*") if p.name.endswith(SUFFIXES) and p.is_file()
                   and not any(part.startswith(".") for part in p.relative_to(path).parts))  # hidden: not data
    if not files:
        raise ChatDataError(f"chat data folder {path!r} holds no {'/'.join(SUFFIXES)} file")
    return files


def iter_records(source, bad=None):
    """(where, record) of every record of a source, where = "file:line" (.jsonl), "file[index]"
    (.json: a list of records), "file row i" (.parquet) or "hf:... row i". bad: a Counter: .jsonl
    lines that are not JSON are counted and skipped instead of raising."""
    try:
        yield from _records(source, bad)
    except corpus.DataError as e:  # corpus.py's readers: the same message, as this module's error
        if isinstance(e, ChatDataError):
            raise
        raise ChatDataError(str(e)) from None


def _records(source, bad):
    if source.startswith("hf:"):
        name, config, split = corpus.parse_hf(source)
        for i, row in enumerate(corpus.dataset_rows(name, config, split)):
            yield f"{source} row {i}", row
        return
    if not os.path.exists(source):
        raise ChatDataError(f"chat data {source!r} not found: give a .json/.jsonl/.parquet file, a folder of them, "
                            "or hf:<name>[:<config>][@<split>]")
    for path in _files(source):
        if path.endswith(".jsonl"):
            for lineno, row in corpus.jsonl_rows(path, bad=bad):
                yield f"{path}:{lineno}", row
        elif path.endswith(".json"):
            rows = corpus.json_records(path, "chat data")
            for i, row in enumerate(rows):
                yield f"{path}[{i}]", row
        else:
            for i, row in enumerate(corpus.dataset_rows("parquet", where=path, data_files=path)):
                yield f"{path} row {i}", row


def detect_format(record):
    """The format of a record, from its fields (FORMAT_KEYS)."""
    _bad(isinstance(record, dict), "not_object", f"a JSON {type(record).__name__}, not an object")
    for fmt, keys in FORMAT_KEYS:
        if keys <= set(record):
            return fmt
    raise BadRecord("unknown_format", f"fields {sorted(record)} match no chat format (messages: 'messages'; "
                    "sharegpt: 'conversations'; alpaca: 'instruction' + 'output'; prompt_completion: 'prompt' + "
                    "'completion'): rename them, or set chat_format")


def _text(record, key, optional=False):
    value = record.get(key)
    if value is None:
        _bad(optional, "missing_field", f"no field {key!r} (fields: {sorted(record)})")
        return ""
    _bad(isinstance(value, str), "not_text", f"field {key!r} holds a {type(value).__name__}, not text")
    return value


def _messages(items, what):
    _bad(isinstance(items, list), "not_messages", f"{what} is a {type(items).__name__}, not a list of messages")
    _bad(len(items) > 0, "empty", f"{what} is empty")
    out = []
    for i, m in enumerate(items, 1):
        _bad(isinstance(m, dict), "not_messages", f"{what} message {i} is a {type(m).__name__}, not an object")
        role_key, content_key = ("from", "value") if m.get("role") is None and m.get("content") is None \
            else ("role", "content")  # (a parquet column of both shapes holds nulls for the other's keys)
        role, content = m.get(role_key), m.get(content_key)
        _bad(role in ROLES, "unknown_role", f"{what} message {i}: unknown role {role!r} "
             f"(known: {', '.join(ROLES)}; a message is {{'role': ..., 'content': ...}} or {{'from': ..., 'value': ...}})")
        _bad(isinstance(content, str), "not_text",
             f"{what} message {i}: content is {'missing' if content is None else 'a ' + type(content).__name__}, "
             "not text")
        out.append({"role": ROLES[role], "content": content})
    return out


def _side(record, key, role):
    # a prompt / completion / chosen / rejected field: text (one message of `role`) or a message list
    value = record.get(key)
    _bad(value is not None, "missing_field", f"no field {key!r} (fields: {sorted(record)})")
    return [{"role": role, "content": value}] if isinstance(value, str) else _messages(value, key)


def to_messages(record, fmt):
    """One record of format fmt (FORMATS) -> its conversation (a list of messages). Raises BadRecord
    (a ValueError) saying what is wrong: a missing field, an unknown role, content that is not text,
    no assistant turn, an empty answer."""
    _bad(isinstance(record, dict), "not_object", f"a JSON {type(record).__name__}, not an object")
    if fmt == "alpaca":  # Stanford Alpaca's fields; the input, when there is one, follows the instruction
        instruction, extra, system = _text(record, "instruction"), _text(record, "input", True), \
            _text(record, "system", True)
        messages = [{"role": "system", "content": system}] * bool(system) + [
            {"role": "user", "content": instruction + ("\n\n" + extra if extra else "")},
            {"role": "assistant", "content": _text(record, "output")}]
    elif fmt in ("sharegpt", "messages"):
        key = "conversations" if fmt == "sharegpt" else "messages"
        _bad(key in record, "missing_field", f"no field {key!r} (fields: {sorted(record)})")
        messages = _messages(record[key], key)
    elif fmt == "prompt_completion":
        completion = _side(record, "completion", "assistant")
        _bad(completion[0]["role"] == "assistant", "not_assistant", "the completion does not start with an "
             f"assistant message (it starts with a {completion[0]['role']} message)")
        messages = _side(record, "prompt", "user") + completion
    else:
        raise ValueError(f"unknown chat format {fmt!r} (one of {', '.join(FORMATS)})")
    answers = [m for m in messages if m["role"] == "assistant"]
    _bad(answers, "no_assistant", "no assistant turn: nothing to train on")
    _bad(all(m["content"].strip() for m in answers), "empty_answer", "an assistant message is empty")
    if isinstance(record.get("answer"), (str, int, float)) and messages[-1]["role"] == "assistant":
        messages[-1] = {**messages[-1], "answer": str(record["answer"])}  # a checkable answer (sft's held-out accuracy)
    return messages


@dataclass
class Pair:
    """A preference pair: the prompt's messages, then the chosen and the rejected answer message(s)."""
    prompt: list
    chosen: list
    rejected: list


def to_pair(record):
    """One preference record -> Pair: prompt/chosen/rejected as text or message lists, or an implicit
    prompt (chosen and rejected are whole conversations; their shared first messages are the prompt)."""
    _bad(isinstance(record, dict), "not_object", f"a JSON {type(record).__name__}, not an object")
    chosen, rejected = record.get("chosen"), record.get("rejected")
    _bad(chosen is not None and rejected is not None, "missing_field",
         f"a preference record needs 'chosen' and 'rejected' (fields: {sorted(record)})")
    _bad(isinstance(chosen, (str, list)) and type(chosen) is type(rejected), "mismatched",
         f"chosen is a {type(chosen).__name__} and rejected a {type(rejected).__name__}: both must be text or "
         "both message lists")
    if record.get("prompt") is not None:
        prompt, chosen, rejected = (_side(record, k, r) for k, r in
                                    (("prompt", "user"), ("chosen", "assistant"), ("rejected", "assistant")))
    else:
        _bad(isinstance(chosen, list), "missing_field", "no 'prompt', and chosen/rejected are text: give a prompt, "
             "or whole conversations as chosen/rejected (their shared first messages are the prompt)")
        chosen, rejected = _messages(chosen, "chosen"), _messages(rejected, "rejected")
        n = 0
        while n < min(len(chosen), len(rejected)) and chosen[n] == rejected[n]:
            n += 1
        prompt, chosen, rejected = chosen[:n], chosen[n:], rejected[n:]
        _bad(prompt, "no_prompt", "chosen and rejected share no first message: no implicit prompt")
    _bad(chosen and rejected, "empty_answer", "chosen or rejected has no answer after the prompt")
    _bad(chosen[0]["role"] == rejected[0]["role"] == "assistant", "not_assistant",
         "the answers after the prompt must start with an assistant message")
    _bad(all(m["content"].strip() for m in chosen + rejected if m["role"] == "assistant"), "empty_answer",
         "an answer is empty")
    _bad(chosen != rejected, "same_answers", "chosen and rejected are the same answer")
    return Pair(prompt, chosen, rejected)


def to_prompt(record):
    """One prompt record -> {"prompt": messages, every other field as is} (e.g. "answer", "tests")."""
    _bad(isinstance(record, dict), "not_object", f"a JSON {type(record).__name__}, not an object")
    prompt = _side(record, "prompt", "user")
    _bad(prompt[-1]["role"] != "assistant", "ends_with_answer",
         "the prompt ends with an assistant message: a prompt is what the model is to answer")
    return {**record, "prompt": prompt}


def _read(source, parse, fmt, skip_bad, limit, what):
    # parse(record, fmt) over the source's records; fmt "auto": detected from the first record
    if fmt != "auto" and fmt not in FORMATS:
        raise ChatDataError(f"chat_format={fmt!r} is not one of auto, {', '.join(FORMATS)}")
    if not isinstance(limit, int) or limit < 0:
        raise ChatDataError(f"limit={limit!r} must be an integer >= 0 (0: all records)")
    bad, out = collections.Counter(), []
    for where, record in iter_records(source, bad if skip_bad else None):
        if fmt == "auto":
            try:
                fmt = detect_format(record)
            except BadRecord as e:
                raise ChatDataError(f"{where}: {e}") from None
        try:
            out.append(parse(record, fmt))
        except BadRecord as e:
            if not skip_bad:
                raise ChatDataError(f"{where}: {e} (skip_bad_records=True skips such records and counts them)") \
                    from None
            bad[e.kind] += 1
            continue
        if limit and len(out) == limit:
            break
    if not out:
        raise ChatDataError(f"chat data {source!r} holds no {what}" +
                            (f": every record was malformed ({dict(bad)})" if bad else ": it is empty"))
    return out, bad


def read_conversations(source, fmt="auto", *, skip_bad=False, limit=0):
    """(conversations, Counter of skipped records per reason) of a source (see iter_records). A bad
    record raises ChatDataError naming file:line unless skip_bad; limit: stop after that many."""
    return _read(source, to_messages, fmt, skip_bad, limit, "conversation")


def read_pairs(source, *, skip_bad=False, limit=0):
    """(list[Pair], Counter of skipped records per reason), as read_conversations."""
    return _read(source, lambda r, _: to_pair(r), "messages", skip_bad, limit, "preference pair")


def read_prompts(source, *, skip_bad=False, limit=0):
    """(prompt records (to_prompt), Counter of skipped records per reason), as read_conversations."""
    return _read(source, lambda r, _: to_prompt(r), "messages", skip_bad, limit, "prompt")


# -----------------------------------------------------------------------------
# Chat templates

class Generation(jinja2.ext.Extension):
    """{% generation %}...{% endgeneration %}: the enclosed output, between two markers that
    ChatTemplate turns into a span (transformers tracks the same blocks as char indices)."""
    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("mark"), [], [], body).set_lineno(lineno)

    def mark(self, caller):
        return GEN + caller() + END_GEN


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt):
    return datetime.datetime.now().strftime(fmt)


def compile_template(source, name="chat template"):
    """jinja2 text -> Template, in the environment transformers renders chat templates in; a syntax
    error is a ChatDataError naming the line. The whole conversation is rendered once by the
    template, as transformers' apply_chat_template renders it: a sandboxed jinja2 environment,
    trim_blocks, lstrip_blocks, raise_exception, tojson, strftime_now, bos_token / eos_token (the
    template's variables), {% generation %} blocks."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now)
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise ChatDataError(f"{name}: line {e.lineno}: {e.message}: fix the template (or set chat_template)") \
            from None


def _protect(value, pattern):
    # a message's strings with the markers removed and each special token's text wrapped in PROTECT..UNPROTECT
    if isinstance(value, str):
        value = value.translate({ord(c): None for c in MARKERS})
        return pattern.sub(lambda m: PROTECT + m.group(0) + UNPROTECT, value) if pattern else value
    if isinstance(value, dict):
        return {k: _protect(v, pattern) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_protect(v, pattern) for v in value]
    return value


def _unmark(raw):
    """Rendered text with markers -> (text, protected ranges, generation spans), the ranges in text
    coordinates. Lone markers are dropped."""
    text, protected, spans, opened, n, pos = [], [], [], {}, 0, 0
    for m in MARKER_RE.finditer(raw):
        text.append(raw[pos:m.start()])
        n, pos, ch = n + m.start() - pos, m.end(), m.group(0)
        if ch in (PROTECT, GEN):
            opened[ch] = n
        elif opened.get(PROTECT if ch == UNPROTECT else GEN) is not None:
            start = opened.pop(PROTECT if ch == UNPROTECT else GEN)
            (protected if ch == UNPROTECT else spans).append((start, n))
    text.append(raw[pos:])
    return "".join(text), protected, [s for s in spans if s[1] > s[0]]


class ChatTemplate:
    """A jinja chat template. source: its text; special_tokens: the tokens it writes that must encode
    as single ids; eos: the end-of-turn token's text (generation stops there); variables: what else
    the template reads (bos_token, eos_token of the tokenizer, as transformers passes them).

    Special tokens become single ids only where the TEMPLATE wrote them. Before rendering, each
    special token's text inside a message is wrapped in two private-use marker characters (_protect;
    the technique of transformers' sanitize_control_tokens); after rendering the markers are removed
    and those places stay ordinary text (_unmark). The text is cut at the template-written special
    tokens (pieces); every piece between them is encoded as ordinary text by the tokenizer, every
    special token as its id. A user typing '<|im_start|>' gets the ids of those characters, never
    the control token. (The four marker characters U+E000..U+E003 are removed from messages, as
    transformers removes its own.)"""

    def __init__(self, source, special_tokens, eos, variables=None, name="chat template"):
        self.source, self.special_tokens, self.eos, self.name = source, list(special_tokens), eos, name
        self.variables = {k: v for k, v in (variables or {}).items() if v}
        self.template = compile_template(source, name)
        self.generation = bool(re.search(r"\{%-?\s*generation\s*-?%\}", source))
        longest = sorted(self.special_tokens, key=len, reverse=True)
        self.pattern = re.compile("|".join(map(re.escape, longest))) if longest else None

    def __repr__(self):
        return f"ChatTemplate({self.name!r}, special_tokens={self.special_tokens}, eos={self.eos!r})"

    def _raw(self, messages, add_generation_prompt):
        try:
            return self.template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                        tools=None, documents=None, **self.variables)
        except Exception as e:  # the template's own code raising: raise_exception, undefined names, types
            first = next((m["content"][:40] for m in messages if m.get("role") == "user"), "")
            raise ChatDataError(f"{self.name} cannot render a conversation ({type(e).__name__}: {e}); its first "
                                f"user message begins {first!r}. Fix the data or the template (chat_template)") \
                from None

    def parts(self, messages, add_generation_prompt=False, spans=True, train_from=0):
        """(text, protected ranges, loss spans): the rendered text, the ranges of it that are a
        message's literal special-token text (ordinary text, never ids), and the spans to train on
        (none when spans=False). train_from > 0: only what follows the first train_from messages
        rendered with add_generation_prompt=True (DPO: the answer after its prompt, as TRL cuts it).
        Loss spans: a template with {% generation %} blocks trains what they enclose (what
        transformers' return_assistant_tokens_mask and TRL's assistant_only_loss train). Otherwise,
        for each assistant message i, from the end of render(messages[:i], add_generation_prompt=True)
        (which must be a prefix of the whole text) through the first end-of-turn token (self.eos)
        the template wrote after it: the answer and its end of turn."""
        marked = _protect([dict(m) for m in messages], self.pattern)
        text, protected, generated = _unmark(self._raw(marked, add_generation_prompt))
        if not spans:
            return text, protected, []
        out = generated if self.generation else []
        for i, m in enumerate(marked if not self.generation else ()):
            if m.get("role") != "assistant":
                continue
            start = self.answer_start(marked, i, text)
            upto = _unmark(self._raw(marked[:i + 1], False))[0]
            limit = len(upto) if text.startswith(upto) and len(upto) > start else len(text)
            end = self.eot_end(text, protected, start, limit)
            out.append((start, end if end is not None else len(text[:limit].rstrip())))
        if train_from:
            start = self.answer_start(marked, train_from, text)
            out = [(max(a, start), b) for a, b in out if b > start]
        return text, protected, out

    def answer_start(self, marked, i, text):
        """Where the answer after messages[:i] starts in text: the end of their rendering with
        add_generation_prompt=True, which must be a prefix of text."""
        prefix = _unmark(self._raw(marked[:i], True))[0]
        if not text.startswith(prefix):
            raise ChatDataError(
                f"{self.name}: the conversation before message {i + 1}, rendered with add_generation_prompt=True, "
                "is not the start of the whole conversation's text, so where the answer starts is unknown: put "
                "{% generation %}...{% endgeneration %} around the assistant's output in the template")
        return len(prefix)

    def eot_end(self, text, protected, start, limit):
        """The end of the first end-of-turn token the template wrote in text[start:limit], or None."""
        i = text.find(self.eos, start, limit) if self.eos else -1
        while i >= 0 and any(a <= i < b for a, b in protected):
            i = text.find(self.eos, i + 1, limit)
        return i + len(self.eos) if i >= 0 else None

    def render(self, messages, add_generation_prompt=False):
        return self.parts(messages, add_generation_prompt, spans=False)[0]

    def spans(self, messages):
        """(text, [(start, end)]): the rendered conversation and the char spans to train on."""
        text, _, spans = self.parts(messages)
        return text, spans

    def pieces(self, text, protected):
        """text -> [(start, end, special token or None)]: cut at the special tokens the template wrote."""
        out, pos = [], 0
        for m in (self.pattern.finditer(text) if self.pattern else ()):
            if any(a <= m.start() < b for a, b in protected):
                continue
            if m.start() > pos:
                out.append((pos, m.start(), None))
            out.append((m.start(), m.end(), m.group(0)))
            pos = m.end()
        return out + [(pos, len(text), None)] * (pos < len(text))


# ChatML, with the assistant's output (answer + <|im_end|>) in a {% generation %} block: rendered,
# it is exactly the ChatML text (transformers renders it the same and can mask with it)
DEFAULT_TEMPLATE = (
    r"{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' }}"
    r"{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] + '<|im_end|>' }}"
    r"{% endgeneration %}{% else %}{{ message['content'] + '<|im_end|>' }}{% endif %}{{ '\n' }}{% endfor %}"
    r"{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def default_template():
    """Ours, ChatML: <|im_start|>role\\ncontent<|im_end|>\\n per message (tokenizer.CHAT_TOKENS)."""
    return ChatTemplate(DEFAULT_TEMPLATE, tokenizer.CHAT_TOKENS, tokenizer.CHAT_TOKENS[-1], name="default chat template")


def template_specials(source, tok):
    """The special tokens a template writes: tok's special tokens that occur in its literal text,
    <|name|> literals tok lacks (they are added to it), and bos/eos when it reads bos_token /
    eos_token; in order of first occurrence. A token the template only assembles from pieces, like
    '<|' + role + '|>', is not found (nor by transformers' sanitize_control_tokens): it stays text
    unless another literal names it; list such tokens yourself: ChatTemplate(source, special_tokens, eos)."""
    ast = compile_template(source).environment.parse(source)
    literal = "\0".join([n.data for n in ast.find_all(jinja2.nodes.TemplateData)] +
                        [n.value for n in ast.find_all(jinja2.nodes.Const) if isinstance(n.value, str)])
    found = {t: literal.find(t) for t in tok.special_tokens if t in literal and not t.isspace()}
    found.update({m.group(0): m.start() for m in re.finditer(r"<\|[^|\s<>\x00]+\|>", literal) if m.group(0) not in found})
    names = jinja2.meta.find_undeclared_variables(ast)
    for var, text in (("bos_token", tok.bos_token), ("eos_token", tok.eos_token)):
        if var in names and text:
            found.setdefault(text, len(literal))
    return sorted(found, key=lambda t: (found[t], t))


def template_for(tok, init_from="", name=""):
    """The chat template of a run: name "default" -> ours; a path -> that .jinja file; "" -> the
    tokenizer's own (an HF folder's chat_template, init_from's) when it has one, else ours."""
    if name == "default":
        return default_template()
    if name:
        if not os.path.isfile(name):
            raise ChatDataError(f"chat_template={name!r}: no such file (give a .jinja file, 'default', or '' for "
                                "the model's own)")
        with open(name, encoding="utf-8") as f:
            source = f.read()
    elif getattr(tok, "chat_template", None):
        source, name = tok.chat_template, f"the chat template of {init_from or tok.name}"
    else:
        return default_template()
    specials = template_specials(source, tok)
    eos = next((t for t in specials if t in EOT_TOKENS), tok.eos_token)  # the first the template writes
    return ChatTemplate(source, specials, eos, {"bos_token": tok.bos_token, "eos_token": tok.eos_token}, name)


# -----------------------------------------------------------------------------
# Token ids and the loss mask

def encode(tok, template, messages, *, add_generation_prompt=False, train_from=0):
    """(ids, mask) of a conversation: the rendered text tokenised once, special tokens as single ids
    where the template wrote them; mask[i] True when token i is trained on (its characters overlap
    a loss span). add_generation_prompt=True: the prompt's ids (ending in the assistant header) and an
    all-False mask. train_from=len(prompt): only the answer after the prompt is trained (a DPO pair's
    prompt + chosen: earlier assistant turns of the prompt are not).
    Loss mask: token i is trained when its characters overlap a span (transformers' rule). The char
    range of each token comes from its bytes in the single tokenization, so a BPE merge across a
    prompt/answer border moves nothing: a token straddling the border (" Hello" whose space the
    template wrote) is trained, a token wholly in the prompt is not."""
    if getattr(tok, "nfc", False):  # a normalising tokenizer: normalise the messages, not the rendered text
        messages = [{**m, "content": unicodedata.normalize("NFC", m["content"])} for m in messages]
    text, protected, spans = template.parts(messages, add_generation_prompt, not add_generation_prompt, train_from)
    ids, starts, ends = [], [], []
    for a, b, special in template.pieces(text, protected):
        if special is not None:
            if special not in tok.special_tokens:
                raise ChatDataError(f"{template.name} writes {special!r}, which tokenizer {tok.name} lacks: build the "
                                    "tokenizer with chat.setup(cfg) (or tok.with_chat(template.special_tokens, "
                                    "template.eos))")
            ids.append(tok.special_tokens[special])
            starts.append(a)
            ends.append(b)
            continue
        piece = tok.encode(text[a:b])
        raw = text[a:b].encode("utf-8")
        lengths = np.array([len(t) for t in tok.token_bytes(piece)], dtype=np.int64)
        if lengths.sum() != len(raw):
            raise ValueError(f"{tok.name}: the tokens of {text[a:b][:40]!r} do not spell its bytes")
        lead = np.concatenate([[0], np.cumsum((np.frombuffer(raw, np.uint8) & 0xC0) != 0x80)])  # chars before byte
        byte_end = np.cumsum(lengths)
        ids += piece
        starts += (a + lead[byte_end - lengths + 1] - 1).tolist()  # the char holding the token's first byte
        ends += (a + lead[byte_end]).tolist()                       # past the char holding its last byte
    cover = np.zeros(len(text) + 1, dtype=np.int64)
    for a, b in spans:
        cover[a] += 1
        cover[b] -= 1
    trained = np.concatenate([[0], np.cumsum(np.cumsum(cover)[:-1] > 0)])  # trained chars before each position
    mask = (trained[np.array(ends, dtype=np.int64)] - trained[np.array(starts, dtype=np.int64)]) > 0
    return ids, mask.tolist()


# -----------------------------------------------------------------------------
# Packing and batches

@dataclass
class Row:
    """Whole examples side by side, T+1 tokens: ids, mask (trained), seg (example index in the row,
    -1 = padding), pos (position within its example)."""
    ids: np.ndarray
    mask: np.ndarray
    seg: np.ndarray
    pos: np.ndarray


def pack(examples, T, *, drop_long=True, one_per_row=False):
    """Examples (ids, mask) -> (rows of T+1 tokens, Counter of dropped examples per reason). Best-fit
    decreasing: longest first, each into the row whose free space fits it most tightly. Dropped:
    "too_long" (more than T+1 tokens: drop_long=False raises instead), "no_target" (no trained token
    after the first). one_per_row: no packing, one example per row (padded). Examples are never cut;
    positions restart at 0 per example, and batch() keeps attention (causal) and targets within an
    example."""
    n, dropped, keep = T + 1, collections.Counter(), []
    for i, (ids, mask) in enumerate(examples):
        if len(ids) != len(mask):
            raise ValueError(f"example {i}: {len(ids)} ids but {len(mask)} mask entries")
        if len(ids) > n:
            dropped["too_long"] += 1
        elif not any(mask[1:]):
            dropped["no_target"] += 1
        else:
            keep.append(i)
    if dropped["too_long"] and not drop_long:
        longest = max(len(ids) for ids, _ in examples)
        raise ChatDataError(f"{dropped['too_long']} examples are longer than a row of T+1={n} tokens (the longest "
                            f"has {longest}): raise seq_len / block_size, or let them be dropped and counted")
    members, free = [], []  # free: sorted (space left, row) of rows that can take another example
    for i in sorted(keep, key=lambda i: (-len(examples[i][0]), i)):
        size = len(examples[i][0])
        j = bisect.bisect_left(free, (size, -1))
        if j < len(free) and not one_per_row:
            space, r = free.pop(j)
        else:
            space, r = n, len(members)
            members.append([])
        members[r].append(i)
        if space - size >= 2:  # room for an example with a target
            bisect.insort(free, (space - size, r))
    if not members:
        raise ChatDataError(f"no example fits and trains in a row of T+1={n} tokens ({dict(dropped)}): raise seq_len "
                            "/ block_size, or check the data")
    rows = []
    for group in members:
        row = Row(np.zeros(n, np.int64), np.zeros(n, bool), np.full(n, -1, np.int64), np.zeros(n, np.int64))
        at = 0
        for k, i in enumerate(group):
            ids, mask = examples[i]
            row.ids[at:at + len(ids)], row.mask[at:at + len(ids)] = ids, mask
            row.seg[at:at + len(ids)], row.pos[at:at + len(ids)] = k, np.arange(len(ids))
            at += len(ids)
        rows.append(row)
    return rows, dropped


def batch(rows, device="cpu"):
    """Rows -> (x, y, pos, attn_mask): x (B, T) ids; y (B, T) next ids, IGNORE where not trained, across
    example borders and on padding; pos (B, T) positions restarting per example; attn_mask (B, T, T)
    bool, causal within the same example (padding sees padding: no empty row). Rows of one example each
    (pack=False, or a packed row that took one) give pos and attn_mask None: the model's plain causal
    path (flash / SDPA, memory linear in T), exact there, as the padding comes after the example; such a
    batch is also cut to its longest row, rounded up to a multiple of 64 and of T/16 (padding computes nothing
    it needs; a compiled forward meets at most 16 lengths)."""
    seg = np.stack([r.seg for r in rows])
    single = bool((seg[:, 0] == 0).all() and (seg <= 0).all() and (seg[:, 1:] <= seg[:, :-1]).all())
    longest = int((seg >= 0).sum(1).max())  # (on the host: no device sync)
    ids, mask, seg, pos = (torch.from_numpy(np.stack([getattr(r, k) for r in rows])).to(device)
                           for k in ("ids", "mask", "seg", "pos"))  # the (B, T, T) mask is built on the device
    same = (seg[:, 1:] == seg[:, :-1]) & (seg[:, 1:] >= 0)
    y = torch.where(mask[:, 1:] & same, ids[:, 1:], IGNORE)
    if single:
        grain = max(64, (len(rows[0].ids) - 1) // 16 // 64 * 64)  # (a multiple of tp: sequence parallelism)
        n = min(-(-longest // grain) * grain, y.shape[1])
        return ids[:, :n], y[:, :n], None, None
    s = seg[:, :-1]
    T = s.shape[1]
    attn = (s[:, :, None] == s[:, None, :]) & torch.ones(T, T, dtype=torch.bool, device=s.device).tril()
    return ids[:, :-1], y, pos[:, :-1], attn


class ChatLoader(data.Loader):
    """Batches of packed rows for data-parallel rank `rank` of `world`: data.Loader's stream (a fresh
    permutation per epoch seeded by (seed, epoch), B*world rows per global batch, ranks disjoint,
    state_dict / load_state_dict exact) over rows instead of token windows."""

    def __init__(self, rows, B, rank=0, world=1, seed=0, device="cpu"):
        self.init_stream(B, len(rows[0].ids) - 1 if rows else 0, rank, world, seed, device)
        self.path, self.rows, self.n_windows = "packed chat rows", rows, len(rows)
        if len(rows) < B * world:
            raise ChatDataError(f"{len(rows)} packed rows of T={self.T} are fewer than one global batch of {B}x{world} "
                                "(micro_batch_size x data-parallel ranks): use more data, a smaller micro_batch_size "
                                "or fewer ranks")

    def next(self):
        return batch([self.rows[i] for i in self.next_windows()], self.device)


# -----------------------------------------------------------------------------
# A chat stage's start

def setup(cfg):
    """(tokenizer, template) of a chat stage: the run's tokenizer (tokenizer.for_cfg(cfg): after
    weights.configure an HF folder's) with the template's special tokens added where missing (new ids past
    the vocabulary) and the template as its chat_template, cfg.vocab_size raised to cover them.
    cfg.chat_template picks the template; a stage that reads chat_format (sft.py) has it checked here."""
    if getattr(cfg, "chat_format", "auto") not in ("auto", *FORMATS):
        raise ChatDataError(f"chat_format={cfg.chat_format!r} is not one of auto, {', '.join(FORMATS)}")
    tok = tokenizer.for_cfg(cfg)
    template = template_for(tok, cfg.init_from, cfg.chat_template)
    tok = tok.with_chat(template.special_tokens, template.eos)
    tok.chat_template = template.source  # what tokenizer.save_tokenizer (export) writes as the model's template
    cfg.vocab_size = max(cfg.vocab_size, tok.n_vocab)
    return tok, template
