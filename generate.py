"""Generation: the KV cache, sampling filters, and generate() for a model.Transformer.

    out = generate.generate(model, idx, 100, temperature=0.8, top_k=50, stop_tokens=[eos])

The eager path: a prefill of every prompt at once, then one token per step through
Transformer.hidden_states with a KVCache (preallocated per layer, dtype/device/head count taken
from the first keys written, so it follows autocast and tensor parallelism). A fast decoder with a
static cache (compiled, CUDA graphs) will live here too (issue 16): RL rollouts need it. It is kept
apart from model.py, which holds the training model only (it was at 687 of its 700 lines) and
must leave room for LoRA hooks; the forward takes any cache with `length` and `update()`.
"""
import torch
import torch.nn.functional as F


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
