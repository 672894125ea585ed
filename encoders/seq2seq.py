"""Sequence-to-sequence chat data for a T5: conversations as (source, target) pairs, batches, answers.

    pairs, dropped = seq2seq.rows(convs, tok, T)            # [(source ids, target ids)], Counter(too_long=n)
    src, y, pos, src_mask = seq2seq.batch(pairs[:4])        # pos None: a T5's micro-batch tuple
    loader = seq2seq.PairLoader(pairs, B, rank, world, seed, device)   # data.Loader's stream over pairs
    answers = seq2seq.answers(model, tok, prompts, 16, t5.generate)    # greedy answers of source_text, EOS cut

Seq2Seq is weights.Family's SFT part for an encoder-decoder (t5.FAMILY): sft.py trains a T5
init_from (objective "span") on these rows instead of chat.pack's: a
conversation's messages before its last answer are the source, as plain text one message a line
(source_text: no chat template, whose special tokens would take the ids a T5 gives its sentinels),
and that answer then EOS is the target. Invariants: a pair with either side longer than T tokens
is dropped and counted, never cut; batches pad the source on the right with 0 (src_mask marks the
real tokens) and the targets with IGNORE (no loss); the loader is data.Loader's stream (a fresh
permutation per epoch seeded by (seed, epoch), ranks disjoint, state_dict exact), as
chat.ChatLoader's over packed rows.
"""
import collections

import torch

import data
import weights
from config import need
from fused import IGNORE


def source_text(messages):
    """A T5's input: the prompt's messages as plain text, one per line."""
    return "\n".join(m["content"] for m in messages)


def rows(convs, tok, T):
    """-> ([(source ids, target ids)], Counter(too_long=dropped)): each conversation's messages before
    its last answer as the source (source_text), that answer then EOS as the target."""
    out, dropped = [], collections.Counter()
    for c in convs:
        src, tgt = tok.encode(source_text(c[:-1])), tok.encode(c[-1]["content"]) + [tok.eos_id]
        if len(src) > T or len(tgt) > T:
            dropped["too_long"] += 1
        else:
            out.append((src, tgt))
    return out, dropped


def batch(pairs, device="cpu"):
    """Pairs -> (src (B, S) right-padded with 0, targets (B, L) padded with IGNORE, None, src_mask (B, S))."""
    S, L = max(len(s) for s, _ in pairs), max(len(t) for _, t in pairs)
    src = torch.tensor([s + [0] * (S - len(s)) for s, _ in pairs], device=device)
    y = torch.tensor([t + [IGNORE] * (L - len(t)) for _, t in pairs], device=device)
    mask = torch.tensor([[1] * len(s) + [0] * (S - len(s)) for s, _ in pairs], device=device)
    return src, y, None, mask


class PairLoader(data.Loader):
    """data.Loader's stream over (source, target) pairs: batch() of B of them per next()."""

    def __init__(self, pairs, B, rank=0, world=1, seed=0, device="cpu"):
        self.init_stream(B, 0, rank, world, seed, device)
        self.path, self.pairs, self.n_windows = "sequence-to-sequence pairs", pairs, len(pairs)

    def next(self):
        return batch([self.pairs[i] for i in self.next_windows()], self.device)


class PairRows(PairLoader):
    """PairLoader whose batches are net.train_step's (src, y, forward keywords) (Seq2Seq.sft_batch's)."""

    def next(self):
        src, y, _, mask = super().next()
        return src, y, dict(reduction="sum", src_mask=mask)


@torch.no_grad()
def answers(model, tok, prompts, max_new_tokens, generate):
    """Greedy answers (token lists, EOS and what follows cut) of an encoder-decoder to chat prompts
    (message lists); generate: its decoding loop (t5.generate)."""
    dev = next(model.parameters()).device
    src, _, _, mask = batch([(tok.encode(source_text(p)), [0]) for p in prompts], dev)
    out = generate(model, src, max_new_tokens, vocab=tok, src_mask=mask, temperature=0.0, stop_tokens=[tok.eos_id],
                   pad_id=tok.eos_id)[:, 1:]
    return [[t for t in row if t != tok.eos_id] for row in out.tolist()]


class Seq2Seq(weights.Family):
    """weights.Family's SFT methods for an encoder-decoder (t5.T5Family, with its generate and a plain
    tokenizer: chat_setup's): one (source, target) pair per row, the NLL over the target tokens."""

    def sft_check(self, cfg, grid):
        self.model_config(cfg)
        need(not cfg.pack, f"pack=True packs decoder rows; a {self.name} trains one (source, target) pair per row: "
             "set pack=False")

    def rows(self, convs, tok, template, T, pack):
        return rows(convs, tok, T)

    def describe(self, pairs, T, cfg):
        return sum(len(t) for _, t in pairs), f"{len(pairs):,} (source, target) pairs of at most {T} tokens"

    def sft_loader(self, pairs, cfg, grid):
        return PairRows(pairs, cfg.micro_batch_size, grid.data_rank, grid.data_world, cfg.seed, grid.device)

    def sft_batch(self, pairs, device="cpu"):
        src, y, _, mask = batch(pairs, device)
        return src, y, dict(reduction="sum", src_mask=mask)

    def answers(self, raw, tok, template, prompts, cfg):
        return answers(raw, tok, prompts, cfg.eval_tokens, self.generate)
