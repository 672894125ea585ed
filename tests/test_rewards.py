"""rewards.py and sandbox.py: final-answer extraction and math equality on hand-written cases that must match and
must not (numbers exactly, without math-verify; symbolic ones through math-verify, test-only, with a
pathological expression that must not hang); format, code and combined rewards on worked values;
and the code sandbox: a correct solution passes, and every attack of issue 18's set ends with
reward 0, a reason, and the host intact (checked from here: files, canary, listener, our
environment, our process, no process of the sandbox's user left) — infinite loop, fork bomb,
memory bomb, writing outside the temporary directory, deleting files, reading our environment,
opening a network socket, killing the parent, 100 MB of output, sys.exit(0) / os._exit(0) before
the tests, fake verdicts, monkey-patching the harness; 64 programs run in parallel far faster than
one after another. Attacks that only the OS can stop (network, read-only mounts, another user id
or PID namespace) are skipped, saying so, where Result.isolation shows the OS did not allow it."""
import os
import socket
import tempfile
import time

import pytest

from posttrain import rewards, sandbox

# ----------------------------------------------------------------------------- math

@pytest.mark.parametrize("text, answer", [
    ("so $x = \\boxed{\\frac{1}{2}}$.", "\\frac{1}{2}"),
    ("\\boxed{3} first, then \\boxed{{a}+{b}^{2}} at last", "{a}+{b}^{2}"),
    ("\\boxed 7 is it", "7"),
    ("\\boxed{3}<|im_end|>\\boxed{4}", "3"),
    ("<think>2+2</think><answer> 4 </answer>", "4"),
    ("Natalia sold 48 clips.\n#### 1,234\n", "1,234"),
    ("#### 5\nno wait\n#### 6", "6"),
    ("So the answer is 42.", "42"),
    ("The final answer is: $3.5$. Next question", "3.5"),
    ("**The answer is 12**", "12"),
    ("I think it is 42", None), ("", None), ("\\boxed{unclosed", None),
])
def test_extract_answer(text, answer):
    assert rewards.extract_answer(text) == answer


MATCH = [("72", "72.0"), ("1234", "1,234"), ("1234567", "1,234,567"), ("0.5", "1/2"), ("\\frac{1}{2}", "0.5"),
         ("-\\frac{3}{4}", "-0.75"), ("-3", "\u22123"), ("5", "5 apples"), ("18", "\\$18"), ("18", "$18.00"),
         ("50", "50\\%"), ("90", "90^\\circ"), ("3", "3 \\text{ cm}"), ("1/3", "0.333333"), ("1000", "1e3"),
         ("\\dfrac{\\sqrt{2}}{2}", "\\frac{\\sqrt{2}}{2}"), ("x = 2", "x=2")]
NO_MATCH = [("12", "1.2"), ("1234", "1,234.5"), ("3/4", "4/3"), ("5", "-5"), ("5", "5x"), ("12", "1,2"),
            ("10", "10 million"), ("2", "2 pi"), ("1/3", "0.333"), ("10000000000000000", "10000000000000001"),
            ("2", "2 or 3"), ("7", None), ("7", ""), ("1", "1/0"), ("x^2+2x+1", "(x+1)^2")]


def test_math_equal_exact_fallback():
    """Without math-verify (symbolic=False): numbers exactly, everything else as normalised text."""
    got = rewards.math_equal_many(MATCH + NO_MATCH, symbolic=False)
    assert got == [True] * len(MATCH) + [False] * len(NO_MATCH)
    assert rewards.parse_number("1,234,567.5") == rewards.Fraction(2469135, 2)
    assert rewards.parse_number("1e999999") is None      # no huge numbers built from a short text


def test_math_equal_symbolic_and_time_limited():
    pytest.importorskip("math_verify")
    pairs = [("x^2+2x+1", "(x+1)^2"), ("\\frac{\\sqrt{2}}{2}", "\\frac{1}{\\sqrt{2}}"), ("\\frac{\\pi}{2}", "\\pi/2"),
             ("x+1", "x-1"), ("\\sqrt{2}", "\\sqrt{3}"), ("72", "72"), ("3", "2^{2^{40}}")]
    start = time.monotonic()
    assert rewards.math_equal_many(pairs, timeout=2) == [True, True, True, False, False, True, False]
    assert time.monotonic() - start < 60      # 2^(2^40) is never computed to the end


def test_a_hung_symbolic_check_is_killed_and_the_rest_go_on(tmp_path, monkeypatch):
    """The worker's kill and restart, with a stand-in worker (a shell script) that hangs on one pair
    in a way no signal inside it would stop, as sympy can in C code."""
    fake = tmp_path / "fake-python"
    fake.write_text('#!/bin/sh\necho ready\nwhile read line; do\n  case "$line" in *hang*) exec sleep 60;; '
                    '*) echo 1;; esac\ndone\n')
    fake.chmod(0o755)
    monkeypatch.setattr(rewards.sys, "executable", str(fake))
    start = time.monotonic()
    assert rewards.math_equal_many([("a", "b"), ("c", "hang"), ("d", "e")], timeout=0.5, symbolic=True) == [True, False, True]
    assert time.monotonic() - start < 10


def test_math_format_and_combined_rewards():
    completions = ["<think>half</think><answer>\\boxed{0.5}</answer>", "the answer is 1/2", "#### 3",
                   [{"role": "assistant", "content": "<think></think> <answer>2</answer>"}], "no idea"]
    golds = ["\\frac{1}{2}", "The solution ... \\boxed{\\frac{1}{2}}", "#### 3", None, "5"]
    prompts = [[{"role": "user", "content": "q"}]] * 5
    math = rewards.math_reward(prompts, completions, answer=golds, timeout=5)
    assert math == [1.0, 1.0, 1.0, None, 0.0]
    assert rewards.math_reward(prompts[:1], ["\\boxed{2}"], solution=["2"]) == [1.0]
    fmt = rewards.format_reward(prompts, completions)
    assert fmt == [1.0, 0.0, 0.0, 1.0, 0.0]
    strict = rewards.format_reward_for(("answer",))
    assert strict(None, ["<answer>1</answer>", "<answer>1</answer><answer>2</answer>", "x<answer>1</answer>"]) == [1.0, 0.0, 0.0]
    both = rewards.combine([rewards.math_reward, rewards.format_reward], [1.0, 0.5])
    assert both(prompts, completions, answer=golds) == [1.5, 1.0, 1.0, 0.5, 0.0]
    never = rewards.combine([lambda p, c, **k: [None] * len(c)])
    assert never(prompts[:2], completions[:2]) == [None, None]
    with pytest.raises(ValueError, match="one weight per function"):
        rewards.combine([rewards.math_reward], [1.0, 2.0])


def test_code_reward_and_extract_code():
    assert rewards.extract_code("Sure:\n```python\ndef f():\n    return 1\n```\nand ```python\nx\n```") == "def f():\n    return 1\n"
    assert rewards.extract_code("    return 1\n<|im_end|>junk") == "    return 1\n"
    completions = ["```python\ndef f(x):\n    return 2 * x\n```", "```py\ndef f(x):\n    return x\n```", "def f(x):\n    return 2 * x\n",
                   "    return 2 * x\n"]
    tests = ["assert f(3) == 6\n"] * 3 + [None]
    assert rewards.code_reward([None] * 4, completions, tests=tests) == [1.0, 0.0, 1.0, None]
    prefixed = rewards.code_reward([None], completions[3:], tests=tests[:1], prefix=["def f(x):\n"])
    assert prefixed == [1.0]


# ----------------------------------------------------------------------------- the sandbox

@pytest.fixture(scope="module")
def isolation():
    r = sandbox.run_code("pass", timeout=20)
    assert r.passed, r
    return r.isolation.split()


def need(isolation, *what):
    if not any(i == w or i.startswith(w + ":") for w in what for i in isolation):   # readonly-except:... is not
        pytest.skip(f"the OS did not allow {' or '.join(what)} here (isolation: {' '.join(isolation) or 'none'})")


def leftovers(result, wait=3.0):
    """Processes still running under the sandbox's user id (as root); [] when it ran without one.
    A killed process takes a moment to go on a loaded machine: polled for up to `wait` seconds."""
    uid = next((int(i[4:]) for i in result.isolation.split() if i.startswith("uid:")), None)
    deadline = time.monotonic() + wait
    while uid is not None and sandbox.processes_of(uid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return [] if uid is None else sandbox.processes_of(uid)


def test_correct_solution_passes_in_a_clean_fresh_directory(monkeypatch):
    monkeypatch.setenv("INGOT_TEST_SECRET", "s3cret-value")
    program = ("import os, sys\ndef add(a, b):\n    return a + b\nopen('note.txt', 'w').write('kept')\n"
               "print(sorted(os.environ), os.getcwd(), sys.flags.isolated, sorted(os.listdir('.')))\n")
    r = sandbox.run_code(program, "assert add(2, 3) == 5\nassert open('note.txt').read() == 'kept'\n", timeout=20)
    assert r.passed and r.reason == "passed", r
    names, cwd = eval(r.output.split("] ", 1)[0] + "]"), r.output.split("] ", 1)[1].split()[0]
    assert "INGOT_TEST_SECRET" not in names and set(names) <= {"PATH", "HOME", "TMPDIR", "LANG", "OMP_NUM_THREADS",
                                                               "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "LC_CTYPE"}
    assert cwd.startswith(tempfile.gettempdir()) and not os.path.exists(cwd)      # fresh, and removed after
    assert " 1 ['candidate.py', 'note.txt', 'tests.py']" in r.output
    wrong = sandbox.run_code("def add(a, b):\n    return a - b\n", "assert add(2, 3) == 5\n", timeout=20)
    assert not wrong.passed and wrong.reason == "AssertionError at tests.py:1 (in the tests)"
    with pytest.raises(ValueError, match="timeout > 0"):
        sandbox.run_code("pass", timeout=0)


def test_infinite_loops_are_killed_on_the_wall_clock():
    start = time.monotonic()
    results = sandbox.run_many(["while True:\n    pass\n", "import time\ntime.sleep(1000)\n"], "", workers=2, timeout=1)
    assert time.monotonic() - start < 10  # killed at 1 s, not after 1000 (sandbox start-up is slow on a loaded machine)
    for r in results:
        assert not r.passed and r.reason == "timed out after 1 s (wall clock): killed" and leftovers(r) == []


def test_fork_bomb_is_contained(isolation):
    """RLIMIT_NPROC does not apply to root: as root the program runs under a fresh user id, where it
    does (need: uid); without root it counts all our processes and is set just above today's count."""
    need(isolation, "uid", "pid")
    r = sandbox.run_code("import os\nwhile True:\n    os.fork()\n", timeout=5, nproc=8)
    assert not r.passed and r.reason.startswith("BlockingIOError: [Errno 11]") and "candidate.py:3" in r.reason
    # one that swallows the error and keeps forking: stopped by the clock, every copy killed
    r = sandbox.run_code("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n",
                         timeout=1, nproc=8)
    assert not r.passed and r.reason.startswith("timed out")
    time.sleep(0.1)
    assert leftovers(r) == []


def test_memory_bomb_hits_the_address_space_limit():
    start = time.monotonic()
    programs = ["x = bytearray(64 << 30)\n", "a = []\nwhile True:\n    a.append(bytearray(1 << 20))\n"]
    for r in sandbox.run_many(programs, "", workers=2, timeout=20, memory_mb=256):
        assert not r.passed and r.reason.startswith("MemoryError"), r
    assert time.monotonic() - start < 10


@pytest.fixture
def shared_dir():
    """A world-writable directory outside the sandbox with a world-writable canary: only the
    read-only mounts stand between the program and them."""
    d = tempfile.mkdtemp(prefix="ingot-outside-")
    os.chmod(d, 0o777)
    canary = os.path.join(d, "canary")
    with open(canary, "w") as f:
        f.write("alive")
    os.chmod(canary, 0o666)
    yield d, canary
    for name in os.listdir(d):
        os.remove(os.path.join(d, name))
    os.rmdir(d)


def test_writing_outside_the_temporary_directory_fails(isolation, shared_dir):
    need(isolation, "readonly")
    d, _ = shared_dir
    evil = os.path.join(d, "evil.txt")
    top = os.path.join(tempfile.gettempdir(), f"ingot-evil-{os.getpid()}")
    r = sandbox.run_code(f"open({evil!r}, 'w').write('x')\n", timeout=20)
    assert not r.passed and r.reason.startswith("OSError: [Errno 30] Read-only file system"), r
    r = sandbox.run_code(f"open({top!r}, 'w').write('x')\n", timeout=20)
    assert not r.passed and "Read-only file system" in r.reason
    assert not os.path.exists(evil) and not os.path.exists(top)


def test_deleting_files_fails(isolation, shared_dir):
    need(isolation, "readonly")
    d, canary = shared_dir
    r = sandbox.run_code(f"import os, shutil\nos.remove({canary!r})\n", timeout=20)
    assert not r.passed and "Read-only file system" in r.reason
    r = sandbox.run_code(f"import shutil\nshutil.rmtree({d!r})\n", timeout=20)
    assert not r.passed and "Read-only file system" in r.reason
    with open(canary) as f:
        assert f.read() == "alive"


def test_our_environment_cannot_be_read(monkeypatch):
    secret = f"s3cret-{os.getpid()}"
    monkeypatch.setenv("INGOT_TEST_SECRET", secret)
    program = (f"import os\nfound = [v for v in os.environ.values() if {secret!r} in v]\n"
               f"for pid in ['self', str(os.getppid()), '{os.getpid()}', '1'] + os.listdir('/proc'):\n"
               "    try:\n        found += [pid] if b's3cret' in open(f'/proc/{pid}/environ', 'rb').read() else []\n"
               "    except OSError as e:\n        print(pid, e.__class__.__name__)\n"
               "assert found, 'no secret found'\n")
    r = sandbox.run_code(program, timeout=20)
    assert not r.passed and r.reason == "AssertionError: no secret found at candidate.py:8 (in the program)"
    assert secret not in r.output


def test_network_is_unreachable(isolation):
    need(isolation, "net")
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)
    port = listener.getsockname()[1]
    try:
        r = sandbox.run_code(f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=3)\n"
                             "s.sendall(b'leak')\n", timeout=20)
        assert not r.passed and r.reason.startswith("OSError: [Errno 101] Network is unreachable"), r
        listener.settimeout(0.2)
        with pytest.raises(socket.timeout):
            listener.accept()
    finally:
        listener.close()


def test_killing_the_parent_fails(isolation):
    need(isolation, "pid", "uid")
    parent = os.getppid()  # pytest's parent, read before: it may be init already (a detached run)
    program = (f"import os, signal\nfor pid in (os.getppid(), {os.getpid()}, {parent}):\n"
               "    try:\n        os.kill(pid, signal.SIGKILL)\n    except OSError as e:\n        print(pid, e, flush=True)\n"
               "    else:\n        print(pid, 'signalled', flush=True)\n"
               "os.killpg(0, signal.SIGKILL)\n")
    r = sandbox.run_code(program, "assert False\n", timeout=20)
    assert not r.passed and r.reason.startswith("killed (SIGKILL)")      # it could only kill itself
    assert f"{os.getpid()} signalled" not in r.output and f"{parent} signalled" not in r.output
    assert r.output.count("\n") == 3 and os.getppid() == parent          # it tried all three; we are alive


def test_output_is_capped():
    start = time.monotonic()
    r = sandbox.run_code("import sys\nsys.stdout.write('x' * (100 << 20))\n", timeout=20, output_bytes=1 << 16)
    assert not r.passed and r.reason == "more than 65536 bytes of output: killed"
    assert r.output == "x" * (1 << 16) and time.monotonic() - start < 10


def test_exiting_early_or_faking_a_verdict_does_not_pass():
    tests = "assert False, 'the tests ran'\n"
    fakes = {
        "import sys\nsys.exit(0)\n": "SystemExit: 0 at candidate.py:2 (in the program)",
        "raise SystemExit\n": "SystemExit at candidate.py:1 (in the program)",
        "import os\nos._exit(0)\n": "exited (status 0) before the tests finished: no verdict from the harness",
        ("import os\nfor fd in range(3, 64):\n    try:\n        os.write(fd, b'pass\\npassed\\nok\\n')\n"
         "    except OSError:\n        pass\nprint('passed')\nos._exit(0)\n"):
            "exited (status 0) before the tests finished: no verdict from the harness",
    }
    results = sandbox.run_many(list(fakes), tests, timeout=20)
    assert [r.reason for r in results] == list(fakes.values())
    # the tests' own sys.exit(0) does not pass either
    r = sandbox.run_code("def f():\n    return 1\n", "import sys\nsys.exit(0)\nassert f() == 2\n", timeout=20)
    assert not r.passed and r.reason == "SystemExit: 0 at tests.py:2 (in the tests)"


def test_monkey_patching_the_harness_does_not_pass():
    program = """
import builtins, os, sys
def add(a, b):
    return 0
real_write = os.write
os.write = lambda fd, data: real_write(fd, data.replace(b" fail ", b" pass\\n"))   # rewrite the verdict
os._exit = lambda code=0: real_write(1, b"no exit\\n")
builtins.exec = lambda *args, **kw: None                      # skip running the tests
builtins.compile = lambda *args, **kw: None
def skip_asserts(frame, event, arg):                           # jump over every line of the tests
    if frame.f_code.co_filename == "tests.py" and event == "line":
        frame.f_lineno = frame.f_lineno + 1
    return skip_asserts
sys.settrace(skip_asserts)
harness = sys.modules.get("rewards")
if harness:
    harness.describe = lambda e, stage: "pass"
    harness.flush = lambda streams: real_write(1, b"patched\\n")
"""
    r = sandbox.run_code(program, "assert add(2, 3) == 5\n", timeout=20)
    assert not r.passed and r.reason == "AssertionError at tests.py:1 (in the tests)", r


def test_many_programs_run_in_parallel():
    programs = [f"import time\ntime.sleep(0.5)\ndef f():\n    return {i}\n" for i in range(64)]
    tests = [f"assert f() == {i}\n" for i in range(64)]
    start = time.monotonic()
    one = sandbox.run_code(programs[0], tests[0], timeout=30)
    single = time.monotonic() - start
    start = time.monotonic()
    results = sandbox.run_many(programs, tests, workers=64, timeout=60)
    wall = time.monotonic() - start
    assert one.passed and all(r.passed for r in results), [r.reason for r in results if not r.passed]
    assert wall < 64 * single / 4, (wall, single)
    wrong = sandbox.run_many(programs[:2], tests[1:3], workers=2, timeout=30)
    assert [r.passed for r in wrong] == [False, False]
    with pytest.raises(ValueError, match="2 programs but 1 tests"):
        sandbox.run_many(programs[:2], tests[:1])
