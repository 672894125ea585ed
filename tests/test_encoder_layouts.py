"""BERT and T5 under DataParallel and FSDP (parallel.parallelize, 2 gloo ranks) equal one process.

Proves, in fp32 on CPU: for a BERT masked-LM (tied decoder) and a T5 v1.1 (untied head, 3 decoder
over 2 encoder layers), parallelize(..., data_parallel="ddp" | "fsdp") over 2 ranks, each rank
half of the global batch, gives the one process's first gradients, gradient norms (clipping
active) and weights after 3 AdamW steps (relative error <= 1e-5), and afterwards the same greedy
T5 generation (FSDP: inside Net.full_params()). The loss is each rank's summed NLL over the
global batch's count of predicted tokens (MLM rows predict different numbers of tokens), times
the data-parallel size that the gradient mean divides by: the global mean, whatever the split.
"""
import os

import pytest
import torch
from distributed import G, assert_close, spawn, train_cfg

import optim
import parallel
from encoders import bert, t5
from fused import IGNORE
from parallelism import fsdp

pytestmark = pytest.mark.usefixtures("one_thread")
V, STEPS = 97, 3
TRAIN = dict(lr=3e-3, weight_decay=0.1, grad_clip=0.5, eps=1e-6, grad_bucket_mb=0.01)
MODELS = {
    "bert": lambda: bert.Bert(bert.BertConfig(vocab_size=V, pad_vocab_multiple=32, block_size=16, n_layer=2, n_head=4,
                                              n_embd=32, dropout=0.0, pad_id=0)),
    "t5": lambda: t5.T5(t5.T5Config(vocab_size=V, pad_vocab_multiple=32, n_layer=2, n_decoder_layer=3, n_head=4,
                                    n_embd=32, head_dim=6, ffn_hidden=40, activation="gated-gelu", tie_embeddings=False,
                                    scale_logits=False, num_buckets=8, max_distance=16, dropout=0.0)),
}


def global_batch(name, step):
    """(inputs, targets) of G rows: BERT's masked rows (15% of 16 positions, varying per row), or a
    T5 source of 16 and targets of 10 with the last 2 of odd rows ignored."""
    g = torch.Generator().manual_seed(100 + step)
    if name == "bert":
        ids = torch.randint(4, V, (G, 16), generator=g)
        return bert.mask_tokens(ids, mask_id=3, vocab_size=V, rate=0.3, special_ids=[0, 1, 2], generator=g)
    src, y = torch.randint(2, V, (G, 16), generator=g), torch.randint(2, V, (G, 10), generator=g)
    y[1::2, -2:] = IGNORE
    return src, y


def train(run, name, grid, rec):
    per = G // grid.dp
    for s in range(STEPS):
        x, y = global_batch(name, s)
        count = (y != IGNORE).sum()
        x, y = x[grid.dp_rank * per:][:per], y[grid.dp_rank * per:][:per]
        (run.fwd(x, y, reduction="sum") / count * grid.dp).backward()
        run.wrapper.finish()
        if s == 0:
            rec["grads"] = (fsdp.gather_by_name(run.wrapper, lambda u: u.grad) if isinstance(run.wrapper, fsdp.FSDP)
                            else {n: p.grad.clone() for n, p in run.raw.named_parameters()})
        rec["norms"].append(run.clip_grad_norm_(TRAIN["grad_clip"]))
        run.optimizer.step()
        run.wrapper.zero_grad()
    rec["weights"] = (fsdp.full_state_dict(run.wrapper) if isinstance(run.wrapper, fsdp.FSDP)
                      else {k: v.clone() for k, v in run.raw.state_dict().items()})
    if name == "t5":
        with run.full_params(), torch.no_grad():
            rec["generate"] = t5.generate(run.raw, global_batch(name, 9)[0][:2], 6, vocab=run.raw.cfg.vocab_size, temperature=0)
    return rec


def _worker(rank, out_dir):
    res = {}
    for layout in ("ddp", "fsdp"):
        cfg = train_cfg(TRAIN, data_parallel=layout)
        grid = parallel.init(cfg)
        for name, make in MODELS.items():
            torch.manual_seed(0)
            run = parallel.parallelize(make(), grid, cfg)
            res[layout, name] = train(run, name, grid, {"norms": []})
    torch.save(res, os.path.join(out_dir, f"rank{rank}.pt"))


def reference(name):
    torch.manual_seed(0)
    model = MODELS[name]()
    opt = optim.build_optimizer(model, train_cfg(TRAIN))
    rec = {"norms": []}
    for s in range(STEPS):
        x, y = global_batch(name, s)
        (model(x, y, reduction="sum") / (y != IGNORE).sum()).backward()
        if s == 0:
            rec["grads"] = {n: p.grad.clone() for n, p in model.named_parameters()}
        rec["norms"].append(torch.nn.utils.clip_grad_norm_(model.parameters(), TRAIN["grad_clip"]))
        opt.step()
        opt.zero_grad()
    rec["weights"] = {k: v.clone() for k, v in model.state_dict().items()}
    if name == "t5":
        with torch.no_grad():
            rec["generate"] = t5.generate(model, global_batch(name, 9)[0][:2], 6, vocab=model.cfg.vocab_size, temperature=0)
    return rec


def test_dp2_and_fsdp2_equal_one_process(tmp_path):
    spawn(_worker, 2, str(tmp_path))
    refs = {name: reference(name) for name in MODELS}
    for rank in range(2):
        res = torch.load(tmp_path / f"rank{rank}.pt")
        for (layout, name), got in res.items():
            ref, what = refs[name], f"{name} {layout} rank {rank}"
            assert_close(got["grads"], ref["grads"], f"{what} first gradients")
            for s in range(STEPS):
                assert_close(got["norms"][s], ref["norms"][s], f"{what} gradient norm step {s}")
            assert_close(got["weights"], ref["weights"], f"{what} weights after {STEPS} steps")
            if name == "t5":
                assert torch.equal(got["generate"], ref["generate"]), f"{what} greedy generation"
    for name, ref in refs.items():
        assert ref["norms"][0] > TRAIN["grad_clip"], f"{name}: clipping never clips"
        torch.manual_seed(0)
        init = MODELS[name]().state_dict()  # the initial weights
        moved = max((ref["weights"][k] - init[k]).norm() / init[k].norm().clamp(min=1e-12) for k in init)
        assert moved > 1e-3, f"{name}: the optimizer did not move the weights"
