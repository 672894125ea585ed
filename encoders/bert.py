"""BERT: the encoder-only Transformer, its heads, masked-language-model masking, HF folders.

    model = bert.Bert(bert.BertConfig(vocab_size=30522, n_layer=12, n_head=12, n_embd=768))
    x, y = bert.mask_tokens(ids, mask_id=103, vocab_size=30522, special_ids=[0, 101, 102], generator=g)
    loss = model(x, y, attn_mask=real)                 # MLM: cross-entropy over the chosen positions
    model = bert.load_hf("models/bert-base-uncased")   # BertForMaskedLM / ...SequenceClassification / ...TokenClassification
    bert.export_hf(model, "out/bert")                  # transformers.AutoModelForMaskedLM.from_pretrained("out/bert")

The model: word + learned position + token-type embeddings, LayerNorm, then model.Block in its
post-norm form (x = LN(x + attn(x)); x = LN(x + mlp(x)), biases everywhere, GELU) with
bidirectional attention: a query sees every real key of its row (attn_mask marks them). Heads
(BertConfig.head): "mlm" (dense, GELU, LayerNorm, then the decoder tied to the word embeddings
plus a bias of its own, as BERT), "sequence" (the tanh pooler on the first token, then a linear
classifier) or "token" (a linear classifier per position, for tagging). Dropout as HF's BERT
(embeddings, attention probabilities, residual branches, before a classifier), one rate.

mask_tokens: BERT's 80/10/10 (HF's DataCollatorForLanguageModeling): each position not in
special_ids is chosen with probability `rate`; a chosen position keeps its token as the target
and its input becomes mask_id (80%), a uniformly random id (10%) or stays (10%); every other
target is IGNORE. Layers are named blocks.i like model.Transformer's, so fsdp.FSDP (a unit per
block) and dp.DataParallel wrap a Bert as they do a Transformer.

HF interop is ours (`transformers` never imported): config.json and safetensors, q/k/v fused into
attn.qkv, vocabulary rows padded, padded logits sliced off; a BertForPreTraining folder's
next-sentence head and a masked-LM folder's pooler left unread, as transformers' BertForMaskedLM.
"""
import json
import os
from dataclasses import dataclass, fields

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors import safe_open

import hf
from config import ConfigError
from encoders import denoising
from fused import IGNORE
from model import Block, ModelConfig, Transformer, activation_fn, round_up

HEADS = ("mlm", "sequence", "token")
ARCHS = {"mlm": "BertForMaskedLM", "sequence": "BertForSequenceClassification", "token": "BertForTokenClassification"}
VOCAB_ROWS = ("tok_emb.weight", "head.bias")  # padded to the model's vocabulary: zero rows in, cut on export
HF_ACTS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "relu": "relu"}


@dataclass
class BertConfig:
    vocab_size: int = 30522
    pad_vocab_multiple: int = 64   # embedding / decoder rows padded to a multiple of this (speed)
    block_size: int = 512          # longest sequence (rows of the position table)
    type_vocab_size: int = 2       # token types (segment A / B)
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    ffn_hidden: int = 0            # 0 -> 4 * n_embd
    activation: str = "gelu"       # gelu (exact, BERT's) | gelu_tanh | relu
    norm_eps: float = 1e-12
    dropout: float = 0.1
    init_std: float = 0.02
    pad_id: int = -1               # >= 0: its embedding row stays zero and gets no gradient (HF's padding_idx)
    head: str = "mlm"              # mlm | sequence | token
    n_labels: int = 2              # classes of the sequence / token head

    @classmethod
    def from_cfg(cls, cfg):
        """Pick this dataclass's keys out of a flat config namespace (the model keys of a run)."""
        return cls(**{f.name: getattr(cfg, f.name) for f in fields(cls) if hasattr(cfg, f.name)})

    def __post_init__(self):
        if self.head not in HEADS:
            raise ConfigError(f"head={self.head!r}: choose one of {', '.join(HEADS)}")
        if self.head != "mlm" and self.n_labels < 2:
            raise ConfigError(f"n_labels={self.n_labels}: a classifier needs at least 2 classes")
        if self.activation not in HF_ACTS.values():
            raise ConfigError(f"activation={self.activation!r}: choose one of gelu, gelu_tanh, relu")
        if self.type_vocab_size < 1 or self.pad_id >= self.vocab_size:
            raise ConfigError(f"type_vocab_size={self.type_vocab_size} must be >= 1, pad_id={self.pad_id} < "
                              f"vocab_size={self.vocab_size}")
        self.block_config()  # the checks of the shared pieces (heads divide the width, ...)

    def block_config(self):
        """The model.ModelConfig of the blocks: post-norm, LayerNorm, biases, learned positions."""
        try:
            return ModelConfig(vocab_size=self.vocab_size, pad_vocab_multiple=self.pad_vocab_multiple,
                               block_size=self.block_size, n_layer=self.n_layer, n_head=self.n_head,
                               n_embd=self.n_embd, ffn_hidden=self.ffn_hidden or 4 * self.n_embd,
                               activation=self.activation, norm="layernorm", norm_eps=self.norm_eps, prenorm=False,
                               pos_emb="learned", bias=True, dropout=self.dropout, init_std=self.init_std)
        except ValueError as e:
            raise ConfigError(str(e)) from e

    @property
    def padded_vocab(self):
        return round_up(self.vocab_size, self.pad_vocab_multiple)


class Bert(denoising.DenseCounts, nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg, mcfg, C = cfg, cfg.block_config(), cfg.n_embd
        self.tok_emb = nn.Embedding(cfg.padded_vocab, C, padding_idx=cfg.pad_id if cfg.pad_id >= 0 else None)
        self.pos_emb = nn.Embedding(cfg.block_size, C)
        self.type_emb = nn.Embedding(cfg.type_vocab_size, C)
        self.emb_norm = nn.LayerNorm(C, eps=cfg.norm_eps)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(mcfg, i) for i in range(cfg.n_layer))
        if cfg.head == "mlm":
            self.transform = nn.Linear(C, C)
            self.act = activation_fn(cfg.activation)
            self.transform_norm = nn.LayerNorm(C, eps=cfg.norm_eps)
            self.head = nn.Linear(C, cfg.padded_vocab)  # BERT's decoder: the word embeddings, its own bias
            self.head.weight = self.tok_emb.weight
        else:
            if cfg.head == "sequence":
                self.pooler = nn.Linear(C, C)
            self.classifier = nn.Linear(C, cfg.n_labels)
        self.init_weights()

    @torch.no_grad()
    def init_weights(self):
        """HF's BERT init: N(0, init_std) linears and embeddings (the padding row zero), zero biases,
        unit LayerNorms."""
        for m in self.modules():
            if isinstance(m, nn.Linear):
                if m is not getattr(self, "head", None):  # the tied decoder: initialised as the embedding
                    nn.init.normal_(m.weight, 0.0, self.cfg.init_std)
                nn.init.zeros_(m.bias)
            elif isinstance(m, nn.Embedding):
                nn.init.normal_(m.weight, 0.0, self.cfg.init_std)
                if m.padding_idx is not None:
                    m.weight[m.padding_idx].zero_()
            elif isinstance(m, nn.LayerNorm):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)

    def encode(self, idx, token_type=None, attn_mask=None):
        """idx (B, T) -> the last block's hidden states (B, T, C). token_type (B, T) (default 0);
        attn_mask (B, T) 0/1 or bool, True = a real token (default: all): keys a query may see."""
        B, T = idx.shape
        if T > self.cfg.block_size:
            raise ConfigError(f"sequence of {T} tokens exceeds block_size={self.cfg.block_size}: shorten it")
        pos = torch.arange(T, device=idx.device)
        types = self.type_emb(token_type) if token_type is not None else self.type_emb.weight[0]
        x = self.drop(self.emb_norm(self.tok_emb(idx) + self.pos_emb(pos) + types))
        mask = None if attn_mask is None else attn_mask.bool()[:, None, None, :]  # (B, 1, 1, T): keys
        for i, block in enumerate(self.blocks):
            x = block(x, None, None, mask, False, None, i)
        return x

    def output(self, h):
        """Hidden states -> the head's logits: mlm (B, T, vocab_size), sequence (B, n_labels) from the
        first position, token (B, T, n_labels)."""
        if self.cfg.head == "mlm":
            h = self.transform_norm(self.act(self.transform(h)))
            return self.head(h)[..., :self.cfg.vocab_size]
        if self.cfg.head == "sequence":
            h = torch.tanh(self.pooler(h[:, 0]))
        return self.classifier(self.drop(h))

    def forward(self, idx, targets=None, *, token_type=None, attn_mask=None, reduction="mean"):
        """Logits (see output), or with targets the cross-entropy: mlm / token targets (B, T) with
        IGNORE where no loss is wanted; sequence targets (B,) class ids. reduction "mean" (over
        the counted targets, as transformers' loss) | "sum" | "none"."""
        h = self.encode(idx, token_type, attn_mask)
        if targets is None:
            return self.output(h)
        if self.cfg.head == "sequence":
            return F.cross_entropy(self.output(h).float(), targets, reduction=reduction)
        if self.cfg.head == "mlm" and reduction != "none":  # the head on the chosen positions only (~15%)
            keep = targets != IGNORE
            return Transformer.loss(self.output(h[keep])[None], targets[keep][None], reduction)
        return Transformer.loss(self.output(h), targets, reduction)


# ----------------------------------------------------------------------------- masked-LM masking

def mask_tokens(ids, *, mask_id, vocab_size, rate=0.15, special_ids=(), generator=None):
    """BERT's masking of a batch of ids (any shape) -> (inputs, targets), see the module docstring.
    special_ids (CLS, SEP, PAD, ...) are never chosen; random replacements are drawn uniformly
    from [0, vocab_size), as transformers' collator draws from the whole vocabulary."""
    if not 0.0 <= rate <= 1.0:
        raise ConfigError(f"mask rate={rate} must be in [0, 1]")
    special = torch.isin(ids, torch.as_tensor(list(special_ids), dtype=ids.dtype, device=ids.device))
    u = torch.rand((3, *ids.shape), generator=generator, device=ids.device)
    chosen = (u[0] < rate) & ~special
    targets = ids.masked_fill(~chosen, IGNORE)
    to_mask = chosen & (u[1] < 0.8)
    to_random = chosen & ~to_mask & (u[2] < 0.5)  # half of the remaining 20%
    random_ids = torch.randint(0, vocab_size, ids.shape, generator=generator, device=ids.device, dtype=ids.dtype)
    inputs = torch.where(to_mask, torch.full_like(ids, mask_id), torch.where(to_random, random_ids, ids))
    return inputs, targets


# ----------------------------------------------------------------------------- HF folders

def hf_names(cfg):
    """Our parameter name -> [HF names] (several: concatenated along our rows, q | k | v)."""
    out = {"tok_emb.weight": ["bert.embeddings.word_embeddings.weight"],
           "pos_emb.weight": ["bert.embeddings.position_embeddings.weight"],
           "type_emb.weight": ["bert.embeddings.token_type_embeddings.weight"],
           "emb_norm.weight": ["bert.embeddings.LayerNorm.weight"], "emb_norm.bias": ["bert.embeddings.LayerNorm.bias"]}
    for i in range(cfg.n_layer):
        hf = f"bert.encoder.layer.{i}."
        for kind in ("weight", "bias"):
            out.update({f"blocks.{i}.attn.qkv.{kind}": [f"{hf}attention.self.{n}.{kind}" for n in ("query", "key", "value")],
                        f"blocks.{i}.attn.proj.{kind}": [f"{hf}attention.output.dense.{kind}"],
                        f"blocks.{i}.norm1.{kind}": [f"{hf}attention.output.LayerNorm.{kind}"],
                        f"blocks.{i}.mlp.fc.{kind}": [f"{hf}intermediate.dense.{kind}"],
                        f"blocks.{i}.mlp.proj.{kind}": [f"{hf}output.dense.{kind}"],
                        f"blocks.{i}.norm2.{kind}": [f"{hf}output.LayerNorm.{kind}"]})
    for kind in ("weight", "bias"):
        if cfg.head == "mlm":
            out.update({f"transform.{kind}": [f"cls.predictions.transform.dense.{kind}"],
                        f"transform_norm.{kind}": [f"cls.predictions.transform.LayerNorm.{kind}"]})
        else:
            out[f"classifier.{kind}"] = [f"classifier.{kind}"]
            if cfg.head == "sequence":
                out[f"pooler.{kind}"] = [f"bert.pooler.dense.{kind}"]
    if cfg.head == "mlm":
        out["head.bias"] = ["cls.predictions.bias"]
    return out


def config_from_hf(hf):
    """A BERT config.json (dict) -> BertConfig; what ingot cannot reproduce raises, naming the field."""
    archs = hf.get("architectures") or ["BertForMaskedLM"]
    heads = [h for h, a in ARCHS.items() if a in archs] or (["mlm"] if "BertForPreTraining" in archs else [])
    for bad, what in [(hf.get("model_type") != "bert", f"model_type={hf.get('model_type')!r} (bert only)"),
                      (not heads, f"architectures {archs} (choose one of {', '.join(ARCHS.values())})"),
                      (hf.get("hidden_act", "gelu") not in HF_ACTS, f"hidden_act={hf.get('hidden_act')!r}"),
                      (hf.get("position_embedding_type", "absolute") != "absolute", "position_embedding_type"),
                      (hf.get("is_decoder") or hf.get("add_cross_attention"), "is_decoder / add_cross_attention"),
                      (not hf.get("tie_word_embeddings", True), "tie_word_embeddings=false"),
                      (hf.get("problem_type") not in (None, "single_label_classification"),
                       f"problem_type={hf.get('problem_type')!r}")]:
        if bad:
            raise ConfigError(f"bert config: {what} is not supported by bert.py")
    labels = len(hf["id2label"]) if hf.get("id2label") else hf.get("num_labels", 2)
    pad = hf.get("pad_token_id")
    return BertConfig(vocab_size=hf["vocab_size"], block_size=hf.get("max_position_embeddings", 512),
                      type_vocab_size=hf.get("type_vocab_size", 2), n_layer=hf["num_hidden_layers"],
                      n_head=hf["num_attention_heads"], n_embd=hf["hidden_size"], ffn_hidden=hf["intermediate_size"],
                      activation=HF_ACTS[hf.get("hidden_act", "gelu")], norm_eps=hf.get("layer_norm_eps", 1e-12),
                      dropout=hf.get("hidden_dropout_prob", 0.1), init_std=hf.get("initializer_range", 0.02),
                      pad_id=-1 if pad is None else pad, head=heads[0], n_labels=labels)


@torch.no_grad()
def load_hf(path, dtype=torch.float32):
    """An HF BERT folder (config.json + model.safetensors) -> Bert in eval mode."""
    with open(os.path.join(path, "config.json")) as f:
        cfg = config_from_hf(json.load(f))
    model = Bert(cfg).to(dtype)
    file = os.path.join(path, "model.safetensors")
    if not os.path.isfile(file):
        raise ConfigError(f"{path}: no model.safetensors (bert.py reads safetensors only)")
    with safe_open(file, framework="pt") as f:
        # older checkpoints: LayerNorm gamma / beta; a bare BertModel: names without "bert."
        src = {k.replace("LayerNorm.gamma", "LayerNorm.weight").replace("LayerNorm.beta", "LayerNorm.bias"): k
               for k in f.keys()}
        bare = not any(k.startswith("bert.") for k in src)
        names = {ours: [n.removeprefix("bert.") if bare else n for n in theirs]
                 for ours, theirs in hf_names(cfg).items()}
        used = hf.read_mapped(model, names, lambda n: f.get_tensor(src[n]) if n in src else None, path,
                              f"{ARCHS[cfg.head]} checkpoint", VOCAB_ROWS)
    skipped = ("pooler.", "cls.seq_relationship.", "position_ids", "cls.predictions.decoder.")
    unused = [k for k in src if k not in used and not any(s in k for s in skipped)]
    if unused:
        raise ConfigError(f"{path}: tensors bert.py does not understand: {unused[:8]}")
    return model.eval()


def config_to_hf(cfg):
    """BertConfig -> an HF config.json dict."""
    act = {v: k for k, v in reversed(HF_ACTS.items())}[cfg.activation]
    out = dict(architectures=[ARCHS[cfg.head]], model_type="bert", vocab_size=cfg.vocab_size,
               hidden_size=cfg.n_embd, num_hidden_layers=cfg.n_layer, num_attention_heads=cfg.n_head,
               intermediate_size=cfg.ffn_hidden or 4 * cfg.n_embd, hidden_act=act, hidden_dropout_prob=cfg.dropout,
               attention_probs_dropout_prob=cfg.dropout, max_position_embeddings=cfg.block_size,
               type_vocab_size=cfg.type_vocab_size, initializer_range=cfg.init_std, layer_norm_eps=cfg.norm_eps,
               pad_token_id=cfg.pad_id if cfg.pad_id >= 0 else None, tie_word_embeddings=True)
    if cfg.head != "mlm":
        out.update(id2label={str(i): f"LABEL_{i}" for i in range(cfg.n_labels)},
                   label2id={f"LABEL_{i}": i for i in range(cfg.n_labels)})
    return out


def export_hf(model, out_dir):
    """Write a Bert as an HF folder (config.json, model.safetensors) transformers loads as ARCHS[head]."""
    return hf.write_mapped(model, hf_names(model.cfg), config_to_hf(model.cfg), out_dir, VOCAB_ROWS)


def flops_per_token(cfg, T=None, predicted=1.0):
    """Training FLOPs per token at length T (default block_size), DESIGN.md's count for an encoder:
    6 x block matmul weights + 6 x the head's (MLM: transform and decoder, on the `predicted`
    fraction of positions it runs on: Bert's loss runs it on the chosen ones only) + 12 x L x T x C
    (bidirectional attention: the full T x T square, twice a causal model's)."""
    T = cfg.block_size if T is None else T
    C, hidden = cfg.n_embd, cfg.ffn_hidden or 4 * cfg.n_embd
    blocks = cfg.n_layer * (4 * C * C + 2 * C * hidden)
    head = (C * C + C * cfg.padded_vocab) * predicted if cfg.head == "mlm" else C * cfg.n_labels
    return 6 * blocks + 6 * head + 12 * cfg.n_layer * T * C


class BertFamily(denoising.Denoising):
    """weights.Family for objective "mlm": a Bert pretrained on BERT's masked tokens (denoising.py's
    batches and loss); sft.py and sample.py refuse it (an encoder does not generate)."""
    name, chosen_by, Config, Model, hf_class = "BERT", "objective='mlm'", BertConfig, Bert, "BertForMaskedLM"
    no_sample = "a BERT is an encoder: it does not generate text (it predicts masked tokens)"

    def extra_ids(self, cfg):
        return 1  # [MASK], the id past the tokenizer's

    def corrupt_row(self, row, cfg, tok, generator):
        return mask_tokens(row, mask_id=tok.n_vocab, vocab_size=tok.n_vocab, rate=cfg.mask_rate,
                           special_ids=[tok.eos_id], generator=generator)

    def flops_per_token(self, model, cfg):
        """Per position read: the head on the mask_rate share of positions it runs on."""
        return flops_per_token(model.cfg, self.read_length(cfg), predicted=cfg.mask_rate)

    def config_from_hf(self, path):
        return config_from_hf(hf.read_config(path))

    def load_hf(self, path):
        return load_hf(path)

    def export(self, model, folder):
        return export_hf(model, folder)

    def sft_check(self, cfg, grid):
        raise ConfigError(f"init_from={cfg.init_from} is a BERT: sft.py fine-tunes decoders, and T5s sequence to "
                          "sequence")


FAMILY = BertFamily()
