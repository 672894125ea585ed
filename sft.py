"""Supervised fine-tuning (SFT), top to bottom: chat conversations, loss on the assistant's tokens.

    python pretrain.py configs/tiny.py
    torchrun --nproc_per_node=2 sft.py configs/sft_tiny.py                     # init_from=out/tiny
    torchrun --nproc_per_node=2 sft.py configs/sft_small.py --lora_r=16        # LoRA adapters, GPUs
    python sft.py configs/sft_tiny.py --chat_data=my.jsonl --chat_format=sharegpt --task=""   # your data
    python sample.py out/sft_tiny --chat                                       # talk to the result

Start: init_from names one of our checkpoints (or a run folder) or a local HF model folder; its
model shape and tokenizer become the run's (hf.configure). chat.setup adds the chat template's
special tokens to the tokenizer; where they are new, the embedding and head grow (hf.init_loader:
new rows = the mean of the old ones).

Data: the conversations a task generates (tasks.py; the offline default is Arithmetic) or a local
file / folder / hf: dataset in a standard format (chat.read_conversations: a malformed record names
its file and line, or is skipped and counted with skip_bad_records). Each conversation is rendered
with the template and tokenised once; the loss mask covers every assistant message and its
end-of-turn token (chat.encode). pack=True puts whole conversations side by side in a row
(positions restart, attention never crosses between them: a block-diagonal mask); pack=False
gives each its own padded row (chat.pack). A conversation longer than seq_len + 1 tokens is
dropped and counted, never cut.

Loss: the mean negative log-likelihood over the assistant tokens of the whole global batch, every
token weighted the same. Each micro-step's summed NLL is divided by the global batch's count of
such tokens (all micro-steps of all data-parallel ranks, counted before the step's first forward)
and multiplied by the data-parallel world, which DataParallel and FSDP divide gradients by.
(Averaging per-micro-batch means instead weights the tokens of a micro-batch holding few of them
more, and the result then depends on how the batch is split: layout, micro_batch_size.)

Full fine-tuning, or LoRA (lora_r > 0: the base frozen, adapters trained, lora.py). A LoRA run's
checkpoints also hold the adapter in PEFT's format (adapter_model.safetensors, adapter_config.json:
peft.PeftModel.from_pretrained reads the checkpoint folder); merge=<folder> writes the merged model
as one of our checkpoints at the end; export_hf=<folder> writes the final model as an HF folder.

Before the first step and after the last: the task's held-out accuracy (greedy answers through
generate.decode, scored by the task's reward), printed side by side.
Importing this file runs nothing: main() does the work.
"""
import collections
import contextlib
import math
import sys
import time
from types import SimpleNamespace

import torch
import torch.distributed as dist
from tqdm import tqdm

import chat
import checkpoint
import config
import generate
import hf
import logs
import lora
import optim
import parallel
import tasks
from model import IGNORE, ModelConfig, Transformer

SFT_DEFAULTS = dict(
    task="arithmetic",  # tasks.get(task): the default training data and the held-out accuracy ("": neither)
    n_train=20000,      # conversations the task generates for training (when chat_data is "")
    n_eval=200,         # held-out task items answered before and after training (0: no accuracy)
    eval_every=0,       # also score them every eval_every steps (0: only before and after)
    eval_tokens=16,     # longest answer generated for them
    eval_batch=64,      # prompts decoded together
    merge="",           # LoRA: write the merged model here at the end, as one of our checkpoints
    export_hf="",       # write the final model (LoRA merged) here as a Hugging Face folder
    ckpt_every=0,       # steps between checkpoints (0: only at the end)
    sample_tokens=0,    # (pretraining's end-of-run sample; SFT prints answers to held-out prompts)
)
EXTRA = {**chat.CHAT_DEFAULTS, **SFT_DEFAULTS}  # this script's keys beyond config.py's (config.load(extra=...))
RESUME_FREE = ("n_eval", "eval_every", "eval_tokens", "eval_batch", "merge", "export_hf")  # a resume may change them


def check(cfg, grid):
    """SFT's own settings, and a LoRA config the model cannot take: one message, before any work."""
    def need(ok, msg):
        if not ok:
            raise config.ConfigError(msg)
    need(cfg.task or cfg.chat_data, "no training data: set chat_data (a file, folder or hf:<name>) or a task")
    need(cfg.n_train > 0 and cfg.n_eval >= 0 and cfg.eval_tokens > 0 and cfg.eval_batch > 0,
         "n_train, eval_tokens and eval_batch must be positive, n_eval >= 0")
    need(not cfg.merge or cfg.lora_r, f"merge={cfg.merge!r} folds LoRA adapters into the model: it needs lora_r > 0 "
         f"(a full fine-tuning's checkpoints are full models already; export_hf writes an HF folder)")
    for path in (cfg.merge, cfg.export_hf):
        need(not path or not checkpoint.run_files(path) and not hf.is_hf_folder(path),
             f"'{path}' already holds a model or a run: name an empty or new folder")
    if cfg.lora_r:  # lora.apply on a meta copy: unknown targets, nothing adapted (MoE), bf16 without autocast
        with torch.device("meta"):
            model = Transformer(ModelConfig.from_cfg(cfg))
        try:
            lora.apply(model, cfg, grid)
        except ValueError as e:
            raise config.ConfigError(f"LoRA: {e}") from e


def load_data(cfg, task, tok, template, T):
    """-> (rows, counts, conversations): the training rows (chat.pack) and what was skipped / dropped."""
    if cfg.chat_data:
        convs, counts = chat.read_conversations(cfg.chat_data, cfg.chat_format, skip_bad=cfg.skip_bad_records,
                                                limit=cfg.chat_limit)
    else:
        if not hasattr(task, "sft_examples"):
            raise config.ConfigError(f"task {cfg.task!r} generates no training conversations: set chat_data")
        convs, counts = task.sft_examples(cfg.n_train, cfg.seed), collections.Counter()
    examples = [chat.encode(tok, template, c) for c in convs]
    rows, dropped = chat.pack(examples, T, one_per_row=not cfg.pack)  # pack=False: one per row, padded
    return rows, counts + dropped, convs


@torch.no_grad()
def accuracy(run, tok, template, task, items, cfg, autocast):
    """Share of items whose greedy answer the task's reward accepts, and one (question, answer)
    pair. Items are split over the data-parallel ranks (all on every rank with expert parallelism:
    EP ranks must run the same forwards); TP partners answer the same ones together."""
    grid = run.grid
    split = grid.data_world if grid.ep == 1 else 1
    mine = items[(grid.data_rank if split > 1 else 0)::split]
    score, example = torch.zeros(2), None
    with run.full_params(), autocast:
        for i in range(0, len(mine), cfg.eval_batch):
            chunk = mine[i:i + cfg.eval_batch]
            prompts = [chat.encode(tok, template, it["prompt"], add_generation_prompt=True)[0] for it in chunk]
            new = min(cfg.eval_tokens, cfg.block_size - max(map(len, prompts)))
            if new < 1:
                raise config.ConfigError(f"a held-out prompt has {max(map(len, prompts))} tokens: block_size "
                                         f"{cfg.block_size} leaves no room for an answer")
            r = generate.decode(run.raw, prompts, new, temperature=0.0, stop_tokens=[tok.eot_id], pad_id=tok.eot_id)
            for it, row, n in zip(chunk, r.tokens[:, r.prompt_len:].tolist(), r.lengths.tolist()):
                answer = tok.decode([t for t in row[:n] if t != tok.eot_id])
                score[0] += float(task.reward(answer, it))
                example = example or (it["prompt"][-1]["content"], answer)
    score[1] = len(mine)
    if split > 1:
        dist.all_reduce(score, group=grid.data_group)
    return (score[0] / score[1].clamp(min=1)).item(), example


def train_step(run, micro, autocast, router=False):
    """Forwards and backwards of one optimizer step over this rank's micro-batches [(x, y, pos,
    attn_mask)]: the gradient of the mean NLL over the global batch's assistant tokens (module
    docstring), left for run.model.finish(). router: add MoE router losses (their mean over the
    micro-steps). Returns (summed NLL of this rank's tokens, the global batch's token count)."""
    grid = run.grid
    count = sum((y != IGNORE).sum() for _, y, _, _ in micro).float()  # all micro-steps, before the first forward
    if grid.data_world > 1:
        dist.all_reduce(count, group=grid.data_group)
    total = torch.zeros((), device=count.device)
    for i, (x, y, pos, mask) in enumerate(micro):
        with run.model.no_sync() if i < len(micro) - 1 else contextlib.nullcontext():  # reduce on the last
            with autocast:
                nll = run.fwd(x, y, reduction="sum", pos=pos, attn_mask=mask)
                loss = nll * (grid.data_world / count.clamp(min=1))  # DataParallel / FSDP divide by data_world
                if router:
                    loss = loss + run.raw.router_loss() / len(micro)
            loss.backward()
        total += nll.detach().float()
    return total, count


def main(argv):
    # ------------------------------------------------------------------------ setup
    t_start = time.perf_counter()
    cfg = config.load(argv, extra=EXTRA)
    grid = parallel.init(cfg)
    say = print if grid.is_main else (lambda *a, **k: None)
    device = grid.device
    dtype = parallel.amp_dtype(cfg, device)
    autocast = (torch.autocast(device.type, dtype=torch.bfloat16) if dtype == torch.bfloat16
                else contextlib.nullcontext())
    torch.manual_seed(cfg.seed)  # same seed on every rank: identical initial weights

    # ------------------------------------------------------------------------ model keys, tokenizer, data
    started = hf.configure(cfg) or "no init_from: random initial weights"  # init_from's shape and tokenizer
    tok, template = chat.setup(cfg)  # the template's special tokens added; cfg.vocab_size covers them
    if not cfg.init_from:
        cfg.vocab_size = tok.n_vocab
    config.validate(cfg, grid.world)  # the model keys just changed
    check(cfg, grid)
    T = cfg.seq_len or cfg.block_size
    task = tasks.get(cfg.task) if cfg.task else None
    rows, counts, convs = load_data(cfg, task, tok, template, T)
    held_out = task.test(cfg.n_eval, cfg.seed) if task and cfg.n_eval else []
    accum = cfg.batch_size // (cfg.micro_batch_size * grid.data_world)
    if len(rows) < cfg.batch_size:
        raise config.ConfigError(f"{len(rows)} training rows (from {len(convs)} conversations) cannot fill one global "
                                 f"batch of {cfg.batch_size}: more data, or a smaller batch_size")
    # out_dir belongs to this run: its lock, the checkpoint to resume, changed settings checked
    lease = checkpoint.open_run_everywhere(cfg, grid, free=RESUME_FREE)
    for line in [started] + lease.notes:
        say(line)
    loader = chat.ChatLoader(rows, cfg.micro_batch_size, grid.data_rank, grid.data_world, cfg.seed, device)
    n_loss = sum(int(r.mask[1:].sum()) for r in rows)
    n_real = sum(int((r.seg >= 0).sum()) for r in rows)
    say(f"config:\n{config.show(cfg)}")
    left_out = "".join(f"; {n:,} {why}" for why, n in sorted(counts.items()))  # skipped records, dropped examples
    say(f"data: {len(convs):,} conversations -> {len(rows):,} rows of {T + 1} tokens ("
        f"{'packed' if cfg.pack else 'padded'}, {n_real / (len(rows) * (T + 1)):.0%} filled), {n_loss:,} assistant "
        f"tokens trained on{left_out} | "
        f"{cfg.max_steps} steps read {cfg.max_steps * cfg.batch_size / len(rows):.2f} epochs")
    say(f"world {grid.world} (dp {grid.dp} {cfg.data_parallel}, ep {grid.ep}, tp {grid.tp}) on {device} | {dtype} | "
        f"global batch {cfg.batch_size} rows = {cfg.micro_batch_size} x {grid.data_world} ranks x {accum} micro-steps"
        + (f" | LoRA r={cfg.lora_r} on {cfg.lora_targets}" if cfg.lora_r else " | full fine-tuning"))

    # ------------------------------------------------------------------------ model and optimizer
    raw = Transformer(ModelConfig.from_cfg(cfg)).to(device)  # the full model on every rank, same seed
    # in place: TP cut, init_from weights (vocabulary grown), LoRA adapters, EP cut, FSDP or DataParallel
    run = parallel.parallelize(raw, grid, cfg, load=hf.init_loader(cfg, grid))
    model, optimizer = run.model, run.optimizer
    step = 0
    if lease.resume_from:  # saved by any layout (adapters and frozen base too), cut to this one
        state = checkpoint.load(lease.resume_from, raw, optimizer, grid, model)
        loader.load_state_dict(state["loader"])
        step = state["step"]
        say(f"resumed from {lease.resume_from} at step {step}")
    n_train = sum(p.numel() for p in raw.parameters() if p.requires_grad)
    say(f"model: {raw.num_params() / 1e6:.2f}M parameters, {n_train / 1e6:.3f}M trained")
    logger = logs.Logger(cfg, grid)

    def score(when):
        if not held_out:
            return None
        acc, example = accuracy(run, tok, template, task, held_out, cfg, autocast)
        logger.log(step, {"accuracy": acc})
        say(f"held-out accuracy {when} (step {step}): {acc:.1%} of {len(held_out)} {cfg.task} items | e.g. "
            + " -> ".join(map(repr, example or ())))  # rank 0 always has an example
        return acc

    def save():  # every rank helps gather full tensors; rank 0 writes (a LoRA run: its PEFT adapter too)
        weights, opt_state = checkpoint.gather(raw, optimizer, grid, model)
        adapters = {k: v for k, v in weights.items() if lora.is_adapter(k)}
        checkpoint.save(cfg.out_dir, step, weights, opt_state, cfg, loader.state_dict(), cfg.keep_last, grid.rank,
                        run_id=lease.run_id, extra=(lambda d: lora.save_peft(d, adapters, cfg)) if adapters else None)
        return weights

    # ------------------------------------------------------------------------ training loop
    before = score("before")
    last = cfg.stop_at or cfg.max_steps
    interrupt, stopped = parallel.Interrupt(grid), False  # SIGTERM / SIGINT: finish the step, save, exit 0
    bar = tqdm(total=cfg.max_steps, initial=step, disable=not (grid.is_main and cfg.progress), dynamic_ncols=True)
    tally = torch.zeros(2, device=device)  # since the last log line: summed NLL, the global batches' assistant tokens
    t0, logged, weights = time.perf_counter(), step, None
    while step < last:
        lr = optim.lr_at(step, cfg)
        for g in optimizer.param_groups:
            g["lr"] = lr * g.get("lr_scale", 1.0)
        nll, count = train_step(run, [loader.next() for _ in range(accum)], autocast, cfg.n_experts > 0)
        tally += torch.stack([nll, count])
        model.finish()  # wait for the gradient reduction before looking at gradients
        grad_norm = run.clip_grad_norm_(cfg.grad_clip or float("inf"))
        optimizer.step()
        model.zero_grad(set_to_none=True)
        step += 1
        bar.update(1)
        if step % cfg.log_every == 0 or step == last:
            if grid.data_world > 1:
                dist.all_reduce(tally[:1], group=grid.data_group)  # the counts are global already
            n_steps, dt = step - logged, time.perf_counter() - t0
            m = {"loss": (tally[0] / tally[1].clamp(min=1)).item(), "lr": lr, "grad_norm": grad_norm.item(),
                 "tok_s": n_steps * cfg.batch_size * T / dt, "loss_tokens": int(tally[1].item()) // n_steps,
                 "mem_gb": logs.peak_memory_gb(device)}
            logger.log(step, m)
            if not math.isfinite(m["loss"]):
                raise FloatingPointError(f"loss is {m['loss']} at step {step}: lower lr or check the data")
            bar.set_postfix(loss=f"{m['loss']:.4f}")
            if grid.is_main:
                bar.write(f"step {step}/{cfg.max_steps} | " + logs.fmt(m))
            tally.zero_()
            t0, logged = time.perf_counter(), step
        if step == 1:
            say(f"first step done {time.perf_counter() - t_start:.1f} s after start")
        stopped = interrupt.requested()  # every rank agrees, after the same step
        t_pause = time.perf_counter()  # checkpoints and evaluations stay out of tok_s
        if stopped or step == last or (cfg.ckpt_every and step % cfg.ckpt_every == 0):
            weights = save()
        if stopped:
            say(f"{interrupt.name()}: saved step {step} in {cfg.out_dir}; continue with --resume")
            break
        if cfg.eval_every and step % cfg.eval_every == 0 and step != last:
            score("during")
        t0 += time.perf_counter() - t_pause
    bar.close()
    interrupt.restore()

    # ------------------------------------------------------------------------ accuracy, merged model, HF folder
    if not stopped:
        after = score("after")
        if before is not None:
            say(f"held-out accuracy: {before:.1%} before -> {after:.1%} after {step} steps")
        if step == cfg.max_steps and (cfg.merge or cfg.export_hf):
            weights = weights if weights is not None else checkpoint.gather(raw, None, grid, model)[0]
            export(cfg, grid, weights, tok, template, step, say)
    logger.close()


def export(cfg, grid, weights, tok, template, step, say):
    """merge=<folder>: the LoRA-merged model as one of our checkpoints (init_from and sample.py read
    it; checkpoint.save is collective, rank 0 writes); export_hf=<folder>: the final model (merged)
    as an HF folder with the tokenizer and the chat template (rank 0)."""
    plain = SimpleNamespace(**{**vars(cfg), "lora_r": 0, "init_from": cfg.out_dir})
    full = lora.merge_weights(weights, cfg) if cfg.lora_r else weights
    if cfg.merge:
        path = checkpoint.save(cfg.merge, step, full, None, plain, rank=grid.rank, run_id=checkpoint.new_run_id())
        say(f"merged model (adapters folded in) saved to {path}")
    if cfg.export_hf and grid.is_main:
        model = Transformer(ModelConfig.from_cfg(plain))
        model.load_state_dict(full)
        tok.chat_template = template.source  # hf_tokenizer.save_tokenizer writes it into tokenizer_config.json
        hf.export_hf(model, cfg.export_hf, tokenizer=tok)
        say(f"HF folder written to {cfg.export_hf} (transformers' AutoModelForCausalLM and chat template read it)")


if __name__ == "__main__":
    config.run(main, sys.argv[1:])  # a user's mistake: one message from rank 0, no traceback (--debug: one)
    parallel.shutdown()
