"""Denoising objectives for pretraining: BERT's masked tokens and T5's corrupted spans, as batches and a loss.

    python pretrain.py configs/tiny_bert.py       # objective="mlm": a bert.Bert; "span": a t5.T5; "lm": next tokens
    denoising.vocabulary(cfg, tok)                 # the model's ids: the tokenizer's + [MASK] or T5's sentinels
    T = denoising.read_length(cfg)                 # tokens a row reads (span: more than seq_len, T5's rule)
    x, y, kw = denoising.corrupt(ids, cfg, tok, stream=step + 1, first_row=r, device=dev)
    loss_fn = denoising.token_mean(micro, grid)    # net.train_step's: the global batch's mean over predicted tokens

Batches. The loader's windows of T tokens are corrupted on the CPU, row by row, each row with its
own generator seeded by (seed, stream, global row): stream = step + 1 in training (0: validation,
the same masks at every evaluation), global row = (micro-step x data ranks + data rank) x rows +
row, the window's place in the global batch. So the masks follow the data, not the layout: one
process and any data-parallel split corrupt the same windows the same way, and a resumed run
replays them. mlm: bert.mask_tokens (80/10/10 at mask_rate; EOS never chosen); [MASK] is the id
past the tokenizer's. span: t5.span_corrupt (noise_density, mean_span) of windows of
t5.corrupted_lengths(seq_len) tokens: inputs of at most seq_len, targets of a fixed length; the
sentinels are the top ids of the vocabulary, above the tokenizer's.

Loss: each micro-step's summed NLL over its predicted tokens times data_world / the global batch's
count of them (counted before the first forward; DataParallel and FSDP divide by data_world): the
mean over the global batch, every predicted token weighted the same, as sft.py's loss.
"""
import numpy as np
import torch
import torch.distributed as dist

from config import need
from encoders import bert, t5
from fused import IGNORE

OBJECTIVES = ("lm", "mlm", "span")


def check(cfg, tok):
    """The objective's keys and the vocabulary it needs, before any work: one line saying what to change."""
    need(cfg.objective in OBJECTIVES, f"objective={cfg.objective!r} must be one of {', '.join(OBJECTIVES)}")
    if cfg.objective == "lm":
        return
    need(0 < cfg.mask_rate <= 1, f"mask_rate={cfg.mask_rate} must be in (0, 1]")
    need(0 < cfg.noise_density < 1 and cfg.mean_span >= 1,
         f"noise_density={cfg.noise_density} must be in (0, 1) and mean_span={cfg.mean_span} >= 1")
    need(cfg.fim_rate == 0, f"fim_rate={cfg.fim_rate}: FIM is a layout for next-token prediction: set fim_rate=0")
    T = cfg.seq_len or cfg.block_size
    need(T >= 8, f"objective={cfg.objective!r} needs rows of at least 8 tokens (seq_len / block_size = {T})")
    if cfg.objective == "span":  # (T5's rounding: the sentinels of a short row can overflow it)
        n = read_length(cfg)
        noise, spans = t5.span_counts(n, cfg.noise_density, cfg.mean_span)
        need(n - noise + spans + 1 <= T, f"span corruption of {n} tokens gives inputs longer than seq_len={T}: "
             "a longer seq_len, or another noise_density / mean_span")
    need(cfg.vocab_size >= tok.n_vocab + extra_ids(cfg), f"vocab_size={cfg.vocab_size} leaves no room for "
         f"{extra_ids(cfg)} {'[MASK]' if cfg.objective == 'mlm' else 'sentinel'} id(s) above the tokenizer's "
         f"{tok.n_vocab}: a model of vocab_size >= {tok.n_vocab + extra_ids(cfg)} (or a smaller tokenizer_vocab)")


def extra_ids(cfg):
    """Ids past the tokenizer's the objective needs: [MASK] (mlm), the sentinels of a row (span), none (lm)."""
    if cfg.objective == "mlm":
        return 1
    if cfg.objective == "span":
        return t5.span_counts(read_length(cfg), cfg.noise_density, cfg.mean_span)[1]
    return 0


def vocabulary(cfg, tok):
    """A fresh model's vocab_size: the tokenizer's ids, then [MASK] (mlm) or the sentinels (span)."""
    cfg.vocab_size = tok.n_vocab + extra_ids(cfg)


def read_length(cfg):
    """Tokens of the corpus one row reads: seq_len (or block_size); span: the most whose corruption fits it."""
    T = cfg.seq_len or cfg.block_size
    return t5.corrupted_lengths(T, cfg.noise_density, cfg.mean_span)[0] if cfg.objective == "span" else T


def row_generator(seed, stream, row):
    """The CPU generator of one row's masks: seeded by (seed, stream, global row), independent of the others."""
    return torch.Generator().manual_seed(int(np.random.SeedSequence([seed, stream, row]).generate_state(1)[0]))


def corrupt(ids, cfg, tok, stream, first_row, device):
    """(B, T) windows (CPU) -> (inputs, targets, forward keywords) on device: BERT's masks or T5's spans
    of each row, its generator seeded by (cfg.seed, stream, first_row + its index) (module docstring)."""
    xs, ys = [], []
    for i, row in enumerate(ids):
        g = row_generator(cfg.seed, stream, first_row + i)
        if cfg.objective == "mlm":
            x, y = bert.mask_tokens(row, mask_id=tok.n_vocab, vocab_size=tok.n_vocab, rate=cfg.mask_rate,
                                    special_ids=[tok.eos_id], generator=g)
        else:
            x, y = t5.span_corrupt(row, vocab_size=cfg.vocab_size, eos_id=tok.eos_id, noise_density=cfg.noise_density,
                                   mean_span=cfg.mean_span, generator=g)
        xs.append(x)
        ys.append(y)
    x, y = torch.stack(xs), torch.stack(ys)
    if device.type == "cuda":
        x, y = x.pin_memory(), y.pin_memory()
    return x.to(device, non_blocking=True), y.to(device, non_blocking=True), dict(reduction="sum")


def token_mean(micro, grid):
    """net.train_step's loss_fn for micro-batches [(x, y, kwargs)] whose forwards return summed NLLs: the
    gradient of the mean over the global batch's predicted tokens; the tallies add up to this rank's
    share of it times data_world (pretrain.py averages them over the data ranks: the global mean)."""
    count = sum((y != IGNORE).sum() for _, y, _ in micro).float()
    if grid.data_world > 1:
        dist.all_reduce(count, group=grid.data_group)
    scale = grid.data_world / count.clamp(min=1)
    return lambda i, nll: (nll * scale, nll.detach() * scale)


def flops_per_token(model, cfg):
    """Training FLOPs per corpus token read (pretrain.py's tokens/s counts those): BERT's per position
    (its head on the mask_rate share it runs on), T5's per row of read_length tokens, divided by them."""
    T = cfg.seq_len or cfg.block_size
    if cfg.objective == "mlm":
        return bert.flops_per_token(model.cfg, T, predicted=cfg.mask_rate)
    n, targets = t5.corrupted_lengths(T, cfg.noise_density, cfg.mean_span)
    noise, spans = t5.span_counts(n, cfg.noise_density, cfg.mean_span)
    return t5.flops_per_row(model.cfg, n - noise + spans + 1, targets) / n
