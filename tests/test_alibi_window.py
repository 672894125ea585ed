"""ALiBi (MPT) and sliding-window attention (Mistral, Qwen2) against transformers, a naive loop and TP.

Proves, on CPU in fp32 with tiny models built here:
- model.alibi_slopes equals the slopes inside transformers' build_mpt_alibi_tensor for 1..16 heads;
- MPT: an MptForCausalLM folder with 6 heads (the slopes of a non-power of two) loads with logits
  <= 1e-4 of transformers' and the same loss, also for a left-padded batch; greedy generation through
  generate() and decode() equals transformers' generate; export_hf writes a folder transformers loads
  with the same logits;
- sliding windows shorter than the sequence: Mistral (window 8, every layer) and Qwen2 (window 8 from
  layer 1 of 3: max_window_layers) at 40 tokens: logits <= 1e-4 and the loss equal transformers',
  and differ without the window; greedy generation of left-padded prompts 25 tokens past the window,
  eager and decode (KV buckets), equals transformers' generate; export and load back give the logits;
- ALiBi with GQA and a window at once: generate() and decode() equal a naive loop that re-runs the
  whole prefix each step, each row alone; decode's seeded samples with buckets equal those without;
- TP2 (2 gloo ranks, one spawn) equals one process for ALiBi with 6 heads (each rank its 3 slopes)
  and a windowed GQA model: logits, loss, first gradients, greedy generate() and decode(); the MPT
  folder read with tp.hf_shard_fn gives each rank its heads' rows of Wqkv and transformers' logits;
- PP2 (2 gloo ranks) equals one process for ALiBi with GQA, tied embeddings and a window from the second
  block of stage 0 on: the loss of two micro-batches, every stage's first gradients, the evaluation through
  the stages and greedy decode() under net.full_params();
- decode refuses the triton / flex kernels for ALiBi; on a GPU, the captured decode step (CUDA graph)
  gives the eager greedy tokens; MPT configs ingot cannot reproduce, and models no HF class expresses
  (ALiBi other than MPT's, a window with learned positions, window_from without Qwen2's layout),
  raise naming the field.
"""
import os
from types import SimpleNamespace

import pytest
import torch
from distributed import assert_close as assert_rel
from distributed import spawn, train_cfg

import generate
import hf
import parallel
from model import ModelConfig, Transformer, alibi_slopes
from parallelism import pp, tp

pytestmark = pytest.mark.usefixtures("one_thread")
V = 97
LLAMA = dict(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, initializer_range=0.1, bos_token_id=None,
             eos_token_id=None)


def transformers_or_skip():
    t = pytest.importorskip("transformers")
    t.logging.set_verbosity_error()
    return t


def ids(seed, shape=(2, 40)):
    return torch.randint(0, V, shape, generator=torch.Generator().manual_seed(seed))


def max_diff(a, b, tol=1e-4):
    diff = (a - b).abs().max().item()
    assert diff <= tol, f"max abs diff {diff:.3g} > {tol}"


def build(name, folder):
    """A tiny random transformers model, norms not all ones, saved into folder -> (model, folder)."""
    t = transformers_or_skip()
    config = {"mpt": lambda: t.MptConfig(d_model=48, n_heads=6, n_layers=2, max_seq_len=64, vocab_size=V,
                                         initializer_range=0.1),
              "mistral": lambda: t.MistralConfig(**LLAMA, sliding_window=8),
              "qwen2": lambda: t.Qwen2Config(**LLAMA, use_sliding_window=True, sliding_window=8,
                                             max_window_layers=1)}[name]()
    torch.manual_seed(0)
    ref = {"mpt": t.MptForCausalLM, "mistral": t.MistralForCausalLM, "qwen2": t.Qwen2ForCausalLM}[name](config).eval()
    with torch.no_grad():
        for n, p in ref.named_parameters():
            if "norm" in n:
                p.uniform_(0.5, 1.5)
    ref.save_pretrained(str(folder))
    return ref, str(folder)


@pytest.fixture(scope="module", params=["mpt", "mistral", "qwen2"])
def arch(request, tmp_path_factory):
    return (request.param, *build(request.param, tmp_path_factory.mktemp(request.param)))


def left_padded(seed):
    """Two prompts of 12 and 9 tokens, left-padded with 0 -> (ids, mask)."""
    p = ids(seed, (2, 12))
    m = torch.ones(2, 12, dtype=torch.long)
    p[1, :3], m[1, :3] = 0, 0
    return p, m


def test_slopes_equal_transformers():
    from transformers.models.mpt.modeling_mpt import build_mpt_alibi_tensor  # noqa: F401 (skip without it)
    transformers_or_skip()
    for H in range(1, 17):
        bias = build_mpt_alibi_tensor(H, 5)  # (H, 1, 5): slope * (key - last key)
        assert torch.equal(alibi_slopes(H), -bias[:, 0, 0] / 4), f"{H} heads"


@torch.no_grad()
def test_logits_loss_and_generation_equal_transformers(arch):
    name, ref, folder = arch
    ours = hf.load_hf(folder)
    assert (ours.cfg.pos_emb, ours.cfg.sliding_window, ours.cfg.window_from) == {
        "mpt": ("alibi", 0, 0), "mistral": ("rope", 8, 0), "qwen2": ("rope", 8, 1)}[name]
    x = ids(1)
    expected = ref(x, labels=x)
    max_diff(ours(x), expected.logits)
    assert_rel(ours(x[:, :-1], x[:, 1:]), expected.loss, "loss", tol=1e-5)
    p, m = left_padded(2)
    max_diff(ours(p, attn_mask=m)[m.bool()], ref(p, attention_mask=m).logits[m.bool()])
    if name != "mpt":  # the window bites: without it the logits are another model's
        window, ours.cfg.sliding_window = ours.cfg.sliding_window, 0
        assert (ours(x) - expected.logits).abs().max() > 0.1
        ours.cfg.sliding_window = window
    gen = ref.generate(p, attention_mask=m, max_new_tokens=25, do_sample=False, pad_token_id=0)
    assert torch.equal(generate.generate(ours, p, 25, vocab=V, temperature=0, attention_mask=m), gen), "generate"
    for bucket in (16, 0):
        got = generate.decode(ours, p, 25, vocab=V, temperature=0, attention_mask=m, bucket=bucket).tokens
        assert torch.equal(got, gen), f"decode, bucket {bucket}"


@torch.no_grad()
def test_export_round_trip(arch, tmp_path):
    t = transformers_or_skip()
    name, ref, folder = arch
    hf.export_hf(hf.load_hf(folder), str(tmp_path))
    back = t.AutoModelForCausalLM.from_pretrained(str(tmp_path)).eval()
    assert back.config.model_type == name
    x = ids(3)
    max_diff(back(x).logits, ref(x).logits)
    max_diff(hf.load_hf(str(tmp_path))(x), ref(x).logits)


MIXED = dict(vocab_size=V, n_layer=3, n_head=4, n_kv_head=2, n_embd=32, block_size=64, pos_emb="alibi",
             sliding_window=6, window_from=1)


def naive_greedy(model, prompt, n):
    """Re-run the whole sequence every step (no cache) and take the argmax: one row, no padding."""
    seq = prompt[None]
    for _ in range(n):
        seq = torch.cat([seq, model(seq)[:, -1].argmax(-1, keepdim=True)], 1)
    return seq[0]


@torch.no_grad()
def test_alibi_gqa_window_decoders_equal_naive_loop():
    torch.manual_seed(0)
    model = Transformer(ModelConfig(**MIXED)).eval()
    p, m = left_padded(4)
    rows = [naive_greedy(model, p[b][m[b].bool()], 20) for b in range(2)]
    for got in (generate.generate(model, p, 20, vocab=V, temperature=0, attention_mask=m),
                generate.decode(model, p, 20, vocab=V, temperature=0, attention_mask=m, bucket=8).tokens):
        for b in range(2):
            real = torch.cat([m[b].bool(), torch.ones(20, dtype=torch.bool)])  # the row without its padding
            assert torch.equal(got[b][real], rows[b]), f"row {b}"
    a = generate.decode(model, p, 20, vocab=V, temperature=1.0, top_k=20, attention_mask=m, seed=3, bucket=8)
    b = generate.decode(model, p, 20, vocab=V, temperature=1.0, top_k=20, attention_mask=m, seed=3, bucket=0)
    assert torch.equal(a.tokens, b.tokens)
    assert_rel(a.logprobs, b.logprobs, "log-probs")
    with pytest.raises(ValueError, match="ALiBi's differ per head"):
        generate.decode(model, p, 4, vocab=V, attention_mask=m, attention="flex")


# ----------------------------------------------------------------------------- TP2

TP_CONFIGS = {"alibi6": dict(vocab_size=V, n_layer=2, n_head=6, n_embd=48, block_size=64, pos_emb="alibi",
                             norm="layernorm", activation="gelu", tie_embeddings=True),
              "window_gqa": dict(vocab_size=V, n_layer=2, n_head=4, n_kv_head=2, n_embd=32, block_size=64,
                                 sliding_window=5, window_from=1)}


def _run(model, grid):
    """What the TP test compares: logits, loss, first gradients (full tensors), greedy generation."""
    x = ids(5, (2, 24))
    out = {"logits": model(x).detach()}
    loss = model(x[:, :-1], x[:, 1:])
    loss.backward()
    out["loss"] = loss.detach()
    out["grads"] = {n: tp.full_tensor(p, p.grad, grid) for n, p in model.named_parameters()}
    p, m = left_padded(6)
    with torch.no_grad():
        out["generate"] = generate.generate(model, p, 16, vocab=V, temperature=0, attention_mask=m)
        out["decode"] = generate.decode(model, p, 16, vocab=V, temperature=0, attention_mask=m, bucket=8).tokens
    return out


def _tp_worker(rank, out_dir, mpt_folder):
    grid = parallel.init(SimpleNamespace(device="cpu", tp=2, ep=1))
    model = tp.tensor_parallel(Transformer(hf.config_from_hf(hf.read_config(mpt_folder))), grid)
    hf.load_weights(mpt_folder, model, shard_fn=tp.hf_shard_fn(model, grid))  # this rank's rows of Wqkv
    with torch.no_grad():
        res = {"mpt": model.eval()(ids(7)), "mpt_qkv": model.blocks[0].attn.qkv.weight.detach()}
    for name, kw in TP_CONFIGS.items():
        torch.manual_seed(0)  # the same full model on both ranks, then each keeps its heads
        model = tp.tensor_parallel(Transformer(ModelConfig(**kw)), grid)
        res[name] = _run(model, grid)
        res[name]["heads"] = (model.alibi_heads.start, model.alibi_heads.stop)
    torch.save(res, os.path.join(out_dir, f"rank{rank}.pt"))


def test_tp2_equals_one_process(tmp_path):
    ref, folder = build("mpt", tmp_path / "mpt")
    spawn(_tp_worker, 2, str(tmp_path), folder)
    full_qkv = hf.load_hf(folder).blocks[0].attn.qkv.weight
    for rank in range(2):  # the MPT folder read shard by shard: its heads' q, k, v rows, transformers' logits
        got = torch.load(tmp_path / f"rank{rank}.pt")
        max_diff(got["mpt"], ref(ids(7)).logits.detach())
        assert torch.equal(got["mpt_qkv"], tp.cut(full_qkv, 0, [(48, 2)] * 3, rank, 2)), f"rank {rank}: MPT q/k/v rows"
    grid = parallel.init(SimpleNamespace(device="cpu", tp=1, ep=1))
    for name, kw in TP_CONFIGS.items():
        torch.manual_seed(0)
        ref = _run(Transformer(ModelConfig(**kw)), grid)
        for rank in range(2):
            got, what = torch.load(tmp_path / f"rank{rank}.pt")[name], f"{name} rank {rank}"
            if name == "alibi6":
                assert got["heads"] == (3 * rank, 3 * rank + 3), f"{what}: not its heads' slopes"
            assert_rel(got["logits"], ref["logits"], f"{what} logits")
            assert_rel(got["loss"], ref["loss"], f"{what} loss")
            assert_rel(got["grads"], ref["grads"], f"{what} first gradients")
            for k in ("generate", "decode"):
                assert torch.equal(got[k], ref[k]), f"{what} greedy {k}"


# ----------------------------------------------------------------------------- PP2

PP_CONFIG = dict(vocab_size=V, n_layer=4, n_head=4, n_kv_head=2, n_embd=32, block_size=64, pos_emb="alibi",
                 norm="layernorm", activation="gelu", tie_embeddings=True, sliding_window=5, window_from=1,
                 lr=1e-3, pp_cut="2")  # the window from block 1 of stage 0 on, all of stage 1 (blocks 2, 3)


def _pp_run(net, grid):
    """Two micro-batches' loss and first gradients through net.train_step, evaluation, greedy decode."""
    x = ids(5, (4, 24))
    micro = [(x[i:i + 2, :-1].clone(), x[i:i + 2, 1:].clone(), {}) for i in (0, 2)]
    out = {"loss": net.train_step(micro, lambda i, loss: (loss / 2, loss.detach() / 2))}
    net.wrapper.finish()
    if net.pipe is not None:
        pp.sum_tied_grads(net)
    out["grads"] = {n: p.grad.clone() for n, p in net.raw.named_parameters() if p.grad is not None}
    with torch.no_grad():
        out["eval"] = net(x[:, :-1], x[:, 1:], reduction="none")
    net.raw.eval()
    p, m = left_padded(6)
    with net.full_params(), torch.no_grad():
        out["decode"] = generate.decode(net.raw, p, 16, vocab=V, temperature=0, attention_mask=m, bucket=8).tokens
    return out


def _pp_worker(rank, out_dir):
    cfg = train_cfg(PP_CONFIG, pp=2)
    grid = parallel.init(cfg)
    torch.manual_seed(0)
    net = parallel.parallelize(Transformer(ModelConfig.from_cfg(cfg)), grid, cfg)
    torch.save(_pp_run(net, grid), os.path.join(out_dir, f"rank{rank}.pt"))


def test_pp2_equals_one_process(tmp_path):
    """ALiBi with a window from the second block of stage 0 on (tied embeddings over the two stages)."""
    spawn(_pp_worker, 2, str(tmp_path))
    cfg = train_cfg(PP_CONFIG, pp_cut="")
    torch.manual_seed(0)
    ref = _pp_run(parallel.parallelize(Transformer(ModelConfig.from_cfg(cfg)), parallel.init(cfg), cfg), None)
    for rank in range(2):
        got, what = torch.load(tmp_path / f"rank{rank}.pt"), f"pp2 stage {rank}"
        assert_rel(got["loss"], ref["loss"], f"{what} loss")
        names = {"tok_emb.weight" if n == "head.weight" else n: g for n, g in got["grads"].items()}
        assert len(names) == len(got["grads"]) > 0, what
        for n, g in names.items():  # the last stage's tied head: the sum of both uses
            assert_rel(g, ref["grads"][n], f"{what} grad {n}")
        assert_rel(got["eval"], ref["eval"], f"{what} evaluation")
        assert torch.equal(got["decode"], ref["decode"]), f"{what} greedy decode"


# ----------------------------------------------------------------------------- refusals

@pytest.mark.parametrize("over, match", [
    ({"attn_config": {"clip_qkv": 6.0}}, "clip_qkv"), ({"attn_config": {"alibi_bias_max": 16}}, "alibi_bias_max"),
    ({"expansion_ratio": 2}, "expansion_ratio"), ({"logit_scale": 0.5}, "logit_scale"),
    ({"attn_config": {"attn_type": "multiquery_attention"}}, "attn_type"),
])
def test_unsupported_mpt_configs(over, match):
    mpt = {"model_type": "mpt", "architectures": ["MptForCausalLM"], "vocab_size": V, "d_model": 32, "n_heads": 4,
           "n_layers": 2, "max_seq_len": 64}
    with pytest.raises(ValueError, match=match):
        hf.config_from_hf({**mpt, **over})


@pytest.mark.parametrize("over, match", [
    (dict(pos_emb="alibi", norm="rmsnorm", activation="gelu"), "alibi other than MPT's"),
    (dict(sliding_window=4, window_from=1), "window_from > 0 without qkv_bias"),
    (dict(pos_emb="learned", norm="layernorm", activation="gelu", bias=True, sliding_window=4), "sliding window"),
])
def test_unexportable(over, match, tmp_path):
    model = Transformer(ModelConfig(vocab_size=V, n_layer=2, n_head=2, n_embd=16, block_size=16, **over))
    with pytest.raises(ValueError, match=match):
        hf.export_hf(model, str(tmp_path))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@torch.no_grad()
def test_captured_decode_on_gpu():
    # the decode step captured as a CUDA graph (the query slots come from the cache's index tensor):
    # greedy tokens equal the eager generate(), fp32, ALiBi with GQA and a window
    torch.manual_seed(0)
    model = Transformer(ModelConfig(**MIXED)).cuda().eval()
    p, m = (t.cuda() for t in left_padded(4))
    ref = generate.generate(model, p, 20, vocab=V, temperature=0, attention_mask=m)
    assert torch.equal(generate.decode(model, p, 20, vocab=V, temperature=0, attention_mask=m, bucket=8, graph=True).tokens, ref)
