"""t5.py against transformers' T5, a cache-free decoding loop, and hand-worked span corruption.

Proves, on CPU in fp32 with tiny models built here (vocabulary 99: padded rows):
- relative position buckets equal transformers' T5Attention._relative_position_bucket for every
  distance in [-300, 300], both directions, two bucket settings, and hand-computed buckets;
- T5ForConditionalGeneration folders, v1.0 (ReLU, head tied to the embedding and fed
  d_model**-0.5-scaled states) and v1.1 (gated-GELU, a head of its own, unscaled, 3 decoder layers
  over 2 encoder layers, n_head * d_kv != d_model): logits <= 1e-4 of transformers' with a padded
  source, the same loss (mean; per token with reduction "none") and the same gradient of every
  parameter after one backward (relative error <= 1e-5); greedy generation equals transformers' generate (stop at eos, pad
  after); export_hf writes a folder transformers loads with the same logits (tie and scale kept);
- generation through the cache equals a loop that re-runs the whole decoder every step (greedy, and
  seeded sampling with top-k / top-p: the same draws), top_k=1 is greedy, a seed repeats itself;
  each cross-attention computes its keys/values once per call, the self-attention cache grows by
  one per token;
- span corruption by hand: a given mask gives the sentinel layout worked out by hand and that of a
  transcription of HF's create_sentinel_ids / filter_input_ids (many random masks); 20 tokens give
  one 3-token span at the end (T5's rule, deterministic there); the counts of span_counts at
  hand-worked lengths (half-to-even rounding); over 4,000 drawn masks of 100 tokens: exactly 15
  noise tokens in exactly 5 spans, non-noise first and noise last, inputs and targets rebuild the
  row; the first span's length follows the law of a uniformly random segmentation;
  corrupted_lengths(512) = (568, 114), and corrupting 568 tokens gives those lengths;
- bad settings raise naming the field.
"""
import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from distributed import assert_close

from config import ConfigError
from encoders import t5
from fused import IGNORE

pytestmark = pytest.mark.usefixtures("one_thread")
V, EOS = 99, 1
SHAPE = dict(vocab_size=V, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_heads=4, relative_attention_num_buckets=8,
             relative_attention_max_distance=20, decoder_start_token_id=0, initializer_factor=1.0)
VERSIONS = {"v1.0": dict(num_decoder_layers=2),
            "v1.1": dict(num_decoder_layers=3, d_kv=6, feed_forward_proj="gated-gelu", tie_word_embeddings=False)}


def transformers_or_skip():
    t = pytest.importorskip("transformers")
    t.logging.set_verbosity_error()
    return t


def build(version, folder):
    """A tiny T5ForConditionalGeneration saved into folder -> (model, folder). v1.1 gets an lm_head of
    its own in the folder, as Google's v1.1 checkpoints have (transformers then leaves it untied)."""
    t = transformers_or_skip()
    from safetensors.torch import load_file, save_file
    torch.manual_seed(0)
    ref = t.T5ForConditionalGeneration(t.T5Config(**{**SHAPE, **VERSIONS[version]})).eval()
    with torch.no_grad():
        for n, p in ref.named_parameters():
            if "layer_norm" in n:
                p.uniform_(0.5, 1.5)
    ref.save_pretrained(str(folder))
    if version == "v1.1":
        sd = load_file(f"{folder}/model.safetensors")
        sd["lm_head.weight"] = torch.randn_like(sd["shared.weight"])
        save_file(sd, f"{folder}/model.safetensors", metadata={"format": "pt"})
        conf = json.load(open(f"{folder}/config.json"))
        conf.pop("scale_decoder_outputs", None)
        json.dump(dict(conf, tie_word_embeddings=False), open(f"{folder}/config.json", "w"))
        ref = t.T5ForConditionalGeneration.from_pretrained(str(folder)).eval()
        assert ref.lm_head.weight.data_ptr() != ref.shared.weight.data_ptr()
    return ref, str(folder)


@pytest.fixture(scope="module", params=list(VERSIONS))
def version(request, tmp_path_factory):
    return (request.param, *build(request.param, tmp_path_factory.mktemp(request.param)))


def batch(seed=0):
    """A source (2, 30) whose second row ends in 6 padding, targets (2, 25) whose second row ends in 4 IGNORE."""
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(2, V, (2, 30), generator=g)
    mask = torch.ones_like(src)
    mask[1, -6:] = 0
    src[1, -6:] = 0
    y = torch.randint(2, V, (2, 25), generator=g)
    y[1, -4:] = IGNORE
    return src, mask, y


def max_diff(a, b, tol=1e-4):
    diff = (a - b).abs().max().item()
    assert diff <= tol, f"max abs diff {diff:.3g} > {tol}"


def test_buckets_equal_transformers_and_hand():
    transformers_or_skip()
    from transformers.models.t5.modeling_t5 import T5Attention
    rel = torch.arange(-300, 301)[None, :]
    for nb, md in ((32, 128), (8, 20)):
        for bidirectional in (True, False):
            ref = T5Attention._relative_position_bucket(rel, bidirectional, nb, md)
            assert torch.equal(t5.relative_buckets(rel, bidirectional, nb, md), ref), (nb, md, bidirectional)
    # by hand, 32 buckets up to 128: bidirectional: 16 per side, the first 8 distances exact; rel > 0 is the upper half
    got = t5.relative_buckets(torch.tensor([0, -1, 1, -7, -8, -12, -128, 5000]), True)
    assert got.tolist() == [0, 1, 17, 7, 8, 8 + int(math.log(12 / 8) / math.log(16) * 8), 15, 31]
    # causal: later keys (rel > 0) share bucket 0; 16 exact distances, then 16 + floor(log(d/16)/log(8) * 16)
    got = t5.relative_buckets(torch.tensor([3, 0, -15, -16, -20, -127, -128]), False)
    assert got.tolist() == [0, 0, 15, 16, 17, 16 + int(math.log(127 / 16) / math.log(8) * 16), 31]


def test_logits_loss_gradients_and_generation_equal_transformers(version):
    name, ref, folder = version
    ours = t5.load_hf(folder)
    tie = name == "v1.0"
    assert (ours.cfg.tie_embeddings, ours.cfg.scale_logits, ours.cfg.decoder_layers) == (tie, tie, 2 if tie else 3)
    src, mask, y = batch()
    expected = ref(input_ids=src, attention_mask=mask, labels=y)
    with torch.no_grad():
        logits = ours(src, tgt=ours.shift_right(y), src_mask=mask)
        max_diff(logits, expected.logits)
        none = ours(src, y, src_mask=mask, reduction="none")
        ref_none = F.cross_entropy(expected.logits.flatten(0, 1), y.flatten(), reduction="none").view(y.shape)
        assert_close(none, ref_none, "per-token loss")
    loss = ours(src, y, src_mask=mask)
    assert_close(loss, expected.loss, "loss")
    expected.loss.backward()
    loss.backward()
    theirs = dict(ref.named_parameters())
    for n, p in ours.named_parameters():
        g = torch.cat([theirs[h].grad for h in t5.hf_names(ours.cfg)[n]])
        assert_close(p.grad[:g.shape[0]], g, f"gradient of {n}")
    with torch.no_grad():
        gen = ref.generate(src, attention_mask=mask, max_new_tokens=20, do_sample=False, use_cache=tie)
        assert torch.equal(t5.generate(ours, src, 20, vocab=V, src_mask=mask, temperature=0, stop_tokens=[EOS]), gen)


@torch.no_grad()
def test_export_round_trip(version, tmp_path):
    t = transformers_or_skip()
    name, ref, folder = version
    t5.export_hf(t5.load_hf(folder), str(tmp_path))
    back = t.T5ForConditionalGeneration.from_pretrained(str(tmp_path)).eval()
    src, mask, y = batch(1)
    tgt = t5.T5.shift_right(t5.load_hf(folder), y)
    expected = ref(input_ids=src, attention_mask=mask, decoder_input_ids=tgt).logits
    max_diff(back(input_ids=src, attention_mask=mask, decoder_input_ids=tgt).logits, expected)
    again = t5.load_hf(str(tmp_path))
    assert (again.cfg.tie_embeddings, again.cfg.scale_logits) == ((True, True) if name == "v1.0" else (False, False))
    max_diff(again(src, tgt=tgt, src_mask=mask), expected)


# ----------------------------------------------------------------------------- generation

def small_model():
    torch.manual_seed(0)
    return t5.T5(t5.T5Config(vocab_size=V, n_layer=2, n_decoder_layer=2, n_head=4, n_embd=32, head_dim=8, ffn_hidden=48,
                             activation="gated-gelu", tie_embeddings=False, scale_logits=False, num_buckets=8,
                             max_distance=20, dropout=0.0)).eval()


def naive(model, src, mask, n, temperature, top_k=None, top_p=None, generator=None):
    """The decoder re-run on every token so far, each step: no cache."""
    out = torch.zeros(src.shape[0], 1, dtype=torch.long)
    context = model.encode(src, mask)
    for _ in range(n):
        logits = model.logits(model.decode(out, context, mask)[:, -1])
        out = torch.cat([out, t5.sample(logits, temperature, top_k, top_p, generator)[:, None]], 1)
    return out


@torch.no_grad()
def test_cached_generation_equals_naive_loop(monkeypatch):
    model = small_model()
    src, mask, _ = batch(2)
    assert torch.equal(t5.generate(model, src, 12, vocab=V, src_mask=mask, temperature=0), naive(model, src, mask, 12, 0))
    for kw in (dict(temperature=1.0), dict(temperature=0.8, top_k=10), dict(temperature=1.2, top_p=0.9)):
        got = t5.generate(model, src, 12, vocab=V, src_mask=mask, generator=torch.Generator().manual_seed(5), **kw)
        assert torch.equal(got, naive(model, src, mask, 12, generator=torch.Generator().manual_seed(5), **kw)), kw
    a, b = (t5.generate(model, src, 12, vocab=V, src_mask=mask, seed=s) for s in (1, 1))
    assert torch.equal(a, b) and not torch.equal(a, t5.generate(model, src, 12, vocab=V, src_mask=mask, seed=2))
    assert torch.equal(t5.generate(model, src, 12, vocab=V, src_mask=mask, top_k=1, seed=3),
                       t5.generate(model, src, 12, vocab=V, src_mask=mask, temperature=0))
    calls = []
    hooks = [b.cross.kv.register_forward_hook(lambda *a: calls.append(1)) for b in model.blocks if b.decoder]
    seen, orig = [], t5.Cache.update

    def spy(self, layer, k, v):  # the keys each self-attention attends over
        out = orig(self, layer, k, v)
        seen.append(out[0].shape[2])
        return out
    monkeypatch.setattr(t5.Cache, "update", spy)
    t5.generate(model, src, 7, vocab=V, src_mask=mask, temperature=0)
    for h in hooks:
        h.remove()
    assert len(calls) == 2, f"cross-attention keys computed {len(calls)} times for 2 layers"
    assert seen == [s for s in range(1, 8) for _ in range(2)], "the self-attention cache grows one key per step"


# ----------------------------------------------------------------------------- span corruption

def hf_sentinels(ids, mask, vocab_size, eos):
    """transformers' examples/flax/language-modeling/run_t5_mlm_flax.py (create_sentinel_ids,
    filter_input_ids) for one row, in numpy: the reference."""
    mask_indices = mask.astype(np.int8)[None]
    start_indices = mask_indices - np.roll(mask_indices, 1, axis=-1) * mask_indices
    start_indices[:, 0] = mask_indices[:, 0]
    sentinel_ids = np.where(start_indices != 0, np.cumsum(start_indices, axis=-1), start_indices)
    sentinel_ids = np.where(sentinel_ids != 0, (vocab_size - sentinel_ids), 0)
    sentinel_ids -= mask_indices - start_indices
    full = np.where(sentinel_ids != 0, sentinel_ids, ids[None])
    return np.concatenate([full[full >= 0], [eos]])


def test_sentinels_by_hand_and_as_transformers():
    ids = torch.arange(10, 20)
    mask = torch.tensor([0, 0, 1, 1, 0, 0, 0, 1, 0, 1], dtype=torch.bool)
    S0, S1, S2 = V - 1, V - 2, V - 3
    inputs, targets = t5.span_corrupt(ids, vocab_size=V, eos_id=EOS, mask=mask)
    assert inputs.tolist() == [10, 11, S0, 14, 15, 16, S1, 18, S2, EOS]
    assert targets.tolist() == [S0, 12, 13, S1, 17, S2, 19, EOS]
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        L = int(torch.randint(2, 60, (1,), generator=g))
        ids, mask = torch.randint(0, V - 20, (L,), generator=g), torch.rand(L, generator=g) < 0.3
        inputs, targets = t5.span_corrupt(ids, vocab_size=V, eos_id=EOS, mask=mask)
        assert inputs.tolist() == hf_sentinels(ids.numpy(), mask.numpy(), V, EOS).tolist()
        assert targets.tolist() == hf_sentinels(ids.numpy(), ~mask.numpy(), V, EOS).tolist()


def test_span_counts_by_hand():
    assert t5.span_counts(100) == (15, 5)
    assert t5.span_counts(10) == (2, 1)     # round(1.5) = 2 noise tokens, round(2 / 3) = 1 span
    assert t5.span_counts(30) == (4, 1)     # round(4.5) = 4 (half to even, as numpy), round(4 / 3) = 1
    assert t5.span_counts(2) == (1, 1)      # at least one noise and one non-noise token
    assert t5.span_counts(1000) == (150, 50)
    mask = t5.noise_mask(20, generator=torch.Generator().manual_seed(0))  # 3 noise tokens, 1 span: at the end
    assert mask.tolist() == [False] * 17 + [True] * 3
    ids = torch.arange(20, 40)
    inputs, targets = t5.span_corrupt(ids, vocab_size=V, eos_id=EOS, generator=torch.Generator().manual_seed(1))
    assert inputs.tolist() == list(range(20, 37)) + [V - 1, EOS]
    assert targets.tolist() == [V - 1, 37, 38, 39, EOS]


def test_noise_masks_over_many_draws():
    g, L, draws = torch.Generator().manual_seed(0), 100, 4000
    first_len = torch.zeros(16)
    ids = torch.arange(L) + 2
    for _ in range(draws):
        m = t5.noise_mask(L, generator=g)
        starts = m & ~torch.cat([torch.tensor([False]), m[:-1]])
        assert int(m.sum()) == 15 and int(starts.sum()) == 5 and not m[0] and m[-1]
        first = int(starts.nonzero()[0])
        first_len[int((~m[first:]).nonzero()[0]) if (~m[first:]).any() else L - first] += 1
        inputs, targets = t5.span_corrupt(ids, vocab_size=1000, eos_id=EOS, mask=m)  # sentinels 999..995
        assert len(inputs) == L - 15 + 5 + 1 and len(targets) == 15 + 5 + 1
        rebuilt = []
        pieces = {}  # sentinel -> the noise tokens after it in the targets
        for tok in targets[:-1].tolist():
            if tok >= 995:
                key = tok
                pieces[key] = []
            else:
                pieces[key].append(tok)
        for tok in inputs[:-1].tolist():
            rebuilt += pieces[tok] if tok >= 995 else [tok]
        assert rebuilt == ids.tolist()
    # 15 noise tokens cut uniformly into 5 non-empty spans: P(first = k) = C(15 - k - 1, 3) / C(14, 4)
    for k in range(1, 12):
        p = math.comb(15 - k - 1, 3) / math.comb(14, 4)
        sd = (draws * p * (1 - p)) ** 0.5
        assert abs(first_len[k] - draws * p) <= 5 * sd + 1, (k, first_len[k].item(), draws * p)


def test_corrupted_lengths():
    n, targets = t5.corrupted_lengths(512)
    assert (n, targets) == (568, 114)
    inputs, out = t5.span_corrupt(torch.arange(n) + 2, vocab_size=32100, eos_id=EOS,
                                  generator=torch.Generator().manual_seed(0))
    assert (len(inputs), len(out)) == (512, 114)


def test_config_errors():
    for kw, match in [(dict(activation="swiglu"), "activation"), (dict(n_head=0), "n_head"),
                      (dict(dropout=1.0), "dropout")]:
        with pytest.raises(ConfigError, match=match):
            t5.T5Config(**kw)
    with pytest.raises(ConfigError, match="at least 2 tokens"):
        t5.noise_mask(1)
    with pytest.raises(ConfigError, match="feed_forward_proj"):
        t5.config_from_hf({"model_type": "t5", "feed_forward_proj": "gated-swish", "vocab_size": V, "num_layers": 1,
                           "num_heads": 2, "d_model": 8, "d_kv": 4, "d_ff": 8})


def test_flops_count_the_matmul_weights():
    # 6 x every matmul weight x the tokens through it: the encoder's over the source, the decoder's and
    # the head's over the targets, counted here from the modules themselves; plus attention
    model = small_model()
    cfg, S, T = model.cfg, 30, 12
    mm = lambda mods: sum(m.weight.numel() for m in mods if isinstance(m, torch.nn.Linear))  # noqa: E731
    enc, dec = mm(model.blocks[:cfg.n_layer].modules()), mm(model.blocks[cfg.n_layer:].modules()) + model.head.weight.numel()
    D = cfg.n_head * cfg.head_dim
    attn = 12 * cfg.n_layer * S * S * D + cfg.decoder_layers * (6 * T * T * D + 12 * T * S * D)
    assert t5.flops_per_row(cfg, S, T) == 6 * (enc * S + dec * T) + attn
    assert t5.T5Config(n_embd=512, n_head=8).head_dim == 64 and t5.T5Config(n_embd=512).ffn_hidden == 2048
