"""gradstats.py: per-group gradient norms, update ratios and activation statistics, every layout.

Proves, in fp32 on CPU, over 3 AdamW steps of a tiny GPT-2-style model (tied embedding, one kv
head shared by every query head, ReLU MLP with 8 hidden units forced dead) with 2 accumulation
micro-steps, through gradstats.Probe (net.train_step, net.step with its hooks) as the stages run it:
- one process: each statistic equals a hand computation from the model's own tensors: grad_norm
  of q / k / v as the norms of their rows of attn.qkv (weight and bias), of a layer and of the
  whole model (= torch's clip_grad_norm_), update_ratio as ||W_after - W_before|| / ||W_before||
  over a layer's parameters, activation mean / rms / absmax / saturated / dead from the tensors
  that plain forward hooks in the test record;
- DP2, DP2 with ZeRO-1, FSDP2, TP2, TP2 with sequence parallelism, and for a MoE model (4 experts,
  top-2, one micro-step) EP2 and EP2 under FSDP (2 gloo processes) give the one process's
  statistics, every key (relative error <= 1e-5; the dead share exactly);
- the ratio warning fires once on a run whose learning rate explodes the updates and never on the
  same run at a normal learning rate; a ratio back inside the band re-arms it; arm() twice refuses;
- grad_stats_every=2: hooks armed and statistics logged on steps 2 and 4 only (0: nothing built);
  a compiled model (dynamo) runs its statistics steps eagerly and logs the eager run's numbers;
- pretrain.py with --grad_stats_every=2 logs grad_norm/ and update_ratio/ keys at steps 2 and 4
  only, writes the ratio warning, and plots.plot_heatmap draws its layers.
"""
import json
import os
import subprocess
import sys

import distributed
import pytest
import torch
from distributed import spawn, train_cfg

import parallel
from model import ModelConfig, Transformer
from tools import gradstats, plots

G, T, STEPS, ACCUM = 8, 16, 3, 2
SMALL = dict(vocab_size=97, pad_vocab_multiple=32, n_layer=2, n_head=4, n_kv_head=1, n_embd=32,
             block_size=T, lr=1e-3, weight_decay=0.1, grad_clip=1.0, grad_bucket_mb=0.01, eps=1e-6,
             tie_embeddings=True, pos_emb="learned", norm="layernorm", activation="relu", bias=True,
             micro_batch_size=1, grad_stats_every=1, act_saturate=0.01)
DEAD = [0, 1, 2, 3, 100, 101, 102, 103]  # hidden units of block 0 that never fire (both TP halves)
SATURATE = SMALL["act_saturate"]  # low enough that a share of every site's values reaches it (attention rms ~3e-3)
LAYOUTS = {"dp2": {}, "dp2_zero1": dict(zero1=True), "fsdp2": dict(data_parallel="fsdp"),
           "tp2": dict(tp=2), "tp2_sp": dict(tp=2, sequence_parallel=True),
           "ep2": dict(n_experts=4, moe_top_k=2, ep=2), "ep2_fsdp2": dict(n_experts=4, moe_top_k=2, ep=2, data_parallel="fsdp")}


def build(cfg):
    torch.manual_seed(0)
    raw = Transformer(ModelConfig.from_cfg(cfg))
    if not cfg.n_experts:
        with torch.no_grad():
            raw.blocks[0].mlp.fc.bias[DEAD] = -100.0
    return raw


class Log:
    """What probe.after logs (a logs.Logger stand-in): [(step, metrics)]."""

    def __init__(self):
        self.records = []

    def log(self, step, metrics):
        self.records.append((step, metrics))


def train(cfg, grid, record=None):
    """A few steps of the stage scripts' loop (gradstats.Probe, net.train_step, net.step with the probe's
    hooks), statistics on every step -> [metrics per step]. record(raw) -> the one-process tensors for
    the hand reference, taken where the probe takes its gradients (net.step's before_update)."""
    net = parallel.parallelize(build(cfg), grid, cfg)
    probe, log = gradstats.Probe(net, cfg), Log()
    per = G // grid.data_world
    accum = 1 if cfg.n_experts else ACCUM  # MoE: router losses see each micro-step's global micro-batch
    out = []
    for step in range(STEPS):
        x, y = distributed.global_batch(step, T, 97)
        x, y = x[grid.data_rank * per:][:per], y[grid.data_rank * per:][:per]
        mb, hand = per // accum, {}
        micro = [(x[m * mb:][:mb], y[m * mb:][:mb], {}) for m in range(accum)]

        def before_update():
            probe.grads()
            if record:
                hand.update(record(net.raw))
        probe.before(step)
        net.train_step(micro, lambda i, loss: (loss / accum, loss.detach()))
        clip = net.step(cfg.grad_clip, before_update, probe.updates).item()
        rec = probe.after(step + 1, log, print)
        assert log.records[-1] == (step + 1, rec)
        rec["clip"] = clip
        if hand:
            hand["after"] = {n: p.detach().clone() for n, p in net.raw.named_parameters()}
            rec["hand"] = hand
        out.append(rec)
    return out


def jobs(rank, out_dir):
    for name, kw in LAYOUTS.items():
        cfg = train_cfg(SMALL, **kw)
        got = train(cfg, parallel.init(cfg))
        if rank == 0:
            torch.save(got, os.path.join(out_dir, f"{name}.pt"))


@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
    out = tmp_path_factory.mktemp("layouts")
    spawn(jobs, 2, str(out))
    return {name: torch.load(out / f"{name}.pt") for name in LAYOUTS}


def reference(**kw):
    cfg = train_cfg(SMALL, **kw)
    return train(cfg, parallel.init(cfg))


def test_one_process_equals_hand_computation(one_thread):
    cfg = train_cfg(SMALL)
    grid = parallel.init(cfg)
    seen = {}

    def record(raw):  # after finish(), before the step: grads and weights of the one process
        return {"grads": {n: p.grad.clone() for n, p in raw.named_parameters()},
                "before": {n: p.detach().clone() for n, p in raw.named_parameters()},
                "acts": {k: torch.cat(v) for k, v in seen.items()}}

    raw_holder = {}
    orig = parallel.parallelize

    def spy(model, *a, **k):  # plain hooks of the test's own, next to gradstats'
        run = orig(model, *a, **k)
        raw_holder["raw"] = run.raw
        for i, b in enumerate(run.raw.blocks):
            b.register_forward_hook(lambda m, a, o, i=i: seen.setdefault(f"L{i}.out", []).append(o.detach().flatten(0, 1)))
            b.attn.register_forward_hook(lambda m, a, o, i=i: seen.setdefault(f"L{i}.attn", []).append(o.detach().flatten(0, 1)))
            b.mlp.proj.register_forward_pre_hook(
                lambda m, a, i=i: seen.setdefault(f"L{i}.mlp_hidden", []).append(a[0].detach().flatten(0, 1)))
        return run

    parallel.parallelize = spy
    try:
        def rec_and_reset(raw):
            r = record(raw)
            seen.clear()
            return r
        got = train(cfg, grid, record=rec_and_reset)
    finally:
        parallel.parallelize = orig
    qn, kvn = 4 * 8, 1 * 8  # q rows, k (and v) rows of attn.qkv
    for rec in got:
        h = rec["hand"]
        g = h["grads"]

        def norm(*ts):
            return torch.sqrt(sum(t.double().square().sum() for t in ts)).item()
        for i in range(2):
            w, b = g[f"blocks.{i}.attn.qkv.weight"], g[f"blocks.{i}.attn.qkv.bias"]
            assert rec[f"grad_norm/L{i}.q"] == pytest.approx(norm(w[:qn], b[:qn]), rel=1e-5)
            assert rec[f"grad_norm/L{i}.k"] == pytest.approx(norm(w[qn:qn + kvn], b[qn:qn + kvn]), rel=1e-5)
            assert rec[f"grad_norm/L{i}.v"] == pytest.approx(norm(w[qn + kvn:], b[qn + kvn:]), rel=1e-5)
            layer = [t for n, t in g.items() if n.startswith(f"blocks.{i}.")]
            assert rec[f"grad_norm/L{i}"] == pytest.approx(norm(*layer), rel=1e-5)
            dw = [h["after"][n] - h["before"][n] for n in g if n.startswith(f"blocks.{i}.")]
            ws = [h["before"][n] for n in g if n.startswith(f"blocks.{i}.")]
            assert rec[f"update_ratio/L{i}"] == pytest.approx(norm(*dw) / norm(*ws), rel=1e-5)
        assert rec["grad_norm/embedding"] == pytest.approx(norm(g["tok_emb.weight"], g["pos_emb.weight"]), rel=1e-5)
        assert "grad_norm/head" not in rec  # tied: the head is the embedding, counted once
        assert rec["grad_norm/total"] == pytest.approx(rec["clip"], rel=1e-5)
        assert rec["grad_norm/total"] == pytest.approx(norm(*g.values()), rel=1e-5)
        for site, x in h["acts"].items():
            assert x.shape[0] == G * T  # both micro-steps
            a = x.abs()
            assert rec[f"act/{site}.mean"] == pytest.approx(x.mean().item(), rel=1e-5, abs=1e-7)
            assert rec[f"act/{site}.rms"] == pytest.approx(x.square().mean().sqrt().item(), rel=1e-5)
            assert rec[f"act/{site}.absmax"] == pytest.approx(a.max().item(), rel=1e-6)
            assert rec[f"act/{site}.saturated"] == pytest.approx((a >= SATURATE).float().mean().item(), rel=1e-6)
            assert 0 < rec[f"act/{site}.saturated"] < 1
            assert rec[f"act/{site}.dead"] == pytest.approx((a.amax(0) <= 0).float().mean().item())
        assert rec["act/L0.mlp_hidden.dead"] >= len(DEAD) / 128


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layouts_equal_one_process(one_thread, layouts, name):
    ref = reference(**LAYOUTS[name])
    got = layouts[name]
    for s, (a, b) in enumerate(zip(got, ref)):
        assert a.keys() == b.keys(), f"step {s}: keys differ {sorted(set(a) ^ set(b))[:6]}"
        # 14 groups (emb.embedding; norm, q, k, v, attn_proj, mlp of 2 blocks; out.norm), 4 layers, 7 kinds, total
        assert len([k for k in a if k.startswith("grad_norm/")]) == (29 if "ep2" in name else 26)  # MoE: router, experts, no mlp
        for k in b:
            if k.endswith(".dead"):
                assert a[k] == b[k], (name, s, k)
            else:
                assert a[k] == pytest.approx(b[k], rel=1e-5, abs=1e-8), (name, s, k, a[k], b[k])
        if "ep2" not in name:
            assert b["act/L0.mlp_hidden.dead"] >= len(DEAD) / 128
        else:  # experts and router groups of both MoE layers
            assert b["grad_norm/L1.experts"] > 0 and b["update_ratio/L0.router"] > 0


def ratios(lr, steps=8):
    """update_ratio/<layer> of each step of a one-process run at this (constant) learning rate."""
    cfg = train_cfg(SMALL, lr=lr, grad_clip=0.0)
    run = parallel.parallelize(build(cfg), parallel.init(cfg), cfg)
    stats = gradstats.GradStats(run.wrapper, run.grid)
    out = []
    for step in range(steps):
        x, y = distributed.global_batch(step, T, 97)
        run.fwd(x, y).backward()
        before = stats.snapshot()
        run.optimizer.step()
        run.wrapper.zero_grad()
        out.append(stats.updates(before))
    return out


def test_ratio_warning(one_thread):
    normal, exploding = ratios(1e-3), ratios(1.0)
    watch = gradstats.RatioWatch(band=(1e-5, 1e-1), patience=3)
    assert [ln for s, m in enumerate(normal) for ln in watch.check(s, m)] == []
    watch = gradstats.RatioWatch(band=(1e-5, 1e-1), patience=3)
    lines = [ln for s, m in enumerate(exploding) for ln in watch.check(s, m)]
    assert exploding[2]["update_ratio/L0"] > 0.1  # really outside
    assert lines and all("exploding" in ln for ln in lines)
    assert len([ln for ln in lines if "layer L0'" in ln]) == 1  # once per excursion
    assert lines[0].startswith("warning: step 2: ")  # the third consecutive check
    # back inside re-arms it; NaN counts as outside
    watch = gradstats.RatioWatch(band=(1e-5, 1e-1), patience=2)
    seq = [0.5, 0.01, 0.5, 0.5, 0.5, 0.01, 1e-7, 1e-7]
    got = [ln for s, r in enumerate(seq) for ln in watch.check(s, {"update_ratio/L1": r, "update_ratio/L1.q": 9.0})]
    assert len(got) == 2, got
    assert "step 3" in got[0] and "exploding" in got[0] and "step 7" in got[1] and "vanishing" in got[1]
    watch = gradstats.RatioWatch(patience=2)
    assert watch.check(0, {"update_ratio/out": float("nan")}) == []
    assert "not a number" in watch.check(1, {"update_ratio/out": float("nan")})[0]


def test_arm_twice_refuses(one_thread):
    cfg = train_cfg(SMALL)
    acts = gradstats.Activations(build(cfg), parallel.init(cfg))
    acts.arm()
    with pytest.raises(RuntimeError, match="collect"):
        acts.arm()
    assert acts.collect() == {}  # armed, no forward: nothing recorded, hooks gone
    assert not acts.handles


def probe_run(cfg, steps=4, compile_kwargs=None):
    """A one-process run through gradstats.Probe -> (what it logged, forward hooks seen in each step)."""
    net = parallel.parallelize(build(cfg), parallel.init(cfg), cfg, compile_kwargs=compile_kwargs)
    probe, log, armed = gradstats.Probe(net, cfg), Log(), []
    for step in range(steps):
        x, y = distributed.global_batch(step, T, 97)
        probe.before(step)
        armed.append(sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in net.raw.modules()))
        net.train_step([(x, y, {})], lambda i, loss: (loss, loss.detach()))
        net.step(cfg.grad_clip, *probe.hooks)
        probe.after(step + 1, log, print)
    return log.records, armed


def test_probe_only_on_its_steps(one_thread):
    """grad_stats_every=2: hooks armed on steps 2 and 4 only, statistics logged there only; 0: nothing
    built or armed; compiled (dynamo, eager backend): the statistics steps run eagerly, same numbers."""
    records, armed = probe_run(train_cfg(SMALL, grad_stats_every=2))
    assert [s for s, _ in records] == [2, 4] and armed[0] == armed[2] == 0 and armed[1] == armed[3] > 0
    assert all(any(k.startswith("update_ratio/") for k in m) and "act/L0.attn.rms" in m for _, m in records)
    records_off, armed_off = probe_run(train_cfg(SMALL, grad_stats_every=0))
    assert records_off == [] and armed_off == [0] * 4
    assert not hasattr(gradstats.Probe(None, train_cfg(SMALL, grad_stats_every=0)), "stats")
    compiled, _ = probe_run(train_cfg(SMALL, grad_stats_every=2, compile=True), compile_kwargs=dict(backend="eager"))
    assert [s for s, _ in compiled] == [2, 4]
    for (_, a), (_, b) in zip(compiled, records):
        assert a.keys() == b.keys()
        for k in b:
            assert a[k] == pytest.approx(b[k], rel=1e-5, abs=1e-8), k


def test_pretrain_logs_statistics_on_their_steps(tmp_path):
    """pretrain.py configs/tiny.py --grad_stats_every=2 --max_steps=4 (tiny overrides): loss logged at
    every step, grad_norm/<group> and update_ratio/<group> at steps 2 and 4 only; the ratio warning
    (a band no update fits, patience 1) is written at step 2; plots.plot_heatmap reads the layers."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = tmp_path / "out"
    args = ["configs/tiny.py", "--grad_stats_every=2", "--max_steps=4", f"--out_dir={out}",
            f"--data_dir={tmp_path / 'data'}", "--max_docs=30", "--clean=False", "--dedup=none", "--tokenizer_vocab=512",
            "--n_layer=2", "--n_embd=32", "--n_head=2", "--n_kv_head=1", "--block_size=32", "--batch_size=4",
            "--micro_batch_size=2", "--warmup_steps=2", "--log_every=1", "--eval_every=0", "--ckpt_every=0",
            "--sample_tokens=0", "--progress=False", "--device=cpu", "--ratio_low=1e3", "--ratio_high=1e4",
            "--ratio_patience=1"]
    r = subprocess.run([sys.executable, os.path.join(root, "pretrain.py"), *args], cwd=root, capture_output=True,
                       text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    recs = [json.loads(ln) for ln in open(out / "train_metrics.jsonl")]
    assert sorted(rec["step"] for rec in recs if "loss" in rec) == [1, 2, 3, 4]
    for prefix in ("grad_norm/", "update_ratio/"):
        steps = sorted({rec["step"] for rec in recs for k in rec if k.startswith(prefix)})
        assert steps == [2, 4], (prefix, steps)
    stats = [rec for rec in recs if "grad_norm/total" in rec]
    assert all(rec["grad_norm/L1.q"] > 0 and 0 < rec["update_ratio/total"] < 1 for rec in stats)
    assert "warning: step 2: layer L0's update ratio" in r.stdout and "vanishing" in r.stdout
    layers, steps, _ = plots.plot_heatmap(str(out), None, "update_ratio")
    assert layers == ["emb", "L0", "L1", "out"] and steps == [2, 4]
