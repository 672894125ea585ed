"""The code reward does not pay a forged verdict (issue 54): a program that reaches for the harness
from inside its own process finds nothing that can make a run pass (sandbox.py: the tests run in a
process of their own; the program's process holds no token, no tests, no verdict pipe).

Proves, through sandbox.run_many and rewards.code_reward (real sandboxed processes), with a wrong
`add` (a + b - 1) behind every attack: none passes and each earns 0, while the honest program run in
the same batch earns 1. The attacks, as a red team writes them — each harvests every 32-hex-digit
string (the token's shape) it can find and writes "<token> pass" lines (and bare "pass" lines, and
forged protocol replies) to every descriptor 0..255 and every /proc/<pid>/fd/* it can open:
- the harness's frames (the sys._getframe() walk that earned 1.0 before this change), gc's objects
  and referrers, the environment and /proc/*/environ, /proc/*/cmdline, its own memory (ctypes), the
  other processes' memory (/proc/<pid>/mem, ptrace through ctypes: refused, checked in the output);
- then os._exit(0), or a forked child that escapes the session and sprays while the tests run;
- signals to every process it can see; os._exit(0) or SystemExit in the middle of a call;
- speaking the protocol itself (fake "ready", fake "ok" replies), shadowing builtins the tests use
  (abs, all, range, len, sorted, isinstance), reading the tests (tests.py, /proc) to return what
  they expect.
Where Result.isolation shows neither a fresh user id (root) nor a PID namespace with its own /proc,
the program could reach our own process: the tests skip, saying so.
"""
import json
import math

import pytest

from posttrain import rewards, sandbox

WRONG = "def add(a, b):\n    return a + b - 1\n"
HONEST = "def add(a, b):\n    return a + b\n"
TESTS = "assert add(2, 3) == 5\nassert add(1, 1) == 2\n"
# every assert here hangs on a builtin: a program whose own abs, all, range, len, sorted reached the
# tests would pass them with the wrong add
BUILTINS_TESTS = ("for i in range(3):\n    assert add(i, i) == 2 * i\n"
                  "assert abs(add(0.5, 0.25) - 0.75) < 1e-9\n"
                  "assert all([add(i, 1) == i + 1 for i in [1, 2]])\n"
                  "assert len([x for x in [add(1, 2)] if x == 3]) == 1\n"
                  "assert sorted([add(2, 2), add(0, 1)]) == [1, 4]\n")

HARVEST = r'''
import ctypes, gc, json, os, re, signal, sys, time
HEX = re.compile(rb"[0-9a-f]{32}")
FOUND = set()

def grab(x, depth=0):
    if isinstance(x, str):
        x = x.encode("utf-8", "replace")
    if isinstance(x, (bytes, bytearray, memoryview)):
        FOUND.update(HEX.findall(bytes(x)))
    elif depth < 3 and isinstance(x, dict):
        for k, v in list(x.items()):
            grab(k, depth + 1), grab(v, depth + 1)
    elif depth < 3 and isinstance(x, (list, tuple, set, frozenset)):
        for v in list(x):
            grab(v, depth + 1)

def pids():
    return [p for p in os.listdir("/proc") if p.isdigit()]

def payload():
    forged = [json.dumps(m).encode() for m in (["ok", 5], ["ok", 2], ["ready", ["add"], []])]
    return b"".join(t + b" pass\n" for t in sorted(FOUND)) + b"pass\n" + b"\n".join(forged) + b"\n"

def spray():
    data = payload()
    for fd in range(256):
        try:
            os.write(fd, data)
        except OSError:
            pass
    for pid in pids():
        try:
            names = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for n in names:
            try:
                fd = os.open(f"/proc/{pid}/fd/{n}", os.O_WRONLY | os.O_NONBLOCK)
                os.write(fd, data)
                os.close(fd)
            except OSError:
                pass

def frames():
    f = sys._getframe()
    while f is not None:
        grab(f.f_locals), grab(f.f_globals), grab(f.f_code.co_consts)
        f = f.f_back

def heap():
    for o in gc.get_objects():
        grab(o, 2)
    for m in list(sys.modules.values()):
        for r in gc.get_referrers(m):
            grab(r, 2)

def environment():
    grab(dict(os.environ))
    for pid in pids():
        for what in ("environ", "cmdline"):
            try:
                grab(open(f"/proc/{pid}/{what}", "rb").read())
            except OSError:
                pass

def regions(pid="self"):
    for line in open(f"/proc/{pid}/maps"):
        span, perms = line.split()[:2]
        if perms[0] == "r":
            lo, hi = (int(x, 16) for x in span.split("-"))
            yield lo, hi

class IOVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]

def read(pid, lo, hi):
    """Memory of a process through process_vm_readv: a fault stops a read, never the reader."""
    libc, out = ctypes.CDLL(None, use_errno=True), []
    for at in range(lo, hi, 1 << 20):
        n = min(1 << 20, hi - at)
        buf = ctypes.create_string_buffer(n)
        local, remote = IOVec(ctypes.cast(buf, ctypes.c_void_p), n), IOVec(at, n)
        got = libc.process_vm_readv(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
        if got > 0:
            out.append(buf.raw[:got])
    return b"".join(out)

def own_memory():
    for lo, hi in regions():
        grab(read(os.getpid(), lo, hi))

def others_memory():
    libc = ctypes.CDLL(None, use_errno=True)
    for pid in pids():
        if int(pid) == os.getpid():
            continue
        if libc.ptrace(16, int(pid), 0, 0) == 0:            # PTRACE_ATTACH
            print("ATTACHED", pid, flush=True)
        try:
            with open(f"/proc/{pid}/mem", "rb"):
                print("OPENED MEM", pid, flush=True)
        except OSError:
            pass
        try:
            for lo, hi in regions(pid):
                data = read(int(pid), lo, hi)
                if data:
                    print("READ MEMORY OF", pid, flush=True)
                grab(data)
        except OSError:
            pass

def everything():
    frames(), heap(), environment(), own_memory(), others_memory()
    spray()
'''

ATTACKS = {
    # the exploit that earned 1.0 before: the harness's frame holds the token and the verdict descriptor
    "frame_walk": HARVEST + WRONG + "frames()\nspray()\nos._exit(0)\n",
    "gc": HARVEST + WRONG + "heap()\nspray()\nos._exit(0)\n",
    "environment": HARVEST + WRONG + "environment()\nspray()\n",
    "own_memory": HARVEST + WRONG + "own_memory()\nspray()\nos._exit(0)\n",
    "others_memory_and_ptrace": HARVEST + WRONG + "others_memory()\nspray()\nos._exit(0)\n",
    "every_fd_then_exit": HARVEST + WRONG + "spray()\nos._exit(0)\n",
    "all_of_it_in_a_call": HARVEST + "def add(a, b):\n    everything()\n    return a + b - 1\n",
    "exit_in_a_call": HARVEST + "def add(a, b):\n    everything()\n    os._exit(0)\n",
    "system_exit_in_a_call": "def add(a, b):\n    raise SystemExit(0)\n",
    "escaping_child": HARVEST + WRONG + (
        "if os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n        for _ in range(40):\n"
        "            everything()\n            time.sleep(0.05)\n    os._exit(0)\n"),
    "signals": HARVEST + (
        "def add(a, b):\n    for pid in pids():\n"
        "        for sig in (signal.SIGINT, signal.SIGUSR1, signal.SIGTERM, signal.SIGPIPE):\n"
        "            if int(pid) != os.getpid():\n                try:\n                    os.kill(int(pid), sig)\n"
        "                except OSError:\n                    pass\n    return a + b - 1\n"),
    # replies that are no answer: a kind the tests' process does not know, a value that is no plain one, ...
    "malformed_replies": HARVEST + (
        "JUNK = [['pass'], ['ok'], {'ok': 5}, ['ok', ['x', 1]], ['ok', ['i', 'zz']], ['ok', ['s', ['l']]],"
        " ['ready', ['add'], [['abs', 0]]], ['raise', 'SystemExit', 'SystemExit', None, '', '', '']]\n"
        "def add(a, b):\n    for fd in range(3, 256):\n        try:\n"
        "            os.write(fd, b''.join(json.dumps(j).encode() + b'\\n' for j in JUNK) + b'not json\\n')\n"
        "        except OSError:\n            pass\n    return a + b - 1\n"),
    # StopIteration out of a call would end a map() early, and with it the tests' loop over it
    "stop_iteration": "def add(a, b):\n    raise StopIteration\n",
    "shadow_builtins": WRONG + ("def abs(x):\n    return 0\ndef all(xs):\n    return True\n"
                                "def range(*a):\n    return []\ndef len(x):\n    return 1\n"
                                "def sorted(x):\n    return [1, 4]\nAssertionError = None\n"),
    "read_the_tests": (
        "import os, re\nseen = open('tests.py').read()\nfor pid in os.listdir('/proc'):\n    try:\n"
        "        seen += open(f'/proc/{pid}/cmdline').read()\n    except OSError:\n        pass\n"
        "answers = iter(int(x) for x in re.findall(r'== (\\d+)', seen))\n"
        "def add(a, b):\n    return next(answers)\n"),
}


def guaranteed(isolation):
    """Where the verdict is out of the program's reach (sandbox.py's docstring): uid:N, or pid + proc."""
    return any(i.startswith("uid:") for i in isolation) or {"pid", "proc"} <= set(isolation)


@pytest.fixture(scope="module")
def isolation():
    r = sandbox.run_code(HONEST, TESTS, timeout=20)
    assert r.passed, r
    if not guaranteed(r.isolation.split()):
        pytest.skip(f"no fresh user id nor PID namespace with its /proc here (isolation: {r.isolation or 'none'})")
    return r.isolation.split()


MAP_TESTS = "for got, want in zip(map(add, [2, 1], [3, 1]), [5, 2]):\n    assert got == want\n"
SUITES = {"shadow_builtins": BUILTINS_TESTS, "stop_iteration": MAP_TESTS}
HONEST_SUITES = [TESTS, BUILTINS_TESTS, MAP_TESTS]       # the honest program passes each


def suite_for(names):
    return [SUITES.get(name, TESTS) for name in names]


def test_attacks_on_the_verdict_fail_through_the_sandbox(isolation):
    results = sandbox.run_many(list(ATTACKS.values()) + [HONEST] * 3, suite_for(ATTACKS) + HONEST_SUITES,
                               workers=4, timeout=30)
    for name, r in zip(ATTACKS, results):
        assert not r.passed and r.reason != "passed", (name, r)
        assert not {"ATTACHED", "OPENED MEM", "READ MEMORY OF"} & set(r.output.split()), (name, r.output[-2000:])
    assert [r.reason for r in results[-3:]] == ["passed"] * 3, results[-3:]
    reasons = dict(zip(ATTACKS, (r.reason for r in results)))
    assert reasons["frame_walk"] == "exited (status 0) before the tests finished: no verdict from the harness"
    assert reasons["shadow_builtins"] == "AssertionError at tests.py:2 (in the tests)"
    assert reasons["system_exit_in_a_call"] == "SystemExit: 0 at candidate.py:2 (in the tests)"
    assert reasons["read_the_tests"].startswith("RuntimeError: add() raised StopIteration at candidate.py:")
    assert reasons["stop_iteration"] == "RuntimeError: add() raised StopIteration at candidate.py:2 (in the tests)"


def test_attacks_on_the_verdict_earn_no_code_reward(isolation):
    completions = [f"```python\n{p}```" for p in list(ATTACKS.values()) + [HONEST] * 3]
    tests = suite_for(ATTACKS) + HONEST_SUITES
    assert rewards.code_reward([None] * len(completions), completions, tests=tests) == [0.0] * len(ATTACKS) + [1.0] * 3


def test_the_program_never_holds_the_token_or_the_tests(isolation):
    """What the program's process can see: its stdio and two pipes; no other process's descriptors; not
    the tests' text (its folder holds a placeholder; its memory, its environment and /proc hold none)."""
    program = HARVEST + (
        "print('fds', sorted(int(n) for n in os.listdir('/proc/self/fd')))\n"
        "blob = b''.join(read(os.getpid(), lo, hi) for lo, hi in regions())\n"
        "blob += open('tests.py', 'rb').read() + repr(os.environ).encode()\n"
        "for pid in pids():\n    for what in ('environ', 'cmdline'):\n        try:\n"
        "            blob += open(f'/proc/{pid}/{what}', 'rb').read()\n        except OSError:\n            pass\n"
        "    try:\n        print('listed', pid, os.listdir(f'/proc/{pid}/fd'))\n    except OSError:\n        pass\n"
        "print('found', ('TERCES'[::-1] + '-EXPECTED-VALUE').encode() in blob, 'in', len(blob))\n"
        "print('folder', sorted(os.listdir('.')))\n"
        "def add(a, b):\n    return a + b\n")
    r = sandbox.run_code(program, "assert add(2, 3) == 5, 'SECRET-EXPECTED-VALUE'\n", timeout=30)
    assert r.passed, r
    lines = r.output.splitlines()
    fds = eval(lines[0].removeprefix("fds "))
    assert fds[:3] == [0, 1, 2] and len(fds) == 6, r.output         # stdio, two pipes, the listing's own
    listed = [line.split()[1] for line in lines if line.startswith("listed")]
    found = next(line for line in lines if line.startswith("found")).split()
    assert found[1] == "False" and int(found[3]) > 1 << 20, r.output      # megabytes searched, the text nowhere
    assert lines[-1] == "folder ['candidate.py', 'tests.py']", r.output
    assert len(listed) == 1, r.output                                      # its own /proc/<pid>/fd only


def exact(a, b):
    """a == b with the same types all the way down (and NaN equal to NaN, -0.0 apart from 0.0)."""
    if type(a) is not type(b):
        return False
    if type(a) is float:
        return math.copysign(1, a) == math.copysign(1, b) and (a == b or a != a and b != b)
    if type(a) in (list, tuple):
        return len(a) == len(b) and all(exact(x, y) for x, y in zip(a, b))
    if type(a) is dict:
        return list(a) == list(b) and all(exact(a[k], b[k]) for k in a)
    return a == b


def test_plain_values_cross_exactly_and_nothing_else_decodes():
    """A value the program returns reaches the tests as an equal one of the same exact types, through
    JSON text; whatever else the program's process writes decodes to plain values or raises."""
    values = [None, True, False, 0, -7, 1 << 53, -(3 ** 9000), 2.5, -0.0, float("inf"), float("nan"), 1e300,
              3 - 4j, "", "é\n\ud800", b"\x00\xff", [], (), set(), frozenset(), {}, [1, (2, [3.0])],
              {(1, "a"): {frozenset({1, 2}): [None]}, 1: b"x", True: "bool key"}, ("tuple",), {1, 2.5, "s", (1,)}]
    for v in values:
        assert exact(sandbox.from_json(json.loads(json.dumps(sandbox.to_json(v)))), v), v
    for bad in [object(), [1, object()], {1: type}, range(3), bytearray(b"x")]:
        with pytest.raises(TypeError):
            sandbox.to_json(bad)
    junk = [{"ok": 1}, ["x", 1], ["i", 5], ["i", "zz"], ["b", "zz"], ["c", "1", 2], ["d", 1], ["s", ["l"]],
            ["d", ["l"], 1], [1, 2], [], ["f", {"a": 1}]]
    for j in junk:
        with pytest.raises((ValueError, TypeError)):
            sandbox.from_json(j)
