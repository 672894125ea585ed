"""The Transformer: GPT-2/3 and LLaMA families by config, FLOPs.

One decoder-only model covers both families; ModelConfig picks the pieces:

    GPT-2:  pos_emb="learned", norm="layernorm", activation="gelu", bias=True, tie_embeddings=True
    LLaMA:  pos_emb="rope", norm="rmsnorm", activation="swiglu", n_kv_head < n_head (GQA)
    MPT:    pos_emb="alibi", norm="layernorm", activation="gelu", bias=False, tie_embeddings=True
    Mistral / Qwen2 windows: sliding_window=W (window_from=k: layers k.. only), with any of the above
    modded-nanogpt: activation="relu2", qk_norm, logit_softcap, value_embeds, unet_skips, fp8_head (fused.py)

Read top to bottom: config, norms, attention (RoPE's tables: rope.py), MLP, block, the model (forward,
init, parameter/FLOP counts). The attention here is training's (flash-attn, else SDPA). The KV
caches, their attention, sampling and generate() live in generate.py: given a cache (generate.Cache:
`length`, `attend(layer, q, k, v, mask, is_causal, dropout)`, optionally `index`, the new tokens' cache
slots, which ALiBi and the window read when `length` does not say) each layer's attention is its.
A pipeline stage (pp.py) runs the pieces of forward: embed, run_blocks over its blocks, output.
Mixture-of-experts layers are moe.py's (imported here, handed this file's MLP class and
activation function).
Shapes use B (batch), T (time), C (n_embd), H (query heads), KV (key/value heads),
D (head_dim), V (vocab_size), S (key length, = cached + new tokens).
"""
import functools
import math
from dataclasses import dataclass, field, fields

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import fused
import moe
from fused import IGNORE  # target id that contributes no loss (prompt tokens, padding): -100
from rope import apply_rope, check_scaling, rope_tables  # (model.rope_tables: memory/materialize.py)

try:  # optional: Tri Dao's kernels; SDPA is the always-available fallback
    from flash_attn import flash_attn_func
    HAS_FLASH_ATTN = True
except Exception:  # ImportError, or a wheel built against another torch/CUDA
    flash_attn_func = None
    HAS_FLASH_ATTN = False

# SDPA learned grouped-query attention (enable_gqa) in torch 2.5; on 2.4 we repeat kv heads.
SDPA_GQA = tuple(int(p) for p in torch.__version__.split(".")[:2]) >= (2, 5)

ACTIVATIONS = ("gelu", "gelu_tanh", "relu", "relu2", "swiglu", "geglu")
NORMS = ("layernorm", "rmsnorm")
POS_EMBS = ("rope", "learned", "alibi")


def round_up(n, multiple):
    return -(-n // multiple) * multiple


@dataclass
class ModelConfig:
    vocab_size: int = 50304        # tokenizer vocabulary (ids >= vocab_size never occur)
    pad_vocab_multiple: int = 64   # embedding/head rows padded to a multiple of this (speed)
    block_size: int = 1024         # longest sequence (learned positions / RoPE cache length)
    n_layer: int = 12              # Transformer blocks
    n_head: int = 12               # query heads
    n_kv_head: int = 0             # 0 -> n_head (MHA); 1 -> MQA; in between -> GQA
    n_embd: int = 768              # width of the residual stream
    ffn_hidden: int = 0            # 0 -> 4*n_embd (plain) or 8/3*n_embd rounded up to 64 (gated)
    activation: str = "swiglu"     # gelu | gelu_tanh | relu | relu2 | swiglu | geglu
    norm: str = "rmsnorm"          # layernorm | rmsnorm
    norm_eps: float = 1e-5         # added to the variance in LayerNorm / RMSNorm
    prenorm: bool = True           # False -> post-norm (original Transformer / BERT)
    pos_emb: str = "rope"          # rope | learned | alibi (MPT: per-head linear score biases, no position table)
    rope_theta: float = 10000.0    # RoPE's base frequency
    rope_scaling: dict = field(default_factory=dict)  # {} (none), linear | dynamic | yarn | llama3 (init_from:
                                   # factor = block_size / its positions, transformers' defaults), or HF's dict
                                   # {"rope_type": "yarn", "factor": 4.0, ...} (rope.py)
    bias: bool = False             # biases in linears (and LayerNorm)
    qkv_bias: bool = False         # bias on the q/k/v projection only (Qwen2); implied by bias
    tie_embeddings: bool = False   # the head shares the token embedding's weight
    sliding_window: int = 0        # > 0: a query sees only the latest sliding_window keys, itself included (Mistral)
    window_from: int = 0           # the window applies from this layer on (Qwen2's max_window_layers); 0: every layer
    qk_norm: bool = False          # RMSNorm on q and k per head (OLMo-2 / Gemma-3 style)
    logit_softcap: float = 0.0     # > 0: logits = c * tanh(z / c) on every path that makes them (Gemma 2)
    value_embeds: int = 0          # n > 0: token tables (vocab x kv width) mixed into v, table i in layers i, L-n+i
    unet_skips: bool = False       # block i < n_layer//2's output, times a learned weight, joins block L-1-i's input
    fp8_head: bool = False         # the head's matmul in FP8 while training on a GPU that has it (fused.FP8Linear)
    dropout: float = 0.0           # on attention probabilities and residual branches (training only)
    init_std: float = 0.02         # normal init of the weights (residual projections scaled by depth)
    grad_checkpoint: bool = False  # recompute each block in backward (activation checkpointing)
    fp32_residual: bool = True     # False: the residual stream in the autocast dtype (bf16), as Megatron-LM
                                   # (autocast alone keeps it fp32, as HF does); less memory traffic
    # mixture of experts (moe.py); n_experts = 0: dense MLP in every layer
    n_experts: int = 0             # routed experts per MoE layer
    moe_top_k: int = 2             # experts per token
    n_shared_experts: int = 0      # always-on experts (one dense MLP of n_shared_experts * expert hidden)
    moe_hidden: int = 0            # hidden size of one expert; 0 -> the dense MLP's hidden size
    moe_every: int = 1             # every moe_every-th layer from moe_first_dense on is MoE
    moe_first_dense: int = 0       # the first layers stay dense (DeepSeek's first_k_dense_replace)
    capacity_factor: float = 0.0   # > 0: per-rank expert capacity ceil(cf * tokens * top_k / n_experts); 0: dropless
    moe_renorm: bool = True        # renormalise the top-k router probabilities to sum to 1
    aux_loss_coeff: float = 0.01   # load-balancing loss coefficient
    z_loss_coeff: float = 0.001    # router z-loss coefficient

    @classmethod
    def from_cfg(cls, cfg):
        """Pick this dataclass's keys out of a flat training config namespace."""
        return cls(**{f.name: getattr(cfg, f.name) for f in fields(cls) if hasattr(cfg, f.name)})

    def __post_init__(self):
        # fail at construction with a message that says what to change, not deep in a forward
        for name in ("vocab_size", "pad_vocab_multiple", "block_size", "n_layer", "n_head", "n_embd"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}={getattr(self, name)} must be a positive integer")
        for name in ("n_kv_head", "ffn_hidden"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 0 (0 picks the default)")
        for name in ("norm_eps", "init_std", "rope_theta"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}={getattr(self, name)} must be > 0")
        if self.logit_softcap < 0 or not 0 <= 2 * self.value_embeds <= self.n_layer:
            raise ValueError(f"logit_softcap={self.logit_softcap} must be >= 0 (0: none) and value_embeds="
                             f"{self.value_embeds} in [0, n_layer/2 = {self.n_layer // 2}] (the first and last layers)")
        if self.sliding_window < 0 or not 0 <= self.window_from < self.n_layer:
            raise ValueError(f"sliding_window={self.sliding_window} must be >= 0 (0: none) and window_from="
                             f"{self.window_from} in [0, n_layer={self.n_layer})")
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd={self.n_embd} is not divisible by n_head={self.n_head}: "
                             f"pick n_embd a multiple of n_head")
        if self.n_head % self.kv_heads:
            raise ValueError(f"n_head={self.n_head} is not divisible by n_kv_head={self.n_kv_head}: "
                             f"pick n_kv_head a divisor of n_head (1 = MQA, 0 or n_head = MHA)")
        for name, valid in (("activation", ACTIVATIONS), ("norm", NORMS), ("pos_emb", POS_EMBS)):
            if getattr(self, name) not in valid:
                raise ValueError(f"unknown {name}={getattr(self, name)!r}: choose one of {', '.join(valid)}")
        if self.pos_emb == "rope" and self.head_dim % 2:
            raise ValueError(f"pos_emb='rope' needs an even head_dim, got n_embd/n_head = {self.head_dim}: "
                             f"change n_embd or n_head")
        check_scaling(self.rope_scaling)
        if self.rope_scaling and self.pos_emb != "rope":
            raise ValueError(f"rope_scaling={self.rope_scaling!r} scales RoPE: pos_emb={self.pos_emb!r} has none")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout={self.dropout} must be in [0, 1)")
        if self.n_experts < 0:
            raise ValueError(f"n_experts={self.n_experts} must be >= 0 (0 = dense)")
        if self.n_experts:
            if not 1 <= self.moe_top_k <= self.n_experts:
                raise ValueError(f"moe_top_k={self.moe_top_k} must be in [1, n_experts={self.n_experts}]")
            for name in ("n_shared_experts", "moe_hidden", "moe_first_dense", "capacity_factor",
                         "aux_loss_coeff", "z_loss_coeff"):
                if getattr(self, name) < 0:
                    raise ValueError(f"{name}={getattr(self, name)} must be >= 0")
            if self.moe_every < 1:
                raise ValueError(f"moe_every={self.moe_every} must be >= 1 (1 = every layer)")
            if self.moe_first_dense >= self.n_layer:
                raise ValueError(f"moe_first_dense={self.moe_first_dense} leaves no MoE layer among "
                                 f"n_layer={self.n_layer}: lower it or set n_experts=0")

    @property
    def kv_heads(self):
        return self.n_kv_head or self.n_head

    @property
    def head_dim(self):
        return self.n_embd // self.n_head

    @property
    def padded_vocab(self):
        return round_up(self.vocab_size, self.pad_vocab_multiple)

    @property
    def gated(self):
        return self.activation in ("swiglu", "geglu")

    @property
    def family(self):
        """The HF family whose module names and layout this model takes: "gpt2" (learned positions),
        "mpt" (ALiBi) or "llama" (LLaMA / Qwen2 / Mistral: rotary positions)."""
        return {"learned": "gpt2", "alibi": "mpt"}.get(self.pos_emb, "llama")

    @property
    def hidden(self):
        if self.ffn_hidden:
            return self.ffn_hidden
        # gated MLPs have three matrices instead of two; 8/3 keeps the parameter count of 4x (LLaMA)
        return round_up(int(8 * self.n_embd / 3), 64) if self.gated else 4 * self.n_embd


# ----------------------------------------------------------------------------- norms

class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in fp32 (bf16 sums of squares lose too much) and cast back. lean (the
    stream's norms): a bf16 input is what backward keeps, its fp32 copy made again there."""

    def __init__(self, dim, eps=1e-5, lean=False):
        super().__init__()
        self.eps, self.lean = eps, lean
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        if self.lean and x.dtype != torch.float32 and x.requires_grad and torch.is_grad_enabled():
            # a bf16 stream: keep x for backward, not the fp32 copy (half the bytes; the cast is redone there)
            return checkpoint(self.norm, x, use_reentrant=False)
        return self.norm(x)

    def norm(self, x):
        return F.rms_norm(x.float(), (x.shape[-1],), self.weight.float(), self.eps).type_as(x)


def make_norm(cfg, dim):
    if cfg.norm == "rmsnorm":
        return RMSNorm(dim, cfg.norm_eps, lean=True)
    return nn.LayerNorm(dim, eps=cfg.norm_eps, bias=cfg.bias)


def position_ids(attention_mask):
    """(B, S) 0/1 mask of real tokens -> positions counted from each row's first real token.

    Left-padded rows then see positions 0, 1, 2, ... exactly as if they were run alone.
    Padding gets position 0 (its output is never used).
    """
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


# ----------------------------------------------------------------------------- ALiBi

def alibi_slopes(n_head, device=None, bias_max=8):
    """ALiBi's per-head slopes (H,), fp32, as MPT (and HF's MptModel) computes them: 1 / 2^(h * bias_max / n)
    for h = 1..n, n = n_head rounded up to a power of two; when n > n_head, the odd-numbered of those n
    slopes then the even-numbered, the first n_head. A head adds -slope * (query - key distance) to its
    scores (Transformer._positional_masks), so it attends the nearer keys more, at any length."""
    n = 2 ** math.ceil(math.log2(n_head))
    slopes = 1.0 / torch.pow(2, torch.arange(1, n + 1, device=device).float() * (bias_max / n))
    return slopes if n == n_head else torch.cat([slopes[1::2], slopes[::2]])[:n_head]


# ----------------------------------------------------------------------------- attention

def value_layer(cfg, layer):
    """The value table layer `layer` mixes into its v, or None: table i serves layers i and n_layer - value_embeds + i.
    As modded-nanogpt's train_gpt.py of its 2025-01-16 record (Sub3Min: "012 ... 012" over 12 layers, v = l0 v +
    l1 table[ids], l = (0.5, 0.5) at init), but kv-wide tables (GQA), N(0, init_std), no l0 in layers without."""
    n, L = cfg.value_embeds, cfg.n_layer
    return layer if layer < n else layer - (L - n) if layer >= L - n else None


class Attention(nn.Module):
    """Causal self-attention with MHA / GQA / MQA, optional per-head q/k RMSNorm.

    n_head, n_kv_head and head_dim are instance attributes read in forward, not cfg, because
    tensor parallelism shrinks them to the heads this rank owns.
    """

    def __init__(self, cfg, layer=0):
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = cfg.n_head, cfg.kv_heads, cfg.head_dim
        # one fused matmul; output rows ordered [q heads | k heads | v heads]
        self.qkv = nn.Linear(cfg.n_embd, (self.n_head + 2 * self.n_kv_head) * self.head_dim,
                             bias=cfg.bias or cfg.qkv_bias)
        self.proj = nn.Linear(self.n_head * self.head_dim, cfg.n_embd, bias=cfg.bias)
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.norm_eps)
        if value_layer(cfg, layer) is not None:  # v = l0 v + l1 ve, l = (0.5, 0.5) at init (modded-nanogpt)
            self.ve_lambdas = nn.Parameter(torch.full((2,), 0.5))
        self.dropout = cfg.dropout

    def heads(self, x, cos=None, sin=None, ve=None):
        """x (B, T, C) -> q (B, T, H, D), k and v (B, T, KV, D): projected, q/k normed, rotated; ve (B, T, KV * D):
        the tokens' value embeddings, mixed into v."""
        H, KV, D = self.n_head, self.n_kv_head, self.head_dim
        qkv = self.qkv(x)  # (B, T, ...): the whole sequence also when x is a shard of it (tp.py)
        B, T, _ = qkv.shape
        q, k, v = qkv.split([H * D, KV * D, KV * D], dim=-1)
        q, k, v = q.view(B, T, H, D), k.view(B, T, KV, D), v.view(B, T, KV, D)
        if ve is not None:
            v = (self.ve_lambdas[0] * v + self.ve_lambdas[1] * ve.view(B, T, KV, D)).type_as(v)
        if self.qk_norm:  # before RoPE, as in OLMo-2 / Qwen-3
            q, k = self.q_norm(q), self.k_norm(k)
        if cos is not None:
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cos is not None or self.qk_norm:  # q, k are new tensors: v alone would keep all of qkv for backward
            v = v.contiguous()
        return q, k, v

    def probs(self, x, cos=None, sin=None, mask=None, is_causal=True):
        """(B, H, T, T) attention probabilities of x: what forward's softmax weighs (plots.py). mask,
        is_causal: forward's (a boolean mask keeps True, a float one is added: ALiBi's biases, the
        sliding window); None with is_causal: causal."""
        q, k, _ = self.heads(x, cos, sin)
        k = k.repeat_interleave(self.n_head // self.n_kv_head, dim=2)
        scores = torch.einsum("bthd,bshd->bhts", q.float(), k.float()) / math.sqrt(self.head_dim)
        if mask is None:
            mask = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool, device=x.device).tril() if is_causal else None
        if mask is not None and mask.is_floating_point():
            scores = scores + mask.float()
        elif mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        return scores.softmax(-1)

    def forward(self, x, cos=None, sin=None, mask=None, is_causal=True, cache=None, layer=0, ve=None):
        H, D = self.n_head, self.head_dim
        q, k, v = self.heads(x, cos, sin, ve)
        B, T = q.shape[:2]
        p = self.dropout if self.training else 0.0
        if cache is not None:  # generation or a prefix (generate.Cache): it keeps k, v and attends over all it holds
            return self.proj(cache.attend(layer, q, k, v, mask, is_causal, p))
        if HAS_FLASH_ATTN and mask is None and is_causal and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16):
            # flash-attn takes (B, T, heads, D) directly and handles GQA natively
            y = flash_attn_func(q, k, v, dropout_p=p, causal=True)
        else:
            y = sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask, is_causal, p).transpose(1, 2)
        return self.proj(y.reshape(B, T, H * D))


def sdpa(q, k, v, mask=None, is_causal=True, dropout=0.0):
    """q (B, H, T, D), k and v (B, KV, S, D) -> (B, H, T, D): PyTorch's scaled_dot_product_attention, grouped
    kv heads (KV < H) through its enable_gqa, or repeated where it cannot take them (a mask; torch 2.4)."""
    H, KV = q.shape[1], k.shape[1]
    gqa = KV != H
    if gqa and (mask is not None or not SDPA_GQA):
        # the fused kernels that take a mask don't all support GQA: give them full heads
        k, v = k.repeat_interleave(H // KV, dim=1), v.repeat_interleave(H // KV, dim=1)
        gqa = False
    kw = {"enable_gqa": True} if gqa else {}
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=is_causal, **kw)


# ----------------------------------------------------------------------------- MLP

def activation_fn(name):
    # gelu is the exact erf form (F.gelu default); gelu_tanh the tanh approximation GPT-2 used
    # (HF's gelu_new), < 1e-3 apart: imported GPT-2 weights need gelu_tanh to match HF's logits.
    if name in ("gelu", "geglu"):
        return F.gelu
    if name == "gelu_tanh":
        return functools.partial(F.gelu, approximate="tanh")
    if name == "relu":
        return F.relu
    if name == "relu2":  # squared ReLU (Primer, modded-nanogpt)
        return lambda x: F.relu(x).square()
    return F.silu  # swiglu


def activate(h, act, gated):
    """The MLP's activation of h = fc(x): act(gate) * up over h's two halves (gated: SwiGLU, GeGLU), else act(h)."""
    if gated:
        gate, up = h.chunk(2, dim=-1)
        return act(gate) * up
    return act(h)


class MLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.gated = cfg.gated
        # gated: one matmul yields rows [gate | up]; out = act(gate) * up
        self.fc = nn.Linear(cfg.n_embd, 2 * cfg.hidden if cfg.gated else cfg.hidden, bias=cfg.bias)
        self.proj = nn.Linear(cfg.hidden, cfg.n_embd, bias=cfg.bias)
        self.act = activation_fn(cfg.activation)
        self.split = cfg.gated  # the two-matmul path below; generate.decode turns it off (one launch)

    def forward(self, x):
        if self.split and type(self.fc) is nn.Linear and not (self.fc._forward_hooks or self.fc._forward_pre_hooks):
            # two matmuls over the weight's [gate | up] halves rather than one and a split: the
            # backward's elementwise kernel then writes d_gate and d_up as two tensors, reading
            # each input once (measured 2x faster kernel, +1-2% per step at the 124M shape).
            # A swapped-in fc (tensor parallelism, LoRA) or one with hooks takes the general path.
            (wg, wu), b = self.fc.weight.chunk(2), self.fc.bias
            bg, bu = b.chunk(2) if b is not None else (None, None)
            return self.proj(self.act(F.linear(x, wg, bg)) * F.linear(x, wu, bu))
        return self.proj(activate(self.fc(x), self.act, self.gated))


def make_moe(cfg):
    """A mixture-of-experts layer (moe.py) whose shared experts are this file's MLP."""
    return moe.MoE(cfg, MLP, activation_fn(cfg.activation))


# ----------------------------------------------------------------------------- block

class Block(nn.Module):
    def __init__(self, cfg, layer=0):
        super().__init__()
        self.prenorm = cfg.prenorm
        self.norm1 = make_norm(cfg, cfg.n_embd)
        self.attn = Attention(cfg, layer)
        self.norm2 = make_norm(cfg, cfg.n_embd)
        self.mlp = make_moe(cfg) if moe.moe_layer(cfg, layer) else MLP(cfg)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x, cos=None, sin=None, mask=None, is_causal=True, cache=None, layer=0, ve=None):
        if self.prenorm:  # residual stream stays un-normalised: stable deep training (GPT-2 onwards)
            x = x + self.drop(self.attn(self.norm1(x), cos, sin, mask, is_causal, cache, layer, ve))
            x = x + self.drop(self.mlp(self.norm2(x)))
        else:  # post-norm: normalise after each residual add (original Transformer)
            x = self.norm1(x + self.drop(self.attn(x, cos, sin, mask, is_causal, cache, layer, ve)))
            x = self.norm2(x + self.drop(self.mlp(x)))
        return x


# ----------------------------------------------------------------------------- the model

class Transformer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        C, V = cfg.n_embd, cfg.padded_vocab
        self.tok_emb = nn.Embedding(V, C)
        if cfg.pos_emb == "learned":
            self.pos_emb = nn.Embedding(cfg.block_size, C)
        else:
            # non-persistent: derived from the config, so never saved in checkpoints
            cos, sin = rope_tables(cfg.head_dim, cfg.block_size, cfg.rope_theta, scaling=cfg.rope_scaling)
            self.register_buffer("rope_cos", cos, persistent=False)
            self.register_buffer("rope_sin", sin, persistent=False)
        # ALiBi: the heads whose slopes this model applies (tp.tensor_parallel keeps its rank's)
        self.alibi_heads = slice(0, cfg.n_head)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layer))
        # post-norm already ends every block with a norm
        self.norm_f = make_norm(cfg, C) if cfg.prenorm else nn.Identity()
        self.head = (fused.FP8Linear if cfg.fp8_head else nn.Linear)(C, V, bias=False)
        # modded-nanogpt: value embeddings (kv width: tp.py cuts their columns as v's), U-net skip weights
        self.value_embeds = nn.ModuleList(nn.Embedding(V, cfg.kv_heads * cfg.head_dim) for _ in range(cfg.value_embeds))
        self.skip_weights = nn.Parameter(torch.ones(cfg.n_layer // 2)) if cfg.unet_skips else None
        if cfg.tie_embeddings:
            self.head.weight = self.tok_emb.weight
        self.init_weights()

    @torch.no_grad()
    def init_weights(self):
        """GPT-2 init: N(0, init_std) matrices and embeddings, residual output projections scaled
        by 1/sqrt(2 n_layer) (two residual adds per layer keep the stream's variance ~constant),
        zero biases, unit norm weights. Also rebuilds the RoPE tables, so a model created on the
        meta device and materialised with to_empty() is fully initialised by calling this.
        """
        cfg = self.cfg
        if cfg.pos_emb == "rope":
            cos, sin = rope_tables(cfg.head_dim, cfg.block_size, cfg.rope_theta, self.rope_cos.device,
                                   cfg.rope_scaling)
            self.rope_cos, self.rope_sin = cos, sin
        out_std = cfg.init_std / math.sqrt(2 * cfg.n_layer)
        for name, m in self.named_modules():  # fixed order -> same seed, same weights
            if hasattr(m, "init_experts"):  # moe.MoE: expert weight tensors (E, out, in)
                m.init_experts(cfg.init_std, out_std)
            if isinstance(m, nn.Linear):
                if m is self.head and cfg.tie_embeddings:
                    continue  # shared with tok_emb, initialised there
                std = out_std if name.endswith(("attn.proj", "mlp.proj", "shared.proj")) else cfg.init_std
                nn.init.normal_(m.weight, 0.0, std)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, nn.Embedding):  # value tables too (modded-nanogpt: N(0, 1), lately N(0, 0.01))
                nn.init.normal_(m.weight, 0.0, cfg.init_std)
            elif hasattr(m, "ve_lambdas"):
                m.ve_lambdas.fill_(0.5)
            elif isinstance(m, (RMSNorm, nn.LayerNorm)):
                nn.init.ones_(m.weight)
                if getattr(m, "bias", None) is not None:
                    nn.init.zeros_(m.bias)
        if cfg.unet_skips:
            self.skip_weights.fill_(1.0)

    def _apply(self, fn, recurse=True):
        # model.to(torch.bfloat16) casts every floating buffer; RoPE tables must stay fp32
        # (bf16 angles are visibly wrong at long positions), so rebuild them after a cast.
        super()._apply(fn, recurse)
        if self.cfg.pos_emb == "rope" and self.rope_cos.dtype != torch.float32:
            c = self.cfg
            self.rope_cos, self.rope_sin = rope_tables(c.head_dim, c.block_size, c.rope_theta, self.rope_cos.device,
                                                       c.rope_scaling)
        return self

    # ------------------------------------------------------------------ forward

    def forward(self, idx, targets=None, *, reduction="mean", cache=None, pos=None, attn_mask=None, temperature=1.0):
        """idx (B, T) token ids -> logits (B, T, vocab_size), or the loss when targets are given.

        targets: (B, T) ids, IGNORE (-100) where no loss is wanted; reduction "mean" | "sum" |
          "none" (-> (B, T), zeros at ignored positions).
        temperature: the loss of logits / temperature (with targets only): GRPO's log-probs under the
          sampling temperature (1.0: the plain loss).
        cache: a generate.Cache (KVCache: generate(); StaticCache: decode(); prefix.PrefixCache); the new
          tokens' keys/values are stored at cache.length and the tokens attend to everything cached.
        MoE models (moe.py): in training mode with reduction "mean" the returned loss also holds
          every MoE layer's router losses (load balance + z-loss, see router_loss()); the latest
          values and expert loads stay on the layers for logging (moe.metrics(model)).
        pos: (B, T) position ids; default: cache.length + 0..T-1, or derived from a 2-D attn_mask.
        attn_mask: (B, S) 0/1 or bool, True = real token (S = cached + new tokens), combined with
          causality; or a ready (B, [1,] T, S) boolean mask (True = attend) used as is, or a float
          one added to the scores (0 / -inf; generate.decode's steps: no per-layer conversion).
        Padded vocabulary rows are sliced off, so they are never sampled nor part of the loss.
        """
        x = self.hidden_states(idx, cache=cache, pos=pos, attn_mask=attn_mask)
        return self.output(x, targets, reduction, temperature)

    def output(self, x, targets=None, reduction="mean", temperature=1.0):
        """Final hidden states (B, T, C) -> logits, or with targets forward's loss (MoE: router losses added)."""
        if targets is None:
            return self.logits(x)
        loss = self.head_loss(x, targets, reduction, temperature)
        if self.cfg.n_experts and self.training and reduction == "mean":
            loss = loss + self.router_loss()
        return loss

    def router_loss(self):
        """Sum of the MoE layers' router losses (aux + z) of the latest forward; 0 when dense."""
        return sum(b.mlp.router_loss for b in self.blocks if getattr(b.mlp, "is_moe", False))

    # The output layer in two methods, so that tensor parallelism (tp.py) can replace them on the
    # instance with vocab-parallel versions (a loss that never gathers the full logits).
    def logits(self, x):
        """Hidden states (..., C) -> logits (..., vocab_size): padded vocabulary rows sliced off, soft-capped."""
        return fused.softcap(self.head(x)[..., :self.cfg.vocab_size], self.cfg.logit_softcap)

    def head_loss(self, x, targets, reduction="mean", temperature=1.0):
        """Hidden states (B, T, C), targets (B, T) -> cross-entropy of the head's soft-capped logits / temperature."""
        logits, cap = self.head(x)[..., :self.cfg.vocab_size], self.cfg.logit_softcap
        if temperature != 1.0:  # the cap first, then the temperature
            logits, cap = fused.softcap(logits, cap) / temperature, 0.0
        return self.loss(logits, targets, reduction, cap)

    @staticmethod
    def loss(logits, targets, reduction="mean", softcap=0.0):
        """Cross-entropy of fused.softcap(logits, softcap): the cap inside the fused kernels, else in fp32."""
        if fused.available(logits):  # GPU: one fused pass each way, computed in fp32 (fused.py)
            nll = fused.cross_entropy(logits.flatten(0, 1), targets.flatten(), IGNORE, softcap).view(targets.shape)
            if reduction == "none":
                return nll
            # mean over the counted tokens, as F.cross_entropy (NaN when none is counted)
            return nll.sum() if reduction == "sum" else nll.sum() / (targets != IGNORE).sum()
        # upcast: softmax over 50k classes in bf16 is noticeably wrong; one fp32 copy of the
        # (already vocab-sliced) logits, which torch.compile fuses into the loss kernel
        loss = F.cross_entropy(fused.softcap(logits.float(), softcap).flatten(0, 1), targets.flatten(),
                               ignore_index=IGNORE, reduction=reduction)
        return loss.view(targets.shape) if reduction == "none" else loss

    def hidden_states(self, idx, *, cache=None, pos=None, attn_mask=None):
        """The final-normalised hidden states (B, T, C), before the head: embeddings, blocks, final norm."""
        T = idx.shape[1]
        start, pos = self.positions(T, cache, pos, attn_mask)
        x = self.run_blocks(self.embed(idx, start, pos), T, start, pos, attn_mask, cache, idx=idx)
        if cache is not None:
            cache.length += T
        return self.norm_f(x)

    def positions(self, T, cache=None, pos=None, attn_mask=None):
        """(start, pos) of T new tokens. start: the first one's slot, cache.length (0 without a cache), a
        Python int (no host sync); pos: the position ids as given, else from a 2-D attn_mask, else None
        (start + 0..T-1, which the embeddings and RoPE take as a static slice)."""
        start = cache.length if cache is not None else 0
        if start + T > self.cfg.block_size:
            raise ValueError(f"sequence of {start + T} tokens exceeds block_size={self.cfg.block_size}: "
                             f"shorten the input or raise block_size")
        if pos is None and attn_mask is not None and attn_mask.dim() == 2:
            pos = position_ids(attn_mask)[:, start:]
        return start, pos

    def embed(self, idx, start=0, pos=None):
        """Token ids (B, T) -> the residual stream's start (B, T, C): token (and learned position) embeddings."""
        cfg = self.cfg
        x = self.tok_emb(idx)
        if cfg.pos_emb == "learned":
            x = x + self.pos_emb(torch.arange(start, start + idx.shape[1], device=idx.device) if pos is None else pos)
        x = self.drop(x)
        if not cfg.fp32_residual and torch.is_autocast_enabled(x.device.type):
            x = x.to(torch.get_autocast_dtype(x.device.type))  # blocks add bf16 outputs: x stays bf16
        return x

    def run_blocks(self, x, T, start=0, pos=None, attn_mask=None, cache=None, layers=None, idx=None):
        """The residual stream x through the blocks of `layers` (default: all; a pipeline stage runs its
        own, pp.py), each given RoPE's angles and its attention mask for T tokens from slot start, and the
        value embeddings of the tokens idx; with unet_skips, block i < n_layer // 2's output joins the input
        of block n_layer - 1 - i (a stack: the last pushed is the first popped)."""
        cfg = self.cfg
        cos = sin = None
        if cfg.pos_emb == "rope":
            if pos is None:  # static slice: the training path compiles to no gather
                cos, sin = self.rope_cos[None, start:start + T, None], self.rope_sin[None, start:start + T, None]
            else:
                cos, sin = self.rope_cos[pos][:, :, None], self.rope_sin[pos][:, :, None]
        mask, is_causal = self._attention_mask(attn_mask, T, start, x.device)
        windowed = None
        if cfg.pos_emb == "alibi" or cfg.sliding_window:
            (mask, is_causal), windowed = self._positional_masks(mask, is_causal, T, start, cache, x)
        half, skips = len(self.skip_weights) if cfg.unet_skips else 0, []
        for i in range(cfg.n_layer) if layers is None else layers:
            block, j = self.blocks[i], value_layer(cfg, i)
            ve = None if j is None else self.value_embeds[j](idx)
            if windowed is not None and i >= cfg.window_from:  # from window_from on: the sliding window's mask
                mask, is_causal = windowed, False
            if i >= cfg.n_layer - half:
                x = x + self.skip_weights[i - (cfg.n_layer - half)].to(x.dtype) * skips.pop()  # (a bf16 x stays)
            if cfg.grad_checkpoint and self.training and cache is None:
                x = checkpoint(block, x, cos, sin, mask, is_causal, None, i, ve, use_reentrant=False)
            else:
                x = block(x, cos, sin, mask, is_causal, cache, i, ve)
            if i < half:
                skips.append(x)
        return x

    @staticmethod
    def _attention_mask(attn_mask, T, start, device):
        """-> (boolean mask (B|1, 1, T, S) or None, is_causal) for SDPA.

        Training and prefill without padding take SDPA's is_causal path: no mask tensor, so
        the flash kernel applies. Only padding or a partly filled cache need an explicit mask.
        """
        S = start + T
        if attn_mask is None:
            if start == 0:
                return None, True
            if T == 1:  # one new token attends to every cached key
                return None, False
            key = None
        elif attn_mask.dim() == 2:
            if attn_mask.shape[-1] != S:
                raise ValueError(f"attn_mask covers {attn_mask.shape[-1]} keys but there are {S} "
                                 f"(cached {start} + new {T}): pass the mask of all tokens so far")
            key = attn_mask.bool()
        else:
            mask = attn_mask if attn_mask.is_floating_point() else attn_mask.bool()
            return (mask.unsqueeze(1) if mask.dim() == 3 else mask), False
        q_pos = torch.arange(start, S, device=device)[:, None]
        k_pos = torch.arange(S, device=device)[None, :]
        mask = k_pos <= q_pos  # causal, offset by what is already cached
        if key is None:
            return mask[None, None], False
        # every query also sees itself, so padding queries have a non-empty row (no NaN)
        mask = (mask & key[:, None, :]) | (k_pos == q_pos)
        return mask[:, None], False

    def _positional_masks(self, mask, is_causal, T, start, cache, x):
        """ALiBi's score biases and the sliding window on top of _attention_mask's (mask, is_causal)
        -> ((mask, is_causal) of the layers before cfg.window_from, the mask of the layers from it on).

        Both depend on how many slots back a key is: dist = query slot - key slot. Within a row
        that is the position difference (left padding shifts a row's slots, packed documents
        restart positions, and the mask already keeps queries inside their own tokens), so it holds
        for training, the KV cache and generate.decode's static cache (whose `index` holds the new
        tokens' slots). Window: keep dist < sliding_window. ALiBi: a float mask (B|1, H, T, S) of
        -slope * dist on the kept keys, -inf elsewhere (SDPA adds it to the scores)."""
        cfg = self.cfg
        full = mask, is_causal  # (without ALiBi: the layers before window_from keep the causal fast path)
        S = start + T if mask is None else mask.shape[-1]
        q = getattr(cache, "index", None)
        q = torch.arange(start, start + T, device=x.device) if q is None else q
        dist = q[:, None] - torch.arange(S, device=q.device)[None, :]  # (T, S)
        if mask is None:  # causal, or one new token that sees every cached key
            mask = (dist >= 0 if is_causal else torch.ones_like(dist, dtype=torch.bool))[None, None]
        if cfg.pos_emb == "alibi":
            bias = -alibi_slopes(cfg.n_head, q.device)[self.alibi_heads, None, None] * dist  # (H, T, S)
            float_mask = mask if mask.is_floating_point() else torch.zeros(mask.shape, device=q.device).masked_fill(
                ~mask, float("-inf"))
            mask = (float_mask + bias).to(mask.dtype if mask.is_floating_point() else x.dtype)
            full = mask, False
        if not cfg.sliding_window:
            return full, None
        far = dist >= cfg.sliding_window
        return full, mask.masked_fill(far, float("-inf") if mask.is_floating_point() else False)

    # ------------------------------------------------------------------ counting

    def num_params(self, non_embedding=False):
        """Unique parameters (a tied head counts once). non_embedding=True leaves out the token,
        position and value tables and an untied head."""
        n = sum(p.numel() for p in self.parameters())  # parameters() yields a shared tensor once
        if non_embedding:
            n -= self.tok_emb.weight.numel()
            if self.cfg.pos_emb == "learned":
                n -= self.pos_emb.weight.numel()
            if not self.cfg.tie_embeddings:
                n -= self.head.weight.numel()
            n -= sum(e.weight.numel() for e in self.value_embeds)
        return n

    def non_embedding_params(self):
        """Matmul parameters inside the blocks: the 2-D weights of every nn.Linear (no norms, biases);
        for MoE layers the router and the *active* experts (moe_top_k of them per token)."""
        n = sum(m.weight.numel() for m in self.blocks.modules() if isinstance(m, nn.Linear))
        return n + sum(m.top_k * m.expert_numel() for m in moe.layers(self))

    def active_params(self):
        """Parameters one token uses: num_params() less the routed experts it does not visit."""
        return self.num_params() - sum((m.n_experts - m.top_k) * m.expert_numel() for m in moe.layers(self))

    def flops_per_token(self, T=None):
        """Training FLOPs per token at sequence length T (default block_size), as in DESIGN.md:

            6 * N          every matmul weight: 2 FLOPs per multiply-add forward, 4 backward
            6 * C * Vp     the head (C x padded vocab), which N leaves out
            6 * L * T * C  attention scores and weighted values: 2 matmuls of T x C per token,
                           halved because causal attention computes only the lower triangle

        N counts the modules of this process: call it on the unsharded model (under tensor
        parallelism the blocks hold 1/tp of the weights).
        """
        cfg = self.cfg
        T = cfg.block_size if T is None else T
        return (6 * self.non_embedding_params() + 6 * cfg.n_embd * cfg.padded_vocab
                + 6 * cfg.n_layer * T * cfg.n_embd)
