"""plots.py: the PNGs are written and what they draw is the log, not a guess (no pixels compared).

Proves:
- from two run folders written by logs.Logger itself (one resumed mid-way, which repeats steps;
  one MoE run with a checkpoint), the curves drawn (read back from the figure's lines) equal the
  logged values, the last record of a repeated step winning; loss against tokens is step x
  batch_size x seq_len of the run's checkpoint config (a run without a checkpoint has no tokens
  curve unless tokens_per_step is given); MFU logged as "n/a" draws nothing, MoE panels appear when
  logged; the PNG is written;
- the attention map equals transformers' own attention probabilities (eager attention,
  output_attentions) of the same weights, every layer and head, for a LLaMA (RoPE, GQA) and a
  GPT-2 (learned positions) model, and its PNG is written;
- a folder without the log names the logs it has; a bad layer/head names the valid range.
"""
import json
import os
from types import SimpleNamespace

import pytest
import torch
from distributed import train_cfg

import checkpoint
import hf
import logs
import tokenizer
from model import ModelConfig, Transformer
from tools import plots

pytest.importorskip("matplotlib")
TINY = dict(block_size=32, n_layer=2, n_head=4, n_embd=32, init_std=0.3)


def log_run(folder, steps, extra=None, resume=None):
    """A run folder logged by logs.Logger: train records per step, val_loss every other step."""
    cfg = SimpleNamespace(out_dir=str(folder), tensorboard=False, wandb=False, mlflow=False)
    written = []
    for part in ([steps] + ([resume] if resume else [])):
        logger = logs.Logger(cfg, SimpleNamespace(is_main=True))
        for s in part:
            m = {"loss": 5.0 / s + len(written) * 1e-3, "lr": 1e-3 * s, "grad_norm": 1.0 + s, "tok_s": 100.0 * s,
                 "mfu": "n/a", "mem_gb": 0.1, **(extra(s) if extra else {})}
            logger.log(s, m)
            written.append((s, m))
            if s % 20 == 0:
                logger.log(s, {"val_loss": 6.0 / s})
                written.append((s, {"val_loss": 6.0 / s}))
        logger.close()
    return written


def last(written, key):
    out = {}
    for s, m in written:
        if key in m:
            out[s] = m[key]
    return sorted(out), [out[s] for s in sorted(out)]


def test_run_curves_equal_the_log(tmp_path):
    a, b = tmp_path / "dense", tmp_path / "moe"
    wa = log_run(a, [10, 20, 30], resume=[20, 30, 40])  # resumed from step 10's checkpoint
    wb = log_run(b, [10, 20], extra=lambda s: {"load_max": 1.0 + 1 / s, "aux_loss": 0.01 * s, "z_loss": 0.001,
                                              "dropped": 0.0, "mfu": 0.3})
    cfg = train_cfg(dict(TINY, vocab_size=64), batch_size=4, micro_batch_size=2, seq_len=16)
    checkpoint.save(str(b), 20, Transformer(ModelConfig.from_cfg(cfg)).state_dict(), None, cfg)
    out = tmp_path / "pics" / "run.png"
    drawn = plots.plot_runs([str(a), str(b)], str(out))
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    steps, loss = last(wa, "loss")
    assert steps == [10, 20, 30, 40] and loss[1] == wa[4][1]["loss"] != wa[1][1]["loss"]  # the resumed lineage's
    assert drawn["loss (step)"]["dense loss"] == (steps, loss)
    assert drawn["loss (step)"]["dense val_loss"] == last(wa, "val_loss")
    assert drawn["gradient norm (step)"]["dense grad_norm"] == last(wa, "grad_norm")
    assert drawn["learning rate (step)"]["moe lr"] == last(wb, "lr")
    assert drawn["tokens/s (step)"]["moe tok_s"] == last(wb, "tok_s")
    s, v = last(wb, "val_loss")
    assert drawn["loss (tokens)"] == {"moe loss": ([x * 64 for x in last(wb, "loss")[0]], last(wb, "loss")[1]),
                                      "moe val_loss": ([x * 64 for x in s], v)}
    assert drawn["MFU (step)"] == {"moe mfu": last(wb, "mfu")}  # dense logged "n/a"
    assert drawn["MoE: router losses (step)"] == {"moe aux_loss": last(wb, "aux_loss"),
                                                  "moe z_loss": last(wb, "z_loss")}
    assert drawn["MoE: busiest expert's load x n_experts (step)"] == {"moe load_max": last(wb, "load_max")}
    assert "validation bits per byte (step)" not in drawn
    kept = plots.plot_runs([str(a)], None, tokens_per_step=10)  # a metrics file kept without its checkpoints
    assert kept["loss (tokens)"]["dense loss"] == ([s * 10 for s in steps], loss)


def test_errors(tmp_path):
    (tmp_path / "sft_metrics.jsonl").write_text(json.dumps({"step": 1, "time": 0, "loss": 1.0}) + "\n")
    with pytest.raises(FileNotFoundError, match="sft_metrics.jsonl: pass --log=<stage>"):
        plots.plot_runs([str(tmp_path)], str(tmp_path / "x.png"))
    model = Transformer(ModelConfig(vocab_size=300, **TINY))
    with pytest.raises(ValueError, match="layers 0..1 and heads 0..3"):
        plots.plot_attention(model, tokenizer.get_tokenizer("cl100k_base", 300), "x", 2, 0, str(tmp_path / "a.png"))


@pytest.mark.parametrize("family", [dict(n_kv_head=2), dict(pos_emb="learned", norm="layernorm", activation="gelu",
                                                            bias=True, tie_embeddings=True)])
def test_attention_equals_transformers(family, tmp_path):
    transformers = pytest.importorskip("transformers")
    tok = tokenizer.get_tokenizer("cl100k_base", 300)
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=tok.n_vocab, **TINY, **family)).eval()
    hf.export_hf(model, str(tmp_path / "hf"))
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), attn_implementation="eager")
    prompt = "def add(a, b):\n    return a + b"
    ids = tok.encode(prompt)
    with torch.no_grad():
        theirs = ref(torch.tensor([ids]), output_attentions=True).attentions
    for layer in range(2):
        ours = plots.attention_weights(model, ids, layer)
        assert (ours - theirs[layer][0]).abs().max() <= 1e-5
    labels, w = plots.plot_attention(model, tok, prompt, 1, 3, str(tmp_path / "attn.png"))
    assert os.path.getsize(tmp_path / "attn.png") > 0 and len(labels) == len(ids)
    assert torch.equal(w, plots.attention_weights(model, ids, 1)[3])
