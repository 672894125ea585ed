"""Generation: the KV caches, sampling filters, the eager generate() and the fast decoder decode().

    out = generate.generate(model, idx, 100, vocab=tok, temperature=0.8, top_k=50, stop_tokens=[eos])   # eager
    r = generate.decode(model, prompts, 256, vocab=tok, n=8, temperature=1.0, top_p=0.95, stop_tokens=[eos], seed=0)
    r.tokens, r.mask, r.logprobs, r.lengths   # (B*n, T+N) ids, real-token mask, (B*n, N) log-probs, (B*n,)

Which is used when: decode() everywhere text is generated (sample.py, pretrain.py's final sample,
the later stages), on every device: on CUDA its step is captured as a CUDA graph, on CPU (and
under tensor parallelism or MoE) the same step runs uncaptured, so one code path is tested
everywhere. generate() is the readable reference the tests hold decode() to, and the fallback to
read or edit: a plain loop over a growing KVCache that any change to the model's forward keeps
working with. How decode() works (static cache, captured step, buckets, sampling, log-probs,
layouts) is in its docstring. cast_copy(model, dtype) / refresh(copy, model): a copy for decode()
to read, nn.Linear weights in the compute dtype, refreshed in place between calls; rollout(): a data
rank's share of prompts x G samples (GRPO).

Invariants: no decoder emits an id its `vocab` (the tokenizer, required) cannot decode (Emittable);
greedy decode() gives generate()'s tokens; decode()'s log-probs are those of a teacher-forced
forward over the same tokens with its logits divided by the same temperature; a captured step
computes what the uncaptured one does. Given a cache (Cache: `length`, attend(), its
`kernel`), the model's attention is the cache's: so the caches, their attention and the decoders live
here, and model.py holds the training model only.
"""
import contextlib
import itertools
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import flex_attention

import fused
import moe
from model import position_ids, round_up, sdpa


class Cache:
    """What model.Attention hands a layer's attention to when its forward is given a cache: attend()
    stores the new keys and values (the subclass's update(layer, k, v) -> every key and value cached
    so far, (B, KV, S, D)) and attends over them. `kernel`: None, SDPA; else decode()'s kernel, (q, k,
    v, mask) -> output, all (B, heads, ., D) (flex_attend, fused.decode_attention)."""
    kernel = None

    def attend(self, layer, q, k, v, mask=None, is_causal=True, dropout=0.0):
        """q (B, T, H, D), k and v (B, T, KV, D) of the new tokens -> their attention output (B, T, H * D)."""
        B, T, H, D = q.shape
        q = q.transpose(1, 2)
        k, v = self.update(layer, k.transpose(1, 2), v.transpose(1, 2))  # (B, KV, S, D): cached so far + new
        if self.kernel is not None:
            return self.kernel(q, k, v, mask).transpose(1, 2).reshape(B, T, H * D)
        KV = k.shape[1]
        if KV != H and T == 1 and not is_causal and (mask is None or mask.shape[1] == 1):
            # one new token (decoding): a kv head's H/KV query heads become H/KV query rows of one
            # MHA head, so the cache is read once, never repeated per query head
            y = F.scaled_dot_product_attention(q.reshape(B, KV, H // KV, D), k, v, attn_mask=mask, dropout_p=dropout)
        else:
            y = sdpa(q, k, v, mask, is_causal, dropout).transpose(1, 2)
        return y.reshape(B, T, H * D)


class KVCache(Cache):
    """Keys and values of every layer, preallocated (B, KV, max_len, D) on first use.

    Buffers take the dtype, device and head count of the first keys written, so the cache
    follows autocast and tensor parallelism without being told. `length` is a Python int,
    advanced by Transformer.forward after all layers have appended.
    """

    def __init__(self, max_len):
        self.max_len = max_len
        self.length = 0
        self.k, self.v = [], []

    def update(self, layer, k, v):
        """Write k, v (B, KV, T, D) at positions length..length+T; return all cached (B, KV, S, D)."""
        B, KV, T, D = k.shape
        if layer == len(self.k):
            self.k.append(k.new_zeros(B, KV, self.max_len, D))
            self.v.append(v.new_zeros(B, KV, self.max_len, D))
        S = self.length + T
        if S > self.max_len:
            raise ValueError(f"KVCache holds {self.max_len} positions, {S} needed: allocate a longer cache")
        self.k[layer][:, :, self.length:S] = k
        self.v[layer][:, :, self.length:S] = v
        return self.k[layer][:, :, :S], self.v[layer][:, :, :S]


class Emittable:
    """The ids a decoder may emit, as the first filter of every decoder (generate, decode, t5's,
    prefix's): a model's vocabulary can hold ids its tokenizer cannot decode (rows padded to a
    multiple, T5's sentinels, chat tokens a plain tokenizer lacks, the holes of cl100k_base / o200k_base:
    tokenizer.find_holes), and one of them sampled crashes tok.decode. vocab: the tokenizer that will
    decode the output (ids below its n_vocab, less its `holes`), or an int n (ids 0..n-1: a model
    without a tokenizer); V: the model's vocabulary. Every decoder requires vocab: none can forget it.

    allowed(logits) -> (..., n): the first n columns, -inf at the holes: a slice (a view, free), and
    one masked_fill only where there are holes; no host sync, the mask at a fixed address (capturable).
    Only the sampled ids are limited: log-probs stay those of the model's full distribution
    (decode's docstring: as top-k / top-p, which filter what is sampled, not the log-probs)."""

    def __init__(self, vocab, V, device=None):
        if isinstance(vocab, int) and not isinstance(vocab, bool):
            n, holes = vocab, ()
        elif hasattr(vocab, "n_vocab"):
            n, holes = vocab.n_vocab, getattr(vocab, "holes", ())
        else:
            raise TypeError(f"vocab={vocab!r}: pass the tokenizer that decodes the output (or an int: ids 0..n-1)")
        self.n = min(n, V)
        if self.n < 1:
            raise ValueError(f"vocab={vocab!r} leaves no id to emit")
        self.holes = tuple(h for h in holes if h < self.n)
        self.mask = None
        if self.holes:
            self.mask = torch.zeros(self.n, dtype=torch.bool, device=device)
            self.mask[list(self.holes)] = True

    def __call__(self, logits):
        logits = logits[..., :self.n]
        return logits if self.mask is None else logits.masked_fill(self.mask, float("-inf"))


def top_k_filter(logits, k):
    """Keep the k largest logits per row, -inf elsewhere."""
    kth = logits.topk(min(k, logits.shape[-1]), dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth, float("-inf"))


def top_p_filter(logits, p):
    """Nucleus filtering: keep the smallest set of most likely tokens whose probability sums to >= p."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    before = F.pad(probs.cumsum(dim=-1)[..., :-1], (1, 0))  # mass of all strictly more likely tokens
    sorted_logits = sorted_logits.masked_fill(before >= p, float("-inf"))  # the set was already complete
    return torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)


def sample(logits, temperature=1.0, top_k=None, top_p=None, generator=None):
    """(B, V) logits -> (B,) token ids."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits.float() / temperature
    if top_k:
        logits = top_k_filter(logits, top_k)
    if top_p is not None and top_p < 1.0:
        logits = top_p_filter(logits, top_p)
    return torch.multinomial(logits.softmax(dim=-1), 1, generator=generator).squeeze(-1)


@torch.no_grad()
def generate(model, idx, max_new_tokens, *, vocab, temperature=1.0, top_k=None, top_p=None,
             stop_tokens=None, pad_id=None, attention_mask=None, generator=None, seed=None):
    """Sample continuations of a batch of prompts from model (a model.Transformer, plain or
    tensor-parallel: every TP rank calls it with the same seed) with a KV cache.

    idx: (B, T) prompts, left-padded; attention_mask (B, T) 0/1 marks real tokens (None = all).
    vocab: the tokenizer that decodes the output, or an int n (Emittable: only ids it decodes are sampled).
    temperature 0 -> greedy; top_k / top_p (nucleus) filter before sampling.
    A row that emits one of stop_tokens then repeats pad_id (default: that stop token);
    generation ends early once every row has stopped.
    Returns (B, T + n_generated). Runs in eval mode (no dropout) and restores the mode.
    """
    B, T = idx.shape
    if T + max_new_tokens > model.cfg.block_size:
        raise ValueError(f"prompt length {T} + max_new_tokens {max_new_tokens} exceeds "
                         f"block_size={model.cfg.block_size}: shorten the prompt or generate fewer tokens")
    if temperature < 0:
        raise ValueError(f"temperature={temperature} must be >= 0 (0 = greedy)")
    if generator is None and seed is not None:
        generator = torch.Generator(idx.device).manual_seed(seed)
    if isinstance(stop_tokens, int):
        stop_tokens = [stop_tokens]
    stops = torch.as_tensor(list(stop_tokens), device=idx.device) if stop_tokens else None
    mask = None if attention_mask is None else attention_mask.bool()
    done = torch.zeros(B, dtype=torch.bool, device=idx.device)
    fill = torch.full((B,), -1 if pad_id is None else pad_id, dtype=idx.dtype, device=idx.device)
    allowed = Emittable(vocab, model.cfg.vocab_size, idx.device)

    was_training = model.training
    model.eval()
    try:
        cache = KVCache(T + max_new_tokens)
        x = model.hidden_states(idx, cache=cache, attn_mask=mask)  # prefill: all prompts at once
        out = [idx]
        for step in range(max_new_tokens):
            logits = allowed(model.logits(x[:, -1]))  # head on the last position only
            nxt = sample(logits, temperature, top_k, top_p, generator)
            if stops is not None:
                nxt = torch.where(done, fill, nxt)
                hit = torch.isin(nxt, stops) & ~done
                if pad_id is None:
                    fill = torch.where(hit, nxt, fill)
                done = done | hit
            out.append(nxt[:, None])
            if step == max_new_tokens - 1 or (stops is not None and bool(done.all())):
                break
            if mask is not None:
                mask = torch.cat([mask, mask.new_ones(B, 1)], dim=1)
            x = model.hidden_states(nxt[:, None], cache=cache, attn_mask=mask)
    finally:
        model.train(was_training)
    return torch.cat(out, dim=1)


# ----------------------------------------------------------------------------- the fast decoder

SDPA = {"math": SDPBackend.MATH, "efficient": SDPBackend.EFFICIENT_ATTENTION,
        "flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}
# decode(attention=...): SDPA (it picks a kernel), one of SDPA's kernels, flex_attend, fused.decode_attention
ATTENTION = ("sdpa", *SDPA, "flex", "triton")


class StaticCache(Cache):
    """Keys and values of every layer, (R, KV, max_len, D), allocated once, written in place.

    Each layer has tensors of its own (views of one big buffer made a compiled step slower:
    BENCHMARKS.md). update() writes the new keys at the slots in `index` (a device tensor: 0..T-1 for
    the prefill, then the one slot a decode step advances itself) with index_copy_ and returns the
    first `span` slots: a KV-length bucket, so a step reads the slots filled so far rounded up, not
    the whole cache; the caller's attention mask says which of them hold real keys. `length` reads
    0 and ignores writes: positions and masks always come from the caller, so no Python number
    changes between steps (Transformer.hidden_states would otherwise offset by it).
    """

    def __init__(self, max_len, index):
        self.max_len, self.index, self.span = max_len, index, max_len
        self.k, self.v = [], []
        self.kernel = None  # decode()'s attention kernel (Cache); None: SDPA

    length = property(lambda self: 0, lambda self, value: None)

    def update(self, layer, k, v):
        if layer == len(self.k):  # first write (the prefill): dtype, device, heads follow autocast and TP
            B, KV, _, D = k.shape
            self.k.append(k.new_zeros(B, KV, self.max_len, D))
            self.v.append(v.new_zeros(B, KV, self.max_len, D))
        self.k[layer].index_copy_(2, self.index, k)
        self.v[layer].index_copy_(2, self.index, v)
        return self.k[layer][:, :, :self.span], self.v[layer][:, :, :self.span]

    def load(self, prefill, n):
        """Row b of the prefill's cache becomes rows b*n .. b*n+n-1 (n samples share a prefill),
        into this cache's buffers when it has them (their addresses are captured), else new ones."""
        for mine, theirs in ((self.k, prefill.k), (self.v, prefill.v)):
            if not mine:
                mine.extend(t if n == 1 else t.repeat_interleave(n, dim=0) for t in theirs)
                continue
            for dst, src in zip(mine, theirs):
                dst.view(src.shape[0], n, *src.shape[1:]).copy_(src[:, None])


PREFILL_MASK_BYTES = 2**30  # the largest (B, T, T) boolean mask of a padded prefill; beyond it, each row alone


def prefill_rows(model, idx, mask, S, by_row=True):
    """decode()'s prefill of B prompts (B, T) over their T slots of an S-slot StaticCache -> (the cache, the
    last hidden state of each row). Without padding: the causal path (no mask tensor: flash). With left
    padding, one batched forward in which query i sees the real keys j <= i (and itself: no NaN rows) while
    its (B, T, T) mask stays within PREFILL_MASK_BYTES; past that (64 prompts of 16k tokens: 17 GB of mask),
    each row alone over its real tokens on the causal path, its keys written to its last slots: memory linear
    in T, the same positions (0 at a row's first real token) and so the same cache. by_row=False: always one
    forward (expert parallelism: every rank must run the same forwards, whatever its prompts)."""
    B, T = idx.shape
    slots = torch.arange(T, device=idx.device)
    padded = not bool(mask.all())
    by_row = (by_row and padded and B * T * T > PREFILL_MASK_BYTES
              and bool((mask.int().diff(dim=1) >= 0).all()))  # each row: padding, then its real tokens
    if not by_row:
        cache = StaticCache(S, slots)
        cache.span = T
        keys = None
        if padded:
            keys = ((slots[None, :] <= slots[:, None]) & mask[:, None, :]) | (slots[None, :] == slots[:, None])
        h = model.hidden_states(idx, cache=cache, pos=position_ids(mask) if padded else None, attn_mask=keys)
        return cache, h[:, -1]
    cache, last = StaticCache(S, slots), []
    cache.span = T
    for b, n in enumerate(mask.sum(1).tolist()):
        alone = StaticCache(n, slots[:n])
        last.append(model.hidden_states(idx[b:b + 1, T - n:], cache=alone)[:, -1])
        for mine, theirs in ((cache.k, alone.k), (cache.v, alone.v)):
            if not mine:
                mine.extend(t.new_zeros(B, t.shape[1], S, t.shape[3]) for t in theirs)
            for dst, src in zip(mine, theirs):
                dst[b, :, T - n:T] = src[0]
    return cache, torch.cat(last)


def flex_attend(q, k, v, mask):
    """Attention of q (R, H, T, D) over the cache's k, v (R, KV, L, D) with torch's flex_attention,
    the float key bias mask (R, 1, 1, L) added as its score_mod. Under torch.compile it is a Triton
    kernel that splits the keys of one-token queries over many blocks (flex decoding), where SDPA's
    kernels tile queries, of which a decode step has one per head."""
    bias = mask[:, 0, 0]
    return flex_attention(q, k, v, score_mod=lambda score, b, h, i, j: score + bias[b, j],
                          enable_gqa=q.shape[1] != k.shape[1])


def top_candidates(logits, k, block=64):
    """(R, V) -> values, ids (R, k): the k largest logits of each row, in no set order. The k blocks
    of `block` columns with the largest maxima hold every one of them (a block whose maximum k other
    blocks beat holds no logit of the top k), so torch.topk runs over the blocks' maxima, then over
    those k blocks: the same set, up to ties at the k-th value. Why: one torch.topk over rows of 50k
    takes its multi-block radix select, ~7 kernels, and the captured decode step runs faster without
    it (BENCHMARKS.md, sampling); rows of a few thousand columns take its one-kernel path."""
    R, V = logits.shape
    nb = -(-V // block)  # blocks, the last padded with -inf
    if nb <= 2 * k:
        return logits.topk(k, dim=-1, sorted=False)
    x = F.pad(logits, (0, nb * block - V), value=float("-inf")).view(R, nb, block)
    best = x.amax(-1).topk(k, dim=-1, sorted=False).indices  # (R, k) blocks
    vals, j = x.gather(1, best[:, :, None].expand(R, k, block)).view(R, k * block).topk(k, dim=-1, sorted=False)
    ids = (best[:, :, None] * block + torch.arange(block, device=logits.device)).view(R, k * block).gather(-1, j)
    return vals, ids.clamp_(max=V - 1)  # a padding column only when fewer than k logits are finite


def pick(logits, temperature=1.0, top_k=None, top_p=None, noise=None, allowed=None):
    """(R, V) logits -> (tokens (R,), log-probs (R,) of those tokens under log_softmax(logits / t)),
    t = temperature (1 when greedy), taken before the filters; allowed (an Emittable) the first filter,
    its n columns the ones noise races. Sampling is the exponential race:
    argmax over the filtered logits / t minus log(noise), noise ~ Exp(1) i.i.d.; token i wins with
    probability softmax_i (Gumbel-max's twin). noise (R, V) races every token; with top_k, noise
    (R, min(top_k, V)) races only the candidates top_candidates returns: the same distribution without
    a pass over the vocabulary after topk (a tie at the k-th logit keeps k tokens, not every tied
    one). noise None or temperature 0: greedy. Fixed shapes, no host sync: it runs in the graph."""
    t, full = temperature or 1.0, logits
    logits = logits if allowed is None else allowed(logits)
    if temperature == 0 or noise is None:
        tok = logits.argmax(dim=-1)
    elif top_k and noise.shape[-1] < logits.shape[-1]:
        vals, ids = top_candidates(logits, noise.shape[-1])
        z = vals.float() / t
        if top_p is not None and top_p < 1.0:
            z = top_p_filter(z, top_p)
        tok = ids.gather(-1, (z - noise.log()).argmax(dim=-1, keepdim=True)).squeeze(-1)
    else:
        z = logits.float() / t
        if top_k:
            z = top_k_filter(z, top_k)
        if top_p is not None and top_p < 1.0:
            z = top_p_filter(z, top_p)
        tok = (z - noise.log()).argmax(dim=-1)
    return tok, log_softmax_at(full, tok, t)


def log_softmax_at(logits, tok, t=1.0, block=64):
    """log_softmax(logits / t) at tok (R,), in fp32: the logit minus its row's logsumexp, taken over
    blocks of `block` columns, then over the blocks. Why blocks: a reduction over 50k columns runs
    one program per row, R in all (64 at B = 64), slow in a decode step (BENCHMARKS.md, sampling);
    blocks give the GPU R * V / block of them."""
    z = logits.float() / t
    R, V = z.shape
    nb = -(-V // block)
    lse = torch.logsumexp(F.pad(z, (0, nb * block - V), value=float("-inf")).view(R, nb, block), -1).logsumexp(-1)
    return z.gather(-1, tok[:, None]).squeeze(-1) - lse


def pad_prompts(prompts, pad_id=0, device=None):
    """A list of 1-D token sequences -> (idx (B, T) left-padded with pad_id, mask (B, T) bool)."""
    rows = [torch.as_tensor(p, dtype=torch.long).flatten() for p in prompts]
    if not rows or min(len(r) for r in rows) == 0:
        raise ValueError("decode: every prompt needs at least one token")
    T = max(len(r) for r in rows)
    idx = torch.full((len(rows), T), pad_id, dtype=torch.long)
    mask = torch.zeros(len(rows), T, dtype=torch.bool)
    for b, r in enumerate(rows):
        idx[b, T - len(r):], mask[b, T - len(r):] = r, True
    return idx.to(device), mask.to(device)


def cuda_graph(fn, state, warmup=3, pool=None):
    """Capture fn() (it reads and writes only tensors it closes over) as one CUDA graph; return
    its replay. The warm-up runs torch.cuda.graph needs (on a side stream; compilation happens
    here) would advance the state: `state` tensors are restored after each, so every warm-up runs
    the same step and none writes past the buffers (a decode of 2 new tokens has 2 columns). Graphs that share a pool
    (torch.cuda.graph_pool_handle()) share their temporaries' memory: replay them one at a time.
    Under autocast the graph casts the weights itself: autocast's cached casts are freed when its
    context exits, and the graph may be replayed after that (decode's keep=)."""
    saved = [t.clone() for t in state]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.autocast("cuda", torch.get_autocast_dtype("cuda"), torch.is_autocast_enabled("cuda"), cache_enabled=False):
        with torch.cuda.stream(side):
            for _ in range(warmup):
                fn()
                for t, s in zip(state, saved):
                    t.copy_(s)
        torch.cuda.current_stream().wait_stream(side)
        with torch.cuda.graph(graph, pool=pool):
            fn()  # recorded, not run
    for t, s in zip(state, saved):
        t.copy_(s)
    return graph.replay


def stopped(done, group=None):
    """Has every row stopped? One host sync. group: the ranks whose steps exchange tokens (expert
    parallelism; they hold different prompts): all must run the same number of steps, so each
    goes on until every rank's rows have stopped."""
    left = (~done).sum()
    if group is not None:
        dist.all_reduce(left, group=group)
    return int(left) == 0


class Decoder:
    """The decode loop's state: the R-row cache and every tensor the step reads or writes, at fixed
    addresses, and the step captured once per KV-length bucket. decode() builds one per call, or
    keeps it (keep=) for the next call of the same shapes and settings: the graphs are replayed
    again, nothing is captured (or compiled) twice. One step per graph: the CPU launches a replay
    in microseconds and is far ahead of a step the GPU needs most of a millisecond for, so several
    steps per captured graph should change little (not done)."""

    def __init__(self, model, R, S, N, width, dtype, *, temperature, top_k, top_p, pad_id, stops, graph, compile,
                 allowed):
        dev = next(model.parameters()).device
        self.model, self.pad_id, self.graph = model, pad_id, graph
        # allowed: the Emittable whose mask the graphs read (kept with the decoder: its address stays)
        self.sampling = dict(temperature=temperature, top_k=top_k, top_p=top_p, allowed=allowed)
        self.index = torch.zeros(1, dtype=torch.long, device=dev)  # the slot the next token's keys go to
        self.first = torch.zeros(1, dtype=torch.long, device=dev)  # slot - first = output column
        self.cache = StaticCache(S, self.index)
        self.bias = torch.zeros(R, S, dtype=dtype, device=dev)  # added to the scores: 0 real key, -inf not
        self.pos = torch.zeros(R, dtype=torch.long, device=dev)  # the next token's position in its row
        self.tok = torch.zeros(R, dtype=torch.long, device=dev)
        self.done = torch.zeros(R, dtype=torch.bool, device=dev)
        self.lengths = torch.zeros(R, dtype=torch.long, device=dev)
        self.out_tok = torch.full((R, N), pad_id, dtype=torch.long, device=dev)
        self.out_lp = torch.zeros(R, N, dtype=torch.float32, device=dev)
        self.noise = torch.empty(R, width, device=dev) if temperature > 0 else None
        self.stops = None if stops is None else stops.clone()
        # the step as a function of the decoder (not a bound method: no reference cycle keeps a dropped
        # decoder's cache and graphs alive until the garbage collector runs)
        self.fn = torch.compile(Decoder.step, **({} if compile is True else compile)) if compile else Decoder.step
        self.graphs, self.pool = {}, torch.cuda.graph_pool_handle() if graph else None

    def start(self, prefill, n, keys, pos, stops):
        """A new batch of B prompts, n rows each: the prefill's cache, keys (B, S) which slots hold
        real keys, pos (B,) the next positions, the stop tokens, copied in (the addresses stay)."""
        T = prefill.span
        self.cache.load(prefill, n)
        self.index.fill_(T)
        self.first.fill_(T - 1)
        B, S = keys.shape
        self.bias.view(B, n, S).copy_(keys.new_zeros(B, 1, S, dtype=self.bias.dtype).masked_fill_(~keys[:, None], float("-inf")))
        self.pos.view(B, n).copy_(pos[:, None])
        self.done.zero_()
        self.lengths.zero_()
        self.out_tok.fill_(self.pad_id)
        self.out_lp.zero_()
        if stops is not None:
            self.stops.copy_(stops)

    def emit(self, logits, col):
        nxt, lp = pick(logits, noise=self.noise, **self.sampling)
        nxt, lp = nxt.masked_fill(self.done, self.pad_id), lp.masked_fill(self.done, 0.0)
        self.lengths.add_((~self.done).long())
        if self.stops is not None:
            self.done.logical_or_((nxt[:, None] == self.stops).any(-1))
        self.out_tok.index_copy_(1, col, nxt[:, None])
        self.out_lp.index_copy_(1, col, lp[:, None])
        self.tok.copy_(nxt)

    def step(self):
        """One token per row; fixed shapes, no host sync: capturable."""
        self.bias.index_fill_(1, self.index, 0.0)
        h = self.model.hidden_states(self.tok[:, None], cache=self.cache, pos=self.pos[:, None],
                                     attn_mask=self.bias[:, None, :self.cache.span])
        self.emit(self.model.logits(h[:, 0]), self.index - self.first)
        self.pos.add_(1)
        self.index.add_(1)

    def advance(self, span):
        """One step attending over the first `span` cache slots: run, or replayed from its graph."""
        self.cache.span = span
        if not self.graph:
            return self.fn(self)
        if span not in self.graphs:  # the first capture warms up cuBLAS & co; later ones only compile
            state = [self.index, self.bias, self.pos, self.tok, self.done, self.lengths, self.out_tok, self.out_lp]
            self.graphs[span] = cuda_graph(lambda: self.fn(self), state, warmup=1 if self.graphs else 3, pool=self.pool)
        self.graphs[span]()


@dataclass
class Rollout:
    """What decode() returns; row r is sample r % n of prompt r // n."""
    tokens: torch.Tensor    # (R, T + N) left-padded prompt, then generated ids (pad_id after a stop)
    mask: torch.Tensor      # (R, T + N) bool: real tokens (prompt, generated up to and with the stop)
    logprobs: torch.Tensor  # (R, N) fp32 log-prob of each generated token (decode's docstring); 0 after
    lengths: torch.Tensor   # (R,) generated tokens per row, the stop token included
    prompt_len: int         # T: generated tokens start at column T

    def texts(self, tok, stops=()):
        """Each row's generated text, without its stop token (one of stops) when it stopped."""
        gen = zip(self.tokens[:, self.prompt_len:].tolist(), self.lengths.tolist())
        return [tok.decode(t[:n - (t[n - 1] in stops)]) for t, n in gen]


@torch.no_grad()
def decode(model, prompts, max_new_tokens, *, vocab, n=1, temperature=1.0, top_k=None, top_p=None,
           stop_tokens=None, pad_id=0, attention_mask=None, seed=None, generator=None,
           check_every=16, graph=None, compile=False, bucket=64, fuse_mlp=True, candidates=True,
           attention=None, keep=None):
    """Sample max_new_tokens (fewer when every row stopped) for each prompt, n times each.

    prompts: a list of 1-D token sequences (any lengths; left-padded here), or (B, T) ids with
      attention_mask (B, T) 0/1 (None: all real). Positions count from each row's first real token.
    vocab: the tokenizer that decodes the output, or an int n: only ids it decodes are sampled (Emittable).
    n: samples per prompt; the prompt is prefilled once and its cache copied to its n rows.
    temperature 0: greedy; top_k / top_p filter before sampling (not the log-probs). seed or
      generator (on the model's device) fix the draws; neither: torch's global RNG.
    stop_tokens: a row stops after emitting one (it then yields pad_id); the whole batch ends once
      every row stopped, read every check_every steps (one host sync each).
    graph: capture the decode step as a CUDA graph (default: on CUDA, not for MoE, not under TP);
      compile: torch.compile the step first (CUDA: fused kernels inside the graph); True, or a dict
      of torch.compile's keyword arguments (tests trace it with fullgraph=True: no graph break).
    Speed settings (each exact; bench/bench_generate.py measures them one by one):
      bucket: a step attends over the cache slots filled so far rounded up to a multiple of bucket
        (one graph per bucket; with keep the cache is rounded up too); 0: the whole cache each step.
      fuse_mlp: one [gate | up] matmul per gated MLP (model.MLP.split off) instead of two.
      candidates: with top_k, race only the top_k candidates (pick()) instead of the vocabulary.
      attention: the steps' attention kernel: "triton" (fused.decode_attention, one query per head:
        the default when the step is captured, Triton is installed and the model is on the current
        CUDA device, where Triton launches), "sdpa" (SDPA picks: the default otherwise), SDPA's
        "math", "efficient", "flash" or "cudnn", or "flex" (flex_attend; compile it). The first
        call compiles and captures every bucket: tens of seconds (BENCHMARKS.md).
      keep: a dict owned by the caller, in which the decoder state (cache, buffers, captured
        graphs) stays for the next call with the same shapes and settings (GRPO's rollouts: no
        recapture, no recompile); it holds the cache's memory until cleared, one entry at a time.
        Under autocast captured steps cast the weights every step: a model in bf16 reads less.
    Returns a Rollout. Runs in eval mode and restores the mode.

    How it works. A StaticCache preallocated to longest prompt + new tokens, per-layer buffers
    written in place at a device-tensor slot; the prefill runs once on the B prompts (prefill_rows: long
    padded ones a row at a time) and its cache rows are copied to each prompt's n sample rows; then a
    one-token decode step (Decoder.step) whose shapes never change: token, per-row position, cache slot
    and key mask (a float bias, added to the scores) are device tensors the step reads and advances
    itself, so on CUDA it is captured as a CUDA graph (by hand, cuda_graph; compile=True first fuses it
    with torch.compile) and replayed, one launch per token. A step attends only over the cache slots
    filled so far, rounded up to a multiple of `bucket`: one graph per bucket, all sharing one memory pool. The
    MLP's gate and up projections run as one matmul. The step samples inside the graph
    (temperature, top-k, top-p, stop mask); the random numbers come from one exponential_ fill per
    step outside it (a captured graph cannot take a torch.Generator), and "is every row done?" is
    read every check_every steps, not per step (a host sync). Sampling is the exponential race
    (pick: argmax of log p - log E, E ~ Exp(1) per token: token i wins with probability p_i), with
    top-k among the k candidates only, so its seeded draws differ from generate()'s
    torch.multinomial; greedy is identical. A caller that decodes the same shapes again (GRPO)
    passes keep={}: the second call replays the graphs the first one captured. A captured step's
    attention is fused.decode_attention (Triton: split-KV, one query per head; SDPA's kernels tile
    16-128 queries and take well over the time the cache's bytes need: BENCHMARKS.md); an
    uncaptured step keeps SDPA (the kernel's gain was measured in captured steps only).
    Log-probs (GRPO's old policy): log_softmax(logits / t)[token] in fp32, t = temperature (t = 1
    when greedy), before top-k / top-p: the distribution a teacher-forced forward over the same
    tokens gives with its logits divided by the same t. 0 after a row's stop token.
    Layouts: tensor parallelism works as the eager path does (each rank its heads; the
    vocab-parallel head gathers the logits, so every rank samples the same token from the same
    seed); under FSDP call it inside parallel.Net.full_params() (parameters gathered once for the
    whole rollout, freed after); LoRA adapters run on the fly (lora.merge() first is the faster
    choice, same tokens); MoE layers run dropless during decoding (capacity_factor set to 0,
    restored after); their per-layer host sync makes the step uncapturable, so MoE models decode
    uncaptured, and under expert parallelism (ranks hold different prompts, every step exchanges
    tokens) the ranks stop together, when all of them have (stopped).
    """
    dev = next(model.parameters()).device
    if isinstance(prompts, torch.Tensor):
        idx = prompts.to(dev)
        mask = (torch.ones_like(idx, dtype=torch.bool) if attention_mask is None else attention_mask.to(dev).bool())
    else:
        idx, mask = pad_prompts(prompts, pad_id, dev)
    B, T = idx.shape
    N, R = max_new_tokens, B * n
    allowed = Emittable(vocab, model.cfg.vocab_size, dev)
    S = round_up(T + N, bucket) if bucket and keep is not None else T + N  # kept: other T, same cache
    moes = list(moe.layers(model))
    mlps = [m for m in model.modules() if getattr(m, "split", False)]
    tensor_parallel = not isinstance(model.head, torch.nn.Linear)
    if graph is None:
        graph = dev.type == "cuda" and not moes and not tensor_parallel and model.tok_emb.weight.device == dev
        # (embed_on_host: a lookup on the host cannot be captured)
    triton_here = fused.available(idx) and dev == torch.device("cuda", torch.cuda.current_device())
    alibi = model.cfg.pos_emb == "alibi"  # per-head score biases: SDPA takes them, triton and flex one bias per row
    for bad, msg in [
        (T + N > model.cfg.block_size, f"prompt length {T} + max_new_tokens {N} exceeds block_size="
         f"{model.cfg.block_size}: shorten the prompts or generate fewer tokens"),
        (N < 1 or n < 1 or check_every < 1, f"max_new_tokens={N}, n={n}, check_every={check_every} must be >= 1"),
        (temperature < 0, f"temperature={temperature} must be >= 0 (0 = greedy)"),
        (bucket < 0, f"bucket={bucket} must be >= 0 (0: attend over the whole cache)"),
        (attention not in (None, *ATTENTION), f"attention={attention!r}: choose one of {', '.join(ATTENTION)} or None"),
        (attention == "triton" and not triton_here, "attention='triton' needs Triton and the model on the current "
         "CUDA device (torch.cuda.set_device): pass attention=None (it picks)"),
        (alibi and attention in ("triton", "flex"), f"attention={attention!r} adds one key bias per row, ALiBi's "
         "differ per head: pass attention='sdpa' (or None)"),
        (not bool(mask.any(1).all()), "decode: every prompt needs at least one real token (attention_mask row of zeros)"),
        (graph and dev.type != "cuda", "graph=True needs the model on a CUDA device: pass graph=False"),
        (graph and bool(moes), "graph=True: MoE layers sync with the host per layer (dropless block sizes), "
         "so their step cannot be captured: pass graph=False")]:
        if bad:
            raise ValueError(msg)
    if attention is None:
        attention = "triton" if graph and triton_here and not alibi else "sdpa"
    if generator is None and seed is not None:
        generator = torch.Generator(dev).manual_seed(seed)
    stops = None if stop_tokens is None else torch.as_tensor(stop_tokens, device=dev).flatten()
    stops = stops if stops is not None and stops.numel() else None
    group = moes[0].data_group if moes and dist.is_initialized() else None
    group = group if group is not None and dist.get_world_size(group) > 1 else None

    was_training, capacity = model.training, [m.capacity_factor for m in moes]
    model.eval()
    for m in moes:
        m.capacity_factor = 0.0  # dropless at inference: no token's expert output is dropped
    for m in mlps:
        m.split = not fuse_mlp
    try:
        prefill, h = prefill_rows(model, idx, mask, S, by_row=group is None)
        logits = model.logits(h).repeat_interleave(n, dim=0)

        V = allowed.n  # the columns sampled from
        width = min(top_k, V) if candidates and top_k and temperature > 0 else V
        key = (R, S, N, width, V, allowed.holes, prefill.k[0].dtype, temperature, top_k, top_p, pad_id, fuse_mlp,
               attention, None if stops is None else stops.numel(), graph, repr(compile),
               tuple(t.data_ptr() for t in itertools.chain(model.parameters(), model.buffers())))
        dec = keep.get(key) if keep is not None else None
        if dec is None:
            dec = Decoder(model, R, S, N, width, prefill.k[0].dtype, temperature=temperature, top_k=top_k, top_p=top_p,
                          pad_id=pad_id, stops=stops, graph=graph, compile=compile, allowed=allowed)
            if keep is not None:
                keep.clear()  # one shape at a time: a new one frees the old cache and graphs
                keep[key] = dec
        dec.start(prefill, n, F.pad(mask, (0, S - T)), mask.sum(1), stops)
        del prefill, h

        if dec.noise is not None:
            dec.noise.exponential_(generator=generator)
        dec.emit(logits, torch.zeros(1, dtype=torch.long, device=dev))
        dec.cache.kernel = {"flex": flex_attend, "triton": fused.decode_attention}.get(attention)
        with sdpa_kernel(SDPA[attention]) if attention in SDPA else contextlib.nullcontext():
            for s in range(1, N):
                if (stops is not None or group is not None) and s % check_every == 0 and stopped(dec.done, group):
                    break
                if dec.noise is not None:
                    dec.noise.exponential_(generator=generator)
                dec.advance(min(S, round_up(T + s, bucket)) if bucket else S)  # step s fills slot T+s-1
    finally:
        model.train(was_training)
        for m, c in zip(moes, capacity):
            m.capacity_factor = c
        for m in mlps:
            m.split = True
    width = int(dec.lengths.max())
    prompt_mask = mask.repeat_interleave(n, dim=0)
    gen_mask = torch.arange(width, device=dev)[None, :] < dec.lengths[:, None]
    return Rollout(torch.cat([idx.repeat_interleave(n, dim=0), dec.out_tok[:, :width]], 1),
                   torch.cat([prompt_mask, gen_mask], 1), dec.out_lp[:, :width].clone(), dec.lengths.clone(), T)


@torch.no_grad()
def rollout(model, prompts, G, rank, world, max_new_tokens, *, vocab, **sampling):
    """Sample this data rank's share of the len(prompts) x G completions (prompt-major: prompt i's are
    i*G .. i*G+G-1; each rank a contiguous 1/world of them, so a group may span ranks) with decode
    (vocab, sampling: its keywords) -> (Rollout, the prompt of each row). A prompt whose samples here are as many
    as every other's is prefilled once for them (decode's n); otherwise each row is prefilled alone."""
    per = len(prompts) * G // world
    which = [c // G for c in range(rank * per, (rank + 1) * per)]
    counts = {i: which.count(i) for i in which}
    if len(set(counts.values())) == 1:
        r = decode(model, [prompts[i] for i in counts], max_new_tokens, vocab=vocab, n=which.count(which[0]), **sampling)
    else:
        r = decode(model, [prompts[i] for i in which], max_new_tokens, vocab=vocab, n=1, **sampling)
    return r, which


def cast_copy(model, dtype):
    """A copy of a plain model.Transformer (not tensor-parallel, no LoRA, no MoE) for decode() to
    read: its nn.Linear weights (the head too, untied from the embedding) in dtype, the rest as
    model's. Under autocast to dtype it computes exactly what model does (autocast casts those
    weights, and only those), without a cast of every weight in every step (a captured step has
    one). refresh(copy, model) copies new weights in, in place: the addresses stay, so decode(keep=)
    replays its graphs (GRPO: the rollouts between optimizer steps)."""
    with torch.random.fork_rng(devices=[]):  # its random init is overwritten: the global RNG stays as it was
        copy = type(model)(model.cfg)
    for m in copy.modules():
        if isinstance(m, torch.nn.Linear):
            m.weight = torch.nn.Parameter(m.weight.detach().to(dtype))
    return refresh(copy.to(next(model.parameters()).device).requires_grad_(False), model)


@torch.no_grad()
def refresh(copy, model):
    """copy's parameters = model's (cast to copy's dtypes), in place -> copy; nothing when copy is model."""
    for mine, theirs in zip(copy.modules(), model.modules()) if copy is not model else ():
        for a, b in zip(mine.parameters(recurse=False), theirs.parameters(recurse=False)):
            a.copy_(b)
    return copy
