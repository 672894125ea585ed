"""Pretraining, top to bottom.

    python pretrain.py configs/tiny.py                            # one process (CPU or GPU)
    torchrun --nproc_per_node=2 pretrain.py configs/small.py      # data parallel over 2 GPUs
    torchrun --nproc_per_node=2 pretrain.py configs/tiny.py --max_steps=50 --lr=1e-3
    torchrun --nproc_per_node=4 pretrain.py configs/small.py --tp=2 --data_parallel=fsdp --compile=False

Importing this file runs nothing: main() does the work.
"""
import contextlib
import math
import os
import sys
import time

import torch
from tqdm import tqdm

import checkpoint
import config
import data
import generate
import hf
import logs
import moe
import optim
import parallel
import scoring
from model import ModelConfig, Transformer


def main(argv):
    # ------------------------------------------------------------------------ setup
    t_start = time.perf_counter()
    cfg = config.load(argv)
    grid = parallel.init(cfg)
    is_main = grid.is_main
    say = print if is_main else (lambda *a, **k: None)
    device = grid.device
    dtype = parallel.amp_dtype(cfg, device)
    # bf16 autocast on GPU: matmuls in bf16, master weights, optimizer and reductions in fp32
    autocast = (torch.autocast(device.type, dtype=torch.bfloat16) if dtype == torch.bfloat16
                else contextlib.nullcontext())
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    torch.manual_seed(cfg.seed)  # same seed on every rank: identical initial weights

    # ------------------------------------------------------------------------ data
    # init_from = an HF model folder or one of our checkpoints: its config sets the model keys, its tokenizer the vocabulary
    from_hf = hf.configure(cfg)
    tok = data.tokenizer_for(cfg)  # with FIM sentinels when fim_rate > 0
    if not from_hf:
        cfg.vocab_size = tok.n_vocab  # the model's vocabulary is the tokenizer's (padded inside the model)
    settings = data.data_settings(cfg)  # prepare()'s keywords; cleaning, dedup and FIM name the folder too
    data_dir = cfg.data_dir or data.default_data_dir(cfg.data, tok.name, cfg.tokenizer_vocab, **settings)
    T = cfg.seq_len or cfg.block_size
    prompt = tok.encode(cfg.sample_prompt) or [tok.eos_id]
    if cfg.sample_tokens and len(prompt) >= cfg.block_size:
        raise config.ConfigError(f"sample_prompt is {len(prompt)} tokens, block_size={cfg.block_size} leaves no room "
                                 "to generate: shorten it or set sample_tokens=0")
    # out_dir belongs to this run: rank 0 takes its lock (held while `lease` lives), picks the
    # checkpoint to resume and checks the settings against it, before any work is spent
    lease = checkpoint.open_run_everywhere(cfg, grid)
    for line in lease.notes:
        say(line)
    meta = data.prepare_everywhere(grid, cfg.data, tok, data_dir, **settings)
    # data-parallel ranks: dp x ep (expert-parallel ranks see different data too)
    accum = cfg.batch_size // (cfg.micro_batch_size * grid.data_world)
    # both splits checked now, not at the first evaluation: the loader needs one global batch of
    # windows, the evaluation shrinks to what validation holds (and says so)
    loader = data.Loader(os.path.join(data_dir, "train.bin"), cfg.micro_batch_size, T,
                         grid.data_rank, grid.data_world, seed=cfg.seed, device=device)
    n_eval, note = (data.eval_plan(os.path.join(data_dir, "val.bin"), cfg.micro_batch_size, T, grid.data_world,
                                   cfg.eval_batches) if cfg.eval_every else (0, None))
    say(f"config:\n{config.show(cfg)}")
    if note:
        say(note)
    epochs = cfg.max_steps * cfg.batch_size * T / meta["n_train"]
    say(f"corpus: {meta['n_docs']:,} documents, {meta['n_train']:,} train / {meta['n_val']:,} validation tokens; "
        f"{cfg.max_steps} steps read {epochs:.2f} epochs" + (" (warning: past ~10 epochs a model memorises its "
                                                          "corpus: more data or fewer steps)" if epochs > 10 else ""))
    say(f"world {grid.world} (dp {grid.dp} {cfg.data_parallel}, ep {grid.ep}, tp {grid.tp}) on {device} | {dtype}"
        f" | global batch {cfg.batch_size} x {T} tokens = {cfg.micro_batch_size} sequences x {grid.data_world}"
        f" ranks x {accum} accumulation steps")

    # ------------------------------------------------------------------------ model and optimizer
    raw = Transformer(ModelConfig.from_cfg(cfg)).to(device)  # the full model on every rank, same seed
    n_params, n_body, n_active = raw.num_params(), raw.non_embedding_params(), raw.active_params()
    flops_per_token = raw.flops_per_token(T)  # counted on the full model, before it is cut
    # in place: TP cut, init_from weights, EP cut, then FSDP or the optimizer + DataParallel (ZeRO-1), compile
    run = parallel.parallelize(raw, grid, cfg, load=hf.init_loader(cfg, grid))
    model, fwd, optimizer = run.model, run.fwd, run.optimizer
    step = 0
    if lease.resume_from:  # saved by any layout: full tensors, cut to this one
        state = checkpoint.load(lease.resume_from, raw, optimizer, grid, model)
        loader.load_state_dict(state["loader"])
        step = state["step"]
        say(f"resumed from {lease.resume_from} at step {step}")
    peak = logs.peak_tflops(device, cfg.peak_tflops)
    say(f"model: {n_params / 1e6:.2f}M parameters ({n_active / 1e6:.2f}M active, {n_body / 1e6:.2f}M active "
        f"non-embedding), {flops_per_token / 1e6:.1f} MFLOPs/token, peak {peak or 'n/a'} TFLOP/s per device")
    logger = logs.Logger(cfg, grid)
    nbytes = scoring.token_bytes(tok).to(device) if cfg.eval_every else None  # bits per byte (scoring.py)

    @torch.no_grad()
    def evaluate():
        """Mean validation loss and bits per byte over the same windows on every call, over all ranks."""
        raw.eval()
        total = torch.zeros(4, device=device)
        for x, y in data.eval_batches(os.path.join(data_dir, "val.bin"), cfg.micro_batch_size, T,
                                      grid.data_rank, grid.data_world, n_eval, device=device):
            with autocast:
                total += scoring.nll_terms(fwd(x, y, reduction="none").float(), y, nbytes)
        if grid.world > 1:
            torch.distributed.all_reduce(total, group=grid.data_group)
        raw.train()
        return (total[0] / total[1].clamp(min=1)).item(), scoring.bpb_of(total[2:])

    def now():
        """Wall time after the GPU has caught up (only called at log / eval / checkpoint steps)."""
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter()

    def save():  # every rank helps gather the full tensors (experts too); rank 0 writes
        weights, opt_state = checkpoint.gather(raw, optimizer, grid, model)
        checkpoint.save(cfg.out_dir, step, weights, opt_state, cfg, loader.state_dict(), cfg.keep_last,
                        grid.rank, run_id=lease.run_id)

    # ------------------------------------------------------------------------ training loop
    last = cfg.stop_at or cfg.max_steps
    interrupt, stopped = parallel.Interrupt(grid), False  # SIGTERM / SIGINT: finish the step, save, exit 0
    bar = tqdm(total=cfg.max_steps, initial=step, disable=not (is_main and cfg.progress), dynamic_ncols=True)
    t0 = now()
    t_steps, t_first = 0, None
    loss_sum = torch.zeros((), device=device)  # summed over the steps since the last log line
    while step < last:
        lr = optim.lr_at(step, cfg)
        for g in optimizer.param_groups:
            g["lr"] = lr * g.get("lr_scale", 1.0)  # Muon's group: muon_lr / lr
        for micro in range(accum):
            x, y = loader.next()
            # communicate only on the last micro-step; earlier ones accumulate gradients locally
            with model.no_sync() if micro < accum - 1 else contextlib.nullcontext():
                with autocast:
                    loss = fwd(x, y) / accum  # mean over the global batch = sum of per-micro-step means / accum
                loss.backward()
            loss_sum += loss.detach()
        model.finish()  # wait for the gradient all-reduce before looking at gradients
        grad_norm = run.clip_grad_norm_(cfg.grad_clip or float("inf"))  # every layout: each slice counted once
        optimizer.step()
        model.zero_grad(set_to_none=True)
        step += 1
        t_steps += 1
        bar.update(1)
        if t_first is None:
            t_first = now()
            say(f"first step done {t_first - t_start:.1f} s after start (data, model, compilation)")

        if step % cfg.log_every == 0 or step == last:
            if grid.world > 1:
                torch.distributed.all_reduce(loss_sum, group=grid.data_group)
                loss_sum /= grid.data_world
            loss_val = loss_sum.item() / t_steps  # mean over the interval's steps
            dt = now() - t0
            tok_s = t_steps * cfg.batch_size * T / dt
            m = {"loss": loss_val, "lr": lr, "grad_norm": grad_norm.item(), "tok_s": tok_s,
                 "mfu": tok_s * flops_per_token / (peak * 1e12 * grid.world) if peak else "n/a",
                 "mem_gb": logs.peak_memory_gb(device)}
            # MoE: the last micro-step's router losses (included in loss), busiest expert, dropped slots
            m.update(moe.metrics(raw, grid.data_group))
            logger.log(step, m)
            if not math.isfinite(loss_val):
                raise FloatingPointError(f"loss is {loss_val} at step {step}: lower lr or check the data")
            bar.set_postfix(loss=f"{loss_val:.4f}", tok_s=f"{tok_s:.3g}")
            if is_main:
                bar.write(f"step {step}/{cfg.max_steps} | " + logs.fmt(m))
            t0, t_steps = now(), 0
            loss_sum.zero_()
        stopped = interrupt.requested()  # every rank agrees, after the same step
        if stopped:
            save()
            bar.close()
            say(f"{interrupt.name()}: saved step {step} in {cfg.out_dir}; continue with --resume")
            break
        # the checkpoint first: an evaluation that fails never costs the steps before it
        do_save = (cfg.ckpt_every and step % cfg.ckpt_every == 0) or step == last
        do_eval = cfg.eval_every and (step % cfg.eval_every == 0 or step == last)
        if do_eval or do_save:
            t_pause = now()  # evaluation and checkpoints stay out of the throughput numbers
            if do_save:
                save()
            if do_eval:
                val, bpb = evaluate()
                logger.log(step, {"val_loss": val, "val_bpb": bpb})
                if is_main:
                    bar.write(f"step {step} | val loss {val:.4f}")
            t0 += now() - t_pause
    bar.close()
    interrupt.restore()

    # ------------------------------------------------------------------------ sample
    if cfg.sample_tokens > 0 and not stopped:  # every rank generates (TP shards need all), same seed
        raw.eval()
        prompt = torch.tensor([prompt], device=device)
        with run.full_params(), autocast:
            out = generate.decode(raw, prompt, min(cfg.sample_tokens, cfg.block_size - prompt.shape[1]),
                                  temperature=cfg.sample_temperature, top_k=cfg.sample_top_k,
                                  stop_tokens=[tok.eos_id], seed=cfg.seed).tokens
        say(f"--- sample after {step} steps ---\n{tok.decode(out[0].tolist())}\n---")
    logger.close()
    parallel.shutdown()


if __name__ == "__main__":
    config.run(main, sys.argv[1:])  # a user's mistake: one message from rank 0, no traceback (--debug: one)
