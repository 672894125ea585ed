"""Five task families with verifiable answers, generated offline with worked solutions: the set GRPO's recipe is
tuned on (at most two) and judged on (the others), as tasks.TASKS names them ('module:Class', imported when asked).

    word_problems    GSM8K-style stories of nine kinds (shopping, travel, sharing, ages, ...), 2-4 steps
    long_arithmetic  3-5 digit sums and differences worked column by column (carries, borrows); 3-4 digit
                     numbers times 2-99 by place-value partial products
    strings          reverse, sort, count a letter, the n-th letter of random lowercase strings (spelled out)
    units            length / mass / time / volume conversions over one or two rungs of a unit ladder, and
                     sums of two lengths (masses, ...) in the smaller unit; exact integer or decimal answers
    shortest_path    the shortest distance between two towns of a small weighted road graph (Dijkstra's trace)

    python sft.py configs/sft_tiny.py --task=strings --out_dir=out/sft_strings
    task = tasks.get("units"); task.train(4, seed=1); task.reward("...\\n#### 2.5", item)

Every family is a Family: a problem is a hashable tuple drawn by draw(rng) and rendered by solve(problem) ->
(question, worked step lines, answer); an item carries prompt, answer, answer_format '####' and solution (the
steps, then '#### <answer>'), which SFT trains on. Train and test are split once by a hash of the question
(tasks.held_out, test_percent of them), so test() never returns a question train() can, whatever the seeds;
train(n) samples (with replacement), test(n) gives n distinct problems. The reward is strict: 1.0 when the last
line is '#### <answer>' (numbers compared exactly as numbers, strings as exact text), else 0.0; lenient
accuracy takes the answer wherever it is. space() counts the problems (exact, or a lower bound where said):
every family holds over 1e6, more than 100x the ~10,000 problems a GRPO run sees.
"""
import heapq
import math
import random
from fractions import Fraction

from posttrain import rewards
from posttrain.tasks import Task, TaskError, assistant, held_out, user


def decimal(x):
    """An exact finite decimal (a Fraction or int) as its shortest text: 2500, 12.5, 0.07."""
    x, places = Fraction(x), 0
    while (x * 10 ** places).denominator != 1:
        places += 1
        if places > 12:
            raise ValueError(f"{x} is not a short finite decimal")
    digits = str(abs(x.numerator) * 10 ** places // x.denominator).rjust(places + 1, "0")
    return "-" * (x < 0) + (f"{digits[:-places]}.{digits[-places:]}" if places else digits)


def step(x, op, y, z):
    return f"{decimal(x)} {op} {decimal(y)} = {decimal(z)}"


class Family(Task):
    """A task family: draw(rng) -> a problem, solve(problem) -> (question, steps, answer); the split, the items,
    the strict '####' reward and SFT's worked solutions are shared. numeric: answers compared as numbers."""
    name = "family"
    numeric = True

    def __init__(self, test_percent=10):
        if not 0 < test_percent < 100:
            raise TaskError(f"{self.name} needs 0 < test_percent < 100")
        self.test_percent = test_percent

    def draw(self, rng):
        raise NotImplementedError

    def solve(self, problem):
        raise NotImplementedError

    def space(self):
        raise NotImplementedError

    def item(self, problem):
        question, steps, answer = self.solve(problem)
        return {"prompt": user(question), "answer": answer, "answer_format": "####",
                "solution": "\n".join([*steps, f"#### {answer}"])}

    def problems(self, n, seed=0, test=False):
        """n problems of a split: train with replacement, test distinct (drawn until the hash puts them there)."""
        rng, out, seen = random.Random(seed), [], set()
        for _ in range(100 * n + 1000):
            if len(out) == n:
                return out
            p = self.draw(rng)
            if held_out(self.solve(p)[0], self.test_percent) != test or p in seen:
                continue
            if test:
                seen.add(p)
            out.append(p)
        raise TaskError(f"{self.name}: found only {len(out)} of {n} {'test' if test else 'train'} problems: ask fewer")

    def train(self, n, seed=0):
        return [self.item(p) for p in self.problems(n, seed)]

    def test(self, n, seed=0):
        return [self.item(p) for p in self.problems(n, seed, test=True)]

    def same(self, got, answer):
        if got is None:
            return False
        if self.numeric:
            return rewards.parse_number(got) == Fraction(answer)
        return got.strip() == answer

    def reward(self, completion, item):
        """1.0 when the completion's last line is '#### <the answer>', else 0.0."""
        return float(self.same(rewards.strict_answer(completion, "####"), item["answer"]))

    def accuracy(self, completion, item):
        """strict: the reward; lenient: the answer wherever it is (numbers: rewards.lenient_answer; text: a
        line that is the answer, '####' or not)."""
        if self.numeric:
            lenient = self.same(rewards.lenient_answer(completion), item["answer"])
        else:
            lines = rewards.completion_text(completion).splitlines()
            lenient = any(self.same(line.replace("####", "", 1), item["answer"]) for line in lines)
        return self.reward(completion, item), float(lenient)

    def sft_examples(self, n, seed=0):
        """Conversations to fine-tune on: the question, then the worked solution ending in '#### <answer>'."""
        return [it["prompt"] + assistant(it["solution"]) for it in self.train(n, seed)]


# ----------------------------------------------------------------------------- word problems

NAMES = ("Ana", "Ben", "Carla", "Dev", "Emma", "Farid", "Grace", "Hugo", "Ines", "Jack", "Kira", "Leo", "Maya",
         "Nina", "Omar", "Priya", "Quinn", "Rosa", "Sam", "Tara", "Umar", "Vera", "Wes", "Yara")
GOODS = ("pencils", "apples", "notebooks", "candles", "mugs", "stickers", "oranges", "markers", "plates", "cards")
EXTRAS = ("bag", "lamp", "book", "scarf", "clock", "hat", "kite", "pen")
THINGS = ("marbles", "stickers", "cookies", "shells", "stamps", "beads", "cards", "coins")
PLANTS = ("tulips", "carrots", "roses", "cabbages", "lettuces", "sunflowers")
VEHICLES = ("car", "bus", "train", "truck", "van", "motorbike")


def shopping(name, goods, n, price, extra, cost, bill):
    a = n * price
    return (f"{name} buys {n} {goods} at ${price} each and a {extra} for ${cost}, and pays with a ${bill} bill. "
            f"How many dollars of change does {name} get?"), [(n, "*", price, a), (a, "+", cost, a + cost),
                                                             (bill, "-", a + cost, bill - a - cost)]


def travel(vehicle, s1, h1, s2, h2):
    a, b = s1 * h1, s2 * h2
    return (f"A {vehicle} travels at {s1} km per hour for {h1} hours, then at {s2} km per hour for {h2} hours. "
            "How many kilometres does it travel in all?"), [(s1, "*", h1, a), (s2, "*", h2, b), (a, "+", b, a + b)]


def sharing(name, things, k, each, more, eat):
    total = k * each - more
    return (f"{name} has {total} {things} and gets {more} more, then shares them equally among {k} friends. "
            f"Each friend gives away {eat} of them. How many {things} does each friend have left?"), [
        (total, "+", more, k * each), (k * each, "/", k, each), (each, "-", eat, each - eat)]


def ages(name, other, m, y, z):
    b = NAMES[(NAMES.index(name) + other) % len(NAMES)]
    a = m * y
    return (f"{name} is {m} times as old as {b}. {b} is {y} years old. What will the sum of their ages be in {z} "
            "years?"), [(m, "*", y, a), (a, "+", z, a + z), (y, "+", z, y + z), (a + z, "+", y + z, a + y + 2 * z)]


def savings(name, w, n, extra, s, b):
    t = w * n
    return (f"{name} saves ${w} each week for {n} weeks, spends ${s} on a {extra}, then earns ${b} more. "
            f"How many dollars does {name} have now?"), [(w, "*", n, t), (t, "-", s, t - s), (t - s, "+", b, t - s + b)]


def garden(name, plants, r, c, p):
    return (f"A garden has {r} rows of {c} {plants}. {name} picks {p} {plants} from each row. How many {plants} "
            "are left in the garden?"), [(r, "*", c, r * c), (r, "*", p, r * p), (r * c, "-", r * p, r * (c - p))]


def reading(name, p1, d1, p2, d2, pages):
    a, b = p1 * d1, p2 * d2
    return (f"{name}'s book has {pages} pages. {name} reads {p1} pages a day for {d1} days, then {p2} pages a day "
            f"for {d2} days. How many pages are left to read?"), [(p1, "*", d1, a), (p2, "*", d2, b),
                                                                 (a, "+", b, a + b), (pages, "-", a + b, pages - a - b)]


def baking(name, f, b, k, c):
    return (f"A recipe uses {f} cups of flour for every {b} cookies. {name} bakes {k * b} cookies and a cake that "
            f"needs {c} cups of flour. How many cups of flour does {name} use?"), [
        (k * b, "/", b, k), (k, "*", f, k * f), (k * f, "+", c, k * f + c)]


def boxes(name, things, n, b, loose):
    return (f"A box holds {b} {things}. {name} has {n} boxes and {loose} loose {things}. How many {things} does "
            f"{name} have in all?"), [(n, "*", b, n * b), (n * b, "+", loose, n * b + loose)]


STORIES = {  # kind: (its function, the domains of its arguments in order)
    "shopping": (shopping, (NAMES, GOODS, range(2, 10), range(2, 16), EXTRAS, range(1, 31), (200, 500))),
    "travel": (travel, (VEHICLES, range(20, 100), range(2, 10), range(20, 100), range(2, 10))),
    "sharing": (sharing, (NAMES, THINGS, range(2, 10), range(10, 61), range(1, 10), range(1, 10))),
    "ages": (ages, (NAMES, range(1, len(NAMES)), range(2, 6), range(3, 20), range(2, 30))),
    "savings": (savings, (NAMES, range(5, 51), range(3, 13), EXTRAS, range(1, 15), range(2, 40))),
    "garden": (garden, (NAMES, PLANTS, range(2, 13), range(10, 41), range(1, 10))),
    "reading": (reading, (NAMES, range(5, 31), range(2, 10), range(5, 31), range(2, 10), range(600, 1000))),
    "baking": (baking, (NAMES, range(2, 10), range(6, 25), range(2, 10), range(1, 10))),
    "boxes": (boxes, (NAMES, THINGS, range(2, 20), range(6, 49), range(1, 20))),
}


class WordProblems(Family):
    """GSM8K-style word problems: nine story kinds (shopping, travel, sharing, ages, savings, garden, reading,
    baking, boxes) of 2-4 arithmetic steps on non-negative integers (a division always exact), worked one step a
    line ("4 * 3 = 12\\n12 + 5 = 17\\n50 - 17 = 33\\n#### 33"). A problem is (kind, its values), each value
    drawn uniformly from its domain (STORIES), the kind uniformly; every value appears in the question, so
    distinct problems read differently. space(): 488,605,008 problems (the product of each kind's domain
    sizes, summed over the kinds)."""
    name = "word_problems"

    def draw(self, rng):
        kind = rng.choice(sorted(STORIES))
        return (kind, tuple(rng.choice(d) for d in STORIES[kind][1]))

    def solve(self, problem):
        kind, values = problem
        question, steps = STORIES[kind][0](*values)
        return question, [step(*s) for s in steps], str(steps[-1][3])

    def space(self):
        return sum(math.prod(map(len, domains)) for _, domains in STORIES.values())


# ----------------------------------------------------------------------------- multi-digit arithmetic

def digits_between(lo, hi):
    """How many integers have lo to hi digits."""
    return 10 ** hi - 10 ** (lo - 1)


class LongArithmetic(Family):
    """Multi-digit arithmetic with carries: a + b and a - b (a >= b) of 3-5 digit numbers, worked column by
    column from the units ("7 + 5 + 0 = 12, write 2, carry 1"; "12 - 8 - 0 = 4, borrow 1": the top digit plus
    10 when it borrows, minus the bottom digit and the borrow in), and a * m of a 3-4 digit a by m in [2, 99]
    by place-value partial products ("4000 * 36 = 144000" ..., then their sum). Each number is first spelled
    digit by digit ("digits of 4827: 4 8 2 7", one token a digit: a BPE token holds several, whose n-th digit
    a small model cannot read), and a sum's or difference's written digits are read back highest first before
    the answer ("digits of the answer: 8 5 2 2"). The operation is drawn uniformly; a term of a sum or
    difference has 3, 4 or 5 digits (equally likely), a product's a and m are uniform. space():
    14,971,035,150 problems (99,900^2 sums, 99,900 x 99,901 / 2 differences, 9,900 x 98 products)."""
    name = "long_arithmetic"

    def draw(self, rng):
        op = rng.choice("+-*")
        if op == "*":
            return op, rng.randint(100, 9999), rng.randint(2, 99)
        a, b = (rng.randrange(10 ** (k - 1), 10 ** k) for k in (rng.randint(3, 5), rng.randint(3, 5)))
        return (op, a, b) if op == "+" or a >= b else (op, b, a)

    def solve(self, problem):
        op, a, b = problem
        spell = lambda x: f"digits of {x}: {' '.join(str(x))}"
        if op == "*":
            parts = [int(d) * 10 ** k * b for k, d in enumerate(reversed(str(a))) if d != "0"][::-1]  # highest first
            steps = [spell(a)] + [f"{x // b} * {b} = {x}" for x in parts]
            if len(parts) > 1:
                steps.append(" + ".join(map(str, parts)) + f" = {a * b}")
            return f"What is {a} * {b}?", steps, str(a * b)
        width, steps, carry = max(len(str(a)), len(str(b))), [spell(a), spell(b)], 0
        top, bottom = (str(x)[::-1].ljust(width, "0") for x in (a, b))  # units first, zeros past the shorter
        for t, u in zip(map(int, top), map(int, bottom)):
            if op == "+":
                s = t + u + carry
                steps.append(f"{t} + {u} + {carry} = {s}, write {s % 10}, carry {s // 10}")
                carry = s // 10
            else:
                borrow = int(t - u - carry < 0)
                steps.append(f"{t + 10 * borrow} - {u} - {carry} = {t + 10 * borrow - u - carry}, borrow {borrow}")
                carry = borrow
        answer = a + b if op == "+" else a - b
        steps.append(f"digits of the answer: {' '.join(str(answer))}")
        return f"What is {a} {op} {b}?", steps, str(answer)

    def space(self):
        d, m = digits_between(3, 5), digits_between(3, 4)
        return d * d + d * (d + 1) // 2 + m * 98


# ----------------------------------------------------------------------------- strings

LETTERS = "abcdefghijklmnopqrstuvwxyz"
LENGTHS = {"reverse": range(4, 9), "sort": range(4, 9), "count": range(6, 11), "nth": range(5, 10)}  # of the strings


class Strings(Family):
    """String manipulation on random lowercase strings, each worked by spelling the string out letter by letter
    (one token a letter) and then the operation: reverse (4-8 letters), sort alphabetically (4-8), count a
    letter (6-10 letters, each the asked one with probability 0.3), the n-th letter (5-9). The answer is the
    exact text (a count: its digits). space(): 3,868,186,590,652,800 problems (every string of those lengths,
    times the letters a count can ask for or the positions an n-th can)."""
    name = "strings"
    numeric = False
    def draw(self, rng):
        op = rng.choice(sorted(LENGTHS))
        n = rng.choice(LENGTHS[op])
        if op == "count":
            c = rng.choice(LETTERS)
            return op, "".join(c if rng.random() < 0.3 else rng.choice(LETTERS) for _ in range(n)), c
        word = "".join(rng.choice(LETTERS) for _ in range(n))
        return op, word, rng.randint(1, n) if op == "nth" else None

    def solve(self, problem):
        op, word, arg = problem
        spelled = " ".join(word)
        if op == "reverse":
            return f"Reverse the letters of '{word}'.", [spelled, " ".join(word[::-1])], word[::-1]
        if op == "sort":
            return (f"Sort the letters of '{word}' in alphabetical order.", [spelled, " ".join(sorted(word))],
                    "".join(sorted(word)))
        if op == "count":
            at = [str(i) for i, ch in enumerate(word, 1) if ch == arg]
            return (f"How many times does the letter '{arg}' appear in '{word}'?",
                    [spelled, f"positions of {arg}: {' '.join(at) or 'none'}"], str(len(at)))
        return (f"What is letter {arg} of '{word}'?",
                [spelled, ", ".join(f"{i} {ch}" for i, ch in enumerate(word[:arg], 1))], word[arg - 1])

    def space(self):
        words = {op: sum(26 ** n for n in lengths) for op, lengths in LENGTHS.items()}
        return words["reverse"] + words["sort"] + 26 * words["count"] + sum(n * 26 ** n for n in LENGTHS["nth"])


# ----------------------------------------------------------------------------- unit conversion

# dimension: (units from the smallest, each as (singular, plural); the factor from each unit to the next)
LADDERS = {
    "length": ((("millimetre", "millimetres"), ("centimetre", "centimetres"), ("metre", "metres"),
                ("kilometre", "kilometres")), (10, 100, 1000)),
    "mass": ((("milligram", "milligrams"), ("gram", "grams"), ("kilogram", "kilograms"), ("tonne", "tonnes")),
             (1000, 1000, 1000)),
    "time": ((("second", "seconds"), ("minute", "minutes"), ("hour", "hours"), ("day", "days"), ("week", "weeks")),
             (60, 60, 24, 7)),
    "volume": ((("millilitre", "millilitres"), ("litre", "litres"), ("kilolitre", "kilolitres")), (1000, 1000)),
    "imperial": ((("inch", "inches"), ("foot", "feet"), ("yard", "yards"), ("mile", "miles")), (12, 3, 1760)),
}
TOTALS = {"length": ("A rope is {} long and another is {} long. How many {} long are they together?"),
          "mass": ("One bag weighs {} and another weighs {}. How many {} do they weigh together?"),
          "time": ("One task takes {} and another takes {}. How many {} do they take together?"),
          "volume": ("One tank holds {} and another holds {}. How many {} do they hold together?"),
          "imperial": ("A board is {} long and another is {} long. How many {} long are they together?")}


def amount(x, unit):
    return f"{decimal(x)} {unit[0] if x == 1 else unit[1]}"


class Units(Family):
    """Unit conversion along a ladder of units (length mm-cm-m-km, mass mg-g-kg-t, time s-min-h-day-week, volume
    mL-L-kL, imperial in-ft-yd-mi), every answer an exact integer or decimal. "convert": a value to a unit one
    or two rungs up or down, one step a rung ("2.5 * 1000 = 2500"); the larger unit's value is k/100 for k in
    [1, 99999], so a division is always exact. "total": a value in one unit (k/10, k in [1, 9999]) plus a
    whole number [1, 999] of the next smaller, in the smaller ("2.5 * 100 = 250\\n250 + 45 = 295"). Kind,
    ladder, units and values drawn uniformly. space(): 154,834,965 problems (50 unit pairs x 99,999 values,
    15 adjacent pairs x 9,999 x 999)."""
    name = "units"

    def draw(self, rng):
        dim = rng.choice(sorted(LADDERS))
        n = len(LADDERS[dim][0])
        if rng.random() < 0.5:
            big = rng.randrange(1, n)
            return "total", dim, big, rng.randint(1, 9999), rng.randint(1, 999)
        lo = rng.randrange(n - 1)
        hi = rng.choice([h for h in (lo + 1, lo + 2) if h < n])
        frm, to = (hi, lo) if rng.random() < 0.5 else (lo, hi)
        return "convert", dim, frm, to, rng.randint(1, 99999)

    def solve(self, problem):
        kind, dim, *args = problem
        units, factors = LADDERS[dim]
        if kind == "total":
            big, k, b = args
            a, f, small = Fraction(k, 10), factors[big - 1], units[big - 1]
            question = TOTALS[dim].format(amount(a, units[big]), amount(b, small), small[1])
            return question, [step(a, "*", f, a * f), step(a * f, "+", b, a * f + b)], decimal(a * f + b)
        frm, to, k = args
        value = Fraction(k, 100)  # in the larger of the two units; the smaller's value is exact by construction
        if frm < to:
            value *= math.prod(factors[frm:to])
        question, steps, x = f"Convert {amount(value, units[frm])} to {units[to][1]}.", [], value
        for i in (range(frm - 1, to - 1, -1) if frm > to else range(frm, to)):
            y = x * factors[i] if frm > to else x / factors[i]
            steps.append(step(x, "*" if frm > to else "/", factors[i], y))
            x = y
        return question, steps, decimal(x)

    def space(self):
        pairs = sum(2 * (len(u) - 1) + 2 * (len(u) - 2) for u, _ in LADDERS.values())
        adjacent = sum(len(u) - 1 for u, _ in LADDERS.values())
        return pairs * 99999 + adjacent * 9999 * 999


# ----------------------------------------------------------------------------- a graph puzzle

class ShortestPath(Family):
    """The shortest distance between two towns of a small road map: 5 or 6 towns (A-F), a random spanning tree
    plus 0-3 other roads, each of length 1-9, listed sorted ("A-B 4, A-C 2, ..."), two distinct towns asked.
    Worked as Dijkstra's trace: each town settled in turn, the road it is reached by and its distance ("A-C:
    0 + 2 = 2", ties to the earlier letter), up to the asked town. space(): at least 2,312,227,620 problems:
    the weighted labelled trees alone, Cayley's n^(n-2) trees x 9^(n-1) lengths x n(n-1) town pairs for n = 5,
    6 (a tree is drawn whenever no other road is added, and every tree can be)."""
    name = "shortest_path"

    def draw(self, rng):
        n = rng.randint(5, 6)
        towns = rng.sample(LETTERS.upper()[:n], n)
        edges = {frozenset((towns[i], towns[rng.randrange(i)])) for i in range(1, n)}  # a random spanning tree
        others = [frozenset((u, v)) for i, u in enumerate(towns) for v in towns[:i] if frozenset((u, v)) not in edges]
        edges |= set(rng.sample(others, rng.randint(0, 3)))
        roads = tuple(sorted((*sorted(e), rng.randint(1, 9)) for e in edges))
        s, t = rng.sample(sorted(towns), 2)
        return roads, s, t

    def solve(self, problem):
        roads, s, t = problem
        near = {}
        for u, v, w in roads:
            near.setdefault(u, []).append((v, w))
            near.setdefault(v, []).append((u, w))
        heap, done, steps = [(0, s, "", 0)], set(), []
        while heap:
            d, v, u, w = heapq.heappop(heap)
            if v in done:
                continue
            done.add(v)
            if u:
                steps.append(f"{u}-{v}: {d - w} + {w} = {d}")
            if v == t:
                break
            for x, wx in near[v]:
                if x not in done:
                    heapq.heappush(heap, (d + wx, x, v, wx))
        question = (f"Roads between towns, with their lengths: {', '.join(f'{u}-{v} {w}' for u, v, w in roads)}. "
                    f"What is the length of the shortest route from {s} to {t}?")
        return question, steps, str(d)

    def space(self):
        return sum(n ** (n - 2) * 9 ** (n - 1) * n * (n - 1) for n in (5, 6))
