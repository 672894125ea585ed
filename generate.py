"""Generation: the KV caches, sampling filters, the eager generate() and the fast decoder decode().

    out = generate.generate(model, idx, 100, temperature=0.8, top_k=50, stop_tokens=[eos])   # eager
    r = generate.decode(model, prompts, 256, n=8, temperature=1.0, top_p=0.95, stop_tokens=[eos], seed=0)
    r.tokens, r.mask, r.logprobs, r.lengths   # (B*n, T+N) ids, real-token mask, (B*n, N) log-probs, (B*n,)

generate(): the readable reference and CPU fallback. A prefill of every prompt at once, then one
token per step through Transformer.hidden_states with a KVCache whose Python-int length grows;
shapes change every step, so nothing can be captured.

decode(): the fast path (issue 16). A StaticCache preallocated to longest prompt + new tokens,
per-layer buffers written in place at a device-tensor slot; the prefill runs once on the B prompts
and its cache rows are copied to each prompt's n sample rows; then a one-token decode step whose
shapes never change: token, per-row position, cache slot and key mask are device tensors the step
reads and advances itself, so on CUDA it is captured once as a CUDA graph (by hand,
torch.cuda.graph; compile=True first fuses it with torch.compile) and replayed, one launch per
token. The step samples inside the graph (temperature, top-k, top-p, stop mask); the random
numbers come from one exponential_ fill per step outside it (a captured graph cannot take a
torch.Generator), and "is every row done?" is read every check_every steps, not per step (a
host sync). On CPU the same step runs eagerly. Sampling is the exponential race (argmax of
log p - log E, E ~ Exp(1) per token: token i wins with probability p_i), so its seeded draws differ
from generate()'s torch.multinomial; greedy is identical.

Log-probs (GRPO's old policy): log_softmax(logits / t)[token] in fp32, t = temperature (t = 1 when
greedy), before top-k / top-p: the distribution a teacher-forced forward over the same tokens
gives with its logits divided by the same t. 0 after a row's stop token.

Layouts: tensor parallelism works as the eager path does (each rank its heads; the vocab-parallel
head gathers the logits, so every rank samples the same token from the same seed); under FSDP
call it inside parallel.Parallel.full_params() (parameters gathered once for the whole rollout);
LoRA adapters run on the fly (lora.merge() first is the faster choice, same tokens); MoE layers
run dropless during decoding (capacity_factor set to 0, restored after); their per-layer host sync
makes the step uncapturable, so MoE models decode eagerly.

Not done yet (issue 16's prototype did them): attending over KV-length buckets rather than the
whole preallocated cache every step (masked slots are read too), fused gate/up matmuls.

Why a file of its own: model.py holds the training model and is near its line budget; the forward
takes any cache with `length` and `update(layer, k, v)`.
"""
from dataclasses import dataclass

import torch
import torch.nn.functional as F

import moe
from model import position_ids


class KVCache:
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
def generate(model, idx, max_new_tokens, *, temperature=1.0, top_k=None, top_p=None,
             stop_tokens=None, pad_id=None, attention_mask=None, generator=None, seed=None):
    """Sample continuations of a batch of prompts from model (a model.Transformer, plain or
    tensor-parallel: every TP rank calls it with the same seed) with a KV cache.

    idx: (B, T) prompts, left-padded; attention_mask (B, T) 0/1 marks real tokens (None = all).
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

    was_training = model.training
    model.eval()
    try:
        cache = KVCache(T + max_new_tokens)
        x = model.hidden_states(idx, cache=cache, attn_mask=mask)  # prefill: all prompts at once
        out = [idx]
        for step in range(max_new_tokens):
            logits = model.logits(x[:, -1])  # head on the last position only
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

class StaticCache:
    """Keys and values of every layer, (R, KV, max_len, D), allocated once, written in place.

    Each layer has tensors of its own (views of one big buffer made a compiled step 5x slower,
    issue 16). update() writes the new keys at the slots in `index` (a device tensor: 0..T-1 for
    the prefill, then the one slot a decode step advances itself) with index_copy_ and returns the
    whole buffers; the caller's attention mask says which slots hold real keys. `length` reads 0
    and ignores writes: positions and masks always come from the caller, so no Python number
    changes between steps (Transformer.hidden_states would otherwise offset by it).
    """

    def __init__(self, max_len, index):
        self.max_len, self.index = max_len, index
        self.k, self.v = [], []

    length = property(lambda self: 0, lambda self, value: None)

    def update(self, layer, k, v):
        if layer == len(self.k):  # first write (the prefill): dtype, device, heads follow autocast and TP
            B, KV, _, D = k.shape
            self.k.append(k.new_zeros(B, KV, self.max_len, D))
            self.v.append(v.new_zeros(B, KV, self.max_len, D))
        self.k[layer].index_copy_(2, self.index, k)
        self.v[layer].index_copy_(2, self.index, v)
        return self.k[layer], self.v[layer]

    def repeat_rows(self, n):
        """Row b becomes rows b*n .. b*n+n-1 (n samples of one prompt share its prefill)."""
        if n > 1:
            self.k = [t.repeat_interleave(n, dim=0) for t in self.k]
            self.v = [t.repeat_interleave(n, dim=0) for t in self.v]


def pick(logits, temperature=1.0, top_k=None, top_p=None, noise=None):
    """(R, V) logits -> (tokens (R,), log-probs (R,) of those tokens under log_softmax(logits / t)),
    t = temperature (1 when greedy), taken before the filters. Sampling: argmax over the filtered
    logits / t minus log(noise), noise ~ Exp(1) i.i.d. (R, V): token i wins with probability
    softmax_i (the exponential race, Gumbel-max's twin). noise None or temperature 0: greedy.
    Fixed shapes, no host sync: it runs inside the captured step."""
    z = logits.float() / (temperature or 1.0)
    logp = z.log_softmax(dim=-1)
    if temperature == 0 or noise is None:
        tok = logits.argmax(dim=-1)
    else:
        if top_k:
            z = top_k_filter(z, top_k)
        if top_p is not None and top_p < 1.0:
            z = top_p_filter(z, top_p)
        tok = (z - noise.log()).argmax(dim=-1)
    return tok, logp.gather(-1, tok[:, None]).squeeze(-1)


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


def cuda_graph(fn, state, warmup=3):
    """Capture fn() (it reads and writes only tensors it closes over) as one CUDA graph; return
    its replay. The warm-up runs torch.cuda.graph needs (on a side stream; compilation happens
    here) advance the state: `state` tensors are restored after them."""
    saved = [t.clone() for t in state]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()  # recorded, not run
    for t, s in zip(state, saved):
        t.copy_(s)
    return graph.replay


@dataclass
class Rollout:
    """What decode() returns; row r is sample r % n of prompt r // n."""
    tokens: torch.Tensor    # (R, T + N) left-padded prompt, then generated ids (pad_id after a stop)
    mask: torch.Tensor      # (R, T + N) bool: real tokens (prompt, generated up to and with the stop)
    logprobs: torch.Tensor  # (R, N) fp32 log-prob of each generated token (module docstring); 0 after
    lengths: torch.Tensor   # (R,) generated tokens per row, the stop token included
    prompt_len: int         # T: generated tokens start at column T


@torch.no_grad()
def decode(model, prompts, max_new_tokens, *, n=1, temperature=1.0, top_k=None, top_p=None,
           stop_tokens=None, pad_id=0, attention_mask=None, seed=None, generator=None,
           check_every=16, graph=None, compile=False):
    """Sample max_new_tokens (fewer when every row stopped) for each prompt, n times each.

    prompts: a list of 1-D token sequences (any lengths; left-padded here), or (B, T) ids with
      attention_mask (B, T) 0/1 (None: all real). Positions count from each row's first real token.
    n: samples per prompt; the prompt is prefilled once and its cache copied to its n rows.
    temperature 0: greedy; top_k / top_p filter before sampling (not the log-probs). seed or
      generator (on the model's device) fix the draws; neither: torch's global RNG.
    stop_tokens: a row stops after emitting one (it then yields pad_id); the whole batch ends once
      every row stopped, read every check_every steps (one host sync each).
    graph: capture the decode step as a CUDA graph (default: on CUDA, not for MoE, not under TP);
      compile: torch.compile the step first (CUDA: fused kernels inside the graph); True, or a dict
      of torch.compile's keyword arguments (tests trace it with fullgraph=True: no graph break).
    Returns a Rollout. Runs in eval mode and restores the mode.
    """
    dev = next(model.parameters()).device
    if isinstance(prompts, torch.Tensor):
        idx = prompts.to(dev)
        mask = (torch.ones_like(idx, dtype=torch.bool) if attention_mask is None else attention_mask.to(dev).bool())
    else:
        idx, mask = pad_prompts(prompts, pad_id, dev)
    B, T = idx.shape
    N, R = max_new_tokens, B * n
    moes = list(moe.layers(model))
    tensor_parallel = not isinstance(model.head, torch.nn.Linear)
    if graph is None:
        graph = dev.type == "cuda" and not moes and not tensor_parallel
    for bad, msg in [
        (T + N > model.cfg.block_size, f"prompt length {T} + max_new_tokens {N} exceeds block_size="
         f"{model.cfg.block_size}: shorten the prompts or generate fewer tokens"),
        (N < 1 or n < 1 or check_every < 1, f"max_new_tokens={N}, n={n}, check_every={check_every} must be >= 1"),
        (temperature < 0, f"temperature={temperature} must be >= 0 (0 = greedy)"),
        (not bool(mask.any(1).all()), "decode: every prompt needs at least one real token (attention_mask row of zeros)"),
        (graph and dev.type != "cuda", "graph=True needs the model on a CUDA device: pass graph=False"),
        (graph and bool(moes), "graph=True: MoE layers sync with the host per layer (dropless block sizes), "
         "so their step cannot be captured: pass graph=False")]:
        if bad:
            raise ValueError(msg)
    if generator is None and seed is not None:
        generator = torch.Generator(dev).manual_seed(seed)
    stops = None if stop_tokens is None else torch.as_tensor(stop_tokens, device=dev).flatten()
    stops = stops if stops is not None and stops.numel() else None

    was_training, capacity = model.training, [m.capacity_factor for m in moes]
    model.eval()
    for m in moes:
        m.capacity_factor = 0.0  # dropless at inference: no token's expert output is dropped
    try:
        # prefill, B prompts: query i sees real keys j <= i (and itself, so padding rows are no NaN)
        S = T + N
        keys = F.pad(mask, (0, N))  # (B, S): which cache slots hold real tokens
        q, k = torch.arange(T, device=dev)[:, None], torch.arange(S, device=dev)[None, :]
        index = torch.arange(T, device=dev)
        cache = StaticCache(S, index)
        h = model.hidden_states(idx, cache=cache, pos=position_ids(mask),
                                attn_mask=((k <= q) & keys[:, None, :]) | (k == q))
        logits = model.logits(h[:, -1]).repeat_interleave(n, dim=0)
        cache.repeat_rows(n)

        # the decode state: every tensor the step reads or writes, at fixed addresses
        cache.index = index = torch.tensor([T], device=dev)  # the slot the next token's keys go to
        kmask = keys.repeat_interleave(n, dim=0)
        pos = mask.sum(1).repeat_interleave(n)  # the next token's position in its row
        tok = torch.zeros(R, dtype=torch.long, device=dev)
        done = torch.zeros(R, dtype=torch.bool, device=dev)
        lengths = torch.zeros(R, dtype=torch.long, device=dev)
        out_tok = torch.full((R, N), pad_id, dtype=torch.long, device=dev)
        out_lp = torch.zeros(R, N, dtype=torch.float32, device=dev)
        sampling = temperature > 0
        noise = torch.empty(R, logits.shape[-1], device=dev) if sampling else None

        def emit(logits, col):
            nxt, lp = pick(logits, temperature, top_k, top_p, noise)
            nxt, lp = nxt.masked_fill(done, pad_id), lp.masked_fill(done, 0.0)
            lengths.add_((~done).long())
            if stops is not None:
                done.logical_or_((nxt[:, None] == stops).any(-1))
            out_tok.index_copy_(1, col, nxt[:, None])
            out_lp.index_copy_(1, col, lp[:, None])
            tok.copy_(nxt)

        def step():  # one token per row; fixed shapes, no host sync: capturable
            kmask.index_fill_(1, index, True)
            h = model.hidden_states(tok[:, None], cache=cache, pos=pos[:, None], attn_mask=kmask[:, None, :])
            emit(model.logits(h[:, 0]), index - (T - 1))
            pos.add_(1)
            index.add_(1)

        if sampling:
            noise.exponential_(generator=generator)
        emit(logits, torch.zeros(1, dtype=torch.long, device=dev))
        run = torch.compile(step, **({} if compile is True else compile)) if compile else step
        if graph and N > 1:
            run = cuda_graph(run, [index, kmask, pos, tok, done, lengths, out_tok, out_lp])
        for s in range(1, N):
            if stops is not None and s % check_every == 0 and bool(done.all()):
                break
            if sampling:
                noise.exponential_(generator=generator)
            run()
    finally:
        model.train(was_training)
        for m, c in zip(moes, capacity):
            m.capacity_factor = c
    width = int(lengths.max())
    prompt_mask = mask.repeat_interleave(n, dim=0)
    gen_mask = torch.arange(width, device=dev)[None, :] < lengths[:, None]
    return Rollout(torch.cat([idx.repeat_interleave(n, dim=0), out_tok[:, :width]], 1),
                   torch.cat([prompt_mask, gen_mask], 1), out_lp[:, :width], lengths, T)
