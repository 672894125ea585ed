"""Tasks that carry their own data and reward (nanochat style): deterministic from a seed, offline.

A task makes items, dicts {"prompt": [messages], "answer": str, ...}, and scores a model's
completion of an item with reward(completion, item) -> float. SFT trains on sft_examples(), DPO
on pairs(), GRPO samples completions of train() prompts and rewards them; test() gives held-out
items (disjoint from train()) on which a rising reward means the model learned, not memorised.

    Arithmetic   "What is 23 + 48?" -> "71": small sums and differences with exact answers; the
                 offline default every chat stage runs on CPU (a tiny model learns it in minutes).
"""
import random
import re
import zlib

from config import UserError

END_OF_TURN = re.compile(r"<\|[^|]*\|>")   # <|im_end|>, <|endoftext|>, ...: a completion ends there
NUMBER = re.compile(r"-?\d+")


def user(text):
    """The one-turn prompt of an item."""
    return [{"role": "user", "content": text}]


def assistant(text):
    return [{"role": "assistant", "content": text}]


def first_integer(completion):
    """The first integer of a completion, read up to its first end-of-turn marker; None if none."""
    text = END_OF_TURN.split(completion, 1)[0]
    m = NUMBER.search(text.replace(",", ""))
    return m.group() if m else None


class Task:
    """A named source of items with a reward. Subclasses define items(split) or train/test."""
    name = "task"

    def train(self, n, seed=0):
        raise NotImplementedError

    def test(self, n, seed=0):
        raise NotImplementedError

    def reward(self, completion, item):
        raise NotImplementedError

    def reward_fn(self):
        """This task's reward in rewards.py's form f(prompts, completions, **columns): the columns
        are the items' other keys ("answer", ...), one value per completion."""
        def task_reward(prompts, completions, **columns):
            return [self.reward(c, {"prompt": p, **{k: v[i] for k, v in columns.items()}})
                    for i, (p, c) in enumerate(zip(prompts, completions))]
        task_reward.__name__ = f"{self.name}_reward"
        return task_reward


class Arithmetic(Task):
    """Sums and differences of integers in [0, max_operand]; a difference is never negative.

    The space of problems is split once, by a hash of the question, into train (about 90%) and
    test (about 10%): test() never returns a question train() can, whatever the seeds. train(n)
    samples with replacement (n may exceed the space); test(n) gives distinct items, at most the
    size of the held-out set. The answer is the bare integer ("71"); reward() reads the first
    integer of the completion before its end-of-turn marker.
    """
    name = "arithmetic"

    def __init__(self, max_operand=20, ops="+-", test_percent=10):
        if max_operand < 1 or not ops or set(ops) - set("+-*") or not 0 < test_percent < 100:
            raise TaskError("Arithmetic needs max_operand >= 1, ops from '+-*', 0 < test_percent < 100")
        self.max_operand, self.ops, self.test_percent = max_operand, ops, test_percent
        problems = [(a, op, b) for op in ops for a in range(max_operand + 1) for b in range(max_operand + 1)
                    if op != "-" or a >= b]
        held = [zlib.crc32(self.question(*p).encode()) % 100 < test_percent for p in problems]
        self.train_problems = [p for p, h in zip(problems, held) if not h]
        self.test_problems = [p for p, h in zip(problems, held) if h]

    @staticmethod
    def question(a, op, b):
        return f"What is {a} {op} {b}?"

    @staticmethod
    def solve(a, op, b):
        return a + b if op == "+" else a - b if op == "-" else a * b

    def item(self, a, op, b):
        return {"prompt": user(self.question(a, op, b)), "answer": str(self.solve(a, op, b))}

    def train(self, n, seed=0):
        rng = random.Random(seed)
        return [self.item(*rng.choice(self.train_problems)) for _ in range(n)]

    def test(self, n, seed=0):
        problems = list(self.test_problems)
        random.Random(seed).shuffle(problems)
        return [self.item(*p) for p in problems[:n]]

    def reward(self, completion, item):
        return 1.0 if first_integer(completion) == item["answer"] else 0.0

    def sft_examples(self, n, seed=0):
        """Conversations to fine-tune on: the question, then the bare answer."""
        return [it["prompt"] + assistant(it["answer"]) for it in self.train(n, seed)]

    def pairs(self, n, seed=0):
        """Preference pairs: the correct answer chosen, a plausible wrong one rejected (off by one,
        off by ten, digits swapped)."""
        rng = random.Random(seed)
        out = []
        for it in self.train(n, seed):
            out.append({"prompt": it["prompt"], "chosen": assistant(it["answer"]),
                        "rejected": assistant(rng.choice(wrong_answers(int(it["answer"]))))})
        return out


def wrong_answers(x):
    """Plausible wrong answers to x, never x itself, never negative: x +- 1, x +- 10, x's digits
    swapped (when that is a different number)."""
    out = {x + 1, x + 10, str(x)[::-1]} | ({x - 1} if x > 0 else set()) | ({x - 10} if x >= 10 else set())
    out = {int(v) for v in out} - {x}
    return sorted(str(v) for v in out)


class TaskError(UserError, ValueError):
    """A task name or setting that cannot work."""


def get(name, **kw):
    """A task by name ("arithmetic", ...), built with keyword settings."""
    tasks = {"arithmetic": Arithmetic}
    if name not in tasks:
        raise TaskError(f"unknown task {name!r}: choose one of {', '.join(sorted(tasks))}")
    return tasks[name](**kw)


def accuracy(model_fn, task, items):
    """The mean reward of model_fn(prompt) -> completion over items."""
    if not items:
        raise ValueError("accuracy() needs at least one item")
    return sum(task.reward(model_fn(it["prompt"]), it) for it in items) / len(items)
