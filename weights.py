"""A run's initial weights: init_from (our checkpoint or run folder, or a local HF folder), and weights into a plain model.

    started = weights.configure(cfg)       # init_from's model keys and tokenizer become cfg's
    raw = weights.build_model(cfg, grid)   # the full model on the device, seeded; init_from's weights come next
    net = parallel.parallelize(raw, grid, cfg, load=weights.loader(cfg, grid))
    weights.load_model("out/tiny/step_000300", model)     # sample.py, eval.py, plots: a plain model

An HF folder is read by hf.py (each TP rank reads only its rows / columns); our checkpoints give
full tensors that tp.local_tensor cuts. A LoRA run's adapters are merged into their base; a
vocabulary smaller than the run's (chat tokens just added) grows, the new rows the mean of the old.
Under LoRA those new rows train too (lora_train_tokens: lora.train_tokens in loader; base_vocab).
"""
import json
import os
from dataclasses import fields
from types import SimpleNamespace

import torch

import checkpoint
import config
import hf
import lora
import materialize
import parallel
import tp
from model import ModelConfig, Transformer


def init_checkpoint(path):
    """init_from: one of our checkpoint folders, or a run folder (its newest) -> (its path, its config dict)."""
    ckpt = path if os.path.isfile(os.path.join(path, "model.safetensors")) else checkpoint.latest(path)
    if ckpt is None:
        what = "no checkpoint in it" if os.path.isdir(path) else "no such folder"
        raise config.MissingFileError(f"init_from={path}: {what} (name a checkpoint, a run folder or a local HF model "
                                      "folder)")
    return ckpt, hf.read_config(ckpt)


def configure(cfg):
    """init_from's model and tokenizer become cfg's (no need to repeat the model shape); returns a line
    saying so ("" without init_from). An HF folder: its config.json's model keys, its tokenizer. Our
    checkpoint or run folder (init_from then names its newest checkpoint): its model keys, tokenizer,
    tokenizer_vocab and tokenizer_fim (a truncated vocabulary's ids depend on it). block_size is capped
    at the model's (learned positions: the model's); the line names any other of these keys the user
    gave that init_from replaced. loader(cfg, grid) then loads the weights."""
    if not cfg.init_from:
        return ""
    if hf.is_hf_folder(cfg.init_from):
        try:
            folder = hf.read_config(cfg.init_from)
            m = vars(hf.config_from_hf(folder, min(cfg.block_size, hf.config_from_hf(folder).block_size)))
        except ValueError as e:
            raise config.ConfigError(f"init_from={cfg.init_from}: {e}") from e
        keys, tok = hf.MODEL_KEYS, dict(tokenizer=cfg.init_from, tokenizer_vocab=0)
    else:
        cfg.init_from, m = init_checkpoint(cfg.init_from)
        keys = [f.name for f in fields(ModelConfig) if f.name not in ("dropout", "grad_checkpoint", "fp32_residual")]
        if m["pos_emb"] == "rope":  # (a learned position table keeps its rows)
            m = dict(m, block_size=min(cfg.block_size, m["block_size"]))
        tok = {k: m[k] for k in ("tokenizer", "tokenizer_vocab")}  # and its FIM sentinels (older checkpoints: fim_rate)
        tok["tokenizer_fim"] = m.get("tokenizer_fim", m.get("fim_rate", 0) > 0)
    taken = [(k, m[k]) for k in keys] + list(tok.items())
    replaced = [f"{k}={v!r} (not {getattr(cfg, k)!r} as given)" for k, v in taken
                if k in getattr(cfg, "given", ()) and k != "block_size" and getattr(cfg, k) != v]
    for k, v in taken:
        setattr(cfg, k, v)
    if cfg.seq_len > cfg.block_size:
        raise config.ConfigError(f"seq_len={cfg.seq_len} > block_size={cfg.block_size} of {cfg.init_from}")
    line = f"model and tokenizer of {'the HF folder' if keys is hf.MODEL_KEYS else 'checkpoint'} {cfg.init_from}"
    return line + (f"; note: init_from's {', '.join(replaced)}: drop those keys, or start without init_from"
                   if replaced else "")


def base_vocab(cfg):
    """init_from's vocabulary size, before this run's chat tokens grew it (None without init_from)."""
    if not cfg.init_from:
        return None
    src = cfg.init_from
    return hf.read_config(src)["vocab_size"] if hf.is_hf_folder(src) else init_checkpoint(src)[1]["vocab_size"]


def build_model(cfg, grid, frozen=False):
    """The full model of cfg on grid.device, before parallelize lays it out; the same on every rank.
    Random initial weights (no init_from, or a full fine-tuning whose weights loader overwrites):
    built on the CPU in fp32 from cfg.seed, then moved (the same weights on any machine). A LoRA
    run from init_from: built straight into the frozen base's storage dtype on the device
    (materialize.build, no fp32 copy anywhere; loader fills every tensor), QLoRA's block linears on
    the host until qlora.quantize takes them to the GPU in 4 bits. frozen: no gradients (a
    reference model; never QLoRA)."""
    torch.manual_seed(cfg.seed)
    mcfg = ModelConfig.from_cfg(cfg)
    if cfg.lora_r and cfg.init_from:
        host = cfg.lora_base_dtype == "nf4" and grid.device.type == "cuda" and not frozen
        dtype = materialize.storage_dtype(cfg, parallel.amp_dtype(cfg, grid.device))
        model = materialize.build(mcfg, grid.device, dtype, init=False,
                                  linear_device="cpu" if host else None)
    else:
        model = Transformer(mcfg).to(grid.device)
    return model.requires_grad_(not frozen)


def loader(cfg, grid):
    """parallelize's `load` callback for cfg.init_from (None without one): an HF folder (each TP rank
    reads its rows / columns) or our checkpoint (full tensors cut to this TP rank; a LoRA run's merged).
    A smaller vocabulary (chat specials just added) grows (grow_vocab), said once; under LoRA
    (lora_train_tokens) the new tokens' rows then train (lora.train_tokens; not in a frozen reference)."""
    if not cfg.init_from:
        return None
    src, is_hf, old = cfg.init_from, hf.is_hf_folder(cfg.init_from), base_vocab(cfg)
    new = range(old, cfg.vocab_size) if cfg.lora_r and cfg.lora_train_tokens else range(0)
    if new and cfg.pp > 1 and cfg.tie_embeddings:
        raise config.ConfigError("lora_train_tokens=True: the new tokens' rows of tied embeddings cannot train across "
                                 "pipeline stages (pp > 1): set --lora_train_tokens=False, or pp=1")
    if old < cfg.vocab_size and grid.is_main:
        print(f"init_from: vocabulary grown from {old} to {cfg.vocab_size} tokens (new rows: the mean of the old"
              + (f"; LoRA trains the rows of tokens {old}..{cfg.vocab_size - 1} too)" if new else ")"))

    def load(model):
        if is_hf:
            params, base = dict(model.named_parameters()), tp.hf_shard_fn(model, grid)

            def shard_fn(name, part):  # vocabulary rows: read whole, grown, then cut like the rest
                if name in ("tok_emb.weight", "head.weight") and old < cfg.vocab_size:
                    return tp.local_tensor(params[name], grow_vocab(part[:], old, cfg.vocab_size), grid)
                return base(name, part)
            hf.load_weights(src, model, shard_fn)
        else:
            saved = init_checkpoint(src)[1]
            weights = checkpoint.read_weights(src, ModelConfig.from_cfg(SimpleNamespace(**saved)))
            tp.load_full_state_dict(model, grid, fit_weights(weights, saved, model.cfg))
        if new and any(p.requires_grad for p in model.parameters()):  # (a frozen reference keeps the base's rows)
            lora.train_tokens(model, new, grid)  # on the TP cut, before lora.apply and FSDP
    return load


def grow_vocab(t, n_old, n_new):
    """Rows n_old..n_new-1 (tokens just added) = the mean of the n_old real rows: an average token, not noise."""
    t = t.clone()
    t[n_old:n_new] = t[:n_old].float().mean(0).to(t.dtype)
    return t


def fit_weights(weights, saved, mcfg):
    """A checkpoint's full weights (`saved`: its config dict) -> model config mcfg's: LoRA adapters
    merged into their base, vocabulary grown (grow_vocab)."""
    if any(lora.is_adapter(k) for k in weights):
        weights = lora.merge_weights(weights, SimpleNamespace(**saved))
    out, n = dict(weights), saved["vocab_size"]
    for k in ("tok_emb.weight", "head.weight") if n < mcfg.vocab_size else ():
        grown = torch.cat([out[k][:n], out[k].new_zeros(mcfg.padded_vocab - n, mcfg.n_embd)])
        out[k] = grow_vocab(grown, n, mcfg.vocab_size)
    return out


def load_model(path, model):
    """Load a checkpoint's weights into a plain (unsharded) model (a LoRA run's: adapters merged)."""
    sd = checkpoint.read_weights(path, model.cfg)
    if any(lora.is_adapter(k) for k in sd):
        with open(os.path.join(path, "config.json")) as f:
            sd = fit_weights(sd, json.load(f), model.cfg)
    with torch.no_grad():
        for k, t in model.state_dict().items():
            t.copy_(sd[k])
    return sd
