"""The memory knobs of issue 34 wired into the spine: config keys -> parallelize / Net / lifecycle.

Proves (CPU, one process unless said):
- parallelize applies each knob: loss_chunk -> chunked's head_loss, recompute -> recompute's wrappers
  on the k-th blocks, adamw_state -> optim_memory's optimizers (under Muon its AdamW part),
  lora_base_dtype=nf4 -> qlora's 4-bit linears; an fp16 compute dtype gives the Net a loss scaler;
- Net.backward / Net.step under fp16 equal torch.amp.GradScaler's recipe (scale, unscale, clip,
  AdamW step, update) over 4 steps with an overflow forced at step 2: the same scales, the same
  skipped step, weights within 1e-5 (relative); the skipped step leaves weights and optimizer alone;
- fp16 on the CPU is accepted (torch has fp16 autocast there): pretrain.py trains with a loss
  scaler, and a run stopped at step 2 and resumed logs the uninterrupted run's losses exactly and
  ends with the same scaler state (restored from trainer.pt: a fresh scaler would have counted
  half the clean steps); settings fp16 (or an NF4 base in fp32) cannot run with stop the script
  with one line, exit status 2, before out_dir exists;
- the knobs that do not change the math keep it through pretrain.py (loss_chunk + recompute=mlp
  every 2nd block + adamw_state=offload + offload_activations: the fp32 run's losses within 1e-5;
  optimizer_in_backward with grad_checkpoint: torch AdamW's losses within 1e-5, each update done
  in backward, no gradient left), and a resumed run may change them (RESUME_FREE); a changed
  adamw_state is refused; optimizer_in_backward with clipping, micro-batches, 8-bit state or two
  processes, offload_activations without a recompute, embed_on_host without LoRA: config.load's ConfigError (the one-line path);
- --gpu_memory=24 prints plan.py's table (and, for a budget it exceeds, fit()'s knobs) and exits 0
  before any work: no out_dir, no data folder (pretrain.py, sft.py).
"""
import concurrent.futures
import copy
import json
import os
import re
import subprocess
import sys

import pytest
import torch
from distributed import assert_close, train_cfg

import config
import lifecycle
import lora
import parallel
import plan
from memory import optim_memory, qlora, recompute
from model import ModelConfig, Transformer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
SMALL = ["--max_docs=40", "--tokenizer_vocab=512", "--n_layer=2", "--n_head=2", "--n_embd=32",
         "--block_size=32", "--batch_size=4", "--micro_batch_size=2", "--lr=3e-3", "--warmup_steps=2",
         "--log_every=1", "--eval_every=0", "--sample_tokens=0", "--progress=False", "--device=cpu"]
MODEL = dict(vocab_size=97, pad_vocab_multiple=32, n_layer=4, n_head=4, n_kv_head=2, n_embd=32, block_size=16,
             lr=3e-3, eps=1e-6, grad_clip=0.5)


def script(name, args):
    return subprocess.run([sys.executable, os.path.join(ROOT, name)] + args, cwd=ROOT, env=ENV,
                          capture_output=True, text=True, timeout=600)


def pretrain(args, check=True):
    r = script("pretrain.py", SMALL + args)
    if check and r.returncode != 0:
        raise AssertionError(f"pretrain failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    return r


def losses(out_dir):
    with open(os.path.join(out_dir, "train_metrics.jsonl")) as f:
        return {r["step"]: r["loss"] for r in map(json.loads, f) if "loss" in r}


def trainer(out_dir, step):
    return torch.load(os.path.join(out_dir, f"step_{step:06d}", "trainer.pt"), weights_only=True)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("data"))


# ----------------------------------------------------------------------------- parallelize

def test_parallelize_applies_each_knob():
    def net_of(**kw):
        cfg = train_cfg(MODEL, **kw)
        torch.manual_seed(0)
        return parallel.parallelize(Transformer(ModelConfig.from_cfg(cfg)), parallel.init(cfg), cfg)
    plain = net_of()
    assert type(plain.optimizer) is torch.optim.AdamW and plain.scaler is None
    assert not isinstance(plain.raw.blocks[0].mlp.forward, recompute.Checkpointed)
    net = net_of(loss_chunk=8, recompute="mlp", recompute_every=2, adamw_state="8bit")
    assert net.raw.loss_chunk == 8 and net.raw.head_loss.__func__.__module__ == "memory.chunked"
    wrapped = [isinstance(b.mlp.forward, recompute.Checkpointed) for b in net.raw.blocks]
    assert wrapped == [True, False, True, False]
    assert isinstance(net.optimizer, optim_memory.AdamW8bit)
    assert isinstance(net_of(adamw_state="offload").optimizer, optim_memory.OffloadAdamW)
    assert isinstance(net_of(optimizer="muon", adamw_state="8bit").optimizer.adamw, optim_memory.AdamW8bit)
    assert net_of(dtype="float16").scaler is not None
    inb = net_of(optimizer_in_backward=True, grad_clip=0.0, grad_checkpoint=True, offload_activations=True)
    assert isinstance(inb.optimizer, optim_memory.InBackwardAdamW)
    assert all(isinstance(b.forward, recompute.Checkpointed) and b.forward.offloader for b in inb.raw.blocks)
    x = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(0))
    before = [p.detach().clone() for p in inb.raw.parameters()]
    inb.backward(inb(x, x))  # the update happens here
    assert all(p.grad is None for p in inb.raw.parameters())
    assert not any(torch.equal(a, p) for a, p in zip(before, inb.raw.parameters()))
    assert inb.step(0.0) > 0  # the norm of the gradients the update saw
    q = net_of(lora_r=4, lora_base_dtype="nf4", dtype="bfloat16")
    assert len(qlora.dequantized_state(q.raw)) == len(lora.adapted(q.raw)) > 0
    assert all(isinstance(m, qlora.QLoRALinear) for m in lora.adapted(q.raw))
    weights, _ = q.full_state()  # a QLoRA checkpoint holds the dequantised base: a complete model
    assert set(weights) == set(Transformer(ModelConfig.from_cfg(train_cfg(MODEL))).state_dict()) | {
        k for k in weights if "lora_" in k}


def test_fp16_net_step_equals_torch_grad_scaler():
    """Ours: parallelize(dtype=float16); theirs: fp16 autocast + torch.amp.GradScaler + AdamW + clip."""
    cfg = train_cfg(MODEL, dtype="float16")
    grid = parallel.init(cfg)
    torch.manual_seed(0)
    model = Transformer(ModelConfig.from_cfg(cfg))
    ref = copy.deepcopy(model)
    net = parallel.parallelize(model, grid, cfg)
    opt = torch.optim.AdamW(ref.parameters(), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                            weight_decay=0.0, foreach=True)
    for g in net.optimizer.param_groups:
        g["weight_decay"] = 0.0  # one group in the reference: no decay anywhere
    ts = torch.amp.GradScaler("cpu")
    g = torch.Generator().manual_seed(1)
    for step in range(4):
        x, y = torch.randint(0, 97, (2, 16), generator=g), torch.randint(0, 97, (2, 16), generator=g)
        boom = float("inf") if step == 2 else 1.0  # an overflow: every gradient inf / NaN
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        with parallel.autocast(cfg, grid.device):
            loss = net(x, y) * boom
        net.backward(loss)
        norm = net.step(cfg.grad_clip)
        with torch.autocast("cpu", dtype=torch.float16):
            theirs = ref(x, y) * boom
        ts.scale(theirs).backward()
        ts.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(ref.parameters(), cfg.grad_clip)
        ts.step(opt)
        ts.update()
        opt.zero_grad(set_to_none=True)
        assert net.scaler.scale_value == ts.get_scale(), step
        if step == 2:  # skipped: weights and AdamW's step count untouched, the scale halved
            assert norm.item() == float("inf") and net.scaler.scale_value == 2.0 ** 15
            assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
            assert all(s["step"].item() == 2 for s in net.optimizer.state.values())
        assert_close(dict(model.named_parameters()), dict(ref.named_parameters()), f"step {step}")


# ----------------------------------------------------------------------------- the stage scripts

def test_fp16_on_cpu_trains_and_resumes_exactly(tmp_path, data_dir):
    common = [f"--data_dir={data_dir}", "--max_steps=4", "--ckpt_every=2", "--dtype=float16", "--dropout=0.1"]
    full, part = str(tmp_path / "full"), str(tmp_path / "part")
    r = pretrain(common + [f"--out_dir={full}"])
    assert "torch.float16" in r.stdout  # the layout line names the compute dtype
    pretrain(common + [f"--out_dir={part}", "--stop_at=2"])
    pretrain(common + [f"--out_dir={part}", "--resume"])
    assert losses(full) == losses(part) and sorted(losses(part)) == [1, 2, 3, 4]
    assert trainer(full, 4)["scaler"] == trainer(part, 4)["scaler"]
    assert trainer(full, 4)["scaler"]["growth_tracker"] == 4  # four clean steps, two of them after the resume


@pytest.mark.parametrize("args, msg", [
    (["--dtype=float16", "--lora_r=4", "--lora_base_dtype=bfloat16"], "dtype='float16' with lora_base_dtype='bfloat16'"),
    (["--dtype=float16", "--grad_reduce_dtype=bfloat16"], "dtype='float16' with grad_reduce_dtype='bfloat16'"),
    (["--lora_r=4", "--lora_base_dtype=nf4"], "lora_base_dtype='nf4' computes in 16 bits"),
    (["--recompute=mlp", "--grad_checkpoint=True"], "both recompute"),
    (["--adamw_state=4bit"], "adamw_state='4bit' must be fp32, 8bit or offload"),
])
def test_refusals_are_one_line_before_work(tmp_path, args, msg):
    out = tmp_path / "out"
    r = pretrain([f"--data_dir={tmp_path}/data", f"--out_dir={out}"] + args, check=False)
    assert r.returncode == 2 and msg in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert len(r.stderr.strip().splitlines()) == 1 and not out.exists()


@pytest.mark.parametrize("args, msg", [
    (["--optimizer_in_backward=True"], "set grad_clip=0 (now 1.0)"),
    (["--optimizer_in_backward=True", "--grad_clip=0"], "set micro_batch_size >= batch_size=4"),
    (["--optimizer_in_backward=True", "--grad_clip=0", "--micro_batch_size=4", "--adamw_state=8bit"],
     "AdamW with fp32 state"),
    (["--offload_activations=True"], "set grad_checkpoint=True or recompute"),
    (["--embed_on_host=True"], "it needs lora_r > 0, tie_embeddings=False"),
])
def test_memory_knob_refusals(args, msg):  # config.validate as above, in this process (no start-up)
    shared = ["--batch_size=4", "--micro_batch_size=2", "--device=cpu"]
    with pytest.raises(config.ConfigError, match=re.escape(msg)):
        config.load(shared + args, extra=lifecycle.TRAIN)  # load validates
    config.load(shared + ["--optimizer_in_backward=True", "--grad_clip=0", "--micro_batch_size=4"],
                extra=lifecycle.TRAIN)  # accepted
    with pytest.raises(config.ConfigError, match="one process only"):
        config.load(["--batch_size=8", "--micro_batch_size=4", "--device=cpu", "--optimizer_in_backward=True",
                     "--grad_clip=0"], extra=lifecycle.TRAIN, world=2)


def test_knobs_keep_the_math_and_may_change_on_resume(tmp_path, data_dir):
    common = [f"--data_dir={data_dir}", "--max_steps=6", "--ckpt_every=3"]
    base, knobs, part = (str(tmp_path / n) for n in ("base", "knobs", "part"))
    whole = ["--micro_batch_size=4", "--grad_clip=0"]  # the update in backward: one micro-batch, no clipping
    plain, inb = str(tmp_path / "plain"), str(tmp_path / "inb")

    def resumes():  # stopped at 3, resumed with other knobs; then a knob that changes the math, refused
        pretrain(common + [f"--out_dir={part}", "--stop_at=3"])
        r = pretrain(common + [f"--out_dir={part}", "--resume", "--loss_chunk=8", "--recompute=block"])
        return r, pretrain(common + [f"--out_dir={part}", "--resume", "--adamw_state=8bit"], check=False)

    def others():  # the knobs from the start; torch AdamW against the update in backward
        pretrain(common + [f"--out_dir={knobs}", "--loss_chunk=16", "--recompute=mlp", "--recompute_every=2",
                           "--adamw_state=offload", "--offload_activations=True"])
        pretrain(common + whole + [f"--out_dir={plain}"])
        pretrain(common + whole + [f"--out_dir={inb}", "--optimizer_in_backward=True", "--grad_checkpoint=True"])

    pretrain(common + [f"--out_dir={base}"])
    with concurrent.futures.ThreadPoolExecutor(2) as pool:  # independent runs, two at a time (the 2 cores)
        chain, rest = pool.submit(resumes), pool.submit(others)
        (r, refused), _ = chain.result(), rest.result()
    a, b = losses(base), losses(knobs)
    assert sorted(a) == sorted(b) == list(range(1, 7))
    assert all(abs(a[s] - b[s]) <= 1e-5 * abs(a[s]) for s in a), (a, b)
    assert "loss_chunk: 0 -> 8" in r.stdout
    c = losses(part)
    assert all(abs(a[s] - c[s]) <= 1e-5 * abs(a[s]) for s in a), (a, c)
    assert refused.returncode == 2 and "adamw_state: 'fp32' -> '8bit'" in refused.stderr
    a, b = losses(plain), losses(inb)
    assert sorted(a) == sorted(b) == list(range(1, 7)) and all(abs(a[s] - b[s]) <= 1e-5 * abs(a[s]) for s in a), (a, b)


def test_gpu_memory_prints_the_plan_and_exits_before_work(tmp_path):
    out, data = tmp_path / "out", tmp_path / "data"
    r = pretrain([f"--out_dir={out}", f"--data_dir={data}", "--gpu_memory=24"])
    lines = r.stdout.splitlines()
    assert lines[0].startswith("memory plan per GPU (1 GPU, dp 1 x tp 1")
    assert any(ln.split()[:1] == ["activations"] for ln in lines) and "[fits 24 GiB, 7% kept spare]" in r.stdout
    assert not out.exists() and not data.exists()
    r = pretrain([f"--out_dir={out}", f"--data_dir={data}", "--gpu_memory=1e-6"])
    assert "does NOT fit" in r.stdout and "to fit 1e-06 GiB, in order of expected cost in speed:" in r.stdout
    assert "+ fp32_residual=False (checkpointed inputs in bf16)" in r.stdout and "still too large" in r.stdout
    # the keys as they end up, one line a user pastes: each knob's key once, at its last value
    run_with = [ln for ln in r.stdout.splitlines() if ln.startswith("  run with: ")]
    knobs = [ln.split()[1] for ln in r.stdout.splitlines() if ln.startswith("  + ")]
    last = {k.split("=")[0]: k for k in knobs if "=" in k and "micro_batch_size" not in k}
    assert len(run_with) == 1 and all(f"--{k}" in run_with[0] for k in last.values()), (run_with, last)
    assert all(run_with[0].count(f"--{key}=") == 1 for key in last)
    assert "+ loss_chunk" not in r.stdout  # 64 tokens: the chunked loss's head buffers outweigh the logits it saves
    assert not out.exists() and not data.exists()
    r = script("sft.py", ["--n_layer=2", "--n_head=2", "--n_embd=32", "--block_size=64", "--tokenizer_vocab=512",
                          "--device=cpu", f"--out_dir={out}", "--gpu_memory=24", "--lora_r=4"])
    assert r.returncode == 0 and "memory plan per GPU" in r.stdout and "trained (fp32)" in r.stdout, r.stderr[-2000:]
    assert not out.exists()
    assert plan.PLAN_DEFAULTS["gpu_memory"] == 0.0  # off unless asked for
