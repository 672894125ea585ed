"""Supervised fine-tuning (SFT), top to bottom: pretrain.py's spine on chat data, loss on the assistant's tokens.

    torchrun --nproc_per_node=2 sft.py configs/sft_tiny.py                     # init_from=out/tiny
    torchrun --nproc_per_node=2 sft.py configs/sft_small.py --lora_r=16        # LoRA adapters, GPUs
    python sft.py configs/sft_tiny.py --chat_data=my.jsonl --task="" --out_dir=out/mine   # your data
    python sample.py out/sft_tiny --chat                                       # talk to the result

Differences from pretraining: chat.setup adds the template's special tokens (the embedding and head
grow: weights.loader); the rows are whole conversations (a task's or chat_data's, chat.pack) with a
loss mask over each assistant answer and its end of turn; held out: the task's test items, answered
greedily and scored by its reward, and a slice of chat_data for a validation loss.
Loss: the mean negative log-likelihood over the assistant tokens of the whole global batch, every
token weighted the same: each micro-step's summed NLL is divided by the global batch's count of
such tokens (counted before the step's first forward) and multiplied by the data-parallel world,
which DataParallel and FSDP divide gradients by (a per-micro-batch mean would weight tokens by how
the batch is split). Full fine-tuning, or LoRA (lora_r > 0: the base frozen; checkpoints then also
hold the adapter in PEFT's format); merge=<folder> writes the merged model as one of our
checkpoints at the end, export_hf=<folder> the final model as an HF folder. The model family
(weights.family: the decoder, init_from's, or a variant whose key was given) makes the rows, batches,
held-out answers and adapter files: an encoder-decoder init_from trains on (source, target) pairs.
"""
import collections
import sys
from types import SimpleNamespace

import torch
from tqdm import tqdm

import chat
import checkpoint
import config
import data
import hf
import lifecycle
import logs
import lora
import optim
import parallel
import weights
from config import need
from model import IGNORE
from posttrain import tasks
from tools import gradstats

SFT_DEFAULTS = dict(
    out_dir="out/sft",  # checkpoints and metrics
    task="arithmetic",  # tasks.get(task): the default training data and the held-out accuracy ("": neither)
    task_args={},       # the task's settings, e.g. dict(max_operand=999, worked=True) (tasks.settings(name))
    n_train=20000,      # conversations the task generates for training (when chat_data is "")
    n_eval=200,         # held-out task items answered before and after training (0: no accuracy)
    held_out=0.02,      # share of chat_data's conversations held out for a validation loss (0: none)
    eval_every=0,       # also evaluate every eval_every steps (0: only before and after)
    eval_tokens=16,     # longest answer generated for the held-out items
    eval_batch=64,      # prompts decoded together (long ones: at most micro_batch_size x block_size tokens)
    merge="",           # LoRA: write the merged model here at the end, as one of our checkpoints
    export_hf="",       # write the final model (LoRA merged) here as a Hugging Face folder
    ckpt_every=0,       # steps between checkpoints (0: only at the end)
)
# this script's keys (config.load(extra=...)): the chat data's, the training keys and its own
EXTRA = config.Keys(
    chat.CHAT_DEFAULTS, lifecycle.TRAIN, SFT_DEFAULTS,
    instead={**{k: "sft.py reads conversations from chat_data" for k in ("prompt_data", "data")},
             "train_prompts": "sft.py's task generates n_train conversations",
             "eval_prompts": "sft.py answers n_eval held-out task items"})
FAMILY_KEYS = weights.variant_keys  # config.load's plugins: a decoder variant's keys, when its key is given
RESUME_FREE = ("n_eval", "eval_every", "eval_tokens", "eval_batch", "merge", "export_hf")  # a resume may change them


def check(cfg, grid):
    """SFT's own settings, and what the model family refuses (a LoRA config the model cannot take, ...):
    one message, before any work."""
    need(cfg.task or cfg.chat_data, "no training data: set chat_data (a file, folder or hf:<name>) or a task")
    need(cfg.n_train > 0 and cfg.n_eval >= 0 and cfg.eval_tokens > 0 and cfg.eval_batch > 0,
         "n_train, eval_tokens and eval_batch must be positive, n_eval >= 0")
    need(0 <= cfg.held_out < 0.5, f"held_out={cfg.held_out} must be in [0, 0.5)")
    need(not cfg.merge or cfg.lora_r, f"merge={cfg.merge!r} folds LoRA adapters into the model: it needs lora_r > 0 "
         f"(a full fine-tuning's checkpoints are full models already; export_hf writes an HF folder)")
    for path in (cfg.merge, cfg.export_hf):
        need(not path or not lifecycle.run_files(path) and not hf.is_hf_folder(path),
             f"'{path}' already holds a model or a run: name an empty or new folder")
    weights.family(cfg).sft_check(cfg, grid)


def load_data(cfg, task, tok, template, T, fam):
    """-> (rows, held-out rows, counts, conversations, held-out conversations): the training rows (fam.rows:
    chat.pack's, or the family's), chat_data's held-out rows (every 1/held_out-th conversation, packed), and
    what was skipped / dropped."""
    if cfg.chat_data:
        convs, counts = chat.read_conversations(cfg.chat_data, cfg.chat_format, skip_bad=cfg.skip_bad_records,
                                                limit=cfg.chat_limit)
    else:
        if not hasattr(task, "sft_examples"):
            raise config.ConfigError(f"task {cfg.task!r} generates no training conversations: set chat_data")
        convs, counts = task.sft_examples(cfg.n_train, cfg.seed), collections.Counter()
    every = round(1 / cfg.held_out) if cfg.chat_data and cfg.held_out and len(convs) >= 2 / cfg.held_out else 0
    held = [c for i, c in enumerate(convs) if every and i % every == every - 1]
    convs = [c for i, c in enumerate(convs) if not (every and i % every == every - 1)]
    rows, dropped = fam.rows(convs, tok, template, T, cfg.pack)  # pack=False: one per row, padded
    held_rows = fam.rows(held, tok, template, T, True)[0] if held else []
    return rows, held_rows, counts + dropped, convs, held


@torch.no_grad()
def accuracy(net, tok, template, task, items, cfg, autocast):
    """Share of items whose greedy answer the task's reward accepts, and one (question, answer)
    pair. Items are split over the data-parallel ranks (all on every rank with expert parallelism:
    EP ranks must run the same forwards); TP partners answer the same ones together (the family's
    greedy answers)."""
    grid, fam = net.grid, weights.family(cfg)
    split = grid.data_world if grid.ep == 1 else 1
    mine = items[(grid.data_rank if split > 1 else 0)::split]
    score, example = torch.zeros(2), None
    with net.full_params(), autocast:
        for i in range(0, len(mine), cfg.eval_batch):
            chunk = mine[i:i + cfg.eval_batch]
            for it, ids in zip(chunk, fam.answers(net.raw, tok, template, [it["prompt"] for it in chunk], cfg)):
                answer = tok.decode(ids)
                score[0] += float(task.reward(answer, it))
                example = example or (it["prompt"][-1]["content"], answer)
    score[1] = len(mine)
    if split > 1:  # (under expert parallelism every rank scored every item)
        parallel.data_sum(score, grid)
    return (score[0] / score[1].clamp(min=1)).item(), example


@torch.no_grad()
def held_out_loss(net, rows, cfg, autocast):
    """Mean NLL over the assistant tokens of the held-out rows (split over data ranks in micro-batches).
    Every micro-batch has micro_batch_size rows, as training's do (row 0 fills it, its targets IGNORE): a
    compiled forward that met another batch size would be recompiled for any size, training's included."""
    grid, mb, fam = net.grid, cfg.micro_batch_size, weights.family(cfg)
    total = torch.zeros(2, device=grid.device)
    net.raw.eval()
    for start in range(0, len(rows), mb * grid.data_world):
        mine = rows[start + grid.data_rank * mb:start + (grid.data_rank + 1) * mb]
        x, y, kw = fam.sft_batch(mine + rows[:1] * (mb - len(mine)), grid.device)
        y[len(mine):] = IGNORE  # (the filling rows count for nothing)
        with autocast:
            nll = net(x, y, **kw).float()
        total += torch.stack([nll, (y != IGNORE).sum().float()])
    net.raw.train()
    parallel.data_sum(total, grid)
    return (total[0] / total[1].clamp(min=1)).item()


def lengths(rows, T):
    """The data line's part on chat.pack's rows: the distribution of their real tokens, the padding ("" for
    a family's own rows)."""
    rows = [r for r in rows if isinstance(r, chat.Row)]
    return f" | {data.length_summary([int((r.seg >= 0).sum()) for r in rows], T + 1)}" if rows else ""


def train_step(net, micro, autocast, router=False):
    """Forwards and backwards of one optimizer step over this rank's micro-batches [(x, y, forward
    keywords)] (the family's loader's: summed NLLs): the gradient of the mean NLL over the global
    batch's assistant tokens (module docstring), left for net.step(). router: add MoE router losses (their mean over the
    micro-steps). Returns (summed NLL of this rank's tokens, the global batch's token count)."""
    grid = net.grid
    count = sum((y != IGNORE).sum() for _, y, _ in micro).float()  # all micro-steps, before the first forward
    parallel.data_sum(count, grid)

    def loss_fn(i, nll):  # (gradients reduced on the last micro-step; pp > 1: the pipeline schedule runs them)
        loss = nll * (grid.data_world / count.clamp(min=1))  # DataParallel / FSDP divide by data_world
        if router:
            loss = loss + net.raw.router_loss() / len(micro)
        return loss, nll.detach().float()
    total = net.train_step(micro, loss_fn, autocast)
    return total, count


def main(argv):
    # ------------------------------------------------------------------------ config, grid, the run folder
    cfg = config.load(argv, extra=EXTRA, script=__file__, example="configs/sft_tiny.py", plugins=FAMILY_KEYS)
    grid = parallel.init(cfg, cfg.threads)
    clock, say = lifecycle.Clock(grid.device), lifecycle.say(grid)
    autocast = parallel.autocast(cfg, grid.device)
    started, tok, template = weights.configure_chat(cfg, grid.world)  # template None: the family reads plain text
    fam = weights.family(cfg)  # the decoder, init_from's family, or a variant whose key was given
    check(cfg, grid)
    lifecycle.preflight(cfg, grid)  # the GPUs and the memory plan, said once (--gpu_memory: the plan, then exit)
    T = fam.row_length(cfg)
    task = tasks.get(cfg.task, cfg.task_args) if cfg.task else None
    rows, held_rows, counts, convs, held_convs = load_data(cfg, task, tok, template, T, fam)
    items = task.test(cfg.n_eval, cfg.seed) if task and cfg.n_eval else []
    if not items and cfg.n_eval:  # your own data: the held-out conversations whose answers can be checked
        task, items = tasks.OwnAnswers(), tasks.OwnAnswers.items(held_convs)[:cfg.n_eval]
    accum = cfg.batch_size // (cfg.micro_batch_size * grid.data_world)
    if len(rows) < cfg.batch_size:
        raise config.ConfigError(f"{len(rows)} training rows (from {len(convs)} conversations) cannot fill one global "
                                 f"batch of {cfg.batch_size}: more data, or a smaller batch_size")
    lease = lifecycle.claim(cfg, grid, free=RESUME_FREE)  # out_dir locked, resume picked, settings checked
    loader = fam.sft_loader(rows, cfg, grid)  # next(): (x, y, forward keywords)
    n_loss, shape = fam.describe(rows, T, cfg)
    epochs = cfg.max_steps * cfg.batch_size / len(rows)
    left_out = "".join(f"; {n:,} {why}" + f" (longer than a row of {T + 1:,} tokens: dropped)" * (why == "too_long")
                       for why, n in sorted(counts.items()))  # skipped records, dropped examples
    for line in [started, *lease.notes, f"config:\n{config.show(cfg)}",
                 f"data: {len(convs):,} conversations -> {shape}, {n_loss:,} "
                 f"assistant tokens trained on{left_out}{lengths(rows, T)} | {cfg.max_steps} steps read "
                 f"{epochs:.2f} epochs"
                 + (" (warning: past ~10 epochs a model memorises its data: more data or fewer steps)"
                    if epochs > 10 else "")
                 + (f" | {len(held_rows):,} held-out rows (every {round(1 / cfg.held_out)}th conversation)"
                    if held_rows else ""),
                 f"{lifecycle.layout(cfg, grid)} | global batch {cfg.batch_size} rows = {cfg.micro_batch_size} x "
                 f"{grid.data_world} ranks x {accum} micro-steps | {fam.tuning(cfg)}"]:
        say(line)

    # ------------------------------------------------------------------------ model, layout, resume
    raw = weights.build_model(cfg, grid)  # from the same seed on every rank (LoRA from init_from: in its storage dtype)
    # in place: TP cut, init_from weights (vocabulary grown; the family's tuned parts), LoRA adapters, EP cut, FSDP
    # or DataParallel
    net = parallel.parallelize(raw, grid, cfg, load=weights.loader(cfg, grid))
    trainer, step = lifecycle.resume(lease, net, say)  # saved by any layout (adapters and frozen base too)
    if trainer:
        loader.load_state_dict(trainer["loader"])
    n_train = sum(p.numel() for p in raw.parameters() if p.requires_grad)  # (adapters: theirs only)
    say(f"model: {raw.num_params() / 1e6:.2f}M parameters, {n_train / 1e6:.3f}M trained")
    logger = logs.Logger(cfg, grid)
    probe = gradstats.Probe(net, cfg)  # grad_stats_every > 0: per-layer statistics on their steps
    held, saved = lease.held, {}  # the held-out metric at the run's first and latest evaluation; the latest checkpoint

    def evaluate():
        """The task's held-out accuracy (greedy answers) and chat_data's held-out loss."""
        m = {}
        if held_rows:
            m["val_loss"] = held_out_loss(net, held_rows, cfg, autocast)
        if items:
            m["accuracy"], example = accuracy(net, tok, template, task, items, cfg, autocast)
        if m:
            logger.log(step, m)
            key = "accuracy" if items else "val_loss"
            lifecycle.track_held(held, step, m[key])
            parts = [f"validation loss {m['val_loss']:.4f} ({len(held_rows)} rows)"] if held_rows else []
            if items:  # rank 0 always has an example
                parts.append(f"accuracy {m['accuracy']:.1%} of {len(items)} {task.name} items | e.g. "
                             + " -> ".join(repr(t if len(t) < 300 else f"...{t[-200:]}") for t in example or ()))
            say(f"step {step} | held-out " + " | ".join(parts))

    def save():  # every rank helps gather full tensors; rank 0 writes (adapters: their PEFT folder too, fam.peft)
        saved["path"], saved["weights"] = lifecycle.save(net, cfg, lease, step, loader.state_dict(),
                                                         extra=lambda full: fam.peft(raw, full, cfg))

    # ------------------------------------------------------------------------ training loop
    if step == 0:
        evaluate()
    last, interrupt, stopped = cfg.stop_at or cfg.max_steps, lifecycle.Interrupt(grid, cfg.max_minutes), False
    bar = tqdm(total=cfg.max_steps, initial=step, disable=not (grid.is_main and cfg.progress), dynamic_ncols=True)
    write = bar.write if grid.is_main else say
    tally, logged, first = torch.zeros(2, device=grid.device), step, step + 1  # summed NLL, assistant tokens
    clock.lap()
    while step < last:
        lr = optim.set_lr(net.optimizer, step, cfg)
        probe.before(step)  # a statistics step (every grad_stats_every): activation hooks armed
        nll, count = train_step(net, [loader.next() for _ in range(accum)], autocast, cfg.n_experts > 0)
        tally += torch.stack([nll, count])
        grad_norm = net.step(cfg.grad_clip, *probe.hooks)
        step += 1
        probe.after(step, logger, write)  # its statistics logged, the ratio warning written
        bar.update(1)
        if step == first:
            write(f"first step done {clock.since_start():.1f} s after start")
        if step % cfg.log_every == 0 or step == last:
            parallel.data_sum(tally[:1], grid)  # the counts are global already
            n_steps = step - logged
            m = {"loss": (tally[0] / tally[1].clamp(min=1)).item(), "lr": lr, "grad_norm": grad_norm.item(),
                 "tok_s": n_steps * cfg.batch_size * T / clock.lap(), "loss_tokens": int(tally[1].item()) // n_steps,
                 "mem_gb": logs.peak_memory_gb(grid.device)}
            logger.report(step, m, cfg.max_steps, write)
            bar.set_postfix(loss=f"{m['loss']:.4f}")
            tally.zero_()
            logged = step
        stopped = lifecycle.end_of_step(step, last, cfg, interrupt, save, evaluate, write, clock)  # and at the end
        if stopped:
            break
    bar.close()
    interrupt.restore()

    # ------------------------------------------------------------------------ merged model, HF folder, summary
    if not stopped and step == cfg.max_steps and (cfg.merge or cfg.export_hf):
        export(cfg, grid, saved.get("weights") or net.full_state(optimizer=False)[0], tok, template, step, say)
    lifecycle.summary(say, "SFT", step, clock, saved.get("path"),
                      "accuracy" if items else "validation loss", held, stopped)
    logger.close()


def export(cfg, grid, full, tok, template, step, say):
    """merge=<folder>: the LoRA-merged model as one of our checkpoints (init_from and sample.py read
    it; checkpoint.save is collective, rank 0 writes); export_hf=<folder>: the final model (merged)
    as an HF folder (the family's: a decoder's with the tokenizer and the chat template; rank 0)."""
    plain = SimpleNamespace(**{**vars(cfg), "lora_r": 0, "init_from": cfg.out_dir})
    full = lora.merge_weights(full, cfg) if cfg.lora_r else full
    if cfg.merge:
        path = checkpoint.save(cfg.merge, step, full, None, plain, rank=grid.rank, run_id=lifecycle.new_run_id())
        say(f"merged model (adapters folded in) saved to {path}")
    if cfg.export_hf and grid.is_main:
        say(weights.family(plain).export_hf(full, plain, tok, template, cfg.export_hf))


if __name__ == "__main__":
    config.cli(main, sys.argv[1:])  # a user's mistake: one message from rank 0, no traceback (--debug: one)
