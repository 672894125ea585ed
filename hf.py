"""Hugging Face interop: load and export causal-LM folders, read HF tokenizers through tiktoken.

    model = hf.load_hf("models/Llama-3.2-1B")              # config.json + safetensors -> Transformer
    tok = hf.load_hf_tokenizer("models/Llama-3.2-1B")      # data.Tokenizer's interface, tiktoken inside
    hf.export_hf(model, "out/hf", tokenizer=tok)           # AutoModelForCausalLM.from_pretrained("out/hf")
    python pretrain.py configs/x.py --init_from=models/Llama-3.2-1B     # any stage: configure(cfg), init_loader(cfg, grid)

Architectures: GPT-2, LLaMA (Llama-3.1 rope scaling included), Qwen2 (q/k/v bias) and Mistral (as
long as block_size <= sliding_window, where windowed attention equals full causal attention).
Everything is local: config.json is read as JSON, weights through safetensors, and `transformers`
is never imported here (the tests use it as the reference).

Weights map by name: HF's q/k/v projections become our fused qkv rows [q | k | v], gate/up our
fused fc rows [gate | up], GPT-2's Conv1D weights (stored (in, out)) are transposed, and the
vocabulary rows are padded to ModelConfig.padded_vocab (zeros, never read: logits are sliced).
Every tensor is read through `safe_open(...).get_slice(name)` as a lazy `Part`; `shard_fn(name,
part) -> tensor` decides which rows/columns of each part this process keeps (default: all of it),
which is where tensor parallelism plugs in to read only its shard.

Tokenizers: byte-level BPE from vocab.json + merges.txt (GPT-2), a tokenizer.json with a BPE
model and a ByteLevel pre-tokenizer (Llama-3, Qwen2, GPT-2), or a tiktoken rank file
(Llama-3's tokenizer.model). tiktoken merges the adjacent pair whose concatenation has the lowest
rank, HF the pair earliest in `merges`; using token ids as ranks gives the same result when ids
grow with merge order (true of these vocabularies, checked on load; otherwise ids are mapped).
SentencePiece, WordPiece and Unigram tokenizers are refused with the format named.
"""
import base64
import contextlib
import hashlib
import json
import os
import re
import shutil
import unicodedata
from dataclasses import fields
from types import SimpleNamespace

import tiktoken
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import checkpoint
import config
import tp
from model import LLAMA3_ROPE_KEYS, ModelConfig, Transformer

ARCHS = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
         "gpt2": "GPT2LMHeadModel"}
GPT2_ACTS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu", "relu": "relu",
             "relu2": "relu2"}
LLAMA_ACTS = {"silu": "swiglu", "gelu": "geglu"}  # hidden_act of the gated MLP
# the ModelConfig keys an HF config defines (the others stay the run's own)
MODEL_KEYS = [f.name for f in fields(ModelConfig)
              if f.name not in ("pad_vocab_multiple", "dropout", "init_std", "grad_checkpoint", "fp32_residual")]
GPT2_PAT = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
LLAMA3_PAT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
              r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")


def read_config(path):
    with open(os.path.join(path, "config.json")) as f:
        return json.load(f)


def is_hf_folder(path):
    """An HF model folder: config.json with a model_type (our checkpoints have trainer.pt instead)."""
    if not path or not os.path.isfile(os.path.join(path, "config.json")) \
            or os.path.isfile(os.path.join(path, "trainer.pt")):
        return False
    return "model_type" in read_config(path)


# ----------------------------------------------------------------------------- configs

def _model_type(hf):
    mt, archs = hf.get("model_type"), hf.get("architectures") or []
    if mt not in ARCHS:
        raise ValueError(f"model_type={mt!r} (architectures {archs}) is not supported: hf.py reads "
                         f"{', '.join(ARCHS)}")
    heads = [a for a in archs if not a.endswith(("ForCausalLM", "LMHeadModel", "Model"))]
    if heads:
        raise ValueError(f"architectures {heads} are not causal language models: hf.py loads "
                         f"{', '.join(ARCHS.values())}")
    return mt


def _rope(hf):
    """(rope_theta, rope_scaling) from transformers v5's rope_parameters or v4's rope_theta/rope_scaling."""
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if params and not ("rope_type" in params or "type" in params or "rope_theta" in params):
        raise ValueError(f"per-layer rope_parameters {sorted(params)} are not supported")
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return theta, {}
    if kind != "llama3":
        raise ValueError(f"rope scaling type {kind!r} is not supported (only default and llama3)")
    params = {"original_max_position_embeddings": hf.get("max_position_embeddings"), **params}
    return theta, {"rope_type": "llama3", **{k: params[k] for k in LLAMA3_ROPE_KEYS}}


def _sliding_window(mt, hf):
    if mt == "mistral" or (mt == "qwen2" and (hf.get("use_sliding_window")
                                              or "sliding_attention" in (hf.get("layer_types") or []))):
        return hf.get("sliding_window")
    return None


def config_from_hf(hf, block_size=None):
    """An HF config.json (dict) -> ModelConfig. block_size defaults to the longest context the model
    takes (max_position_embeddings, or sliding_window if smaller: beyond it Mistral's attention
    differs from ours). Anything we cannot reproduce exactly raises, naming the field."""
    mt = _model_type(hf)

    def refuse(bad, what):
        if bad:
            raise ValueError(f"{mt} config: {what} is not supported by ingot's Transformer")
    if mt == "gpt2":
        act = hf.get("activation_function", "gelu_new")
        refuse(act not in GPT2_ACTS, f"activation_function={act!r} (choose one of {', '.join(GPT2_ACTS)})")
        refuse(not hf.get("scale_attn_weights", True), "scale_attn_weights=false")
        refuse(hf.get("scale_attn_by_inverse_layer_idx"), "scale_attn_by_inverse_layer_idx=true")
        refuse(hf.get("add_cross_attention"), "add_cross_attention=true")
        C = hf["n_embd"]
        kw = dict(n_layer=hf["n_layer"], n_head=hf["n_head"], n_embd=C, ffn_hidden=hf.get("n_inner") or 4 * C,
                  activation=GPT2_ACTS[act], norm="layernorm", norm_eps=hf.get("layer_norm_epsilon", 1e-5),
                  pos_emb="learned", bias=True, tie_embeddings=hf.get("tie_word_embeddings", True))
        longest, window = hf.get("n_positions", 1024), None
    else:
        act = hf.get("hidden_act", "silu")
        refuse(act not in LLAMA_ACTS, f"hidden_act={act!r} (silu or gelu)")
        C, H = hf["hidden_size"], hf["num_attention_heads"]
        refuse((hf.get("head_dim") or C // H) * H != C, f"head_dim={hf.get('head_dim')} != hidden_size/num_heads")
        refuse(hf.get("partial_rotary_factor", 1.0) != 1.0, "partial_rotary_factor != 1")
        attn_bias, mlp_bias = hf.get("attention_bias", False), hf.get("mlp_bias", False)
        refuse(attn_bias != mlp_bias, f"attention_bias={attn_bias} with mlp_bias={mlp_bias} (only both or neither)")
        theta, scaling = _rope(hf)
        kw = dict(n_layer=hf["num_hidden_layers"], n_head=H, n_kv_head=hf.get("num_key_value_heads") or H,
                  n_embd=C, ffn_hidden=hf["intermediate_size"], activation=LLAMA_ACTS[act], norm="rmsnorm",
                  norm_eps=hf.get("rms_norm_eps", 1e-6), pos_emb="rope", rope_theta=theta, rope_scaling=scaling,
                  bias=attn_bias, qkv_bias=mt == "qwen2", tie_embeddings=hf.get("tie_word_embeddings", False))
        longest, window = hf.get("max_position_embeddings", 2048), _sliding_window(mt, hf)
    block_size = block_size or min(longest, window or longest)
    refuse(mt == "gpt2" and block_size > longest, f"block_size={block_size} > n_positions={longest}")
    refuse(window and block_size > window, f"sliding_window={window} shorter than block_size={block_size} "
                                           f"(pass block_size <= {window})")
    return ModelConfig(vocab_size=hf["vocab_size"], block_size=block_size, **kw)


def _export_type(cfg, model_type=None):
    """The HF model_type that expresses cfg exactly, or a ValueError naming what does not fit."""
    gpt2 = cfg.pos_emb == "learned"
    why = [w for bad, w in [
        (not cfg.prenorm, "prenorm=False"), (cfg.qk_norm, "qk_norm=True"),
        (gpt2 and cfg.norm != "layernorm", "learned positions with rmsnorm"),
        (gpt2 and cfg.activation not in GPT2_ACTS.values(), f"activation={cfg.activation!r} with learned positions"),
        (gpt2 and not cfg.bias, "learned positions without bias (GPT-2 has biases everywhere)"),
        (gpt2 and cfg.kv_heads != cfg.n_head, "grouped-query attention with learned positions"),
        (not gpt2 and cfg.norm != "rmsnorm", "rope with layernorm"),
        (not gpt2 and cfg.activation not in LLAMA_ACTS.values(), f"activation={cfg.activation!r} with rope"),
    ] if bad]
    mt = "gpt2" if gpt2 else "qwen2" if cfg.qkv_bias and not cfg.bias else "llama"
    if model_type == "mistral" and mt == "llama" and not cfg.bias:  # Mistral without a window = LLaMA
        mt = model_type
    elif model_type not in (None, mt):
        why.append(f"model_type={model_type!r} (this config is a {mt})")
    if why:
        raise ValueError(f"this model cannot be exported to Hugging Face: {'; '.join(why)}. Exportable: GPT-2 "
                         "(learned positions, layernorm, gelu/gelu_tanh/relu/relu2, bias) and LLaMA/Qwen2/Mistral "
                         "(rope, rmsnorm, swiglu/geglu), pre-norm, without qk_norm")
    return mt


def config_to_hf(cfg, model_type=None, tokenizer=None):
    """ModelConfig -> an HF config.json dict (rope fields in the v4 form, which v5 also reads)."""
    mt = _export_type(cfg, model_type)
    ids = {k: getattr(tokenizer, a, None) for k, a in (("bos_token_id", "bos_id"), ("eos_token_id", "eos_id"))}
    common = dict(architectures=[ARCHS[mt]], model_type=mt, vocab_size=cfg.vocab_size,
                  tie_word_embeddings=cfg.tie_embeddings, initializer_range=cfg.init_std, **ids)
    if mt == "gpt2":
        act = {v: k for k, v in reversed(GPT2_ACTS.items())}[cfg.activation]
        return dict(common, n_positions=cfg.block_size, n_embd=cfg.n_embd, n_layer=cfg.n_layer, n_head=cfg.n_head,
                    n_inner=cfg.hidden, activation_function=act, layer_norm_epsilon=cfg.norm_eps,
                    resid_pdrop=cfg.dropout, embd_pdrop=cfg.dropout, attn_pdrop=cfg.dropout)
    out = dict(common, hidden_size=cfg.n_embd, intermediate_size=cfg.hidden, num_hidden_layers=cfg.n_layer,
               num_attention_heads=cfg.n_head, num_key_value_heads=cfg.kv_heads, head_dim=cfg.head_dim,
               hidden_act={v: k for k, v in LLAMA_ACTS.items()}[cfg.activation],
               max_position_embeddings=cfg.block_size, rms_norm_eps=cfg.norm_eps, rope_theta=cfg.rope_theta,
               rope_scaling=dict(cfg.rope_scaling) or None, attention_dropout=cfg.dropout)
    if mt == "llama":
        out.update(attention_bias=cfg.bias, mlp_bias=cfg.bias)
    else:
        out.update(sliding_window=None, use_sliding_window=False)
    return out


# ----------------------------------------------------------------------------- weights

LLAMA_NAMES = {"norm1": ["input_layernorm"], "norm2": ["post_attention_layernorm"],
               "attn.qkv": ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"],
               "attn.proj": ["self_attn.o_proj"], "mlp.fc": ["mlp.gate_proj", "mlp.up_proj"],
               "mlp.proj": ["mlp.down_proj"], "tok_emb": ["embed_tokens"], "norm_f": ["norm"]}
GPT2_NAMES = {"norm1": ["ln_1"], "norm2": ["ln_2"], "attn.qkv": ["attn.c_attn"], "attn.proj": ["attn.c_proj"],
              "mlp.fc": ["mlp.c_fc"], "mlp.proj": ["mlp.c_proj"], "tok_emb": ["wte"], "pos_emb": ["wpe"],
              "norm_f": ["ln_f"]}
PREFIXES = ("model.", "transformer.", "")  # ...ForCausalLM / GPT2LMHeadModel / bare base model
IGNORED = re.compile(r"(\.attn\.(masked_)?bias|rotary_emb\.inv_freq)$")  # buffers some checkpoints carry


def _layout(name, cfg, mt):
    """Our parameter name -> [(HF name without prefix, HF column range or None, transposed)],
    concatenated along our dim 0. GPT-2's fused c_attn is cut into q/k/v column ranges, so that
    every part is one head group (what a tensor-parallel shard_fn cuts)."""
    if name == "head.weight":
        return [("lm_head.weight", None, False)]
    m = re.fullmatch(r"(?:blocks\.(\d+)\.)?(.+)\.(weight|bias)", name)
    layer, module, kind = m.groups()
    names = (GPT2_NAMES if mt == "gpt2" else LLAMA_NAMES)[module]
    block = "" if layer is None else (f"h.{layer}." if mt == "gpt2" else f"layers.{layer}.")
    conv1d = mt == "gpt2" and layer is not None and kind == "weight" and not module.startswith("norm")
    if mt == "gpt2" and module == "attn.qkv":
        C = cfg.n_embd
        return [(f"{block}{names[0]}.{kind}", (j * C, (j + 1) * C), conv1d) for j in range(3)]
    return [(f"{block}{n}.{kind}", None, conv1d) for n in names]


class Part:
    """One HF tensor, or a column range of it, seen in our orientation and read lazily:
    part[a:b] (rows) or part[a:b, c:d] reads only those bytes. `rows` pads with zero rows (the
    padded vocabulary) or keeps the first rows (a learned position table longer than block_size).
    sl: safetensors' get_slice() object, or a tensor (pytorch_model.bin)."""

    def __init__(self, sl, cols=None, transpose=False, rows=None):
        self.sl, self.cols, self.transpose = sl, cols, transpose
        shape = list(sl.shape if torch.is_tensor(sl) else sl.get_shape())
        if cols:
            shape[-1] = cols[1] - cols[0]
        shape = shape[::-1] if transpose else shape
        self.real_rows = shape[0]
        self.shape = tuple([rows or shape[0]] + shape[1:])

    def __getitem__(self, idx):
        idx = idx if isinstance(idx, tuple) else (idx,)
        r0, r1, step = idx[0].indices(self.shape[0])
        if step != 1:
            raise ValueError("Part reads contiguous ranges only")
        real = slice(min(r0, self.real_rows), min(max(r1, r0), self.real_rows))
        ours = [real] + list(idx[1:]) + [slice(None)] * (len(self.shape) - len(idx))
        theirs = ours[::-1] if self.transpose else ours
        if self.cols:
            c0, c1, _ = theirs[-1].indices(self.cols[1] - self.cols[0])
            theirs[-1] = slice(self.cols[0] + c0, self.cols[0] + c1)
        t = self.sl[tuple(theirs)]
        t = t.T if self.transpose else t
        pad = max(r1 - r0, 0) - t.shape[0]
        return torch.cat([t, t.new_zeros(pad, *t.shape[1:])]) if pad else t


def _tensors(path, stack):
    """name -> lazily readable slice, for every tensor of the folder's weight files."""
    for index in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        if os.path.isfile(os.path.join(path, index)):
            with open(os.path.join(path, index)) as f:
                files = sorted(set(json.load(f)["weight_map"].values()))
            break
    else:
        files = [f for f in ("model.safetensors", "pytorch_model.bin") if os.path.isfile(os.path.join(path, f))][:1]
    if not files:
        raise FileNotFoundError(f"{path}: no model.safetensors(.index.json) or pytorch_model.bin(.index.json)")
    out = {}
    for f in files:
        if f.endswith(".safetensors"):
            h = stack.enter_context(safe_open(os.path.join(path, f), framework="pt"))
            out.update({k: h.get_slice(k) for k in h.keys()})
        else:
            sd = torch.load(os.path.join(path, f), map_location="cpu", mmap=True, weights_only=True)
            out.update(sd)
    return out


@torch.no_grad()
def load_weights(path, model, shard_fn=None):
    """Copy the weights of HF folder `path` into `model` (built from config_from_hf of that folder).

    shard_fn(name, part) -> tensor: what this process keeps of each Part of our parameter `name`
    (default part[:], all of it); the parts of a fused parameter are concatenated along dim 0.
    Tensor parallelism passes a function that reads only its rows / columns.
    """
    cfg, mt = model.cfg, _model_type(read_config(path))
    shard_fn = shard_fn or (lambda name, part: part[:])
    used = set()
    with contextlib.ExitStack() as stack:
        src = _tensors(path, stack)
        emb = "wte.weight" if mt == "gpt2" else "embed_tokens.weight"
        prefix = next((p for p in PREFIXES if p + emb in src), None)
        if prefix is None:
            raise ValueError(f"{path}: no {emb} under any of the prefixes {PREFIXES}: not a {mt} checkpoint?")
        missing = []
        for name, p in model.named_parameters():  # a tied head is listed once, as tok_emb.weight
            specs = [(n if n == "lm_head.weight" else prefix + n, cols, tr) for n, cols, tr in _layout(name, cfg, mt)]
            missing += [n for n, _, _ in specs if n not in src]
            if any(n not in src for n, _, _ in specs):
                continue
            rows = {"tok_emb.weight": cfg.padded_vocab, "head.weight": cfg.padded_vocab,
                    "pos_emb.weight": cfg.block_size}.get(name)
            t = torch.cat([shard_fn(name, Part(src[n], cols, tr, rows)) for n, cols, tr in specs])
            if t.shape != p.shape:
                raise ValueError(f"{path}: {name} is {tuple(t.shape)} from {[s[0] for s in specs]}, "
                                 f"the model's is {tuple(p.shape)}")
            p.copy_(t)
            used.update(n for n, _, _ in specs)
    unused = [n for n in src if n not in used and not IGNORED.search(n)
              and not (n == "lm_head.weight" and cfg.tie_embeddings)]
    if missing or unused:
        raise ValueError(f"{path} does not fit its config as ingot reads it: missing {missing[:8]}, "
                         f"not understood {unused[:8]}")
    return model


def load_hf(path, device="cpu", dtype=torch.float32, shard_fn=None, block_size=None):
    """An HF causal-LM folder -> Transformer in eval mode (see config_from_hf for block_size)."""
    cfg = config_from_hf(read_config(path), block_size)
    with torch.device("meta"):  # no random init of weights about to be overwritten
        model = Transformer(cfg)
    model.to_empty(device=device).to(dtype)
    if cfg.tie_embeddings:  # to_empty gives each module its own tensor: tie again
        model.head.weight = model.tok_emb.weight
    model.init_weights()  # also builds the RoPE tables; every parameter is overwritten below
    return load_weights(path, model, shard_fn).eval()


def init_checkpoint(path):
    """init_from: one of our checkpoint folders, or a run folder (its newest) -> (its path, its config dict)."""
    ckpt = path if os.path.isfile(os.path.join(path, "model.safetensors")) else checkpoint.latest(path)
    if ckpt is None:
        what = "no checkpoint in it" if os.path.isdir(path) else "no such folder"
        raise config.MissingFileError(f"init_from={path}: {what} (name a checkpoint, a run folder or a local HF model "
                                      "folder)")
    with open(os.path.join(ckpt, "config.json")) as f:
        return ckpt, json.load(f)


def configure(cfg):
    """init_from's model and tokenizer become cfg's (no need to repeat the model shape); returns a line
    saying so ("" without init_from). An HF folder: its config.json's model keys, its tokenizer. Our
    checkpoint or run folder (init_from then names its newest checkpoint): its model keys, tokenizer,
    tokenizer_vocab (and fim_rate where a truncated vocabulary's ids depend on it). block_size is capped
    at the model's (learned positions: the model's). init_loader(cfg, grid) then loads the weights."""
    if not cfg.init_from:
        return ""
    if is_hf_folder(cfg.init_from):
        try:
            hf = read_config(cfg.init_from)
            m = vars(config_from_hf(hf, min(cfg.block_size, config_from_hf(hf).block_size)))
        except ValueError as e:
            raise config.ConfigError(f"init_from={cfg.init_from}: {e}") from e
        keys, tok = MODEL_KEYS, dict(tokenizer=cfg.init_from, tokenizer_vocab=0)
    else:
        cfg.init_from, m = init_checkpoint(cfg.init_from)
        keys = [f.name for f in fields(ModelConfig) if f.name not in ("dropout", "grad_checkpoint", "fp32_residual")]
        if m["pos_emb"] == "rope":  # (a learned position table keeps its rows)
            m = dict(m, block_size=min(cfg.block_size, m["block_size"]))
        tok = {k: m[k] for k in ("tokenizer", "tokenizer_vocab")}
        if m["tokenizer_vocab"] and (m.get("fim_rate", 0) > 0) != (getattr(cfg, "fim_rate", 0) > 0):
            tok["fim_rate"] = m.get("fim_rate", 0)
    for k, v in [(k, m[k]) for k in keys] + list(tok.items()):
        setattr(cfg, k, v)
    if cfg.seq_len > cfg.block_size:
        raise config.ConfigError(f"seq_len={cfg.seq_len} > block_size={cfg.block_size} of {cfg.init_from}")
    return f"model and tokenizer of {'the HF folder' if keys is MODEL_KEYS else 'checkpoint'} {cfg.init_from}"


def init_loader(cfg, grid):
    """parallelize's `load` callback for cfg.init_from (None without one): an HF folder (each TP rank
    reads its rows / columns) or our checkpoint (full tensors cut to this TP rank; a LoRA run's merged).
    A smaller vocabulary (chat specials just added) grows (checkpoint.grow_vocab), said once."""
    if not cfg.init_from:
        return None
    src, is_hf = cfg.init_from, is_hf_folder(cfg.init_from)
    old = read_config(src)["vocab_size"] if is_hf else init_checkpoint(src)[1]["vocab_size"]
    if old < cfg.vocab_size and grid.is_main:
        print(f"init_from: vocabulary grown from {old} to {cfg.vocab_size} tokens (new rows: the mean of the old)")

    def load(model):
        if is_hf:
            params, base = dict(model.named_parameters()), tp.hf_shard_fn(model, grid)

            def shard_fn(name, part):  # vocabulary rows: read whole, grown, then cut like the rest
                if name in ("tok_emb.weight", "head.weight") and old < cfg.vocab_size:
                    return tp.local_tensor(params[name], checkpoint.grow_vocab(part[:], old, cfg.vocab_size), grid)
                return base(name, part)
            return load_weights(src, model, shard_fn)
        saved = init_checkpoint(src)[1]
        weights = checkpoint.read_weights(src, ModelConfig.from_cfg(SimpleNamespace(**saved)))
        checkpoint.load_full_state_dict(model, grid, checkpoint.fit_weights(weights, saved, model.cfg))
    return load


def export_hf(model, out_dir, tokenizer=None, model_type=None):
    """Write `model` as an HF folder: config.json, model.safetensors, generation_config.json and,
    given a tokenizer, its files. model_type: None picks gpt2 / llama / qwen2 from the config;
    "mistral" is accepted for a bias-free LLaMA-style model."""
    cfg = model.cfg
    mt = _export_type(cfg, model_type)
    sizes = {"attn.qkv": [cfg.n_head * cfg.head_dim] + [cfg.kv_heads * cfg.head_dim] * 2, "mlp.fc": [cfg.hidden] * 2}
    prefix = "transformer." if mt == "gpt2" else "model."
    out = {}
    for name, t in model.named_parameters():
        specs = _layout(name, cfg, mt)
        t = t.detach()[:cfg.vocab_size] if name in ("tok_emb.weight", "head.weight") else t.detach()
        pieces = t.split(sizes[name.split(".", 2)[2].rsplit(".", 1)[0]]) if len(specs) > 1 else [t]
        for (n, _, transposed), piece in zip(specs, pieces):
            n = n if n == "lm_head.weight" else prefix + n
            out.setdefault(n, []).append(piece.T if transposed else piece)
    tensors = {n: torch.cat(v, dim=-1).contiguous().cpu() for n, v in out.items()}  # GPT-2 c_attn: q|k|v columns
    os.makedirs(out_dir, exist_ok=True)
    save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    hf = config_to_hf(cfg, mt, tokenizer)
    hf["torch_dtype"] = str(next(model.parameters()).dtype).removeprefix("torch.")
    _write_json(os.path.join(out_dir, "config.json"), hf)
    _write_json(os.path.join(out_dir, "generation_config.json"),
                {k: hf[k] for k in ("bos_token_id", "eos_token_id") if hf[k] is not None})
    if tokenizer is not None:
        save_tokenizer(tokenizer, out_dir)
    return out_dir


def _write_json(path, obj):
    with open(path, "w") as f:
        json.dump(obj, f, indent=2, ensure_ascii=False)


# ----------------------------------------------------------------------------- tokenizers

def bytes_to_unicode():
    """GPT-2's reversible byte -> printable character map used by every byte-level BPE vocabulary."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


class HFTokenizer:
    """data.Tokenizer's interface (name, n_vocab, eos_id, encode, encode_batch, decode) over a
    tiktoken Encoding built from HF tokenizer files, plus special_tokens (text -> id), bos_id,
    chat_template and files (the source files, copied by export_hf). encode() reads special-token
    text as plain text, as data.Tokenizer does; encode(text, special=True) turns it into the special
    ids, as HF tokenizers do (what a rendered chat template needs). The chat names are data.Tokenizer's:
    with_chat(tokens, eot) adds a template's missing special tokens past the vocabulary, special_ids,
    eot_id, encode_chat, token_bytes; eos_token / bos_token are the texts.

    ranks: token bytes -> HF id. merge_order: None when HF ids follow the merge order (they are
    then tiktoken's ranks); else the tokens in merge order, and ids are mapped both ways."""
    vocab = 0

    def __init__(self, name, ranks, pat, special_tokens, eos, bos=None, chat_template=None, nfc=False,
                 files=(), merge_order=None, chat=(), eot=None):
        self.args = dict(name=name, ranks=ranks, pat=pat, special_tokens=special_tokens, eos=eos, bos=bos,
                         chat_template=chat_template, nfc=nfc, files=files, merge_order=merge_order)
        self.name, self.chat_template, self.nfc, self.files = name, chat_template, nfc, list(files)
        n = max([*ranks.values(), *special_tokens.values()]) + 1  # chat tokens it lacks come after every id
        special_tokens = {**special_tokens, **{t: n + i for i, t in enumerate(
            t for t in dict.fromkeys(chat) if t not in special_tokens)}}
        self.special_tokens = special_tokens
        self.ids = self.rank_of = None
        if merge_order is not None:
            self.ids = [ranks[t] for t in merge_order] + list(special_tokens.values())  # tiktoken rank -> id
            self.rank_of = {i: r for r, i in enumerate(self.ids)}
            ranks = {t: r for r, t in enumerate(merge_order)}
            special_tokens = {s: len(ranks) + j for j, s in enumerate(special_tokens)}
        self.enc = tiktoken.Encoding(name, pat_str=pat, mergeable_ranks=ranks, special_tokens=special_tokens)
        self.n_vocab = self.enc.n_vocab if self.ids is None else max(self.ids) + 1
        for token in (eos, bos, eot):
            if token and token not in self.special_tokens:
                raise ValueError(f"{name}: special token {token!r} is not in the vocabulary")
        self.eos_token, self.bos_token = eos, bos
        self.eos_id = self.special_tokens[eos]
        self.bos_id = self.special_tokens[bos] if bos else None
        self.special_ids = {t: self.special_tokens[t] for t in chat}
        self.eot_id = self.special_tokens[eot] if eot else self.eos_id

    def with_chat(self, tokens, eot):
        """This tokenizer with the chat special `tokens` (texts) added where missing; eot: the end-of-turn token."""
        return HFTokenizer(**self.args, chat=tuple(tokens), eot=eot)

    def _to_ids(self, ranks):
        return ranks if self.ids is None else [self.ids[r] for r in ranks]

    def encode(self, text, special=False):
        text = unicodedata.normalize("NFC", text) if self.nfc else text
        return self._to_ids(self.enc.encode(text, allowed_special="all") if special else self.enc.encode_ordinary(text))

    def encode_chat(self, text):
        text = unicodedata.normalize("NFC", text) if self.nfc else text
        return self._to_ids(self.enc.encode(text, allowed_special=set(self.special_ids), disallowed_special=()))

    def encode_batch(self, texts, num_threads=8):
        texts = [unicodedata.normalize("NFC", t) for t in texts] if self.nfc else texts
        return [self._to_ids(ids) for ids in self.enc.encode_ordinary_batch(texts, num_threads=num_threads)]

    def decode(self, ids):
        ids = ids.tolist() if hasattr(ids, "tolist") else list(ids)
        return self.enc.decode(ids if self.rank_of is None else [self.rank_of[i] for i in ids])

    def token_bytes(self, ids):
        """The bytes of each token (special tokens: their text): char offsets of an encoding."""
        return [self.enc.decode_single_token_bytes(i if self.rank_of is None else self.rank_of[i]) for i in ids]

    def __repr__(self):
        return f"HFTokenizer({self.name!r}, n_vocab={self.n_vocab}, eos_id={self.eos_id})"


def _byte_level_ranks(vocab, merges, specials):
    """HF byte-level vocab (mapped strings -> id) + merges -> (ranks: bytes -> id, specials,
    merge_order or None). Ranks hold the 256 bytes and each merge's result (at its first merge);
    vocabulary entries BPE never produces become special tokens (GPT-2's <|endoftext|>)."""
    b2u = bytes_to_unicode()
    char_byte = {c: b for b, c in b2u.items()}
    try:
        order = [bytes([b]) for b in range(256)]
        ranks = {t: vocab[b2u[t[0]]] for t in order}
        for a, b in merges:
            raw = bytes(char_byte[ch] for ch in a + b)
            if raw not in ranks:
                ranks[raw] = vocab[a + b]
                order.append(raw)
    except KeyError as e:
        raise ValueError(f"not a byte-level BPE vocabulary: {e} is missing or not a byte-level character "
                         "(SentencePiece-style BPE is not supported)") from None
    specials = dict(specials)
    taken = set(ranks.values()) | set(specials.values())
    for s, i in vocab.items():
        if i not in taken:
            specials[bytes(char_byte.get(ch, 63) for ch in s).decode("utf-8", "replace")] = i
    merged = [ranks[t] for t in order[256:]]
    in_order = all(a < b for a, b in zip(merged, merged[1:]))
    return ranks, specials, None if in_order else order


def _json(path, default=None):
    if not os.path.isfile(path):
        return default
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _read_tokenizer_json(path):
    with open(path, encoding="utf-8") as f:
        tj = json.load(f)
    model = tj.get("model") or {}
    kind = model.get("type")
    if kind != "BPE":
        raise ValueError(f"{path}: tokenizer model {kind!r} cannot be read through tiktoken "
                         "(only byte-level BPE; WordPiece, Unigram and WordLevel are not supported)")
    odd = {k: model.get(k) for k in ("dropout", "continuing_subword_prefix", "end_of_word_suffix", "byte_fallback")
           if model.get(k)}
    if odd:
        raise ValueError(f"{path}: BPE options {odd} are not supported (SentencePiece-style BPE, e.g. Llama-2 "
                         "and Mistral's, cannot be read through tiktoken)")
    norm = tj.get("normalizer")
    if norm and norm.get("type") != "NFC":
        raise ValueError(f"{path}: normalizer {norm.get('type')!r} is not supported (only none or NFC)")
    pre = tj.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    types = [s.get("type") for s in steps]
    if types == ["ByteLevel"] and steps[0].get("use_regex", True):
        pat = GPT2_PAT
    elif types == ["Split", "ByteLevel"] and not steps[1].get("use_regex", True) \
            and "Regex" in steps[0].get("pattern", {}) and steps[0].get("behavior") == "Isolated" \
            and not steps[0].get("invert"):
        pat = steps[0]["pattern"]["Regex"]
    else:
        raise ValueError(f"{path}: pre-tokenizer {types} is not supported (ByteLevel, or an isolating "
                         "Split regex followed by ByteLevel without regex)")
    if any(s.get("add_prefix_space") for s in steps):
        raise ValueError(f"{path}: ByteLevel add_prefix_space=true is not supported")
    merges = [m.split(" ") if isinstance(m, str) else m for m in model["merges"]]
    specials = {t["content"]: t["id"] for t in tj.get("added_tokens", [])}
    return model["vocab"], merges, specials, pat, bool(norm)


def _read_tiktoken_file(path):
    """Llama-3's tokenizer.model: lines 'base64(token) rank'. Anything else is refused."""
    with open(path, "rb") as f:
        raw = f.read()
    lines = raw.splitlines()
    if not lines or not re.fullmatch(rb"[A-Za-z0-9+/=]+ \d+", lines[0]):
        raise ValueError(f"{path} is not a tiktoken rank file (a SentencePiece protobuf model?): SentencePiece "
                         "tokenizers cannot be read through tiktoken; a tokenizer.json with byte-level BPE can")
    return {base64.b64decode(tok): int(rank) for tok, rank in (line.split() for line in lines if line)}


def llama3_specials(n):
    """Llama-3.1's 256 special tokens, numbered from n (used when no tokenizer_config.json names them)."""
    names = ["<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>", "<|reserved_special_token_1|>",
             "<|finetune_right_pad_id|>", "<|step_id|>", "<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>",
             "<|eot_id|>", "<|python_tag|>"]
    names += [f"<|reserved_special_token_{2 + i}|>" for i in range(256 - len(names))]
    return {s: n + i for i, s in enumerate(names)}


def _token_text(t):
    return t.get("content") if isinstance(t, dict) else t


def load_hf_tokenizer(path):
    """A folder with tokenizer.json, vocab.json + merges.txt, or a tiktoken tokenizer.model
    (first found, in that order) -> HFTokenizer. Special tokens: the files' added tokens (and
    tokenizer_config.json's added_tokens_decoder); eos/bos: tokenizer_config.json (else config.json's
    eos_token_id); the chat template: chat_template.jinja or tokenizer_config.json."""
    folder = path if os.path.isdir(path) else os.path.dirname(path)
    f = lambda *names: os.path.join(folder, *names)  # noqa: E731
    tc = _json(f("tokenizer_config.json"), {})
    specials = {_token_text(t): int(i) for i, t in tc.get("added_tokens_decoder", {}).items()}
    specials.update(_json(f("added_tokens.json"), {}))
    nfc, order = False, None
    if os.path.isfile(f("tokenizer.json")):
        files = [f("tokenizer.json")]
        vocab, merges, added, pat, nfc = _read_tokenizer_json(files[0])
        ranks, specials, order = _byte_level_ranks(vocab, merges, {**specials, **added})
    elif os.path.isfile(f("vocab.json")) and os.path.isfile(f("merges.txt")):
        files = [f("vocab.json"), f("merges.txt")]
        with open(files[1], encoding="utf-8") as fh:
            merges = [line.split(" ") for line in fh.read().split("\n") if line and not line.startswith("#version")]
        ranks, specials, order = _byte_level_ranks(_json(files[0]), merges, specials)
        pat = GPT2_PAT
    else:
        files = [p for p in (f("tokenizer.model"), f("original", "tokenizer.model")) if os.path.isfile(p)][:1]
        if not files:
            raise FileNotFoundError(f"{folder}: no tokenizer files (tokenizer.json, vocab.json + merges.txt, or a "
                                    "tiktoken tokenizer.model)")
        ranks, pat = _read_tiktoken_file(files[0]), LLAMA3_PAT
        if not specials:
            specials = llama3_specials(len(ranks))
            tc = {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>", **tc}
    files += [p for p in map(f, ("tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                                 "chat_template.jinja")) if os.path.isfile(p)]
    template = tc.get("chat_template")
    if isinstance(template, list):  # named templates: the default one
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    if os.path.isfile(f("chat_template.jinja")):
        with open(f("chat_template.jinja"), encoding="utf-8") as fh:
            template = fh.read()
    eos = _token_text(tc.get("eos_token"))
    if not eos:
        eos_id = _json(f("config.json"), {}).get("eos_token_id")
        eos_id = eos_id[0] if isinstance(eos_id, list) else eos_id
        names = [s for s in specials if specials[s] == eos_id] + ["<|endoftext|>", "<|end_of_text|>", "</s>"]
        eos = next((s for s in names if s in specials), None)
    if not eos:
        raise ValueError(f"{folder}: no end-of-sequence token found: set eos_token in tokenizer_config.json")
    h = hashlib.sha1()
    for p in files:
        with open(p, "rb") as fh:
            h.update(fh.read())
    name = f"hf-{re.sub(r'[^A-Za-z0-9_.]+', '-', os.path.basename(os.path.abspath(folder)))}-{h.hexdigest()[:8]}"
    return HFTokenizer(name, ranks, pat, specials, eos, _token_text(tc.get("bos_token")), template, nfc, files,
                       order)


def save_tokenizer(tok, out_dir):
    """An HFTokenizer's own files are copied (chat tokens it gained and a chat template it was given
    go into tokenizer_config.json: added_tokens_decoder, chat_template); a tiktoken tokenizer
    (data.Tokenizer) is written as a byte-level BPE tokenizer.json (merges recovered from the ranks as
    transformers' TikTokenConverter does: every split of a token into two tokens, ordered by the
    token's rank) + tokenizer_config.json."""
    files = getattr(tok, "files", [])
    if any(os.path.basename(p) in ("tokenizer.json", "vocab.json") for p in files):
        for p in files:
            shutil.copy(p, os.path.join(out_dir, os.path.basename(p)))
        added = {t: i for t, i in tok.special_tokens.items() if t not in tok.args["special_tokens"]}
        if added or tok.chat_template != tok.args["chat_template"]:
            path = os.path.join(out_dir, "tokenizer_config.json")
            config = _json(path, {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": tok.eos_token})
            config.setdefault("added_tokens_decoder", {}).update({str(i): {
                "content": t, "special": True, "lstrip": False, "rstrip": False, "normalized": False,
                "single_word": False} for t, i in added.items()})
            config["chat_template"] = tok.chat_template
            _write_json(path, config)
            if os.path.isfile(os.path.join(out_dir, "chat_template.jinja")):  # it would win over the config's
                os.remove(os.path.join(out_dir, "chat_template.jinja"))
        return
    enc, b2u = tok.enc, bytes_to_unicode()
    # Oniguruma (tokenizers) reads "x{1,3}+" as "(x{1,3})+", not possessive; a repetition that ends
    # an alternative never backtracks, so dropping the "+" keeps tiktoken's meaning (cl100k's digits)
    pat = re.sub(r"(\{\d+(,\d*)?\})\+", r"\1", enc._pat_str)
    ranks = enc._mergeable_ranks
    text = lambda b: "".join(b2u[x] for x in b)  # noqa: E731
    merges = sorted((r, text(t[:i]), text(t[i:])) for t, r in ranks.items()
                    for i in range(1, len(t)) if t[:i] in ranks and t[i:] in ranks)
    specials = [{"id": i, "content": s, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
                 "special": True} for s, i in sorted(enc._special_tokens.items(), key=lambda x: x[1])]
    tj = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": specials, "normalizer": None,
          "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
              {"type": "Split", "pattern": {"Regex": pat}, "behavior": "Isolated", "invert": False},
              {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]},
          "post_processor": None, "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True,
                                              "use_regex": True},
          "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                    "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": True,
                    "vocab": {text(t): r for t, r in ranks.items()}, "merges": [f"{a} {b}" for _, a, b in merges]}}
    _write_json(os.path.join(out_dir, "tokenizer.json"), tj)
    name_of = {i: s for s, i in enc._special_tokens.items()}
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": name_of[tok.eos_id],
              "bos_token": name_of.get(getattr(tok, "bos_id", None)), "clean_up_tokenization_spaces": False}
    if getattr(tok, "chat_template", None):
        config["chat_template"] = tok.chat_template
    _write_json(os.path.join(out_dir, "tokenizer_config.json"), config)
