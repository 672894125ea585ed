"""qlora.py's 4-bit NF4 base against a dequantise-then-LoRA reference, PEFT on HF weights, and
bitsandbytes' Linear4bit (when installed; skipped without it).

Proves:
- quantize() turns every adapted linear into a QLoRALinear whose logits and adapter gradients are
  bitwise those of the same LoRA model with each base weight replaced by its dequantised NF4 (fp32,
  with and without double quantisation), and after two AdamW steps the adapters still are; the
  rest of the frozen tensors go to bf16 on request; the NF4 buffers take what nf4_bytes says and
  backward keeps no tensor of a base weight's size (saved-tensor hooks);
- HF weights: a tiny LLaMA (transformers) loaded by hf.load_hf, adapted and quantised; our adapters
  saved with lora.save_peft and loaded by peft into that HF model, with its linears replaced by the
  dequantised NF4 of each HF module, give our logits (max abs diff <= 1e-5): loading, the fused
  [q|k|v] / [gate|up] quantisation (64-element blocks never straddle a row) and PEFT's format;
- dequantized_state + lora.merge_weights give a plain model with the QLoRA model's logits; merge()
  and quantize() without adapters are refused;
- bitsandbytes: Linear4bit (NF4, double quantisation, fp32 compute) on the same weight gives the
  same output as our NF4 linear.
"""
import copy

import pytest
import torch
from distributed import train_cfg

import lora
import parallel
from memory import qlora, quant
from model import ModelConfig, Transformer

SMALL = dict(vocab_size=97, pad_vocab_multiple=32, n_layer=2, n_head=4, n_kv_head=1, n_embd=64, block_size=8,
             lora_r=4, lora_alpha=8.0, lr=1e-2, weight_decay=0.0)


def grid():
    return parallel.init(train_cfg(SMALL))


def lora_model(seed=0):
    cfg = train_cfg(SMALL)
    torch.manual_seed(seed)
    model = lora.apply(Transformer(ModelConfig.from_cfg(cfg)), cfg, grid())
    g = torch.Generator().manual_seed(5)
    lora.load(model, grid(), {n: 0.2 * torch.randn(p.shape, generator=g)
                              for n, p in model.named_parameters() if lora.is_adapter(n)})
    return model, cfg


def nf4_round_trip(w, double, block=64):
    packed, absmax = quant.nf4_quantize(w, block)
    if double:
        absmax = quant.double_dequantize(*quant.double_quantize(absmax))
    return quant.nf4_dequantize(packed, absmax, w.numel(), block).view(w.shape)


def batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 97, (2, 8), generator=g), torch.randint(0, 97, (2, 8), generator=g)


@pytest.mark.parametrize("double", [False, True])
def test_equals_dequantise_then_lora(double):
    model, _ = lora_model()
    ref = copy.deepcopy(model)
    with torch.no_grad():
        for m in lora.adapted(ref):
            m.weight.copy_(nf4_round_trip(m.weight, double))
    qlora.quantize(model, double=double, rest_dtype=None)
    assert len([m for m in model.modules() if isinstance(m, qlora.QLoRALinear)]) == 8
    assert not any(n.endswith(("qkv.weight", "fc.weight", "proj.weight")) for n, _ in model.named_parameters())
    opts = [torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2) for m in (model, ref)]
    for step in range(3):
        x, y = batch(step)
        losses = [m(x, y) for m in (model, ref)]
        assert torch.equal(losses[0], losses[1]), step
        for loss in losses:
            loss.backward()
        grads = [{n: p.grad for n, p in m.named_parameters() if p.requires_grad} for m in (model, ref)]
        assert grads[0].keys() == grads[1].keys() and all(torch.equal(grads[0][k], grads[1][k]) for k in grads[0])
        for o in opts:
            o.step()
            o.zero_grad()
    with torch.no_grad():
        assert torch.equal(model(x), ref(x))


def saved_shapes(model):
    """Shapes of the tensors autograd saves in a bf16-autocast forward of model."""
    shapes = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: shapes.append(tuple(t.shape)) or t, lambda t: t):
        with torch.autocast("cpu", torch.bfloat16):
            loss = model(*batch())
    loss.backward()
    return set(shapes)


def test_memory_and_dtypes():
    model, _ = lora_model()
    bases = {n: tuple(m.weight.shape) for n, m in model.named_modules() if isinstance(m, lora.LoRALinear)}
    weight_like = set(bases.values()) | {s[::-1] for s in bases.values()}  # a weight, or its transpose
    assert saved_shapes(copy.deepcopy(model)) & weight_like  # plain LoRA keeps its (bf16) base weights
    qlora.quantize(model, double=True)
    stored = sum(b.numel() * b.element_size() for n, b in model.named_buffers() if ".weight_" in n)
    assert stored == sum(qlora.nf4_bytes(s[0] * s[1]) for s in bases.values())
    frozen = {p.dtype for n, p in model.named_parameters() if not lora.is_adapter(n)}
    assert frozen == {torch.bfloat16} and {p.dtype for n, p in model.named_parameters() if lora.is_adapter(n)} == {torch.float32}
    assert not saved_shapes(model) & weight_like  # QLoRA: no (dequantised) base weight kept for backward


def test_hf_weights_and_peft_export(tmp_path):
    pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    import test_hf

    import hf
    base, folder = test_hf.build("llama", tmp_path / "hf", hidden_size=64, intermediate_size=128)
    ours = hf.load_hf(folder)
    cfg = train_cfg(dict(SMALL, **{k: getattr(ours.cfg, k) for k in ("vocab_size", "n_embd", "n_layer", "n_head",
                                                                       "n_kv_head", "ffn_hidden", "block_size")}))
    lora.apply(ours, cfg, grid())
    g = torch.Generator().manual_seed(9)
    lora.load(ours, grid(), {n: 0.2 * torch.randn(p.shape, generator=g) for n, p in ours.named_parameters()
                             if lora.is_adapter(n)})
    qlora.quantize(ours, double=False, rest_dtype=None)
    lora.save_peft(str(tmp_path / "adapter"), lora.gather(ours, grid()), cfg, base_model_name_or_path=folder)
    deq = copy.deepcopy(base)
    with torch.no_grad():
        for n, mod in deq.named_modules():
            if n.endswith(("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")):
                mod.weight.copy_(nf4_round_trip(mod.weight, double=False))
    theirs = peft.PeftModel.from_pretrained(deq, str(tmp_path / "adapter")).eval()
    x = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        diff = (theirs(input_ids=x).logits - ours.eval()(x)).abs().max().item()
        assert diff <= 1e-5, diff
        assert (base(input_ids=x).logits - ours(x)).abs().max().item() > 1e-3  # the adapters and NF4 matter


def test_merge_through_dequantized_state_and_refusals():
    model, cfg = lora_model()
    qlora.quantize(model, rest_dtype=None)
    x, _ = batch()
    weights = {k: v.detach() for k, v in model.state_dict().items()}
    weights.update(qlora.dequantized_state(model))
    plain = Transformer(ModelConfig.from_cfg(cfg))
    plain.load_state_dict(lora.merge_weights(weights, cfg))
    with torch.no_grad():
        assert (plain(x) - model(x)).abs().max().item() <= 1e-5
    with pytest.raises(ValueError, match="merge"):
        lora.merge(model)
    with pytest.raises(ValueError, match="lora.apply"):
        qlora.quantize(Transformer(ModelConfig.from_cfg(cfg)))


def test_equals_bitsandbytes_linear4bit():
    bnb = pytest.importorskip("bitsandbytes")
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(48, 128, generator=g), torch.randn(5, 128, generator=g)
    lin = bnb.nn.Linear4bit(128, 48, bias=False, compute_dtype=torch.float32, quant_type="nf4", compress_statistics=True)
    lin.weight = bnb.nn.Params4bit(w.clone(), requires_grad=False, quant_type="nf4", compress_statistics=True, blocksize=64)
    lin = lin.to("cpu")
    base = torch.nn.Linear(128, 48, bias=False)
    base.weight.data.copy_(w)
    cfg = train_cfg(SMALL)
    m = lora.LoRALinear(base, [("self_attn.o_proj", 48)], {"o_proj"}, 4, 2.0, 0.0, torch.Generator().manual_seed(0), grid())
    q = qlora.QLoRALinear(m, block=64, double=True)
    with torch.no_grad():
        assert torch.equal(q.base_forward(x), lin(x)) and cfg.lora_r == 4
