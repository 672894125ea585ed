"""prefix.py against peft's PrefixTuningConfig on a tiny HF Llama (grouped-query attention), both ways.

Proves, on CPU in fp32: with the same prefix weights, Prefixed(our model loaded from the HF folder)
gives peft's PeftModel logits (<= 1e-4), loss and prefix gradients (relative error <= 1e-5), with
and without the reparameterisation MLP, with and without a right-padded attention mask; two
AdamW steps on the prefix alone give peft's prefix, and the frozen base stays bitwise unchanged.
PEFT's format both ways: our save_peft folder loads with peft.PeftModel.from_pretrained (on the
original HF model and on our model exported with hf.export_hf) with our logits; a folder peft
saved loads with load_peft and gives peft's logits. generate() (the prefix in the KV cache) gives the
greedy tokens of a loop over peft's forward, a left-padded prompt the tokens of the prompt alone, and
a seed repeats itself. A prefix for another shape is refused.
"""
import copy

import pytest
import torch
from distributed import assert_close

import hf
from config import ConfigError
from encoders import prefix as pfx

pytestmark = pytest.mark.usefixtures("one_thread")
V, N = 97, 5
LLAMA = dict(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, initializer_range=0.1, bos_token_id=None,
             eos_token_id=None)


def libs():
    t, peft = pytest.importorskip("transformers"), pytest.importorskip("peft")
    t.logging.set_verbosity_error()
    return t, peft


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    t, _ = libs()
    torch.manual_seed(0)
    ref = t.LlamaForCausalLM(t.LlamaConfig(**LLAMA)).eval()
    with torch.no_grad():
        for n, p in ref.named_parameters():
            if "norm" in n:
                p.uniform_(0.5, 1.5)
    folder = str(tmp_path_factory.mktemp("llama"))
    ref.save_pretrained(folder)
    return ref, folder


def peft_model(ref, projection):
    _, peft = libs()
    conf = peft.PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=N, prefix_projection=projection,
                                   encoder_hidden_size=24)
    torch.manual_seed(1)
    return peft.get_peft_model(copy.deepcopy(ref), conf)


def ours_like(pm, folder, projection):
    model = hf.load_hf(folder)
    prefix = pfx.Prefix(model.cfg, N, projection=projection, hidden=24)
    prefix.load_state_dict(pm.prompt_encoder["default"].state_dict())  # PEFT's PrefixEncoder: the same names
    return pfx.Prefixed(model, prefix)


def batch(seed=0, pad=False):
    x = torch.randint(0, V, (2, 20), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(x)
    if pad:
        mask[1, -6:] = 0  # right padding: the positions of the real tokens are those of the row alone
    labels = x.masked_fill(mask == 0, -100)  # transformers' labels; our targets are them shifted
    return x, mask, torch.cat([labels[:, 1:], torch.full((2, 1), -100)], 1)


def max_diff(a, b, tol=1e-4):
    diff = (a - b).abs().max().item()
    assert diff <= tol, f"max abs diff {diff:.3g} > {tol}"


@pytest.mark.parametrize("projection", [False, True])
def test_equal_to_peft(base, projection):
    ref, folder = base
    pm = peft_model(ref, projection)
    ours = ours_like(pm, folder, projection)
    frozen = {k: v.clone() for k, v in ours.model.state_dict().items()}
    for pad in (False, True):
        x, mask, y = batch(pad=pad)
        with torch.no_grad():
            real = mask.bool()
            max_diff(ours(x, attn_mask=mask)[real], pm(input_ids=x, attention_mask=mask).logits[real])
    x, mask, y = batch(1, pad=True)
    opt_ours = torch.optim.AdamW(ours.prefix.parameters(), lr=1e-2)
    opt_peft = torch.optim.AdamW([p for p in pm.parameters() if p.requires_grad], lr=1e-2)
    for step in range(2):
        loss = ours(x, y, attn_mask=mask)
        ref_loss = pm(input_ids=x, attention_mask=mask, labels=x.masked_fill(mask == 0, -100)).loss
        assert_close(loss, ref_loss, f"loss step {step}")
        loss.backward()
        ref_loss.backward()
        theirs = dict(pm.prompt_encoder["default"].named_parameters())
        for n, p in ours.prefix.named_parameters():
            assert_close(p.grad, theirs[n].grad, f"gradient of {n}, step {step}")
        for opt in (opt_ours, opt_peft):
            opt.step()
            opt.zero_grad()
    assert_close(ours.prefix.table(), pm.prompt_encoder["default"](torch.arange(N)[None])[0], "prefix after 2 steps")
    assert all(p.grad is None for p in ours.model.parameters())
    assert all(torch.equal(v, frozen[k]) for k, v in ours.model.state_dict().items()), "the base moved"


@torch.no_grad()
def test_peft_format_both_ways(base, tmp_path):
    t, peft = libs()
    ref, folder = base
    pm = peft_model(ref, True)
    ours = ours_like(pm, folder, True)
    x, mask, _ = batch(2)
    expected = ours(x, attn_mask=mask)
    pfx.save_peft(str(tmp_path / "ours"), ours.prefix)
    loaded = peft.PeftModel.from_pretrained(copy.deepcopy(ref), str(tmp_path / "ours")).eval()
    max_diff(loaded(input_ids=x, attention_mask=mask).logits, expected)
    hf.export_hf(ours.model, str(tmp_path / "base"))  # our base, as an HF folder, with our adapter
    exported = t.AutoModelForCausalLM.from_pretrained(str(tmp_path / "base")).eval()
    max_diff(peft.PeftModel.from_pretrained(exported, str(tmp_path / "ours"))(input_ids=x, attention_mask=mask).logits,
             expected)
    pm.save_pretrained(str(tmp_path / "peft"))  # PEFT's own folder -> ours
    back = pfx.Prefixed(hf.load_hf(folder), pfx.load_peft(str(tmp_path / "peft"), ours.cfg))
    max_diff(back(x, attn_mask=mask), pm(input_ids=x, attention_mask=mask).logits)


@torch.no_grad()
def test_generate_equals_a_loop_over_peft(base):
    # peft 0.21.2's own generate() on transformers 5.24 returns the base model's tokens (the prefix is
    # not applied), so the reference is a loop that re-runs PeftModel's forward over the whole sequence
    ref, folder = base
    pm = peft_model(ref, True)
    ours = ours_like(pm, folder, True)
    x = torch.randint(0, V, (2, 8), generator=torch.Generator().manual_seed(3))
    seq = x
    for _ in range(10):
        seq = torch.cat([seq, pm(input_ids=seq).logits[:, -1].argmax(-1, keepdim=True)], 1)
    assert torch.equal(pfx.generate(ours, x, 10, vocab=V, temperature=0), seq)
    padded, mask = torch.cat([torch.zeros(1, 3, dtype=torch.long), x[1:, :5]], 1), torch.tensor([[0, 0, 0] + [1] * 5])
    both = pfx.generate(ours, torch.cat([x[:1], padded]), 10, vocab=V,
                        attention_mask=torch.cat([torch.ones(1, 8), mask]).long(), temperature=0)
    assert torch.equal(both[1, 3:], pfx.generate(ours, x[1:, :5], 10, vocab=V, temperature=0)[0]), "left padding: as alone"
    a, b = (pfx.generate(ours, x, 10, vocab=V, temperature=1.0, top_k=20, seed=s) for s in (4, 4))
    assert torch.equal(a, b)


def test_refusals(base, tmp_path):
    _, folder = base
    model = hf.load_hf(folder)
    other = hf.config_from_hf({**hf.read_config(folder), "num_key_value_heads": 4})
    with pytest.raises(ConfigError, match="this prefix is for 2 layers of 4 x 8"):
        pfx.Prefixed(model, pfx.Prefix(other, N))
    pfx.save_peft(str(tmp_path), pfx.Prefix(other, N))
    with pytest.raises(ConfigError, match="num_attention_heads=4"):
        pfx.load_peft(str(tmp_path), model.cfg)
    with pytest.raises(ConfigError, match="n_tokens=0"):
        pfx.Prefix(model.cfg, 0)
