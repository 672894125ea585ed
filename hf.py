"""Hugging Face interop: load and export causal-LM folders, read HF tokenizers through tiktoken.

    model = hf.load_hf("models/Llama-3.2-1B")              # config.json + safetensors -> Transformer
    tok = tokenizer.load_hf_tokenizer("models/Llama-3.2-1B")      # its tokenizer: tokenizer.py
    hf.export_hf(model, "out/hf", tokenizer=tok)           # AutoModelForCausalLM.from_pretrained("out/hf")
    python pretrain.py configs/x.py --init_from=models/Llama-3.2-1B     # any stage: weights.configure, weights.loader

Architectures: GPT-2, LLaMA (RoPE scaling linear, dynamic, yarn, llama3: rope.py), Qwen2 (q/k/v bias; its
sliding window on the last layers) and Mistral (its sliding window), MPT (ALiBi).
Everything is local: config.json is read as JSON, weights through safetensors, and `transformers`
is never imported here (the tests use it as the reference).

Weights map by name: HF's q/k/v projections become our fused qkv rows [q | k | v], gate/up our
fused fc rows [gate | up], GPT-2's Conv1D weights (stored (in, out)) are transposed, and the
vocabulary rows are padded to ModelConfig.padded_vocab (zeros, never read: logits are sliced).
Every tensor is read through `safe_open(...).get_slice(name)` as a lazy `Part`; `shard_fn(name,
part) -> tensor` decides which rows/columns of each part this process keeps (default: all of it),
which is where tensor parallelism plugs in to read only its shard.

Tokenizers: tokenizer.py. init_from (configure, loading into any layout): weights.py.
"""
import contextlib
import json
import os
import re
from dataclasses import fields

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

import config
import rope
from model import ModelConfig, Transformer
from tokenizer import save_tokenizer, write_json

ARCHS = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
         "gpt2": "GPT2LMHeadModel", "mpt": "MptForCausalLM"}
GPT2_ACTS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu", "relu": "relu",
             "relu2": "relu2"}
LLAMA_ACTS = {"silu": "swiglu", "gelu": "geglu"}  # hidden_act of the gated MLP
# the ModelConfig keys an HF config defines (the others stay the run's own)
MODEL_KEYS = [f.name for f in fields(ModelConfig) if f.name not in (
    "pad_vocab_multiple", "dropout", "init_std", "grad_checkpoint", "fp32_residual", "fp8_head")]


class FolderError(config.UserError, ValueError):
    """A model folder whose files cannot be read (missing, damaged, malformed): one line naming the file."""


def read_config(path):
    """A model folder's config.json (HF's, or one of our checkpoints') as a dict; a missing or
    malformed file raises a UserError naming it."""
    file = os.path.join(path, "config.json")
    if not os.path.isfile(file):
        raise config.MissingFileError(f"{file} not found: a model folder keeps its config there (an HF folder: "
                                      "config.json, model.safetensors, tokenizer files); copy or export it again")
    try:
        with open(file, encoding="utf-8") as f:
            out = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        where = f":{e.lineno}" if isinstance(e, json.JSONDecodeError) else ""
        raise FolderError(f"{file}{where}: not valid JSON ({getattr(e, 'msg', e)}): repair it or copy/export the "
                          "folder again") from None
    if not isinstance(out, dict):
        raise FolderError(f"{file}: holds a {type(out).__name__}, not a JSON object of settings")
    return out


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
    return params.get("rope_theta", hf.get("rope_theta", 10000.0)), rope.from_hf(params, hf.get(
        "max_position_embeddings", 2048))


def _sliding_window(mt, hf):
    """(sliding_window, window_from) of ModelConfig: Mistral's window is on every layer; Qwen2's (with
    use_sliding_window) on the layers from max_window_layers on, or where layer_types says (v5)."""
    window = hf.get("sliding_window")
    if mt == "mistral" or not window:
        return window or 0, 0
    if mt != "qwen2" or not hf.get("use_sliding_window"):
        return 0, 0
    L = hf["num_hidden_layers"]
    types = hf.get("layer_types") or ["sliding_attention" if i >= hf.get("max_window_layers", 28) else "full_attention"
                                      for i in range(L)]
    first = types.index("sliding_attention") if "sliding_attention" in types else L
    if types[first:] != ["sliding_attention"] * (L - first):
        raise ValueError(f"qwen2 config: layer_types {types} is not supported by ingot's Transformer (the windowed "
                         f"layers must be the last ones)")
    return (window, first) if first < L else (0, 0)


def _mpt(hf, refuse):
    """MPT's config.json -> ModelConfig keywords (transformers' MptForCausalLM: ALiBi, bias-free LayerNorm)."""
    a = hf.get("attn_config") or {}
    for bad, what in [(not a.get("alibi", True), "attn_config.alibi=false"),
                      (a.get("alibi_bias_max", 8) != 8, f"attn_config.alibi_bias_max={a.get('alibi_bias_max')} (8 only)"),
                      (a.get("clip_qkv"), "attn_config.clip_qkv"), (a.get("softmax_scale"), "attn_config.softmax_scale"),
                      (a.get("qk_ln"), "attn_config.qk_ln"), (a.get("prefix_lm"), "attn_config.prefix_lm"),
                      (a.get("attn_type", "multihead_attention") != "multihead_attention", "attn_config.attn_type"),
                      (hf.get("expansion_ratio", 4) != 4, "expansion_ratio != 4"), (not hf.get("no_bias", True),
                      "no_bias=false"), (hf.get("logit_scale") is not None, "logit_scale")]:
        refuse(bad, what)
    C = hf["d_model"]
    return dict(n_layer=hf["n_layers"], n_head=hf["n_heads"], n_embd=C, ffn_hidden=4 * C, activation="gelu",
                norm="layernorm", norm_eps=hf.get("layer_norm_epsilon", 1e-5), pos_emb="alibi", bias=False,
                tie_embeddings=hf.get("tie_word_embeddings", True))


def config_from_hf(hf, block_size=None):
    """An HF config.json (dict) -> ModelConfig. block_size defaults to the longest context the model
    takes (max_position_embeddings). Anything we cannot reproduce exactly raises, naming the field."""
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
        longest, window = hf.get("n_positions", 1024), (0, 0)
    elif mt == "mpt":
        kw, longest, window = _mpt(hf, refuse), hf.get("max_seq_len", 2048), (0, 0)
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
    block_size = block_size or longest
    refuse(mt == "gpt2" and block_size > longest, f"block_size={block_size} > n_positions={longest}")
    return ModelConfig(vocab_size=hf["vocab_size"], block_size=block_size, sliding_window=window[0],
                       window_from=window[1], **kw)


def _export_type(cfg, model_type=None):
    """The HF model_type that expresses cfg exactly, or a ValueError naming what does not fit."""
    gpt2, mpt, window = cfg.family == "gpt2", cfg.family == "mpt", cfg.sliding_window > 0
    why = [w for bad, w in [
        (not cfg.prenorm, "prenorm=False"), (cfg.qk_norm, "qk_norm=True"),
        (gpt2 and cfg.norm != "layernorm", "learned positions with rmsnorm"),
        (gpt2 and cfg.activation not in GPT2_ACTS.values(), f"activation={cfg.activation!r} with learned positions"),
        (gpt2 and not cfg.bias, "learned positions without bias (GPT-2 has biases everywhere)"),
        (gpt2 and cfg.kv_heads != cfg.n_head, "grouped-query attention with learned positions"),
        (mpt and (cfg.norm, cfg.activation, cfg.bias, cfg.qkv_bias, cfg.kv_heads, cfg.hidden) != (
            "layernorm", "gelu", False, False, cfg.n_head, 4 * cfg.n_embd),
         "alibi other than MPT's (layernorm, gelu, no biases, MHA, ffn_hidden = 4 n_embd)"),
        ((gpt2 or mpt) and window, "a sliding window with learned or alibi positions"),
        (window and cfg.window_from and not (cfg.qkv_bias and not cfg.bias), "window_from > 0 without qkv_bias "
         "(Qwen2's layout)"), (window and cfg.bias, "a sliding window with bias=True"),
        (not (gpt2 or mpt) and cfg.norm != "rmsnorm", "rope with layernorm"),
        (not (gpt2 or mpt) and cfg.activation not in LLAMA_ACTS.values(), f"activation={cfg.activation!r} with rope"),
        # modded-nanogpt's pieces: no HF class above has them (Gemma 2's final_logit_softcapping comes with
        # its other differences: scaled embeddings, (1 + w) norms, post-norms, attention soft caps)
        (cfg.logit_softcap, f"logit_softcap={cfg.logit_softcap}"), (cfg.unet_skips, "unet_skips=True"),
        (cfg.value_embeds, f"value_embeds={cfg.value_embeds}"),
    ] if bad]
    mt = "gpt2" if gpt2 else "mpt" if mpt else "qwen2" if cfg.qkv_bias and not cfg.bias else "llama"
    if mt == "llama" and (window or model_type == "mistral") and not cfg.bias:  # Mistral without a window = LLaMA
        mt = "mistral"
    elif model_type not in (None, mt):
        why.append(f"model_type={model_type!r} (this config is a {mt})")
    if why:
        raise ValueError(f"this model cannot be exported to Hugging Face: {'; '.join(why)}. Exportable: GPT-2 "
                         "(learned positions, layernorm, gelu/gelu_tanh/relu/relu2, bias), MPT (alibi) and "
                         "LLaMA/Qwen2/Mistral (rope, rmsnorm, swiglu/geglu), pre-norm, without qk_norm, "
                         "logit_softcap, value_embeds, unet_skips")
    return mt


def config_to_hf(cfg, model_type=None, tokenizer=None):
    """ModelConfig -> an HF config.json dict. RoPE in both transformers' forms: v5's rope_parameters, v4's
    rope_theta / rope_scaling (which v5 also reads); max_position_embeddings block_size (dynamic: its
    original positions, past which HF's dynamic scales: rope.to_hf)."""
    mt = _export_type(cfg, model_type)
    ids = {k: getattr(tokenizer, a, None) for k, a in (("bos_token_id", "bos_id"), ("eos_token_id", "eos_id"))}
    common = dict(architectures=[ARCHS[mt]], model_type=mt, vocab_size=cfg.vocab_size,
                  tie_word_embeddings=cfg.tie_embeddings, initializer_range=cfg.init_std, **ids)
    if mt == "gpt2":
        act = {v: k for k, v in reversed(GPT2_ACTS.items())}[cfg.activation]
        return dict(common, n_positions=cfg.block_size, n_embd=cfg.n_embd, n_layer=cfg.n_layer, n_head=cfg.n_head,
                    n_inner=cfg.hidden, activation_function=act, layer_norm_epsilon=cfg.norm_eps,
                    resid_pdrop=cfg.dropout, embd_pdrop=cfg.dropout, attn_pdrop=cfg.dropout)
    if mt == "mpt":
        return dict(common, d_model=cfg.n_embd, n_heads=cfg.n_head, n_layers=cfg.n_layer, expansion_ratio=4,
                    max_seq_len=cfg.block_size, layer_norm_epsilon=cfg.norm_eps, no_bias=True, learned_pos_emb=False,
                    resid_pdrop=cfg.dropout, emb_pdrop=cfg.dropout, attn_config=dict(alibi=True, alibi_bias_max=8))
    scaling, positions = rope.to_hf(cfg.rope_scaling, cfg.block_size)
    out = dict(common, hidden_size=cfg.n_embd, intermediate_size=cfg.hidden, num_hidden_layers=cfg.n_layer,
               num_attention_heads=cfg.n_head, num_key_value_heads=cfg.kv_heads, head_dim=cfg.head_dim,
               hidden_act={v: k for k, v in LLAMA_ACTS.items()}[cfg.activation],
               max_position_embeddings=positions, rms_norm_eps=cfg.norm_eps, rope_theta=cfg.rope_theta,
               rope_scaling=scaling, rope_parameters={"rope_type": "default", **(scaling or {}),
                                                      "rope_theta": cfg.rope_theta}, attention_dropout=cfg.dropout)
    if mt == "llama":
        out.update(attention_bias=cfg.bias, mlp_bias=cfg.bias)
    else:
        out.update(sliding_window=cfg.sliding_window or None, use_sliding_window=cfg.sliding_window > 0,
                   max_window_layers=cfg.window_from)
    return out


# ----------------------------------------------------------------------------- weights

LLAMA_NAMES = {"norm1": ["input_layernorm"], "norm2": ["post_attention_layernorm"],
               "attn.qkv": ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"],
               "attn.proj": ["self_attn.o_proj"], "mlp.fc": ["mlp.gate_proj", "mlp.up_proj"],
               "mlp.proj": ["mlp.down_proj"], "tok_emb": ["embed_tokens"], "norm_f": ["norm"]}
GPT2_NAMES = {"norm1": ["ln_1"], "norm2": ["ln_2"], "attn.qkv": ["attn.c_attn"], "attn.proj": ["attn.c_proj"],
              "mlp.fc": ["mlp.c_fc"], "mlp.proj": ["mlp.c_proj"], "tok_emb": ["wte"], "pos_emb": ["wpe"],
              "norm_f": ["ln_f"]}
MPT_NAMES = {"norm1": ["norm_1"], "norm2": ["norm_2"], "attn.qkv": ["attn.Wqkv"], "attn.proj": ["attn.out_proj"],
             "mlp.fc": ["ffn.up_proj"], "mlp.proj": ["ffn.down_proj"], "tok_emb": ["wte"], "norm_f": ["norm_f"]}
PREFIXES = ("model.", "transformer.", "")  # ...ForCausalLM / GPT2LMHeadModel / bare base model
IGNORED = re.compile(r"(\.attn\.(masked_)?bias|rotary_emb\.inv_freq)$")  # buffers some checkpoints carry


def _layout(name, cfg, mt):
    """Our parameter name -> [(HF name without prefix, a range of our rows or None, transposed)],
    concatenated along our dim 0. GPT-2's fused c_attn (its columns) and MPT's Wqkv (its rows) are
    cut into q/k/v ranges, so that every part is one head group (what a tensor-parallel shard_fn cuts)."""
    if name == "head.weight":
        return [("lm_head.weight", None, False)]
    m = re.fullmatch(r"(?:blocks\.(\d+)\.)?(.+)\.(weight|bias)", name)
    layer, module, kind = m.groups()
    names = {"gpt2": GPT2_NAMES, "mpt": MPT_NAMES}.get(mt, LLAMA_NAMES)[module]
    block = "" if layer is None else {"gpt2": f"h.{layer}.", "mpt": f"blocks.{layer}."}.get(mt, f"layers.{layer}.")
    conv1d = mt == "gpt2" and layer is not None and kind == "weight" and not module.startswith("norm")
    if mt in ("gpt2", "mpt") and module == "attn.qkv":
        C = cfg.n_embd
        return [(f"{block}{names[0]}.{kind}", (j * C, (j + 1) * C), conv1d) for j in range(3)]
    return [(f"{block}{n}.{kind}", None, conv1d) for n in names]


class Part:
    """One HF tensor, or the range `cols` of its rows in our orientation (columns of a transposed one),
    seen in our orientation and read lazily: part[a:b] (rows) or part[a:b, c:d] reads only those bytes. `rows` pads with zero rows (the
    padded vocabulary) or keeps the first rows (a learned position table longer than block_size).
    sl: safetensors' get_slice() object, or a tensor (pytorch_model.bin)."""

    def __init__(self, sl, cols=None, transpose=False, rows=None):
        self.sl, self.cols, self.transpose = sl, cols, transpose
        shape = list(sl.shape if torch.is_tensor(sl) else sl.get_shape())
        self.ax = -1 if transpose else 0  # their axis of our rows
        if cols:
            shape[self.ax] = cols[1] - cols[0]
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
            c0, c1, _ = theirs[self.ax].indices(self.cols[1] - self.cols[0])
            theirs[self.ax] = slice(self.cols[0] + c0, self.cols[0] + c1)
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
        raise config.MissingFileError(f"{path}: no model.safetensors(.index.json) or pytorch_model.bin(.index.json): "
                                      "the folder has no weights; copy or export them into it")
    out = {}
    for f in files:
        if not os.path.isfile(os.path.join(path, f)):
            raise config.MissingFileError(f"{os.path.join(path, f)} not found (named by the folder's weight index): "
                                          "copy the missing shard into the folder")
        if f.endswith(".safetensors"):
            try:
                h = stack.enter_context(safe_open(os.path.join(path, f), framework="pt"))
            except (SafetensorError, OSError) as e:
                raise FolderError(f"{os.path.join(path, f)}: cannot read it ({e}): the file is incomplete or "
                                  "damaged; copy or export it again") from None
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
        emb = "wte.weight" if mt in ("gpt2", "mpt") else "embed_tokens.weight"
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


def export_hf(model, out_dir, tokenizer=None, model_type=None):
    """Write `model` as an HF folder: config.json, model.safetensors, generation_config.json (a chat
    tokenizer's end-of-turn id first among its eos_token_id) and, given a tokenizer, its files.
    model_type: None picks gpt2 / llama / qwen2 from the config; "mistral" is accepted for a
    bias-free LLaMA-style model."""
    cfg = model.cfg
    mt = _export_type(cfg, model_type)
    sizes = {"attn.qkv": [cfg.n_head * cfg.head_dim] + [cfg.kv_heads * cfg.head_dim] * 2, "mlp.fc": [cfg.hidden] * 2}
    prefix = "transformer." if mt in ("gpt2", "mpt") else "model."
    out = {}
    for name, t in model.named_parameters():
        specs = _layout(name, cfg, mt)
        t = t.detach()[:cfg.vocab_size] if name in ("tok_emb.weight", "head.weight") else t.detach()
        pieces = t.split(sizes[name.split(".", 2)[2].rsplit(".", 1)[0]]) if len(specs) > 1 else [t]
        for (n, _, transposed), piece in zip(specs, pieces):
            n = n if n == "lm_head.weight" else prefix + n
            out.setdefault(n, []).append((piece, transposed))
    tensors = {}
    for n, v in out.items():  # the pieces of one HF tensor (GPT-2's c_attn, MPT's Wqkv: q|k|v) join along our rows
        t = torch.cat([piece for piece, _ in v])
        tensors[n] = (t.T if v[0][1] else t).contiguous().cpu()
    os.makedirs(out_dir, exist_ok=True)
    save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    hf = config_to_hf(cfg, mt, tokenizer)
    hf["torch_dtype"] = str(next(model.parameters()).dtype).removeprefix("torch.")
    write_json(os.path.join(out_dir, "config.json"), hf)
    gen = {k: hf[k] for k in ("bos_token_id", "eos_token_id") if hf[k] is not None}
    eot = getattr(tokenizer, "eot_id", None)  # a chat model's end of turn: generate stops there too (as HF's chat models)
    if eot is not None and eot != hf["eos_token_id"]:
        gen["eos_token_id"] = [eot] + ([hf["eos_token_id"]] if hf["eos_token_id"] is not None else [])
    write_json(os.path.join(out_dir, "generation_config.json"), gen)
    if tokenizer is not None:
        save_tokenizer(tokenizer, out_dir)
    return out_dir




# ----------------------------------------------------------------------------- name-mapped folders (encoders/)

def read_mapped(model, names, get, path, what, vocab):
    """Copy HF tensors into `model` by a name map (ours -> the HF names stacked along rows: an encoders/
    family's hf_names); get(name) gives a tensor, or None where the file has none. The `vocab` parameters get
    zero rows past the folder's vocabulary (never read). Returns the HF names read."""
    params, used = dict(model.named_parameters()), set()
    for ours, theirs in names.items():
        parts = [get(n) for n in theirs]
        missing = [n for n, t in zip(theirs, parts) if t is None]
        if missing:
            raise config.ConfigError(f"{path}: {missing[0]} missing: not a {what}?")
        t, p = torch.cat(parts), params[ours]
        if ours in vocab:
            t = torch.cat([t, t.new_zeros(p.shape[0] - t.shape[0], *t.shape[1:])])
        if t.shape != p.shape:
            raise config.ConfigError(f"{path}: {ours} is {tuple(t.shape)} from {theirs}, the model's {tuple(p.shape)}")
        p.copy_(t)
        used.update(theirs)
    return used


def write_mapped(model, names, hf_config, out_dir, vocab):
    """Write `model` as an HF folder (model.safetensors, config.json = hf_config + torch_dtype) by a name map
    as read_mapped's; the `vocab` parameters lose their padded rows."""
    params, tensors = dict(model.named_parameters()), {}
    for ours, theirs in names.items():
        t = params[ours].detach()
        t = t[:model.cfg.vocab_size] if ours in vocab else t
        for name, piece in zip(theirs, t.chunk(len(theirs))):
            tensors[name] = piece.contiguous().cpu()
    os.makedirs(out_dir, exist_ok=True)
    save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    write_json(os.path.join(out_dir, "config.json"), dict(hf_config, torch_dtype=dtype))
    return out_dir


if __name__ == "__main__":  # a library module, not a script: running it (--help or not) says what it holds
    print(__doc__)
