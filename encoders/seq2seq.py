"""Sequence-to-sequence chat data for a T5: conversations as (source, target) pairs, batches, answers.

    pairs, dropped = seq2seq.rows(convs, tok, T)            # [(source ids, target ids)], Counter(too_long=n)
    src, y, pos, src_mask = seq2seq.batch(pairs[:4])        # pos None: a T5's micro-batch tuple
    loader = seq2seq.PairLoader(pairs, B, rank, world, seed, device)   # data.Loader's stream over pairs
    answers = seq2seq.answers(model, tok, prompts, 16)      # greedy t5.generate of source_text, EOS cut

sft.py trains a T5 init_from (objective "span") on these rows instead of chat.pack's: a
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
from encoders import t5
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


@torch.no_grad()
def answers(model, tok, prompts, max_new_tokens):
    """Greedy answers (token lists, EOS and what follows cut) of a t5.T5 to chat prompts (message lists)."""
    dev = next(model.parameters()).device
    src, _, _, mask = batch([(tok.encode(source_text(p)), [0]) for p in prompts], dev)
    out = t5.generate(model, src, max_new_tokens, vocab=tok, src_mask=mask, temperature=0.0, stop_tokens=[tok.eos_id],
                      pad_id=tok.eos_id)[:, 1:]
    return [[t for t in row if t != tok.eos_id] for row in out.tolist()]
