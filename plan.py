"""The memory plan: predicted peak GPU memory of a training step, term by term, and the knobs that fit it.

    table = plan.predict(cfg, world=2)                 # cfg: a flat training config (config.load)
    print("\n".join(plan.show(table)))
    steps = plan.fit(cfg, gpu_gb=24, world=2)          # [(knob, new cfg, new table)], cheapest first
    python sft.py configs/sft_small.py --lora_r=16 --gpu_memory=24         # any stage: advice(), then exit
    python plan.py --stage=sft configs/sft_small.py --lora_r=16 --gpu_memory=24 --world=2   # other GPU counts

What is predicted: torch.cuda.max_memory_allocated() of one steady-state step, per GPU (not the CUDA
context, allocator slack, or building the model: weights.py's job). Terms: weights (storage dtype,
sharded as the layout shards them); bf16 compute copies autocast keeps of fp32 matrices (a recomputed
part's made again in backward); gradients (fp32; DataParallel's buckets full size, ZeRO-1 too);
optimizer state (AdamW 8 B a parameter, Muon's momentum 4, 8-bit ~2.03, offloaded 0); activations
(block_bytes: per token and block from model.py's ops, equal to the bytes a CPU keeps with its
composite rms_norm, tests/test_plan.py; compiled, a model may keep less); the loss's largest backward
phase (logits, or chunked.py's chunk and head buffers); a tied embedding's lookup gradient; Muon's step
temporaries; a KV cache. Peak: weights + state + the larger of backward's holding (copies, activations,
logits or one part recomputed; gradients too under DP / FSDP) and its end / the optimizer step (the
gradients + the embedding's or Muon's).

fit() walks LADDER, knobs ordered by their cost in speed (recompute before 8-bit AdamW as measured
on the 1B shape, BENCHMARKS.md; the rest judged, offload_activations among them; each applied only
where it lowers the total), until the plan fits gpu_gb less SPARE (7%). Dense models only (MoE refused); not
modelled: sequence parallelism, dropout masks, attention without flash kernels (T x T scores).
"""
import copy
import sys
from types import SimpleNamespace

import torch

import config
import lora
import muon
import weights
from memory import optim_memory, qlora
from model import ModelConfig, Transformer, value_layer

GiB = 2 ** 30
PLAN_DEFAULTS = dict(  # the memory plan's config key (memory/README.md: what a 24 GB card needs)
    gpu_memory=0.0,          # >0: print the memory plan (plan.py) for GPUs of this many GiB, what fits, and exit
)
SPARE = 0.07  # of gpu_memory left free: the allocator's reserved-but-unused blocks and the plan's own error (<= 4.9%
# on the 8B rows through sft.py, BENCHMARKS.md); "fits" means the predicted peak is within the rest
RESUME_FREE = ("gpu_memory",)  # a resumed run may change it (lifecycle.RESUME_FREE)


def check(cfg, world=1):
    config.need(cfg.gpu_memory >= 0, f"gpu_memory={cfg.gpu_memory} must be >= 0 (0: no plan; 24: plan for 24 GiB GPUs)")


def compute_bytes(cfg, cuda=True):
    return 4 if cfg.dtype == "float32" or (cfg.dtype == "auto" and not cuda) else 2


# ----------------------------------------------------------------------------- parameters

def count(cfg):
    """Parameter counts of the model cfg describes (built on the meta device, LoRA applied when
    lora_r > 0): {trained, frozen, block_matrices, matrices (blocks + untied head), largest,
    largest_trained, unit, root, muon, muon_batch, nf4_bytes}; unit: the largest block's parameters,
    root: the rest (FSDP units); muon_batch: Muon's largest Newton-Schulz batch (matrices of one shape)."""
    fam = weights.family(cfg)
    if fam.Model is not Transformer:
        raise NotImplementedError(f"plan: a {fam.name} ({fam.chosen_by}) is not modelled; the plan models the decoder")
    mcfg = fam.model_config(cfg)
    if mcfg.n_experts:
        raise NotImplementedError("plan: mixture-of-experts models are not modelled")
    with torch.device("meta"):
        model = Transformer(mcfg)
        if cfg.lora_r:
            c = copy.copy(cfg)
            c.lora_base_dtype = "float32"  # counted here; storage bytes below
            lora.apply(model, c, SimpleNamespace(tp=1, device=torch.device("cuda")))
    named = list(model.named_parameters())
    muon.mark_splits(model)
    ns = {}  # Muon's Newton-Schulz batches: elements per matrix shape (rows <= cols), fused weights split
    for n, p in named:
        if p.requires_grad and n.startswith("blocks.") and p.dim() >= 2:
            for rows in getattr(p, "muon_split", None) or [p.shape[-2]]:
                key = tuple(sorted((rows, p.shape[-1])))
                ns[key] = ns.get(key, 0) + rows * p.shape[-1]
    head = "tok_emb.weight" if mcfg.tie_embeddings else "head.weight"  # (a tied head is listed once, as tok_emb)
    mats = [(n, p) for n, p in named if p.dim() >= 2 and (n.startswith("blocks.") or n == head)]
    base = {f"{n}.weight" for n, m in model.named_modules() if isinstance(m, lora.LoRALinear)}
    blocks = [sum(p.numel() for n, p in named if n.startswith(f"blocks.{i}.")) for i in range(mcfg.n_layer)]
    return dict(trained=sum(p.numel() for _, p in named if p.requires_grad),
                frozen=sum(p.numel() for _, p in named if not p.requires_grad),
                matrices=sum(p.numel() for n, p in mats if not lora.is_adapter(n)),
                largest=max(p.numel() for _, p in mats),
                largest_trained=max([p.numel() for _, p in named if p.requires_grad] or [0]),
                base_linear=sum(p.numel() for n, p in named if n in base),
                largest_base=max([p.numel() for n, p in named if n in base] or [0]),
                nf4_bytes=sum(qlora.nf4_bytes(p.numel()) for n, p in named if n in base),
                unit=max(blocks), root=sum(p.numel() for n, p in named if not n.startswith("blocks.")),
                muon=sum(p.numel() for n, p in named if p.requires_grad and n.startswith("blocks.") and p.dim() >= 2),
                muon_batch=max(ns.values() or [0]), head_matrix=dict(named)[head].numel(),
                **{f"{part}_matrices": sum(p.numel() for n, p in named if n.startswith(f"blocks.0.{prefix}")
                                           and p.dim() >= 2 and not lora.is_adapter(n))
                   for part, prefix in (("block", ""), ("attn", "attn."), ("mlp", "mlp."))})


# ----------------------------------------------------------------------------- activations

def stream_bytes(cfg, compute=2):
    """Bytes per value of the residual stream: fp32 when fp32_residual and the embedding's output is fp32;
    a LoRA base stored in bf16 / NF4 hands the blocks a bf16 stream whatever fp32_residual says."""
    low_base = cfg.lora_r and cfg.lora_base_dtype != "float32"
    return 4 if compute == 4 or (ModelConfig.from_cfg(cfg).fp32_residual and not low_base) else 2


def block_bytes(cfg, tp=1, compute=2, part="all", fused_norm=True):
    """Bytes autograd keeps per token for one block of model.py (prenorm), by the ops it runs under
    autocast (compute = 2: bf16 activations, fp32 residual stream; 4: fp32). part: "attn", "mlp"
    (each with its norm), "norm" (one norm's share) or "all". fused_norm: F.rms_norm is CUDA's fused
    kernel (input and rstd kept); False: the composite one a CPU runs (the normalised input too, for
    the weight's gradient). Each term names the tensor it is."""
    m = ModelConfig.from_cfg(cfg)
    C, H, KV, D, F = m.n_embd, m.n_head // tp, max(1, m.kv_heads // tp), m.head_dim, m.hidden // tp
    a = compute
    cast = C * a if a == 2 else 0  # the first matmul's bf16 input (autocast's copy, or a bf16 stream's norm output)
    rms = m.norm == "rmsnorm"
    # a norm keeps its fp32 input (autocast's fp32 layer_norm makes one of a bf16 stream), rstd (LayerNorm: + mean)
    # and, composite with its weight trained, the normalised input; model.RMSNorm on a bf16 stream: that input only
    norm = 4 * C + (4 if rms else 8) + (4 * C if rms and not cfg.lora_r and not fused_norm else 0)
    if rms and stream_bytes(cfg, compute) == 2:
        norm = 2 * C
    r = cfg.lora_r or 0
    attn = norm + (cast or 4 * C) + 4 * H + a * H * D  # ..., bf16 input, lse, out
    if m.pos_emb == "rope" or m.qk_norm:  # new q and k (rotated, normed), and v copied out of qkv's output
        attn += a * (H + KV) * D + a * KV * D
    else:  # q, k, v: views of qkv's output
        attn += a * (H + 2 * KV) * D
    if getattr(cfg, "pack", False) and KV < H:  # SFT's packed rows: a mask, so model.sdpa repeats k and v to every
        # head (q, k, v all H wide are kept, not k and the v copy) and SDPA keeps the mask as a bias, T per token
        attn += a * 2 * (H - KV) * D + a * (cfg.seq_len or cfg.block_size)
    if m.qk_norm:  # model.RMSNorm on q and k per head (not lean): an fp32 copy kept, rstd per head (composite: normed)
        attn += (4 + (4 if not cfg.lora_r and not fused_norm else 0)) * (H + KV) * D + 4 * (H + KV)
    attn += 2 * r * 4  # the adapters' h (q, k, v; proj), LoRA only
    split = m.gated and not r  # model.MLP's two-matmul path on a plain nn.Linear: one input cast per matmul
    mlp = norm + (cast or 4 * C) * (2 if split and cast else 1)
    if m.gated:
        mlp += 4 * a * F  # gate, act(gate), up, product (with LoRA: [gate|up] as one tensor, same bytes)
    else:
        mlp += a * F * (1 if m.activation == "relu" else 2)  # fc out (saved by the activation), its output
    mlp += 2 * r * 3
    return {"attn": attn, "mlp": mlp, "norm": norm, "all": attn + mlp}[part]


def recompute_of(cfg):
    """(mode, every): mode '' | 'block' | 'attn' | 'mlp' (grad_checkpoint=True is 'block' every block)."""
    if cfg.grad_checkpoint:
        return "block", 1
    return cfg.recompute, max(1, cfg.recompute_every)


def activations(cfg, tokens, tp=1, compute=2, fused_norm=True):
    """(bytes saved over every block and the final norm, bytes of one part recomputed in backward);
    fused_norm: block_bytes'. mlp_tile: every MLP keeps its input only, and one tile's internals are
    rebuilt at a time (on top of a recomputed block's)."""
    m = ModelConfig.from_cfg(cfg)
    mode, every = recompute_of(cfg)
    full = block_bytes(cfg, tp, compute, fused_norm=fused_norm)
    res = stream_bytes(cfg, compute)  # a checkpointed part keeps its input: the stream, or its norm's output (same dtype)
    norm = block_bytes(cfg, tp, compute, "norm", fused_norm)
    tile = 0
    if cfg.mlp_tile:  # the MLP's internals (without its norm) become its input, one tile of them at a time in backward
        mlp = block_bytes(cfg, tp, compute, "mlp", fused_norm) - norm
        full, tile = full - mlp + res * m.n_embd, min(cfg.mlp_tile, tokens) * mlp
    # value embeddings: l0 v + l1 ve (l trained) keeps ve (fp32, an embedding's output) and v, a view of qkv's output
    # (all of it kept: q and k are new tensors with rope or qk_norm) or, without, the mixed v SDPA keeps; where the
    # attention is recomputed, ve alone (the checkpoint's input). unet_skips (its weights trained): the middle
    # block's output, kept by its skip weight's product (the other skips are saved block inputs)
    H, KV, D = m.n_head // tp, max(1, m.kv_heads // tp), m.head_dim
    mixed = (compute * (H + 2 * KV) * D if m.pos_emb == "rope" or m.qk_norm else compute * KV * D) + 4 * KV * D
    redone = [i % every == 0 and mode in ("block", "attn") for i in range(m.n_layer) if value_layer(m, i) is not None]
    extra = sum(4 * KV * D if r else 0 if cfg.lora_r else mixed for r in redone)
    extra += res * m.n_embd if m.unet_skips and not cfg.lora_r else 0
    n_ck = -(-m.n_layer // every) if mode else 0  # blocks 0, every, 2 every, ... are checkpointed
    if mode == "block":  # the block's input only
        kept, redo = res * m.n_embd, full
    elif mode in ("attn", "mlp"):  # the module's input (its norm's output) instead of its internals
        part = block_bytes(cfg, tp, compute, mode, fused_norm)
        kept, redo = full - part + norm + res * m.n_embd, part - norm
    else:
        kept, redo = full, 0
    if mode and cfg.offload_activations:  # each part's input waits on the host: in backward
        kept, redo = kept - res * m.n_embd, redo + 2 * res * m.n_embd  # its own is back and the next one's coming
    final = norm + (2 * m.n_embd if compute == 2 else 0)  # norm_f, the head's input
    saved = tokens * ((m.n_layer - n_ck) * full + n_ck * kept + final + extra)
    if cfg.lora_r and mode != "block":  # a frozen embedding: the first norm's input needs no gradient, nothing kept
        saved -= tokens * norm
    # a recomputed block's internals stay while its MLP's tiles are rebuilt; an attention's come after them
    return saved, (tokens * redo + tile if mode == "block" else max(tokens * redo, tile))
def offloaded_bytes(cfg, tokens):
    """Pinned host bytes of the inputs offload_activations keeps there (0 without it)."""
    m = ModelConfig.from_cfg(cfg)
    mode, every = recompute_of(cfg)
    if not (mode and cfg.offload_activations):
        return 0
    res = stream_bytes(cfg, compute_bytes(cfg))
    return tokens * -(-m.n_layer // every) * res * m.n_embd


def logits_bytes(cfg, tokens, tp=1, compute=2, head_trains=True, buckets=False):
    """The loss's peak in backward: logits kept for backward and their gradient (or one chunk of them),
    and the head weight's gradient being made (buckets: DataParallel already holds its fp32 .grad)."""
    m = ModelConfig.from_cfg(cfg)
    Vp, V, C = m.padded_vocab // tp, -(-m.vocab_size // tp), m.n_embd
    chunk = cfg.loss_chunk
    if chunk:  # one chunk's logits and their gradient (fused.py's kernels on a GPU), the fp32 lse; chunked.py's
        # backward: the (fp32) head in the compute dtype, dW (fp32) and one chunk's dW in the compute dtype
        w = (compute * (compute == 2) + compute + 4) * C * Vp if head_trains else 0
        return min(chunk, tokens) * Vp * 2 * compute + 4 * tokens + w
    dw = (compute + (0 if buckets else 4)) * C * Vp if head_trains else 0  # dW in the compute dtype (+ the fp32 .grad)
    if tp > 1:  # tp.py's vocab-parallel loss: the local logits, an fp32 softmax saved, the gradient
        return tokens * (compute * Vp + 4 * Vp + compute * Vp) + dw
    # one phase at a time: the logits (kept for backward) and their gradient (fused.py); the gradient and the
    # head's dW in the compute dtype (the logits freed); dW and its fp32 cast (the gradient freed)
    return max(tokens * (compute * Vp + compute * V), tokens * compute * V + compute * C * Vp * head_trains, dw)


# ----------------------------------------------------------------------------- the plan

def predict(cfg, world=1, decode=None):
    """The per-GPU memory table for cfg on `world` GPUs (dp = world / tp). decode: (rows, length) of
    a KV cache (GRPO rollouts, generation) to add. -> {"rows": [(term, bytes, note)], "total",
    "host", "fits"(None)}."""
    tp = cfg.tp
    dp = max(1, world // tp)
    fsdp = cfg.data_parallel == "fsdp" and dp > 1
    zero1 = cfg.zero1 and dp > 1 and not fsdp
    n = count(cfg)
    a = compute_bytes(cfg)
    T = cfg.seq_len or cfg.block_size
    tokens = cfg.micro_batch_size * T
    kind = cfg.adamw_state
    shard = dp if fsdp else 1
    trained, frozen = n["trained"] / (tp if not cfg.lora_r else 1), n["frozen"] / tp
    rows = []
    # weights
    if cfg.lora_r:
        base = cfg.lora_base_dtype
        other = frozen - n["base_linear"] / tp
        fbytes = (n["nf4_bytes"] / tp + 2 * other / shard) if base == "nf4" else \
            frozen * (2 if base == "bfloat16" else 4) / shard
        m = ModelConfig.from_cfg(cfg)
        embed = m.padded_vocab * m.n_embd * (4 if base == "float32" else 2) if cfg.embed_on_host else 0
        rows.append(("weights", 4 * trained / shard + fbytes - embed,
                     f"{n['trained'] / 1e6:.1f}M trained (fp32) + {n['frozen'] / 1e9:.2f}B frozen ({base})"
                     + (", the token embedding on the host" if embed else "")))
    else:
        rows.append(("weights", 4 * trained / shard, f"{n['trained'] / 1e9:.2f}B parameters, fp32"
                     + (f", 1/{dp} each (FSDP)" if fsdp else "")))
    # bf16 compute copies of fp32 matrices (autocast: kept for backward), or FSDP's gathered units
    fp32_mats = n["matrices"] / tp if not cfg.lora_r or cfg.lora_base_dtype == "float32" else 0
    redo_copies = 0  # the copies of the part recomputed in backward
    if a == 2 and fsdp:
        copies, note = 2 * (2 * n["unit"] + n["root"]) / tp, "FSDP: two blocks and the root gathered in 16 bits"
    elif a == 2 and fp32_mats:  # a recomputed part's copies are made again in backward, one part at a time
        mode, every = recompute_of(cfg)
        part = n[f"{mode}_matrices"] / tp if mode else 0
        redo_copies = 2 * part
        head = n["head_matrix"] / tp if cfg.loss_chunk else 0  # chunked.py casts the head itself (logits_bytes)
        copies = 2 * (fp32_mats - head - -(-ModelConfig.from_cfg(cfg).n_layer // every) * part)
        note = "autocast's 16-bit copy of every fp32 matrix, kept for backward" + (
            f" (not those of the recomputed {mode}s)" if mode else "")
    elif cfg.lora_r and cfg.lora_base_dtype == "nf4":
        copies, note = 8 * n["largest_base"] / tp, "one NF4 weight dequantised at a time (fp32 values, index, bf16)"
    else:
        copies, note = 0, "none (weights already in the compute dtype)"
    rows.append(("compute copies", copies, note))
    # gradients
    if fsdp:
        grads, gnote = 4 * trained / dp + (4 + a) * n["unit"] / tp, f"fp32 shards (1/{dp}) + one block's full gradient"
    elif cfg.optimizer_in_backward:  # each gradient used and freed as it arrives: the largest one at a time
        grads, gnote = 4 * n["largest_trained"], "updated in backward: one gradient at a time (the largest, fp32)"
    else:
        grads, gnote = 4 * trained, "fp32" + (" (DataParallel's buckets stay full size under ZeRO-1)" if zero1 else "")
    rows.append(("gradients", grads, gnote))
    # optimizer state
    per = optim_memory.bytes_per_param(kind)
    if cfg.optimizer == "muon" and not cfg.lora_r:
        muon = n["muon"] / tp
        opt = 4 * muon + per * (trained - muon)
        onote = f"Muon momentum (4 B) on {muon / 1e9:.2f}B, AdamW ({kind}) on the rest"
    else:
        opt, onote = per * trained, f"AdamW, {kind}: {per:.2f} B per trained parameter"
    if fsdp or zero1:
        opt, onote = opt / dp, onote + f", 1/{dp} each ({'FSDP' if fsdp else 'ZeRO-1'})"
    rows.append(("optimizer state", opt, onote))
    # activations, logits, cache
    saved, redo = activations(cfg, tokens, tp, a)
    redo += redo_copies
    mode, every = recompute_of(cfg)
    rows.append(("activations", saved, f"{tokens} tokens x {ModelConfig.from_cfg(cfg).n_layer} blocks, "
                 + (f"checkpointed: {mode}, every {every}" if mode else "no checkpointing")))
    head_trains = not cfg.lora_r
    logit = logits_bytes(cfg, tokens, tp, a, head_trains, buckets=dp > 1 or fsdp)
    rows.append(("logits", logit, f"chunked, {cfg.loss_chunk} tokens at a time" if cfg.loss_chunk
                 else "materialised: the head's output and its gradient"))
    if redo:
        rows.append(("recompute", redo, "one checkpointed part rebuilt in backward (when the logits are gone)"))
    m = ModelConfig.from_cfg(cfg)
    # a block's backward: the gradients of its attention's internals, flash's fp32 dq and the stream's gradient,
    # beside what it rebuilt (measured: 8B LoRA at 32k-131k tokens, BENCHMARKS.md); an NF4 base then holds one
    # dequantised bf16 weight, not the forward's dequantisation buffers
    attn = block_bytes(cfg, tp, a, "attn")
    flight = tokens * (attn + 4 * max(1, m.n_head // tp) * m.head_dim + stream_bytes(cfg, a) * m.n_embd)
    if mode == "block":  # by the attention's backward the rebuilt block's MLP part is freed: its attention is left
        res = stream_bytes(cfg, a)
        redo_attn = tokens * (attn + (2 * res * m.n_embd if cfg.offload_activations else 0)) + redo_copies
    else:
        redo_attn = redo
    rows.append(("backward", flight, "a block's gradients in flight (its attention's, flash's fp32 dq, the stream's)"))
    bwd_copies = 2 * n["largest_base"] / tp if cfg.lora_r and cfg.lora_base_dtype == "nf4" else copies
    if decode:
        rows.append(("kv cache", 2 * m.n_layer * max(1, m.kv_heads // tp) * m.head_dim * 2 * decode[0] * decode[1],
                     f"{decode[0]} rows x {decode[1]} positions, bf16"))
    tied = 4 * m.padded_vocab * m.n_embd / tp if m.tie_embeddings and head_trains and not fsdp else 0
    if tied:
        rows.append(("embedding grad", tied, "the tied embedding's lookup gradient, made while the head's is held"))
    step_tmp = 0
    if cfg.optimizer == "muon" and not cfg.lora_r:  # the updates (fp32), Newton-Schulz's largest batch twice (bf16)
        step_tmp = (4 * n["muon"] / tp + 2 * 2 * n["muon_batch"]) / (dp if zero1 else 1)
        rows.append(("optimizer step", step_tmp, "Muon's updates (fp32) and its largest Newton-Schulz batch, twice in bf16"))
    cache = sum(b for name, b, _ in rows if name == "kv cache")
    static = sum(b for name, b, _ in rows if name in ("weights", "optimizer state")) + cache
    end = grads + max(tied, step_tmp)  # the end of backward, the optimizer step: activations and copies freed
    held = grads if dp > 1 or fsdp or cfg.optimizer_in_backward else 0  # buckets, shards, or the one being used
    # (one process: gradients appear as backward frees the activations)
    # an MLP's backward: the gradients of its hidden activations beside its internals, 2 x T x ffn in the compute
    # dtype (the down projection's input gradient, then gate's and up's; measured on CPU: 1.5 (NF4) to 2.0 of it),
    # one tile's with mlp_tile
    mlp_grads = 2 * a * (m.hidden // tp) * (min(cfg.mlp_tile, tokens) if cfg.mlp_tile else tokens)
    rows.append(("mlp backward", mlp_grads, "an MLP's hidden gradients in flight (one tile's with mlp_tile)"))
    peak = static + held + max(copies + saved + logit, bwd_copies + saved + redo + mlp_grads,
                               bwd_copies + saved + redo_attn + flight,
                               end - held)
    host = ((4 + 8 + 4) * trained if kind == "offload" else 0) + offloaded_bytes(cfg, tokens) + \
        (embed if cfg.lora_r else 0)
    return {"rows": rows, "total": peak, "host": host, "world": world, "dp": dp, "tp": tp}


def show(table, gpu_gb=None):
    """The table as lines of text (GiB)."""
    out = [f"memory plan per GPU ({table['world']} GPU{'s' if table['world'] > 1 else ''}, dp {table['dp']} x "
           f"tp {table['tp']}; predicted max_memory_allocated of a step, CUDA context not included)"]
    out += [f"  {name:<16} {b / GiB:8.2f} GiB  {note}" for name, b, note in table["rows"]]
    out.append(f"  {'peak':<16} {table['total'] / GiB:8.2f} GiB  weights, copies, state, gradients + the larger "
               f"of the loss and a recompute on top of the activations"
               + (f"  [{'fits' if fits(table, gpu_gb) else 'does NOT fit'} {gpu_gb:g} GiB, {SPARE:.0%} kept spare]"
                  if gpu_gb else ""))
    if table["host"]:
        out.append(f"  {'host (pinned)':<16} {table['host'] / GiB:8.2f} GiB  offloaded master, state and gradients")
    return out


# ----------------------------------------------------------------------------- what makes it fit

def _set(**kw):
    def change(cfg):
        c = copy.copy(cfg)
        for k, v in kw.items():
            setattr(c, k, v)
        return c
    return change


def fits(table, gpu_gb):
    """Does predict()'s table fit GPUs of gpu_gb GiB, SPARE of them kept free?"""
    return table["total"] <= (1 - SPARE) * gpu_gb * GiB


def longest(cfg, gpu_gb, world=1):
    """The longest row (tokens, a multiple of 1024) of micro_batch_size 1 whose plan fits gpu_gb GiB (0: none)."""
    def ok(t):
        c = copy.copy(cfg)
        c.micro_batch_size, c.block_size, c.seq_len = 1, t, 0
        return fits(predict(c, world), gpu_gb)
    lo, hi = 0, 1024
    while ok(hi) and hi < 2 ** 24:
        lo, hi = hi, 2 * hi
    while hi - lo > 1024:
        mid = (lo + hi) // 2 // 1024 * 1024
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo


def _halve_batch(cfg):
    c = copy.copy(cfg)
    c.micro_batch_size = max(1, cfg.micro_batch_size // 2)
    return c


# (knob, applies to cfg, change): cheapest in speed first
LADDER = [
    ("loss_chunk=1024 (chunked loss, no logits)", lambda c, w: not c.loss_chunk, _set(loss_chunk=1024)),
    ("lora_base_dtype=bfloat16", lambda c, w: c.lora_r and c.lora_base_dtype == "float32", _set(lora_base_dtype="bfloat16")),
    ("data_parallel=fsdp", lambda c, w: w // c.tp > 1 and c.data_parallel != "fsdp" and not c.zero1,
     _set(data_parallel="fsdp")),
    ("recompute=mlp (recompute the MLPs)", lambda c, w: not c.grad_checkpoint and not c.recompute,
     _set(recompute="mlp", recompute_every=1)),
    ("fp32_residual=False (checkpointed inputs in bf16)", lambda c, w: c.fp32_residual and c.dtype != "float32",
     _set(fp32_residual=False)),
    ("recompute=block (whole blocks, not only MLPs)", lambda c, w: not c.grad_checkpoint
     and c.recompute != "block", _set(recompute="block", recompute_every=1)),
    ("offload_activations=True (block inputs in host memory)", lambda c, w: (c.grad_checkpoint or c.recompute)
     and not c.offload_activations, _set(offload_activations=True)),
    ("mlp_tile=4096 (MLPs over tiles of 4096 tokens)", lambda c, w: not c.mlp_tile and not c.n_experts
     and c.micro_batch_size * (c.seq_len or c.block_size) > 4096, lambda c: _set(
        mlp_tile=4096, recompute="" if c.recompute == "mlp" else c.recompute)(c)),
    ("embed_on_host=True (the frozen token embedding in host memory)", lambda c, w: c.lora_r and not c.embed_on_host
     and not c.tie_embeddings and c.tp == 1 and c.pp == 1 and c.data_parallel == "ddp", _set(embed_on_host=True)),
    ("optimizer_in_backward=True, grad_clip=0 (each update in backward, no clipping)", lambda c, w: w == 1
     and not c.optimizer_in_backward and c.optimizer == "adamw" and c.adamw_state == "fp32" and not c.lora_r
     and c.batch_size <= c.micro_batch_size, _set(optimizer_in_backward=True, grad_clip=0.0)),
    ("adamw_state=8bit", lambda c, w: not c.lora_r and c.adamw_state == "fp32", _set(adamw_state="8bit")),
    ("micro_batch_size halved (more accumulation steps)", lambda c, w: c.micro_batch_size > 1, _halve_batch),
    ("lora_base_dtype=nf4 (QLoRA)", lambda c, w: c.lora_r and c.lora_base_dtype != "nf4", _set(lora_base_dtype="nf4")),
    ("adamw_state=offload (update on the CPU)", lambda c, w: not c.lora_r and c.adamw_state != "offload",
     _set(adamw_state="offload")),
]


def fit(cfg, gpu_gb, world=1, decode=None):
    """[(knob, cfg after it, its table)] in LADDER's order until the plan fits gpu_gb GiB ([] if it
    fits already; the last table says whether it fits in the end). A knob that does not lower the
    peak is skipped; micro_batch_size may be halved several times."""
    steps, cur = [], predict(cfg, world, decode)
    for knob, applies, change in LADDER:
        while not fits(cur, gpu_gb) and applies(cfg, world):
            new_cfg = change(cfg)
            new = predict(new_cfg, world, decode)
            if new["total"] >= cur["total"]:
                break
            cfg, cur = new_cfg, new
            steps.append((knob, cfg, cur))
            if "halved" not in knob:
                break
    return steps


def advice(cfg, world=1, gpu_gb=0.0, decode=None):
    """Lines to print: the table for cfg on `world` GPUs and, when gpu_gb is given and the plan does
    not fit it, fit()'s knobs in their order, each with the peak it leads to (and what to try when
    even the last does not fit). A mixture-of-experts model: config.UserError (not modelled)."""
    try:
        table = predict(cfg, world, decode)
    except NotImplementedError as e:
        raise config.UserError(f"gpu_memory: {e}; drop --gpu_memory") from e
    out, steps = show(table, gpu_gb or None), []
    if gpu_gb and not fits(table, gpu_gb):
        steps = fit(cfg, gpu_gb, world, decode)
        out.append(f"to fit {gpu_gb:g} GiB, in order of expected cost in speed:")
        out += [f"  + {knob:<50} -> {t['total'] / GiB:6.2f} GiB" for knob, _, t in steps]
        if not steps or not fits(steps[-1][2], gpu_gb):
            out.append("  still too large: more GPUs (data_parallel=fsdp, tp), a shorter seq_len, or a smaller model")
        if steps:  # the keys as they end up (a later knob may replace an earlier one's value)
            last = vars(steps[-1][1])
            out.append("  run with: " + " ".join(f"--{k}={v}" for k, v in last.items() if vars(cfg).get(k) != v))
    if gpu_gb:
        final = steps[-1][1] if steps else cfg
        more = [k for k, unset in (("recompute=block", final.recompute != "block" and not final.grad_checkpoint),
                                   ("offload_activations=True", not final.offload_activations),
                                   ("mlp_tile=4096", not final.mlp_tile and not final.n_experts),
                                   ("lora_base_dtype=nf4", final.lora_r and final.lora_base_dtype != "nf4")) if unset]
        out.append(f"longest row of one sequence that fits {gpu_gb:g} GiB with these keys: {longest(final, gpu_gb, world):,} "
                   "tokens" + (f" (longer: {', '.join(more)})" if more else ""))
    return out


def main(argv):
    """python plan.py [--stage=sft] config.py [--key=value ...] [--gpu_memory=24] [--world=2]: the plan for
    `world` GPUs without starting them (a stage's own --gpu_memory plans for the world it runs in)."""
    import importlib
    stage = next((a.split("=", 1)[1] for a in argv if a.startswith("--stage=")), "pretrain")
    argv = [a for a in argv if not a.startswith("--stage=")]
    module = importlib.import_module(stage)
    extra = config.Keys(getattr(module, "EXTRA", {}),  # with the stage's checks
                        dict(gpu_memory=24.0, world=1, decode_rows=0, decode_len=0))
    cfg = config.load(argv, extra=extra, world=1, plugins=getattr(module, "FAMILY_KEYS", None))
    try:
        weights.configure(cfg)
    except config.MissingFileError as e:  # planning for a machine the base model is not on (yet)
        print(f"note: {e}; planned with the config's own model keys (n_layer={cfg.n_layer}, n_embd={cfg.n_embd}, "
              f"vocab_size={cfg.vocab_size}, ...)")
    decode = (cfg.decode_rows, cfg.decode_len) if cfg.decode_rows else None
    print("\n".join(advice(cfg, cfg.world, cfg.gpu_memory, decode)))


if __name__ == "__main__":
    config.cli(main, sys.argv[1:])
