"""Verifiable rewards: math answers checked numerically and symbolically, code run in a sandbox.

A reward function has TRL's form f(prompts, completions, **columns) -> list[float | None]: one
value per completion, None where the reward does not apply (no gold answer, no tests); the
dataset's other columns ("answer", "tests", ...) arrive as keyword lists. combine() weighs several.

Math. extract_answer() finds the final answer (\\boxed{...} with nested braces, <answer> tags,
'#### 42', 'the answer is 42'); math_equal() compares it with the gold answer: numbers exactly
(decimals, fractions, thousands commas, currency, percent, unit words stripped conservatively),
anything else with math-verify (the library TRL uses) when installed, else as normalised text.
math-verify runs in a worker process killed on a wall clock: a pathological expression never
hangs the trainer, from any thread (its own timeout is signal-based: main thread only).

Code. code_reward() runs each completion's program and its tests in sandbox.py's sandbox
(sandbox.run_many: many at once, each in its own isolated process); a test passes or it does not.

Accuracy, strict and lenient. accuracy() -> {"strict", "lenient"} per completion: lenient finds the
answer anywhere (its marker, else the last number), strict only in the item's answer_format column
('####' last line, \\boxed{}, <think>/<answer> tags: ANSWER_FORMATS; None where none is asked).
By name and by file. from_spec("math,format:0.2") or "path/to/my_reward.py:fn:0.5" -> a Reward: a
weighted sum in the same form (REWARDS: math, strict, lenient, format, code; extra names from the caller).
"""
import contextlib
import importlib.util
import inspect
import json
import math
import os
import re
import resource
import select
import subprocess
import sys
import time
from fractions import Fraction

from posttrain import sandbox

END_OF_TURN = re.compile(r"<\|[^|<>]*\|>")   # <|im_end|>, <|endoftext|>: a completion ends at the first
# the formats an answer can be asked in (an item's answer_format column) -> the instruction that asks for it
ANSWER_FORMATS = {
    "####": "Give the final answer on the last line as: #### <answer>",
    "boxed": "Put the final answer in \\boxed{}.",
    "tags": "Think inside <think></think>, then give the final answer inside <answer></answer>.",
}


def completion_text(completion):
    """The text of a completion (a string, a message or a list of messages), cut at its first
    end-of-turn marker."""
    if isinstance(completion, dict):
        completion = completion.get("content", "")
    elif isinstance(completion, (list, tuple)):
        completion = "".join(m.get("content", "") if isinstance(m, dict) else str(m) for m in completion)
    return END_OF_TURN.split(str(completion), 1)[0]


# ----------------------------------------------------------------------------- math answers

def boxed(text):
    """The content of the last \\boxed{...} (nested braces counted; or \\fbox{...}, or '\\boxed 5') in
    text; None if none (or unclosed)."""
    for m in reversed(list(re.finditer(r"\\(?:boxed|fbox)\s*", text))):
        rest, depth = text[m.end():], 0
        if rest.startswith("{"):
            for i, ch in enumerate(rest):
                depth += {"{": 1, "}": -1}.get(ch, 0)
                if depth == 0:
                    return rest[1:i].strip()
        elif rest[:1].strip() and m.group().endswith(" "):
            return re.split(r"[\s$]", rest, 1)[0]
    return None


def extract_answer(text):
    """The final answer in a completion: the last \\boxed{...}, else the last <answer>...</answer>,
    else the rest of the line after the last '####', else after the last 'answer is' (up to the end
    of the sentence); None if none of these is there."""
    text = completion_text(text)
    tags = re.findall(r"<answer>(.*?)</answer>", text, re.S)
    hashes = re.findall(r"####\s*([^\n]*)", text)
    said = re.findall(r"answer\s+is\b\s*:?\s*([^\n]*)", text, re.I)
    candidates = (boxed(text), (tags or [None])[-1], (hashes or [None])[-1],
                  re.split(r"\.(?:\s|$)", said[-1], 1)[0] if said else None)
    found = next((c for c in candidates if c is not None), None)
    if found is None:
        return None
    found = re.sub(r"^\$+|\$+$|^\\\(|\\\)$|^\\\[|\\\]$", "", found.strip().strip("*").strip()).strip()
    return found.rstrip(".").strip() or None


UNITS = re.compile(r"(?:\s*(?:\\(?:text|mbox|mathrm)\{[^{}]*\}|\^\s*\{?\\circ\}?|°|\\?%))+$"
                   r"|\s+(?!(?:pi|sqrt|dozen|hundreds?|thousands?|millions?|billions?|trillions?)\b)"
                   r"[A-Za-z]{2,}(?:\s+[A-Za-z]{2,})?$", re.I)
FRAC = re.compile(r"^(-?)\\[dt]?frac\{(-?\d+)\}\{(-?\d+)\}$")
DECIMAL = re.compile(r"^[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d{1,3})?$")


def parse_number(text):
    """text as an exact Fraction when it is a plain number, else None. Accepts integers, decimals,
    a/b, \\frac{a}{b}, thousands commas (1,234,567 only), a leading currency sign, a trailing percent
    sign, degree sign or unit words (42 apples, 3 \\text{cm}). '1,2', '5x', '2 or 3' are not numbers."""
    s = str(text).strip().replace("\u2212", "-").replace("\\!", "").replace("{,}", ",").replace("\\,", ",")
    s = re.sub(r"^\$+|\$+$", "", s).strip()
    s = re.sub(r"^(-?)\s*(?:\\\$|\$|€|£)\s*", r"\1", s)
    if len(s) > 200:    # not a plain number, and int() of thousands of digits would raise
        return None
    for _ in range(2):
        s = UNITS.sub("", s).strip()
    if re.fullmatch(r"[-+]?\d{1,3}(?:,\d{3})+(?:\.\d+)?", s):
        s = s.replace(",", "")
    m = FRAC.match(s) or re.fullmatch(r"()([-+]?\d+)\s*/\s*([-+]?\d+)", s)
    if m:
        return None if int(m.group(3)) == 0 else Fraction(int(m.group(2)), int(m.group(3))) * (-1 if m.group(1) else 1)
    if DECIMAL.match(s) and len(s) < 100:
        return Fraction(s)
    return None


def numbers_equal(a, b):
    """Exact Fractions equal, or (when either is not an integer) equal rounded to 6 decimals, as
    math-verify's float_rounding=6."""
    return a == b or (not a.denominator == b.denominator == 1 and round(a, 6) == round(b, 6))


def normalize_text(s):
    """A conservative normal form for comparing answers as text: no spaces, $, \\left/\\right, \\!,
    \\dfrac/\\tfrac spelled \\frac, a leading 'x =' kept."""
    s = re.sub(r"\\left|\\right|\\!|\\,|\\;|\$|\s", "", str(s))
    return s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac").rstrip(".")


def math_verify_available():
    return importlib.util.find_spec("math_verify") is not None   # optional: pip install math-verify


def symbolic_server(timeout):
    """The math-verify worker (run_code's sibling: `python -I -c`, at most 2 GB of address space):
    reads one JSON [gold, answer] per line, answers 1 or 0 per line; each pair under math-verify's
    own signal-based timeouts (this is the main thread here, whatever thread asked)."""
    resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))
    from math_verify import parse, verify
    seconds = max(1, math.ceil(timeout))
    verify(parse("$x^2+2x+1$"), parse("$(x+1)^2$"))          # sympy's first use imports more: not in a pair's time
    print("ready", flush=True)
    for line in sys.stdin:
        gold, answer = json.loads(line)
        try:
            g, a = parse(f"${gold}$", parsing_timeout=seconds), parse(f"${answer}$", parsing_timeout=seconds)
            ok = bool(g) and bool(a) and verify(g, a, timeout_seconds=seconds)
        except BaseException:  # a timeout or anything sympy raises: not equal
            ok = False
        print(int(bool(ok)), flush=True)


def read_line(fd, seconds):
    """One line from a pipe within seconds; None at a timeout or end of file."""
    data, deadline = b"", time.monotonic() + seconds
    while not data.endswith(b"\n"):
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            return None
        chunk = os.read(fd, 1)
        if not chunk:
            return None
        data += chunk
    return data.decode().strip()


def symbolic_equal_many(pairs, timeout):
    """math-verify on each pair in a worker process (sympy imported once), one pair at a time. A pair
    that runs past timeout (+1 s) inside C code no signal interrupts (2^{2^{40}}), or that kills the
    worker, counts as not equal; the worker is killed and a fresh one takes the remaining pairs."""
    out = []
    while len(out) < len(pairs):
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository root
        child = f"import sys; sys.path.insert(0, {root!r}); from posttrain import rewards; rewards.symbolic_server({timeout!r})"
        proc = subprocess.Popen([sys.executable, "-I", "-c", child], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL)
        try:
            if read_line(proc.stdout.fileno(), 120) != "ready":             # start-up: importing sympy
                raise RuntimeError("the math-verify worker did not start within 120 s")
            while len(out) < len(pairs):
                try:
                    proc.stdin.write((json.dumps(pairs[len(out)]) + "\n").encode())
                    proc.stdin.flush()
                    answer = read_line(proc.stdout.fileno(), timeout + 1)
                except BrokenPipeError:                                     # it died on the last pair
                    answer = None
                out.append(answer == "1")
                if answer is None:
                    break
        finally:
            proc.kill()
            proc.wait()
            with contextlib.suppress(BrokenPipeError):
                proc.stdin.close()
            proc.stdout.close()
    return out


def math_equal_many(pairs, timeout=5.0, symbolic=None):
    """math_equal over (gold, answer) pairs; the symbolic ones share one worker process."""
    symbolic = math_verify_available() if symbolic is None else symbolic
    out, todo = [], []
    for i, (gold, answer) in enumerate(pairs):
        if gold is None or answer is None:
            out.append(False)
            continue
        g, a = parse_number(gold), parse_number(answer)
        if g is not None and a is not None:
            out.append(numbers_equal(g, a))
        elif normalize_text(gold) == normalize_text(answer) and normalize_text(gold):
            out.append(True)
        else:
            out.append(False)
            if symbolic and len(str(answer)) <= 1000:
                todo.append(i)
    if todo:
        for i, ok in zip(todo, symbolic_equal_many([(str(pairs[i][0]), str(pairs[i][1])) for i in todo], timeout)):
            out[i] = ok
    return out


def math_equal(gold, answer, timeout=5.0, symbolic=None):
    """True when answer equals the gold answer: numbers exactly (see parse_number), else
    symbolically with math-verify when installed (symbolic=None: when it imports), else as
    normalised text. Gold comes first: math-verify's comparison is asymmetric on purpose."""
    return math_equal_many([(gold, answer)], timeout, symbolic)[0]


def column(columns, names, n):
    """The first of the named dataset columns that is present, as a list of n values (or None)."""
    for name in names:
        if columns.get(name) is not None:
            values = list(columns[name])
            if len(values) != n:
                raise ValueError(f"column {name!r} has {len(values)} values for {n} completions")
            return values
    return None


def math_reward(prompts, completions, *, timeout=5.0, **columns):
    """1.0 when the completion's final answer (extract_answer) equals the gold answer (column
    'answer' or 'solution'; a solution's own \\boxed{} or '####' answer is used when it has one),
    0.0 when not or when no answer can be found, None where there is no gold answer."""
    golds = column(columns, ("answer", "solution"), len(completions)) or [None] * len(completions)
    golds = [None if g is None else (extract_answer(str(g)) or str(g).strip() or None) for g in golds]
    pairs = [(g, extract_answer(c)) for g, c in zip(golds, completions)]
    ok = math_equal_many([p for p in pairs if p[0] is not None], timeout)
    it = iter(ok)
    return [None if g is None else float(next(it)) for g, _ in pairs]


def format_reward_for(tags=("think", "answer")):
    """A reward: 1.0 when the completion is exactly the given tags in order, each once
    (<think>...</think><answer>...</answer> by default), only whitespace between and around them."""
    body = r"\s*".join(rf"<{t}>(?:(?!</?{t}>).)*</{t}>" for t in tags)
    pattern = re.compile(rf"\s*{body}\s*", re.S)

    def format_reward(prompts, completions, **columns):
        return [1.0 if pattern.fullmatch(completion_text(c)) else 0.0 for c in completions]
    return format_reward


format_reward = format_reward_for()


def extract_code(text):
    """The first fenced code block (```python ... ``` or ``` ... ```) of a completion, else its whole
    text (a base model continuing a function's body)."""
    text = completion_text(text)
    m = re.search(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)(?:```|$)", text, re.S)
    return m.group(1) if m else text


def code_reward(prompts, completions, *, timeout=10.0, memory_mb=512, workers=None, **columns):
    """1.0 when the completion's code (extract_code, after the column 'prefix' when given: e.g. a
    HumanEval prompt the completion continues) passes the column 'tests' in the sandbox, else 0.0;
    None where an item has no tests."""
    n = len(completions)
    tests = column(columns, ("tests",), n) or [None] * n
    prefix = column(columns, ("prefix",), n) or [""] * n
    jobs = [i for i in range(n) if tests[i]]
    results = sandbox.run_many([(prefix[i] or "") + extract_code(completions[i]) for i in jobs], [tests[i] for i in jobs],
                       workers=workers, timeout=timeout, memory_mb=memory_mb)
    done = dict(zip(jobs, results))
    return [float(done[i].passed) if i in done else None for i in range(n)]


def combine(fns, weights=None):
    """One reward from several: sum(w * f) over the functions that apply (None ones are skipped, as
    TRL's nansum); None only where none applies. weights default to 1 each."""
    weights = [1.0] * len(fns) if weights is None else list(weights)
    if len(weights) != len(fns) or not fns:
        raise ValueError(f"combine() needs one weight per function: {len(fns)} functions, {len(weights)} weights")

    def combined(prompts, completions, **columns):
        per_fn = [fn(prompts, completions, **columns) for fn in fns]
        return [sum(w * v for w, v in zip(weights, values) if v is not None)
                if any(v is not None for v in values) else None for values in zip(*per_fn)]
    return combined


# ----------------------------------------------------------------------------- strict and lenient accuracy

NUMBER = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?")
TAGGED = re.compile(r"\s*<think>(?:(?!</?think>).)*</think>\s*<answer>((?:(?!</?answer>).)*)</answer>\s*", re.S)


def last_number(text):
    """The last number (integer or decimal, thousands commas allowed) in a completion; None if none."""
    found = NUMBER.findall(completion_text(text))
    return found[-1] if found else None


def strict_answer(text, fmt):
    """A completion's answer only where it is given in the format fmt (ANSWER_FORMATS): '####' the last
    line '#### <answer>', 'boxed' the last \\boxed{...}, 'tags' the <answer> of exactly <think>...</think>
    <answer>...</answer>; None when it is not (or fmt is '': none asked)."""
    text = completion_text(text)
    if fmt == "####":
        lines = text.strip().splitlines()
        m = re.fullmatch(r"####\s*(.*?)\s*\.?\s*", lines[-1]) if lines else None
        return (m.group(1) or None) if m else None
    if fmt == "boxed":
        return boxed(text)
    if fmt == "tags":
        m = TAGGED.fullmatch(text)
        return (m.group(1).strip() or None) if m else None
    if fmt:
        raise ValueError(f"answer format {fmt!r} is not one of {', '.join(ANSWER_FORMATS)}")
    return None


def lenient_answer(text):
    """A completion's answer wherever it is: its final-answer marker (extract_answer), else its last number."""
    return extract_answer(text) or last_number(text)


def golds_of(columns, n):
    """The gold answers of n completions (column 'answer' or 'solution'; a solution's own \\boxed{} or '####'
    answer where it has one), None where there is none."""
    golds = column(columns, ("answer", "solution"), n) or [None] * n
    return [None if g is None else (extract_answer(str(g)) or str(g).strip() or None) for g in golds]


def accuracy(prompts, completions, *, timeout=5.0, **columns):
    """{"strict": [...], "lenient": [...]}: 1.0 / 0.0 per completion. lenient: lenient_answer equals the
    gold; strict: strict_answer in the item's answer_format (column; '' none asked) equals it. None where
    there is no gold answer, and for strict where no format is asked."""
    n = len(completions)
    golds, fmts = golds_of(columns, n), column(columns, ("answer_format",), n) or [""] * n
    pairs = [(g, lenient_answer(c)) for g, c in zip(golds, completions)]
    pairs += [(g if f else None, strict_answer(c, f)) for g, f, c in zip(golds, fmts, completions)]
    ok = iter(math_equal_many([p for p in pairs if p[0] is not None], timeout))
    got = [None if g is None else float(next(ok)) for g, _ in pairs]
    return {"strict": got[n:], "lenient": got[:n]}


def strict_reward(prompts, completions, **columns):
    """accuracy()'s strict: the right answer, given in the asked format (None where none is asked)."""
    return accuracy(prompts, completions, **columns)["strict"]


def lenient_reward(prompts, completions, **columns):
    """accuracy()'s lenient: the right answer, found anywhere (None where there is no gold answer)."""
    return accuracy(prompts, completions, **columns)["lenient"]


def answer_format_reward(prompts, completions, **columns):
    """1.0 when the completion gives an answer in its item's answer_format (column), else 0.0; where the
    items ask no format, the <think>...</think><answer>...</answer> tags (format_reward's)."""
    n = len(completions)
    fmts = column(columns, ("answer_format",), n) or [""] * n
    return [float(strict_answer(c, f or "tags") is not None) for c, f in zip(completions, fmts)]


# ----------------------------------------------------------------------------- rewards by name and by file

REWARDS = {"math": math_reward, "strict": strict_reward, "lenient": lenient_reward, "format": answer_format_reward,
           "code": code_reward}


def reward_error(message):
    """A config.UserError: a reward setting that cannot work (config is imported here, not at the top: the
    math-verify worker imports this file, and config imports torch)."""
    from config import UserError
    return UserError(message)


class Reward:
    """A weighted sum of reward functions, in TRL's form: reward(prompts, completions, **columns) -> the
    sums (None where no part applies, as combine()). parts: [(name, weight, fn)]; score() also gives
    each part's own values (for logging: rewards/<name>)."""

    def __init__(self, parts):
        self.parts = list(parts)

    def score(self, prompts, completions, **columns):
        """(the weighted sums, {name: that part's values})."""
        each = {}
        for name, _, fn in self.parts:
            values = list(fn(prompts, completions, **columns))
            if len(values) != len(completions):
                raise reward_error(f"reward {name!r} gave {len(values)} values for {len(completions)} completions")
            each[name] = values
        weights = [w for _, w, _ in self.parts]
        total = [sum(w * v for w, v in zip(weights, values) if v is not None)
                 if any(v is not None for v in values) else None for values in zip(*each.values())]
        return total, each

    def __call__(self, prompts, completions, **columns):
        return self.score(prompts, completions, **columns)[0]


def load_function(path, name):
    """The function `name` of the Python file at path, which must take the dataset's columns as **kwargs."""
    if not os.path.isfile(path):
        raise reward_error(f"reward file {path!r} not found")
    module_name = "ingot_reward_" + re.sub(r"\W", "_", os.path.abspath(path))
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except SyntaxError as e:
        raise reward_error(f"reward file {path}:{e.lineno}: {e.msg}") from None
    fn = getattr(module, name, None)
    if not callable(fn):
        defined = sorted(k for k, v in vars(module).items() if callable(v) and getattr(v, "__module__", "") == module_name)
        raise reward_error(f"reward file {path!r} has no function {name!r} (it defines: {', '.join(defined) or 'none'})")
    params = inspect.signature(fn).parameters.values()
    if not any(p.kind is p.VAR_KEYWORD for p in params):
        raise reward_error(f"reward {path}:{name} must be f(prompts, completions, **columns): the dataset's columns "
                          "arrive as keywords")
    return fn


def from_spec(spec, extra=None):
    """A Reward from its setting: comma-separated parts, each a name (REWARDS, or extra's: e.g. "task") or
    path/to/file.py:function, with an optional :weight (default 1): "math,format:0.2",
    "my_reward.py:score:0.5,math"."""
    names = {**REWARDS, **(extra or {})}
    parts = [p.strip() for p in str(spec).split(",") if p.strip()]
    if not parts:
        raise reward_error(f"reward={spec!r} names no reward: give one of {', '.join(names)} or path/to/file.py:function")
    out = []
    for part in parts:
        where, weight = part, 1.0
        head, sep, tail = part.rpartition(":")
        if sep and not tail.endswith(".py") and (".py:" in head or ".py" not in part):
            try:
                weight = float(tail)
            except ValueError:
                raise reward_error(f"reward weight {tail!r} of {head!r} is not a number (name:weight, e.g. "
                                  "format:0.2)") from None
            if not math.isfinite(weight):
                raise reward_error(f"reward weight {tail!r} of {head!r} must be finite")
            where = head
        if any(where == name for name, _, _ in out):
            raise reward_error(f"reward {where!r} is named twice in {spec!r}: give it once, with one weight")
        if ".py" in where:
            path, sep, fn = where.rpartition(".py:")
            if not sep or not fn:
                raise reward_error(f"reward {where!r}: name the function in the file, as path/to/file.py:function")
            out.append((where, weight, load_function(path + ".py", fn)))
        elif where in names:
            out.append((where, weight, names[where]))
        else:
            raise reward_error(f"unknown reward {where!r}: choose one of {', '.join(names)} or path/to/file.py:function")
    return Reward(out)
