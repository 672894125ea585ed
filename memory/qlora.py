"""QLoRA (Dettmers et al., 2023): LoRA adapters on a frozen base stored in 4-bit NF4.

    lora.apply(model, cfg, grid)                 # after the TP cut and the HF / checkpoint weights
    qlora.quantize(model, double=True)           # each adapted linear's weight -> NF4 (+ 8-bit absmax)
    loss = model(x, y); loss.backward()          # adapters train; the base is dequantised on the fly
    lora.save_peft(out, lora.gather(model, grid), cfg)   # adapters in PEFT's format, as with LoRA
    weights = qlora.dequantized_state(model)     # the base as full tensors (merging, export)

QLoRALinear replaces each lora.LoRALinear in place, keeping its adapters, scale, dropout and TP
layout (its base_forward is the only change): the weight becomes quant.py's NF4 codes, two per
byte, with one fp32 absmax per block of 64 (0.5 bits per weight) or, with double quantisation, the
absmaxes themselves in 8 bits per block of 256 (0.127 bits). forward: NF4Linear (an autograd
Function) dequantises the weight into the compute dtype (bf16 under autocast), multiplies, and
keeps nothing weight-sized for backward: dx = dy W recomputes the dequantised W, so the base costs
its 4-bit bytes plus one layer's dequantised weight at a time. The weight gets no gradient.

The NF4 buffers are not persistent: checkpoints of a QLoRA run hold the adapters and the other
tensors; the base is quantised again from init_from when the run resumes (deterministic). Under
tensor parallelism each rank quantises its own slices; with in_features / tp a multiple of 64 the
blocks never straddle a row or a cut, so the codes equal one process's (double quantisation then
differs per rank, slightly). FSDP leaves the buffers replicated (4 bits per weight on every rank).
The other frozen tensors (embeddings, norms, head) are cast to `rest_dtype` (bf16), as QLoRA does.
merge() is refused: there is no full-precision weight to add into (use dequantized_state).
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

import lora
from memory import quant
from parallelism import tp

QLORA_DEFAULTS = dict(  # QLoRA's config key (lora_base_dtype="nf4")
    qlora_double=True,       # nf4: the block scales quantised too (double quantisation, 0.127 bits per weight)
)


class NF4Weight:
    """A frozen weight in NF4: packed codes and block statistics (tensors owned by the module's buffers)."""

    def __init__(self, module, prefix, block, double):
        self.module, self.prefix, self.block, self.double = module, prefix, block, double

    def dequantize(self, dtype):
        m, p = self.module, self.prefix
        absmax = getattr(m, p + "_absmax")
        if self.double:
            absmax = quant.double_dequantize(absmax, getattr(m, p + "_absmax2"), getattr(m, p + "_offset"))
        shape = m.weight_shape
        return quant.nf4_dequantize(getattr(m, p + "_nf4"), absmax, shape[0] * shape[1], self.block, dtype).view(shape)


class NF4Linear(torch.autograd.Function):
    """y = x W^T (+ b) with W dequantised in forward and again in backward (nothing W-sized saved)."""

    @staticmethod
    def forward(ctx, x, weight, bias, dtype):
        ctx.weight, ctx.dtype = weight, dtype
        return F.linear(x.to(dtype), weight.dequantize(dtype), None if bias is None else bias.to(dtype))

    @staticmethod
    def backward(ctx, dy):
        if not ctx.needs_input_grad[0]:
            return None, None, None, None
        return torch.matmul(dy.to(ctx.dtype), ctx.weight.dequantize(ctx.dtype)), None, None, None


def compute_dtype(x, fallback):
    dev = x.device.type
    return torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else fallback


class QLoRALinear(lora.LoRALinear):
    """A lora.LoRALinear whose frozen base weight is NF4 (built from one: from_lora)."""

    def __init__(self, m, block=64, double=True, device=None):
        nn.Module.__init__(self)
        for k in ("row", "group", "scale", "merged", "disabled", "rows"):  # LoRALinear's plain attributes
            setattr(self, k, getattr(m, k))
        self.drop, self.lora_A, self.lora_B, self.bias = m.drop, m.lora_A, m.lora_B, m.bias
        if m.merged:
            raise ValueError("qlora: the adapters are merged into the base; unmerge() first")
        w = m.weight.detach().to(device or m.weight.device)  # quantised where it will live (one weight at a time)
        self.weight_dtype, self.weight_shape = w.dtype, tuple(w.shape)  # compute dtype outside autocast; shape
        packed, absmax = quant.nf4_quantize(w, block)
        self.register_buffer("weight_nf4", packed, persistent=False)
        if double:
            q, a2, offset = quant.double_quantize(absmax)
            self.register_buffer("weight_absmax", q, persistent=False)
            self.register_buffer("weight_absmax2", a2, persistent=False)
            self.register_buffer("weight_offset", offset, persistent=False)
        else:
            self.register_buffer("weight_absmax", absmax, persistent=False)
        self.nf4 = NF4Weight(self, "weight", block, double)
        if hasattr(m.weight, "tp_split"):
            self.tp_split = m.weight.tp_split  # the base's TP layout: dequantized_state gathers like it

    def base_forward(self, x):
        dtype = compute_dtype(x, self.weight_dtype)
        if self.row:  # tp.RowParallelLinear's: partial sums, then the bias once
            y = tp.Reduce.apply(NF4Linear.apply(x, self.nf4, None, dtype), self.group)
            return y if self.bias is None else y + self.bias.to(y.dtype)
        return NF4Linear.apply(tp.Copy.apply(x, self.group), self.nf4, self.bias, dtype)

    def dequantized(self, dtype=torch.float32):
        return self.nf4.dequantize(dtype)

    def merge(self):
        raise ValueError("qlora: merge() needs a full-precision base; merge qlora.dequantized_state() "
                         "with lora.merge_weights instead")

    unmerge = merge


def quantize(model, block=64, double=True, rest_dtype=torch.bfloat16, device=None):
    """Every lora.LoRALinear of model -> QLoRALinear (NF4 base), in place; the other frozen floating
    tensors cast to rest_dtype (None: left alone). device: where the model goes (each base weight is
    moved there and quantised one at a time: a base built on the host, materialize.build's
    linear_device, never reaches the GPU in bf16). Call after lora.apply, before FSDP / DataParallel."""
    mods = lora.adapted(model)
    if not mods:
        raise ValueError("qlora.quantize: no LoRA adapters in this model: lora.apply() first")
    for name, parent in list(model.named_modules()):
        for attr, child in list(parent.named_children()):
            if isinstance(child, lora.LoRALinear) and not isinstance(child, QLoRALinear):
                setattr(parent, attr, QLoRALinear(child, block, double, device))
    if rest_dtype is not None:
        for n, p in model.named_parameters():
            if not p.requires_grad and p.is_floating_point():
                p.data = p.data.to(rest_dtype)
    return model if device is None else model.to(device)


def dequantized_state(model, grid=None, dtype=None):
    """{'<linear>.weight': full dequantised base weight on CPU} for every QLoRALinear (TP slices
    gathered when grid has tp > 1: collective), in dtype (None: the dtype it was quantised from);
    {} for a model without one. parallel.Net.full_state adds it to the weights, so a QLoRA
    checkpoint is a complete model (init_from, sample.py, lora.merge_weights read it as any other)."""
    out = {}
    for n, m in model.named_modules():
        if isinstance(m, QLoRALinear):
            w = m.dequantized(dtype or m.weight_dtype)
            out[f"{n}.weight"] = (tp.full_tensor(m, w, grid) if grid is not None else w).cpu()
    return out


def nf4_bytes(n_params, block=64, double=True):
    """Bytes of an n_params weight in NF4: half a byte per weight plus the block statistics (fp32
    absmax per block; double: one byte per block, an fp32 absmax per 256 blocks and the offset)."""
    blocks = -(-n_params // block)
    stats = blocks + 4 * -(-blocks // 256) + 4 if double else 4 * blocks
    return -(-n_params // 2) + stats
