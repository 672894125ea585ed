"""The code reward does not pay a forged equality (issue 32): sandbox.py's harness hands the tests
the program's callables wrapped so that only plain built-in values come back.

Proves, through run_many / rewards.code_reward (real sandboxed processes):
- an object whose __eq__ is always True, subclasses of int / str / list overriding __eq__, such an
  object nested in a list or a dict, an always-equal result from a callable object or from a class
  standing in for the function: none passes `assert f(x) == y` tests nor HumanEval-style
  check(candidate) tests, and each fails with the TypeError naming the returned type; the code
  reward of the always-equal candidate is 0.0;
- builtins patched during a call (abs made to return 0) are restored before the tests use them;
- honest solutions pass: ints, floats, strings, None, bools, nested lists / tuples / dicts / sets,
  a recursive function, helpers that return generators or objects of the program's own class when
  the program calls them itself, assert and check(candidate) styles; their code reward is 1.0;
  (the price: a function handed to the tests must return plain values: a generator is refused).
"""
import pytest

from posttrain import rewards, sandbox

FORGED = "class AlwaysEqual:\n    def __eq__(self, other):\n        return True\n    __hash__ = object.__hash__\n"
CASES = {  # program -> the type the harness must name
    "always_equal": (FORGED + "def add(a, b):\n    return AlwaysEqual()\n", "__main__.AlwaysEqual"),
    "int_subclass": ("class I(int):\n    def __eq__(self, o):\n        return True\n    __hash__ = int.__hash__\n"
                     "def add(a, b):\n    return I(0)\n", "__main__.I"),
    "str_subclass": ("class S(str):\n    def __eq__(self, o):\n        return True\n    __hash__ = str.__hash__\n"
                     "def add(a, b):\n    return S('')\n", "__main__.S"),
    "list_subclass": ("class L(list):\n    def __eq__(self, o):\n        return True\n"
                      "def add(a, b):\n    return L()\n", "__main__.L"),
    "nested_in_list": (FORGED + "def add(a, b):\n    return [AlwaysEqual()]\n", "__main__.AlwaysEqual inside"),
    "nested_in_dict": (FORGED + "def add(a, b):\n    return {'sum': AlwaysEqual()}\n", "__main__.AlwaysEqual inside"),
    "callable_object": (FORGED + "class Adder:\n    def __call__(self, a, b):\n        return AlwaysEqual()\n"
                        "add = Adder()\n", "__main__.AlwaysEqual"),
    "class_as_function": (FORGED + "class add:\n    def __new__(cls, a, b):\n        return AlwaysEqual()\n",
                          "__main__.AlwaysEqual"),
}
TESTS = {"assert": "assert add(2, 3) == 5\nassert add(1, 1) == 2\n",
         "check": "def check(candidate):\n    assert candidate(2, 3) == 5\n    assert candidate(0, 0) == 0\n\ncheck(add)\n",
         "nested": "assert add(2, 3) == [5]\nassert add(1, 2) == {'sum': 3}\n"}


@pytest.mark.parametrize("style", list(TESTS))
def test_forged_equality_does_not_pass(style):
    results = sandbox.run_many([p for p, _ in CASES.values()], TESTS[style], workers=4, timeout=20)
    for (name, (_, kind)), r in zip(CASES.items(), results):
        assert not r.passed, (name, style, r)
        assert r.reason.startswith(f"TypeError: add() returned a {kind}") and "(in the tests)" in r.reason, r.reason


def test_code_reward_pays_honest_code_only():
    forged = f"```python\n{CASES['always_equal'][0]}```"
    honest = "```python\ndef add(a, b):\n    return a + b\n```"
    assert rewards.code_reward([None] * 2, [forged, honest], tests=[TESTS["assert"]] * 2) == [0.0, 1.0]


def test_builtins_patched_during_a_call_are_restored():
    program = "def add(a, b):\n    import builtins\n    builtins.abs = lambda x: 0\n    return 0\n"
    r = sandbox.run_code(program, "x = add(2, 3)\nassert abs(x - 5) < 1e-9\n", timeout=20)  # abs looked up after
    assert not r.passed and r.reason == "AssertionError at tests.py:2 (in the tests)", r


HONEST = '''
class Box:
    def __init__(self, v):
        self.v = v
def evens(n):
    return (i for i in range(n) if i % 2 == 0)
def boxed(x):
    return Box(x)
def solve(n):
    return {"evens": list(evens(n)), "sum": boxed(sum(evens(n))).v, "pair": (n, n / 2), "set": {1, 2},
            "none": None, "ok": True, "name": "x" * n, "nested": [[1, [2.5, (3,)]], frozenset({4})]}
def fib(n):
    return n if n < 2 else fib(n - 1) + fib(n - 2)
'''
HONEST_TESTS = '''
def check(candidate):
    assert candidate(4) == {"evens": [0, 2], "sum": 2, "pair": (4, 2.0), "set": {1, 2}, "none": None, "ok": True,
                            "name": "xxxx", "nested": [[1, [2.5, (3,)]], frozenset({4})]}
    assert candidate(4)["ok"] is True and candidate(1)["none"] is None
check(solve)
assert fib(10) == 55 and abs(solve(3)["pair"][1] - 1.5) < 1e-12
'''


def test_honest_solutions_still_pass():
    r = sandbox.run_code(HONEST, HONEST_TESTS, timeout=20)
    assert r.passed, r
    # a generator handed to the tests is not a plain value: refused, even when honest
    r = sandbox.run_code(HONEST, "assert list(evens(3)) == [0, 2]\n", timeout=20)
    assert not r.passed and "evens() returned a builtins.generator" in r.reason
