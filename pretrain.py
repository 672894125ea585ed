"""Pretraining, top to bottom: the spine every stage script shares, on next-token prediction.

    python pretrain.py configs/tiny.py                            # one process (CPU or GPU)
    torchrun --nproc_per_node=2 pretrain.py configs/small.py      # data parallel over 2 GPUs
    torchrun --nproc_per_node=2 pretrain.py configs/tiny.py --max_steps=50 --lr=1e-3
    torchrun --nproc_per_node=4 pretrain.py configs/small.py --tp=2 --data_parallel=fsdp --compile=False
    torchrun --nproc_per_node=2 pretrain.py configs/small.py --pp=2 --compile=False   # two pipeline stages
    python pretrain.py --help                                     # every key, its default and comment

The spine (sft.py, dpo.py and grpo.py follow it and differ in their data and loss): config ->
grid -> init_from's model and tokenizer -> validate -> the stage's checks -> claim out_dir ->
data -> model -> parallelize -> resume -> loop (lr, micro-steps, net.step, log, end_of_step) ->
summary. The model family (weights.family: the decoder, or the one objective= picks from
weights.FAMILIES; configs/ holds a tiny config of each) builds the model and makes each step's
batches and loss from the windows (masked or corrupted: the mean over the predicted tokens); the
stage never asks which it is. Importing this file runs nothing: main() does the work.
"""
import sys

import torch
from tqdm import tqdm

import config
import data
import generate
import lifecycle
import logs
import moe
import optim
import parallel
import tokenizer
import weights
from tools import gradstats, scoring

PRETRAIN_DEFAULTS = dict(
    out_dir="out/pretrain",  # checkpoints and metrics
    eval_batches=20,         # validation batches per evaluation (0: the whole validation split)
    target_loss=0.0,         # >0: stop (and save) at the first evaluation whose validation loss is <= this
    sample_tokens=128,       # sample printed at the end (0: none)
    sample_prompt="def ",    # its prompt
    sample_temperature=0.8,  # its temperature (0: greedy)
    sample_top_k=50,         # its top-k filter (0: none)
    objective="lm",          # lm: next tokens (model.Transformer) | mlm: masked tokens | span: corrupted spans
                             # (weights.FAMILIES: the family that trains it, its own keys); init_from's model sets it
)
# this script's keys (config.load(extra=...)): the data pipeline's, the training keys and its own
EXTRA = config.Keys(data.DATA_DEFAULTS, (data.ROWS_DEFAULTS, data.check_rows), lifecycle.TRAIN, PRETRAIN_DEFAULTS,
                    instead={k: "pretrain.py reads its corpus from data" for k in ("chat_data", "prompt_data")})
FAMILY_KEYS = weights.objective_keys  # config.load's plugins: the keys of the family objective picks
RESUME_FREE = (*data.RESUME_FREE, "eval_batches", "target_loss", "sample_tokens", "sample_prompt", "sample_temperature",
               "sample_top_k")


def check(cfg, tok=None):
    """Pretraining's own settings, before any work is spent (tok: also the sample prompt's length, and the
    model family's checks: its keys, the vocabulary it needs, the model it builds and the layouts it takes)."""
    data.check_settings(cfg)
    fam = weights.family(cfg)  # (an objective no family trains: one line)
    if tok:
        fam.pretrain_check(cfg, tok)
    for bad, msg in [
        (cfg.eval_batches < 0, f"eval_batches={cfg.eval_batches} must be >= 0 (0: the whole validation split)"),
        (cfg.target_loss < 0 or (cfg.target_loss and not cfg.eval_every),
         f"target_loss={cfg.target_loss} must be >= 0 and is checked at evaluations: set eval_every > 0"),
        (cfg.sample_tokens < 0, f"sample_tokens={cfg.sample_tokens} must be >= 0 (0: no sample)"),
        (cfg.sample_temperature < 0, f"sample_temperature={cfg.sample_temperature} must be >= 0 (0: greedy)"),
        (cfg.sample_top_k < 0, f"sample_top_k={cfg.sample_top_k} must be >= 0 (0: no top-k filter)"),
        (cfg.rows != "windows" and cfg.objective != "lm", f"rows={cfg.rows!r} pads rows for next-token prediction: "
         f"objective={cfg.objective!r} reads windows (set rows='windows')"),
        (tok and cfg.sample_tokens and len(tok.encode(cfg.sample_prompt) or [0]) >= cfg.block_size,
         f"sample_prompt leaves no room to generate within block_size={cfg.block_size}: shorten it or sample_tokens=0")]:
        if bad:
            raise config.ConfigError(msg)


def main(argv):
    # ------------------------------------------------------------------------ config, grid, the run folder
    cfg = config.load(argv, extra=EXTRA, script=__file__, example="configs/tiny.py", plugins=FAMILY_KEYS)
    grid = parallel.init(cfg, cfg.threads)  # device, process groups, CPU threads
    clock, say = lifecycle.Clock(grid.device), lifecycle.say(grid)
    autocast = parallel.autocast(cfg, grid.device)
    started = weights.configure(cfg) or "no init_from: random initial weights"  # init_from's shape and tokenizer
    fam = weights.family(cfg)  # objective's (init_from's): what builds the model, makes the batches and the loss
    if not cfg.init_from:  # FIM sentinels in the vocabulary (init_from: its tokenizer's, as its ids)
        cfg.tokenizer_fim = cfg.tokenizer_fim or cfg.fim_rate > 0
    tok = tokenizer.for_cfg(cfg)
    if not cfg.init_from:
        cfg.vocab_size = fam.vocabulary(cfg, tok)  # the tokenizer's (and ids of the family's own above it)
    config.validate(cfg, grid.world, fam.model_config)  # the model keys may have changed
    check(cfg, tok)
    lifecycle.preflight(cfg, grid)  # the GPUs and the memory plan, said once (--gpu_memory: the plan, then exit)
    # out_dir belongs to this run: rank 0 takes its lock (held while `lease` lives), picks the
    # checkpoint to resume and checks the settings against it, before any work is spent
    lease = lifecycle.claim(cfg, grid, free=RESUME_FREE)

    # ------------------------------------------------------------------------ data
    T, accum = fam.read_length(cfg), cfg.batch_size // (cfg.micro_batch_size * grid.data_world)
    # the corpus tokenized once into memmaps (prepare.prepare: cleaning, dedup and FIM name its folder), or
    # token shards streamed (data="shards:..." or data_sources: stream.py). Both splits checked now, not at
    # the first evaluation: the evaluation shrinks to what validation holds (and says so)
    reader = fam.read_grid(grid)  # (reader.device: where the windows go; fam.batches moves them on)
    loader, val_path, meta = data.make_loader(cfg, reader, tok, T)
    n_eval, note = (data.eval_plan(val_path, cfg.micro_batch_size, T, grid.data_world, cfg.eval_batches)
                    if cfg.eval_every else (0, None))
    epochs = cfg.max_steps * cfg.batch_size / (meta.get("n_rows") or max(meta["n_train"], 1) / T)  # rows' worth
    for line in [started, *lease.notes, f"config:\n{config.show(cfg)}", note,
                 f"corpus: {meta['about']}; {cfg.max_steps} steps read {epochs:.2f} epochs" + (
                     " (warning: past ~10 epochs a model memorises its corpus: more data or fewer steps)"
                     if epochs > 10 else ""),
                 f"{lifecycle.layout(cfg, grid)} | global batch {cfg.batch_size} x {T} tokens = "
                 f"{cfg.micro_batch_size} sequences x {grid.data_world} ranks x {accum} accumulation steps"]:
        if line:
            say(line)

    # ------------------------------------------------------------------------ model, layout, resume
    raw = weights.build_model(cfg, grid)  # the full model on every rank, from the same seed: identical weights
    n_params, n_body, n_active = raw.num_params(), raw.non_embedding_params(), raw.active_params()
    flops_per_token = fam.flops_per_token(raw, cfg)  # on the full model, before it is cut; per corpus token read
    # in place: TP cut, init_from weights, EP cut, then FSDP or the optimizer + DataParallel (ZeRO-1), compile
    net = parallel.parallelize(raw, grid, cfg, load=weights.loader(cfg, grid))
    trainer, step = lifecycle.resume(lease, net, say)  # saved by any layout: full tensors, cut to this one
    if trainer:
        loader.load_state_dict(trainer["loader"])
    peak = logs.peak_tflops(grid.device, cfg.peak_tflops)
    say(f"model: {n_params / 1e6:.2f}M parameters ({n_active / 1e6:.2f}M active, {n_body / 1e6:.2f}M active "
        f"non-embedding), {flops_per_token / 1e6:.1f} MFLOPs/token, peak {peak or 'n/a'} TFLOP/s per device")
    logger = logs.Logger(cfg, grid)
    probe = gradstats.Probe(net, cfg)  # grad_stats_every > 0: per-layer statistics on their steps
    nbytes = scoring.token_bytes(tok).to(grid.device) if cfg.eval_every and fam.bits_per_byte else None
    held = lease.held  # the held-out loss at the run's first and its latest evaluation

    @torch.no_grad()
    def evaluate():
        """Mean validation loss (and bits per byte) over the same windows on every call, over all ranks
        (a family that predicts some tokens: over those, the same ones at every call; no bits per byte)."""
        raw.eval()
        total = torch.zeros(5, device=grid.device)  # fam.held_out's terms (loss, its count, bpb's), tokens read
        for j, (x, y) in enumerate(data.eval_batches(val_path, cfg.micro_batch_size, T, grid.data_rank,
                                                     grid.data_world, n_eval, device=reader.device)):
            total[4] += x.numel()
            with autocast:
                total[:4] += fam.held_out(net, x, y, j, cfg, tok, grid, nbytes)
        if grid.world > 1:
            torch.distributed.all_reduce(total, group=grid.data_group)
        raw.train()
        val = (total[0] / total[1].clamp(min=1)).item()
        bpb = scoring.bpb_of(total[2:4]) if nbytes is not None else None
        logger.log(step, {"val_loss": val} if bpb is None else {"val_loss": val, "val_bpb": bpb})
        lifecycle.track_held(held, step, val)
        scored = f" over {int(total[1]):,} predicted tokens" if bpb is None else f" | bpb {bpb:.4f}"
        write(f"step {step} | val loss {val:.4f}{scored} (the first {int(total[4]):,} of {meta['n_val']:,} "
              f"validation tokens; eval.py scores them all)")
        return val

    saved = {}

    def save():  # every rank helps gather the full tensors (experts too); rank 0 writes
        saved["path"] = lifecycle.save(net, cfg, lease, step, loader.state_dict())[0]

    # ------------------------------------------------------------------------ training loop
    bar = tqdm(total=cfg.max_steps, initial=step, disable=not (grid.is_main and cfg.progress), dynamic_ncols=True)
    write = bar.write if grid.is_main else say  # lines above the progress bar
    if cfg.eval_every and step == 0:
        evaluate()
    last, interrupt, stopped, first = cfg.stop_at or cfg.max_steps, lifecycle.Interrupt(grid, cfg.max_minutes), False, step + 1
    loss_sum, t_steps = torch.zeros((), device=grid.device), 0  # summed over the steps since the last log line
    clock.lap()
    while step < last:
        lr = optim.set_lr(net.optimizer, step, cfg)
        # the step's micro-batches, forward and backward (gradients reduced on the last; pp > 1: the
        # pipeline schedule); the loss: the mean over the global batch (of tokens, or of predicted ones)
        micro = fam.batches(loader, accum, step, cfg, tok, grid)  # [(x, y, forward keywords)]
        loss_fn = fam.loss_fn(micro, grid)
        probe.before(step)  # a statistics step (every grad_stats_every): activation hooks armed
        loss_sum += net.train_step(micro, loss_fn, autocast)
        grad_norm = net.step(cfg.grad_clip, *probe.hooks)  # reductions, clipping (each slice counted once), step
        step, t_steps = step + 1, t_steps + 1
        probe.after(step, logger, write)  # its statistics logged, the ratio warning written
        bar.update(1)
        if step == first:
            write(f"first step done {clock.since_start():.1f} s after start (data, model, compilation)")
        if step % cfg.log_every == 0 or step == last:
            if grid.world > 1:
                torch.distributed.all_reduce(loss_sum, group=grid.data_group)
                loss_sum /= grid.data_world
            tok_s = t_steps * cfg.batch_size * T / clock.lap()
            m = {"loss": loss_sum.item() / t_steps, "lr": lr, "grad_norm": grad_norm.item(), "tok_s": tok_s,
                 "mfu": tok_s * flops_per_token / (peak * 1e12 * grid.world) if peak else "n/a",
                 "mem_gb": logs.peak_memory_gb(grid.device)}
            m.update(moe.metrics(raw, grid.data_group))  # MoE: router losses, busiest expert, dropped slots
            m.update(data.read_metrics(loader))  # streamed shards: time waited; per source tokens read, share
            logger.report(step, m, cfg.max_steps, write)
            bar.set_postfix(loss=f"{m['loss']:.4f}", tok_s=f"{tok_s:.3g}")
            loss_sum.zero_()
            t_steps = 0
        stopped = lifecycle.end_of_step(step, last, cfg, interrupt, save, evaluate if cfg.eval_every else None, write,
                                        clock, target=cfg.target_loss)  # a signal, or the target loss reached
        if stopped:
            break
    bar.close()
    interrupt.restore()
    loader.close()
    for line in data.read_report(loader):  # streamed shards: each source's share of what was read
        say(line)

    # ------------------------------------------------------------------------ sample, summary
    if cfg.sample_tokens > 0 and not stopped and not fam.no_sample:  # every rank generates (TP shards need all)
        raw.eval()
        prompt = torch.tensor([tok.encode(cfg.sample_prompt) or [tok.eos_id]], device=grid.device)
        with net.full_params(), autocast:
            out = generate.decode(raw, prompt, min(cfg.sample_tokens, cfg.block_size - prompt.shape[1]), vocab=tok,
                                  temperature=cfg.sample_temperature, top_k=cfg.sample_top_k,
                                  stop_tokens=[tok.eos_id], seed=cfg.seed).tokens
        say(f"--- sample after {step} steps ---\n{tok.decode(out[0].tolist())}\n---")
    lifecycle.summary(say, "pretraining", step, clock, saved.get("path"), "validation loss", held, stopped)
    logger.close()


if __name__ == "__main__":
    config.cli(main, sys.argv[1:])  # a user's mistake: one message from rank 0, no traceback (--debug: one)
