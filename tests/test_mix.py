"""mix.py: the draws are SplitMix64 as a plain-Python reference computes it (integers mod 2^64); a
70/20/10 mixture gives each source its share within +-2% over 10k samples (several seeds); a
schedule is honoured: the share of each window of steps is within +-4% of the weights' mean there
(2,000 samples a window), a source at weight 0 is never drawn, the weights before the first and
after the last point are held, and expected() equals the mean worked by hand; counts() equals a
direct count whatever the chunking; the assignment depends on (seed, index) only; bad weights
are refused with a message."""
import numpy as np
import pytest

from corpora import corpus, mix

M64 = (1 << 64) - 1


def splitmix_ref(x):
    x &= M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & M64
    return x ^ (x >> 31)


def test_uniform_equals_reference():
    for seed in (0, 1, 12345):
        key = splitmix_ref(seed + mix.GOLDEN)
        ref = [(splitmix_ref(i * mix.GOLDEN + key) >> 11) / 2.0 ** 53 for i in range(1000, 1100)]
        assert mix.uniform(seed, 1000, 1100).tolist() == ref


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_proportions_10k(seed):
    weights = {"prose": 0.7, "code": 0.2, "math": 0.1}
    m = mix.Mixture(weights, seed=seed)
    src = m.sources(0, 10_000)
    for j, name in enumerate(m.names):
        assert abs((src == j).mean() - weights[name]) <= 0.02, name
    assert np.array_equal(m.counts(10_000), np.bincount(src, minlength=3))
    # a function of (seed, index): any range gives the same draws
    assert np.array_equal(m.sources(4321, 4400), src[4321:4400])
    assert not np.array_equal(mix.Mixture(weights, seed=seed + 10).sources(0, 10_000), src)


def test_schedule_honoured():
    steps, per = 200, 100
    sched = [(20, {"a": 1.0, "b": 0.0}), (120, {"a": 0.0, "b": 3.0})]  # b: 0 -> 1 over steps 20..120 (normalised)
    m = mix.Mixture(sched, seed=0, samples_per_step=per)
    src = m.sources(0, steps * per)
    step = np.arange(steps * per) // per
    want_b = np.clip((step - 20) / 100, 0, 1)
    for s0 in range(0, steps, 20):
        sel = (step >= s0) & (step < s0 + 20)
        assert abs((src[sel] == 1).mean() - want_b[sel].mean()) <= 0.04, s0
    assert (src[step < 20] == 0).all() and (src[step >= 120] == 1).all()  # weight 0: never drawn
    # steps 20..119: b's weight (step - 20) / 100, mean 0.495 worked by hand
    assert m.expected(120 * per, 20 * per)[1] == pytest.approx(0.495)
    assert m.expected(steps * per)[1] == pytest.approx((20 * 0 + 100 * 0.495 + 80 * 1) / 200)
    as_dict = mix.Mixture({120: sched[1][1], 20: sched[0][1]}, seed=0, samples_per_step=per)  # a config's form
    assert np.array_equal(as_dict.sources(0, steps * per), src)


def test_counts_any_chunking(monkeypatch):
    m = mix.Mixture({"x": 1, "y": 2, "z": 5}, seed=9)
    ref = np.bincount(m.sources(0, 5000), minlength=3)
    monkeypatch.setattr(mix, "CHUNK", 777)
    assert np.array_equal(m.counts(5000), ref)
    assert np.array_equal(m.counts(5000, 1234), np.bincount(m.sources(1234, 5000), minlength=3))


def test_bad_weights():
    for bad, msg in [({"a": -1, "b": 1}, "number >= 0"), ({"a": 0, "b": 0}, "sum > 0"), ({}, "give a dict"),
                     ([(0, {"a": 1}), (10, {"b": 1})], "same sources"),
                     ([(10, {"a": 1}), (5, {"a": 1})], "must increase")]:
        with pytest.raises(corpus.DataError, match=msg):
            mix.Mixture(bad)
    with pytest.raises(corpus.DataError, match="samples_per_step"):
        mix.Mixture({"a": 1}, samples_per_step=0)
