"""Build a model straight into its storage dtype and device: no fp32 copy of an 8B base on the GPU.

    model = materialize.build(mcfg, device, torch.bfloat16, init=False)   # LoRA over init_from: weights come next
    model = materialize.build(mcfg, device, torch.bfloat16, init=False, linear_device="cpu")  # QLoRA: see below
    net = parallel.parallelize(model, grid, cfg, load=weights.loader(cfg, grid))

Today a stage builds Transformer(cfg) on the CPU in fp32 and moves it to the GPU, so an 8B LoRA run
peaks at the fp32 model (32 GB) before lora.apply casts the base to bf16. build() instead creates
the model on the meta device (no memory), casts it there (free; RoPE tables stay fp32), then gives
each module its own storage on the target device in the target dtype, module by module, so the
peak is the final model. init=True draws the initial weights on that device (Transformer.init_weights;
on a GPU its RNG, so the values differ from a CPU-built model's, though they are the same on every
rank for one seed); init=False leaves them to the loader (hf.load_weights / a checkpoint overwrite
every parameter) and only builds the RoPE tables. A tied head stays tied. Pretraining and full
fine-tuning keep fp32 parameters, the final model then being the peak anyway: their stages can keep
today's CPU-initialised Transformer(cfg) (the same weights on any machine for one seed).

linear_device (QLoRA): the blocks' linear weights live there (the host) instead, in the storage
dtype, while everything else is on `device`; the loader fills them, lora.apply adapts them, and
qlora.quantize(model, device=...) moves each one to the GPU as 4-bit codes, one weight at a time:
the GPU never holds the bf16 base (the host holds it, once, while it loads).

host_embedding(model) (embed_on_host): a frozen token embedding (LoRA, untied) moves to host memory;
its lookup runs there and only the looked-up rows (tokens x n_embd) go to the GPU: an 8B Llama's
128k x 4096 table is 1 GiB the GPU no longer holds. Names, state dicts and hooks are unchanged.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

import model as model_lib
from config import need
from model import Transformer

MATERIALIZE_DEFAULTS = dict(  # the frozen embedding's place (a config key)
    embed_on_host=False,     # LoRA: the frozen token embedding stays in host memory, rows looked up there (materialize.py)
)
RESUME_FREE = ("embed_on_host",)  # a resumed run may change it (lifecycle.RESUME_FREE)


def check(cfg, world=1):
    need(not cfg.embed_on_host or (cfg.lora_r and not cfg.tie_embeddings and cfg.tp == 1 and cfg.pp == 1
                                   and cfg.data_parallel == "ddp"),
         "embed_on_host=True keeps a frozen, untied token embedding on the host: it needs lora_r > 0, "
         "tie_embeddings=False, tp=1, pp=1 and data_parallel=ddp")


def is_block_linear(name, module):
    return name.startswith("blocks.") and isinstance(module, nn.Linear)


@torch.no_grad()
def build(mcfg, device, dtype=torch.float32, init=True, linear_device=None):
    """A Transformer(mcfg) whose parameters live on `device` (blocks' linears on linear_device when
    given) in `dtype`, built without a full-precision copy anywhere. See the module docstring."""
    with torch.device("meta"):
        m = Transformer(mcfg)
    if dtype != torch.float32:
        m.to(dtype)  # on meta: no memory; Transformer._apply keeps the RoPE tables fp32
    for name, mod in m.named_modules():
        own = list(mod.parameters(recurse=False)) + list(mod.buffers(recurse=False))
        if not any(t.is_meta for t in own):
            continue  # no tensors of its own, or a tied head already given its storage
        dev = linear_device if linear_device is not None and is_block_linear(name, mod) else device
        mod.to_empty(device=dev, recurse=False)
    if mcfg.tie_embeddings:
        m.head.weight = m.tok_emb.weight
    if init:
        m.init_weights()
    elif mcfg.pos_emb == "rope":  # what init_weights does besides drawing weights
        m.rope_cos, m.rope_sin = model_lib.rope_tables(mcfg.head_dim, mcfg.block_size, mcfg.rope_theta,
                                                       torch.device(device), mcfg.rope_scaling)
    return m


def storage_dtype(cfg, compute=torch.bfloat16):
    """The dtype a stage should build its model in: the frozen base's (LoRA with lora_base_dtype
    bfloat16: bf16; nf4: the compute dtype, which its 4-bit codes are made from; the adapters
    lora.apply adds stay fp32), else fp32."""
    if cfg.lora_r and cfg.lora_base_dtype == "nf4" and compute != torch.float32:
        return compute
    return torch.bfloat16 if cfg.lora_r and cfg.lora_base_dtype in ("bfloat16", "nf4") else torch.float32


class HostEmbedding(nn.Embedding):
    """An nn.Embedding whose (frozen) weight stays in host memory: the lookup runs there and the rows
    go to the ids' device; .to() / .cuda() leave the weight where it is."""

    def forward(self, idx):
        rows = F.embedding(idx.cpu(), self.weight, self.padding_idx, self.max_norm, self.norm_type,
                           self.scale_grad_by_freq, self.sparse)
        return rows.to(idx.device)

    def _apply(self, fn, recurse=True):
        return self


def host_embedding(model):
    """model.tok_emb -> HostEmbedding, its weight moved to the host (in place; returns model). Refused
    for an embedding that trains or is tied to the head (the head's matmul needs it on the GPU)."""
    emb = model.tok_emb
    if emb.weight.requires_grad or getattr(model.cfg, "tie_embeddings", False):
        raise ValueError("embed_on_host=True keeps a frozen, untied token embedding on the host: this one "
                         + ("trains" if emb.weight.requires_grad else "is tied to the head"))
    if not isinstance(emb, HostEmbedding):
        emb.weight.data = emb.weight.data.cpu()
        emb.__class__ = HostEmbedding
    return model
