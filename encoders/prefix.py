"""Prefix tuning (Li & Liang, 2021): learned keys and values in front of every layer's, base frozen.

    prefix = Prefix(model.cfg, n_tokens=20, projection=True)      # optional reparameterisation MLP
    tuned = Prefixed(model, prefix)                                 # the base frozen; only the prefix trains
    loss = tuned(x, y, attn_mask=real)                              # model.Transformer's forward, prefixed
    attach(model, prefix)                                           # the same in place (FAMILY's: sft.py's)
    save_peft("out/prefix", prefix)                                 # adapter_model.safetensors + adapter_config.json
    prefix = load_peft("out/prefix", model.cfg)                     # PEFT's (or ours): peft.PeftModel reads it too

What it is, as PEFT's PrefixTuningConfig builds it for a causal LM: N virtual tokens whose keys and
values are prepended to each layer's attention, as if a cache held N earlier tokens: every real
token attends to all of them, the real tokens' positions start at N (the prefix keys used as given,
no rotation), an attention mask gains N ones in front (a packed row's (B, T, T) mask N columns).
The table is (N, n_layer * 2 * KV * D): row n holds, layer by layer, the key then the value of
virtual token n for each of the KV key/value heads (PEFT's token_dim = KV * D under GQA).
projection=True learns it through PEFT's reparameterisation, embedding (N, KV * D) -> Linear ->
tanh -> Linear(hidden -> n_layer * 2 * KV * D), which training sees; without it the table is the
parameter. Saved, as PEFT saves it, is the table itself ("prompt_embeddings"), so a projected
prefix loads back as a plain table (inference), as in PEFT.
How: prefixed() hands Transformer.forward a PrefixCache (the cache interface: `length` = N,
update() puts the prefix in front of each layer's keys and values), so positions, causality, GQA,
ALiBi and sliding windows follow the model's own rules. generate(): the eager decoding loop with
the prefix in the KV cache (answers(): greedy). Not here: tensor parallelism (the prefix's kv heads
would be cut like attn.qkv's), FSDP of the frozen base, generate.decode's static cache. PrefixTuning
is sft.py's weights.Family for prefix_tokens > 0 (PREFIX_DEFAULTS: its keys).
"""
import functools
import json
import os
import types

import torch
import torch.nn as nn
from safetensors import safe_open
from safetensors.torch import save_file

import weights
from config import ConfigError, MissingFileError, need
from generate import Cache, Emittable, KVCache, sample
from model import Transformer

PREFIX_DEFAULTS = dict(
    prefix_tokens=0,    # > 0: prefix tuning (sft.py), this many learned key/value positions per layer (the base frozen)
    prefix_projection=False,  # prefix tuning through PEFT's reparameterisation MLP (embedding -> tanh MLP)
    prefix_hidden=0,    # its hidden width (0: the key/value width)
)


class Prefix(nn.Module):
    """PEFT's PrefixEncoder for a model.ModelConfig: table() -> (N, n_layer * 2 * KV * D)."""

    def __init__(self, mcfg, n_tokens, projection=False, hidden=0):
        super().__init__()
        if n_tokens < 1:
            raise ConfigError(f"prefix n_tokens={n_tokens} must be >= 1")
        self.n_tokens, self.n_layer, self.kv_heads, self.head_dim = n_tokens, mcfg.n_layer, mcfg.kv_heads, mcfg.head_dim
        token_dim, width = mcfg.kv_heads * mcfg.head_dim, mcfg.n_layer * 2 * mcfg.kv_heads * mcfg.head_dim
        self.projection = projection
        if projection:  # PEFT's defaults: nn.Embedding's N(0, 1), nn.Linear's uniform
            self.embedding = nn.Embedding(n_tokens, token_dim)
            self.transform = nn.Sequential(nn.Linear(token_dim, hidden or token_dim), nn.Tanh(),
                                           nn.Linear(hidden or token_dim, width))
        else:
            self.embedding = nn.Embedding(n_tokens, width)

    def table(self):
        w = self.embedding.weight
        return self.transform(w) if self.projection else w

    def forward(self, batch):
        """-> [(keys, values)] per layer, each (batch, KV, N, D)."""
        t = self.table().view(self.n_tokens, 2 * self.n_layer, self.kv_heads, self.head_dim).permute(1, 2, 0, 3)
        return [(t[2 * i].expand(batch, -1, -1, -1), t[2 * i + 1].expand(batch, -1, -1, -1))
                for i in range(self.n_layer)]


class PrefixCache(Cache):
    """Transformer.forward's cache (generate.Cache) over a prefix: every layer's keys and values start with
    its N learned ones; `length` (N at first) offsets positions and the causal mask as a cache would."""

    def __init__(self, kv):
        self.kv, self.length = kv, kv[0][0].shape[2]

    def update(self, layer, k, v):
        pk, pv = self.kv[layer]
        return torch.cat([pk.to(k.dtype), k], dim=2), torch.cat([pv.to(v.dtype), v], dim=2)


def check_fits(model, prefix):
    """ConfigError unless prefix has model's layers and key/value width."""
    kv, want = prefix.kv_heads * prefix.head_dim, model.cfg.kv_heads * model.cfg.head_dim
    if prefix.n_layer != model.cfg.n_layer or kv != want:
        raise ConfigError(f"this prefix is for {prefix.n_layer} layers of {prefix.kv_heads} x {prefix.head_dim} "
                          f"key/value heads, the model has {model.cfg.n_layer} of {model.cfg.kv_heads} x "
                          f"{model.cfg.head_dim}")


def prefixed(run, prefix, idx, targets=None, *, reduction="mean", pos=None, attn_mask=None, temperature=1.0):
    """run(idx, targets, ...) (a Transformer's forward) with prefix's keys and values in front of every
    layer's: attn_mask (B, T) 0/1 (real tokens) or a boolean (B, T, T) one (packed rows) gains the
    prefix's N columns (always seen), given positions pos shift by N."""
    B, T = idx.shape
    N = prefix.n_tokens
    if attn_mask is not None:
        if attn_mask.dim() == 2:
            attn_mask = torch.cat([attn_mask.new_ones(B, N), attn_mask], dim=1)
        elif attn_mask.dim() == 3 and not attn_mask.is_floating_point():
            attn_mask = torch.cat([attn_mask.new_ones(B, T, N), attn_mask], dim=2)
        else:
            raise ConfigError("prefix tuning: attn_mask must be (B, T) 0/1 or a boolean (B, T, T) (the prefix's N "
                              "columns are added here)")
    return run(idx, targets, reduction=reduction, cache=PrefixCache(prefix(B)), pos=None if pos is None else pos + N,
               attn_mask=attn_mask, temperature=temperature)


class Prefixed(nn.Module):
    """A model.Transformer (frozen here) with a Prefix in front of every layer; forward as the model's."""

    def __init__(self, model, prefix):
        super().__init__()
        check_fits(model, prefix)
        self.model, self.prefix, self.cfg = model.requires_grad_(False), prefix, model.cfg

    def forward(self, idx, targets=None, **kw):
        """idx (B, T) -> logits, or the loss with targets (model.Transformer.forward's meaning, through
        prefixed(): attn_mask, pos, reduction, temperature)."""
        return prefixed(self.model, self.prefix, idx, targets, **kw)


def attach(model, prefix):
    """Prefix tuning of a model.Transformer in place, as sft.py trains it: the base frozen, model.prefix
    = prefix (on the model's device), and model(...) runs through prefixed(). The state dict keeps the
    base's names and adds prefix.* (checkpoint.read_weights takes them). Returns model."""
    check_fits(model, prefix)
    model.requires_grad_(False)
    model.prefix = prefix.to(next(model.parameters()).device)
    model.forward = types.MethodType(lambda self, idx, targets=None, **kw: prefixed(
        functools.partial(Transformer.forward, self), self.prefix, idx, targets, **kw), model)
    return model


@torch.no_grad()
def generate(tuned, idx, max_new_tokens, *, vocab, attention_mask=None, temperature=1.0, top_k=None, top_p=None,
             stop_tokens=None, pad_id=None, generator=None, seed=None):
    """generate.generate's eager loop (vocab as there) for a Prefixed model (or one attach() tuned): the
    prefix is written into the KV cache's first N slots, then the (left-padded) prompts are prefilled
    after it and decoded one token a step. Positions count from each prompt's first real token after the N
    virtual ones (transformers' generate through PEFT does the same). Returns (B, T + generated); a
    row that emitted one of stop_tokens repeats pad_id (default: that token); the loop ends when
    every row has stopped."""
    model, N = tuned.model if isinstance(tuned, Prefixed) else tuned, tuned.prefix.n_tokens  # (or attach()'s)
    B, T = idx.shape
    if N + T + max_new_tokens > model.cfg.block_size:
        raise ConfigError(f"prefix {N} + prompt {T} + max_new_tokens {max_new_tokens} exceeds block_size="
                          f"{model.cfg.block_size}: generate fewer tokens")
    if generator is None and seed is not None:
        generator = torch.Generator(idx.device).manual_seed(seed)
    cache = KVCache(N + T + max_new_tokens)
    for layer, (k, v) in enumerate(tuned.prefix(B)):
        cache.update(layer, k, v)
    cache.length = N
    real = torch.ones_like(idx, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
    mask = torch.cat([real.new_ones(B, N), real], dim=1)
    stops = torch.as_tensor(list(stop_tokens or []), device=idx.device)
    fill = torch.full((B,), -1 if pad_id is None else pad_id, dtype=idx.dtype, device=idx.device)
    done = torch.zeros(B, dtype=torch.bool, device=idx.device)
    allowed = Emittable(vocab, model.cfg.vocab_size, idx.device)
    was_training = tuned.training
    tuned.eval()
    try:
        x, out = model.hidden_states(idx, cache=cache, attn_mask=mask), [idx]
        for step in range(max_new_tokens):
            nxt = sample(allowed(model.logits(x[:, -1])), temperature, top_k, top_p, generator)
            nxt = torch.where(done, fill, nxt)
            hit = torch.isin(nxt, stops) & ~done
            fill = torch.where(hit, nxt, fill) if pad_id is None else fill
            done = done | hit
            out.append(nxt[:, None])
            if step == max_new_tokens - 1 or (stops.numel() and bool(done.all())):
                break
            mask = torch.cat([mask, mask.new_ones(B, 1)], dim=1)
            x = model.hidden_states(nxt[:, None], cache=cache, attn_mask=mask)
    finally:
        tuned.train(was_training)
    return torch.cat(out, dim=1)


def answers(tuned, tok, prompts, max_new_tokens):
    """Greedy answers of a prefix-tuned model to prompts (token lists): left-padded with tok's end of
    turn, decoded by generate() until it; -> token lists, the end of turn cut (sft.py's held-out accuracy)."""
    T, dev, stop_id = max(map(len, prompts)), tuned.prefix.embedding.weight.device, tok.eot_id
    idx = torch.tensor([[stop_id] * (T - len(p)) + p for p in prompts], device=dev)
    mask = torch.tensor([[0] * (T - len(p)) + [1] * len(p) for p in prompts], device=dev)
    out = generate(tuned, idx, max_new_tokens, vocab=tok, attention_mask=mask, temperature=0.0, stop_tokens=[stop_id],
                   pad_id=stop_id)[:, T:]
    return [[t for t in row if t != stop_id] for row in out.tolist()]


# ----------------------------------------------------------------------------- PEFT's format

def peft_config(prefix, base_model_name_or_path=None):
    """The adapter_config.json PEFT writes for PrefixTuningConfig(task_type="CAUSAL_LM")."""
    token_dim = prefix.kv_heads * prefix.head_dim
    hidden = prefix.transform[0].out_features if prefix.projection else token_dim
    return {"peft_type": "PREFIX_TUNING", "task_type": "CAUSAL_LM", "num_virtual_tokens": prefix.n_tokens,
            "token_dim": token_dim, "num_transformer_submodules": 1, "num_attention_heads": prefix.kv_heads,
            "num_layers": prefix.n_layer, "encoder_hidden_size": hidden, "prefix_projection": prefix.projection,
            "inference_mode": True, "init_weights": None, "modules_to_save": None, "auto_mapping": None,
            "revision": None, "base_model_name_or_path": base_model_name_or_path}


@torch.no_grad()
def save_peft(out_dir, prefix, base_model_name_or_path=None):
    """The prefix as PEFT saves it: its table as "prompt_embeddings", and adapter_config.json."""
    os.makedirs(out_dir, exist_ok=True)
    save_file({"prompt_embeddings": prefix.table().detach().float().contiguous().cpu()},
              os.path.join(out_dir, "adapter_model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out_dir, "adapter_config.json"), "w") as f:
        json.dump(peft_config(prefix, base_model_name_or_path), f, indent=2)
    return out_dir


@torch.no_grad()
def load_peft(path, mcfg):
    """A PEFT prefix-tuning adapter folder -> Prefix (its table as the parameter) for a model of mcfg."""
    files = [os.path.join(path, f) for f in ("adapter_config.json", "adapter_model.safetensors")]
    if not all(os.path.isfile(f) for f in files):
        raise MissingFileError(f"{path}: no adapter_config.json + adapter_model.safetensors (a PEFT adapter folder)")
    with open(files[0]) as f:
        conf = json.load(f)
    want = {"peft_type": "PREFIX_TUNING", "num_layers": mcfg.n_layer, "num_attention_heads": mcfg.kv_heads,
            "token_dim": mcfg.kv_heads * mcfg.head_dim, "num_transformer_submodules": 1}
    bad = [f"{k}={conf.get(k)!r} (this model: {v!r})" for k, v in want.items() if conf.get(k) != v]
    if bad:
        raise ConfigError(f"{path}: the adapter does not fit this model: {', '.join(bad)}")
    prefix = Prefix(mcfg, conf["num_virtual_tokens"])
    with safe_open(files[1], framework="pt") as f:
        prefix.embedding.weight.copy_(f.get_tensor("prompt_embeddings"))
    return prefix


# ----------------------------------------------------------------------------- sft.py's variant of the decoder

class PrefixTuning(weights.Family):
    """weights.Family for prefix_tokens > 0 (sft.py): the decoder, its base frozen once its weights are
    loaded and a Prefix attached (loader; from cfg.seed); the prefix takes prefix_tokens positions;
    held-out answers decoded with the prefix in the KV cache; checkpoints also hold it in PEFT's format."""
    name, chosen_by, keys = "prefix tuning", "prefix_tokens > 0", PREFIX_DEFAULTS

    def adapter_key(self, name):
        return super().adapter_key(name) or name.startswith("prefix.")

    def sft_check(self, cfg, grid):
        need(0 <= cfg.prefix_tokens < cfg.block_size // 2 and cfg.prefix_hidden >= 0, f"prefix_tokens="
             f"{cfg.prefix_tokens} must be in [0, block_size / 2 = {cfg.block_size // 2}) and prefix_hidden >= 0")
        for bad, what in [(cfg.lora_r, "LoRA (lora_r > 0)"), (grid.tp > 1, "tp > 1"), (grid.pp > 1, "pp > 1"),
                          (grid.ep > 1 or cfg.n_experts, "experts"),
                          (cfg.data_parallel == "fsdp", "data_parallel='fsdp'"), (cfg.compile, "compile=True"),
                          (cfg.merge or cfg.export_hf, "merge / export_hf (the PEFT adapter is in every checkpoint "
                                                       "folder; the base is init_from)")]:
            need(not bad, f"prefix tuning (prefix_tokens={cfg.prefix_tokens}) works with data_parallel='ddp' on a "
                 f"decoder: not with {what}")
        super().sft_check(cfg, grid)

    def positions(self, cfg):
        return cfg.block_size - cfg.prefix_tokens  # (the prefix takes positions too)

    def tuning(self, cfg):
        return f"prefix tuning, {cfg.prefix_tokens} positions"

    def loader(self, cfg, grid):
        """The decoder's loader, then a Prefix attached to the loaded base (from cfg.seed), as LoRA comes
        after the weights."""
        load = super().loader(cfg, grid)

        def load_then_attach(model):
            if load is not None:
                load(model)
            torch.manual_seed(cfg.seed)
            attach(model, Prefix(model.cfg, cfg.prefix_tokens, cfg.prefix_projection, cfg.prefix_hidden))
        return load_then_attach

    def decode(self, raw, tok, ids, new):
        return answers(raw, tok, ids, new)

    def peft(self, raw, full, cfg):
        return lambda d: save_peft(d, raw.prefix, cfg.init_from or None)


FAMILY = PrefixTuning()
