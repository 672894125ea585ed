"""LoRA with trainable token rows (lora.train_tokens: PEFT's trainable_token_indices) against PEFT
and against one process.

The case of issue 32: a chat template's two tokens were just added (their embedding and head rows
are the mean of the old rows, weights.grow_vocab, so they are equal), and LoRA on the linears
alone never changes those rows. Proves:
- fresh rows change nothing (the logits are the base's); after 3 AdamW steps on batches holding the
  new tokens, rows 95 and 96 (V = 97) of the embedding and of the untied head differ from each
  other and from their start in merge_weights' output, and every other row and the base are
  unchanged; LLaMA untied, LLaMA tied, GPT-2 (tied);
- PEFT parity (transformers + peft, fp32, max abs diff <= 1e-5): the trained adapter saved by
  save_peft (rows under token_adapter.trainable_tokens_delta, ids in trainable_token_indices)
  loads in peft.PeftModel over the base's HF export with our logits; load_peft reads it back into a
  fresh model with the same logits; merge_weights -> a plain model gives them too; in-place merge
  gives them, unmerge restores the base weights, lora.disabled gives the base's logits; a checkpoint
  of the run (rows and ids among its weights) loads merged (weights.load_model) with our logits;
- layouts (gloo, 2 processes, 3 AdamW steps with clipping, random non-zero starting adapters and
  rows, tokens 3, 95, 96 so that under TP2 the rows' owners are both ranks): DP2, FSDP2, TP2 and TP2 with
  the chunked loss (loss_chunk) give the one-process rows and adapters (relative error <= 1e-5),
  bitwise identical on every rank after every step; under FSDP the rows are the only trainable tensors outside the blocks;
- the chunked loss (chunked.py, which reads the head's weight) sees the rows: the materialised
  head's loss and gradients, tied and untied;
- the stages' wiring (weights.loader): rows for exactly the ids init_from lacked (weights.base_vocab),
  none with lora_train_tokens=False, without LoRA or on a frozen reference; tied embeddings under a
  pipeline refused in one line.
"""
import copy
import os

import distributed
import pytest
import torch
from distributed import assert_close, spawn, train_cfg

import checkpoint
import hf
import lora
import parallel
import weights
from memory import chunked
from model import ModelConfig, Transformer

T, STEPS, V, OLD = 16, 3, 97, 95  # tokens OLD..V-1 were just added
NEW = list(range(OLD, V))
SMALL = dict(vocab_size=V, pad_vocab_multiple=32, n_layer=2, n_head=4, n_kv_head=2, n_embd=32, block_size=T,
             lr=1e-2, weight_decay=0.1, grad_clip=0.05, eps=1e-6, warmup_steps=0, schedule="constant",
             lora_r=4, lora_alpha=8.0)
FAMILIES = {"llama": {}, "llama_tied": dict(tie_embeddings=True),
            "gpt2": dict(pos_emb="learned", norm="layernorm", activation="gelu_tanh", bias=True, n_kv_head=0,
                         tie_embeddings=True)}


def one_grid():
    return parallel.init(train_cfg(SMALL))


def grown_model(cfg):
    """A model whose rows OLD..V-1 (embedding and head) were just grown: the mean of the old rows."""
    torch.manual_seed(0)
    model = Transformer(ModelConfig.from_cfg(cfg))
    with torch.no_grad():
        for p in {id(p): p for p in (model.tok_emb.weight, model.head.weight)}.values():
            p.copy_(weights.grow_vocab(p, OLD, V))
    return model


def batches(step, vocab=V):
    """Random ids with the new tokens in inputs and targets."""
    x, y = distributed.global_batch(step, T, vocab)
    x[:, ::3], y[:, 1::3] = OLD, V - 1
    x[:, 1::4] = V - 1
    return x, y


@pytest.fixture(scope="module", params=list(FAMILIES))
def trained(request, tmp_path_factory):
    """(cfg, base model, its HF folder, trained LoRA model with token rows, the rows' start)."""
    cfg = train_cfg(SMALL, **FAMILIES[request.param])
    base = grown_model(cfg).eval()
    folder = str(tmp_path_factory.mktemp(request.param))
    hf.export_hf(base, folder)
    model = lora.apply(copy.deepcopy(base), cfg, one_grid())
    lora.train_tokens(model, NEW, one_grid())
    x = batches(9)[0]
    with torch.no_grad():
        assert (model(x) - base(x)).abs().max() <= 1e-6  # fresh rows are the base's (a separate matmul)
    start = {k: v.clone() for k, v in lora.gather(model, one_grid()).items()}
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg.lr, eps=cfg.eps)
    model.train()
    for s in range(STEPS):
        model(*batches(s)).backward()
        opt.step()
        opt.zero_grad()
    return cfg, base, folder, model.eval(), start


@torch.no_grad()
def test_new_rows_train(trained):
    cfg, base, _, model, start = trained
    merged = lora.merge_weights(lora.gather(model, one_grid()) | parallel.full_state_dict(model, one_grid()), cfg)
    names = ["tok_emb.weight"] + ([] if cfg.tie_embeddings else ["head.weight"])
    assert ("head.lora_tokens.rows" in start) == (not cfg.tie_embeddings)
    for name in names:
        W, W0 = merged[name], base.state_dict()[name]
        assert torch.equal(W0[OLD], W0[OLD + 1])  # the bug's starting point: equal grown rows
        assert (W[OLD] - W[OLD + 1]).abs().max() > 1e-3, f"{name}: rows {OLD}, {OLD + 1} still equal"
        assert (W[NEW] - W0[NEW]).abs().min(-1).values.max() > 0  # they moved
        assert torch.equal(W[:OLD], W0[:OLD]) and torch.equal(W[V:], W0[V:])  # nothing else did
    assert all(torch.equal(p, base.state_dict()[n]) for n, p in model.named_parameters() if not lora.is_adapter(n))
    assert torch.equal(model.tok_emb.lora_tokens.ids, torch.tensor(NEW))


@torch.no_grad()
def test_peft_loads_ours_and_back(trained, tmp_path):
    pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    import transformers
    cfg, base, folder, model, _ = trained
    lora.save_peft(str(tmp_path), lora.gather(model, one_grid()), cfg, base_model_name_or_path=folder)
    hf_base = transformers.AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()
    theirs = peft.PeftModel.from_pretrained(hf_base, str(tmp_path)).eval()
    x = batches(7)[0]
    ours = model(x)
    assert (ours - base(x)).abs().max() > 1e-2  # the adapter matters
    assert (theirs(input_ids=x).logits - ours).abs().max() <= 1e-5
    with theirs.disable_adapter():
        assert (theirs(input_ids=x).logits - base(x)).abs().max() <= 1e-5
    # back into a fresh model of ours
    tokens = lora.peft_tokens(str(tmp_path))
    assert tokens["tok_emb"] == NEW and ("head" in tokens) == (not cfg.tie_embeddings)
    fresh = lora.apply(copy.deepcopy(base), train_cfg(SMALL, **lora.peft_config(str(tmp_path))), one_grid())
    lora.train_tokens(fresh, tokens["tok_emb"], one_grid(), head="head" in tokens)
    lora.load_peft(str(tmp_path), fresh, one_grid())
    assert (fresh.eval()(x) - ours).abs().max() <= 1e-5
    # merged on full tensors, merged in place, unmerged, disabled
    plain = Transformer(base.cfg)
    plain.load_state_dict(lora.merge_weights(fresh.state_dict(), cfg))
    assert (plain.eval()(x) - ours).abs().max() <= 1e-5
    lora.merge(fresh)
    assert (fresh(x) - ours).abs().max() <= 1e-5
    lora.unmerge(fresh)
    assert all((p - base.state_dict()[n]).abs().max() <= 1e-6 for n, p in fresh.named_parameters()
               if not lora.is_adapter(n))
    with lora.disabled(fresh):
        assert (fresh(x) - base(x)).abs().max() <= 1e-6
    wrong = lora.apply(copy.deepcopy(base), train_cfg(SMALL, **lora.peft_config(str(tmp_path))), one_grid())
    lora.train_tokens(wrong, [3, 4], one_grid(), head="head" in tokens)
    with pytest.raises(ValueError, match="trainable token ids"):
        lora.load_peft(str(tmp_path), wrong, one_grid())


@torch.no_grad()
def test_checkpoint_keeps_rows(trained, tmp_path):
    """A LoRA run's checkpoint holds the rows and their ids; loading it merged (sample.py, init_from:
    weights.load_model / fit_weights) gives the trained logits."""
    cfg, base, _, model, _ = trained
    full = parallel.full_state_dict(model, one_grid())
    assert full["tok_emb.lora_tokens.ids"].tolist() == NEW
    checkpoint.save(str(tmp_path), 1, full, None, cfg)
    plain = Transformer(base.cfg)
    weights.load_model(str(tmp_path / "step_000001"), plain)
    x = batches(5)[0]
    assert (plain.eval()(x) - model(x)).abs().max() <= 1e-5


def test_refusals():
    model = grown_model(train_cfg(SMALL))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        lora.train_tokens(model, [V], one_grid())
    lora.train_tokens(model, NEW, one_grid())
    with pytest.raises(ValueError, match="trainable rows already"):
        lora.train_tokens(model, NEW, one_grid())


# ----------------------------------------------------------------------------- layouts

IDS = [3] + NEW  # under TP2 (128 padded rows, 64 a rank) row 3 lives on rank 0, 95 and 96 on rank 1
LAYOUTS = {"dp2": (1, "ddp", 0), "fsdp2": (1, "fsdp", 0), "tp2": (2, "ddp", 0), "tp2_chunked": (2, "ddp", 5)}


def train(cfg, grid, init):
    """parallelize a grown model with LoRA and trainable rows for IDS (added in parallelize's load
    callback: on the TP cut, before apply and FSDP), set the starting adapters and rows, train
    STEPS steps on this data rank's share -> [gather() after each step]."""
    model = grown_model(cfg)
    net = parallel.parallelize(model, grid, cfg, load=lambda m: lora.train_tokens(m, IDS, grid))
    lora.load(net.raw, grid, init, net.wrapper)
    per = distributed.G // grid.data_world
    out = []
    for s in range(STEPS):
        x, y = (t[grid.data_rank * per:(grid.data_rank + 1) * per] for t in batches(s))
        net(x, y).backward()
        net.step(cfg.grad_clip)  # reduce, clip, optimizer step, zero gradients
        out.append(lora.gather(net.raw, grid, net.wrapper))
    if cfg.data_parallel == "fsdp":
        root = [names[0] for ns in net.wrapper.units for names, _, _ in ns.params if not names[0].startswith("blocks.")]
        out.append(sorted(root))
    return out


def _layouts(rank, out_dir, init):
    for name, (tp_size, dp, chunk) in LAYOUTS.items():
        cfg = train_cfg(SMALL, tp=tp_size, data_parallel=dp, loss_chunk=chunk)
        torch.save(train(cfg, parallel.init(cfg), init), os.path.join(out_dir, f"{name}_{rank}.pt"))


def test_layouts_equal_one_process(tmp_path):
    cfg = train_cfg(SMALL)
    model = lora.train_tokens(lora.apply(grown_model(cfg), cfg, one_grid()), IDS, one_grid())
    g = torch.Generator().manual_seed(3)
    init = {n: 0.3 * torch.randn(p.shape, generator=g) for n, p in model.named_parameters() if lora.is_adapter(n)}
    init.update({n: b.clone() for n, b in model.named_buffers() if lora.is_adapter(n)})
    ref = train(cfg, one_grid(), init)
    spawn(_layouts, 2, str(tmp_path), init)
    for name in LAYOUTS:
        recs = [torch.load(tmp_path / f"{name}_{r}.pt") for r in range(2)]
        for s in range(STEPS):
            for k, v in recs[0][s].items():
                assert torch.equal(recs[1][s][k], v), f"{name} step {s}: rank 1's {k} drifted"
        assert_close(recs[0][STEPS - 1], ref[STEPS - 1], name)
        assert (ref[STEPS - 1]["tok_emb.lora_tokens.rows"] - init["tok_emb.lora_tokens.rows"]).abs().min() > 0
        if name == "fsdp2":
            assert recs[0][STEPS] == ["head.lora_tokens.rows", "tok_emb.lora_tokens.rows"]


# ----------------------------------------------------------------------------- weights.loader: where the stages get them

def test_loader_adds_rows_for_the_new_tokens(tmp_path):
    """weights.loader's callback (sft, dpo, grpo) gives a LoRA model trainable rows for exactly the
    tokens init_from lacked (weights.base_vocab): none with lora_train_tokens=False, none without
    LoRA, none on a frozen reference; tied embeddings under a pipeline are refused in one line."""
    import config
    small = train_cfg(SMALL, vocab_size=OLD)
    torch.manual_seed(0)
    checkpoint.save(str(tmp_path), 1, Transformer(ModelConfig.from_cfg(small)).state_dict(), None, small)
    cfg = train_cfg(SMALL, init_from=str(tmp_path / "step_000001"))  # V = OLD + 2: the chat tokens added
    assert weights.base_vocab(cfg) == OLD and weights.base_vocab(train_cfg(SMALL)) is None

    def rows(frozen=False, **kw):
        c = train_cfg(SMALL, init_from=cfg.init_from, **kw)
        model = Transformer(ModelConfig.from_cfg(c)).requires_grad_(not frozen)
        weights.loader(c, one_grid())(model)
        return {n: b.tolist() for n, b in model.named_buffers() if lora.is_adapter(n)}
    assert rows() == {"tok_emb.lora_tokens.ids": NEW, "head.lora_tokens.ids": NEW}
    assert rows(tie_embeddings=True) == {"tok_emb.lora_tokens.ids": NEW}
    assert rows(lora_train_tokens=False) == rows(lora_r=0) == rows(frozen=True) == {}
    with pytest.raises(config.ConfigError, match="set --lora_train_tokens=False, or pp=1"):
        weights.loader(train_cfg(SMALL, init_from=cfg.init_from, pp=2, tie_embeddings=True), one_grid())


@pytest.mark.parametrize("family", ["llama", "llama_tied"])
def test_chunked_loss_sees_the_rows(family):
    """loss_chunk > 0 (chunked.py reads the head's weight, never calls the head): the same loss and
    the same gradients of the rows and adapters as the materialised head, with trained-looking rows."""
    cfg = train_cfg(SMALL, **FAMILIES[family])
    model = lora.train_tokens(lora.apply(grown_model(cfg), cfg, one_grid()), NEW, one_grid())
    with torch.no_grad():
        for t in lora.token_rows(model):
            t.rows.add_(0.5 * torch.randn(t.rows.shape, generator=torch.Generator().manual_seed(1)))
        for n, p in model.named_parameters():
            if ".lora_B." in n:
                p.normal_(0, 0.3, generator=torch.Generator().manual_seed(2))
    chunked_model = chunked.use(copy.deepcopy(model), 5)
    x, y = batches(4)
    got = {}
    for name, m in (("materialised", model), ("chunked", chunked_model)):
        loss = m(x, y)
        loss.backward()
        got[name] = (loss.detach(), {n: p.grad for n, p in m.named_parameters() if p.requires_grad})
    (want, want_g), (loss, grads) = got["materialised"], got["chunked"]
    assert (loss - want).abs() <= 1e-5 * want.abs()
    assert want_g.keys() == grads.keys() and any("lora_tokens" in n for n in grads)
    assert_close(grads, want_g, "chunked loss: gradients")
