"""Denoising objectives for pretraining (BERT's masked tokens, T5's corrupted spans), and what their families share.

    python pretrain.py configs/tiny_bert.py       # objective="mlm": a bert.Bert; "span": a t5.T5; "lm": next tokens
    fam = weights.family(cfg)                      # bert.FAMILY / t5.FAMILY: Denoising's, each with its row rule
    cfg.vocab_size = fam.vocabulary(cfg, tok)      # the model's ids: the tokenizer's + [MASK] or T5's sentinels
    T = fam.read_length(cfg)                       # tokens a row reads (span: more than seq_len, T5's rule)
    x, y, kw = fam.corrupt(ids, cfg, tok, stream=step + 1, first_row=r, device=dev)
    loss_fn = denoising.token_mean(micro, grid)    # net.train_step's: the global batch's mean over predicted tokens

Batches. The loader's windows of T tokens are corrupted on the CPU, row by row, each row with its
own generator seeded by (seed, stream, global row): stream = step + 1 in training (0: validation,
the same masks at every evaluation), global row = (micro-step x data ranks + data rank) x rows +
row, the window's place in the global batch. So the masks follow the data, not the layout: one
process and any data-parallel split corrupt the same windows the same way, and a resumed run
replays them. A family's corrupt_row says how: mlm bert.mask_tokens (80/10/10 at mask_rate; EOS
never chosen; [MASK] the id past the tokenizer's), span t5.span_corrupt (noise_density, mean_span)
of windows of t5.corrupted_lengths(seq_len) tokens (the sentinels the top ids, above the tokenizer's).
Loss: each micro-step's summed NLL over its predicted tokens times data_world / the global batch's
count of them (counted before the first forward; DataParallel and FSDP divide by data_world): the
mean over the global batch, every predicted token weighted the same, as sft.py's loss.
Denoising (a weights.Family) is also what BERT and T5 share: the layouts and keys they refuse, their
init_from (HF folders, our checkpoints), no sampling by sample.py; DENOISING_DEFAULTS their keys;
DenseCounts the parameter counts pretrain.py prints for them.
"""
import dataclasses
import os
from dataclasses import fields
from types import SimpleNamespace

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn

import checkpoint
import hf
import tokenizer
import weights
from config import need
from fused import IGNORE
from model import ModelConfig

DENOISING_DEFAULTS = dict(
    mask_rate=0.15,          # mlm: share of positions predicted (80% [MASK], 10% a random id, 10% kept)
    noise_density=0.15,      # span: share of the tokens corrupted
    mean_span=3.0,           # span: mean length of a corrupted span
)
DECODER_KEYS = {f.name for f in fields(ModelConfig)}
# the layouts and keys a BERT / T5 takes: (what is wrong, the one-line refusal)
REFUSALS = [
    (lambda c: c.tp > 1, "tp > 1 (set tp=1: tensor parallelism cuts the decoder Transformer only)"),
    (lambda c: c.pp > 1, "pp > 1 (set pp=1: pipeline stages cut the decoder Transformer only)"),
    (lambda c: c.ep > 1 or c.n_experts, "experts (set n_experts=0, ep=1)"),
    (lambda c: c.lora_r, "LoRA (set lora_r=0: the adapters name the decoder's linears)"),
    (lambda c: c.sequence_parallel, "sequence_parallel (set it False)"),
    (lambda c: c.compile and c.data_parallel == "fsdp", "compile=True under FSDP (untested: set compile=False)"),
    (lambda c: c.loss_chunk or c.recompute or c.grad_checkpoint, "loss_chunk / recompute / grad_checkpoint "
     "(the decoder's memory tools: set them off)"),
    (lambda c: c.optimizer != "adamw" or c.zero1 or c.adamw_state != "fp32", "Muon, zero1 or adamw_state "
     "(untested: set optimizer='adamw', zero1=False, adamw_state='fp32')"),
]


class Denoising(weights.Family):
    """weights.Family of a model pretrained by denoising (bert.FAMILY, t5.FAMILY): the objective's
    batches, loss, validation and checks, and the families' shared init_from. A subclass sets
    name, chosen_by, Config, Model, extra_what and hf_class, and says extra_ids, corrupt_row,
    flops_per_token, config_from_hf, load_hf and export (to an HF folder)."""
    keys = DENOISING_DEFAULTS
    bits_per_byte = False
    extra_what = "[MASK]"  # what the ids past the tokenizer's are

    # ------------------------------------------------------------------------ what it builds, init_from
    def model_config(self, cfg):
        """The family's config (Config.from_cfg: its keys read from cfg by name); a layout or a decoder
        key given that it does not take: ConfigError (one line)."""
        for bad, what in REFUSALS:
            need(not bad(cfg), f"objective={cfg.objective!r} builds a {self.name}, which does not take {what}")
        own = {f.name for f in fields(self.Config)}
        ignored = sorted(k for k in getattr(cfg, "given", ()) if k in DECODER_KEYS and k not in own | {"block_size"})
        need(not ignored, f"objective={cfg.objective!r} builds a {self.name}, which has no {', '.join(ignored)}: "
             f"drop them")
        return self.Config.from_cfg(cfg)

    def configure(self, cfg):
        """init_from's config keys (Config's) become cfg's; an HF folder's tokenizer when it has a
        tokenizer.json (else cfg's stays), our checkpoint's."""
        if hf.is_hf_folder(cfg.init_from):
            fam = self.config_from_hf(cfg.init_from)
            m = {f.name: getattr(fam, f.name) for f in fields(self.Config)}
            if os.path.isfile(os.path.join(cfg.init_from, "tokenizer.json")):
                m.update(tokenizer=cfg.init_from, tokenizer_vocab=0)
            what = f"the HF {self.name} folder"
        else:
            cfg.init_from, saved = weights.init_checkpoint(cfg.init_from)
            m = {k: saved[k] for k in [f.name for f in fields(self.Config)] + ["tokenizer", "tokenizer_vocab",
                                                                                "tokenizer_fim"] if k in saved}
            what = f"{self.name} checkpoint"
        for k, v in m.items():
            setattr(cfg, k, v)
        return f"model and tokenizer of {what} {cfg.init_from}"

    def loader(self, cfg, grid):
        """The weights of init_from (one process's model: tp=1): an HF folder (load_hf) or our
        checkpoint, its vocabulary the run's."""
        src = cfg.init_from
        if not src:
            return None
        if hf.is_hf_folder(src):
            def load(model):
                model.load_state_dict(self.load_hf(src).state_dict())
            return load
        saved = weights.init_checkpoint(src)[1]
        need(saved["vocab_size"] == cfg.vocab_size, f"init_from={src} has vocab_size={saved['vocab_size']}, this run "
             f"{cfg.vocab_size}: a {self.name}'s vocabulary does not grow here")

        def load(model):
            model.load_state_dict(checkpoint.read_weights(src, **self.reference(self.Config.from_cfg(
                SimpleNamespace(**saved)))))
        return load

    def chat_setup(self, cfg):
        """Plain text in and out: the run's tokenizer, no chat template (its special tokens would take the
        ids of T5's sentinels)."""
        return tokenizer.for_cfg(cfg), None

    def write_hf(self, model, folder, tok, template):
        self.export(model, folder)
        return f"HF folder written to {folder} (transformers' {self.hf_class} reads it; no tokenizer)"

    # ------------------------------------------------------------------------ pretraining
    def pretrain_check(self, cfg, tok):
        """The objective's keys and the vocabulary it needs, then the model: one line saying what to change."""
        need(0 < cfg.mask_rate <= 1, f"mask_rate={cfg.mask_rate} must be in (0, 1]")
        need(0 < cfg.noise_density < 1 and cfg.mean_span >= 1,
             f"noise_density={cfg.noise_density} must be in (0, 1) and mean_span={cfg.mean_span} >= 1")
        need(cfg.fim_rate == 0, f"fim_rate={cfg.fim_rate}: FIM is a layout for next-token prediction: set fim_rate=0")
        T = cfg.seq_len or cfg.block_size
        need(T >= 8, f"objective={cfg.objective!r} needs rows of at least 8 tokens (seq_len / block_size = {T})")
        self.check_rows(cfg)
        n = self.extra_ids(cfg)
        need(cfg.vocab_size >= tok.n_vocab + n, f"vocab_size={cfg.vocab_size} leaves no room for {n} "
             f"{self.extra_what} id(s) above the tokenizer's {tok.n_vocab}: a model of vocab_size >= "
             f"{tok.n_vocab + n} (or a smaller tokenizer_vocab)")
        self.model_config(cfg)

    def check_rows(self, cfg):
        """A row rule's own check (pretrain_check's)."""

    def vocabulary(self, cfg, tok):
        """A fresh model's vocab_size: the tokenizer's ids, then the objective's (extra_ids)."""
        return tok.n_vocab + self.extra_ids(cfg)

    def read_grid(self, grid):
        """Windows are corrupted on the CPU (corrupt() moves them)."""
        return dataclasses.replace(grid, device=torch.device("cpu"))

    def corrupt(self, ids, cfg, tok, stream, first_row, device):
        """(B, T) windows (CPU) -> (inputs, targets, forward keywords) on device: corrupt_row of each row,
        its generator seeded by (cfg.seed, stream, first_row + its index) (module docstring)."""
        xs, ys = [], []
        for i, row in enumerate(ids):
            x, y = self.corrupt_row(row, cfg, tok, row_generator(cfg.seed, stream, first_row + i))
            xs.append(x)
            ys.append(y)
        x, y = torch.stack(xs), torch.stack(ys)
        if device.type == "cuda":
            x, y = x.pin_memory(), y.pin_memory()
        return x.to(device, non_blocking=True), y.to(device, non_blocking=True), dict(reduction="sum")

    def batches(self, loader, accum, step, cfg, tok, grid):
        """The step's windows corrupted, seeded by (seed, step + 1, global row): any layout, and a resume, sees
        the same masks."""
        B, W = cfg.micro_batch_size, grid.data_world
        return [self.corrupt(loader.next()[0], cfg, tok, step + 1, (i * W + grid.data_rank) * B, grid.device)
                for i in range(accum)]

    def loss_fn(self, micro, grid):
        return token_mean(micro, grid)

    def held_out(self, net, x, y, j, cfg, tok, grid, nbytes):
        """Validation batch j corrupted by stream 0 (the same masks at every evaluation) -> [summed NLL,
        predicted tokens, 0, 0]: the mean over them (no bits per byte)."""
        x, y, kw = self.corrupt(x, cfg, tok, 0, (j * grid.data_world + grid.data_rank) * len(x), grid.device)
        nll, zero = net(x, y, **kw).float(), torch.zeros((), device=grid.device)
        return torch.stack([nll, (y != IGNORE).sum().float(), zero, zero])


def row_generator(seed, stream, row):
    """The CPU generator of one row's masks: seeded by (seed, stream, global row), independent of the others."""
    return torch.Generator().manual_seed(int(np.random.SeedSequence([seed, stream, row]).generate_state(1)[0]))


def token_mean(micro, grid):
    """net.train_step's loss_fn for micro-batches [(x, y, kwargs)] whose forwards return summed NLLs: the
    gradient of the mean over the global batch's predicted tokens; the tallies add up to this rank's
    share of it times data_world (pretrain.py averages them over the data ranks: the global mean)."""
    count = sum((y != IGNORE).sum() for _, y, _ in micro).float()
    if grid.data_world > 1:
        dist.all_reduce(count, group=grid.data_group)
    scale = grid.data_world / count.clamp(min=1)
    return lambda i, nll: (nll * scale, nll.detach() * scale)


class DenseCounts:
    """The parameter counts pretrain.py prints, for a dense model whose blocks are self.blocks (BERT, T5)."""

    def num_params(self):
        """Unique parameters (a tied head counts once)."""
        return sum(p.numel() for p in self.parameters())

    def non_embedding_params(self):
        """Matmul parameters inside the blocks: the 2-D weights of every nn.Linear."""
        return sum(m.weight.numel() for m in self.blocks.modules() if isinstance(m, nn.Linear))

    def active_params(self):
        return self.num_params()
