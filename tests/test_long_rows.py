"""Long rows (issue 58): one document per row, long documents offline, and a long-context retrieval task.

Proves: data.Documents (rows="documents") puts exactly one document per row: every row's real tokens are a document's
tokens (EOS-ended, as prepare writes them), or, for a document longer than the row, its consecutive pieces (split:
each token after the first a target exactly once) or its head (truncate); the rest is EOS padding whose targets are
IGNORE. Its description reports the rows' length distribution and padding share (worked out here with numpy) and says
how many documents were cut and how. Data-parallel ranks read disjoint rows whose union is one process' batch, a
saved state resumes the identical rows, and pretrain.py with rows="documents" stopped and resumed logs exactly the
uninterrupted run's losses. A padded row's loss is each document's loss alone (the model's plain causal path: SDPA
gets no mask and is_causal=True), and so are chat rows of one conversation each (chat.batch gives no mask and cuts
the batch to its longest row, rounded up to a multiple of 64 and of T/16; the packed path still does). Greedy
held-out answers decode at most a training micro-step's tokens at a time (counted calls), giving one batched call's
answers. Bad settings are one line. join_docs: corpus groups (a folder's files together) are joined into documents of
at least N tokens that never mix two groups. The retrieval task: the asked number sits at the requested depth (tokens
counted with the tokenizer, a truncated one too), min_depth / spread (log-uniform depths) / length / keys shape the
prompt, answer="sentence" answers with the needle's own sentence, the reward scores right 1 and wrong / near misses
0, train and test numbers never meet (hash split), items are deterministic, and by_depth bins accuracy by distance as
worked by hand.
"""
import json
import os
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import chat  # noqa: E402
import config  # noqa: E402
import data  # noqa: E402
import model as model_mod  # noqa: E402
import pretrain  # noqa: E402
import tokenizer  # noqa: E402
from corpora import corpus, prepare  # noqa: E402
from model import IGNORE, ModelConfig, Transformer  # noqa: E402
from posttrain import retrieval, tasks  # noqa: E402

EOS = 999
# documents as prepare writes them (each ends in EOS); lengths 3, 9, 1 (a lone EOS), 5, 14, 2, 6
DOCS = [[1, 2, EOS], list(range(10, 18)) + [EOS], [EOS], [3, 4, 5, 6, EOS], list(range(20, 33)) + [EOS], [7, EOS],
        [40, 41, 42, 43, 44, EOS]]


def token_file(tmp_path, docs=DOCS, tail=()):
    d = tmp_path / "tokens"
    d.mkdir(exist_ok=True)
    np.array([t for doc in docs for t in doc] + list(tail), dtype=np.uint16).tofile(d / "train.bin")
    (d / "meta.json").write_text(json.dumps({"dtype": "uint16", "eos_id": EOS}))
    return str(d / "train.bin")


def pieces(doc, T, cut):
    """A document's rows by hand: consecutive windows of T + 1 sharing one token, or the head only."""
    out = [doc[k:k + T + 1] for k in range(0, max(len(doc) - 1, 1), T)] if len(doc) >= 2 else []
    return out[:1] if cut == "truncate" else out


def all_rows(loader):
    """Every row of one epoch (as real-token lists), read through next()."""
    got = []
    for _ in range(loader.n_windows // (loader.B * loader.world)):
        x, y = loader.next()
        for xr, yr in zip(x.tolist(), y.tolist()):
            n = sum(t != IGNORE for t in yr)  # targets: the real tokens after the first
            assert all(t == IGNORE for t in yr[n:]) and all(t == EOS for t in xr[n + 1:])  # padding after
            assert yr[:n - 1] == xr[1:n]  # y is x shifted, on the real part
            got.append(xr[:n] + [yr[n - 1]])
    return got


@pytest.mark.parametrize("cut", ["split", "truncate"])
def test_one_document_per_row(tmp_path, cut):
    T = 4
    path = token_file(tmp_path, tail=[50, 51, 52])  # a last document without EOS (a validation split cut it)
    loader = data.Documents(path, B=1, T=T, seed=3, cut=cut)
    docs = DOCS + [[50, 51, 52]]
    want = sorted(p for d in docs for p in pieces(d, T, cut))
    assert loader.n_windows == len(want) and sorted(all_rows(loader)) == want
    lengths = [len(p) for p in want]
    long = sum(len(d) > T + 1 for d in docs)
    assert loader.counts == dict(documents=7, long=long, rows=len(want),
                                 cut_tokens=sum(len(d) - len(p) for d in docs for p in pieces(d, T, cut)[:1])
                                 if cut == "truncate" else 0)
    line = loader.describe()
    q = np.percentile(lengths, [0, 50, 90, 100])
    assert f"min {q[0]:,.0f} / median {q[1]:,.0f} / p90 {q[2]:,.0f} / max {q[3]:,.0f} tokens" in line
    assert f"{1 - sum(lengths) / (len(lengths) * (T + 1)):.1%} padding" in line
    assert f"{long:,} longer than a row of {T + 1}" in line
    assert ("split into consecutive rows" if cut == "split" else f"{loader.counts['cut_tokens']:,} tokens") in line


def test_ranks_disjoint_and_resume(tmp_path):
    docs = [list(range(100 + 10 * i, 100 + 10 * i + 1 + i % 7)) + [EOS] for i in range(40)]
    path = token_file(tmp_path, docs)
    one = data.Documents(path, B=4, T=5, seed=7)
    ranks = [data.Documents(path, B=2, T=5, rank=r, world=2, seed=7) for r in range(2)]
    for _ in range(30):  # past two epochs
        x, y = one.next()
        parts = [r.next() for r in ranks]
        assert torch.equal(x, torch.cat([p[0] for p in parts])) and torch.equal(y, torch.cat([p[1] for p in parts]))
        assert not set(map(tuple, parts[0][0].tolist())) & set(map(tuple, parts[1][0].tolist()))
    state = json.loads(json.dumps(one.state_dict()))
    want = [one.next() for _ in range(12)]
    again = data.Documents(path, B=4, T=5, seed=0)
    again.load_state_dict(state)
    for x, y in want:
        gx, gy = again.next()
        assert torch.equal(gx, x) and torch.equal(gy, y)
    with pytest.raises(ValueError, match="T=5"):
        data.Documents(path, B=4, T=6).load_state_dict(state)


def test_padded_row_is_each_document_alone_on_the_causal_path(tmp_path, monkeypatch):
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=1000, block_size=16, n_layer=2, n_head=2, n_embd=32))
    loader = data.Documents(token_file(tmp_path), B=6, T=8, seed=1)  # 7 rows: every document whole but one
    calls = []
    real = F.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, **kw):
        calls.append((attn_mask is None, is_causal))
        return real(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, **kw)
    monkeypatch.setattr(model_mod.F, "scaled_dot_product_attention", spy)
    x, y = loader.next()
    loss = model(x, y, reduction="none")
    assert calls and all(c == (True, True) for c in calls)
    for r in range(len(x)):
        n = int((y[r] != IGNORE).sum())
        alone = model(x[r:r + 1, :n], y[r:r + 1, :n], reduction="none")
        torch.testing.assert_close(loss[r, :n], alone[0], rtol=1e-5, atol=1e-6)
        assert (loss[r, n:] == 0).all()


def test_chat_rows_of_one_conversation_take_the_causal_path():
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=100, block_size=32, n_layer=2, n_head=2, n_embd=32))
    ex = [(list(range(1, 1 + k)), [False] * 2 + [True] * (k - 2)) for k in (9, 5, 12, 3)]
    rows, _ = chat.pack(ex, 15, one_per_row=True)
    x, y, pos, attn = chat.batch(rows)
    assert pos is None and attn is None and x.shape == y.shape == (4, 15)  # T=15 (< 64: never cut)
    for T, k, n in [(2048, 70, 128), (2048, 200, 256), (2048, 1100, 1152), (299, 200, 256), (299, 290, 299)]:
        one = (list(range(1, 1 + k)), [False] + [True] * (k - 1))  # a conversation of k tokens
        got = chat.batch(chat.pack([one], T, one_per_row=True)[0])
        assert got[0].shape == got[1].shape == (1, n)  # cut to a multiple of 64 and of T/16, at most T
        assert (got[1][0, :k - 1] != IGNORE).all() and (got[1][0, k - 1:] == IGNORE).all()
    loss = model(x, y, reduction="none")
    for r, row in enumerate(rows):
        ids, mask = next(e for e in ex if e[0] == row.ids[row.seg == 0].tolist())
        yi = torch.where(torch.tensor([mask[1:]]), torch.tensor([ids[1:]]), IGNORE)
        alone = model(torch.tensor([ids[:-1]]), yi, reduction="none")
        torch.testing.assert_close(loss[r, :len(ids) - 1], alone[0], rtol=1e-5, atol=1e-6)
    packed, _ = chat.pack(ex, 15)
    assert any(r.seg.max() > 0 for r in packed) and chat.batch(packed)[3] is not None  # packed: the block mask


def test_long_prompts_decode_in_rows_of_a_micro_step(monkeypatch):
    import generate
    import weights
    tok = tokenizer.get_tokenizer("cl100k_base", 300)
    template = chat.default_template()
    tok = tok.with_chat(template.special_tokens, template.eos)
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=tok.n_vocab, block_size=128, n_layer=2, n_head=2, n_embd=32)).eval()
    prompts = [[{"role": "user", "content": " ".join(["one two"] * k)}] for k in (3, 5, 7, 1, 4)]
    lengths = [len(chat.encode(tok, template, p, add_generation_prompt=True)[0]) for p in prompts]
    calls, decode = [], generate.decode
    monkeypatch.setattr(generate, "decode", lambda m, ids, *a, **kw: (calls.append(len(ids)), decode(m, ids, *a,
                                                                                                   **kw))[1])
    cfg = SimpleNamespace(block_size=128, eval_tokens=5, micro_batch_size=8)
    one = weights.DECODER.answers(model, tok, template, prompts, cfg)
    assert calls == [5]  # 8 x 128 tokens hold every prompt and its answer
    assert 128 // (max(lengths) + 5) == 2  # one row of 128 tokens holds two prompts and their answers
    del calls[:]
    cfg.micro_batch_size = 1
    assert weights.DECODER.answers(model, tok, template, prompts, cfg) == one and calls == [2, 2, 1]


def test_bad_row_settings_are_one_line():
    cfg = SimpleNamespace(**{**data.DATA_DEFAULTS, **data.ROWS_DEFAULTS})
    for key, value, match in [("rows", "docs", "rows='docs'"), ("doc_cut", "drop", "doc_cut='drop'")]:
        with pytest.raises(config.ConfigError, match=match):
            data.check_rows(SimpleNamespace(**{**vars(cfg), key: value}))
    with pytest.raises(config.ConfigError, match="shard sets are streamed"):
        data.check_rows(SimpleNamespace(**{**vars(cfg), "rows": "documents", "data": "shards:x"}))
    with pytest.raises(config.ConfigError, match="objective='mlm' reads windows"):
        pretrain.check(config.load(["--rows=documents", "--objective=mlm"], extra=pretrain.EXTRA, world=1))


def test_pretrain_on_documents_resumes_exactly(tmp_path, capsys):
    root = tmp_path / "corpus"
    for i in range(30):
        (root / f"p{i % 3}").mkdir(parents=True, exist_ok=True)
        (root / f"p{i % 3}" / f"{i:02d}.md").write_text(" ".join(f"word{j * i % 17}" for j in range(5 + 9 * i)))
    common = [f"--data={root}", f"--data_dir={tmp_path / 'data'}", "--tokenizer_vocab=512", "--n_layer=1",
              "--n_head=2", "--n_embd=16", "--block_size=64", "--batch_size=4", "--micro_batch_size=2",
              "--max_steps=4", "--ckpt_every=2", "--log_every=1", "--eval_every=0", "--sample_tokens=0",
              "--progress=False", "--rows=documents", "--join_docs=100", "--val_tokens=0", "--val_fraction=0.1"]

    def run(out, *extra):
        pretrain.main(common + [f"--out_dir={tmp_path / out}", *extra])
        with open(tmp_path / out / "train_metrics.jsonl") as f:
            return {r["step"]: r["loss"] for r in map(json.loads, f) if "loss" in r}
    full = run("full")
    assert "one document per row:" in capsys.readouterr().out
    run("part", "--stop_at=2")
    part = run("part", "--resume=True")
    assert full == part and sorted(full) == [1, 2, 3, 4]


def test_join_docs_groups_and_lengths(tmp_path):
    tok = tokenizer.get_tokenizer("cl100k_base", 4096)
    root = tmp_path / "corpus"
    texts = {}
    for g in ("a", "b", "c"):
        (root / g).mkdir(parents=True)
        for i in range(6 if g != "c" else 1):
            texts[(g, i)] = f"{g}{i} " + " ".join(f"{g}w{j}" for j in range(7 * (i + 1)))
            (root / g / f"{i}.md").write_text(texts[(g, i)])
    pairs = list(corpus.iter_documents(str(root), groups=True))
    assert [g for g, _ in pairs] == [str(root / g) for g in "aaaaaabbbbbbc"]
    meta = prepare.prepare(str(root), tok, str(tmp_path / "out"), val_fraction=0, val_tokens=0, verbose=False,
                           join_docs=40)
    stream = np.fromfile(tmp_path / "out" / "train.bin", dtype=np.uint16).tolist()
    ends = [i + 1 for i, t in enumerate(stream) if t == tok.eos_id]
    docs = [tok.decode(stream[a:b - 1]) for a, b in zip([0] + ends[:-1], ends)]
    assert "".join(docs).replace(prepare.JOIN, "") == "".join(texts.values())  # every text once, in order
    for doc in docs:
        parts = doc.split(prepare.JOIN)
        assert len({p[0] for p in parts}) == 1  # one group's texts
        counted = sum(len(tok.encode(p)) for p in parts)
        assert counted >= 40 or parts[0].startswith("c0")  # group c is one short text
    assert meta["joined"] == {"texts": 13, "documents": len(docs), "short": 1}
    assert "-join40-" in prepare.default_data_dir(str(root), "cl100k_base", 4096, join_docs=40)


# ----------------------------------------------------------------------------- the retrieval task

def tokens_after(tok, text, answer):
    """Tokens of the prompt after the asked number, counted on the whole prompt's encoding."""
    ids = tok.encode(text)
    end = text.index(f" is {answer}.") + len(f" is {answer}")
    cum = np.cumsum([len(b) for b in tok.token_bytes(ids)])
    return len(ids) - int(np.searchsorted(cum, len(text[:end].encode()), "left")) - 1


def test_retrieval_depth_is_counted_in_tokens():
    tok = tokenizer.get_tokenizer("cl100k_base")
    task = tasks.get("retrieval", dict(depth=8192))
    for it in task.train(3, seed=1) + task.test(3, seed=1):
        text = it["prompt"][0]["content"]
        assert tokens_after(tok, text, it["answer"]) == it["depth"] and 8192 <= it["depth"] < 8192 + 12
        assert len(tasks.NUMBER.findall(text)) == 1 and text.endswith("Answer with the number only.")
    task = tasks.get("retrieval", dict(depth=400, min_depth=100, length=1000, keys=4))
    items = task.train(40, seed=2)
    assert all(100 <= it["depth"] < 412 for it in items) and len({it["depth"] for it in items}) > 20
    for it in items[:5]:
        text = it["prompt"][0]["content"]
        assert tokens_after(tok, text, it["answer"]) == it["depth"] and 1000 <= len(tok.encode(text)) < 1020
        assert len(set(tasks.NUMBER.findall(text))) == 4 and it["answer"] in text
    for spread, lo, hi in (("log", 0.4, 0.6), ("uniform", 0.0, 0.2)):  # below the geometric mean 724: half if log
        task = tasks.get("retrieval", dict(depth=8192, min_depth=64, spread=spread))
        depths = [it["depth"] for it in task.train(200)]
        assert all(64 <= d < 8192 + 12 for d in depths) and lo < sum(d < 724 for d in depths) / 200 < hi
    with pytest.raises(tasks.TaskError, match="spread"):
        tasks.get("retrieval", dict(depth=8192, spread="log"))  # log needs min_depth
    small = tokenizer.get_tokenizer("cl100k_base", 512)  # a truncated vocabulary: more tokens for the same text
    for it in tasks.get("retrieval", dict(depth=300, tokenizer_vocab=512)).test(3):
        assert tokens_after(small, it["prompt"][0]["content"], it["answer"]) == it["depth"] and 300 <= it["depth"] < 330


def test_retrieval_reward_split_and_determinism():
    task = tasks.get("retrieval", dict(depth=64, keys=3))
    it = task.test(1, seed=0)[0]
    a = it["answer"]
    other = next(v for v in tasks.NUMBER.findall(it["prompt"][0]["content"]) if v != a)
    near = a[:-1] + str((int(a[-1]) + 1) % 10)
    for completion, reward, strict, lenient in [
            (a, 1, 1, 1), (f" {a}<|im_end|>", 1, 1, 1), (f"The pass key is {a}.", 1, 0, 1),
            (near, 0, 0, 0), (other, 0, 0, 0), (f"{other}, no, {a}", 0, 0, 1), (a[:4], 0, 0, 0),
            (a + "7", 0, 0, 0), ("I do not know", 0, 0, 0)]:
        assert task.reward(completion, it) == reward and task.accuracy(completion, it) == (strict, lenient), completion
    assert task.reward_fn()([it["prompt"]], [a], answer=[a], depth=[it["depth"]]) == [1.0]
    train = {t["answer"] for t in task.train(2000, seed=1)}
    test = task.test(300, seed=1)
    assert len({t["answer"] for t in test}) == 300 and not train & {t["answer"] for t in test}
    assert all(tasks.held_out(t["answer"], 10) for t in test) and not any(tasks.held_out(a, 10) for a in train)
    assert task.train(5, seed=4) == task.train(5, seed=4) != task.train(5, seed=5)
    conv = task.sft_examples(2, seed=4)[1]
    assert conv[:-1] == task.train(2, seed=4)[1]["prompt"] and conv[-1] == {"role": "assistant", "content":
                                                                          task.train(2, seed=4)[1]["answer"]}
    with pytest.raises(tasks.TaskError, match="depth >= 16"):
        tasks.get("retrieval", dict(depth=400, length=300))
    tok = tokenizer.get_tokenizer("cl100k_base")  # answer="sentence": the answer restates the needle
    for keys in (1, 3):
        task = tasks.get("retrieval", dict(depth=200, keys=keys, answer="sentence"))
        for it, conv in zip(task.train(4, seed=6), task.sft_examples(4, seed=6)):
            text, said = it["prompt"][0]["content"], conv[-1]["content"]
            assert text.endswith("?") and tokens_after(tok, text, it["answer"]) == it["depth"]
            assert said == it["needle"] + "." and said[:-1] in text and task.reward(said, it) == 1.0
            assert said.startswith("The pass key ") and said.endswith(f" is {it['answer']}.")
    with pytest.raises(tasks.TaskError, match="answer number or sentence"):
        tasks.get("retrieval", dict(depth=400, answer="word"))


def test_retrieval_accuracy_by_depth():
    items = [{"depth": d} for d in (100, 110, 150, 199, 200, 260, 299)]
    scores = [1, 1, 0, 1, 0, 0, 1]
    # depths 100..299 in 4 ranges of 50: [100, 150) [150, 200) [200, 250) [250, 300)
    assert retrieval.Retrieval.by_depth(items, scores) == [(100, 149, 2, 1.0), (150, 199, 2, 0.5), (200, 249, 1, 0.0),
                                                       (250, 299, 2, 0.5)]
