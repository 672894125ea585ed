"""scaler.py's dynamic loss scaling against torch.amp.GradScaler, and the same skip on every rank.

Proves:
- one process: with infs and a NaN injected at chosen steps, LossScaler gives torch.amp.GradScaler's
  scale at every step, skips the same steps, and leaves the same parameters (SGD; bitwise);
- two gloo processes holding different gradients (as ZeRO-1 / FSDP ranks do): an inf injected into
  rank 1's gradient only makes both ranks skip that step (rank 0's finite step is not taken),
  back off to the same scale, and step together again afterwards;
- a scaler rebuilt from state_dict() (through torch.save / torch.load, weights_only) continues with
  exactly the scales and skips of the uninterrupted one;
- grads() finds this rank's gradients under DataParallel and FSDP; fp16_refusals names the
  settings fp16 cannot run with.
"""
import io
import os
from types import SimpleNamespace

import pytest
import torch
from distributed import spawn, train_cfg

import config
import parallel
from memory import scaler
from model import ModelConfig, Transformer
from parallelism import dp, fsdp

BAD = {2: float("inf"), 5: float("nan"), 6: float("inf")}  # step -> value injected into one gradient


def run(steps, sc, param, opt, bad, seed, torch_scaler=None):
    out = []
    g = torch.Generator().manual_seed(seed)
    for s in steps:
        c = torch.randn(param.shape, generator=g)
        loss = (param * c).sum() ** 2 / 100
        (torch_scaler or sc).scale(loss).backward()
        if s in bad:
            param.grad.view(-1)[3] = bad[s]
        if torch_scaler is not None:
            before = param.detach().clone()
            torch_scaler.step(opt)
            skipped = torch.equal(param, before)  # SGD moves a parameter whose gradient is not zero
            torch_scaler.update()
            scale = torch_scaler.get_scale()
        else:
            skipped = sc.unscale_(sc.grads(torch.nn.ParameterList([param])))
            if not skipped:
                opt.step()
            sc.update(skipped)
            scale = sc.scale_value
        opt.zero_grad()
        out.append((scale, skipped, param.detach().clone()))
    return out


def fresh(seed=0):
    p = torch.nn.Parameter(torch.randn(4, 5, generator=torch.Generator().manual_seed(seed)))
    return p, torch.optim.SGD([p], lr=0.05)


def test_matches_torch_grad_scaler():
    p, opt = fresh()
    ours = run(range(10), scaler.LossScaler(init_scale=2.0 ** 10, growth_interval=2), p, opt, BAD, 1)
    q, qopt = fresh()
    ts = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=2)
    theirs = run(range(10), None, q, qopt, BAD, 1, torch_scaler=ts)
    assert [o[:2] for o in ours] == [t[:2] for t in theirs]
    assert all(torch.equal(o[2], t[2]) for o, t in zip(ours, theirs))
    assert [o[1] for o in ours] == [s in BAD for s in range(10)]
    assert len({o[0] for o in ours}) > 2  # it grew and backed off


def test_resume_is_exact():
    p, opt = fresh()
    whole = run(range(10), scaler.LossScaler(init_scale=2.0 ** 10, growth_interval=3), p, opt, BAD, 1)
    p, opt = fresh()
    sc = scaler.LossScaler(init_scale=2.0 ** 10, growth_interval=3)
    first = run(range(4), sc, p, opt, BAD, 1)
    buf = io.BytesIO()
    torch.save(sc.state_dict(), buf)
    again = scaler.LossScaler()
    again.load_state_dict(torch.load(io.BytesIO(buf.getvalue()), weights_only=True))
    assert again.state_dict() == sc.state_dict()
    g = torch.Generator().manual_seed(1)  # replay the batches' generator to step 4
    for _ in range(4):
        torch.randn(p.shape, generator=g)
    rest = []
    for s in range(4, 10):
        loss = (p * torch.randn(p.shape, generator=g)).sum() ** 2 / 100
        again.scale(loss).backward()
        if s in BAD:
            p.grad.view(-1)[3] = BAD[s]
        skipped = again.unscale_([p.grad])
        if not skipped:
            opt.step()
        again.update(skipped)
        opt.zero_grad()
        rest.append((again.scale_value, skipped, p.detach().clone()))
    assert [r[:2] for r in first + rest] == [w[:2] for w in whole]
    assert all(torch.equal(a[2], b[2]) for a, b in zip(first + rest, whole))


def _two_ranks(rank, out_dir):
    parallel.init(train_cfg({}))
    p, opt = fresh(seed=rank)  # different gradients on each rank, as ZeRO-1 / FSDP shards have
    rec = run(range(6), scaler.LossScaler(init_scale=2.0 ** 8, growth_interval=2), p, opt,
              {2: float("inf")} if rank == 1 else {}, 10 + rank)
    torch.save(rec, os.path.join(out_dir, f"{rank}.pt"))


def test_overflow_on_one_rank_skips_everywhere(tmp_path):
    spawn(_two_ranks, 2, str(tmp_path))
    r0, r1 = (torch.load(tmp_path / f"{r}.pt", weights_only=True) for r in range(2))
    assert [s for _, s, _ in r0] == [s for _, s, _ in r1] == [False, False, True, False, False, False]
    assert [c for c, _, _ in r0] == [c for c, _, _ in r1] == [2.0 ** 8, 2.0 ** 9, 2.0 ** 8, 2.0 ** 8, 2.0 ** 9, 2.0 ** 9]
    for rec in (r0, r1):
        assert torch.equal(rec[2][2], rec[1][2])  # the skipped step left the parameters alone
        assert not torch.equal(rec[3][2], rec[2][2])  # and the next one stepped


def test_grads_of_layouts_and_refusals():
    cfg = train_cfg(dict(vocab_size=97, pad_vocab_multiple=32, n_layer=1, n_head=2, n_embd=16, block_size=8))
    grid = parallel.init(cfg)
    torch.manual_seed(0)
    model = Transformer(ModelConfig.from_cfg(cfg))
    x = torch.randint(0, 97, (2, 8))
    ddp = dp.DataParallel(model, grid)
    ddp(x, x).backward()
    assert len(scaler.LossScaler.grads(ddp)) == len(list(model.parameters()))
    wrapper = fsdp.FSDP(Transformer(ModelConfig.from_cfg(cfg)), grid)
    wrapper(x, x).backward()
    wrapper.finish()
    assert len(scaler.LossScaler.grads(wrapper)) == len(wrapper.units)
    scaler.fp16_refusals(SimpleNamespace(dtype="bfloat16", lora_base_dtype="bfloat16"))  # not fp16: fine
    for bad, msg in ((dict(lora_base_dtype="bfloat16"), "lora_base_dtype"), (dict(grad_reduce_dtype="bfloat16"), "grad_reduce")):
        with pytest.raises(config.ConfigError, match=msg):
            scaler.fp16_refusals(SimpleNamespace(dtype="float16", **bad))
