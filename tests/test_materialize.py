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
  qlora.quantize) gives the logits of the same path from hf.load_hf;
- weights.build_model (the stages' build): a random LoRA base in bf16 is built in bf16 (peak = its size); an
  fp32 LoRA base and full training keep the CPU-built fp32 model bitwise;
- embed_on_host (parallelize -> host_embedding): a LoRA run with a token row trained (train_tokens'
  hook on the embedding) gives bitwise the losses and adapters of the same run without it over 3
  steps; the table is a HostEmbedding that .to() / .double() leave in place, with the same state-dict
  keys; an embedding that trains or is tied to the head is refused.
"""
import pytest
import torch
from distributed import train_cfg
from meter import PeakBytes

import hf
import lora
import parallel
from memory import materialize, qlora
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


def test_stage_builds_a_random_lora_base_in_its_storage_dtype():
    """weights.build_model, the stage scripts' build: LoRA over a bf16 base without init_from (random
    weights, sft.py --init_from=) is built straight in bf16, peaking at its own size, never the fp32
    model; a LoRA base kept in fp32 and full training keep the CPU-built fp32 model (bitwise today's)."""
    import weights
    kw = dict(vocab_size=1000, n_layer=8, n_head=4, n_embd=64, block_size=64, device="cpu", init_from="")
    cfg = train_cfg(kw, lora_r=4, lora_base_dtype="bfloat16", dtype="bfloat16")
    grid = parallel.init(cfg)
    with PeakBytes() as built:
        m = weights.build_model(cfg, grid)
    size = sum(p.numel() * p.element_size() for p in m.parameters()) + 2 * 64 * 8 * 4  # + fp32 RoPE tables
    assert {p.dtype for p in m.parameters()} == {torch.bfloat16} and built.peak <= size * 1.02, (built.peak, size)
    w = m.blocks[0].mlp.fc.weight.float()
    assert abs(w.std().item() - m.cfg.init_std) < 0.1 * m.cfg.init_std
    for other in (dict(lora_r=4), dict(lora_r=0)):  # fp32: the CPU-built model from the seed
        c = train_cfg(kw, **other)
        torch.manual_seed(c.seed)
        want = Transformer(ModelConfig.from_cfg(c)).state_dict()
        got = weights.build_model(c, parallel.init(c)).state_dict()
        assert all(torch.equal(got[k], want[k]) for k in want)


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


def test_embed_on_host_equals_the_embedding_on_the_device():
    base = dict(vocab_size=128, n_layer=2, n_head=4, n_kv_head=2, n_embd=32, ffn_hidden=64, block_size=16,
                lora_r=4, lora_alpha=8.0, lr=1e-2, batch_size=2, micro_batch_size=2)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randint(0, 128, (3, 2, 16), generator=g), torch.randint(0, 128, (3, 2, 16), generator=g)
    runs = []
    for host in (False, True):
        cfg = train_cfg(base, embed_on_host=host)
        grid = parallel.init(cfg)
        torch.manual_seed(0)
        model = Transformer(ModelConfig.from_cfg(cfg))
        lora.train_tokens(model, [int(x[0, 0, 0])], grid)  # a hook on the embedding's output
        net = parallel.parallelize(model, grid, cfg)
        losses = []
        for i in range(3):
            loss = net(x[i], y[i])
            net.backward(loss)
            net.step(1.0)
            losses.append(loss.item())
        runs.append((losses, {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}, model))
    (l0, a0, m0), (l1, a1, m1) = runs
    assert l0 == l1 and a0.keys() == a1.keys() and all(torch.equal(a0[k], a1[k]) for k in a0)
    assert isinstance(m1.tok_emb, materialize.HostEmbedding) and m1.state_dict().keys() == m0.state_dict().keys()
    m1.double()
    assert m1.tok_emb.weight.dtype == torch.float32 and m1.blocks[0].norm1.weight.dtype == torch.float64
    tied = Transformer(ModelConfig(vocab_size=64, n_layer=1, n_head=2, n_embd=16, block_size=8, tie_embeddings=True))
    with pytest.raises(ValueError, match="tied to the head"):
        materialize.host_embedding(tied.requires_grad_(False))
    with pytest.raises(ValueError, match="trains"):
        materialize.host_embedding(Transformer(ModelConfig(vocab_size=64, n_layer=1, n_head=2, n_embd=16, block_size=8)))
