"""LoRA (lora.py) against PEFT and against one process.

Proves:
- a fresh adapter leaves the logits unchanged (B = 0), A is drawn as PEFT draws it (kaiming-uniform
  a = sqrt 5: within +-1/sqrt(fan_in), filling that range), only adapters train, the base is frozen;
- PEFT parity (transformers + peft on tiny random LLaMA and GPT-2 models, fp32, max abs diff
  <= 1e-5): an adapter saved by PEFT (random A and B, all-linear or q/v only, rsLoRA) loads into ours
  with equal logits; ours saved in PEFT's format loads in PEFT with equal logits; merge_weights
  equals merge_and_unload's weights (through hf.export_hf's names); in-place merge gives the
  adapter's logits and unmerge restores the base weights;
- layouts (gloo, 3 AdamW steps with clipping and two accumulated micro-steps, adapters started
  non-zero so that every factor's gradient is live from step 1): DP2, FSDP2, TP2 (one 2-process spawn) and TP2 x DP2, TP2 x FSDP2,
  TP4 with kv heads shared by two ranks (one 4-process spawn) give the one-process adapters
  (relative error <= 1e-5) and losses; after every step the adapters are bitwise identical on every
  rank (the TP replicas of A and B never drift); the base never changes; under FSDP the frozen base
  is sharded (each rank holds 1/dp of it) and the optimizer state covers the adapters' shards only;
- MoE: attention and dense MLP layers are adapted, the MoE blocks (router, experts) are not and
  stay frozen through training steps; lora_base_dtype="bfloat16" stores the frozen base in bf16 and
  trains under autocast; bad settings and an adapter that does not fit raise errors that say so.
"""
import contextlib
import copy
import json
import math
import os
from dataclasses import asdict

import distributed
import pytest
import torch
from distributed import assert_close, spawn, train_cfg

import config
import lora
import parallel
from model import ModelConfig, Transformer

T, STEPS, V = 16, 3, 97
SMALL = dict(vocab_size=V, pad_vocab_multiple=32, n_layer=2, n_head=4, n_kv_head=2, n_embd=32, block_size=T,
             lr=1e-2, weight_decay=0.1, grad_clip=0.05, eps=1e-6, warmup_steps=0, schedule="constant",
             lora_r=4, lora_alpha=8.0)


def small_cfg(**kw):
    return train_cfg(SMALL, **kw)


def one_grid():
    return parallel.init(small_cfg())  # no WORLD_SIZE: one process, no process group


def random_adapters(model, seed):
    """Full random adapter tensors shaped like model's (a one-process model)."""
    g = torch.Generator().manual_seed(seed)
    return {n: 0.3 * torch.randn(p.shape, generator=g) for n, p in model.named_parameters() if lora.is_adapter(n)}


def test_fresh_adapter_is_identity_and_frozen_base():
    cfg = small_cfg()
    torch.manual_seed(0)
    model = Transformer(ModelConfig.from_cfg(cfg))
    x = torch.randint(0, V, (2, T))
    with torch.no_grad():
        before = model(x)
    lora.apply(model, cfg, one_grid())
    with torch.no_grad():
        assert torch.equal(model(x), before)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(lora.is_adapter(n) for n in trainable)
    names = {n.split("lora_")[1] for n in trainable}
    assert names == {f"{f}.{k}" for f in "AB" for k in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                         "up_proj", "down_proj")}
    A = model.blocks[0].attn.qkv.lora_A["q_proj"]
    bound = 1 / math.sqrt(32)  # kaiming_uniform(a=sqrt(5)) on (r, fan_in): U(-1/sqrt(fan_in), 1/sqrt(fan_in))
    assert A.shape == (4, 32) and A.abs().max() <= bound and A.abs().max() > 0.7 * bound
    assert all(not p.any() for n, p in model.named_parameters() if "lora_B" in n)
    # q/v only: k gets zero rows of the block-diagonal B, and no parameters
    model = lora.apply(Transformer(ModelConfig.from_cfg(cfg)), small_cfg(lora_targets="q_proj, v_proj"), one_grid())
    assert set(model.blocks[1].attn.qkv.lora_A) == {"q_proj", "v_proj"} and model.blocks[1].mlp.fc is not None
    assert not any("mlp" in n for n, _ in model.named_parameters() if lora.is_adapter(n))


def test_moe_adapts_attention_only():
    cfg = small_cfg(n_experts=4, moe_top_k=2, moe_first_dense=1, n_shared_experts=1)
    torch.manual_seed(0)
    model = Transformer(ModelConfig.from_cfg(cfg))
    init = {k: v.clone() for k, v in model.state_dict().items()}
    run = parallel.parallelize(model, one_grid(), cfg)
    adapters = {n for n, p in model.named_parameters() if p.requires_grad}
    assert {n.split(".lora_")[0] for n in adapters} == {
        "blocks.0.attn.qkv", "blocks.0.attn.proj", "blocks.0.mlp.fc", "blocks.0.mlp.proj",  # dense layer 0
        "blocks.1.attn.qkv", "blocks.1.attn.proj"}  # MoE layer 1: attention only
    lora.load(model, run.grid, random_adapters(model, 1))
    for s in range(2):
        run.fwd(*distributed.global_batch(s, T, V)).backward()
        run.wrapper.finish()
        run.clip_grad_norm_(1.0)
        run.optimizer.step()
        run.wrapper.zero_grad()
    after = model.state_dict()
    assert all(torch.equal(after[k], init[k]) for k in init)  # the base, experts and router included
    assert sum(len(g["params"]) for g in run.optimizer.param_groups) == len(adapters)


@pytest.mark.parametrize("kw, msg", [
    (dict(lora_targets="q_proj,wq"), "unknown module names ['wq']"),
    (dict(lora_base_dtype="bfloat16"), "needs bf16 autocast"),
    (dict(n_experts=4, moe_first_dense=0, lora_targets="gate_proj"), "adapts nothing"),
])
def test_bad_settings(kw, msg):
    cfg = small_cfg(**kw)
    with pytest.raises(ValueError, match=msg.replace("[", r"\[").replace("]", r"\]")):
        lora.apply(Transformer(ModelConfig.from_cfg(cfg)), cfg, one_grid())


def test_config_refuses():
    for kw, msg in [(dict(lora_r=-1), "lora_r"), (dict(lora_r=4, optimizer="muon"), "AdamW"),
                    (dict(lora_base_dtype="fp16"), "lora_base_dtype")]:
        with pytest.raises(config.ConfigError, match=msg):
            config.validate(small_cfg(**kw))


def test_bf16_base():
    """lora_base_dtype='bfloat16': every frozen tensor stored in bf16 (half the bytes), adapters fp32,
    trains under bf16 autocast; the loss stays within bf16 rounding of the fp32 model's."""
    cfg = small_cfg(lora_base_dtype="bfloat16", dtype="bfloat16")
    torch.manual_seed(0)
    ref = lora.apply(Transformer(ModelConfig.from_cfg(cfg)), small_cfg(), one_grid())
    torch.manual_seed(0)
    model = lora.apply(Transformer(ModelConfig.from_cfg(cfg)), cfg, one_grid())
    init = random_adapters(model, 5)
    lora.load(model, one_grid(), init)
    lora.load(ref, one_grid(), init)
    dtypes = {n: p.dtype for n, p in model.named_parameters()}
    assert all(d == (torch.float32 if lora.is_adapter(n) else torch.bfloat16) for n, d in dtypes.items())
    x, y = distributed.global_batch(0, T, V)
    with torch.autocast("cpu", torch.bfloat16):
        loss = model(x, y)
    loss.backward()
    assert abs(loss.item() - ref(x, y).item()) < 0.05 * loss.item()
    assert all((p.grad is not None) == lora.is_adapter(n) for n, p in model.named_parameters())


# ----------------------------------------------------------------------------- against PEFT

PEFT_CASES = {  # name -> (architecture of tests/test_hf.py, PEFT target_modules, use_rslora)
    "llama_all": ("llama", ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], False),
    "llama_qv_rslora": ("llama", ["q_proj", "v_proj"], True),
    "gpt2": ("gpt2", ["c_attn", "c_proj", "c_fc"], False),
}


@pytest.fixture(scope="module", params=list(PEFT_CASES))
def peft_case(request, tmp_path_factory):
    """(HF base model, its folder, PEFT model with random A and B, that adapter's folder)."""
    pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    import test_hf  # tiny random HF models, built offline
    arch, modules, rslora = PEFT_CASES[request.param]
    base, folder = test_hf.build(arch, tmp_path_factory.mktemp(request.param))
    torch.manual_seed(1)
    pm = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=modules, lora_dropout=0.0, use_rslora=rslora, init_lora_weights=False,
        fan_in_fan_out=arch == "gpt2")).eval()
    adapter = str(tmp_path_factory.mktemp(request.param + "_adapter"))
    pm.save_pretrained(adapter)
    return base, folder, pm, adapter


def ours_with(folder, adapter_cfg):
    """Our model from an HF folder, with LoRA configured as adapter_cfg (lora_* keys) -> (model, cfg)."""
    import hf
    model = hf.load_hf(folder)
    cfg = small_cfg(**{k: v for k, v in asdict(model.cfg).items()}, **adapter_cfg)
    return lora.apply(model, cfg, one_grid()), cfg


def ids(seed):
    return torch.randint(0, V, (2, 12), generator=torch.Generator().manual_seed(seed))


def max_diff(a, b):
    return (a - b).abs().max().item()


@torch.no_grad()
def test_peft_adapter_loads_into_ours(peft_case):
    base, folder, pm, adapter = peft_case
    ours, _ = ours_with(folder, lora.peft_config(adapter))
    lora.load_peft(adapter, ours, one_grid())
    x = ids(0)
    assert max_diff(pm(input_ids=x).logits, base(x).logits) > 1e-2  # the adapter matters
    assert max_diff(ours(x), pm(input_ids=x).logits) <= 1e-5
    conf = lora.peft_config(adapter)
    fewer, _ = ours_with(folder, dict(conf, lora_targets=conf["lora_targets"].split(",")[0]))
    with pytest.raises(ValueError, match="does not fit this model's adapters"):
        lora.load_peft(adapter, fewer, one_grid())


@torch.no_grad()
def test_ours_loads_into_peft(peft_case, tmp_path):
    peft = pytest.importorskip("peft")
    base, folder, pm, adapter = peft_case
    ours, cfg = ours_with(folder, lora.peft_config(adapter))
    lora.load(ours, one_grid(), random_adapters(ours, 7))
    lora.save_peft(str(tmp_path), lora.gather(ours, one_grid()), cfg, base_model_name_or_path=folder)
    conf = json.load(open(tmp_path / "adapter_config.json"))
    assert conf["peft_type"] == "LORA" and conf["task_type"] == "CAUSAL_LM" and conf["bias"] == "none"
    theirs = peft.PeftModel.from_pretrained(copy.deepcopy(base), str(tmp_path)).eval()
    x = ids(1)
    assert max_diff(theirs(input_ids=x).logits, ours(x)) <= 1e-5
    assert max_diff(theirs(input_ids=x).logits, pm(input_ids=x).logits) > 1e-2  # a different adapter


@torch.no_grad()
def test_merge_equals_merge_and_unload(peft_case, tmp_path):
    from safetensors.torch import load_file

    import hf
    base, folder, pm, adapter = peft_case
    ours, cfg = ours_with(folder, lora.peft_config(adapter))
    lora.load_peft(adapter, ours, one_grid())
    x = ids(2)
    with_adapter = ours(x)
    merged = lora.merge_weights(ours.state_dict(), cfg)
    plain = Transformer(ours.cfg)
    plain.load_state_dict(merged)  # the plain model's keys exactly
    hf.export_hf(plain, str(tmp_path))
    got = load_file(str(tmp_path / "model.safetensors"))
    ref = copy.deepcopy(pm).merge_and_unload().state_dict()
    assert set(got) <= set(ref)
    for k in got:
        assert max_diff(got[k], ref[k]) <= 1e-6, k
    assert max_diff(plain.eval()(x), with_adapter) <= 1e-5
    weights = {n: p.clone() for n, p in ours.named_parameters() if not lora.is_adapter(n)}
    lora.merge(ours)
    assert max_diff(ours(x), with_adapter) <= 1e-5
    lora.unmerge(ours)
    assert all(max_diff(p, weights[n]) <= 1e-6 for n, p in ours.named_parameters() if n in weights)
    assert max_diff(ours(x), with_adapter) <= 1e-5


# ----------------------------------------------------------------------------- layouts

LAYOUTS = {"dp2": (1, "ddp"), "fsdp2": (1, "fsdp"), "tp2": (2, "ddp"),  # world 2
           "tp2_dp2": (2, "ddp"), "tp2_fsdp2": (2, "fsdp"), "tp4": (4, "ddp")}  # world 4


def train(cfg, grid, init_adapters, steps=STEPS):
    """parallelize a fresh model (seed 0) with LoRA, set the adapters, train `steps` steps on this
    data rank's share of the global batches -> record of what the test compares."""
    torch.manual_seed(0)
    model = Transformer(ModelConfig.from_cfg(cfg))
    base = {k: v.clone() for k, v in model.state_dict().items()}
    run = parallel.parallelize(model, grid, cfg)
    lora.load(run.raw, grid, init_adapters, run.wrapper)
    per = distributed.G // grid.data_world
    rec = {"adapters": [], "losses": []}
    for s in range(steps):
        x, y = (t[grid.data_rank * per:(grid.data_rank + 1) * per] for t in distributed.global_batch(s, T, V))
        loss = 0.0
        for i, (xm, ym) in enumerate(zip(x.chunk(2), y.chunk(2))):  # two micro-steps: gradient accumulation
            with run.wrapper.no_sync() if i == 0 else contextlib.nullcontext():
                micro = run.fwd(xm, ym) / 2
                micro.backward()
            loss = loss + micro.detach()
        run.wrapper.finish()
        run.clip_grad_norm_(cfg.grad_clip)
        run.optimizer.step()
        run.wrapper.zero_grad()
        rec["losses"].append(loss)
        rec["adapters"].append(lora.gather(run.raw, grid, run.wrapper))
    with run.full_params():
        full = parallel.full_state_dict(run.raw, grid)
    rec["base_same"] = all(torch.equal(full[k], base[k]) for k in base)
    rec["opt_numel"] = sum(v.numel() for st in run.optimizer.state.values() for k, v in st.items() if k == "exp_avg")
    if cfg.data_parallel == "fsdp":
        rec["frozen_numel"] = sum(u.shard.numel() for u in run.wrapper.frozen)
        rec["unit_numel"] = sum(u.shard.numel() for u in run.wrapper.units)
        rec["units_adapters_only"] = all(lora.is_adapter(ns[0]) for u in run.wrapper.units for ns, _, _ in u.params)
    return rec


def _layouts(rank, out_dir, names, init_adapters):
    for name in names:
        tp_size, dp = LAYOUTS[name]
        cfg = small_cfg(tp=tp_size, data_parallel=dp)
        grid = parallel.init(cfg)
        torch.save(train(cfg, grid, init_adapters), os.path.join(out_dir, f"{name}_{rank}.pt"))


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    cfg = small_cfg()
    model = lora.apply(Transformer(ModelConfig.from_cfg(cfg)), cfg, one_grid())
    init = random_adapters(model, 3)
    path = tmp_path_factory.mktemp("lora_ref")
    torch.save(init, path / "init.pt")
    base_numel = sum(p.numel() for n, p in model.named_parameters() if not lora.is_adapter(n))
    return train(cfg, one_grid(), init), init, base_numel


def check_layout(tmp_path, name, world, ref, base_numel):
    recs = [torch.load(tmp_path / f"{name}_{r}.pt") for r in range(world)]
    for s in range(STEPS):  # every rank holds the same adapters, bit for bit, after every step
        for r, rec in enumerate(recs[1:], 1):
            for k, v in recs[0]["adapters"][s].items():
                assert torch.equal(rec["adapters"][s][k], v), f"{name} step {s}: rank {r} {k} drifted"
    assert_close(recs[0]["adapters"][-1], ref["adapters"][-1], name)
    assert all(rec["base_same"] for rec in recs), f"{name}: the frozen base changed"
    # TP partners report their data rank's loss: the mean over all ranks is the global batch's
    losses = torch.stack([torch.stack(rec["losses"]) for rec in recs]).mean(0)
    assert_close(losses, torch.stack(ref["losses"]), f"{name} losses")
    tp_size, dp_kind = LAYOUTS[name]
    dp = world // tp_size
    adapter_numel = sum(v.numel() for v in ref["adapters"][-1].values())
    assert ref["opt_numel"] == adapter_numel
    for rec in recs:
        if dp_kind == "fsdp":  # base sharded over dp (its TP slices); optimizer state: adapter shards only
            assert rec["units_adapters_only"] and rec["opt_numel"] == rec["unit_numel"]
            assert rec["unit_numel"] <= adapter_numel / dp + 3 * 16  # + padding (a few units)
            assert rec["frozen_numel"] <= base_numel / dp + 3 * 16
        elif tp_size == 1:
            assert rec["opt_numel"] == adapter_numel


@pytest.mark.parametrize("world, names", [(2, ["dp2", "fsdp2", "tp2"]), (4, ["tp2_dp2", "tp2_fsdp2", "tp4"])])
def test_layouts_equal_one_process(tmp_path, reference, world, names):
    ref, init, base_numel = reference
    spawn(_layouts, world, str(tmp_path), names, init)
    for name in names:
        check_layout(tmp_path, name, world, ref, base_numel)
