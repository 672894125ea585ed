"""materialize.build: a model built straight into its storage dtype equals the usual one, and never
holds more than itself.

Proves:
- init=False + hf.load_weights of a tiny HF LLaMA folder gives bitwise the parameters of
  hf.load_hf(folder) cast to bf16, fp32 RoPE tables equal to a CPU-built model's, and the same logits;
  a tied head stays tied (GPT-2);
- measured on CPU (tests/meter.py): building an 8-block bf16 model peaks at its own size (+ RoPE
  tables), where Transformer(cfg).to(bf16), today's path, peaks at the fp32 model and more;
- init=True: norms are ones, matrices are N(0, init_std) (std within 10%); linear_device places the
  blocks' linears apart from the rest; the QLoRA path (bf16 build, HF weights, lora.apply,
  qlora.quantize) gives the logits of the same path from hf.load_hf.
"""
import torch

import hf
import lora
import parallel
import qlora
import materialize
from distributed import train_cfg
from meter import PeakBytes
from model import ModelConfig, Transformer


def test_load_into_bf16_build_equals_load_hf(tmp_path):
    import test_hf
    for arch in ("llama", "gpt2"):
        _, folder = test_hf.build(arch, tmp_path / arch)
        ref = hf.load_hf(folder).to(torch.bfloat16)
        m = materialize.build(ref.cfg, "cpu", torch.bfloat16, init=False)
        hf.load_weights(folder, m)
        sd, rd = m.state_dict(), ref.state_dict()
        assert sd.keys() == rd.keys() and all(torch.equal(sd[k], rd[k]) and sd[k].dtype == rd[k].dtype for k in rd)
        if ref.cfg.pos_emb == "rope":
            plain = Transformer(ref.cfg)
            assert m.rope_cos.dtype == torch.float32 and torch.equal(m.rope_cos, plain.rope_cos)
            assert torch.equal(m.rope_sin, plain.rope_sin)
        if ref.cfg.tie_embeddings:
            assert m.head.weight is m.tok_emb.weight
        x = torch.randint(0, 97, (2, 10))
        with torch.no_grad():
            assert torch.equal(m.eval()(x), ref.eval()(x))


def test_peak_is_the_model():
    mcfg = ModelConfig(vocab_size=1000, n_layer=8, n_head=4, n_embd=64, block_size=64)
    with PeakBytes() as built:
        m = materialize.build(mcfg, "cpu", torch.bfloat16, init=True)
    size = sum(p.numel() * p.element_size() for p in m.parameters()) + 2 * 64 * 8 * 4  # + fp32 RoPE tables
    assert built.peak <= size * 1.02, (built.peak, size)
    with PeakBytes() as today:
        Transformer(mcfg).to(torch.bfloat16)
    assert today.peak >= 2 * size * 0.95  # the fp32 model existed first
    norms = [p for n, p in m.named_parameters() if "norm" in n]
    assert all(torch.equal(p, torch.ones_like(p)) for p in norms)
    w = m.blocks[0].mlp.fc.weight.float()
    assert abs(w.std().item() - mcfg.init_std) < 0.1 * mcfg.init_std
    apart = materialize.build(mcfg, "cpu", torch.bfloat16, init=False, linear_device="meta")
    devices = {n: p.device.type for n, p in apart.named_parameters()}
    assert all((d == "meta") == (n.startswith("blocks.") and n.endswith(("qkv.weight", "proj.weight", "fc.weight")))
               for n, d in devices.items())


def test_qlora_path_equals_load_hf(tmp_path):
    import test_hf
    _, folder = test_hf.build("llama", tmp_path / "hf", hidden_size=64, intermediate_size=128)
    cfg_of = lambda m: train_cfg(dict(lora_r=4, lora_alpha=8.0, lora_base_dtype="float32",  # noqa: E731
                                      **{k: getattr(m.cfg, k) for k in ("vocab_size", "n_embd", "n_layer", "n_head",
                                                                       "n_kv_head", "ffn_hidden", "block_size")}))
    out = []
    for built in (False, True):
        if built:
            mcfg = hf.config_from_hf(hf.read_config(folder))
            m = hf.load_weights(folder, materialize.build(mcfg, "cpu", torch.bfloat16, init=False, linear_device="cpu"))
        else:
            m = hf.load_hf(folder).to(torch.bfloat16)
        cfg = cfg_of(m)
        lora.apply(m, cfg, parallel.init(cfg))
        qlora.quantize(m, device="cpu")
        with torch.no_grad(), torch.autocast("cpu", torch.bfloat16):
            out.append(m.eval()(torch.randint(0, 97, (2, 10), generator=torch.Generator().manual_seed(0))))
    assert torch.equal(out[0], out[1])
