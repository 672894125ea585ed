"""quant.py's block-wise codes against hand-worked blocks, a brute-force nearest-code search, and
bitsandbytes (when installed; its CPU ops are the reference: skipped without it).

Proves:
- the dynamic maps: 256 sorted entries in [-1, 1] / [0, 1], with 0 and 1, and the hand-computed
  extremes of the decimal-exponent construction; NF4's 16 entries are QLoRA's table;
- quantize picks the nearest code of every scaled value (brute-force argmin over the book) for
  random blocks of every size class (a short last block included); all-zero blocks stay zero;
- the bin table (bins) finds bucketize's code bit for bit, midpoints and their neighbours included;
- a hand-worked NF4 block: codes, packed bytes (first element in the high nibble), dequantised values;
- dequantise then quantise gives the same codes (unsigned and NF4: every block; signed: blocks
  whose largest magnitude is positive); requantize gives codes and absmax back for every block
  (absmax to 1e-6), which is what loads a dequantised optimizer-state checkpoint;
- double quantisation of NF4 statistics reconstructs each absmax within one 8-bit code step;
- bitsandbytes: create_dynamic_map equals ours; quantize_blockwise gives the same absmax and, but
  for values near a midpoint (< 0.5%, where its CPU kernel's approximate search takes the farther
  neighbour and ours the nearer), the same codes, and dequantises as ours; quantize_4bit (NF4, with
  and without double quantisation) gives the same packed codes, absmax and dequantised weights.
"""
import pytest
import torch

from memory import quant


def test_maps():
    s, u, nf4 = quant.dynamic_map(True), quant.dynamic_map(False), quant.nf4_map()
    assert s.shape == u.shape == (256,) and nf4.shape == (16,)
    assert torch.equal(s, s.sort().values) and torch.equal(u, u.sort().values)
    assert s.max() == 1.0 and 0.0 in s.tolist() and u.min() == 0.0 and u.max() == 1.0
    # the signed book's most negative entry: 10^0 * the last mean of linspace(0.1, 1, 65), no -1
    assert abs(s.min().item() + (1 + (1 - 0.9 / 64)) / 2) < 1e-6
    # its smallest positive entry: 10^-6 * mean(0.1, 1) = 5.5e-7; the unsigned book's: 10^-6 * 0.325
    assert abs(s[s > 0].min().item() - 5.5e-7) < 1e-12 and abs(u[u > 0].min().item() - 3.25e-7) < 1e-12
    assert nf4[0] == -1 and nf4[7] == 0 and nf4[15] == 1 and len(set(nf4.tolist())) == 16


@pytest.mark.parametrize("code_name", ["signed", "unsigned", "nf4"])
def test_nearest_code(code_name):
    code = {"signed": quant.dynamic_map(True), "unsigned": quant.dynamic_map(False), "nf4": quant.nf4_map()}[code_name]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1000, generator=g) * torch.logspace(-5, 1, 1000)  # small and large magnitudes
    x = x.abs() if code_name == "unsigned" else x
    block = 64
    q, absmax = quant.quantize(x, code, block)
    assert q.dtype == torch.uint8 and absmax.shape == (16,)  # 1000 = 15 full blocks + 40
    xb = torch.nn.functional.pad(x, (0, 24)).view(-1, block)
    assert torch.equal(absmax, xb.abs().amax(1))
    scaled = (xb * (1 / absmax)[:, None]).clamp(-1, 1).view(-1)[:1000]
    dist = (scaled[:, None] - code[None, :]).abs()
    best = dist.min(1).values
    assert torch.equal(dist[torch.arange(1000), q.long()], best)  # q is a nearest code (ties: either)
    back = quant.dequantize(q, absmax, code, block)
    assert torch.equal(back, code[q.long()] * absmax.repeat_interleave(block)[:1000])
    zq, za = quant.quantize(torch.zeros(10), code, 4)
    assert (quant.dequantize(zq, za, code, 4) == 0).all()



@pytest.mark.parametrize("code_name", ["signed", "unsigned", "nf4"])
def test_bin_table_equals_bucketize(code_name):
    """bins(): the nearest code found by a table lookup is bucketize's, bit for bit, also on the midpoints,
    their float neighbours, signed zeros, subnormals and the ends of [-1, 1]."""
    code = {"signed": quant.dynamic_map(True), "unsigned": quant.dynamic_map(False), "nf4": quant.nf4_map()}[code_name]
    mids = (code[:-1] + code[1:]) / 2
    g = torch.Generator().manual_seed(0)
    x = torch.randn(200_000, generator=g) * torch.logspace(-9, 0, 200_000)
    up, down = torch.nextafter(mids, torch.tensor(2.0)), torch.nextafter(mids, torch.tensor(-2.0))
    x = torch.cat([x, mids, -mids, up, down, -up, -down, torch.tensor([0.0, -0.0, 1.0, -1.0, 1e-45, -1e-45, 1e-38])])
    x = x.clamp(-1, 1)
    table = quant.bins(code)
    assert table is not None
    assert torch.equal(quant.nearest(x, code, table), quant.nearest(x, code))
    q1, a1 = quant.quantize(x * 3, code, 64, table)
    q2, a2 = quant.quantize(x * 3, code, 64)
    assert torch.equal(q1, q2) and torch.equal(a1, a2)
    # a book with two midpoints inside one bin of 2^-7 relative width has no table
    assert quant.bins(torch.tensor([0.0, 0.5, 0.5001, 0.5002, 1.0])) is None

def test_nf4_hand_worked_block():
    w = torch.tensor([2.0, -1.0, 0.5, 0.0])  # absmax 2 -> scaled [1, -0.5, 0.25, 0]
    packed, absmax = quant.nf4_quantize(w, block=4)
    # nearest NF4 entries: 1.0 (15); -0.5 -> -0.5251 (2), not -0.3949; 0.25 -> 0.2461 (10); 0 (7)
    assert absmax.tolist() == [2.0]
    assert packed.tolist() == [(15 << 4) | 2, (10 << 4) | 7]
    back = quant.nf4_dequantize(packed, absmax, 4, block=4)
    assert torch.equal(back, torch.tensor([1.0, quant.NF4[2], quant.NF4[10], 0.0]) * 2)
    odd_packed, _ = quant.nf4_quantize(torch.tensor([1.0, -1.0, 0.5]), block=4)
    assert odd_packed.shape == (2,)  # an odd count pads one code


def test_round_trip_codes():
    g = torch.Generator().manual_seed(1)
    for code in (quant.dynamic_map(True), quant.dynamic_map(False)):
        x = torch.randn(4096, generator=g)
        x = x if code.min() < 0 else x.abs()
        q, a = quant.quantize(x, code, 256)
        q2, a2 = quant.quantize(quant.dequantize(q, a, code, 256), code, 256)
        positive_max = x.view(-1, 256).gather(1, x.view(-1, 256).abs().argmax(1, keepdim=True)).squeeze(1) > 0
        same = (q2.view(-1, 256) == q.view(-1, 256)).all(1)
        assert same[positive_max].all() and torch.equal(a2[positive_max], a[positive_max])
        q3, a3 = quant.requantize(quant.dequantize(q, a, code, 256), code, 256)  # every block, both signs
        assert torch.equal(q3, q) and ((a3 - a).abs() <= 1e-6 * a).all()
        if code.min() < 0:
            assert not positive_max.all()  # (the case requantize exists for did occur)
    w = torch.randn(64, 48, generator=g)
    p, a = quant.nf4_quantize(w, 64)
    p2, a2 = quant.nf4_quantize(quant.nf4_dequantize(p, a, w.numel(), 64), 64)
    assert torch.equal(p2, p) and torch.equal(a2, a)


def test_double_quantization():
    g = torch.Generator().manual_seed(2)
    absmax = torch.rand(1000, generator=g) * 3
    q, a2, offset = quant.double_quantize(absmax)
    back = quant.double_dequantize(q, a2, offset)
    step = (quant.dynamic_map(True).diff().max() * a2.max()).item()
    assert q.dtype == torch.uint8 and a2.shape == (4,) and (back - absmax).abs().max() <= step


@pytest.fixture(scope="module")
def bnb():
    return pytest.importorskip("bitsandbytes.functional")


def test_equals_bitsandbytes(bnb):
    for signed in (True, False):
        assert torch.equal(quant.dynamic_map(signed), bnb.create_dynamic_map(signed=signed))
    g = torch.Generator().manual_seed(3)
    x = torch.randn(8192, generator=g) * 0.01
    for signed in (True, False):
        v = x if signed else x.abs()
        code = quant.dynamic_map(signed)
        q, a = quant.quantize(v, code, 256)
        bq, state = bnb.quantize_blockwise(v, code=code, blocksize=256)
        assert torch.equal(a, state.absmax)
        # bitsandbytes' CPU kernel searches the book approximately: near a midpoint it may take the
        # farther neighbour. Elsewhere the codes are equal; where not, ours is the nearer one
        diff = q != bq
        assert diff.float().mean() < 0.005
        scaled = v * (1 / a).repeat_interleave(256)
        ours, theirs = (scaled - code[q.long()]).abs(), (scaled - code[bq.long()]).abs()
        assert ((q.int() - bq.int())[diff].abs() == 1).all() and (ours[diff] <= theirs[diff]).all()
        assert torch.equal(quant.dequantize(bq, a, code, 256), bnb.dequantize_blockwise(bq, state))
    w = torch.randn(96, 64, generator=g)
    p, a = quant.nf4_quantize(w, 64)
    bp, st = bnb.quantize_4bit(w, blocksize=64, quant_type="nf4", compress_statistics=False)
    assert torch.equal(p, bp.view(-1)) and torch.equal(a, st.absmax)
    assert torch.equal(quant.nf4_dequantize(p, a, w.numel(), 64).view(w.shape), bnb.dequantize_4bit(bp, st))
    bp2, st2 = bnb.quantize_4bit(w, blocksize=64, quant_type="nf4", compress_statistics=True)
    q, a2, offset = quant.double_quantize(a)
    assert torch.equal(q, st2.absmax) and torch.equal(a2, st2.state2.absmax) and abs(offset.item() - st2.offset.item()) < 1e-7
