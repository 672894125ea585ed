"""A run's initial weights: init_from (our checkpoint or run folder, or a local HF folder), and weights into a plain model.

    started = weights.configure(cfg)       # init_from's model keys and tokenizer become cfg's
    started, tok, template = weights.configure_chat(cfg, grid.world)   # SFT, DPO, GRPO: and the chat template
    raw = weights.build_model(cfg, grid)   # the full model on the device, seeded; init_from's weights come next
    net = parallel.parallelize(raw, grid, cfg, load=weights.loader(cfg, grid))
    ref = weights.build_net(cfg, grid, load, frozen=True)  # both in one call: a frozen reference (DPO, GRPO)
    weights.load_model("out/tiny/step_000300", model)     # sample.py, eval.py, plots: a plain model

An HF folder is read by hf.py (each TP rank reads only its rows / columns); our checkpoints give
full tensors that tp.local_tensor cuts. A LoRA run's adapters are merged into their base; a
vocabulary smaller than the run's (chat tokens just added) grows, the new rows the mean of the old.
Under LoRA those new rows train too (lora_train_tokens: lora.train_tokens in loader; base_vocab).
The family follows cfg.objective (pretrain.py's; init_from's sets it): "lm" model.Transformer,
"mlm" bert.Bert, "span" t5.T5 (HF folders of model_type bert / t5 too); model_config says which.
"""
import json
import os
from dataclasses import fields
from types import SimpleNamespace

import torch

import chat
import checkpoint
import config
import hf
import lora
import parallel
import tokenizer
from encoders import bert, t5
from memory import materialize
from model import ModelConfig, Transformer
from parallelism import tp


def init_checkpoint(path):
    """init_from: one of our checkpoint folders, or a run folder (its newest) -> (its path, its config dict)."""
    ckpt = path if os.path.isfile(os.path.join(path, "model.safetensors")) else checkpoint.latest(path)
    if ckpt is None:
        what = "no checkpoint in it" if os.path.isdir(path) else "no such folder"
        raise config.MissingFileError(f"init_from={path}: {what} (name a checkpoint, a run folder or a local HF model "
                                      "folder)")
    return ckpt, hf.read_config(ckpt)


FAMILIES = {"mlm": (bert.BertConfig, bert.Bert, "bert"), "span": (t5.T5Config, t5.T5, "t5")}  # objective -> model
# the layouts and keys a BERT / T5 takes: (what is wrong, the one-line refusal)
FAMILY_REFUSALS = [
    (lambda c: c.tp > 1, "tp > 1 (set tp=1: tensor parallelism cuts the decoder Transformer only)"),
    (lambda c: c.pp > 1, "pp > 1 (set pp=1: pipeline stages cut the decoder Transformer only)"),
    (lambda c: c.ep > 1 or c.n_experts, "experts (set n_experts=0, ep=1)"),
    (lambda c: c.lora_r, "LoRA (set lora_r=0: the adapters name the decoder's linears)"),
    (lambda c: c.sequence_parallel, "sequence_parallel (set it False)"),
    (lambda c: c.compile and c.data_parallel == "fsdp", "compile=True under FSDP (untested: set compile=False)"),
    (lambda c: c.loss_chunk or c.recompute or c.grad_checkpoint, "loss_chunk / recompute / grad_checkpoint "
     "(the decoder's memory tools: set them off)"),
    (lambda c: c.optimizer != "adamw" or c.zero1 or c.adamw_state != "fp32", "Muon, zero1 or adamw_state "
     "(untested: set optimizer='adamw', zero1=False, adamw_state='fp32')"),
]


def model_config(cfg):
    """The model config cfg describes: model.ModelConfig (objective "lm", or a stage without one),
    bert.BertConfig ("mlm") or t5.T5Config ("span"), their shared keys read from cfg by name; a
    config that cannot work, or a layout or key the family does not take, raises ConfigError (one line)."""
    objective = getattr(cfg, "objective", "lm")
    if objective not in FAMILIES:
        try:
            return ModelConfig.from_cfg(cfg)
        except (ValueError, TypeError) as e:
            raise config.ConfigError(str(e)) from e
    kind, _, name = FAMILIES[objective]
    for bad, what in FAMILY_REFUSALS:
        if bad(cfg):
            raise config.ConfigError(f"objective={objective!r} builds a {name.upper()}, which does not take {what}")
    own = {f.name for f in fields(kind)}
    ignored = sorted(k for k in getattr(cfg, "given", ()) if k in DECODER_KEYS and k not in own | {"block_size"})
    if ignored:
        raise config.ConfigError(f"objective={objective!r} builds a {name.upper()}, which has no {', '.join(ignored)}: "
                                 f"drop them")
    return kind.from_cfg(cfg)


DECODER_KEYS = {f.name for f in fields(ModelConfig)}


def configure(cfg):
    """init_from's model and tokenizer become cfg's (no need to repeat the model shape); returns a line
    saying so ("" without init_from). An HF folder: its config.json's model keys, its tokenizer. Our
    checkpoint or run folder (init_from then names its newest checkpoint): its model keys, tokenizer,
    tokenizer_vocab and tokenizer_fim (a truncated vocabulary's ids depend on it). block_size is capped
    at the model's (learned positions: the model's); the line names any other of these keys the user
    gave that init_from replaced. loader(cfg, grid) then loads the weights."""
    if not cfg.init_from:
        return ""
    family = init_family(cfg.init_from)
    if family != getattr(cfg, "objective", "lm"):
        if "objective" in getattr(cfg, "given", ()):
            raise config.ConfigError(f"init_from={cfg.init_from} holds a model of objective={family!r}, this run has "
                                     f"objective={cfg.objective!r}: set objective={family!r}")
        cfg.objective = family  # (SFT: a T5 trains sequence to sequence)
    if family != "lm":
        return configure_family(cfg, family)
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


def init_family(path):
    """The objective init_from's model was built for: "mlm" (BERT), "span" (T5) or "lm" (the rest)."""
    if hf.is_hf_folder(path):
        return {"bert": "mlm", "t5": "span"}.get(hf.read_config(path).get("model_type"), "lm")
    return init_checkpoint(path)[1].get("objective", "lm")


def configure_chat(cfg, world, seq2seq=False):
    """A chat stage's configure step -> (configure's line, tokenizer, template): init_from's model keys and
    tokenizer (configure), the chat template's special tokens (chat.setup; seq2seq and a T5 init_from: its
    plain tokenizer, no template), vocab_size the tokenizer's without init_from, cfg validated again (its
    model keys just changed)."""
    started = configure(cfg) or "no init_from: random initial weights"
    if seq2seq and getattr(cfg, "objective", "lm") != "lm":  # a T5: plain text in and out (seq2seq.rows)
        tok, template = tokenizer.for_cfg(cfg), None
    else:
        tok, template = chat.setup(cfg)
    if not cfg.init_from:
        cfg.vocab_size = tok.n_vocab
    config.validate(cfg, world)
    return started, tok, template


def configure_family(cfg, objective):
    """configure() for a BERT / T5 init_from: its config's keys (bert.BertConfig's / t5.T5Config's) become
    cfg's; an HF folder's tokenizer when it has a tokenizer.json (else cfg's stays), our checkpoint's."""
    kind, _, name = FAMILIES[objective]
    if hf.is_hf_folder(cfg.init_from):
        hf_cfg = hf.read_config(cfg.init_from)
        fam = bert.config_from_hf(hf_cfg) if name == "bert" else t5.config_from_hf(hf_cfg, t5.has_own_head(cfg.init_from))
        m = {f.name: getattr(fam, f.name) for f in fields(kind)}
        if os.path.isfile(os.path.join(cfg.init_from, "tokenizer.json")):
            m.update(tokenizer=cfg.init_from, tokenizer_vocab=0)
        what = f"the HF {name} folder"
    else:
        cfg.init_from, saved = init_checkpoint(cfg.init_from)
        m = {k: saved[k] for k in [f.name for f in fields(kind)] + ["tokenizer", "tokenizer_vocab", "tokenizer_fim"]
             if k in saved}
        what = f"{name} checkpoint"
    for k, v in m.items():
        setattr(cfg, k, v)
    return f"model and tokenizer of {what} {cfg.init_from}"


def build_model(cfg, grid, frozen=False):
    """The full model of cfg on grid.device, before parallelize lays it out; the same on every rank.
    Random initial weights (no init_from, or a full fine-tuning whose weights loader overwrites):
    built on the CPU in fp32 from cfg.seed, then moved (the same weights on any machine). A LoRA
    run from init_from: built straight into the frozen base's storage dtype on the device
    (materialize.build, no fp32 copy anywhere; loader fills every tensor), QLoRA's block linears on
    the host until qlora.quantize takes them to the GPU in 4 bits. frozen: no gradients (a
    reference model; never QLoRA)."""
    torch.manual_seed(cfg.seed)
    mcfg = model_config(cfg)
    if not isinstance(mcfg, ModelConfig):  # a BERT / T5 (objective mlm / span): fp32 from the seed, moved
        model = FAMILIES[cfg.objective][1](mcfg).to(grid.device)
    elif cfg.lora_r and cfg.init_from:
        host = cfg.lora_base_dtype == "nf4" and grid.device.type == "cuda" and not frozen
        dtype = materialize.storage_dtype(cfg, parallel.amp_dtype(cfg, grid.device))
        model = materialize.build(mcfg, grid.device, dtype, init=False,
                                  linear_device="cpu" if host else None)
    else:
        model = Transformer(mcfg).to(grid.device)
    return model.requires_grad_(not frozen)


def build_net(cfg, grid, load=None, frozen=False):
    """build_model, laid out by parallel.parallelize with load's weights (loader's) -> parallel.Net. frozen:
    a reference copy (no gradients, no optimizer; without init_from it equals the policy's start)."""
    return parallel.parallelize(build_model(cfg, grid, frozen=frozen), grid, cfg, load=load, optimizer=not frozen)


def loader(cfg, grid):
    """parallelize's `load` callback for cfg.init_from (None without one): an HF folder (each TP rank
    reads its rows / columns) or our checkpoint (full tensors cut to this TP rank; a LoRA run's merged).
    A smaller vocabulary (chat specials just added) grows (grow_vocab), said once; under LoRA
    (lora_train_tokens) the new tokens' rows then train (lora.train_tokens; not in a frozen reference)."""
    if not cfg.init_from:
        return None
    if getattr(cfg, "objective", "lm") in FAMILIES:
        return family_loader(cfg)
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
            parallel.load_full_state_dict(model, grid, fit_weights(weights, saved, model.cfg))
        if new and any(p.requires_grad for p in model.parameters()):  # (a frozen reference keeps the base's rows)
            lora.train_tokens(model, new, grid)  # on the TP cut, before lora.apply and FSDP
    return load


def family_loader(cfg):
    """loader() for a BERT / T5 (one process's model: tp=1): an HF folder (bert.load_hf / t5.load_hf)
    or our checkpoint, its vocabulary the run's."""
    src, kind = cfg.init_from, FAMILIES[cfg.objective]
    if hf.is_hf_folder(src):
        def load(model):
            model.load_state_dict((bert.load_hf if kind[2] == "bert" else t5.load_hf)(src).state_dict())
        return load
    saved = init_checkpoint(src)[1]
    if saved["vocab_size"] != cfg.vocab_size:
        raise config.ConfigError(f"init_from={src} has vocab_size={saved['vocab_size']}, this run {cfg.vocab_size}: a "
                                 f"{kind[2].upper()}'s vocabulary does not grow here")

    def load(model):
        model.load_state_dict(checkpoint.read_weights(src, kind[0].from_cfg(SimpleNamespace(**saved))))
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
