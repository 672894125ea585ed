"""plan.py's arithmetic against numbers worked by hand for a small model, and its activation formula
against the bytes autograd really keeps on CPU.

Proves:
- parameter counts, weights, bf16 compute copies (not those of recomputed parts), gradients (also updated in backward), AdamW /
  8-bit / offloaded state, activations per token and block, logits (materialised and chunked) and the
  peak of a small LLaMA-style model (C 64, 4 heads, 2 kv heads, hidden 192, 2 blocks, vocab 512, 2 x 32 tokens) equal the
  values written out term by term below, also for LoRA r=4 (adapters counted by hand; the embedding on the host), whole-block
  checkpointing (its inputs offloaded to the host too), FSDP over 2 GPUs, a KV cache, a tied embedding's
  lookup gradient and Muon's step (its updates and largest Newton-Schulz batch);
- measured (saved-tensor hooks, unique storages, bf16 autocast on CPU): the bytes a forward keeps
  for backward (activations + autocast's weight copies) are the plan's within 1% (full fine-tuning,
  whole-block checkpointing, LoRA, whose adapters' bf16 copies are not modelled); per token, exactly,
  under every recompute mode, a bf16 stream and a bf16 LoRA base; packed rows' attention (a mask: k and v
  repeated to every head, the mask's bias) per token exactly; an MLP's backward gradients (every storage the
  ops make, tracked) within -5% / +35% of the plan's row;
- fit() applies knobs in LADDER order, each lowering the peak, until the plan fits, and returns []
  when it already fits; show() prints every term and the verdict;
- `plan.py --stage=sft` plans from the config's model keys when init_from is not on disk (one note says so).
"""
import pytest
import torch
from distributed import train_cfg
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

import lora
import parallel
import plan
from memory import recompute
from model import ModelConfig, Transformer

TINY = dict(vocab_size=512, pad_vocab_multiple=64, n_layer=2, n_head=4, n_kv_head=2, n_embd=64, block_size=32,
            micro_batch_size=2, batch_size=2, dtype="bfloat16")
C, H, KV, D, F, L, V, TOK = 64, 4, 2, 16, 192, 2, 512, 64
# parameters: qkv (H + 2 KV) D x C, proj C x C, fc 2F x C, mlp.proj C x F, two norms of C, per block
BLOCK_MATS = (H + 2 * KV) * D * C + C * C + 2 * F * C + C * F
P = V * C + L * (BLOCK_MATS + 2 * C) + C + V * C  # embedding, blocks, final norm, untied head
# activations per token: attention (its norm: input fp32, rstd (CUDA's fused rms_norm); bf16 input;
# rotated q, k; v copied; logsumexp; output) and MLP (norm; two bf16 input casts; gate, silu, up, product)
NORM = 4 * C + 4
ATTN = NORM + 2 * C + 2 * (H + KV) * D + 2 * KV * D + 4 * H + 2 * H * D  # (v copied out of qkv's output)
MLP = NORM + 2 * 2 * C + 4 * 2 * F
FINAL = NORM + 2 * C  # the final norm and the head's bf16 input


def rows(cfg, world=1, decode=None):
    t = plan.predict(train_cfg(TINY, **cfg), world, decode)
    return {name: b for name, b, _ in t["rows"]}, t


def test_full_fine_tuning_by_hand():
    assert P == 164160 and ATTN == 788 and MLP == 2052  # the numbers themselves, once
    r, t = rows({})
    assert r["weights"] == 4 * P
    assert r["compute copies"] == 2 * (L * BLOCK_MATS + V * C)  # block matrices and the head, bf16
    assert r["gradients"] == 4 * P and r["optimizer state"] == 8 * P
    assert r["activations"] == TOK * (L * (ATTN + MLP) + FINAL)
    # the larger of: the head's bf16 output and its gradient; the gradient and the head weight's in bf16; that
    # and its fp32 .grad
    assert r["logits"] == max(TOK * (2 * V + 2 * V), TOK * 2 * V + 2 * C * V, (2 + 4) * C * V) == (2 + 4) * C * V
    # one process: gradients appear as backward frees activations and weight copies; the larger side
    static, copies = 4 * P + 8 * P, 2 * (L * BLOCK_MATS + V * C)
    assert t["total"] == static + max(copies + r["activations"] + r["logits"], 4 * P)
    r8, _ = rows(dict(adamw_state="8bit"))
    assert r8["optimizer state"] == pytest.approx(P * (2 + 8 / 256))
    ro, to = rows(dict(adamw_state="offload"))
    assert ro["optimizer state"] == 0 and to["host"] == 16 * P
    ri, ti = rows(dict(optimizer_in_backward=True, grad_clip=0.0))  # one gradient at a time: the largest, V x C
    assert ri["gradients"] == 4 * V * C and ti["total"] == static + copies + 4 * V * C + r["activations"] + r["logits"]


def test_tied_embedding_and_muon_step_by_hand():
    r, t = rows(dict(tie_embeddings=True, optimizer="muon"))
    Pt = P - V * C  # no separate head
    assert r["embedding grad"] == 4 * V * C  # the lookup's dense gradient, beside the head's in .grad
    # Muon's updates (fp32) of the block matrices, and its largest Newton-Schulz batch (bf16) twice: per block
    # gate, up (192 x 64, transposed) and mlp.proj (64 x 192): 3 matrices of 64 x 192
    assert r["optimizer step"] == 4 * L * BLOCK_MATS + 2 * 2 * L * 3 * 64 * 192
    assert r["optimizer state"] == 4 * L * BLOCK_MATS + 8 * (Pt - L * BLOCK_MATS)  # momentum; AdamW on the rest
    end = 4 * Pt + max(r["embedding grad"], r["optimizer step"])  # all gradients, then the step's temporaries
    during = r["compute copies"] + r["activations"] + r["logits"]
    assert t["total"] == r["weights"] + r["optimizer state"] + max(during, end) and end > during


def test_checkpointing_chunking_fsdp_cache_by_hand():
    r, t = rows(dict(grad_checkpoint=True))
    assert r["activations"] == TOK * (L * 4 * C + FINAL)  # each block keeps its fp32 input only
    # a recomputed block's bf16 weight copies are made again in backward, one block at a time: only the head's kept
    assert r["recompute"] == TOK * (ATTN + MLP) + 2 * BLOCK_MATS and r["compute copies"] == 2 * V * C
    r, t = rows(dict(grad_checkpoint=True, offload_activations=True))  # the inputs on the host, 2 back in backward
    assert r["activations"] == TOK * FINAL and r["recompute"] == TOK * (ATTN + MLP + 2 * 4 * C) + 2 * BLOCK_MATS
    assert t["host"] == TOK * L * 4 * C
    r, _ = rows(dict(recompute="mlp"))
    assert r["activations"] == TOK * (L * (ATTN + NORM + 4 * C) + FINAL)  # the MLP's norm and its input
    MLP_MATS = 2 * F * C + C * F
    assert r["recompute"] == TOK * (MLP - NORM) + 2 * MLP_MATS
    assert r["compute copies"] == 2 * (L * (BLOCK_MATS - MLP_MATS) + V * C)
    r, _ = rows(dict(loss_chunk=16))
    # one chunk and its gradient, lse; backward: the head in bf16, dW in fp32, a chunk's dW in bf16
    assert r["logits"] == 16 * V * 2 * 2 + 4 * TOK + (2 + 4 + 2) * C * V
    assert r["compute copies"] == 2 * L * BLOCK_MATS  # (the head's bf16 copy is chunked.py's own, in backward)
    r, t = rows(dict(data_parallel="fsdp"), world=2)
    unit, root = BLOCK_MATS + 2 * C, 2 * V * C + C
    assert r["weights"] == 4 * P / 2 and r["optimizer state"] == 8 * P / 2
    assert r["compute copies"] == 2 * (2 * unit + root)  # two blocks and the root gathered in bf16
    assert r["gradients"] == 4 * P / 2 + (4 + 2) * unit
    assert r["logits"] == max(TOK * (2 * V + 2 * V), TOK * 2 * V + 2 * C * V, 2 * C * V)  # (shards hold the fp32 part)
    assert t["total"] == sum(r[k] for k in ("weights", "compute copies", "gradients", "optimizer state",
                                            "activations")) + r["logits"]
    r, _ = rows({}, decode=(8, 32))
    assert r["kv cache"] == 2 * L * KV * D * 2 * 8 * 32
    # a block's backward: its attention's gradients, flash's fp32 dq, the (fp32) stream's gradient, beside the
    # recomputed block; the peak is the larger of that phase and the loss's (here the loss's)
    r, t = rows(dict(grad_checkpoint=True, loss_chunk=16))
    assert r["backward"] == TOK * (ATTN + 4 * H * D + 4 * C)
    static = r["weights"] + r["optimizer state"]
    assert t["total"] == static + max(r["compute copies"] + r["activations"] + r["logits"],
                                      r["compute copies"] + r["activations"] + r["recompute"] + r["backward"],
                                      r["gradients"])


def test_lora_by_hand():
    r, t = rows(dict(lora_r=4, lora_base_dtype="bfloat16"))
    # adapters per block: qkv A 3 x (4 x C), B (H D + 2 KV D) x 4; proj A 4 x C, B C x 4; fc A 2 x (4 x C),
    # B 2F x 4; mlp.proj A 4 x F, B C x 4
    adapters = L * (3 * 4 * C + (H + 2 * KV) * D * 4 + 4 * C + C * 4 + 2 * 4 * C + 2 * F * 4 + 4 * F + C * 4)
    assert adapters == 9728
    assert r["weights"] == 4 * adapters + 2 * P and r["gradients"] == 4 * adapters
    assert r["optimizer state"] == 8 * adapters and r["compute copies"] == 0
    norm = 2 * C  # a bf16 base makes the stream bf16: model.RMSNorm keeps its bf16 input only
    attn = norm + 2 * C + 2 * (H + KV) * D + 2 * KV * D + 4 * H + 2 * H * D + 2 * 4 * 4
    mlp = norm + 2 * C + 4 * 2 * F + 2 * 4 * 3
    # the token embedding is frozen: the first block's norm keeps nothing (its input needs no gradient)
    assert r["activations"] == TOK * (L * (attn + mlp) - norm + norm + 2 * C)
    re_, te = rows(dict(lora_r=4, lora_base_dtype="bfloat16", embed_on_host=True))  # the V x C bf16 table on the host
    assert re_["weights"] == r["weights"] - 2 * V * C and te["host"] == 2 * V * C
    assert te["total"] == t["total"] - 2 * V * C
    rq, _ = rows(dict(lora_r=4, lora_base_dtype="nf4"))
    # 4-bit base matrices: half a byte each + a byte per block of 64 + fp32 absmax per 256 blocks + offset
    nf4 = L * sum(n // 2 + n // 64 + 4 * -(-(n // 64) // 256) + 4 for n in ((H + 2 * KV) * D * C, C * C, 2 * F * C, C * F))
    assert rq["weights"] == 4 * adapters + nf4 + 2 * (P - L * BLOCK_MATS)  # the rest in bf16
    assert rq["compute copies"] == 8 * 2 * F * C  # the largest base matrix dequantised (fp32, index, bf16)


def measured(cfg, T=24, mask=False):
    """Bytes of the unique storages autograd saves in a bf16-autocast hidden_states forward (the
    embedding's int64 ids left out), parameters and buffers excluded; recompute.apply'd as cfg says.
    mask: packed rows' forward (a (2, T, T) causal mask and positions, as chat.batch gives)."""
    torch.manual_seed(0)
    model = Transformer(ModelConfig.from_cfg(cfg))
    if cfg.lora_r:
        lora.apply(model, cfg, parallel.init(cfg))
    recompute.apply(model, cfg.recompute, cfg.recompute_every, mlp_tile=cfg.mlp_tile)
    seen = {}

    def pack(t):
        st = t.untyped_storage()
        seen.setdefault(st.data_ptr(), st.nbytes() if t.dtype != torch.int64 else 0)
        return t
    own = {t.untyped_storage().data_ptr() for t in list(model.parameters()) + list(model.buffers())}
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.autocast("cpu", torch.bfloat16):
        kw = dict(attn_mask=torch.ones(2, T, T, dtype=torch.bool).tril(), pos=torch.arange(T).expand(2, T)) if mask \
            else {}
        model.hidden_states(torch.randint(0, 512, (2, T)), **kw)
    return sum(n for k, n in seen.items() if k not in own)


@pytest.mark.parametrize("kw", [{}, dict(grad_checkpoint=True), dict(lora_r=4)])
def test_activations_equal_measured(kw):
    cfg = train_cfg(TINY, **kw)
    tokens = 2 * 24  # (not 64 = C: no activation shaped like a weight)
    saved, _ = plan.activations(cfg, tokens, 1, 2, fused_norm=False)  # (a CPU's composite rms_norm)
    saved -= tokens * 2 * C  # hidden_states stops before the head's input cast
    r, _ = rows(kw)
    copies = r["compute copies"] - (0 if kw.get("grad_checkpoint") else 2 * V * C)  # no head here
    if kw.get("grad_checkpoint"):
        copies = 0  # checkpointed blocks keep no weight copies: recomputed in backward
    got = measured(cfg)
    adapters = 2 * plan.count(cfg)["trained"] if cfg.lora_r else 0  # their bf16 copies (not in the plan)
    assert abs(got - (saved + copies)) <= 0.01 * got + adapters, (got, saved + copies)


@pytest.mark.parametrize("kw", [dict(recompute="mlp"), dict(recompute="mlp", fp32_residual=False),
                                dict(grad_checkpoint=True, fp32_residual=False), dict(fp32_residual=False, lora_r=4),
                                *(dict(lora_r=4, lora_base_dtype="bfloat16", **k) for k in (
                                    {}, dict(fp32_residual=False), dict(recompute="mlp"), dict(recompute="attn"),
                                    dict(recompute="mlp", fp32_residual=False), dict(recompute="block"),
                                    dict(mlp_tile=8), dict(mlp_tile=8, recompute="attn"))), dict(mlp_tile=8),
                                *(dict(qk_norm=True, value_embeds=1, unet_skips=True, **k) for k in (  # speedrun's
                                    {}, dict(fp32_residual=False, activation="gelu"), dict(pos_emb="learned"),
                                    dict(grad_checkpoint=True), dict(recompute="attn"),
                                    dict(lora_r=4, lora_base_dtype="bfloat16")))])
def test_activations_per_token_equal_measured(kw):
    """The bytes a forward keeps per token (the difference of two lengths: weight copies cancel) are
    the plan's exactly, for the knobs fit() recommends: a bf16 stream (its norms still keep an fp32
    input), recomputed MLPs / attention / blocks, tiled MLPs, a LoRA base in bf16 (a bf16 stream whatever
    fp32_residual says; the frozen embedding's first norm keeps nothing); configs/speedrun.py's options (q and k
    normed, value embeddings mixed into v, U-net skips), also under recompute, learned positions and LoRA."""
    cfg = train_cfg(TINY, **kw)
    (p1, _), (p2, _) = (plan.activations(cfg, 2 * T, 1, 2, fused_norm=False) for T in (12, 28))
    assert measured(cfg, 28) - measured(cfg, 12) == p2 - p1 - 2 * 16 * 2 * C  # (less the head's input cast)


def test_fit_and_show():
    cfg = train_cfg(TINY, micro_batch_size=2)
    need = plan.predict(cfg)["total"]
    assert plan.fit(cfg, need / plan.GiB / (1 - plan.SPARE) * 1.01) == []  # (SPARE of the GPU kept free)
    assert plan.fit(cfg, need / plan.GiB * 1.01) != []
    steps = plan.fit(cfg, need / plan.GiB * 0.6)
    order = [k for k, _, _ in plan.LADDER]
    names = [k for k, _, _ in steps]
    assert names and [order.index(n) for n in names] == sorted(order.index(n) for n in names)
    totals = [need] + [t["total"] for _, _, t in steps]
    assert all(b < a for a, b in zip(totals, totals[1:])) and totals[-1] <= need * 0.6
    text = "\n".join(plan.show(steps[-1][2], need / plan.GiB * 0.6))
    assert "fits" in text and all(term in text for term in ("weights", "gradients", "optimizer state", "activations"))
    with pytest.raises(NotImplementedError, match="mixture-of-experts"):
        plan.predict(train_cfg(TINY, n_experts=4))


def test_cli_plans_without_the_base_on_disk(tmp_path, monkeypatch, capsys):
    """`plan.py --stage=sft configs/sft_tiny.py`, where init_from (out/tiny) is not on this machine: one note
    says so, and the plan is the config's own model keys' (equal to plan.advice on those keys)."""
    import os

    import config
    import sft
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    monkeypatch.chdir(tmp_path)
    plan.main(["--stage=sft", os.path.join(root, "configs", "sft_tiny.py"), "--gpu_memory=24"])
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("note: init_from=out/tiny: no such folder") and "config's own model keys" in out[0]
    cfg = config.load([os.path.join(root, "configs", "sft_tiny.py")], extra=sft.EXTRA, world=1)
    assert out[1:] == plan.advice(cfg, 1, 24.0, None)


def test_packed_rows_attention_per_token_equals_measured():
    """Packed SFT rows (pack=True: a mask) with grouped kv heads: model.sdpa repeats k and v to every head and
    SDPA keeps the mask as a bf16 bias, T values a token; the plan's extra is the measured extra exactly, less
    the per-row cos / sin tables of explicit positions (fp32, D/2 each, shared by the blocks)."""
    for T in (12, 28):
        plain, packed = (train_cfg(TINY, block_size=T, pack=p) for p in (False, True))
        extra = (plan.block_bytes(packed, 1, 2, "attn", False) - plan.block_bytes(plain, 1, 2, "attn", False)) * 2 * T * L
        assert extra == 2 * T * L * (2 * 2 * (H - KV) * D + 2 * T)
        assert measured(plain, T, mask=True) - measured(plain, T) - 2 * (2 * T * D // 2 * 4) == extra


class Live(TorchDispatchMode):
    """The bytes of the storages ops made (those in `skip` aside) while they live, and their peak."""

    def __init__(self, skip=()):
        super().__init__()
        self.refs, self.skip, self.peak = {}, set(skip), 0

    def now(self):
        self.refs = {k: v for k, v in self.refs.items() if not v[0].expired()}
        return sum(n for _, n in self.refs.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and (k := t.untyped_storage().data_ptr()) and k not in self.skip:
                self.refs.setdefault(k, (StorageWeakRef(t.untyped_storage()), t.untyped_storage().nbytes()))
        self.peak = max(self.peak, self.now())
        return out


@pytest.mark.parametrize("base", ["bfloat16", "nf4"])
def test_mlp_backward_gradients_within_the_plan(base):
    """An MLP's backward holds the gradients of its hidden activations beside what its forward kept: measured
    (every storage the ops make, bf16 autocast on CPU, LoRA r=4 on a bf16 / NF4 base) the peak above the
    forward's leftovers is 1.5-2 x T x hidden x 2 bytes; the plan's `mlp backward` row (2 x T x hidden x 2)
    is within -5% / +35% of it."""
    T, width, hidden = 512, 256, 1024  # (at TINY's width the adapters' share blurs the ratio)
    cfg = train_cfg(TINY, lora_r=4, lora_base_dtype=base, n_embd=width, ffn_hidden=hidden, block_size=T,
                    micro_batch_size=1)
    model = Transformer(ModelConfig.from_cfg(cfg))
    lora.apply(model, cfg, parallel.init(cfg))
    mlp = model.blocks[0].mlp
    x = torch.randn(1, T, width, dtype=torch.bfloat16, requires_grad=True)
    skip = {t.untyped_storage().data_ptr() for t in [x, *model.parameters(), *model.buffers()]}
    with torch.autocast("cpu", torch.bfloat16):
        with Live(skip) as fwd:
            y = mlp(x)
        dy = torch.randn_like(y)
        bwd = Live(skip | {dy.untyped_storage().data_ptr()})
        bwd.refs = dict(fwd.refs)
        left = bwd.now()
        with bwd:
            y.backward(dy)
    transient = bwd.peak - left
    row = dict((name, b) for name, b, _ in plan.predict(cfg)["rows"])["mlp backward"]  # (1 row of T tokens)
    assert row == 2 * 2 * hidden * T and 0.95 * transient <= row <= 1.35 * transient, (transient, row)
