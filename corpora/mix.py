"""Mixing sources by proportion (domain balance): which source sample i of training comes from.

    m = mix.Mixture({"prose": 0.7, "code": 0.2, "math": 0.1}, seed=0)
    m = mix.Mixture([(0, {"prose": 0.9, "code": 0.1}), (1000, {"prose": 0.5, "code": 0.5})],
                    seed=0, samples_per_step=512)       # a schedule over optimizer steps
    m.sources(i0, i1)   # source index (into m.names) of global samples i0 .. i1-1
    m.counts(i)         # samples of each source among 0 .. i-1: where each source's own order is at i

Weights: a dict (constant), or a schedule of (step, dict) points (a list, or a dict step -> dict:
what a config file holds), linear in between and held
before the first and after the last. Each step's weights are normalised to sum to 1; a source
may have weight 0 at some steps. The step of sample i is i // samples_per_step (the global batch).

Invariant: sample i is source s when u(seed, i) (SplitMix64 of the seed and i, a fraction of
2^64) falls in s's slice of [0, 1) at its step: a function of (seed, i) alone, whatever the
number of ranks, workers or restarts. The draws are independent, so over n samples a share is off
by about sqrt(w (1 - w) / n). counts(i) recomputes the draws of 0 .. i-1 (vectorised, in chunks;
a loader keeps a running count and pays this only when it resumes).
"""
import numpy as np

from corpora import corpus

GOLDEN = 0x9E3779B97F4A7C15
CHUNK = 1 << 22


def splitmix64(x):
    """SplitMix64's finalizer over a uint64 array (wrapping arithmetic)."""
    x = np.asarray(x, dtype=np.uint64)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def uniform(seed, start, stop):
    """u(seed, i) in [0, 1) for i in start .. stop-1: the top 53 bits of SplitMix64(i * GOLDEN + key(seed))."""
    key = splitmix64(np.array([seed & (2 ** 64 - 1)], np.uint64) + np.uint64(GOLDEN))
    i = np.arange(start, stop, dtype=np.uint64)
    return (splitmix64(i * np.uint64(GOLDEN) + key) >> np.uint64(11)).astype(np.float64) * 2.0 ** -53


def _need(ok, message):
    if not ok:
        raise corpus.DataError(message)


class Mixture:
    """Deterministic assignment of global samples to named sources (module docstring)."""

    def __init__(self, weights, seed=0, samples_per_step=1):
        if isinstance(weights, dict) and weights and all(isinstance(w, dict) for w in weights.values()):
            weights = sorted(weights.items())  # {step: {source: weight}}: a schedule too
        points = [(0, weights)] if isinstance(weights, dict) else [(int(s), w) for s, w in weights]
        _need(points and all(isinstance(w, dict) and w for _, w in points),
              f"mixture weights {weights!r}: give a dict {{source: weight}} or a list of (step, dict) points")
        self.names = list(points[0][1])
        for step, w in points:
            _need(sorted(w) == sorted(self.names), f"mixture point at step {step} names {sorted(w)}; every point must "
                  f"name the same sources {sorted(self.names)}")
            _need(all(isinstance(v, (int, float)) and v >= 0 for v in w.values()) and sum(w.values()) > 0,
                  f"mixture weights at step {step} {w}: each must be a number >= 0, and their sum > 0")
        steps = [s for s, _ in points]
        _need(steps == sorted(set(steps)) and steps[0] >= 0, f"mixture schedule steps {steps} must increase from >= 0")
        _need(isinstance(samples_per_step, int) and samples_per_step >= 1,
              f"samples_per_step={samples_per_step} must be an integer >= 1 (the global batch)")
        self.steps = np.array(steps, dtype=np.float64)
        table = np.array([[w[n] for n in self.names] for _, w in points], dtype=np.float64)
        self.table = table / table.sum(axis=1, keepdims=True)
        self.seed, self.samples_per_step = seed, samples_per_step

    def weights_at(self, steps):
        """(len(steps), sources) normalised weights at the given optimizer steps."""
        steps = np.asarray(steps, dtype=np.float64)
        w = np.stack([np.interp(steps, self.steps, self.table[:, j]) for j in range(len(self.names))], axis=-1)
        return w / w.sum(axis=-1, keepdims=True)

    def sources(self, start, stop):
        """int8 source index of each global sample in start .. stop-1."""
        if len(self.names) == 1:
            return np.zeros(max(stop - start, 0), dtype=np.int8)
        u = uniform(self.seed, start, stop)
        if len(self.steps) == 1:
            edges = np.cumsum(self.table[0])[:-1]
            return np.searchsorted(edges, u, side="right").astype(np.int8)
        w = self.weights_at(np.arange(start, stop) // self.samples_per_step)
        return (u[:, None] >= np.cumsum(w, axis=1)[:, :-1]).sum(axis=1).astype(np.int8)

    def counts(self, stop, start=0):
        """Samples of each source among start .. stop-1."""
        n = np.zeros(len(self.names), dtype=np.int64)
        for a in range(start, stop, CHUNK):
            n += np.bincount(self.sources(a, min(a + CHUNK, stop)), minlength=len(self.names))
        return n

    def expected(self, stop, start=0):
        """The shares the weights ask for over samples start .. stop-1 (their mean weights)."""
        if len(self.steps) == 1:
            return self.table[0].copy()
        total = np.zeros(len(self.names))
        for a in range(start, stop, CHUNK):
            total += self.weights_at(np.arange(a, min(a + CHUNK, stop)) // self.samples_per_step).sum(axis=0)
        return total / max(stop - start, 1)
