"""Block-wise quantisation: 8-bit dynamic codes (optimizer state) and 4-bit NF4 (a frozen base).

    q, absmax = quant.quantize(x, quant.dynamic_map(signed=True), block=256)   # uint8 codes, fp32 per block
    x2 = quant.dequantize(q, absmax, code, block)                              # code[q] * absmax, fp32
    packed, absmax = quant.nf4_quantize(w, block=64)                           # two 4-bit codes per byte
    w2 = quant.nf4_dequantize(packed, absmax, w.numel(), block).view(w.shape)

A tensor is cut into blocks of `block` consecutive elements (flattened; the last block may be
short). Each block is divided by its absolute maximum, so its values lie in [-1, 1], and each value
is stored as the index of the nearest entry of a sorted code book (torch.bucketize on the midpoints
between neighbouring entries): x ~ code[q] * absmax. Both code books and the rounding are those of
bitsandbytes (Dettmers et al.), so our codes equal theirs bit for bit (tests/test_quant.py):
- dynamic_map(signed): the 8-bit "dynamic tree" type (8-Bit Approximations for Parallelism in Deep
  Learning): a decimal exponent from 1e-6 to 1 and a linear fraction whose bits shrink as the
  exponent grows; signed (first Adam moment) or unsigned (second moment, never negative).
- NF4 (QLoRA, Dettmers et al. 2023): the 16 quantiles of a standard normal, rescaled to [-1, 1]
  with an exact zero; two codes per byte, the first element in the high nibble.
- double quantisation (QLoRA's): the fp32 absmax of each NF4 block, less their mean, quantised
  again to 8 bits in blocks of 256 (0.127 bits per weight for the statistics instead of 0.5).
Dequantise then quantise gives the same codes back; requantize() also gives the absmax back (to
rounding), also where the signed book, which has +1 but not -1, put a block's largest magnitude on
its most negative entry. All-zero blocks give zeros.
"""
import torch

# QLoRA's NF4 code book (Appendix E; bitsandbytes' table): quantiles of N(0, 1) scaled to [-1, 1]
NF4 = (-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
       -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
       0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
       0.7229568362236023, 1.0)


def dynamic_map(signed=True, max_exponent_bits=7, total_bits=8):
    """The 256 sorted values of the 8-bit dynamic type in [-1, 1] (signed) or [0, 1] (unsigned),
    computed exactly as bitsandbytes.functional.create_dynamic_map."""
    data = []
    non_sign_bits = total_bits - 1
    extra = 2 ** (non_sign_bits - max_exponent_bits) - 1
    for i in range(max_exponent_bits):
        n = int(2 ** (i + non_sign_bits - max_exponent_bits) + 1 if signed
                else 2 ** (i + non_sign_bits - max_exponent_bits + 1) + 1)
        bounds = torch.linspace(0.1, 1, n, dtype=torch.float32)
        means = (bounds[:-1] + bounds[1:]) / 2.0
        data += ((10 ** (-(max_exponent_bits - 1) + i)) * means).tolist()
        if signed:
            data += (-(10 ** (-(max_exponent_bits - 1) + i)) * means).tolist()
    if extra > 0:
        bounds = torch.linspace(0.1, 1, extra + 1, dtype=torch.float32)
        means = (bounds[:-1] + bounds[1:]) / 2.0
        data += ((10 ** (-(max_exponent_bits - 1) + i)) * means).tolist()
        if signed:
            data += (-(10 ** (-(max_exponent_bits - 1) + i)) * means).tolist()
    data += [0.0, 1.0]
    data += [0.0] * (256 - len(data))
    return torch.tensor(sorted(data), dtype=torch.float32)


def nf4_map(device=None):
    return torch.tensor(NF4, dtype=torch.float32, device=device)


def _blocks(x, block):
    """Flat fp32 x -> (blocks, block) zero-padded view, and the element count."""
    x = x.reshape(-1).float()
    n = x.numel()
    pad = -n % block
    return (torch.nn.functional.pad(x, (0, pad)) if pad else x).view(-1, block), n


def bins(code, bits=16):
    """A lookup table that finds the nearest code of an fp32 value without a binary search: the
    value's top `bits` bits (sign, exponent, leading mantissa) name a bin; table[bin] counts the
    midpoints below the bin, and at most one midpoint lies inside it (checked), so the code is
    table[bin] + (mids[table[bin]] < x): bucketize's answer, bit for bit. None when some bin holds two."""
    mids = (code[:-1] + code[1:]) / 2
    shift = 32 - bits
    lo = torch.arange(2 ** bits, dtype=torch.int64) << shift
    hi = lo + (1 << shift) - 1
    f = [torch.where(v >= 2 ** 31, v - 2 ** 32, v).to(torch.int32).view(torch.float32) for v in (lo, hi)]
    neg = lo >= 2 ** 31  # negative floats: the larger the bits, the more negative
    low, high = torch.where(neg, f[1], f[0]), torch.where(neg, f[0], f[1])
    table = torch.bucketize(low, mids)
    finite = low.isfinite() & high.isfinite()
    if (torch.bucketize(high, mids, right=True) - table)[finite].max() > 1:
        return None
    return table.to(torch.int32), torch.cat((mids, mids.new_tensor([float("inf")]))), shift


def nearest(scaled, code, table=None):
    """Index of the nearest entry of the sorted book `code` for each fp32 value in [-1, 1] (uint8):
    torch.bucketize on the midpoints, or the same answer from a bins() table (no search)."""
    if table is None:
        return torch.bucketize(scaled, (code[:-1] + code[1:]) / 2, out_int32=True).to(torch.uint8)
    counts, mids, shift = table
    base = counts.index_select(0, (scaled.view(torch.int32) >> shift) & ((1 << (32 - shift)) - 1))
    return (mids.index_select(0, base) < scaled).to(torch.uint8).add_(base.to(torch.uint8))


def quantize(x, code, block=256, table=None):
    """x (any shape) -> (uint8 codes shaped like x, fp32 absmax per block): code[q] * absmax ~ x.
    table: bins(code) on x's device, for speed (the same codes)."""
    xb, n = _blocks(x, block)
    absmax = xb.abs().amax(dim=1)
    scaled = (xb * (1.0 / absmax.clamp(min=1e-38))[:, None]).clamp_(-1, 1).view(-1)[:n]
    q = nearest(scaled.contiguous(), code.to(x.device), table)
    return q.view(x.shape), absmax


def requantize(x, code, block=256):
    """quantize() for values that came out of dequantize() with this book: the codes and (to
    rounding) the absmax come back. A block's largest magnitude sits on the book's largest entry
    or, in the signed book, which has +1 but not -1, on its most negative one (-0.9930): both
    scalings are tried per block and the one that reproduces the values better is kept."""
    code = code.to(x.device)
    xb, n = _blocks(x, block)
    top = xb.abs().amax(dim=1)
    best = None
    for c in {code.max().item(), -code.min().item()} - {0.0}:
        absmax = top / c
        scaled = (xb * (1.0 / absmax.clamp(min=1e-38))[:, None]).clamp_(-1, 1)
        q = torch.bucketize(scaled, (code[:-1] + code[1:]) / 2, out_int32=True)
        err = (code[q.long()] * absmax[:, None] - xb).abs().amax(dim=1)
        if best is None:
            best = (q, absmax, err)
        else:
            keep = err < best[2]
            best = (torch.where(keep[:, None], q, best[0]), torch.where(keep, absmax, best[1]), torch.minimum(err, best[2]))
    return best[0].view(-1)[:n].to(torch.uint8).view(x.shape), best[1]


def dequantize(q, absmax, code, block=256, out=None):
    """Codes (any shape) and absmax per block -> fp32 values shaped like q (or written into out)."""
    n = q.numel()
    v = code.to(q.device).index_select(0, q.reshape(-1).int())
    pad = -n % block
    v = (torch.nn.functional.pad(v, (0, pad)) if pad else v).view(-1, block).mul_(absmax[:, None]).view(-1)[:n]
    if out is None:
        return v.view(q.shape)
    return out.copy_(v.view(out.shape))


def nf4_quantize(w, block=64):
    """w -> (packed uint8 codes (ceil(numel / 2),), fp32 absmax per block), bitsandbytes' layout."""
    q, absmax = quantize(w.reshape(-1), nf4_map(w.device), block)
    if q.numel() % 2:
        q = torch.nn.functional.pad(q, (0, 1))
    return (q[0::2] << 4) | q[1::2], absmax


def nf4_dequantize(packed, absmax, numel, block=64, dtype=torch.float32):
    """packed codes and absmax -> the flat (numel,) weights in dtype (fp32 arithmetic, then cast).
    Looked up a byte at a time (both codes of a byte at once, int32 indices): 6 bytes of transients
    per weight, not the 12 of an int64 index per code."""
    code = nf4_map(packed.device)
    pairs = torch.stack((code.repeat_interleave(16), code.repeat(16)), dim=1)  # byte b -> (code[b >> 4], code[b & 15])
    v = torch.index_select(pairs, 0, packed.reshape(-1).int()).view(-1)[:numel]
    pad = -numel % block
    v = (torch.nn.functional.pad(v, (0, pad)) if pad else v).view(-1, block).mul_(absmax[:, None]).view(-1)[:numel]
    return v.to(dtype)


def double_quantize(absmax, block=256):
    """QLoRA's double quantisation of NF4 block statistics: (uint8 codes, fp32 absmax of theirs,
    the mean subtracted first)."""
    offset = absmax.mean()
    q, a2 = quantize(absmax - offset, dynamic_map(signed=True), block)
    return q, a2, offset


def double_dequantize(q, a2, offset, block=256):
    return dequantize(q, a2, dynamic_map(signed=True), block) + offset
