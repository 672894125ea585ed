"""sft.py for the other architectures: a T5 sequence to sequence, and prefix tuning of a decoder.

Proves:
- seq2seq.rows / seq2seq.batch by hand: the prompt's messages as plain lines -> source ids, the answer
  then EOS -> target ids, too-long pairs dropped and counted; right padding (0 in the source, IGNORE
  in the targets) and the source mask.
- a T5 init_from (one of our T5 checkpoints: objective "span" is read from it) trains sequence to
  sequence: the first logged loss is the mean NLL over the first global batch's target tokens of the
  initial model (the batch rebuilt from the same rows and seed); under DP2 (2 gloo ranks) the weights
  after 3 steps equal one process's (<= 1e-5) and the held-out accuracy (seq2seq.answers: t5.generate's
  greedy answers) is the same; export_hf writes a folder transformers' T5ForConditionalGeneration loads
  with the final model's logits (<= 1e-4).
- prefix tuning (prefix_tokens > 0) on packed rows: prefix.prefixed's (B, T, T) mask with N prefix
  columns and positions + N gives each packed example the logits it has alone after the prefix (2-D
  mask, as peft; <= 1e-5); sft.main trains only the prefix (the base bitwise unchanged, the prefix
  moved), writes it in PEFT's format into each checkpoint (load_peft gives the saved table), and
  under DP2, and resumed from step 2 in a new folder, ends with the one-process weights (<= 1e-5).
- refusals, one line: prefix tuning with LoRA, a T5 with pack=True.
"""
import collections
import json

import pytest
import torch
from distributed import assert_close, spawn
from safetensors.torch import load_file
from test_sft import COMMON, STEPS, TINY, run_cfg

import checkpoint
import config
import sft
import tokenizer
import weights
from encoders import prefix as pfx
from encoders import seq2seq, t5
from fused import IGNORE
from model import ModelConfig, Transformer
from posttrain import tasks

pytestmark = pytest.mark.usefixtures("one_thread")
TOK = tokenizer.get_tokenizer("cl100k_base", 512)
T5_TINY = dict(tokenizer="cl100k_base", tokenizer_vocab=512, vocab_size=520, n_layer=2, n_head=4, n_embd=32,
               ffn_hidden=48, activation="gated-gelu", tie_embeddings=True, block_size=64, objective="span")
PREFIX = ["--prefix_tokens=4", "--lr=1e-2"]


def test_seq2seq_rows_and_batch_by_hand():
    conv = [{"role": "system", "content": "Add."}, {"role": "user", "content": "What is 1 + 2?"},
            {"role": "assistant", "content": "3"}]
    long = [{"role": "user", "content": "x " * 80}, {"role": "assistant", "content": "y"}]
    rows, dropped = seq2seq.rows([conv, long], TOK, 16)
    assert rows == [(TOK.encode("Add.\nWhat is 1 + 2?"), TOK.encode("3") + [TOK.eos_id])]
    assert dropped == collections.Counter(too_long=1)
    src, y, pos, mask = seq2seq.batch([([5, 6, 7], [8, 9]), ([4], [3, 2, 1])])
    assert pos is None
    assert src.tolist() == [[5, 6, 7], [4, 0, 0]] and mask.tolist() == [[1, 1, 1], [1, 0, 0]]
    assert y.tolist() == [[8, 9, IGNORE], [3, 2, 1]]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """Our T5 checkpoint and our decoder checkpoint (tiny, random), then the one-process SFT runs."""
    root = tmp_path_factory.mktemp("sft_arch")
    torch.manual_seed(0)
    cfg = run_cfg(**T5_TINY)
    checkpoint.save(str(root / "t5init"), 5, t5.T5(weights.model_config(cfg)).state_dict(), None, cfg, run_id="t5")
    cfg = run_cfg(**TINY)
    checkpoint.save(str(root / "init"), 7, Transformer(ModelConfig.from_cfg(cfg)).state_dict(), None, cfg,
                    run_id="init")
    sft.main(t5_args(root, "t5_ref", f"--export_hf={root}/t5_hf"))
    sft.main(prefix_args(root, "prefix_ref"))
    return root


def t5_args(root, name, *extra):
    return [f"--init_from={root}/t5init", f"--out_dir={root}/{name}", *COMMON, "--pack=False", *extra]


def prefix_args(root, name, *extra):
    return [f"--init_from={root}/init", f"--out_dir={root}/{name}", *COMMON, *PREFIX, *extra]


def saved(root, name, step=STEPS):
    return load_file(str(root / name / f"step_{step:06d}" / "model.safetensors"))


def logged(root, name, key):
    with open(root / name / "train_metrics.jsonl") as f:
        return [r[key] for r in map(json.loads, f) if key in r]


def _runs(rank, runs):
    for argv in runs:
        sft.main(argv)


@pytest.fixture(scope="module")
def two(root):
    spawn(_runs, 2, [t5_args(root, "t5_dp2"), prefix_args(root, "prefix_dp2"),
                     prefix_args(root, "prefix_resume", f"--resume={root}/prefix_ref/step_000002")])
    return root


def test_t5_first_loss_is_the_batch_mean(root):
    cfg = run_cfg(**T5_TINY, n_train=64, seed=1337)
    task = tasks.get("arithmetic", {})
    rows, _ = seq2seq.rows(task.sft_examples(64, cfg.seed), TOK, cfg.block_size)
    loader = seq2seq.PairLoader(rows, 1, seed=cfg.seed)
    model = t5.T5(weights.model_config(cfg))
    weights.load_model(str(root / "t5init" / "step_000005"), model)
    nll, count = 0.0, 0
    with torch.no_grad():
        for _ in range(4):  # batch_size 4 = 4 micro-steps of 1 row
            src, y, _, mask = loader.next()
            nll += model(src, y, src_mask=mask, reduction="sum").item()
            count += int((y != IGNORE).sum())
    assert abs(logged(root, "t5_ref", "loss")[0] - nll / count) <= 1e-5 * nll / count


def test_t5_dp2_and_export(two):
    root = two
    assert_close(saved(root, "t5_dp2"), saved(root, "t5_ref"), "T5 seq2seq DP2 weights")
    assert logged(root, "t5_dp2", "accuracy") == logged(root, "t5_ref", "accuracy")
    assert len(logged(root, "t5_ref", "accuracy")) == 2
    tr = pytest.importorskip("transformers")
    ref = tr.T5ForConditionalGeneration.from_pretrained(str(root / "t5_hf")).eval()
    ours = t5.T5(weights.model_config(run_cfg(**T5_TINY)))
    weights.load_model(str(root / "t5_ref" / f"step_{STEPS:06d}"), ours)  # (the tied head filled in)
    x = torch.randint(0, 512, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = (ours.eval()(x, tgt=x[:, :5]) - ref(input_ids=x, decoder_input_ids=x[:, :5]).logits).abs().max()
    assert diff <= 1e-4


def test_prefix_on_packed_rows_equals_each_example_alone():
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=97, n_layer=2, n_head=4, n_kv_head=2, n_embd=32, block_size=64))
    prefix = pfx.Prefix(model.cfg, 3)
    a, b = torch.randint(0, 97, (1, 7)), torch.randint(0, 97, (1, 5))
    x = torch.cat([a, b], 1)
    seg = torch.tensor([0] * 7 + [1] * 5)
    mask = (seg[:, None] == seg[None, :]) & torch.ones(12, 12, dtype=torch.bool).tril()
    pos = torch.cat([torch.arange(7), torch.arange(5)])[None]
    with torch.no_grad():
        packed = pfx.prefixed(model, prefix, x, pos=pos, attn_mask=mask[None])
        alone = [pfx.prefixed(model, prefix, t, attn_mask=torch.ones_like(t)) for t in (a, b)]
    assert_close(packed, torch.cat(alone, 1), "packed prefix logits")


def test_prefix_sft(two):
    root = two
    init = checkpoint.read_weights(str(root / "init" / "step_000007"),
                                   **weights.reference(ModelConfig.from_cfg(run_cfg(**TINY))))
    ref = saved(root, "prefix_ref")
    with open(root / "prefix_ref" / f"step_{STEPS:06d}" / "config.json") as f:
        n_vocab = json.load(f)["vocab_size"]
    assert n_vocab == TOK.n_vocab + 2  # <|im_start|>, <|im_end|> added
    grown = ModelConfig.from_cfg(run_cfg(**{**TINY, "vocab_size": n_vocab}))
    init = weights.fit_weights(init, dict(vocab_size=TINY["vocab_size"]), grown)  # the loaded base (new rows: means)
    for k, v in init.items():
        assert torch.equal(ref[k], v), f"prefix tuning changed the base's {k}"
    assert set(ref) - set(init) == {"prefix.embedding.weight"}
    first = saved(root, "prefix_ref", 2)["prefix.embedding.weight"]
    assert not torch.equal(first, ref["prefix.embedding.weight"]), "the prefix did not train"
    peft = pfx.load_peft(str(root / "prefix_ref" / f"step_{STEPS:06d}"), ModelConfig.from_cfg(run_cfg(**TINY)))
    assert torch.equal(peft.embedding.weight, ref["prefix.embedding.weight"])
    for name in ("prefix_dp2", "prefix_resume"):
        assert_close(saved(root, name), ref, f"{name} weights")
    assert logged(root, "prefix_dp2", "accuracy") == logged(root, "prefix_ref", "accuracy")


@pytest.mark.parametrize("extra, init, match", [
    (["--prefix_tokens=4", "--lora_r=4"], "init", "not with LoRA"),
    (["--pack=True"], "t5init", "set pack=False"),
])
def test_refusals(root, extra, init, match):
    argv = [f"--init_from={root}/{init}", f"--out_dir={root}/refused", *COMMON, *extra]
    with pytest.raises(config.UserError, match=match):
        sft.main(argv)
    assert not (root / "refused").exists()
