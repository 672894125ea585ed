"""No decoder emits an id its tokenizer cannot decode (issue 54, item 2). Offline, CPU, tiny models.

Proves:
- tokenizer holes: the ids below n_vocab that tiktoken refuses to decode are exactly find_holes'
  (cl100k_base: 16, o200k_base: 19; every other id decodes; a truncated BPE has none), and
  generate.Emittable keeps the ids below a tokenizer's n_vocab but its holes (an int n: 0..n-1);
- every decoder, given a model rigged so that the ids its tokenizer cannot decode have by far the
  largest logits (their head rows; unmasked, the decoder emits only such ids), emits only ids the
  tokenizer decodes, greedy and sampled: generate.generate and generate.decode (full cl100k_base:
  its holes, rows past its vocabulary, the padded rows; top-k candidates, the full race, top-p, n
  samples; the step traced whole by torch.compile fullgraph=True with the mask: capturable),
  generate.rollout (GRPO's), t5.generate (sentinels past a truncated tokenizer), prefix.generate,
  eval.py's generation (the CLI's gsm8k on an HF folder), sample.py (plain and --chat);
- the two crashes of issue 54 run to the end: the README's T5 commands (pretrain.py span corruption,
  a few steps, then sft.py --pack=False, whose step-0 evaluation decoded a sentinel) and grpo.py on
  GSM8K-style prompt data with reward=math from the full cl100k_base vocabulary (a rollout decoded a
  hole; here a checkpoint rigged to favour the holes, where a random one hits them by chance).
"""
import json
import os
import random
from types import SimpleNamespace

import pytest
import torch

import checkpoint
import config
import eval as ev
import generate
import grpo
import hf
import lifecycle
import pretrain
import sample
import sft
import tokenizer
import weights
from encoders import prefix as pfx
from encoders import t5
from model import ModelConfig, Transformer

pytestmark = pytest.mark.usefixtures("one_thread")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FULL = tokenizer.get_tokenizer("cl100k_base")      # holes 100256, 100261..100275; n_vocab 100277
SMALL = tokenizer.get_tokenizer("cl100k_base", 300)  # no holes
TINY = dict(n_layer=1, n_head=2, n_embd=16, block_size=64)


def rig(model, banned):
    """Blocks that add nothing (the last hidden state is the token's embedding, whose direction 0 is 1
    for every token) and head rows that read direction 0 with weight 50 for the `banned` ids, 0 for
    the others: the banned ids' logits exceed every other by far. -> model (eval mode)."""
    with torch.no_grad():
        for m in model.blocks.modules():
            if isinstance(m, torch.nn.Linear):
                m.weight.zero_()
                if m.bias is not None:
                    m.bias.zero_()
        emb, head = model.tok_emb.weight, model.head.weight
        emb.normal_(0, 0.02)
        emb[:, 0] = 1.0
        if head is not emb:
            head.normal_(0, 0.02)
            head[:, 0] = 0.0
        head[list(banned), 0] = 50.0
    return model.eval()


def decoder(tok, extra=3, **kw):
    """A tiny decoder of tok's vocabulary + `extra` rows, rigged: its banned ids (tok's holes, the extra
    and the padded rows) dominate. -> (model, the banned ids)."""
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=tok.n_vocab + extra, **TINY, **kw))
    banned = set(tok.holes) | set(range(tok.n_vocab, model.cfg.padded_vocab))
    return rig(model, banned), banned


def prompts(tok, seed=0, lengths=(5, 2, 7)):
    rnd = random.Random(seed)
    return [tok.encode(" ".join(rnd.choice(["the", "cat", "sat", "on", "a", "mat", "1", "+"]) for _ in range(n)))
            for n in lengths]


def check(tok, rows, banned):
    """Every id decodes (tok.decode raises on the others) and none is banned."""
    for row in rows:
        row = row.tolist() if hasattr(row, "tolist") else list(row)
        assert not set(row) & banned, sorted(set(row) & banned)
        tok.decode(row)


def test_holes_are_what_tiktoken_cannot_decode():
    for tok, n in ((FULL, 16), (tokenizer.get_tokenizer("o200k_base"), 19)):
        refused = []
        for i in range(tok.n_vocab):
            try:
                tok.decode([i])
            except KeyError:
                refused.append(i)
        assert tuple(refused) == tok.holes and len(refused) == n
    assert SMALL.holes == () and tokenizer.get_tokenizer("cl100k_base", 300, chat=True).holes == ()
    allowed = generate.Emittable(FULL, FULL.n_vocab + 20)
    assert (allowed.n, allowed.holes, int(allowed.mask.sum())) == (FULL.n_vocab, FULL.holes, 16)
    logits = torch.randn(2, FULL.n_vocab + 20)
    kept = allowed(logits)
    assert kept.shape == (2, FULL.n_vocab) and torch.isinf(kept[:, list(FULL.holes)]).all()
    assert torch.equal(kept[:, :100256], logits[:, :100256])
    small = generate.Emittable(7, 10)
    assert small.mask is None and torch.equal(small(logits[:, :10]), logits[:, :7])
    with pytest.raises(TypeError, match="tokenizer"):
        generate.Emittable("cl100k_base", 10)


def test_generate_decode_and_rollout_emit_only_decodable_ids():
    model, banned = decoder(FULL)
    ps = prompts(FULL)
    idx, mask = generate.pad_prompts(ps)
    unmasked = generate.generate(model, idx, 3, vocab=model.cfg.vocab_size, temperature=0, attention_mask=mask)
    assert set(unmasked[:, idx.shape[1]:].flatten().tolist()) <= banned  # what the rig makes of an unmasked decoder
    for kw in (dict(temperature=0), dict(temperature=1.0, seed=1), dict(temperature=1.0, top_k=40, seed=2),
               dict(temperature=0.7, top_p=0.9, seed=3)):
        out = generate.generate(model, idx, 6, vocab=FULL, attention_mask=mask, **kw)
        check(FULL, out[:, idx.shape[1]:], banned)
        for n, candidates in ((1, True), (3, True), (3, False)):
            r = generate.decode(model, ps, 6, vocab=FULL, n=n, candidates=candidates, **kw)
            check(FULL, r.tokens[:, r.prompt_len:], banned)
            assert r.texts(FULL) and bool(r.mask[:, r.prompt_len:].all())
    greedy = generate.decode(model, ps, 6, vocab=FULL, temperature=0)  # greedy: eager = fast, masked alike
    assert torch.equal(greedy.tokens, generate.generate(model, idx, 6, vocab=FULL, temperature=0, attention_mask=mask))
    traced = generate.decode(model, ps, 6, vocab=FULL, temperature=1.0, top_k=40, seed=2, bucket=4,
                             compile={"backend": "eager", "fullgraph": True})  # the masked step: one graph
    assert torch.equal(traced.tokens, generate.decode(model, ps, 6, vocab=FULL, temperature=1.0, top_k=40, seed=2,
                                                      bucket=4).tokens)
    torch._dynamo.reset()
    keep = {}
    for seed in (4, 5):  # GRPO's rollouts, the decoder kept between calls (its mask too)
        r, which = generate.rollout(model, ps, 4, 0, 1, 5, vocab=FULL, temperature=1.0, seed=seed, keep=keep)
        check(FULL, r.tokens[:, r.prompt_len:], banned)
        assert which == [i // 4 for i in range(12)] and len(r.texts(FULL)) == 12
    with pytest.raises(TypeError, match="vocab"):
        generate.decode(model, ps, 4)  # required: a caller cannot forget it


def test_t5_and_prefix_emit_only_decodable_ids():
    torch.manual_seed(0)
    model = t5.T5(t5.T5Config(vocab_size=SMALL.n_vocab + 5, n_layer=1, n_head=2, n_embd=16, ffn_hidden=32))
    banned = set(range(SMALL.n_vocab, model.cfg.padded_vocab))  # T5's sentinels, then the padded rows
    rig(model, banned)
    src, _ = generate.pad_prompts(prompts(SMALL))
    assert set(t5.generate(model, src, 3, vocab=model.cfg.vocab_size, temperature=0)[:, 1:].flatten().tolist()) <= banned
    for kw in (dict(temperature=0), dict(temperature=1.0, seed=1), dict(temperature=1.0, top_k=20, top_p=0.9, seed=2)):
        check(SMALL, t5.generate(model, src, 6, vocab=SMALL, **kw)[:, 1:], banned)
    base, banned = decoder(SMALL)
    torch.manual_seed(1)
    tuned = pfx.Prefixed(base, pfx.Prefix(base.cfg, 3))
    idx, mask = generate.pad_prompts(prompts(SMALL))
    unmasked = pfx.generate(tuned, idx, 3, vocab=base.cfg.vocab_size, temperature=0, attention_mask=mask)
    assert set(unmasked[:, idx.shape[1]:].flatten().tolist()) <= banned
    for kw in (dict(temperature=0), dict(temperature=1.0, seed=1), dict(temperature=1.0, top_k=20, seed=2)):
        check(SMALL, pfx.generate(tuned, idx, 6, vocab=SMALL, attention_mask=mask, **kw)[:, idx.shape[1]:], banned)


def test_eval_and_sample_emit_only_decodable_ids(tmp_path, capsys):
    """eval.py's gsm8k (generation) on an HF folder and sample.py on our checkpoint (plain and --chat) of
    a model whose rows past its tokenizer win: each runs to the end and prints decodable text."""
    model, banned = decoder(SMALL)
    hf.export_hf(model, str(tmp_path / "hf"), tokenizer=SMALL)
    gsm = tmp_path / "gsm.jsonl"
    gsm.write_text("".join(json.dumps({"question": f"What is {a} + 2?", "answer": f"#### {a + 2}"}) + "\n"
                           for a in range(4)))
    res = ev.main([str(tmp_path / "hf"), f"--tasks=gsm8k={gsm}", "--num_fewshot=1", "--max_new_tokens=5",
                   "--device=cpu", f"--results={tmp_path / 'res.json'}"])
    assert res["gsm8k"]["n"] == 4
    cfg = config.load(["--tokenizer=cl100k_base", "--tokenizer_vocab=300", f"--vocab_size={SMALL.n_vocab + 3}",
                       *(f"--{k}={v}" for k, v in TINY.items()), "--device=cpu"], extra=lifecycle.TRAIN)
    checkpoint.save(str(tmp_path / "ckpt"), 1, model.state_dict(), None, cfg)
    capsys.readouterr()
    for args in (["--prompt=the cat", "--n=3", "--temperature=1.0"], ["--temperature=0"]):
        sample.main([str(tmp_path / "ckpt"), "--tokens=6", "--device=cpu", *args])
        assert "--- sample 0 ---" in capsys.readouterr().out
    chat_model, _ = decoder(SMALL.with_chat(tokenizer.CHAT_TOKENS, tokenizer.CHAT_TOKENS[-1]))  # an SFT-like vocabulary
    cfg = config.load(["--tokenizer=cl100k_base", "--tokenizer_vocab=300", f"--vocab_size={SMALL.n_vocab + 5}",
                       *(f"--{k}={v}" for k, v in TINY.items()), "--device=cpu"], extra=sft.EXTRA)
    checkpoint.save(str(tmp_path / "chat"), 1, chat_model.state_dict(), None, cfg)
    sample.main([str(tmp_path / "chat"), "--chat", "--prompt=What is 1 + 2?", "--tokens=6", "--device=cpu", "--n=2"])
    assert "--- answer 1 ---" in capsys.readouterr().out


def test_readme_t5_commands_run(tmp_path):
    """pretrain.py configs/tiny_t5.py (tiny, 20 steps: its greedy first token is already a sentinel,
    <extra_id_0>, which every target starts with), then sft.py --init_from=it --pack=False: the step-0
    evaluation decodes its answers (it raised KeyError: 'Invalid token for decoding')."""
    rnd = random.Random(1)
    words = "the a man woman dog cat runs jumps into over under ball water car house red blue then and".split()
    (tmp_path / "corpus").mkdir()
    for i in range(40):
        (tmp_path / "corpus" / f"d{i}.md").write_text("\n".join(" ".join(rnd.choice(words) for _ in range(12))
                                                               for _ in range(8)))
    run = tmp_path / "tiny_t5"
    pretrain.main([os.path.join(ROOT, "configs/tiny_t5.py"), f"--data={tmp_path / 'corpus'}",
                   f"--data_dir={tmp_path / 'prep'}",
                   f"--out_dir={run}", "--device=cpu", "--tokenizer_vocab=300", "--max_docs=0", "--clean=False",
                   "--dedup=none", "--n_layer=1", "--n_head=2", "--n_embd=32", "--ffn_hidden=64", "--block_size=64",
                   "--batch_size=8", "--micro_batch_size=8", "--max_steps=20", "--warmup_steps=2", "--lr=1e-2",
                   "--eval_every=0", "--ckpt_every=0", "--progress=False"])
    path = checkpoint.latest(str(run))
    model = t5.T5(t5.T5Config.from_cfg(SimpleNamespace(**hf.read_config(path))))
    weights.load_model(path, model)
    src = torch.tensor([SMALL.encode("the dog runs into the water")])
    first = int(t5.generate(model, src, 1, vocab=model.cfg.vocab_size, temperature=0)[0, 1])
    assert first >= SMALL.n_vocab  # a sentinel: unmasked, the evaluation would decode it
    out = tmp_path / "sft_t5"
    sft.main([os.path.join(ROOT, "configs/sft_tiny.py"), f"--init_from={run}", "--pack=False", f"--out_dir={out}",
              "--device=cpu", "--n_train=64", "--n_eval=8", "--batch_size=4", "--micro_batch_size=4", "--max_steps=2",
              "--progress=False"])
    with open(out / "train_metrics.jsonl") as f:
        assert [r["step"] for r in map(json.loads, f) if "accuracy" in r] == [0, 2]


def test_grpo_on_gsm8k_data_from_the_full_vocabulary(tmp_path):
    """grpo.py with GSM8K-style prompt data and reward=math from a checkpoint of the full cl100k_base
    vocabulary (+ the chat tokens, + one row past them) whose holes and extra rows win: its rollouts
    and held-out evaluations decode (a hole raised KeyError there), one step logs its reward."""
    chat = FULL.with_chat(tokenizer.CHAT_TOKENS, tokenizer.CHAT_TOKENS[-1])
    model, banned = decoder(chat, extra=1)
    cfg = config.load(["--tokenizer=cl100k_base", f"--vocab_size={chat.n_vocab + 1}",
                       *(f"--{k}={v}" for k, v in TINY.items()), "--device=cpu"], extra=lifecycle.TRAIN)
    checkpoint.save(str(tmp_path / "init"), 1, model.state_dict(), None, cfg)
    gsm = tmp_path / "gsm.jsonl"
    gsm.write_text("".join(json.dumps({"question": f"Tom has {a} apples and buys {a + 3} more. How many now?",
                                       "answer": f"{a} + {a + 3} = {2 * a + 3}\n#### {2 * a + 3}"}) + "\n"
                           for a in range(20)))
    grpo.main([f"--init_from={tmp_path / 'init'}", f"--prompt_data={gsm}", "--reward=math", "--eval_percent=20",
               f"--out_dir={tmp_path / 'grpo'}", "--device=cpu", "--batch_size=8", "--group_size=4",
               "--micro_batch_size=4", "--max_new_tokens=6", "--max_steps=1", "--eval_every=1", "--log_every=1",
               "--ckpt_every=0", "--progress=False", "--warmup_steps=0"])
    with open(tmp_path / "grpo" / "train_metrics.jsonl") as f:
        rows = [json.loads(line) for line in f]
    assert any("reward" in r for r in rows) and any("heldout_greedy" in r for r in rows)
