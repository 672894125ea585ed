"""RoPE: the rotary tables, and their scaling families as transformers names them.

    cos, sin = rope.rope_tables(head_dim, block_size, theta, scaling=cfg.rope_scaling)   # (T, D/2), fp32
    q = rope.apply_rope(q, cos, sin)
    scaling = rope.resolve("yarn", block_size, positions, old)   # --rope_scaling=yarn -> the full dict

ModelConfig.rope_scaling is {} (none) or transformers' dict, {"rope_type": t, "factor": f, ...} with t one of
TYPES: linear (positions / factor), dynamic (NTK: theta grown with the length), yarn (NTK-by-parts, and cos/sin
times an attention factor), llama3 (Llama-3.1: low frequencies / factor, the middle band blended). Each table
is transformers' ROPE_INIT_FUNCTIONS' to the bit (inverse frequencies, yarn's attention factor), so imported
and exported models give HF's logits. original_max_position_embeddings (the positions the model was trained
at) defaults to the table's length, as HF's does to max_position_embeddings.
dynamic: the table is built once, for block_size: HF's at an input of block_size tokens (HF rescales per input).
A type's bare name (--rope_scaling=yarn) is completed by resolve() against init_from's positions
(weights.configure): factor = block_size / the model's original positions.
to_hf / from_hf: the HF config's fields (hf.py).
"""
import math

import torch

TYPES = ("linear", "dynamic", "yarn", "llama3")
# each type's keys beside rope_type and original_max_position_embeddings (the first ones required)
KEYS = {"linear": ("factor",), "dynamic": ("factor",),
        "yarn": ("factor", "attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate"),
        "llama3": ("factor", "low_freq_factor", "high_freq_factor")}
REQUIRED = {"llama3": 3}  # the others need only factor
DEFAULTS = {"llama3": dict(low_freq_factor=1.0, high_freq_factor=4.0)}  # Llama-3.1's (transformers has none)


def check_scaling(scaling):
    """ValueError unless scaling is {} (none), one of TYPES by name (resolve() completes it) or a dict
    of a type with its keys (no others)."""
    if isinstance(scaling, str):
        if scaling not in TYPES:
            raise ValueError(f"rope_scaling={scaling!r}: choose one of {', '.join(TYPES)} (or HF's dict)")
        return
    if not scaling:
        return
    kind = scaling.get("rope_type")
    if kind not in TYPES:
        raise ValueError(f"rope_scaling={scaling!r}: rope_type must be one of {', '.join(TYPES)}")
    keys = KEYS[kind]
    missing = [k for k in keys[:REQUIRED.get(kind, 1)] if scaling.get(k) is None]
    unknown = set(scaling) - {"rope_type", "original_max_position_embeddings", *keys}
    if missing or unknown:
        raise ValueError(f"rope_scaling={scaling!r}: {kind} needs {', '.join(keys[:REQUIRED.get(kind, 1)])}, "
                         f"takes {', '.join(['original_max_position_embeddings', *keys])}")
    if not scaling["factor"] > 0:
        raise ValueError(f"rope_scaling={scaling!r}: factor must be > 0")


def inv_freq(head_dim, theta, scaling, length, device=None):
    """(inverse frequencies (head_dim/2,), attention factor) of transformers' ROPE_INIT_FUNCTIONS for
    scaling (none: its default), for a table of `length` positions (dynamic's seq_len, the default original)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(device=device, dtype=torch.float) / head_dim
    base = 1.0 / (theta ** exponents)
    if not scaling:
        return base, 1.0
    if isinstance(scaling, str):
        raise ValueError(f"rope_scaling={scaling!r} names a type only: its factor comes from init_from's positions "
                         f"(set init_from, or give the whole dict)")
    kind, factor = scaling["rope_type"], scaling["factor"]
    old = scaling.get("original_max_position_embeddings") or length
    if kind == "linear":
        return base / factor, 1.0
    if kind == "dynamic":  # (as HF: Python numbers up to the original positions, beyond them a tensor's)
        seq = torch.maximum(torch.tensor(length), torch.tensor(old)) if length > old else old
        grown = theta * ((factor * seq / old) - (factor - 1)) ** (head_dim / (head_dim - 2))
        return 1.0 / (grown ** exponents), 1.0
    if kind == "llama3":
        lo, hi = scaling["low_freq_factor"], scaling["high_freq_factor"]
        wavelen = 2 * math.pi / base
        scaled = torch.where(wavelen > old / lo, base / factor, base)
        smooth = (old / wavelen - lo) / (hi - lo)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        middle = ~(wavelen < old / hi) * ~(wavelen > old / lo)
        return torch.where(middle, blended, scaled), 1.0
    return yarn(head_dim, theta, scaling, old, device)


def mscale(scale, m=1.0):
    """YaRN's attention temperature, 0.1 m ln(scale) + 1 (1 for scale <= 1)."""
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0


def yarn(dim, theta, s, old, device=None):
    """YaRN (transformers' _compute_yarn_parameters): frequencies interpolated by factor below the
    correction range, kept above it, a linear ramp between; and the attention factor."""
    factor, ms, ms_all = s["factor"], s.get("mscale"), s.get("mscale_all_dim")
    attention = s.get("attention_factor")
    if attention is None:
        attention = float(mscale(factor, ms) / mscale(factor, ms_all)) if ms and ms_all else mscale(factor)
    fast, slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1

    def correction(rotations):  # the dimension at which a wavelength turns `rotations` times in `old` positions
        return (dim * math.log(old / (rotations * 2 * math.pi))) / (2 * math.log(theta))
    low, high = correction(fast), correction(slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    high = high + 0.001 if low == high else high
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2).to(device=device, dtype=torch.float) / dim)
    keep = 1 - ramp.to(device=device, dtype=torch.float)
    return (1.0 / (factor * pos_freqs)) * (1 - keep) + (1.0 / pos_freqs) * keep, attention


def rope_tables(head_dim, length, theta, device=None, scaling=None):
    """cos/sin of position * frequency, (length, head_dim/2), fp32, times yarn's attention factor:
    HF's LlamaRotaryEmbedding's numbers (fp32 inverse frequencies times fp32 positions)."""
    freq, attention = inv_freq(head_dim, theta, scaling, length, device)
    angles = torch.outer(torch.arange(length, device=device).float(), freq)
    return angles.cos() * attention, angles.sin() * attention


def apply_rope(x, cos, sin):
    """Rotate pairs (x[i], x[i + D/2]) by position-dependent angles ("rotate half", as HF LLaMA).

    x: (B, T, heads, D); cos/sin: (B or 1, T, 1, D/2) in fp32. Real arithmetic rather than
    complex numbers so torch.compile fuses it into one elementwise kernel; done in fp32 and
    cast back because bf16 angles are off by ~1e-2 at long positions.
    """
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).type_as(x)


def resolve(value, length, positions, old=None):
    """The run's rope_scaling from a user's value, for a model trained at `positions` with scaling `old`:
    a type's name -> the full dict, factor = length / the model's original positions (old's
    original_max_position_embeddings, else positions), old's other keys when it is of that type, else
    transformers' defaults (DEFAULTS); a dict -> itself, its original positions the model's unless given.
    ValueError: an unknown type or key, or a name whose factor would not exceed 1."""
    check_scaling(value)
    old = old or {}
    if not isinstance(value, str):
        return {"original_max_position_embeddings": positions, **value} if value else {}
    original = old.get("original_max_position_embeddings")
    if not original:  # (an HF linear model keeps none: trained at its factor times them)
        original = positions / old["factor"] if old.get("rope_type") == "linear" else positions
        original = int(original) if original == int(original) else original
    if length <= original:
        raise ValueError(f"rope_scaling={value!r} scales the model's {original} positions up to block_size: "
                         f"block_size={length} does not exceed them (raise block_size, or drop rope_scaling)")
    rest = {k: v for k, v in old.items() if k in KEYS[value]} if old.get("rope_type") == value else DEFAULTS.get(
        value, {})
    return {"rope_type": value, **rest, "factor": length / original, "original_max_position_embeddings": original}


def to_hf(scaling, block_size):
    """(rope_scaling for an HF config.json or None, its max_position_embeddings): block_size, but dynamic's
    original positions (HF's dynamic scales past max_position_embeddings); only the keys HF's type reads."""
    if not scaling:
        return None, block_size
    kind, old = scaling["rope_type"], scaling.get("original_max_position_embeddings") or block_size
    out = {"rope_type": kind, **{k: scaling[k] for k in KEYS[kind] if scaling.get(k) is not None}}
    if kind in ("yarn", "llama3"):
        out["original_max_position_embeddings"] = old
    return out, old if kind == "dynamic" else block_size


def from_hf(params, max_positions):
    """An HF config's rope parameters (v5's rope_parameters or v4's rope_scaling) -> ModelConfig.rope_scaling,
    as transformers reads them: original positions max_position_embeddings unless given (dynamic: always;
    linear reads none)."""
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return {}
    if kind not in TYPES:
        raise ValueError(f"rope scaling type {kind!r} is not supported (default, {', '.join(TYPES)})")
    out = {"rope_type": kind, **{k: params[k] for k in KEYS[kind] if params.get(k) is not None}}
    if kind != "linear":
        out["original_max_position_embeddings"] = max_positions if kind == "dynamic" else params.get(
            "original_max_position_embeddings") or max_positions
    if kind == "yarn" and "factor" not in out:  # (DeepSeek-V3: the ratio of the two lengths)
        out["factor"] = max_positions / out["original_max_position_embeddings"]
    check_scaling(out)
    return out
