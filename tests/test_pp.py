"""Pipeline parallelism (pp.py) equals one process.

Proves, in fp32 on CPU with gloo, against one process that sees the whole global batch (plain torch:
one forward, AdamW, torch's clip_grad_norm_; relative error <= 1e-5): pp=2 and pp=4, both schedules,
balanced and uneven explicit cuts (pp_cut), micro-batch counts not divisible by the stage count (3 on
2 stages, 3 and 6 on 4), untied and tied embeddings, give the same first gradients (every parameter,
on the stage holding it; the last stage's tied copy the sum of both uses), gradient norms, losses and
weights and optimizer state after 3 steps (Net.full_state: every stage's tensors, one-process names);
the same with LoRA (pp=2); pp2 x dp2 (ddp and ZeRO-1), pp2 x tp2 (also sequence-parallel) and pp2 x
FSDP2 (both schedules) too. Evaluation through the stages (net(x, y) without gradients: every rank
gets the last stage's loss) and greedy generation under net.full_params() equal one process's (pp=2;
pp2 x tp2; pp2 x FSDP2), and the model is cut again after it. Under bf16 autocast (the residual
stream in bf16 or fp32: what travels between stages) pp=2 equals one process on the same
micro-batches for 2 steps. A pp=2 checkpoint (step 2) holds the one-process state and resumes into one process
and into dp=2 to the one-process step 3; a one-process checkpoint resumes into pp2 x dp2. Activation
memory, measured as the bytes of the tensors autograd saves that are alive (parameters excluded):
GPipe holds all m micro-batches' on every stage, 1F1B min(pp - s, m) on stage s (pp=2, pp=4).
pretrain.py, sft.py (full and LoRA) and dpo.py (frozen copy and adapters-off references) under pp=2
log the one-process metrics (losses, held-out loss, SFT's accuracy from greedy answers) and end with
its weights; grpo.py refuses pp > 1 with one line; config errors are one line each.
"""
import json
import os

import pytest
import torch
from distributed import assert_close, spawn, train_cfg
from safetensors.torch import load_file

import checkpoint
import config
import dpo
import generate
import grpo
import lifecycle
import lora
import optim
import parallel
import pretrain
import sft
from model import ModelConfig, Transformer
from parallelism import fsdp, pp, tp
from weights import reference as model_reference

G, T, STEPS = 12, 16, 3  # global batch (sequences: 3, 4 and 6 micro-batches divide it), length, steps
LLAMA = dict(vocab_size=97, pad_vocab_multiple=32, n_layer=5, n_head=4, n_kv_head=2, n_embd=32, block_size=T,
             lr=1e-3, weight_decay=0.1, grad_clip=0.5,  # below the first norms: clipping is exercised
             eps=1e-6)  # see tests/test_parallel.py: the key bias's gradient is rounding noise
GPT2 = dict(LLAMA, tie_embeddings=True, pos_emb="learned", norm="layernorm", activation="gelu", bias=True)
LORA = dict(LLAMA, lora_r=4, lora_alpha=8.0, lr=1e-2)
MODELS = {"llama": LLAMA, "gpt2": GPT2, "lora": LORA}


def batch(step):
    """Step `step`'s global batch (x, y), the same in every process."""
    g = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, 97, (G, T), generator=g), torch.randint(0, 97, (G, T), generator=g)


def one_process_grid():
    return parallel.init(train_cfg(LLAMA))  # (no WORLD_SIZE in the test process: one plain process)


def reference(model, steps=STEPS, save=None):
    """One process, the whole batch per step, plain torch. save: (folder, step) for a checkpoint."""
    cfg = train_cfg(MODELS[model])
    torch.manual_seed(0)
    raw = Transformer(ModelConfig.from_cfg(cfg))
    if cfg.lora_r:
        lora.apply(raw, cfg, one_process_grid())
    opt = optim.build_optimizer(raw, cfg)
    rec = {"losses": [], "norms": []}
    for step in range(steps):
        if save and step == save[1]:
            state = parallel.full_optim_state(raw, opt, one_process_grid())
            checkpoint.save(save[0], step, raw.state_dict(), state, cfg, run_id="ref")
        loss = raw(*batch(step))
        loss.backward()
        if step == 0:
            rec["grads"] = {n: p.grad.clone() for n, p in raw.named_parameters() if p.grad is not None}
        rec["norms"].append(torch.nn.utils.clip_grad_norm_([p for p in raw.parameters() if p.requires_grad],
                                                           cfg.grad_clip))
        opt.step()
        opt.zero_grad()
        rec["losses"].append(loss.item())
    rec["weights"] = {k: v.clone() for k, v in raw.state_dict().items()}
    rec["optim"] = parallel.full_optim_state(raw, opt, one_process_grid())
    rec["model"] = raw
    return rec


@pytest.fixture(scope="module")
def refs():
    return {name: reference(name) for name in MODELS}


# ---------------------------------------------------------------------------- the distributed runs

def micro_batches(x, y, grid, m):
    """This data rank's rows, cut into m micro-batches (copies: each its own storage)."""
    per = G // grid.data_world
    x, y = (t[grid.data_rank * per:(grid.data_rank + 1) * per] for t in (x, y))
    return [(a.clone(), b.clone(), {}) for a, b in zip(x.chunk(m), y.chunk(m))]


def local_grads(net):
    """{name: full gradient} of the parameters this rank holds reduced gradients of (not FSDP)."""
    if isinstance(net.wrapper, fsdp.FSDP):
        return {}
    return {n: tp.full_tensor(p, p.grad, net.grid) for n, p in net.raw.named_parameters() if p.grad is not None}


def train(case, resume=None, save=None, first=0):
    """One layout's run: STEPS steps from step `first` (resume: a checkpoint to start from)."""
    cfg = train_cfg(MODELS[case["model"]], **case.get("cfg", {}))
    grid = parallel.init(cfg)
    torch.manual_seed(0)
    net = parallel.parallelize(Transformer(ModelConfig.from_cfg(cfg)), grid, cfg)
    if resume:
        lifecycle.resume(lifecycle.Lease(None, resume, None), net, say=lambda line: None)
    m, rec = case.get("micro", 1), {"losses": [], "norms": []}
    for step in range(first, case.get("steps", STEPS)):
        if save and step == save[1]:
            weights, state = net.full_state()
            checkpoint.save(save[0], step, weights, state, cfg, rank=grid.rank, run_id="pp")
        tally = net.train_step(micro_batches(*batch(step), grid, m), lambda i, loss: (loss / m, loss.detach() / m),
                               parallel.autocast(cfg, grid.device))
        if step == 0:  # Net.step's body, the gradients read before clipping
            net.wrapper.finish()
            if net.pipe is not None:
                pp.sum_tied_grads(net)
            rec["grads"] = local_grads(net)
            rec["norms"].append(net.clip_grad_norm_(cfg.grad_clip))
            net.optimizer.step()
            net.wrapper.zero_grad(set_to_none=True)
        else:
            rec["norms"].append(net.step(cfg.grad_clip))
        if grid.data_world > 1:
            torch.distributed.all_reduce(tally, group=grid.data_group)
        rec["losses"].append(tally.item() / grid.data_world)
    rec["weights"], rec["optim"] = net.full_state()
    return net, rec


class SavedBytes:
    """saved_tensors_hooks' pack / unpack counting the bytes of the storages autograd keeps for backward
    (parameters and buffers excluded): `now` alive, `peak` the most at once."""

    def __init__(self, model):
        self.skip = {t.untyped_storage().data_ptr() for t in pp.tensors(model)}
        self.refs, self.now, self.peak = {}, 0, 0

    def pack(self, t):
        s = t.untyped_storage()
        key, n = s.data_ptr(), s.nbytes()
        if key in self.skip or n == 0:
            return t
        if not self.refs.get(key):
            self.now += n
            self.peak = max(self.peak, self.now)
        self.refs[key] = self.refs.get(key, 0) + 1
        return Saved(self, key, n, t)

    def unpack(self, h):
        return h.t if isinstance(h, Saved) else h


class Saved:
    def __init__(self, meter, key, n, t):
        self.meter, self.key, self.n, self.t = meter, key, n, t

    def __del__(self):  # autograd drops what it saved once the backward used it
        m = self.meter
        m.refs[self.key] -= 1
        if not m.refs[self.key]:
            del m.refs[self.key]
            m.now -= self.n


def memory(stages, micro):
    """{(schedule, m): (peak, left) saved bytes} of one train_step, m = 1 and `micro` micro-batches of 2 rows."""
    out = {}
    for schedule in pp.SCHEDULES:
        cfg = train_cfg(LLAMA, pp=stages, pp_schedule=schedule)
        grid = parallel.init(cfg)
        torch.manual_seed(0)
        net = parallel.parallelize(Transformer(ModelConfig.from_cfg(cfg)), grid, cfg)
        x, y = batch(0)
        for m in (1, micro):
            meter = SavedBytes(net.raw)
            with torch.autograd.graph.saved_tensors_hooks(meter.pack, meter.unpack):
                net.train_step([(x[2 * i:2 * i + 2].clone(), y[2 * i:2 * i + 2].clone(), {}) for i in range(m)],
                               lambda i, loss: (loss / m, loss.detach()))
            net.wrapper.finish()
            net.wrapper.zero_grad()
            out[schedule, m] = (meter.peak, meter.now)
    return out


def evaluate_and_sample(net):
    """The loss through the stages without gradients, and greedy tokens under net.full_params()."""
    x, y = batch(STEPS)
    with torch.no_grad():
        rec = {"eval_none": net(x, y, reduction="none"), "eval_mean": net(x, y)}
    n = sum(t.numel() for t in pp.tensors(net.raw))
    net.raw.eval()
    with net.full_params():
        rec["sample"] = generate.decode(net.raw, x[:2, :4], 6, vocab=net.raw.cfg.vocab_size, temperature=0.0).tokens
    net.raw.train()
    b = net.pipe.bounds
    rec["cut_again"] = n == sum(t.numel() for t in pp.tensors(net.raw)) and net.raw.forward.layers == range(
        b[net.pipe.stage], b[net.pipe.stage + 1])
    return rec


def _runs(rank, cases, out_dir, measure=0):
    for name, case in cases.items():
        net, rec = train(case, **case.get("run", {}))
        if case.get("sample"):
            rec.update(evaluate_and_sample(net))
        torch.save(rec, os.path.join(out_dir, f"{name}_{rank}.pt"))
    if measure:
        torch.save(memory(measure, 6 if measure > 2 else 4), os.path.join(out_dir, f"memory_{rank}.pt"))


def check(rec, ref, what, tied=False, first=0):
    assert_close(torch.tensor(rec["losses"]), torch.tensor(ref["losses"][first:]), f"{what}: losses")
    assert_close(torch.stack(rec["norms"]), torch.stack(ref["norms"][first:]), f"{what}: gradient norms")
    assert_close(rec["weights"], ref["weights"], f"{what}: weights after {STEPS} steps")
    assert_close(rec["optim"], ref["optim"], f"{what}: optimizer state after {STEPS} steps")
    for n, g in rec.get("grads", {}).items():  # the last stage's tied copy: one process's tied gradient
        assert_close(g, ref["grads"]["tok_emb.weight" if tied and n == "head.weight" else n], f"{what}: grad {n}")


def check_memory(path, stages, micro):
    for s in range(stages):
        got = torch.load(path / f"memory_{s}.pt")  # (world = stages: rank s is stage s)
        for schedule in pp.SCHEDULES:
            unit, left = got[schedule, 1]
            assert unit > 0 and left == 0 and got[schedule, micro][1] == 0, (s, schedule)
            held = got[schedule, micro][0] / unit  # micro-batches' activations alive at the peak
            want = micro if schedule == "gpipe" else min(stages - s, micro)
            assert abs(held - want) < 0.02, f"stage {s} {schedule}: {held:.3f} micro-batches in flight, not {want}"


def check_sample(rec, ref, what):
    """evaluate_and_sample's record against the one-process model after STEPS steps."""
    x, y = batch(STEPS)
    with torch.no_grad():
        want = ref(x, y, reduction="none"), ref(x, y)
        tokens = generate.decode(ref.eval(), x[:2, :4], 6, vocab=ref.cfg.vocab_size, temperature=0.0).tokens
    ref.train()
    assert_close(rec["eval_none"], want[0], f"{what}: evaluation, per token")
    assert_close(rec["eval_mean"], want[1], f"{what}: evaluation, mean")
    assert torch.equal(rec["sample"], tokens) and rec["cut_again"], what


def test_pp2_equals_one_process(tmp_path, refs):
    """pp=2 (both schedules, cuts, LoRA, tied), evaluation, sampling, memory; a pp=2 checkpoint into dp=2."""
    ckpt = str(tmp_path / "ckpt")
    cases = {"gpipe": dict(model="llama", micro=3, cfg=dict(pp=2, pp_schedule="gpipe"), run=dict(save=(ckpt, 2))),
             "1f1b_cut": dict(model="gpt2", micro=3, cfg=dict(pp=2, pp_cut="1"), sample=True),
             "lora": dict(model="lora", micro=4, cfg=dict(pp=2, pp_schedule="gpipe", pp_cut="4")),
             "dp2_resumed": dict(model="llama", micro=1, run=dict(resume=f"{ckpt}/step_000002", first=2))}
    # bf16: 2 steps. By a third, autocast has turned last-bit differences of the first steps (a sum's order)
    # into bf16 rounding noise that AdamW's normalised step passes on (past 1e-6 on CPUs with AMX)
    bf16 = {"bf16": dict(model="llama", micro=3, steps=2, cfg=dict(pp=2, dtype="bfloat16", fp32_residual=False)),
            "bf16_fp32_residual": dict(model="gpt2", micro=3, steps=2, cfg=dict(pp=2, dtype="bfloat16"))}
    spawn(_runs, 2, {**cases, **bf16}, str(tmp_path), 2)
    for name, case in bf16.items():  # bf16 autocast (what travels: pp.activation_dtype) = one process, same micro-batches
        _, want = train(dict(case, cfg={k: v for k, v in case["cfg"].items() if k != "pp"}))
        for r in range(2):
            got = torch.load(tmp_path / f"{name}_{r}.pt")
            assert_close(torch.tensor(got["losses"]), torch.tensor(want["losses"]), f"{name}: losses", 1e-6)
            assert_close(got["weights"], want["weights"], f"{name}: weights", 1e-6)
    recs = {name: [torch.load(tmp_path / f"{name}_{r}.pt") for r in range(2)] for name in cases}
    for name, case in cases.items():
        for r, rec in enumerate(recs[name]):
            check(rec, refs[case["model"]], f"{name} rank {r}", case["model"] == "gpt2", case.get("run", {}).get("first", 0))
        if name != "dp2_resumed":  # the stages' gradients: every parameter, the tied one on both
            held = set(recs[name][0]["grads"]) | set(recs[name][1]["grads"])
            assert held == set(refs[case["model"]]["grads"]) | ({"head.weight"} if case["model"] == "gpt2" else set())
    for rec in recs["1f1b_cut"]:
        check_sample(rec, refs["gpt2"]["model"], "pp=2")
    check_memory(tmp_path, 2, 4)
    # the pp=2 checkpoint: the one-process state after 2 steps; it resumes in one process to step 3
    two = reference("llama", steps=2)
    expected = model_reference(ModelConfig.from_cfg(train_cfg(LLAMA)))  # the names, shapes and ties it reads
    weights, state, trainer = checkpoint.load(f"{ckpt}/step_000002", **expected)
    assert_close(weights, two["weights"], "pp=2 checkpoint weights")
    assert_close(state, two["optim"], "pp=2 checkpoint optimizer state")
    _, rec = train(dict(model="llama"), resume=f"{ckpt}/step_000002", first=2)
    check(rec, refs["llama"], "one process resumed from pp=2", first=2)


def test_pp4_and_products_equal_one_process(tmp_path, refs):
    """pp=4 (both schedules, uneven cut), pp2 x dp2 / ZeRO-1 / tp2 / tp2 sequence-parallel / FSDP2, memory
    at pp=4, and a one-process checkpoint resumed into pp2 x dp2."""
    ckpt = str(tmp_path / "ref_ckpt")
    reference("gpt2", save=(ckpt, 2))
    cases = {"pp4_gpipe": dict(model="llama", micro=3, cfg=dict(pp=4, pp_schedule="gpipe", pp_cut="1,3,4")),
             "pp4_1f1b": dict(model="gpt2", micro=6, cfg=dict(pp=4)),
             "pp2_dp2": dict(model="gpt2", micro=3, cfg=dict(pp=2)),
             "pp2_zero1": dict(model="gpt2", micro=3, cfg=dict(pp=2, zero1=True, pp_schedule="gpipe")),
             "pp2_tp2": dict(model="gpt2", micro=3, cfg=dict(pp=2, tp=2), sample=True),
             "pp2_tp2_sp": dict(model="llama", micro=3, cfg=dict(pp=2, tp=2, sequence_parallel=True,
                                                                pp_schedule="gpipe")),
             "pp2_fsdp2": dict(model="gpt2", micro=3, cfg=dict(pp=2, data_parallel="fsdp"), sample=True),
             "pp2_fsdp2_gpipe": dict(model="llama", micro=3, cfg=dict(pp=2, data_parallel="fsdp", pp_schedule="gpipe")),
             "pp2_dp2_resumed": dict(model="gpt2", micro=3, cfg=dict(pp=2), run=dict(resume=f"{ckpt}/step_000002",
                                                                                   first=2))}
    spawn(_runs, 4, cases, str(tmp_path), 4)
    for name, case in cases.items():
        for r in range(4):
            rec = torch.load(tmp_path / f"{name}_{r}.pt")
            check(rec, refs[case["model"]], f"{name} rank {r}", case["model"] == "gpt2", case.get("run", {}).get("first", 0))
            if case.get("sample"):
                check_sample(rec, refs["gpt2"]["model"], f"{name} rank {r}")
    check_memory(tmp_path, 4, 6)


# ---------------------------------------------------------------------------- the stage scripts under pp

SPEED = ("time", "tok_s", "pairs_s", "mfu", "mem_gb")  # measurements of this machine, not of the math


def same_metrics(a, b, what):
    """Two runs' train_metrics.jsonl: the same lines, every number within 1e-5 (speed and memory aside)."""
    rows = []
    for out in (a, b):
        with open(os.path.join(out, "train_metrics.jsonl")) as f:
            rows.append([json.loads(line) for line in f])
    assert len(rows[0]) == len(rows[1]) > 1, what
    for ra, rb in zip(*rows):
        assert ra.keys() == rb.keys(), (what, ra.keys() ^ rb.keys())
        for k, v in ra.items():
            if k not in SPEED and isinstance(v, (int, float)):
                assert abs(rb[k] - v) <= 1e-5 * abs(v) + 1e-7, f"{what} step {ra.get('step')}: {k} {rb[k]} vs {v}"
    return rows[0]


def _mains(rank, runs):
    for main, argv in runs:
        main(argv)


PRETRAIN = ["--max_docs=40", "--tokenizer_vocab=512", "--n_layer=3", "--n_head=2", "--n_embd=32", "--block_size=32",
            "--tie_embeddings=True", "--batch_size=6", "--lr=3e-3", "--warmup_steps=2", "--max_steps=4",
            "--log_every=1", "--eval_every=2", "--eval_batches=2", "--sample_tokens=8", "--progress=False",
            "--ckpt_every=0", "--device=cpu", "--eps=1e-6"]
DPO = ["--device=cpu", "--tokenizer_vocab=300", "--n_layer=2", "--n_head=2", "--n_embd=32", "--block_size=32",
       "--n_pairs=32", "--eval_pairs=8", "--batch_size=8", "--micro_batch_size=2", "--max_steps=3",
       "--warmup_steps=0", "--lr=1e-2", "--eval_every=3", "--ckpt_every=0", "--log_every=1", "--progress=False"]


def test_stage_scripts_under_pp2(tmp_path):
    """pretrain.py (tied, pp_micro=3), sft.py (full and LoRA, 4 micro-steps) and dpo.py (a frozen copy, and
    LoRA's adapters off, as reference) under pp=2 log the one-process losses and held-out metrics (SFT's
    accuracy: greedy answers under full_params) and end with its weights."""
    data, init = str(tmp_path / "data"), tmp_path / "init"
    cfg = train_cfg(SFT_TINY)
    torch.manual_seed(0)
    checkpoint.save(str(init), 7, Transformer(ModelConfig.from_cfg(cfg)).state_dict(), None, cfg, run_id="init")
    runs = {"pre": (pretrain.main, PRETRAIN + [f"--data_dir={data}"], ["--micro_batch_size=2"], ["--pp_micro=3"]),
            **{f"sft_{kind}": (sft.main, [f"--init_from={init}", *SFT_COMMON, *extra], [], ["--pp_schedule=gpipe"])
               for kind, extra in (("full", []), ("lora", SFT_LORA))},
            **{f"dpo_{kind}": (dpo.main, DPO + extra, [], []) for kind, extra in (("copy", []), ("lora", ["--lora_r=4"]))}}
    for name, (main, argv, one, _) in runs.items():
        main(argv + one + [f"--out_dir={tmp_path}/{name}_ref"])
    spawn(_mains, 2, [(main, argv + two + ["--pp=2", f"--out_dir={tmp_path}/{name}_pp"])
                      for name, (main, argv, _, two) in runs.items()])
    for name in runs:
        rows = same_metrics(f"{tmp_path}/{name}_ref", f"{tmp_path}/{name}_pp", name)
        assert any("accuracy" in r for r in rows) or not name.startswith("sft")
        last = max(r["step"] for r in rows)
        want, got = (load_file(f"{tmp_path}/{name}_{k}/step_{last:06d}/model.safetensors") for k in ("ref", "pp"))
        assert_close(got, want, f"{name}: final weights")


SFT_TINY = dict(tokenizer="cl100k_base", tokenizer_vocab=512, vocab_size=512, n_layer=2, n_head=4, n_kv_head=2,
                n_embd=32, block_size=64)
SFT_COMMON = ["--n_train=64", "--n_eval=4", "--eval_tokens=2", "--eval_batch=2", "--batch_size=4",
              "--micro_batch_size=1", "--max_steps=3", "--lr=3e-3", "--warmup_steps=0", "--schedule=constant",
              "--eps=1e-6", "--log_every=1", "--progress=False", "--device=cpu", "--ckpt_every=0"]
SFT_LORA = ["--lora_r=4", "--lora_alpha=8", "--lr=1e-2"]


@pytest.mark.parametrize("kw, world, match", [
    (dict(pp=3), 4, "world size 4 is not divisible by pp\\*tp\\*ep=3"),
    (dict(pp=2, n_layer=1), 2, "need n_layer >= pp"),
    (dict(pp=2, pp_schedule="zb"), 2, "pp_schedule='zb' must be 1f1b or gpipe"),
    (dict(pp_cut="3"), 1, "set pp > 1"),
    (dict(pp=3, n_layer=6, pp_cut="0,2"), 3, "2 increasing block indices in 1..5"),
    (dict(pp=3, n_layer=6, pp_cut="4,2"), 3, "e.g. pp_cut='2,4'"),
    (dict(pp=2, pp_cut="a"), 2, "pp_cut='a' must be 1 increasing"),
    (dict(pp=2, n_experts=4), 2, "dense models"),
    (dict(pp=2, compile=True), 2, "compile=False"),
    (dict(pp=2, pp_micro=5, batch_size=32), 4, "divisible by pp_micro\\*data_parallel=5\\*2"),
])
def test_config_errors(kw, world, match):
    with pytest.raises(config.ConfigError, match=match):
        config.validate(train_cfg(LLAMA, **kw), world)


def test_pp_micro_sets_the_micro_batch_and_grpo_refuses():
    cfg = train_cfg(LLAMA, pp=2, pp_micro=4, batch_size=32)
    config.validate(cfg, 4)  # two pipelines of two stages: 32 rows = 4 micro-batches x 2 data ranks x 4 rows
    assert cfg.micro_batch_size == 4 and "pp" in lifecycle.RESUME_FREE and "pp_cut" in lifecycle.RESUME_FREE
    with pytest.raises(config.ConfigError, match="pp=2: GRPO"):
        grpo.check(train_cfg({**config.defaults(grpo.EXTRA), **LLAMA}, pp=2), one_process_grid())
    assert pp.boundaries(5, 2) == [0, 3, 5] and pp.boundaries(5, 4) == [0, 2, 3, 4, 5]
    assert pp.boundaries(5, 4, "1,3,4") == [0, 1, 3, 4, 5]
