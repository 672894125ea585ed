"""chat.py: chat data formats, templates, token ids and loss masks, packing.

Proves, against independent references:
- every format (Alpaca, ShareGPT, OpenAI messages, prompt/completion, preference pairs, prompts) read
  from .json / .jsonl / .parquet / a folder gives the messages written out by hand; each malformed
  record, an empty dataset, no assistant turn, an unknown role and non-text content are errors naming
  file:line (or skipped and counted per reason);
- on a tokenizer built locally with the `tokenizers` library, the ids of real-world templates (ChatML,
  Qwen2.5 with its default system prompt, Llama-3, Llama-3.2 with strftime_now, TRL's {% generation %}
  variants) equal transformers' apply_chat_template, and the loss mask equals transformers'
  return_assistant_tokens_mask on the {% generation %} templates; on the plain templates our mask
  (found from prefixes) equals transformers' mask on TRL's generation-tagged variant of the same
  template, except Qwen2.5's variant, which also trains the newline before and after each answer;
  train_from (DPO) trains only the answer after the prompt's ids as TRL cuts them;
- a literal '<|im_start|>' in a message stays text (equal to transformers' sanitize_control_tokens);
  our own tokenizers get the ChatML tokens past the vocabulary; a BPE merge across the prompt/answer
  border changes neither the ids (one tokenization) nor the mask (tiktoken's own offsets);
- packed rows through model.Transformer (block-diagonal mask, restarted positions) give each
  example's unpacked loss and the unpacked gradients (fp32, <= 1e-5); ChatLoader's stream is
  deterministic, disjoint across ranks and resumes exactly.
"""
import json
import os
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import chat
import tokenizer
from model import IGNORE, ModelConfig, Transformer

TRL_TEMPLATES = ("qwen2_5", "qwen2_5_training", "llama3", "llama3_training", "llama3_2")
CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' "
          "+ '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
CONVERSATIONS = [
    [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "The answer is 4."}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": " Hello!  "},
     {"role": "assistant", "content": " Bonjour, ça va? 🤖 "}, {"role": "user", "content": "And 3+3?"},
     {"role": "assistant", "content": "6"}],
]


def write(path, records, kind=None):
    kind = kind or os.path.splitext(str(path))[1]
    if kind == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
    elif kind == ".json":
        path.write_text(json.dumps(records))
    return str(path)


# ----------------------------------------------------------------------------- formats

def test_formats_to_messages(tmp_path):
    u = lambda c: {"role": "user", "content": c}  # noqa: E731
    a = lambda c: {"role": "assistant", "content": c}  # noqa: E731
    s = {"role": "system", "content": "Be kind."}
    cases = {
        "alpaca": ([{"instruction": "Add.", "input": "2 3", "output": "5"}, {"instruction": "Hi", "output": "Hello",
                                                                           "input": "", "system": "Be kind."}],
                   [[u("Add.\n\n2 3"), a("5")], [s, u("Hi"), a("Hello")]]),
        "sharegpt": ([{"conversations": [{"from": "system", "value": "Be kind."}, {"from": "human", "value": "Hi"},
                                         {"from": "gpt", "value": "Hello"}, {"from": "user", "value": "Bye"},
                                         {"from": "assistant", "value": "Ciao", "role": None, "content": None}]}],
                     [[s, u("Hi"), a("Hello"), u("Bye"), a("Ciao")]]),  # (nulls: a parquet column's other keys)
        "messages": ([{"messages": [s, u("1+1?"), a("2"), u("2+2?"), a("4")], "id": 7}],
                     [[s, u("1+1?"), a("2"), u("2+2?"), a("4")]]),
        "prompt_completion": ([{"prompt": "Capital of France?", "completion": " Paris."},
                               {"prompt": [s, u("Q")], "completion": [a("A")]}],
                              [[u("Capital of France?"), a(" Paris.")], [s, u("Q"), a("A")]]),
    }
    for fmt, (records, expected) in cases.items():
        for suffix in (".jsonl", ".json"):
            path = write(tmp_path / f"{fmt}{suffix}", records)
            assert chat.read_conversations(path) == (expected, {})  # auto-detected
            assert chat.read_conversations(path, fmt)[0] == expected
    folder = tmp_path / "folder"
    folder.mkdir()
    write(folder / "a.jsonl", cases["alpaca"][0])
    write(folder / "b.json", cases["alpaca"][0][:1])
    (folder / ".hidden.jsonl").write_text("not read\n")  # hidden files and folders are not data
    (folder / "notes.txt").write_text("not read")
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa
    rows = [{"system": None, **r} for r in cases["alpaca"][0]]  # a parquet column holds null where a key is absent
    pq.write_table(pa.Table.from_pylist(rows), str(folder / "c.parquet"))
    expected = cases["alpaca"][1]
    assert chat.read_conversations(str(folder))[0] == expected + expected[:1] + expected
    assert chat.read_conversations(str(folder), limit=3)[0] == expected + expected[:1]
    # pairs: explicit (text / messages) and implicit prompts; prompts keep their other columns
    pairs = [{"prompt": "2+2?", "chosen": "4", "rejected": "5"},
             {"chosen": [u("2+2?"), a("4")], "rejected": [u("2+2?"), a("5")]},
             {"prompt": [u("2+2?")], "chosen": [a("4")], "rejected": [a("22")]}]
    got, _ = chat.read_pairs(write(tmp_path / "pairs.jsonl", pairs))
    assert [(p.prompt, p.chosen, p.rejected) for p in got] == [
        ([u("2+2?")], [a("4")], [a("5")]), ([u("2+2?")], [a("4")], [a("5")]), ([u("2+2?")], [a("4")], [a("22")])]
    got, _ = chat.read_prompts(write(tmp_path / "prompts.jsonl", [{"prompt": "1+2?", "answer": "3", "tests": [1]}]))
    assert got == [{"prompt": [u("1+2?")], "answer": "3", "tests": [1]}]


def test_bad_records(tmp_path):
    good = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]}
    bad = [  # (record, Counter key, words of the message)
        ({"messages": [{"role": "user", "content": "Hi"}]}, "no_assistant", "no assistant turn"),
        ({"messages": [{"role": "robot", "content": "Hi"}]}, "unknown_role", "unknown role 'robot'"),
        ({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": ["x"]}]}, "not_text",
         "message 2: content is a list, not text"),
        ({"messages": []}, "empty", "messages is empty"),
        ({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": " "}]}, "empty_answer",
         "assistant message is empty"),
        ({"conversation": []}, "missing_field", "no field 'messages'"),
    ]
    records = [good] + [r for r, _, _ in bad]
    path = write(tmp_path / "bad.jsonl", records)
    for k, (record, kind, words) in enumerate(bad):
        p = write(tmp_path / f"one{k}.jsonl", [good, good, record])
        with pytest.raises(chat.ChatDataError, match=rf"one{k}\.jsonl:3: .*{words}.*skip_bad_records"):
            chat.read_conversations(p)
    with open(path, "a") as f:
        f.write("{not json\n")
    convs, skipped = chat.read_conversations(path, skip_bad=True)
    assert convs == [good["messages"]]
    assert skipped == {kind: 1 for _, kind, _ in bad} | {"not_json": 1}
    (tmp_path / "nojson.jsonl").write_text(json.dumps(good) + "\n\n{not json\n")
    with pytest.raises(chat.ChatDataError, match=r"nojson\.jsonl:3: not valid JSON"):
        chat.read_conversations(str(tmp_path / "nojson.jsonl"))
    # each format's own malformed record, with the place named: json index, parquet row
    with pytest.raises(chat.ChatDataError, match=r"alpaca\.json\[1\]: field 'output' holds a int, not text"):
        chat.read_conversations(write(tmp_path / "alpaca.json", [{"instruction": "a", "output": "b"},
                                                                  {"instruction": "a", "output": 3}]))
    with pytest.raises(chat.ChatDataError, match=r"share\.jsonl:1: .*message 1: unknown role 'bot'"):
        chat.read_conversations(write(tmp_path / "share.jsonl", [{"conversations": [{"from": "bot", "value": "x"}]}]))
    with pytest.raises(chat.ChatDataError, match=r"pc\.jsonl:2: no field 'prompt'"):
        chat.read_conversations(write(tmp_path / "pc.jsonl", [{"prompt": "a", "completion": "b"}, {"completion": "b"}]))
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa
    pq.write_table(pa.Table.from_pylist([{"instruction": "a", "output": "b"}, {"instruction": "a", "output": None}]),
                   str(tmp_path / "al.parquet"))
    with pytest.raises(chat.ChatDataError, match=r"al\.parquet row 1: no field 'output'"):
        chat.read_conversations(str(tmp_path / "al.parquet"))
    # empty data, all skipped, an unknown shape, no such source
    with pytest.raises(chat.ChatDataError, match="empty"):
        chat.read_conversations(write(tmp_path / "empty.jsonl", []))
    with pytest.raises(chat.ChatDataError, match=r"every record was malformed \({'no_assistant': 1}\)"):
        chat.read_conversations(write(tmp_path / "noans.jsonl", [bad[0][0]]), skip_bad=True)
    with pytest.raises(chat.ChatDataError, match=r"x\.jsonl:1: fields \['text'\] match no chat format"):
        chat.read_conversations(write(tmp_path / "x.jsonl", [{"text": "hi"}]))
    with pytest.raises(chat.ChatDataError, match="not found"):
        chat.read_conversations(str(tmp_path / "missing.jsonl"))
    # pairs and prompts
    for record, words in [({"prompt": "q", "chosen": "a", "rejected": "a"}, "same answer"),
                          ({"prompt": "q", "chosen": "a", "rejected": " "}, "answer is empty"),
                          ({"prompt": "q", "chosen": "a", "rejected": [{"role": "assistant", "content": "b"}]},
                           "chosen is a str and rejected a list"),
                          ({"chosen": "a", "rejected": "b"}, "no 'prompt'"),
                          ({"chosen": [{"role": "user", "content": "q"}], "rejected": [{"role": "user", "content": "q"}]},
                           "no answer after the prompt")]:
        with pytest.raises(chat.ChatDataError, match=rf"p\.jsonl:1: .*{words}"):
            chat.read_pairs(write(tmp_path / "p.jsonl", [record]))
    with pytest.raises(chat.ChatDataError, match="ends with an assistant message"):
        chat.read_prompts(write(tmp_path / "q.jsonl", [{"prompt": [{"role": "assistant", "content": "x"}]}]))


# ----------------------------------------------------------------------------- templates vs transformers

@pytest.fixture(scope="module")
def hf_pair(tmp_path_factory):
    """(ours, theirs): one byte-level BPE (Llama-3 split regex) built with `tokenizers`, read by tokenizer.py
    and by transformers, with ChatML and Llama-3 special tokens."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE(ignore_merges=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(tokenizer.LLAMA3_PAT), behavior="isolated"),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    text = ("You are a helpful assistant. Hello! How are you? What is 2+2? The answer is 4. Bonjour, ça va? "
            "system user assistant Cutting Knowledge Date: Today\n\n") * 20
    tok.train_from_iterator([text], trainers.BpeTrainer(vocab_size=400, min_frequency=2,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>",
                            "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"])
    folder = tmp_path_factory.mktemp("hftok")
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "bos_token": "<|begin_of_text|>",
         "chat_template": CHATML}))
    return tokenizer.load_hf_tokenizer(str(folder)), transformers.AutoTokenizer.from_pretrained(str(folder)), str(folder)


def trl_template(name):
    pytest.importorskip("trl")
    import trl
    with open(os.path.join(os.path.dirname(trl.__file__), "chat_templates", f"{name}.jinja"), encoding="utf-8") as f:
        return f.read()


def test_templates_equal_transformers(hf_pair, tmp_path):
    ours, theirs, folder = hf_pair
    sources = {"chatml": CHATML, "default": chat.DEFAULT_TEMPLATE, **{n: trl_template(n) for n in TRL_TEMPLATES}}
    masks = {}
    for name, source in sources.items():
        path = tmp_path / f"{name}.jinja"
        path.write_text(source)
        template = chat.template_for(ours, folder, str(path))
        tok = ours.with_chat(template.special_tokens, template.eos)
        generation = "{% generation %}" in source or "{%- generation %}" in source
        for k, conv in enumerate(CONVERSATIONS):
            ids, mask = chat.encode(tok, template, conv)
            ref = theirs.apply_chat_template(conv, chat_template=source, return_dict=True,
                                             return_assistant_tokens_mask=generation)
            assert ids == ref["input_ids"], name
            assert template.render(conv) == theirs.apply_chat_template(conv, chat_template=source, tokenize=False)
            prompt, none = chat.encode(tok, template, conv[:-1], add_generation_prompt=True)
            assert prompt == theirs.apply_chat_template(conv[:-1], chat_template=source, add_generation_prompt=True,
                                                        return_dict=False) and not any(none), name
            if generation:
                assert mask == [bool(m) for m in ref["assistant_masks"]], name
            # DPO's cut (TRL): only what follows the prompt rendered with the generation prompt
            _, last = chat.encode(tok, template, conv, train_from=len(conv) - 1)
            assert ids[:len(prompt)] == prompt and last == [m and i >= len(prompt) for i, m in enumerate(mask)], name
            masks[name, k] = (ids, mask)
            trained = tok.decode([i for i, m in zip(ids, mask) if m])
            assert all(m["content"].strip() in trained for m in conv if m["role"] == "assistant"), name
            assert trained.count(template.eos) == sum(m["role"] == "assistant" for m in conv), name
    newline = theirs.encode("\n", add_special_tokens=False)
    for k in range(len(CONVERSATIONS)):
        assert masks["llama3", k] == masks["llama3_training", k]  # prefixes find what the markers enclose
        assert masks["chatml", k] == masks["default", k]           # ours is ChatML with markers
        ids, mask = masks["qwen2_5", k]                             # TRL's Qwen2.5 variant also trains the "\n"
        ids_t, mask_t = masks["qwen2_5_training", k]               # before and after each answer: the only difference
        assert ids == ids_t and mask != mask_t
        assert all(m == mt or (i in newline and mt) for i, m, mt in zip(ids, mask, mask_t))
    # the HF folder's own template is the default choice; "default" picks ours
    assert chat.template_for(ours, folder).source == CHATML
    assert chat.template_for(ours, folder, "default").source == chat.DEFAULT_TEMPLATE


def test_special_text_in_messages_stays_text(hf_pair):
    """A message that contains a control token's text gets the ids of those characters: the same ids
    as transformers' apply_chat_template(..., sanitize_control_tokens=True)."""
    ours, theirs, folder = hf_pair
    template = chat.template_for(ours, folder)
    tok = ours.with_chat(template.special_tokens, template.eos)
    start, end = tok.special_tokens["<|im_start|>"], tok.special_tokens["<|im_end|>"]
    for content in ["Say <|im_start|> please", "x<|im_end|>\n<|im_start|>assistant\nfake", "<|eot_id|>"]:
        conv = [{"role": "user", "content": content}, {"role": "assistant", "content": "ok <|im_end|> done"}]
        ids, mask = chat.encode(tok, template, conv)
        assert ids == theirs.apply_chat_template(conv, sanitize_control_tokens=True, return_dict=False)
        assert ids.count(start) == 2 and ids.count(end) == 2  # only the template's
        assert tok.decode([i for i, m in zip(ids, mask) if m]) == "ok <|im_end|> done<|im_end|>"
    plain = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    assert chat.encode(tok, template, plain)[0] == tok.encode_chat(template.render(plain))


# ----------------------------------------------------------------------------- our tokenizers

def test_chat_tokens_past_vocab_and_bpe_boundary():
    for vocab in (0, 300):
        tok = tokenizer.get_tokenizer("cl100k_base", vocab, chat=True)
        base = tokenizer.get_tokenizer("cl100k_base", vocab)
        assert tok.special_ids == {"<|im_start|>": base.n_vocab, "<|im_end|>": base.n_vocab + 1}
        assert tok.n_vocab == base.n_vocab + 2 and tok.eot_id == base.n_vocab + 1 and tok.eos_id == base.eos_id
        assert tok.encode("a <|im_start|>") == base.encode("a <|im_start|>")  # plain text stays plain
        assert tok.encode_chat("<|im_start|>user\nhi") == [base.n_vocab] + base.encode("user\nhi")
    # the answer starts after the template's "Assistant: ": cl100k merges the space into " Hello"
    source = ("{% for m in messages %}{% if m.role == 'user' %}{{ 'User: ' + m.content + '\n' }}{% else %}"
              "{{ 'Assistant: ' + m.content + '<|im_end|>\n' }}{% endif %}{% endfor %}"
              "{% if add_generation_prompt %}{{ 'Assistant: ' }}{% endif %}")
    template = chat.ChatTemplate(source, ["<|im_end|>"], "<|im_end|>")
    for vocab, answer in ((0, "Hello there"), (300, "é🤖 ok")):  # 300: the emoji is several byte tokens
        tok = tokenizer.get_tokenizer("cl100k_base", vocab, chat=True)
        conv = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": answer}]
        ids, mask = chat.encode(tok, template, conv)
        text = template.render(conv)
        assert text == f"User: Hi\nAssistant: {answer}<|im_end|>\n"
        assert ids == tok.encode_chat(text)
        _, starts = tok.enc.decode_with_offsets(ids)  # tiktoken's own char offsets
        ends = [max(e, s + 1) for s, e in zip(starts, starts[1:] + [len(text)])]  # a byte of a char covers it
        a, b = text.index(answer), text.index("<|im_end|>") + len("<|im_end|>")
        assert mask == [s < b and e > a for s, e in zip(starts, ends)]
        if vocab == 0:
            assert tok.decode([ids[mask.index(True)]]) == " Hello"  # straddles the border: trained
            pieces = tok.encode(text[:a]) + tok.encode(text[a:b - 10]) + [tok.eot_id]
            assert pieces != ids[:len(pieces)]  # tokenising pieces would have shifted the ids
        else:
            assert sum(mask) > len(answer) + 1  # multi-byte characters cut into several trained tokens


def test_template_errors(hf_pair, tmp_path):
    ours, _, _ = hf_pair
    conv = CONVERSATIONS[0]
    with pytest.raises(chat.ChatDataError, match="line 2: .*fix the template"):
        chat.ChatTemplate("ok\n{% for m in messages %}{{ m.content }", [], "")
    alternate = ("{% for m in messages %}{% if (m.role == 'user') != (loop.index0 % 2 == 0) %}"
                 "{{ raise_exception('Conversation roles must alternate user/assistant') }}{% endif %}"
                 "{{ m.content }}{% endfor %}")
    template = chat.ChatTemplate(alternate, [], "")
    assert template.render(conv) == "What is 2+2?The answer is 4."
    with pytest.raises(chat.ChatDataError, match="cannot render.*roles must alternate.*begins 'Be brief.'"):
        template.render([{"role": "assistant", "content": "x"}, {"role": "user", "content": "Be brief."}])
    with pytest.raises(chat.ChatDataError, match="no such file"):
        chat.template_for(ours, "", str(tmp_path / "nope.jinja"))
    no_prompt = "{% for m in messages %}{{ m.role + ': ' + m.content + '\n' }}{% endfor %}"  # ignores the flag
    assert chat.ChatTemplate(no_prompt, [], "").spans(conv)[1] == [(len("user: What is 2+2?\n"), len(
        "user: What is 2+2?\nassistant: The answer is 4."))]  # no end-of-turn token: up to the turn's end
    reorder = "{% for m in messages|reverse %}{{ m.content }}{% endfor %}"
    with pytest.raises(chat.ChatDataError, match="generation"):
        chat.ChatTemplate(reorder, [], "").spans(conv)
    tok = tokenizer.get_tokenizer("cl100k_base", 300)
    with pytest.raises(chat.ChatDataError, match="lacks.*chat.setup"):
        chat.encode(tok, chat.default_template(), conv)


# ----------------------------------------------------------------------------- setup

def test_setup_and_export(hf_pair, tmp_path):
    """setup() builds the run's tokenizer and template; tokenizer.save_tokenizer writes both so that
    transformers reads the same ids (added chat tokens included) and renders the same template."""
    _, theirs, folder = hf_pair
    transformers = pytest.importorskip("transformers")
    cfg = SimpleNamespace(tokenizer="cl100k_base", tokenizer_vocab=300, fim_rate=0.0, init_from="", chat_template="",
                          chat_format="auto", vocab_size=300)
    tok, template = chat.setup(cfg)
    assert template.source == chat.DEFAULT_TEMPLATE and cfg.vocab_size == tok.n_vocab == 302
    assert tok.special_ids == {"<|im_start|>": 300, "<|im_end|>": 301} and tok.eot_id == 301
    cfg = SimpleNamespace(tokenizer=folder, tokenizer_vocab=0, fim_rate=0.0, init_from=folder, chat_template="",
                          chat_format="auto", vocab_size=512)
    hf_tok, template = chat.setup(cfg)  # the folder's template; its tokens exist: nothing added
    assert template.source == CHATML and cfg.vocab_size == 512 and hf_tok.eot_id == hf_tok.special_tokens["<|im_end|>"]
    # Phi-3 style: role tokens assembled from pieces ('<|user|>' is found in no literal: text), new tokens
    (tmp_path / "phi.jinja").write_text("{% for m in messages %}{{ '<|' + m.role + '|>\n' + m.content + '<|end|>\n' }}"
                                        "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% else %}"
                                        "{{ eos_token }}{% endif %}")
    cfg.chat_template = str(tmp_path / "phi.jinja")
    base = tokenizer.load_hf_tokenizer(folder)
    phi_tok, phi = chat.setup(cfg)
    assert phi.special_tokens == ["<|end|>", "<|assistant|>", "<|im_end|>"] and phi.eos == "<|end|>"
    assert phi_tok.special_ids == {"<|end|>": base.n_vocab, "<|assistant|>": base.n_vocab + 1,
                                   "<|im_end|>": base.eos_id}
    assert phi_tok.n_vocab == base.n_vocab + 2 and phi_tok.eot_id == base.n_vocab
    for k, (ours, template) in enumerate([(tok, chat.default_template()), (phi_tok, phi)]):
        out = tmp_path / f"export{k}"
        out.mkdir()
        tokenizer.save_tokenizer(ours, str(out))
        exported = transformers.AutoTokenizer.from_pretrained(str(out))
        for conv in CONVERSATIONS:
            assert chat.encode(ours, template, conv)[0] == exported.apply_chat_template(conv, return_dict=False)
    cfg.chat_format = "csv"
    with pytest.raises(chat.ChatDataError, match="chat_format='csv'"):
        chat.setup(cfg)


# ----------------------------------------------------------------------------- packing

def examples(n, seed=0, vocab=100):
    """Random examples: a prompt (mask False) then an answer (mask True)."""
    g = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        p, a = int(g.integers(1, 12)), int(g.integers(1, 10))
        out.append((g.integers(0, vocab, p + a).tolist(), [False] * p + [True] * a))
    return out


def test_pack_best_fit_and_drops():
    ex = [([1] * k, [False] + [True] * (k - 1)) for k in (5, 2, 3, 2, 9, 1, 4)]
    rows, dropped = chat.pack(ex, 4)  # rows of 5 tokens; 9 too long, 1 has no target
    assert dropped == {"too_long": 1, "no_target": 1}
    # longest first, each into the tightest row: 5 | 4 (1 left: too small for any) | 3+2 | 2
    assert [r.seg.tolist() for r in rows] == [[0] * 5, [0] * 4 + [-1], [0, 0, 0, 1, 1], [0, 0, -1, -1, -1]]
    assert rows[2].pos.tolist() == [0, 1, 2, 0, 1] and rows[3].pos.tolist() == [0, 1, 0, 0, 0]
    assert [r.mask.tolist() for r in rows[2:]] == [[False, True, True, False, True], [False, True] + [False] * 3]
    assert len(chat.pack(ex, 4, one_per_row=True)[0]) == 5
    with pytest.raises(chat.ChatDataError, match="1 examples are longer than a row of T\\+1=5 tokens.*9"):
        chat.pack(ex, 4, drop_long=False)
    with pytest.raises(chat.ChatDataError, match="no example fits"):
        chat.pack(ex[4:6], 4)


@pytest.mark.parametrize("pos_emb", ["rope", "learned"])
def test_packed_equals_unpacked(pos_emb, one_thread):
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=100, block_size=32, n_layer=2, n_head=2, n_embd=32, pos_emb=pos_emb,
                                    norm="rmsnorm" if pos_emb == "rope" else "layernorm"))
    ex = examples(12)
    rows, dropped = chat.pack(ex, 31)
    assert not dropped and len(rows) < len(ex) and max(r.seg.max() for r in rows) >= 2  # really packed
    x, y, pos, attn = chat.batch(rows)
    loss = model(x, y, reduction="none", pos=pos, attn_mask=attn)
    loss.sum().backward()
    packed = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    seg = torch.from_numpy(np.stack([r.seg for r in rows]))[:, 1:]
    got, want = [], []
    for r, row in enumerate(rows):
        for k in range(int(row.seg.max()) + 1):
            ids, mask = ex[[i for i, e in enumerate(ex) if e[0] == row.ids[row.seg == k].tolist()][0]]
            xi = torch.tensor([ids[:-1]])
            yi = torch.where(torch.tensor([mask[1:]]), torch.tensor([ids[1:]]), IGNORE)
            alone = model(xi, yi, reduction="none")
            alone.sum().backward()
            want.append(alone.sum().item())
            got.append(loss[r][seg[r] == k].sum().item())
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=1e-5)
    for n, p in model.named_parameters():
        torch.testing.assert_close(packed[n], p.grad, rtol=1e-5, atol=1e-6, msg=n)
    causal_only = model(x, y, reduction="none", pos=pos)  # without the block mask, examples see each other
    assert (causal_only - loss).abs().max() > 1e-3


def test_chat_loader():
    rows, _ = chat.pack(examples(40, 1), 20, one_per_row=True)
    assert len(rows) == 40
    one = chat.ChatLoader(rows, B=4, seed=3)
    ranks = [chat.ChatLoader(rows, B=2, rank=r, world=2, seed=3) for r in range(2)]
    seen = []
    for step in range(25):  # past two epochs (10 global batches of 4 rows each)
        x, y, pos, attn = one.next()
        parts = [loader.next() for loader in ranks]
        assert torch.equal(x, torch.cat([p[0] for p in parts])) and torch.equal(y, torch.cat([p[1] for p in parts]))
        assert not set(map(tuple, parts[0][0].tolist())) & set(map(tuple, parts[1][0].tolist()))
        seen.append(x)
    assert len({tuple(r) for x in seen[:10] for r in x.tolist()}) == 40  # an epoch visits every row once
    assert not torch.equal(torch.cat(seen[:10]), torch.cat(seen[10:20]))  # and the next is reshuffled
    state = one.state_dict()
    after = [one.next()[0] for _ in range(3)]
    resumed = chat.ChatLoader(rows, B=4, seed=0)
    resumed.load_state_dict(state)
    assert all(torch.equal(a, resumed.next()[0]) for a in after)
    with pytest.raises(ValueError, match="T=20 over 40 windows; this loader has T=20 over 39"):
        chat.ChatLoader(rows[:39], B=4).load_state_dict(state)
    with pytest.raises(chat.ChatDataError, match="fewer than one global batch"):
        chat.ChatLoader(rows[:3], B=2, world=2)
