"""LoRA adapters (Hu et al., 2021) on the Transformer's linears, exact under tensor parallelism;
merge and unmerge; adapters switched off for a block (disabled()); adapters saved and loaded in
PEFT's format.

    cfg.lora_r = 16                                   # parallel.parallelize then calls apply(): base
    net = parallel.parallelize(model, grid, cfg, load=weights.loader(cfg, grid))  # frozen, adapters train
    state = lora.gather(net.raw, grid, net.wrapper)    # {our name: full adapter tensor}, any layout
    lora.save_peft(out_dir, state, cfg)               # adapter_model.safetensors + adapter_config.json
    lora.load_peft(path, net.raw, grid, net.wrapper)   # a PEFT adapter into the adapters (any layout)
    weights = lora.merge_weights(full_weights, cfg)   # Net.full_state's weights -> plain model's, merged
    with lora.disabled(net.raw): ref = net(x, y)       # the frozen base alone (dpo.py's reference, no copy)
    lora.train_tokens(model, [4096, 4097], grid)      # those tokens' embedding / head rows train too (TokenRows)

Where each part is explained: y = x W^T + b + scale * B A dropout(x) per HF module on our fused
linears, in LoRALinear; why its gradients are exact under tensor parallelism, in
LoRALinear.forward; which modules are adapted (lora_targets), in targets; initialisation, the
frozen base and its dtype, in apply.

Invariants: a fresh adapter changes nothing (B = 0); adapters match PEFT's module for module
(names, initialisation, scale, saved format), so each loads what the other saves; in every layout
the adapters' gradients are the one-process ones, and replicated adapters stay identical on every
rank; the base is frozen, so the optimizer holds adapters only.
"""
import contextlib
import json
import math
import os
import re

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from config import need
from model import ModelConfig
from parallelism import fsdp, tp

# LoRA's config keys: lora_r > 0 freezes the base and trains rank-r adapters
LORA_DEFAULTS = dict(
    lora_r=0,                # adapter rank (0: no LoRA)
    lora_alpha=16.0,         # adapter scale alpha / r
    lora_dropout=0.0,        # dropout on the adapters' input
    lora_targets="all-linear",  # "all-linear" (attention + MLP) or HF module names: "q_proj,v_proj" (GPT-2: c_attn, ...)
    lora_rslora=False,       # scale alpha / sqrt(r) instead of alpha / r
    lora_base_dtype="float32",  # float32 | bfloat16 | nf4: the frozen base's storage (bf16 needs bf16 autocast;
                                # nf4: 4-bit QLoRA, qlora.py, computed in bf16 or fp16)
    lora_train_tokens=True,  # LoRA: the embedding/head rows of tokens added to init_from's vocabulary (the chat template's) train too, as PEFT's trainable_token_indices
)


def check(cfg, world=1):
    """LoRA's keys, and the optimizer it trains with."""
    need(cfg.lora_r >= 0, f"lora_r={cfg.lora_r} must be >= 0 (0: no LoRA)")
    need(cfg.lora_alpha > 0 and 0 <= cfg.lora_dropout < 1,
         f"lora_alpha={cfg.lora_alpha} must be > 0 and lora_dropout={cfg.lora_dropout} in [0, 1)")
    need(cfg.lora_base_dtype in ("float32", "bfloat16", "nf4"),
         f"lora_base_dtype='{cfg.lora_base_dtype}' must be float32, bfloat16 or nf4")
    need(not cfg.lora_r or (cfg.optimizer == "adamw" and not cfg.zero1),
         "LoRA trains with AdamW, without zero1 (Muon is for full hidden matrices; the adapters' state is small): "
         "set optimizer='adamw', zero1=False")


# our linear -> the HF modules its output rows are made of, in order (LLaMA family / GPT-2 / MPT)
HF_MODULES = {
    "llama": {"attn.qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
              "attn.proj": ("self_attn.o_proj",), "mlp.fc": ("mlp.gate_proj", "mlp.up_proj"),
              "mlp.proj": ("mlp.down_proj",)},
    "gpt2": {"attn.qkv": ("attn.c_attn",), "attn.proj": ("attn.c_proj",), "mlp.fc": ("mlp.c_fc",),
             "mlp.proj": ("mlp.c_proj",)},
    "mpt": {"attn.qkv": ("attn.Wqkv",), "attn.proj": ("attn.out_proj",), "mlp.fc": ("ffn.up_proj",),
            "mlp.proj": ("ffn.down_proj",)},
}
BLOCK_PREFIX = {"llama": "model.layers.{}.", "gpt2": "transformer.h.{}.", "mpt": "transformer.blocks.{}."}
PEFT_PREFIX = "base_model.model."
ADAPTER = re.compile(r"blocks\.(\d+)\.(attn\.qkv|attn\.proj|mlp\.fc|mlp\.proj)\.lora_([AB])\.(\w+)$")
TOKENS = re.compile(r"^(tok_emb|head)\.lora_tokens\.(rows|ids)$")  # train_tokens' rows and their token ids
TOKEN_MODULES = {"llama": {"tok_emb": "model.embed_tokens", "head": "lm_head"},  # their HF modules
                 "gpt2": {"tok_emb": "transformer.wte", "head": "lm_head"}}
KEYS = ("lora_r", "lora_alpha", "lora_dropout", "lora_targets", "lora_rslora")


def is_adapter(name):
    """A LoRA adapter's or train_tokens' tensor (what trains, what save_peft writes)."""
    return ADAPTER.search(name) is not None or TOKENS.search(name) is not None


def segments(mcfg, linear):
    """[(HF module path, full output rows)] of our linear ("attn.qkv", ...), in row order."""
    C, hq, hkv = mcfg.n_embd, mcfg.n_head * mcfg.head_dim, mcfg.kv_heads * mcfg.head_dim
    fam = mcfg.family
    if linear == "attn.qkv":
        rows = [hq, hkv, hkv] if fam == "llama" else [hq + 2 * hkv]
    elif linear == "mlp.fc":
        if fam == "llama" and not mcfg.gated:
            return [("mlp.up_proj", mcfg.hidden)]
        rows = [mcfg.hidden] * (2 if fam == "llama" else 1)
    else:
        rows = [C]
    return list(zip(HF_MODULES[fam][linear], rows))


def scale_of(cfg):
    return cfg.lora_alpha / (math.sqrt(cfg.lora_r) if cfg.lora_rslora else cfg.lora_r)


def targets(spec, fam):
    """cfg.lora_targets -> the set of HF module names adapted (None: all of them). "all-linear"
    (PEFT's meaning: every attention and MLP linear, not the head) or HF module names, comma
    separated (e.g. "q_proj,v_proj"; GPT-2: c_attn, c_proj, c_fc)."""
    valid = sorted({p.rsplit(".", 1)[1] for mods in HF_MODULES[fam].values() for p in mods})
    if spec == "all-linear":
        return None
    names = {s.strip() for s in spec.split(",") if s.strip()}
    bad = sorted(names - set(valid))
    if bad or not names:
        raise ValueError(f"lora_targets={spec!r}: unknown module names {bad} for a {fam}-style model; "
                         f"use 'all-linear' or a comma-separated subset of {', '.join(valid)}")
    return names


# ----------------------------------------------------------------------------- the adapted linear

def block_b(Bs, rows, dtype, device):
    """The block-diagonal B of a fused linear: Bs {key: (rows_k, r)} placed at their rows
    [(key, n)] (in output order), zero rows for modules without an adapter."""
    return torch.block_diag(*[Bs[k] if k in Bs else torch.zeros(n, 0, dtype=dtype, device=device)
                              for k, n in rows])


class LoRALinear(nn.Module):
    """A frozen base linear (nn.Linear, tp.ColumnParallelLinear or tp.RowParallelLinear) plus
    adapters lora_A[key], lora_B[key] per adapted HF module. Holds the base's weight and bias
    under their old names, so parameter names, checkpoints and HF loading are unchanged.

    y = x W^T + b + scale * B A dropout(x), A (r x in) and B (out x r) per HF module, scale =
    alpha / r (rsLoRA: alpha / sqrt(r)). Our linears are fused where HF's are not: attn.qkv holds
    [q | k | v] rows and a gated mlp.fc [gate | up]. Each of those HF modules gets its own A and B,
    exactly as PEFT adapting LLaMA's q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj:
    the fused linear computes h = dropout(x) [A_q; A_k; A_v]^T (one matmul) and adds h times the
    block-diagonal [B_q, B_k, B_v] (block_b: zero blocks where a module is not targeted). GPT-2's
    c_attn, c_fc, c_proj are single HF modules (Conv1D; PEFT's fan_in_fan_out): one A and B each.
    One dropout mask serves the segments of a fused linear (PEFT draws one per module: the same
    distribution). merge()/unmerge() add / subtract scale B A in place (plain or TP model: each rank
    its own slices); merge_weights() does it on full tensors from any layout."""

    def __init__(self, base, segs, wanted, r, scale, dropout, gen, grid):
        super().__init__()
        self.weight, self.bias = base.weight, base.bias
        self.row = isinstance(base, tp.RowParallelLinear)
        self.group = getattr(base, "group", None)
        self.scale, self.merged, self.disabled = scale, False, False
        self.drop = nn.Dropout(dropout)
        self.lora_A, self.lora_B = nn.ParameterDict(), nn.ParameterDict()
        cut = grid.tp > 1 and hasattr(base.weight, "tp_split")
        in_full = base.weight.shape[1] * (grid.tp if cut and self.row else 1)
        layout = list(base.weight.tp_split[1]) if cut and not self.row else None
        self.rows = []  # (key, local rows) in output order
        for path, n in segs:
            key = path.rsplit(".", 1)[1]
            sub = []  # the base's TP segments inside this module's rows (a column-parallel base)
            while layout and sum(s for s, _ in sub) < n:
                sub.append(layout.pop(0))
            self.rows.append((key, sum(s // c for s, c in sub) if sub else n))
            if key not in wanted:
                continue
            A = torch.empty(r, in_full)
            nn.init.kaiming_uniform_(A, a=math.sqrt(5), generator=gen)  # PEFT's (nn.Linear's) init
            A, B = nn.Parameter(A.to(base.weight.device)), nn.Parameter(torch.zeros(n, r, device=base.weight.device))
            if cut and self.row:
                A = tp.shard(A, grid, 1, [(in_full, grid.tp)])  # this rank's input columns, like the base
            elif cut:
                B = tp.shard(B, grid, 0, sub)  # this rank's output rows, like the base
            self.lora_A[key], self.lora_B[key] = A, B

    def b_matrix(self):
        B = self.lora_B[next(iter(self.lora_B))]
        return block_b(self.lora_B, self.rows, B.dtype, B.device)

    def delta(self):
        """scale * B A for this rank's slice of the weight (its rows or its columns)."""
        return self.b_matrix() @ torch.cat(list(self.lora_A.values())) * self.scale

    def base_forward(self, x):
        """The frozen base's output (qlora.QLoRALinear overrides it: a 4-bit weight)."""
        if self.row:  # tp.RowParallelLinear's forward (group None: one process)
            y = tp.Reduce.apply(F.linear(x, self.weight), self.group)
            return y if self.bias is None else y + self.bias
        return F.linear(tp.Copy.apply(x, self.group), self.weight, self.bias)  # tp.ColumnParallelLinear's (or nn.Linear's)

    def forward(self, x):
        """Tensor parallelism, and why the gradients are exact (tp.py's Copy: identity forward,
        all-reduce of the gradient backward; Reduce: all-reduce forward, identity backward):
        - column-parallel base (qkv, fc: rank t holds rows W_t): A is replicated, B cut by output
          rows exactly like the base (tp.shard with the base's segments, kv pieces shared by
          several ranks included). h = x A^T is computed on every rank, then goes through Copy
          before B_t. The loss depends on A through every rank's rows: dL/dh = sum_t dy_t B_t.
          Copy's backward is that sum, so dA = (sum_t dy_t B_t)^T x is complete and the same on
          every rank; dB_t = scale dy_t^T h needs only rank t's rows. (Without the Copy, rank t's dA
          would see only its own rows and the replicas of A would drift apart.) The Copy sits on h,
          not on x: x's gradient through A, (sum_t ...) A, is then already complete on every rank
          and is not summed a second time.
        - row-parallel base (attn.proj, mlp.proj: rank t holds input columns): A is cut by input
          columns like the base, B replicated. x_t A_t^T is a partial sum; Reduce completes
          h = x A^T before B, so every rank holds the same h and the same dy: dB = scale dy^T h is
          complete and identical; Reduce's backward hands dL/dh to every rank, dA_t = (dL/dh)^T x_t
          is this rank's columns of dA. (Adding B (x_t A_t^T) into the base's partial output before
          its all-reduce gives the right forward, but each rank's dB would hold its own partial
          sum only.)
        Cut parameters carry p.tp_split, so gradient norms, checkpoints and FSDP count them like
        any other; replicated ones get identical gradients on every rank (tests/test_lora.py checks
        bitwise)."""
        y = self.base_forward(x)
        if self.merged or self.disabled or not self.lora_A:
            return y
        h = F.linear(self.drop(x), torch.cat(list(self.lora_A.values())))  # (..., adapted modules * r)
        # row: complete the partial sums before the replicated B; column: B_t's rows on every rank
        # feed the gradient of the replicated A (the docstring above)
        h = (tp.Reduce if self.row else tp.Copy).apply(h, self.group)
        return y + F.linear(h, self.b_matrix()) * self.scale

    @torch.no_grad()
    def merge(self):
        if not self.merged:
            self.weight += self.delta().to(self.weight.dtype)
            self.merged = True

    @torch.no_grad()
    def unmerge(self):
        if self.merged:
            self.weight -= self.delta().to(self.weight.dtype)
            self.merged = False


def adapted(model):
    return [m for m in model.modules() if isinstance(m, LoRALinear)]


def merge(model):
    """Fold every adapter into its base weight, in place (a plain or TP model; under FSDP use
    merge_weights on gathered weights); trainable token rows replace the base's. The forward then
    skips the adapters."""
    for m in adapted(model) + token_rows(model):
        m.merge()


def unmerge(model):
    """Undo merge(): subtract the same scale * B A (equal up to rounding), restore the base's token rows."""
    for m in adapted(model) + token_rows(model):
        m.unmerge()


@contextlib.contextmanager
def disabled(model):
    """Inside the block every adapter is skipped: the model computes its frozen base alone (what
    PEFT's disable_adapter() gives). DPO's reference without a second copy of the model. Works in
    every layout (each rank skips the same adapters, so TP ranks skip the same collectives; FSDP
    still gathers the adapter shards, unused). Refused while merged: the base weights hold them."""
    mods = adapted(model) + token_rows(model)
    if any(m.merged for m in mods):
        raise ValueError("lora.disabled: the adapters are merged into the base weights; unmerge() first")
    for m in mods:
        m.disabled = True
    try:
        yield model
    finally:
        for m in mods:
            m.disabled = False


def apply(model, cfg, grid):
    """Freeze model and add adapters per cfg (lora_r, lora_alpha, lora_dropout, lora_targets,
    lora_rslora, lora_base_dtype), in place. Call after the TP cut and the initial weights, before
    the EP cut, FSDP / DataParallel and the optimizer (parallel.parallelize does). Returns model.
    Mixture-of-experts layers: attention is adapted, the MoE block (router, routed and shared
    experts) is not: it stays frozen (dense MLP layers of such a model are adapted). Embeddings,
    norms, head: frozen. Initialisation as PEFT's: A kaiming-uniform (a = sqrt 5), B zero, so a
    fresh adapter changes nothing; drawn from a generator seeded by cfg.seed, in model order, the
    same in every layout. The base is frozen (requires_grad False): DataParallel never reduces it,
    FSDP shards it in units of its own (fsdp.py), the optimizer holds adapters only.
    lora_base_dtype="bfloat16" stores every frozen tensor in bf16 (an 8B base in 16 GB); it needs
    bf16 autocast (dtype bfloat16, or auto on GPU). Adapters stay fp32."""
    if cfg.lora_base_dtype == "bfloat16" and (cfg.dtype == "float32" or (cfg.dtype == "auto" and grid.device.type != "cuda")):
        raise ValueError("lora_base_dtype='bfloat16' needs bf16 autocast: set dtype='bfloat16' (or 'auto' on a GPU), "
                         "or lora_base_dtype='float32'")
    if adapted(model):
        raise ValueError("lora.apply: this model already has LoRA adapters")
    mcfg = model.cfg
    fam = mcfg.family
    wanted = targets(cfg.lora_targets, fam)
    gen = torch.Generator().manual_seed(cfg.seed)
    model.requires_grad_(False)
    for t in token_rows(model):  # train_tokens before apply: its rows keep training, in fp32
        t.rows.requires_grad_(True)
    if cfg.lora_base_dtype == "bfloat16":
        for n, p in model.named_parameters():
            if p.is_floating_point() and not is_adapter(n):
                p.data = p.data.to(torch.bfloat16)
    for block in model.blocks:
        for linear in HF_MODULES[fam]:
            owner, attr = linear.split(".")
            parent = getattr(block, owner)
            if getattr(parent, "is_moe", False):
                continue  # MoE blocks stay frozen (the docstring)
            segs = segments(mcfg, linear)
            keys = {p.rsplit(".", 1)[1] for p, _ in segs}
            keys = keys if wanted is None else keys & wanted
            if keys:
                setattr(parent, attr, LoRALinear(getattr(parent, attr), segs, keys, cfg.lora_r, scale_of(cfg),
                                                 cfg.lora_dropout, gen, grid))
    if not adapted(model):
        raise ValueError(f"lora_targets={cfg.lora_targets!r} adapts nothing in this model (MoE layers are not "
                         f"adapted): target attention modules too")
    return model


# ----------------------------------------------------------------------------- trainable token rows

class TokenRows(nn.Module):
    """Trainable rows, for token ids `ids`, of a frozen vocabulary matrix `weight` (the embedding's,
    or an untied head's; this TP rank's vocabulary slice under TP). Its embed() / logits() are
    forward hooks of the embedding / head (train_tokens registers them).

    PEFT's trainable_token_indices: tokens just added to the vocabulary (a chat template's) have no
    trained rows, and adapters on the linears cannot give them any. The rows are fp32, replicated on
    every rank and start as the base's: the embedding's output at such a token is its row, the head's
    logit of such a token is x . its row (PEFT's index_copy semantics, so the base's rows never
    matter). Under TP only the rank owning a row's vocabulary slice uses it in the head; tp.Copy on
    the rows and on x sums the gradients over the ranks, so the replicas stay equal. Saved as PEFT
    saves them (token_adapter.trainable_tokens_delta, the ids in adapter_config.json)."""

    def __init__(self, ids, weight, grid):
        super().__init__()
        cut = grid.tp > 1 and hasattr(weight, "tp_split")
        n, device = weight.shape[0], weight.device
        lo = grid.tp_rank * n if cut else 0  # this rank's vocabulary rows [lo, lo + n)
        self.group = grid.tp_group if cut else None
        ids = torch.tensor(ids, dtype=torch.long, device=device)
        self.owned = torch.nonzero((ids >= lo) & (ids < lo + n)).flatten()  # which of ids this rank holds
        self.local = ids[self.owned] - lo                                   # their rows in `weight`
        rows = torch.zeros(len(ids), weight.shape[1], dtype=torch.float32, device=device)
        rows[self.owned] = weight.detach()[self.local].float()
        if cut:
            dist.all_reduce(rows, group=self.group)  # each row from its owner: the same rows on every rank
        self.register_buffer("ids", ids)  # persistent: checkpoints and save_peft know which tokens
        self.register_buffer("original", weight.detach()[self.local].clone(), persistent=False)  # for unmerge
        self.rows = nn.Parameter(rows)
        self.weight = [weight]  # a list: not registered again (the base's own module holds it)
        self.merged = self.disabled = False

    def embed(self, module, args, out):
        """The embedding's output with the rows of these tokens: out (..., C) at ids (..., )."""
        if self.merged or self.disabled:
            return out
        hit = args[0].unsqueeze(-1) == self.ids  # (..., k)
        return torch.where(hit.any(-1, keepdim=True), self.rows[hit.int().argmax(-1)].to(out.dtype), out)

    def logits(self, module, args, out):
        """The head's (local) logits with these tokens' columns x . rows: only the owner of a
        column computes it; Copy sums the gradients of x and of the replicated rows over TP ranks."""
        if self.merged or self.disabled:
            return out
        x, rows = tp.Copy.apply(args[0], self.group), tp.Copy.apply(self.rows, self.group)
        new = F.linear(x, rows[self.owned].to(x.dtype))
        return out.index_copy(-1, self.local, new.to(out.dtype))

    def head_weight(self, weight):
        """The head's (local) weight with these tokens' rows in it, for a loss that reads the weight
        instead of calling the head (chunked.py): a copy, whose gradient reaches the rows (summed
        over TP ranks by Copy, as in logits())."""
        if self.merged or self.disabled:
            return weight
        rows = tp.Copy.apply(self.rows, self.group)
        return weight.index_copy(0, self.local, rows[self.owned].to(weight.dtype))

    @torch.no_grad()
    def merge(self):
        if not self.merged:
            self.weight[0][self.local] = self.rows[self.owned].to(self.weight[0].dtype)
            self.merged = True

    @torch.no_grad()
    def unmerge(self):
        if self.merged:
            self.weight[0][self.local] = self.original
            self.merged = False


def token_rows(model):
    return [m for m in model.modules() if isinstance(m, TokenRows)]


def train_tokens(model, ids, grid, head=True):
    """Make the embedding and head rows of token `ids` trainable (PEFT's trainable_token_indices), in
    place: a TokenRows on tok_emb (and, head=True, one on an untied head), forward hooks. For LoRA runs:
    call on the TP-cut model once its weights are loaded, before or after apply(), before FSDP /
    DataParallel and the optimizer. Returns model."""
    ids = sorted({int(i) for i in ids})
    if not ids:
        return model
    bad = [i for i in ids if not 0 <= i < model.cfg.vocab_size]
    if bad:
        raise ValueError(f"lora.train_tokens: token ids {bad} are outside the vocabulary (vocab_size="
                         f"{model.cfg.vocab_size})")
    if token_rows(model):
        raise ValueError("lora.train_tokens: this model has trainable rows already")
    if any(getattr(m, "sequence_parallel", False) for m in (model.tok_emb, model.head)):
        raise ValueError("lora.train_tokens does not work with sequence_parallel=True")
    if model.tok_emb.weight.numel() == 0:
        raise ValueError("lora.train_tokens: the weights are sharded (FSDP) already: call it before FSDP")
    emb = TokenRows(ids, model.tok_emb.weight, grid)
    model.tok_emb.lora_tokens = emb
    model.tok_emb.register_forward_hook(emb.embed)
    if model.head.weight is model.tok_emb.weight:  # tied: the same rows score the tokens
        rows = emb
    elif head:  # untied: the head's rows of their own
        rows = model.head.lora_tokens = TokenRows(ids, model.head.weight, grid)
    else:
        return model
    model.head.register_forward_hook(rows.logits)
    model.head.token_rows_weight = rows.head_weight  # what chunked.head_loss multiplies by (a bound method)
    return model


# ----------------------------------------------------------------------------- full adapter tensors, any layout

def gather(model, grid, wrapper=None):
    """{our adapter name: full fp32 tensor on CPU}, from any layout. Collective: every rank calls it."""
    ids = {n: b.detach().cpu().clone() for n, b in model.named_buffers() if is_adapter(n)}  # train_tokens' ids
    if isinstance(wrapper, fsdp.FSDP):
        full = fsdp.gather_by_name(wrapper, lambda u: None if u.frozen else u.shard)
        return {**{k: v for k, v in full.items() if is_adapter(k)}, **ids}
    return {**{n: tp.full_tensor(p, p, grid).cpu() for n, p in model.named_parameters() if is_adapter(n)}, **ids}


@torch.no_grad()
def load(model, grid, state, wrapper=None, source="adapter state"):
    """Copy full adapter tensors (gather's output, saved by any layout) into this rank's adapters."""
    ids = {n: b for n, b in model.named_buffers() if is_adapter(n)}
    if isinstance(wrapper, fsdp.FSDP):
        units = [u for u in wrapper.units if any(is_adapter(names[0]) for names, _, _ in u.params)]
        have = [names[0] for u in units for names, _, _ in u.params]
    else:
        params = {n: p for n, p in model.named_parameters() if is_adapter(n)}
        have = list(params)
    missing, extra = sorted(set(have) - set(state)), sorted(set(state) - set(have) - set(ids))
    if missing or extra:
        raise ValueError(f"{source} does not fit this model's adapters (lora_targets / MoE layers / trainable "
                         f"tokens differ?): missing {missing[:6]}, not in the model {extra[:6]}")
    for n, b in ids.items():
        if n not in state or not torch.equal(state[n].to(b), b):
            raise ValueError(f"{source}: trainable token ids {state[n].tolist() if n in state else None} differ from "
                             f"this model's {b.tolist()} (lora.train_tokens)")
    if isinstance(wrapper, fsdp.FSDP):
        for u in units:
            u.drop()
            u.shard.copy_(fsdp.local_flat(wrapper, u, lambda names: fsdp.pick(state, names)))
        return
    for n, p in params.items():
        t = tp.local_tensor(p, state[n], grid)
        if t.shape != p.shape:
            raise ValueError(f"{source}: {n} has shape {tuple(state[n].shape)}: the rank differs (lora_r)?")
        p.copy_(t)


def merge_weights(weights, cfg):
    """Full weights of a LoRA model (parallel.Net.full_state's, any layout) -> the plain model's state:
    scale * B A added to each base weight, adapter tensors dropped. cfg: the run's flat config
    (model keys and lora_*). What checkpoint.save or hf.export_hf (after loading) writes."""
    out = {k: v for k, v in weights.items() if not is_adapter(k)}
    for m in ("tok_emb", "head"):  # train_tokens' rows replace the base's
        if f"{m}.lora_tokens.rows" in weights:
            W = out[f"{m}.weight"].clone()
            W[weights[f"{m}.lora_tokens.ids"].long()] = weights[f"{m}.lora_tokens.rows"].to(W.dtype)
            out[f"{m}.weight"] = W
            if m == "tok_emb" and cfg.tie_embeddings and "head.weight" in out:
                out["head.weight"] = W
    groups = {}
    for k in weights:
        m = ADAPTER.search(k)
        if m:
            groups.setdefault(f"blocks.{m[1]}.{m[2]}", set()).add(m[4])
    mcfg = ModelConfig.from_cfg(cfg)
    for prefix, keys in groups.items():
        rows = segments(mcfg, prefix.split(".", 2)[2])
        rows = [(p.rsplit(".", 1)[1], n) for p, n in rows]
        A = torch.cat([weights[f"{prefix}.lora_A.{k}"].float() for k, _ in rows if k in keys])
        B = block_b({k: weights[f"{prefix}.lora_B.{k}"].float() for k in keys}, rows, torch.float32, A.device)
        W = weights[f"{prefix}.weight"]
        out[f"{prefix}.weight"] = (W.float() + B @ A * scale_of(cfg)).to(W.dtype)
    return out


# ----------------------------------------------------------------------------- PEFT's format

def peft_name(name, mcfg):
    """blocks.3.attn.qkv.lora_A.q_proj -> base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight;
    tok_emb.lora_tokens.rows -> base_model.model.model.embed_tokens.token_adapter.trainable_tokens_delta"""
    fam = mcfg.family
    t = TOKENS.search(name)
    if t:
        return f"{PEFT_PREFIX}{TOKEN_MODULES[fam][t[1]]}.token_adapter.trainable_tokens_delta"
    m = ADAPTER.search(name)
    path = next(p for p in HF_MODULES[fam][m[2]] if p.rsplit(".", 1)[1] == m[4])
    return f"{PEFT_PREFIX}{BLOCK_PREFIX[fam].format(m[1])}{path}.lora_{m[3]}.weight"


def save_peft(out_dir, state, cfg, base_model_name_or_path=None, rank=0):
    """gather()'s adapters -> out_dir/adapter_model.safetensors + adapter_config.json (rank 0
    writes), loadable by peft.PeftModel.from_pretrained(transformers model, out_dir)."""
    if rank != 0:
        return None
    mcfg = ModelConfig.from_cfg(cfg)
    os.makedirs(out_dir, exist_ok=True)
    save_file({peft_name(k, mcfg): v.contiguous() for k, v in state.items() if not k.endswith(".lora_tokens.ids")},
              os.path.join(out_dir, "adapter_model.safetensors"), metadata={"format": "pt"})
    modules = sorted({ADAPTER.search(k)[4] for k in state if ADAPTER.search(k)})
    tokens = {TOKEN_MODULES[mcfg.family][m].rsplit(".", 1)[-1]: state[f"{m}.lora_tokens.ids"].tolist()
              for m in ("tok_emb", "head") if f"{m}.lora_tokens.ids" in state}
    if len(tokens) == 1:  # the embedding's rows only (a tied head follows them in PEFT): PEFT's list form
        tokens = next(iter(tokens.values()))
    conf = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": cfg.lora_r, "lora_alpha": cfg.lora_alpha,
            "lora_dropout": cfg.lora_dropout, "target_modules": modules, "use_rslora": cfg.lora_rslora,
            "bias": "none", "fan_in_fan_out": mcfg.family == "gpt2", "init_lora_weights": True,
            "inference_mode": True, "modules_to_save": None, "use_dora": False, "layers_to_transform": None,
            "rank_pattern": {}, "alpha_pattern": {}, "trainable_token_indices": tokens or None,
            "base_model_name_or_path": base_model_name_or_path if base_model_name_or_path is not None
            else (cfg.init_from or None)}
    with open(os.path.join(out_dir, "adapter_config.json"), "w") as f:
        json.dump(conf, f, indent=2)
    return out_dir


def peft_config(path):
    """adapter_config.json of a PEFT LoRA adapter -> {lora_r, lora_alpha, lora_dropout, lora_targets,
    lora_rslora}: set these on cfg before parallelize (apply), then load_peft. What we cannot
    reproduce raises, naming the field."""
    file = os.path.join(path, "adapter_config.json")
    if not os.path.isfile(file):
        raise FileNotFoundError(f"no adapter_config.json in '{path}': not a PEFT adapter folder")
    with open(file) as f:
        c = json.load(f)
    tm = c.get("target_modules")
    why = [w for bad, w in [
        (c.get("peft_type") != "LORA", f"peft_type={c.get('peft_type')!r} (only LORA)"),
        (c.get("bias", "none") != "none", f"bias={c.get('bias')!r} (only 'none')"),
        (c.get("use_dora"), "use_dora=true"), (c.get("modules_to_save"), f"modules_to_save={c.get('modules_to_save')}"),
        (c.get("layers_to_transform") is not None, "layers_to_transform"),
        (c.get("rank_pattern") or c.get("alpha_pattern"), "rank_pattern / alpha_pattern"),
        (isinstance(tm, str) and tm != "all-linear", f"target_modules={tm!r} (a regex; give a list of names)"),
        (isinstance(c.get("trainable_token_indices"), dict) and not set(c["trainable_token_indices"]) <= {
            "embed_tokens", "wte", "lm_head"}, f"trainable_token_indices={c.get('trainable_token_indices')}"),
    ] if bad]
    if why:
        raise ValueError(f"{file}: not supported by lora.py: {'; '.join(why)}")
    return {"lora_r": int(c["r"]), "lora_alpha": float(c["lora_alpha"]), "lora_dropout": float(c.get("lora_dropout", 0.0)),
            "lora_targets": tm if isinstance(tm, str) else ",".join(sorted(tm)),
            "lora_rslora": bool(c.get("use_rslora", False))}


def peft_tokens(path):
    """The trainable token ids of a PEFT adapter (adapter_config.json's trainable_token_indices) ->
    {"tok_emb": ids, "head": ids (an untied head's own)} ({} without): lora.train_tokens(model,
    ids["tok_emb"], grid, head="head" in ids) before load_peft."""
    with open(os.path.join(path, "adapter_config.json")) as f:
        t = json.load(f).get("trainable_token_indices")
    if not t:
        return {}
    if not isinstance(t, dict):
        return {"tok_emb": sorted(t)}
    out = {("head" if k == "lm_head" else "tok_emb"): sorted(v) for k, v in t.items()}
    if "tok_emb" not in out or out.get("head", out["tok_emb"]) != out["tok_emb"]:
        raise ValueError(f"{path}: trainable_token_indices {t}: lora.py trains the same tokens' rows in the "
                         "embedding and the head")
    return out


def load_peft(path, model, grid, wrapper=None):
    """A PEFT adapter folder into the adapters of a model built with its peft_config() (and
    train_tokens with its peft_tokens())."""
    file = os.path.join(path, "adapter_model.safetensors")
    if not os.path.isfile(file):
        raise FileNotFoundError(f"no adapter_model.safetensors in '{path}' (adapter_model.bin is not read)")
    conf = peft_config(path)
    want = conf["lora_alpha"] / (math.sqrt(conf["lora_r"]) if conf["lora_rslora"] else conf["lora_r"])
    for m in adapted(model):
        if abs(m.scale - want) > 1e-12 * want:
            raise ValueError(f"{path}: scale {want} (r, lora_alpha, use_rslora) differs from this model's {m.scale}: "
                             f"build the model with lora.peft_config('{path}')")
    names = [n for n, _ in model.named_parameters() if is_adapter(n)]
    if isinstance(wrapper, fsdp.FSDP):
        names = [ns[0] for u in wrapper.units for ns, _, _ in u.params if is_adapter(ns[0])]
    ours = {peft_name(n, model.cfg): n for n in names}
    saved = {re.sub(r"\.default(\.weight)$", r"\1", k): v for k, v in load_file(file).items()}
    state = {ours.get(k, k): v.float() for k, v in saved.items()}
    state.update({f"{m}.lora_tokens.ids": torch.tensor(ids) for m, ids in peft_tokens(path).items()})
    load(model, grid, state, wrapper, source=path)
