"""The long-context retrieval task (tasks.TASKS["retrieval"]): a pass key buried in filler text, asked for
`depth` tokens later, with its own exact-match reward (GRPO), SFT examples and accuracy by depth.

    task = tasks.get("retrieval", depth=8192)     # or python sft.py ... --task=retrieval --pack=False
"""
import math
import random

import tokenizer as tokenizer_mod
from posttrain import rewards
from posttrain.tasks import NUMBER, Task, TaskError, assistant, first_integer, held_out, user


class Retrieval(Task):
    """Retrieval over a long context (passkey, Mohtashami & Jaggi 2023): `keys` pass keys, 5-digit numbers (named by a
    word when keys > 1), hidden in filler (plain sentences, no digit), the one asked for at least `depth` tokens
    before the prompt's end (min_depth > 0: drawn in [min_depth, depth], uniformly or with spread="log" log-
    uniformly: most items short and cheap, a tail as long as depth; an item's "depth" holds its count), counted
    by `tokenizer` (ours by default; name the model's, e.g. its HF folder, or give its tokenizer_vocab, for
    exact depths). length > 0: filler before the keys too, to about length tokens. Offline, seeded; split by a
    hash of the asked number. Reward: 1.0 when the completion's first integer is the number, else 0.0 (a near
    miss, a digit off or another key's number, earns nothing). Chance: blind, 1/90,000 (~0); copying one of the
    prompt's numbers at random, 1/keys. answer="sentence": the question drops "Answer with the number only." and
    SFT answers restate the needle ("The pass key is N."), a copy that follows the model's own words (the reward is
    the same: the first integer). by_depth(): accuracy by distance."""
    name = "retrieval"
    NAMES = "apple zephyr candle violet harbor meadow copper falcon lantern orchid pepper saddle thistle walnut".split()
    WORDS = ("small old quiet bright green heavy gentle distant yellow careful".split(),
             "cat farmer river bird teacher wind child boat garden horse baker".split(),
             "watches follows paints carries finds visits cleans remembers passes".split())

    def __init__(self, depth=8192, min_depth=0, length=0, keys=1, test_percent=10, tokenizer="cl100k_base",
                 tokenizer_vocab=0, spread="uniform", answer="number"):
        if depth < 16 or not 0 <= min_depth <= depth or length and length <= depth \
                or not 1 <= keys <= len(self.NAMES) or not 0 < test_percent < 100 \
                or spread not in ("uniform", "log") or spread == "log" and not min_depth \
                or answer not in ("number", "sentence"):
            raise TaskError(f"Retrieval needs depth >= 16, 0 <= min_depth <= depth, length 0 or > depth, spread "
                            f"uniform or log (log: min_depth > 0), answer number or sentence, 1 <= keys <= "
                            f"{len(self.NAMES)}, 0 < test_percent < 100")
        self.depth, self.min_depth, self.length, self.keys, self.spread = depth, min_depth, length, keys, spread
        self.answer = answer
        self.test_percent = test_percent
        self.tok = tokenizer_mod.get_tokenizer(tokenizer, tokenizer_vocab)
        rng, (adj, noun, verb) = random.Random(0), self.WORDS
        self.filler = [f" The {rng.choice(adj)} {rng.choice(noun)} {rng.choice(verb)} the {rng.choice(noun)}."
                       for _ in range(512)]
        self.sizes = [self.count(f) for f in self.filler]

    def count(self, text):
        return len(self.tok.encode(text))

    def fill(self, rng, tokens):
        """Filler sentences of at least `tokens` tokens, summed as each encodes alone."""
        out, n = [], 0
        while n < tokens:
            out.append(rng.randrange(len(self.filler)))
            n += self.sizes[out[-1]]
        return "".join(self.filler[i] for i in out)

    def item(self, rng, test):
        values = []
        while len(values) < self.keys:
            v = rng.randint(10000, 99999)
            if v not in values and held_out(str(v), self.test_percent) == test:
                values.append(v)
        names = rng.sample(self.NAMES, self.keys) if self.keys > 1 else [""]
        needles = [f" The pass key{f' of {m}' if m else ''} is {v}." for m, v in zip(names, values)]
        order = rng.sample(range(self.keys), self.keys)
        at = order.index(0)  # the asked key's place among the needles
        question = f" What is the pass key{f' of {names[0]}' if names[0] else ''}?" + \
            (" Answer with the number only." if self.answer == "number" else "")
        lo, hi = self.min_depth, self.depth
        want = hi if not lo else rng.randint(lo, hi) if self.spread == "uniform" \
            else round(math.exp(rng.uniform(math.log(lo), math.log(hi))))
        rest = "." + "".join(needles[i] for i in order[at + 1:])  # after the asked number
        tail = rest + self.fill(rng, want - self.count(rest + question)) + question
        while (depth := self.count(tail)) < want:  # a tokenizer whose pieces do not add up: more filler
            tail = rest + self.fill(rng, 1) + tail[len(rest):]
        head = ("There is a pass key hidden in a lot of irrelevant text. Find it and memorize it" if self.keys == 1 else
                "Pass keys, each named by a word, are hidden in a lot of irrelevant text. Find and memorize them")
        head += ".\n"
        keys = "".join(needles[i] for i in order[:at + 1])[:-1]
        before = self.fill(rng, self.length - self.count(head + keys) - depth) if self.length else ""
        return {"prompt": user(head + before + keys + tail), "answer": str(values[0]), "depth": depth,
                "needle": needles[0][1:-1]}

    def train(self, n, seed=0):
        rng = random.Random(seed)
        return [self.item(rng, False) for _ in range(n)]

    def test(self, n, seed=0):
        rng, out = random.Random(seed), {}
        while len(out) < n:  # distinct asked numbers
            it = self.item(rng, True)
            out.setdefault(it["answer"], it)
        return list(out.values())

    def reward(self, completion, item):
        return 1.0 if first_integer(completion) == item["answer"] else 0.0

    def accuracy(self, completion, item):
        """strict: the completion is the number alone; lenient: the number anywhere in it."""
        text = rewards.completion_text(completion)
        return float(text.strip() == item["answer"]), float(item["answer"] in NUMBER.findall(text))

    def sft_examples(self, n, seed=0):
        return [it["prompt"] + assistant(it["answer"] if self.answer == "number" else it["needle"] + ".")
                for it in self.train(n, seed)]

    @staticmethod
    def by_depth(items, scores, bins=4):
        """Accuracy by distance: [(lowest depth, highest depth, items, mean score)] of `bins` equal depth ranges."""
        lo, hi = min(it["depth"] for it in items), max(it["depth"] for it in items) + 1
        edges = [lo + (hi - lo) * b // bins for b in range(bins + 1)]
        got = [[s for it, s in zip(items, scores) if a <= it["depth"] < b] for a, b in zip(edges, edges[1:])]
        return [(a, b - 1, len(g), sum(g) / max(len(g), 1)) for a, b, g in zip(edges, edges[1:], got)]
