"""T5: the encoder-decoder Transformer, span corruption, generation with a cache, HF folders.

    model = t5.T5(t5.T5Config(vocab_size=32128, n_layer=6, n_head=8, n_embd=512, head_dim=64, ffn_hidden=2048))
    inputs, targets = t5.span_corrupt(ids, vocab_size=32100, eos_id=1, generator=g)   # one row, T5's objective
    loss = model(src, targets, src_mask=real)       # decoder input: targets shifted right (start id first)
    out = t5.generate(model, src, 32, vocab=tok, src_mask=real, temperature=0, stop_tokens=[1])   # (B, 1 + n) ids
    model = t5.load_hf("models/t5-small"); t5.export_hf(model, "out/t5")

The model (T5Config): a shared token embedding; encoder blocks (pre-norm: x + attn(norm(x)),
x + mlp(norm(x))) and decoder blocks (self-attention, cross-attention over the encoder's output,
MLP), T5's RMSNorm (no mean subtraction, no bias), no biases anywhere, unscaled dot products, and
relative position buckets instead of positions: a learned bias per (bucket, head) added to every
layer's scores, one table per stack (bidirectional buckets in the encoder, causal in the decoder).
v1.0: activation "relu", head tied to the embedding and fed d_model**-0.5-scaled states
(tie_embeddings=True); v1.1: "gated-gelu" (gelu_tanh(wi_0 x) * wi_1 x), a head of its own.

Span corruption (T5's random_spans_noise_mask and sentinels, as HF's run_t5_mlm_flax.py):
round(L * noise_density) noise tokens in round(noise / mean_span) spans, alternating with as many
non-noise spans, non-noise first, all such masks equally likely. The input keeps the non-noise
tokens, each noise span replaced by one sentinel; the target is each noise span after its sentinel;
sentinels count down from vocab_size - 1 (<extra_id_0>); both end with eos. corrupted_lengths
says how many raw tokens give an input of a wanted length (HF's compute_input_and_target_lengths).

Layers are one ModuleList `blocks`, the encoder's then the decoder's (the order a forward runs
them), so fsdp.FSDP (a unit per block) and dp.DataParallel wrap a T5 as a Transformer.
"""
import json
import math
import os
from dataclasses import dataclass, fields

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors import safe_open

import hf
from config import ConfigError, need
from encoders import denoising, seq2seq
from generate import Emittable, KVCache, sample
from model import RMSNorm, Transformer, activate, round_up

VOCAB_ROWS = ("tok_emb.weight", "head.weight")  # padded to the model's vocabulary: zero rows in, cut on export
ACTIVATIONS = {"relu": F.relu, "gelu": F.gelu, "gated-gelu": lambda x: F.gelu(x, approximate="tanh"),
               "gated-silu": F.silu}  # HF's feed_forward_proj; gated-gelu is HF's gelu_new (tanh)


@dataclass
class T5Config:
    vocab_size: int = 32128
    pad_vocab_multiple: int = 64   # embedding / head rows padded to a multiple of this (speed)
    n_layer: int = 6               # encoder blocks
    n_decoder_layer: int = 0       # 0 -> n_layer
    n_head: int = 8
    n_embd: int = 512              # d_model
    head_dim: int = 0              # d_kv (n_head * head_dim need not be n_embd); 0 -> n_embd / n_head
    ffn_hidden: int = 0            # d_ff; 0 -> 4 * n_embd
    activation: str = "relu"       # relu (v1.0) | gated-gelu (v1.1) | gelu | gated-silu
    tie_embeddings: bool = True    # v1.0: head = embedding (fed scaled states); False: a head of its own
    scale_logits: bool = True      # multiply the decoder's output by n_embd**-0.5 before the head (v1.0)
    num_buckets: int = 32          # relative position buckets per direction pair
    max_distance: int = 128        # distances >= this share the last bucket
    norm_eps: float = 1e-6
    dropout: float = 0.1
    init_factor: float = 1.0       # HF's initializer_factor
    pad_id: int = 0                # ignored targets become this in the decoder input
    decoder_start_id: int = 0      # the decoder's first input (T5: the pad id)

    @classmethod
    def from_cfg(cls, cfg):
        """Pick this dataclass's keys out of a flat config namespace (without scale_logits: scaled when
        the head is tied, as HF's scale_decoder_outputs defaults)."""
        kw = {f.name: getattr(cfg, f.name) for f in fields(cls) if hasattr(cfg, f.name)}
        kw.setdefault("scale_logits", kw.get("tie_embeddings", True))
        return cls(**kw)

    def __post_init__(self):
        self.head_dim = self.head_dim or self.n_embd // max(self.n_head, 1)
        self.ffn_hidden = self.ffn_hidden or 4 * self.n_embd
        for name in ("vocab_size", "n_layer", "n_head", "n_embd", "head_dim", "ffn_hidden", "num_buckets",
                     "max_distance"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name}={getattr(self, name)} must be a positive integer")
        if self.activation not in ACTIVATIONS:
            raise ConfigError(f"activation={self.activation!r}: choose one of {', '.join(ACTIVATIONS)}")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"dropout={self.dropout} must be in [0, 1)")

    @property
    def decoder_layers(self):
        return self.n_decoder_layer or self.n_layer

    @property
    def padded_vocab(self):
        return round_up(self.vocab_size, self.pad_vocab_multiple)


# ----------------------------------------------------------------------------- relative positions

def relative_buckets(rel, bidirectional, num_buckets=32, max_distance=128):
    """T5's bucket of each relative position rel = key - query (an integer tensor): exact buckets
    for the nearest num_buckets / 2 distances (/ 4 per side when bidirectional), logarithmically
    wider ones up to max_distance, the last one beyond. Causal (bidirectional=False): keys after the
    query (never attended) share bucket 0 with the query itself."""
    buckets = torch.zeros_like(rel)
    if bidirectional:
        num_buckets //= 2
        buckets = buckets + (rel > 0).long() * num_buckets
        dist = rel.abs()
    else:
        dist = (-rel).clamp(min=0)
    exact = num_buckets // 2
    large = exact + (torch.log(dist.float() / exact) / math.log(max_distance / exact) * (num_buckets - exact)).long()
    large = large.clamp(max=num_buckets - 1)
    return buckets + torch.where(dist < exact, dist, large)


# ----------------------------------------------------------------------------- layers

class Attention(nn.Module):
    """Multi-head attention without biases or 1/sqrt(d) scaling; `bias` (float, added to the scores)
    carries the relative positions and masks. Self-attention: one qkv matmul; cross-attention
    (cross=True): q from the decoder, [k | v] from the encoder output, cached once per generation."""

    def __init__(self, cfg, cross=False):
        super().__init__()
        self.n_head, self.head_dim, self.cross, inner = cfg.n_head, cfg.head_dim, cross, cfg.n_head * cfg.head_dim
        if cross:
            self.q = nn.Linear(cfg.n_embd, inner, bias=False)
            self.kv = nn.Linear(cfg.n_embd, 2 * inner, bias=False)
        else:
            self.qkv = nn.Linear(cfg.n_embd, 3 * inner, bias=False)
        self.proj = nn.Linear(inner, cfg.n_embd, bias=False)
        self.dropout = cfg.dropout

    def forward(self, x, bias, context=None, cache=None, layer=0):
        B, T, _ = x.shape
        H, D = self.n_head, self.head_dim
        heads = lambda t: t.view(B, -1, H, D).transpose(1, 2)  # noqa: E731  (B, H, len, D)
        if self.cross:
            q = heads(self.q(x))
            kv = self.kv(context) if cache is None else cache.cross_kv(layer, lambda: self.kv(context))
            k, v = (heads(t) for t in kv.chunk(2, dim=-1))
        else:
            q, k, v = (heads(t) for t in self.qkv(x).chunk(3, dim=-1))
            if cache is not None:
                k, v = cache.update(layer, k, v)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, dropout_p=self.dropout if self.training else 0.0,
                                           scale=1.0)
        return self.proj(y.transpose(1, 2).reshape(B, T, H * D))


class MLP(nn.Module):
    """wo(dropout(act(wi x))), or gated: wo(dropout(act(wi_0 x) * wi_1 x)); fc rows [wi_0 | wi_1]."""

    def __init__(self, cfg):
        super().__init__()
        self.gated = cfg.activation.startswith("gated")
        self.fc = nn.Linear(cfg.n_embd, cfg.ffn_hidden * (2 if self.gated else 1), bias=False)
        self.proj = nn.Linear(cfg.ffn_hidden, cfg.n_embd, bias=False)
        self.act, self.drop = ACTIVATIONS[cfg.activation], nn.Dropout(cfg.dropout)

    def forward(self, x):
        return self.proj(self.drop(activate(self.fc(x), self.act, self.gated)))


class Block(nn.Module):
    """Pre-norm residual sublayers: self-attention, (decoder) cross-attention, MLP."""

    def __init__(self, cfg, decoder=False):
        super().__init__()
        self.decoder = decoder
        self.norm1, self.attn = RMSNorm(cfg.n_embd, cfg.norm_eps), Attention(cfg)
        if decoder:
            self.norm_x, self.cross = RMSNorm(cfg.n_embd, cfg.norm_eps), Attention(cfg, cross=True)
        self.norm2, self.mlp = RMSNorm(cfg.n_embd, cfg.norm_eps), MLP(cfg)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x, bias, context=None, context_bias=None, cache=None, layer=0):
        x = x + self.drop(self.attn(self.norm1(x), bias, cache=cache, layer=layer))
        if self.decoder:
            x = x + self.drop(self.cross(self.norm_x(x), context_bias, context, cache, layer))
        return x + self.drop(self.mlp(self.norm2(x)))


# ----------------------------------------------------------------------------- the model

class T5(denoising.DenseCounts, nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg, C = cfg, cfg.n_embd
        self.tok_emb = nn.Embedding(cfg.padded_vocab, C)
        self.enc_rel = nn.Embedding(cfg.num_buckets, cfg.n_head)  # (bucket, head) -> score bias
        self.dec_rel = nn.Embedding(cfg.num_buckets, cfg.n_head)
        self.blocks = nn.ModuleList([Block(cfg) for _ in range(cfg.n_layer)] +
                                    [Block(cfg, decoder=True) for _ in range(cfg.decoder_layers)])
        self.enc_norm, self.norm_f = RMSNorm(C, cfg.norm_eps), RMSNorm(C, cfg.norm_eps)
        self.drop = nn.Dropout(cfg.dropout)
        self.head = nn.Linear(C, cfg.padded_vocab, bias=False)
        if cfg.tie_embeddings:
            self.head.weight = self.tok_emb.weight
        self.init_weights()

    @torch.no_grad()
    def init_weights(self):
        """HF's T5 init (factor f = init_factor): embedding and an untied head N(0, f), q N(0, f (C D)^-1/2),
        k, v and wi N(0, f C^-1/2), attention out N(0, f (H D)^-1/2), wo N(0, f d_ff^-1/2), relative
        tables N(0, f C^-1/2), norms 1."""
        cfg, f = self.cfg, self.cfg.init_factor
        C, inner = cfg.n_embd, cfg.n_head * cfg.head_dim
        nn.init.normal_(self.tok_emb.weight, 0.0, f)
        if not cfg.tie_embeddings:
            nn.init.normal_(self.head.weight, 0.0, f)
        for table in (self.enc_rel, self.dec_rel):
            nn.init.normal_(table.weight, 0.0, f * C ** -0.5)
        for m in self.modules():
            if isinstance(m, Attention):
                q = m.q.weight if m.cross else m.qkv.weight[:inner]
                kv = m.kv.weight if m.cross else m.qkv.weight[inner:]
                nn.init.normal_(q, 0.0, f * (C * cfg.head_dim) ** -0.5)
                nn.init.normal_(kv, 0.0, f * C ** -0.5)
                nn.init.normal_(m.proj.weight, 0.0, f * inner ** -0.5)
            elif isinstance(m, MLP):
                nn.init.normal_(m.fc.weight, 0.0, f * C ** -0.5)
                nn.init.normal_(m.proj.weight, 0.0, f * cfg.ffn_hidden ** -0.5)
            elif isinstance(m, RMSNorm):
                nn.init.ones_(m.weight)

    def position_bias(self, table, T, S, start, bidirectional):
        """(1, H, T, S) score biases of queries start..start+T-1 over keys 0..S-1."""
        q = torch.arange(start, start + T, device=table.weight.device)[:, None]
        rel = torch.arange(S, device=table.weight.device)[None, :] - q
        b = table(relative_buckets(rel, bidirectional, self.cfg.num_buckets, self.cfg.max_distance))
        return b.permute(2, 0, 1)[None]

    @staticmethod
    def key_mask(src_mask, like):
        """(B, S) 0/1 real-key mask -> a (B, 1, 1, S) float bias (0 / -inf) in like's dtype; None stays None."""
        if src_mask is None:
            return None
        return torch.zeros(src_mask.shape, dtype=like.dtype, device=like.device).masked_fill(
            ~src_mask.bool(), float("-inf"))[:, None, None]

    def encode(self, src, src_mask=None):
        """src (B, S) ids, src_mask (B, S) 0/1 (None: all real) -> the encoder output (B, S, C)."""
        x = self.drop(self.tok_emb(src))
        bias = self.position_bias(self.enc_rel, src.shape[1], src.shape[1], 0, True).to(x.dtype)
        mask = self.key_mask(src_mask, bias)
        bias = bias if mask is None else bias + mask
        for block in self.blocks[:self.cfg.n_layer]:
            x = block(x, bias)
        return self.drop(self.enc_norm(x))

    def decode(self, tgt, context, src_mask=None, cache=None):
        """Decoder inputs tgt (B, T) over the encoder output -> hidden states (B, T, C). cache (Cache):
        tgt follows the cache.length tokens already decoded; their keys come from the cache."""
        start = cache.length if cache is not None else 0
        T = tgt.shape[1]
        x = self.drop(self.tok_emb(tgt))
        bias = self.position_bias(self.dec_rel, T, start + T, start, False).to(x.dtype)
        causal = torch.arange(start + T, device=x.device)[None, :] > torch.arange(start, start + T, device=x.device)[:, None]
        bias = bias.masked_fill(causal, float("-inf"))
        context_bias = self.key_mask(src_mask, bias)
        for i, block in enumerate(self.blocks[self.cfg.n_layer:]):
            x = block(x, bias, context, context_bias, cache, i)
        if cache is not None:
            cache.length += T
        return self.drop(self.norm_f(x))

    def logits(self, h):
        """Decoder hidden states -> logits (..., vocab_size), padded rows sliced off."""
        return self.head(h * self.cfg.n_embd ** -0.5 if self.cfg.scale_logits else h)[..., :self.cfg.vocab_size]

    def shift_right(self, targets):
        """Targets (B, T) -> decoder inputs: the start id, then targets[:, :-1], IGNORE as pad_id."""
        tgt = targets.roll(1, dims=1)
        tgt[:, 0] = self.cfg.decoder_start_id
        return tgt.masked_fill(tgt < 0, self.cfg.pad_id)

    def forward(self, src, targets=None, *, tgt=None, src_mask=None, reduction="mean"):
        """Logits (B, T, vocab_size) of the decoder inputs tgt (default: shift_right(targets)), or with
        targets (B, T) (IGNORE: no loss) the cross-entropy, reduction "mean" | "sum" | "none"."""
        h = self.decode(self.shift_right(targets) if tgt is None else tgt, self.encode(src, src_mask), src_mask)
        logits = self.logits(h)
        return logits if targets is None else Transformer.loss(logits, targets, reduction)


def flops_per_row(cfg, src_len, tgt_len):
    """Training FLOPs of one (source, target) row, DESIGN.md's count: 6 x the encoder blocks' matmul
    weights x src_len + 6 x the decoder's (head included) x tgt_len + attention per layer: encoder
    12 S^2 C' (bidirectional), decoder 6 T^2 C' (causal) + 12 T S C' (cross), C' = n_head * head_dim."""
    C, D = cfg.n_embd, cfg.n_head * cfg.head_dim
    hidden = cfg.ffn_hidden * (3 if cfg.activation.startswith("gated") else 2)
    enc = cfg.n_layer * (4 * C * D + C * hidden)
    dec = cfg.decoder_layers * (8 * C * D + C * hidden) + C * cfg.padded_vocab
    S, T = src_len, tgt_len
    return (6 * (enc * S + dec * T) + 12 * cfg.n_layer * S * S * D
            + cfg.decoder_layers * (6 * T * T * D + 12 * T * S * D))


# ----------------------------------------------------------------------------- generation

class Cache:
    """The decoder's keys and values: self-attention's grow (generate.KVCache, `length` decoded so
    far), cross-attention's [k | v] of the encoder output computed at the first step and kept."""

    def __init__(self, max_len):
        self.kv, self.cross = KVCache(max_len), []

    length = property(lambda self: self.kv.length, lambda self, n: setattr(self.kv, "length", n))

    def update(self, layer, k, v):
        return self.kv.update(layer, k, v)

    def cross_kv(self, layer, make):
        if layer == len(self.cross):
            self.cross.append(make())
        return self.cross[layer]


@torch.no_grad()
def generate(model, src, max_new_tokens, *, vocab, src_mask=None, temperature=1.0, top_k=None, top_p=None,
             stop_tokens=None, pad_id=None, generator=None, seed=None):
    """Decode max_new_tokens after the start id for each source row, one token per step through the
    cache -> (B, 1 + n) ids, the start id first (as transformers' generate returns). vocab: the
    tokenizer that decodes them, or an int n (generate.Emittable: never a sentinel past the tokenizer's
    ids, nor a padded row); temperature 0: greedy; top_k / top_p filter (generate.sample). A row that
    emitted one of stop_tokens then repeats pad_id (default cfg.pad_id); generation ends once every row
    has stopped. Eval mode inside."""
    if temperature < 0:
        raise ConfigError(f"temperature={temperature} must be >= 0 (0 = greedy)")
    if generator is None and seed is not None:
        generator = torch.Generator(src.device).manual_seed(seed)
    B = src.shape[0]
    stops = torch.as_tensor(list(stop_tokens or []), device=src.device)
    fill = model.cfg.pad_id if pad_id is None else pad_id
    allowed = Emittable(vocab, model.cfg.vocab_size, src.device)
    was_training = model.training
    model.eval()
    try:
        context, cache = model.encode(src, src_mask), Cache(max_new_tokens)
        out = [torch.full((B, 1), model.cfg.decoder_start_id, dtype=torch.long, device=src.device)]
        done = torch.zeros(B, dtype=torch.bool, device=src.device)
        for _ in range(max_new_tokens):
            h = model.decode(out[-1], context, src_mask, cache)
            nxt = sample(allowed(model.logits(h[:, -1])), temperature, top_k, top_p, generator)
            nxt = nxt.masked_fill(done, fill)
            done = done | torch.isin(nxt, stops)
            out.append(nxt[:, None])
            if stops.numel() and bool(done.all()):
                break
    finally:
        model.train(was_training)
    return torch.cat(out, dim=1)


# ----------------------------------------------------------------------------- span corruption

def span_counts(length, noise_density=0.15, mean_span=3.0):
    """(noise tokens, noise spans) of a row of `length`: T5's round(length * density), at least 1 and
    at most length - 1; round(noise / mean_span) spans, at least 1 (Python's round: half to even, as numpy's)."""
    noise = min(max(int(round(length * noise_density)), 1), length - 1)
    return noise, max(int(round(noise / mean_span)), 1)


def random_segmentation(n, segments, generator=None):
    """n items cut into `segments` non-empty runs, every cut equally likely -> their lengths (segments,)."""
    cuts = torch.zeros(n - 1, dtype=torch.bool)
    cuts[torch.randperm(n - 1, generator=generator)[:segments - 1]] = True
    starts = torch.cat([torch.tensor([True]), cuts])
    return torch.bincount(starts.long().cumsum(0) - 1, minlength=segments)


def noise_mask(length, noise_density=0.15, mean_span=3.0, generator=None):
    """T5's random_spans_noise_mask -> (length,) bool, True = noise (see the module docstring)."""
    if length < 2:
        raise ConfigError(f"span corruption needs rows of at least 2 tokens, got {length}")
    noise, spans = span_counts(length, noise_density, mean_span)
    noise_lengths = random_segmentation(noise, spans, generator)
    keep_lengths = random_segmentation(length - noise, spans, generator)
    runs = torch.stack([keep_lengths, noise_lengths], dim=1).flatten()  # non-noise first, alternating
    is_noise = torch.arange(2 * spans) % 2 == 1
    return is_noise.repeat_interleave(runs)


def sentinel_fill(ids, drop, vocab_size, eos_id):
    """ids (L,) with each run of `drop` (L,) bool replaced by one sentinel (vocab_size - 1 for the
    first run, counting down), then eos: HF's create_sentinel_ids + filter_input_ids for one row."""
    first = drop & ~torch.cat([torch.tensor([False], device=drop.device), drop[:-1]])  # a run starts here
    sentinel = vocab_size - first.long().cumsum(0)
    kept = torch.where(first, sentinel, ids)[first | ~drop]
    return torch.cat([kept, torch.tensor([eos_id], dtype=ids.dtype, device=ids.device)])


def span_corrupt(ids, *, vocab_size, eos_id, noise_density=0.15, mean_span=3.0, generator=None, mask=None):
    """One row of ids (L,) -> (inputs, targets): T5's span corruption (module docstring). vocab_size:
    the tokenizer's ids (the sentinels are its top ids); mask: a given noise mask instead of a drawn one."""
    mask = noise_mask(ids.numel(), noise_density, mean_span, generator).to(ids.device) if mask is None else mask
    return sentinel_fill(ids, mask, vocab_size, eos_id), sentinel_fill(ids, ~mask, vocab_size, eos_id)


def corrupted_lengths(inputs_length, noise_density=0.15, mean_span=3.0):
    """-> (raw tokens, target length): the most raw tokens whose corruption fits inputs_length (HF's
    compute_input_and_target_lengths: the loader reads that many tokens per row; inputs of at most
    inputs_length, targets of exactly the target length)."""
    def lengths(n):
        noise = int(round(n * noise_density))
        spans = int(round(noise / mean_span))
        return n - noise + spans + 1, noise + spans + 1
    n = inputs_length
    while lengths(n + 1)[0] <= inputs_length:
        n += 1
    targets = lengths(n)[1]
    if noise_density == 0.5 and targets > inputs_length:
        n, targets = n - 1, targets - 1
    return n, targets


# ----------------------------------------------------------------------------- HF folders

def hf_names(cfg):
    """Our parameter name -> [HF names], several concatenated along our rows (q | k | v; wi_0 | wi_1)."""
    mlp = ["wi_0", "wi_1"] if cfg.activation.startswith("gated") else ["wi"]
    out = {"tok_emb.weight": ["shared.weight"], "enc_norm.weight": ["encoder.final_layer_norm.weight"],
           "norm_f.weight": ["decoder.final_layer_norm.weight"],
           "enc_rel.weight": ["encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"],
           "dec_rel.weight": ["decoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"]}
    for i in range(cfg.n_layer + cfg.decoder_layers):
        dec = i >= cfg.n_layer
        hf, ff = (f"decoder.block.{i - cfg.n_layer}.layer.", 2) if dec else (f"encoder.block.{i}.layer.", 1)
        ours = f"blocks.{i}."
        out.update({ours + "norm1.weight": [hf + "0.layer_norm.weight"],
                    ours + "attn.qkv.weight": [f"{hf}0.SelfAttention.{n}.weight" for n in "qkv"],
                    ours + "attn.proj.weight": [hf + "0.SelfAttention.o.weight"],
                    ours + "norm2.weight": [f"{hf}{ff}.layer_norm.weight"],
                    ours + "mlp.fc.weight": [f"{hf}{ff}.DenseReluDense.{n}.weight" for n in mlp],
                    ours + "mlp.proj.weight": [f"{hf}{ff}.DenseReluDense.wo.weight"]})
        if dec:
            out.update({ours + "norm_x.weight": [hf + "1.layer_norm.weight"],
                        ours + "cross.q.weight": [hf + "1.EncDecAttention.q.weight"],
                        ours + "cross.kv.weight": [hf + "1.EncDecAttention.k.weight", hf + "1.EncDecAttention.v.weight"],
                        ours + "cross.proj.weight": [hf + "1.EncDecAttention.o.weight"]})
    if not cfg.tie_embeddings:
        out["head.weight"] = ["lm_head.weight"]
    return out


def config_from_hf(hf, untied=False):
    """A T5 config.json (dict) -> T5Config. untied: the folder has an lm_head of its own (v1.1)."""
    act = hf.get("feed_forward_proj", "relu")
    for bad, what in [(hf.get("model_type") != "t5", f"model_type={hf.get('model_type')!r} (t5 only)"),
                      (act not in ACTIVATIONS, f"feed_forward_proj={act!r} (choose one of {', '.join(ACTIVATIONS)})")]:
        if bad:
            raise ConfigError(f"t5 config: {what} is not supported by t5.py")
    tied = hf.get("tie_word_embeddings", True) is not False and not untied
    return T5Config(vocab_size=hf["vocab_size"], n_layer=hf["num_layers"], n_decoder_layer=hf.get("num_decoder_layers") or 0,
                    n_head=hf["num_heads"], n_embd=hf["d_model"], head_dim=hf["d_kv"], ffn_hidden=hf["d_ff"],
                    activation=act, tie_embeddings=tied,
                    scale_logits=hf.get("scale_decoder_outputs", hf.get("tie_word_embeddings", True) is not False),
                    num_buckets=hf.get("relative_attention_num_buckets", 32),
                    max_distance=hf.get("relative_attention_max_distance", 128),
                    norm_eps=hf.get("layer_norm_epsilon", 1e-6), dropout=hf.get("dropout_rate", 0.1),
                    init_factor=hf.get("initializer_factor", 1.0), pad_id=hf.get("pad_token_id", 0),
                    decoder_start_id=hf.get("decoder_start_token_id", hf.get("pad_token_id", 0)))


def has_own_head(path):
    """Whether an HF T5 folder's lm_head differs from its shared embedding (v1.1; transformers 5 writes
    a tied model's lm_head too)."""
    file = os.path.join(path, "model.safetensors")
    if not os.path.isfile(file):
        raise ConfigError(f"{path}: no model.safetensors (t5.py reads safetensors only)")
    with safe_open(file, framework="pt") as st:
        return "lm_head.weight" in st.keys() and not torch.equal(st.get_tensor("lm_head.weight"),
                                                                 st.get_tensor("shared.weight"))


@torch.no_grad()
def load_hf(path, dtype=torch.float32):
    """An HF T5ForConditionalGeneration folder (config.json + model.safetensors) -> T5 in eval mode."""
    untied, file = has_own_head(path), os.path.join(path, "model.safetensors")
    with open(os.path.join(path, "config.json")) as f, safe_open(file, framework="pt") as st:
        keys = set(st.keys())
        cfg = config_from_hf(json.load(f), untied)
        model = T5(cfg).to(dtype)
        used = hf.read_mapped(model, hf_names(cfg), lambda n: st.get_tensor(n) if n in keys else None, path,
                              "T5ForConditionalGeneration of this config", VOCAB_ROWS)
    copies = {"encoder.embed_tokens.weight", "decoder.embed_tokens.weight", "lm_head.weight"}  # tied copies
    unused = sorted(keys - used - copies)
    if unused:
        raise ConfigError(f"{path}: tensors t5.py does not understand: {unused[:8]}")
    return model.eval()


def export_hf(model, out_dir):
    """Write a T5 as an HF folder transformers loads as T5ForConditionalGeneration."""
    cfg = model.cfg
    config = dict(architectures=["T5ForConditionalGeneration"], model_type="t5", vocab_size=cfg.vocab_size,
                  d_model=cfg.n_embd, d_kv=cfg.head_dim, d_ff=cfg.ffn_hidden, num_layers=cfg.n_layer,
                  num_decoder_layers=cfg.decoder_layers, num_heads=cfg.n_head, feed_forward_proj=cfg.activation,
                  relative_attention_num_buckets=cfg.num_buckets, relative_attention_max_distance=cfg.max_distance,
                  dropout_rate=cfg.dropout, layer_norm_epsilon=cfg.norm_eps, initializer_factor=cfg.init_factor,
                  is_encoder_decoder=True, pad_token_id=cfg.pad_id, decoder_start_token_id=cfg.decoder_start_id,
                  tie_word_embeddings=cfg.tie_embeddings, scale_decoder_outputs=cfg.scale_logits)
    return hf.write_mapped(model, hf_names(cfg), config, out_dir, VOCAB_ROWS)


class T5Family(denoising.Denoising, seq2seq.Seq2Seq):
    """weights.Family for objective "span": a T5 pretrained on corrupted spans (denoising.py's batches and
    loss, rows of corrupted_lengths tokens) and fine-tuned sequence to sequence (seq2seq.py's pairs)."""
    name, chosen_by, Config, Model, hf_class = "T5", "objective='span'", T5Config, T5, "T5ForConditionalGeneration"
    extra_what = "sentinel"
    no_sample = "a T5 generates from a source text (t5.generate; sft.py's held-out answers), not from a prompt"

    def read_length(self, cfg):
        """The most raw tokens whose corruption fits seq_len (T5's rule: more than seq_len)."""
        return corrupted_lengths(cfg.seq_len or cfg.block_size, cfg.noise_density, cfg.mean_span)[0]

    def extra_ids(self, cfg):
        return span_counts(self.read_length(cfg), cfg.noise_density, cfg.mean_span)[1]  # the sentinels of a row

    def check_rows(self, cfg):
        """T5's rounding: the sentinels of a short row can overflow it."""
        n, T = self.read_length(cfg), cfg.seq_len or cfg.block_size
        noise, spans = span_counts(n, cfg.noise_density, cfg.mean_span)
        need(n - noise + spans + 1 <= T, f"span corruption of {n} tokens gives inputs longer than seq_len={T}: "
             "a longer seq_len, or another noise_density / mean_span")

    def corrupt_row(self, row, cfg, tok, generator):
        return span_corrupt(row, vocab_size=cfg.vocab_size, eos_id=tok.eos_id, noise_density=cfg.noise_density,
                            mean_span=cfg.mean_span, generator=generator)

    def flops_per_token(self, model, cfg):
        """Per raw token read: a row's FLOPs (its corrupted input and target) over read_length."""
        n, targets = corrupted_lengths(cfg.seq_len or cfg.block_size, cfg.noise_density, cfg.mean_span)
        noise, spans = span_counts(n, cfg.noise_density, cfg.mean_span)
        return flops_per_row(model.cfg, n - noise + spans + 1, targets) / n

    def config_from_hf(self, path):
        return config_from_hf(hf.read_config(path), has_own_head(path))

    def load_hf(self, path):
        return load_hf(path)

    def export(self, model, folder):
        return export_hf(model, folder)

    def generate(self, model, src, max_new_tokens, **kw):
        return generate(model, src, max_new_tokens, **kw)


FAMILY = T5Family()
