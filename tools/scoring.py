"""How a model's answers are scored: log-probs of given continuations (multiple choice as
lm-evaluation-harness does it), bits per byte, generation to stop strings, exact match, pass@k.

Plain functions over a parallel.Net `net` and a tokenizer, used by eval.py (the evaluation
script: its tasks, prompts and CLI) and by pretrain.py (its validation logs val_bpb through
nll_terms / bpb_of). Under data parallelism each rank scores whole batches (batch j on rank
j % ranks) and the results are gathered, so numbers do not depend on the layout.

The rules, as the references apply them:
- bits per byte: the NLL of every target token that stands for text (special tokens have 0 bytes
  and are left out, as nanochat does) in bits / its UTF-8 bytes: comparable across tokenizers.
- multiple choice (lm-evaluation-harness): the continuation " " + choice (a chat template's
  prompt: the bare choice) is scored by the sum of its token log-probs, with the context's trailing
  whitespace moved to it and the pair tokenised whole then split (encode_pair), left-truncated to
  block_size + 1 tokens; acc = argmax of the sums, acc_norm = argmax of the sums divided by the
  choice's length in characters.
- a prompt a chat template rendered is tokenised as an HF tokenizer does it (encoder): the
  template's special tokens as their single ids, the text between them as ordinary text.
- pass@k: the unbiased estimator 1 - C(n-c, k) / C(n, k) (Chen et al. 2021).
"""
import math
import re

import numpy as np
import torch
import torch.distributed as dist

import generate
from config import UserError
from model import IGNORE
from posttrain import sandbox

GSM8K_STRICT = re.compile(r"#### (\-?[0-9\.\,]+)")
GSM8K_FLEX = re.compile(r"(-?[$0-9.,]{2,})|(-?[0-9]+)")
GSM8K_IGNORE = (",", r"\$", r"(?s).*#### ", r"\.$")            # lm-eval's regexes_to_ignore


class EvalError(UserError, ValueError):
    """A task, a data file or a setting eval.py cannot use."""


# ----------------------------------------------------------------------------- scoring

def encoder(tok, template=None):
    """text -> ids: tok.encode, or (template: a chat.ChatTemplate) the template's special tokens in the
    text as their single ids and the text between them as ordinary text, as an HF tokenizer encodes a
    rendered chat prompt (tok: chat.setup's, which has those tokens)."""
    if template is None:
        return tok.encode
    return lambda text: [i for a, b, special in template.pieces(text, ())
                         for i in ([tok.special_tokens[special]] if special else tok.encode(text[a:b]))]


def encode_pair(tok, context, continuation, add_bos=False, encode=None):
    """lm-eval's _encode_pair: trailing whitespace of the context moves to the continuation; the pair
    is tokenised whole (by encode: default tok.encode) and split at the context's length. An empty
    context is BOS (EOS without one)."""
    bos = getattr(tok, "bos_id", None)
    if add_bos and bos is None:
        raise EvalError(f"add_bos=True but tokenizer {tok.name} has no BOS token: drop --add_bos")
    prefix, encode = [bos] if add_bos else [], encode or tok.encode
    if not context:
        first, cont = tok.eos_id if bos is None else bos, encode(continuation)
        return ([first], cont) if cont[:1] != [first] else (cont[:1], cont[1:])
    n = len(context) - len(context.rstrip())
    if n:
        context, continuation = context[:-n], context[-n:] + continuation
    whole, ctx = prefix + encode(context + continuation), prefix + encode(context)
    return ctx, whole[len(ctx):]


def gather_rows(out, grid):
    """{row index: value} of every data-parallel rank, merged (every rank gets all)."""
    if grid.data_world > 1:
        parts = [None] * grid.data_world
        dist.all_gather_object(parts, out, group=grid.data_group)
        out = {k: v for p in parts for k, v in p.items()}
    return out


def my_batches(n_batches, grid):
    """Global batch j runs on data-parallel rank j % ranks; every rank gets the same number of steps
    (None: an idle step, so that collectives inside the forward, FSDP's and EP's, stay matched)."""
    mine = list(range(grid.data_rank, n_batches, grid.data_world))
    steps = -(-n_batches // grid.data_world)
    return mine + [None] * (steps - len(mine))


@torch.no_grad()
def token_logprobs(net, rows, batch_size, autocast=None):
    """rows: (ids, mask) with mask[t] True where target ids[t + 1] is scored -> per row the log-probs
    of its scored targets (float64 tensor), from -model(x, y, reduction="none") (TP: the vocab-parallel
    loss, logits never gathered). Rows are sorted by length and batched (right padding, which causal
    attention never sees); the results are gathered from every data-parallel rank."""
    order = sorted(range(len(rows)), key=lambda i: -len(rows[i][0]))
    batches = [order[j:j + batch_size] for j in range(0, len(order), batch_size)]
    device = net.grid.device
    out = {}
    for j in my_batches(len(batches), net.grid):
        b = batches[j] if j is not None else []
        T = max((len(rows[i][0]) - 1 for i in b), default=1)
        x = torch.zeros(max(len(b), 1), T, dtype=torch.long)
        y = torch.full_like(x, IGNORE)
        for r, i in enumerate(b):
            ids, mask = rows[i]
            x[r, :len(ids) - 1] = torch.tensor(ids[:-1])
            y[r, :len(ids) - 1] = torch.where(torch.tensor(mask), torch.tensor(ids[1:]), IGNORE)
        with autocast or torch.autocast(device.type, enabled=False):
            nll = net(x.to(device), y.to(device), reduction="none").double().cpu()
        for r, i in enumerate(b):
            out[i] = -nll[r][y[r] != IGNORE]
    out = gather_rows(out, net.grid)
    return [out[i] for i in range(len(rows))]


def multiple_choice(net, tok, docs, contexts, batch_size, autocast=None, add_bos=False, template=None):
    """lm-eval's multiple-choice scoring -> (metrics, per-doc results). Every (context, " " + choice)
    pair is one row, left-truncated to block_size + 1 tokens; template: the contexts are a chat
    template's prompts (evaltasks.chat_prompt), the continuation the bare choice (lm-eval's)."""
    rows, owner = [], []
    L = net.raw.cfg.block_size + 1
    encode, delimiter = encoder(tok, template), "" if template else " "
    for d, (doc, ctx) in enumerate(zip(docs, contexts)):
        for c, choice in enumerate(doc["choices"]):
            a, b = encode_pair(tok, ctx, delimiter + choice, add_bos, encode)
            if len(b) >= L:
                raise EvalError(f"document {d + 1}: choice {c} is {len(b)} tokens, block_size is {L - 1}")
            ids = (a + b)[-L:]
            rows.append((ids, [False] * (len(ids) - 1 - len(b)) + [True] * len(b)))
            owner.append(d)
    lps = token_logprobs(net, rows, batch_size, autocast)
    per_doc = [{"lls": [], "gold": doc["gold"]} for doc in docs]
    for d, lp in zip(owner, lps):
        per_doc[d]["lls"].append(float(lp.sum()))
    for doc, r in zip(docs, per_doc):
        norm = [ll / len(c) if c else -math.inf for ll, c in zip(r["lls"], doc["choices"])]
        r["acc"] = float(argmax(r["lls"]) == r["gold"])
        r["acc_norm"] = float(argmax(norm) == r["gold"])
    return {**mean_and_stderr("acc", [r["acc"] for r in per_doc]),
            **mean_and_stderr("acc_norm", [r["acc_norm"] for r in per_doc]), "n": len(docs)}, per_doc


def argmax(values):
    return max(range(len(values)), key=values.__getitem__)  # the first of equal maxima, as np.argmax


def mean_and_stderr(name, xs):
    """mean and lm-eval's standard error (sample standard deviation / sqrt(n))."""
    m = sum(xs) / len(xs) if xs else float("nan")
    se = math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1) / len(xs)) if len(xs) > 1 else float("nan")
    return {name: m, f"{name}_stderr": se}


# ----------------------------------------------------------------------------- bits per byte

def token_bytes(tok):
    """(n_vocab,) UTF-8 byte length of every token id; 0 for special tokens and unused ids."""
    enc, rank_of = tok.enc, getattr(tok, "rank_of", None)
    specials = set(tok.special_tokens.values())
    out = torch.zeros(tok.n_vocab, dtype=torch.long)
    for i in range(tok.n_vocab):
        if i not in specials and (rank_of is None or i in rank_of):
            try:
                out[i] = len(enc.decode_single_token_bytes(i if rank_of is None else rank_of[i]))
            except KeyError:  # a hole in the vocabulary
                pass
    return out


def nll_terms(nll, y, nbytes):
    """(B, T) NLL of targets y -> [mean NLL, 1, NLL of the targets with bytes, their bytes], to sum over
    batches and ranks: pretrain.py's validation loss and bits per byte (bpb_of) in one pass."""
    b = nbytes[y.clamp(min=0)] * (y != IGNORE)
    return torch.stack([nll.sum() / (y != IGNORE).sum(), torch.ones_like(nll[0, 0]), (nll * (b > 0)).sum(),
                        b.sum().to(nll.dtype)])


def bpb_of(sums):
    """[NLL of the text targets in nats, their UTF-8 bytes] -> bits per byte."""
    return float(sums[0] / math.log(2) / sums[1]) if float(sums[1]) else float("nan")


def bits_per_byte(net, tok, windows, batch_size, autocast=None, nbytes=None):
    """windows: token lists (each predicts its tokens 1..) -> loss (nats per target token), perplexity,
    bits per byte (targets with bytes only: NLL / ln 2 / their UTF-8 bytes), tokens, bytes."""
    nbytes = token_bytes(tok) if nbytes is None else nbytes
    lps = token_logprobs(net, [(w, [True] * (len(w) - 1)) for w in windows], batch_size, autocast)
    nll = tok_count = text_nll = n_bytes = 0.0
    for w, lp in zip(windows, lps):
        b = nbytes[torch.tensor(w[1:])].double()
        nll, tok_count = nll - float(lp.sum()), tok_count + len(lp)
        text_nll, n_bytes = text_nll - float((lp * (b > 0)).sum()), n_bytes + float(b.sum())
    if not n_bytes:
        raise EvalError("bits per byte: the evaluated text has no bytes (empty corpus?)")
    loss = nll / tok_count
    return {"bpb": text_nll / math.log(2) / n_bytes, "loss": loss, "ppl": math.exp(loss),
            "tokens": int(tok_count), "bytes": int(n_bytes)}


# ----------------------------------------------------------------------------- generation

def cut(text, stops):
    """text up to the first of the stop strings."""
    ends = [i for i in (text.find(s) for s in stops) if i >= 0]
    return text[:min(ends)] if ends else text


@torch.no_grad()
def generate_texts(net, tok, prompts, max_new_tokens, *, n=1, temperature=0.0, top_p=1.0, seed=0,
                   stops=(), batch_size=16, autocast=None, template=None):
    """Completions of text prompts by the fast decoder (generate.decode), n per prompt, cut at the
    first stop string (or EOS, or a chat tokenizer's end-of-turn id). Prompts (a chat template's:
    template, encoder) are left-truncated to leave max_new_tokens. Global batch j of prompts draws with seed + j on rank j % ranks: the texts do
    not depend on the layout."""
    L, device = net.raw.cfg.block_size, net.grid.device
    keep = L - max_new_tokens
    if keep < 1:
        raise EvalError(f"max_new_tokens={max_new_tokens} leaves no room for a prompt in block_size={L}")
    ids = [(encoder(tok, template)(p) or [tok.eos_id])[-keep:] for p in prompts]
    batches = [list(range(j, min(j + batch_size, len(ids)))) for j in range(0, len(ids), batch_size)]
    ends = sorted({tok.eos_id, getattr(tok, "eot_id", tok.eos_id)})  # a chat model's end of turn stops it too
    out = {}
    with net.full_params(), autocast or torch.autocast(device.type, enabled=False):
        for j in my_batches(len(batches), net.grid):
            b = batches[j] if j is not None else []
            r = generate.decode(net.raw, [ids[i] for i in b] or [[tok.eos_id]], max_new_tokens if b else 1,
                                vocab=tok, n=n, temperature=temperature, top_p=top_p, stop_tokens=ends,
                                pad_id=tok.eos_id, seed=seed + (j or 0))
            gen = r.tokens[:, r.prompt_len:].tolist()
            for k, i in enumerate(b):
                rows = [gen[k * n + s][:int(r.lengths[k * n + s])] for s in range(n)]
                out[i] = [cut(tok.decode([t for t in row if t not in ends]), stops) for row in rows]
    out = gather_rows(out, net.grid)
    return [out[i] for i in range(len(prompts))]


def pass_at_k(n, c, k):
    """The unbiased estimator of Chen et al. (2021): 1 - C(n - c, k) / C(n, k), as a stable product."""
    if n - c < k:
        return 1.0
    return 1.0 - float(np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def code_scores(items, completions, ks, timeout=10.0, workers=4):
    """pass@k of n completions per HumanEval item (tasks.human_eval) in sandbox.py's sandbox: the
    program is the item's code_prompt + completion, then its tests (check(entry_point)).
    -> (metrics, passes per item)."""
    flat = [(i, it["code_prompt"] + c, it["tests"]) for i, (it, cs) in enumerate(zip(items, completions)) for c in cs]
    results = sandbox.run_many([p for _, p, _ in flat], [t for _, _, t in flat], workers=workers, timeout=timeout)
    passed = [0] * len(items)
    for (i, _, _), r in zip(flat, results):
        passed[i] += r.passed
    at_k = {f"pass@{k}": float(np.mean([pass_at_k(len(cs), c, k) for cs, c in zip(completions, passed)])) for k in ks}
    return {**at_k, "n": len(items), "samples": len(completions[0]) if completions else 0}, passed


def gsm8k_extract(text, strict):
    """lm-eval's gsm8k filters: strict = the number after '#### ', flexible = the last number."""
    found = (GSM8K_STRICT if strict else GSM8K_FLEX).findall(text)
    if not found:
        return "[invalid]"
    m = found[0 if strict else -1]
    if isinstance(m, tuple):  # several groups: the first that matched
        m = next((g for g in m if g), "[invalid]")
    return m.strip()


def gsm8k_normalise(text):
    for pattern in GSM8K_IGNORE:
        text = re.sub(pattern, "", text)
    return text.lower()


def gsm8k_scores(completions, docs):
    """lm-eval's exact match (ignore_case, its regexes_to_ignore) of the strict and flexible answers."""
    per = []
    for text, doc in zip(completions, docs):
        gold = gsm8k_normalise(doc["target"])
        per.append({k: float(gsm8k_normalise(gsm8k_extract(text, k == "strict")) == gold)
                    for k in ("strict", "flexible")})
    return {**mean_and_stderr("exact_match_strict", [p["strict"] for p in per]),
            **mean_and_stderr("exact_match_flexible", [p["flexible"] for p in per]), "n": len(docs)}, per
