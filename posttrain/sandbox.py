"""The code sandbox: a candidate program and its tests, isolated (rewards.py's code_reward, eval.py's
HumanEval pass@k, tasks.py's generated code tasks).

    r = sandbox.run_code(program, tests, timeout=10.0)  # Result(passed, reason, output, seconds, isolation)
    rs = sandbox.run_many(programs, tests)              # in parallel on a thread pool, a sandbox each

Why a file of its own: running hostile code safely is one concept: the parent (run_code, run_many:
limits, the wall-clock kill, the verdict) and the child it starts (sandbox_main: namespaces, a reaper,
then the tests' process, run_tests, and the program's, run_program). The child imports only this file.
Step by step: run_code, isolate (the Linux namespaces and what each gives), run_tests, run_program.

Invariants: a run passes only when the program ran without an exception and then its tests did,
told by a per-run random token that only the tests' process holds. The program's process never
holds the token, the tests (its tests.py is a placeholder) or any descriptor of ours but two pipes
to the tests' process, and none that does can be traced or read by it (not dumpable, or root): the
tests call the program's functions through those pipes and get plain values back (a forged __eq__
fails) or the exception raised; a builtin the program redefines never reaches them. So nothing the
program does in its process (frames, gc, memory, descriptors, ctypes, fork, signals) forges a pass,
where Result.isolation shows uid:N (as root) or pid and proc; elsewhere (no PID namespace and no
root, macOS) it can reach our own process. Where the namespaces apply the host stays safe from any
program; without them only rlimits, the session kill and the clean environment remain: not a sandbox
for hostile code. What the tests assert is all that is checked.
"""
import builtins
import collections
import contextlib
import ctypes
import json
import linecache
import math
import os
import re
import resource
import selectors
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from concurrent.futures import ThreadPoolExecutor

# reason: "passed" or why not (the exception, the limit hit, ...); output: stdout+stderr (at most
# output_bytes); isolation: what the OS allowed. A named tuple: the sandbox process imports this module, fast.
Result = collections.namedtuple("Result", "passed reason output seconds isolation", defaults=("", 0.0, ""))


CLONE_NEWNS, CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x20000, 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND = 1, 2, 4, 8, 32, 4096
MS_REC, MS_PRIVATE, MS_RELATIME = 16384, 1 << 18, 1 << 21
KEPT_MOUNT_FLAGS = MS_NOSUID | MS_NODEV | MS_NOEXEC | 1024 | 2048    # + noatime, nodiratime (statvfs bits)
TESTS_ELSEWHERE = "# the tests run in a process of their own: the program never sees them\n"
SIGNALS = {signal.SIGXCPU: "CPU time limit", signal.SIGKILL: "killed", signal.SIGSEGV: "segmentation fault",
           signal.SIGXFSZ: "file size limit", signal.SIGABRT: "aborted"}


HERE = os.path.dirname(os.path.abspath(__file__))  # the child imports this file from here
def clean_env(work):
    """The child's whole environment: nothing inherited from ours."""
    return {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": work, "TMPDIR": work, "LANG": "C.UTF-8",
            "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def processes_of(uid):
    """Host pids of live processes (zombies are dead) whose real user id is uid (from /proc)."""
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc") if os.path.isdir("/proc") else []):
        with contextlib.suppress(OSError, KeyError, IndexError, ValueError), open(f"/proc/{pid}/status") as f:
            status = dict(line.split(":", 1) for line in f if ":" in line)
            if int(status["Uid"].split()[0]) == uid and not status["State"].split()[0] == "Z":
                pids.append(int(pid))
    return pids


def kill_all(proc, uid):
    """SIGKILL the sandbox's session, then (as root) every process left with its user id."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    for _ in range(100 if uid >= 0 else 0):  # up to ~1 s: a loaded machine tears processes down slowly
        pids = processes_of(uid)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        if not pids:
            break
        time.sleep(0.01)


def run_code(program, tests="", *, timeout=10.0, memory_mb=512, nproc=8, nofile=64, file_mb=16,
             output_bytes=1 << 16):
    """Run program, then tests (a script that sees the program's names: HumanEval's check(f) style), in a
    fresh `python -I -S` process tree set up by itself (sandbox_main; no preexec_fn, so run_many's threads
    may start runs): a temporary cwd, a clean environment, stdin closed, rlimits (timeout: wall-clock
    seconds, the CPU limit ceil(timeout) + 1; memory_mb per process; nproc; nofile; file_mb), no core
    files, output_bytes of stdout+stderr kept (more is killed), its own session killed whole at the
    timeout, Linux namespaces where the OS allows (isolate). Returns Result(passed, reason, output, ...)."""
    if timeout <= 0 or memory_mb <= 0 or nproc < 1 or nofile < 8 or output_bytes < 1:
        raise ValueError("run_code needs timeout > 0, memory_mb > 0, nproc >= 1, nofile >= 8, output_bytes >= 1")
    token = os.urandom(16).hex()
    uid = (1 << 20) + int.from_bytes(os.urandom(4), "little") % (1 << 30) if os.geteuid() == 0 else -1
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="ingot-sandbox-", ignore_cleanup_errors=True) as work, \
            tempfile.TemporaryFile() as secret:             # unlinked: the token and the tests, for the tests' process
        for name, text in (("candidate.py", program), ("tests.py", TESTS_ELSEWHERE)):
            with open(os.path.join(work, name), "w") as f:
                f.write(text)
        secret.write(f"{token}\n{tests}".encode())
        secret.flush()
        ver_r, ver_w = os.pipe()
        settings = {"dir": work, "uid": uid, "cpu": math.ceil(timeout) + 1, "memory": memory_mb << 20, "nproc": nproc,
                    "nofile": nofile, "fsize": file_mb << 20, "secret_fd": secret.fileno(), "verdict_fd": ver_w,
                    "site": [p for p in sys.path if os.path.basename(p) in ("site-packages", "dist-packages")]}
        child = f"import sys; sys.path.insert(0, {HERE!r}); import sandbox; sandbox.sandbox_main()"
        try:
            proc = subprocess.Popen([sys.executable, "-I", "-S", "-B", "-c", child, json.dumps(settings)], cwd=work,
                                    env=clean_env(work), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, pass_fds=(secret.fileno(), ver_w), start_new_session=True)
        finally:
            os.close(ver_w)
        out, verdict, limit = b"", b"", ""
        try:
            out, verdict, limit = collect(proc, ver_r, start + timeout, output_bytes)
        finally:   # a PID namespace dies with its first process; without one, look for any left (as root)
            kill_all(proc, -1 if "pid" in isolation_of(token, verdict).split() else uid)
            proc.wait()
            proc.stdout.close()
            os.close(ver_r)
    seconds = time.monotonic() - start
    return judge(token, proc.returncode, out, verdict, limit, timeout, output_bytes, seconds)


def collect(proc, ver_r, deadline, output_bytes):
    """Read the child's output (at most output_bytes) and verdict pipe until both close, the
    deadline passes or the output runs over. Returns (output, verdict, limit hit or "")."""
    out, verdict, limit = bytearray(), bytearray(), ""
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ, "out")
    sel.register(ver_r, selectors.EVENT_READ, "verdict")
    exited = False
    with sel:
        while sel.get_map():
            left = deadline - time.monotonic()
            if left <= 0:
                limit = "" if exited else "timeout"
                break
            for key, _ in sel.select(min(left, 0.2)):
                data = os.read(key.fd, 1 << 16)
                if not data:
                    sel.unregister(key.fileobj)
                elif key.data == "verdict":
                    verdict += data[:4096 - len(verdict)]
                else:
                    out += data
                    if len(out) > output_bytes:
                        return bytes(out[:output_bytes]), bytes(verdict), "output"
            if not exited and proc.poll() is not None:
                exited = True                        # what it left behind goes now; a second to drain
                kill_all(proc, -1)
                deadline = min(deadline, time.monotonic() + 1.0)
    return bytes(out), bytes(verdict), limit


def harness_lines(token, verdict):
    """The verdict pipe's lines that only the harness (which holds the token) can have written."""
    return [line[len(token) + 1:] for line in verdict.decode("utf-8", "replace").splitlines() if line.startswith(token)]


def isolation_of(token, verdict):
    return " ".join(line[len("isolation "):] for line in harness_lines(token, verdict) if line.startswith("isolation "))


def judge(token, returncode, out, verdict, limit, timeout, output_bytes, seconds):
    isolation = isolation_of(token, verdict)
    said = [line for line in harness_lines(token, verdict) if line == "pass" or line.startswith("fail ")]
    text = out.decode("utf-8", "replace")
    if limit == "output":
        reason = f"more than {output_bytes} bytes of output: killed"
    elif limit == "timeout":
        reason = f"timed out after {timeout:g} s (wall clock): killed"
    elif said:
        reason = "passed" if said[0] == "pass" else said[0].removeprefix("fail ") or "failed"
    elif returncode and returncode - 128 in signal.valid_signals():
        sig = signal.Signals(returncode - 128)
        reason = f"{SIGNALS.get(sig, 'killed by a signal')} ({sig.name})"
    else:
        reason = f"exited (status {returncode}) before the tests finished: no verdict from the harness"
    return Result(not limit and said[:1] == ["pass"], reason, text, seconds, isolation)


def run_many(programs, tests, *, workers=None, **limits):
    """run_code over many programs at once on a thread pool (each run is its own process); tests:
    one string for all programs or one per program. workers: parallel runs (default: CPU count)."""
    programs = list(programs)
    tests = [tests] * len(programs) if isinstance(tests, str) else list(tests)
    if len(tests) != len(programs):
        raise ValueError(f"run_many: {len(programs)} programs but {len(tests)} tests")
    with ThreadPoolExecutor(max_workers=max(1, min(len(programs), workers or os.cpu_count() or 1))) as pool:
        return list(pool.map(lambda pt: run_code(pt[0], pt[1], **limits), zip(programs, tests)))


# ----------------------------------------------------------------------------- the child side

def libc_call(libc, name, *args):
    """A libc call through ctypes; raises OSError with errno when it fails."""
    if getattr(libc, name)(*args) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{name}: {os.strerror(err)}")


def mount(libc, source, target, fstype, flags, data=None):
    enc = (lambda s: None if s is None else s.encode())
    libc_call(libc, "mount", enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data))


def expose(libc, needed):
    """As root in a private mount namespace: a directory that other users may not enter (/root)
    and that holds a needed path (the Python installation) is covered with an empty tmpfs, and only
    the needed paths are bound back into it: the sandbox's user reaches Python, nothing else there."""
    needed = sorted({os.path.realpath(p) for p in needed if os.path.exists(p)})
    needed = [p for p in needed if not any(p.startswith(q + "/") for q in needed)]
    hidden = {}
    for p in needed:
        parts = p.strip("/").split("/")
        for i in range(1, len(parts)):
            a = "/" + "/".join(parts[:i])
            if not os.stat(a).st_mode & 0o001:
                hidden.setdefault(a, []).append(p)
                break
    for a in sorted(hidden, key=len):
        if any(a.startswith(b + "/") for b in hidden if b != a):
            continue
        inside = [p for b in hidden if b == a or b.startswith(a + "/") for p in hidden[b]]
        fds = [os.open(p, os.O_PATH) for p in inside]
        mount(libc, "tmpfs", a, "tmpfs", MS_NOSUID | MS_NODEV, "mode=755,size=1m")
        for p, fd in zip(inside, fds):
            if os.path.isdir(f"/proc/self/fd/{fd}"):
                os.makedirs(p, 0o755, exist_ok=True)
            else:
                os.makedirs(os.path.dirname(p), 0o755, exist_ok=True)
                open(p, "w").close()
            mount(libc, f"/proc/self/fd/{fd}", p, None, MS_BIND | MS_REC)
            os.close(fd)


def read_only_except(libc, work, root):
    """In the new mount namespace: mounts private, the Python installation reachable (as root),
    work bound onto itself, every other mount remounted read-only (its nosuid/nodev/... kept).
    Returns the mount points that could not be made read-only ("/" when the namespace failed)."""
    try:
        mount(libc, None, "/", None, MS_REC | MS_PRIVATE)
        if root:
            expose(libc, [p for p in sys.path if p and p != HERE] + [work])
        mount(libc, work, work, None, MS_BIND | MS_REC)
    except OSError:
        return ["/"]
    failed = []
    with open("/proc/self/mounts") as f:     # mount points, with spaces etc. written as octal escapes
        points = [re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), line.split()[1]) for line in f]
    for mp in points:
        if mp == work or mp.startswith(work + "/"):
            continue
        try:
            f = os.statvfs(mp).f_flag
            flags = (f & KEPT_MOUNT_FLAGS) | (MS_RELATIME if f & 4096 else 0)
            mount(libc, None, mp, None, MS_REMOUNT | MS_BIND | MS_RDONLY | flags)
        except OSError:
            failed.append(mp)
    return failed


def isolate(libc, settings):
    """New namespaces as far as the OS allows; returns the list of what applied (Result.isolation):
      net       a new network namespace: no interface is up, no socket reaches anything;
      pid       a new PID namespace: the program sees and can signal only its own processes,
                which all die with the sandbox (a fork bomb cannot outlive it);
      readonly  every mount read-only except the temporary directory (private mount namespace);
      proc      a fresh /proc showing only the sandbox's processes (mounted by sandbox_main);
      uid:N     (as root) a fresh random user id N: RLIMIT_NPROC counts only its processes (it
                does not apply to root), it cannot signal or read ours (/proc/<pid>/environ),
                and a directory only root may enter (/root) shows it only the Python install.
    Without root, a user namespace gives net/pid/readonly/proc where unprivileged ones are allowed
    (capabilities dropped before the program); RLIMIT_NPROC then counts all our processes (set above
    today's count). With none (macOS, locked-down kernels) only rlimits, the session kill and the
    clean environment remain: not a sandbox for hostile code."""
    root, uid, gid, applied = os.geteuid() == 0, os.getuid(), os.getgid(), []
    for flags, names in ((CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID, ["net", "pid"]), (CLONE_NEWNET, ["net"])):
        if hasattr(libc, "unshare") and libc.unshare(flags | (0 if root else CLONE_NEWUSER)) == 0:
            applied = names
            break
    if applied and not root:  # we are ourselves inside: map our ids, so files keep their owners
        for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
            with open(f"/proc/self/{name}", "w") as f:
                f.write(text)
    if "pid" in applied:
        writable = read_only_except(libc, settings["dir"], root)
        applied.append("readonly" if not writable else f"readonly-except:{','.join(writable)}")
    if root:
        os.chown(settings["dir"], settings["uid"], settings["uid"])
        applied.insert(0, f"uid:{settings['uid']}")
    return applied


def sandbox_main():
    """The sandbox process (run by run_code as `python -I -c`): namespaces, then a reaper (PID 1 of
    the new PID namespace: when it exits every process of the sandbox dies) that forks the tests'
    process (run_tests), and once that one is confined, the program's (run_program).
    No process here reads the token or the tests before the program's process is forked from it."""
    s = json.loads(sys.argv[1])
    os.umask(0o022)                                           # directories made for the sandbox's user
    sys.path += [p for p in s["site"] if p not in sys.path]   # -S skipped site's .pth files (fast start)
    libc = ctypes.CDLL(None, use_errno=True)
    with open(os.path.join(s["dir"], "candidate.py")) as f:
        program = f.read()
    nproc = 1 + (s["nproc"] if os.geteuid() == 0 else len(processes_of(os.getuid())) + s["nproc"])   # 1: the tests'
    try:
        applied = isolate(libc, s)
    except OSError as e:
        os.write(s["verdict_fd"], f"{secrets(s)[0]} fail sandbox setup failed: {e}\n".encode())
        os._exit(2)
    set_dumpable(libc, False)    # from here on: no ptrace, /proc/<pid>/fd or mem of ours for the program
    reaper = os.fork()
    if reaper == 0:
        if "pid" in applied:
            libc_call(libc, "prctl", 1, signal.SIGKILL, 0, 0, 0)    # PR_SET_PDEATHSIG: we die with our parent,
            os.setsid()                           # out of its group: the program's killpg(0) cannot reach it
            with contextlib.suppress(OSError):
                mount(libc, "proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
                applied.append("proc")
        (call_r, call_w), (reply_r, reply_w), (ready_r, ready_w) = os.pipe(), os.pipe(), os.pipe()
        in_user_namespace = bool(applied) and os.geteuid() != 0
        tests = forked(run_tests, libc, s, nproc, applied, in_user_namespace, ready_w, call_w, reply_r)
        os.close(ready_w)
        program_pid = None
        if os.read(ready_r, 1):                   # the tests' process is confined: no window to attach to it
            program_pid = forked(run_program, libc, s, nproc, program, in_user_namespace, call_r, reply_w)
        for fd in (ready_r, call_r, call_w, reply_r, reply_w):
            os.close(fd)
        reap(tests, program_pid)
    os._exit(exit_code(os.waitpid(reaper, 0)[1]))


GONE = 3   # the tests' process's exit status when the program's process ended or broke the protocol


def forked(main, *args):
    pid = os.fork()
    if pid == 0:
        try:
            main(*args)
        finally:
            os._exit(1)                          # never back into the reaper's code
    return pid


def reap(tests, program):
    """The reaper: wait for the tests' process and exit with its status, or (GONE) with the program's."""
    done = {}
    while tests not in done or (exit_code(done[tests]) == GONE and program is not None and program not in done):
        pid, status = os.wait()                  # also reaps orphans (PID 1)
        if pid in (tests, program):
            done[pid] = status
    code = exit_code(done[tests])
    os._exit(exit_code(done[program]) if code == GONE and program is not None else code)


def exit_code(status):
    code = os.waitstatus_to_exitcode(status)
    return 128 - code if code < 0 else code


def keep_only(fds):
    """Close every descriptor but fds."""
    keep = sorted(fds)
    for low, high in zip([-1] + keep, keep + [1 << 20]):
        if high - low > 1:
            os.closerange(low + 1, high)


def secrets(s):
    """The token and the tests, from the unlinked file run_code handed over (never a pipe, path, argv or env)."""
    fd = s["secret_fd"]
    token, _, tests = os.pread(fd, os.fstat(fd).st_size, 0).decode().partition("\n")
    return token, tests


def set_dumpable(libc, on):
    """prctl(PR_SET_DUMPABLE): a process that is not dumpable cannot be traced, nor its /proc/<pid>/mem,
    fd/ or environ opened, by a process without CAP_SYS_PTRACE (Linux; elsewhere nothing)."""
    if hasattr(libc, "prctl"):
        libc_call(libc, "prctl", 4, int(on), 0, 0, 0)


def drop_capabilities(libc):
    """Without root, inside our user namespace: no capabilities left (so no remounting), none gained."""
    libc_call(libc, "prctl", 38, 1, 0, 0, 0)                      # PR_SET_NO_NEW_PRIVS
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)                  # _LINUX_CAPABILITY_VERSION_3, this process
    libc_call(libc, "capset", header, (ctypes.c_uint32 * 6)())       # effective, permitted, inheritable: none


def confine(libc, s, nproc, in_user_namespace):
    """Limits, then the sandbox's user id (as root) or no capabilities (in our user namespace), then
    the temporary directory as cwd. Returns the limits the OS refused; raises OSError."""
    refused = set_limits({"CPU": s["cpu"], "CORE": 0, "AS": s["memory"], "FSIZE": s["fsize"], "NPROC": nproc,
                          "NOFILE": s["nofile"]})
    if s["uid"] >= 0:
        os.setgroups([])
        os.setgid(s["uid"])
        os.setuid(s["uid"])
    elif in_user_namespace:
        drop_capabilities(libc)
    os.chdir(s["dir"])
    return refused


def run_tests(libc, s, nproc, applied, in_user_namespace, ready_w, call_w, reply_r):
    """The tests' process: the one that holds the token and the tests (read before the program's process
    exists; never dumpable) and writes the verdict. The tests call stand-ins for the program's functions
    (program_names): plain data to the program's process and back. A reply that is none, or the program's
    process gone, ends this one with status GONE and no verdict (the reaper reports the program's status)."""
    keep_only({0, 1, 2, s["verdict_fd"], s["secret_fd"], ready_w, call_w, reply_r})
    signal.signal(signal.SIGINT, signal.SIG_DFL)    # a signal from the program is never an exception here
    token, tests = secrets(s)
    os.close(s["secret_fd"])
    vfd = s["verdict_fd"]
    os.write(vfd, f"{token} isolation {' '.join(applied)}\n".encode())
    try:
        refused = confine(libc, s, nproc, in_user_namespace)
        set_dumpable(libc, False)                    # setuid() reset it
    except OSError as e:
        os.write(vfd, f"{token} fail sandbox setup failed: {e}\n".encode())
        os._exit(2)
    os.write(ready_w, b".")                          # now the program's process may be forked
    os.close(ready_w)
    if refused:
        os.write(vfd, f"{token} isolation no-limit:{','.join(refused)}\n".encode())
    calls, replies = os.fdopen(call_w, "wb"), os.fdopen(reply_r, "rb")
    streams = (sys.stdout, sys.stderr)

    def receive():                                   # a JSON list, or (EOF, garbage, a flood) no verdict
        try:
            message = json.loads(replies.readline(s["memory"] // 4))
            if type(message) is list and message:
                return message
        except BaseException:
            pass
        os._exit(GONE)

    def ask(name, args, kwargs):
        try:
            request = json.dumps(["call", name, to_json(list(args)), to_json(kwargs)]).encode() + b"\n"
        except (TypeError, ValueError, RecursionError) as e:
            raise TypeError(f"the tests pass {name}() something that is not a plain value ({e})") from None
        flush(streams)
        try:
            calls.write(request)
            calls.flush()
            kind, *reply = receive()
            if kind == "ok" and len(reply) == 1:
                return from_json(reply[0])
            error = program_error(name, *reply)
        except BaseException:
            os._exit(GONE)
        raise error

    kind, *ready = receive()
    if kind == "fail" and len(ready) == 1 and type(ready[0]) is str:
        os.write(vfd, f"{token} fail {' '.join(ready[0].split())[:1000] or 'failed'}\n".encode())
        os._exit(1)
    try:
        namespace = program_names(*ready, ask) if kind == "ready" else {}[kind]
    except BaseException:
        os._exit(GONE)
    linecache.cache["tests.py"] = (len(tests), None, tests.splitlines(True), "tests.py")   # tracebacks show them
    try:
        exec(compile(tests, "tests.py", "exec"), namespace)
    except BaseException as e:  # SystemExit too: exiting before the tests finish is not passing
        try:
            why = describe(e, "the tests")
            flush(streams)
            traceback.print_exception(type(e), e, e.__traceback__.tb_next)
            if getattr(e, "in_program", None):
                print("in the program's process:\n" + e.in_program[1], end="", file=sys.stderr)
        except BaseException:
            why = "an exception in the tests"
        flush(streams)
        os.write(vfd, f"{token} fail {why}\n".encode("utf-8", "replace"))
        os._exit(1)
    flush(streams)
    os.write(vfd, f"{token} pass\n".encode())
    os._exit(0)


def program_names(callables, values, ask):
    """The tests' namespace from the program's "ready" reply: a stand-in for each callable, a copy of
    each plain value; no name of a builtin or a dunder. Raises on anything malformed."""
    namespace = {"__name__": "__main__", "__file__": "tests.py", "__builtins__": builtins}
    kept = (lambda name: type(name) is str and not name.startswith("__") and name not in builtins.__dict__)
    for name in filter(kept, callables):
        namespace[name] = stand_in(name, ask)
    for name, value in values:
        if kept(name):
            namespace[name] = from_json(value)
    return namespace


def stand_in(name, ask):
    def call(*args, **kwargs):
        return ask(name, args, kwargs)
    call.__name__ = call.__qualname__ = name
    return call


def program_error(function, base, name, args, text, where, trace):
    """A call's exception in the program's process, rebuilt: its nearest builtin class (subclassed under the
    program's name when its own), its args when plain; in_program = (where, its traceback) for describe()."""
    cls = getattr(builtins, base, None) if type(base) is str else None
    cls = cls if isinstance(cls, type) and issubclass(cls, BaseException) else Exception
    text = text if type(text) is str else ""
    if issubclass(cls, (StopIteration, StopAsyncIteration)):   # it would end a map() over the calls early
        cls, args, text = RuntimeError, None, f"{function}() raised {cls.__name__}"
    elif type(name) is str and name != cls.__name__:
        with contextlib.suppress(Exception):
            cls = type(name, (cls,), {"__module__": "candidate"})
    try:
        error = cls(*from_json(args)) if args is not None else cls(text)
    except Exception:
        error = Exception(text)
    error.in_program = (where if type(where) is str else "", trace if type(trace) is str else "")
    return error


def run_program(libc, s, nproc, program, in_user_namespace, call_r, reply_w):
    """The program's process: nothing here can produce a pass (no token, no tests, no descriptor of ours but
    two pipes to the tests' process). It runs the program, says "ready" with its names (or "fail" and why),
    then answers calls: each result checked (plain_value) and sent (to_json), or the exception described."""
    keep_only({0, 1, 2, call_r, reply_w})                   # first: the verdict pipe, the secrets closed
    set_dumpable(libc, True)                                # as before: a program may read its own /proc/self
    calls, replies = os.fdopen(call_r, "rb"), os.fdopen(reply_w, "wb")
    leave, getpid, dumps, loads, me = os._exit, os.getpid, json.dumps, json.loads, os.getpid()
    settrace, setprofile, streams = sys.settrace, sys.setprofile, (sys.stdout, sys.stderr)
    saved_builtins = dict(builtins.__dict__)

    def send(message):
        flush(streams)
        replies.write(dumps(message).encode() + b"\n")
        replies.flush()

    def restore():  # what the program may have patched: trace hooks, builtins
        settrace(None)
        setprofile(None)
        builtins.__dict__.clear()
        builtins.__dict__.update(saved_builtins)
    try:
        confine(libc, s, nproc, in_user_namespace)
    except OSError as e:
        send(["fail", f"sandbox setup failed: {e}"])
        leave(2)
    sys.argv, sys.path[0] = ["candidate.py"], s["dir"]
    namespace = {"__name__": "__main__", "__file__": "candidate.py", "__builtins__": builtins}
    try:
        exec(compile(program, "candidate.py", "exec"), namespace)
    except BaseException as e:  # SystemExit too: exiting before the tests is not passing
        if getpid() == me:
            try:
                why = describe(e, "the program")
                flush(streams)
                traceback.print_exception(type(e), e, e.__traceback__.tb_next)   # from the program's frame on
            except BaseException:
                why = "an exception in the program"
            send(["fail", why])
        leave(1)
    if getpid() != me:                                   # a copy the program forked: it never answers
        leave(0)
    restore()
    values = []
    for name, v in namespace.items():
        with contextlib.suppress(Exception):                # a callable is no plain value
            values.append([name, to_json(plain_value(v, name))])
    send(["ready", [name for name, v in namespace.items() if callable(v)], values])
    while line := calls.readline():
        try:
            _, name, args, kwargs = loads(line)
            try:
                result = namespace[name](*from_json(args), **from_json(kwargs))
            finally:
                restore()
            answer = ["ok", to_json(plain_value(result, name))]
        except BaseException as e:
            if getpid() != me:
                leave(1)
            answer = described(e)
        send(answer)
    leave(0)


def described(e):
    """An exception of the program's as plain data for the tests' process (program_error rebuilds it)."""
    base = next(c for c in type(e).__mro__ if c.__module__ == "builtins")
    try:
        args = to_json(plain_value(e.args, "args"))
    except TypeError:
        args = None
    trace = "".join(traceback.format_exception(type(e), e, e.__traceback__.tb_next))[-4000:]
    text = " ".join(str(e).split())[:1000]
    return ["raise", base.__name__, type(e).__qualname__, args, text, located(e.__traceback__), trace]


PLAIN_ORDER = (type(None), bool, int, float, complex, str, bytes, list, tuple, dict, set, frozenset)
PLAIN = frozenset(PLAIN_ORDER)
TAGS = {list: "l", tuple: "t", set: "s", frozenset: "f"}
BUILD = {tag: t for t, tag in TAGS.items()}


def plain_value(value, name):
    """value itself if it is made of PLAIN types only (exact types: no subclass, whose __eq__ could
    be anything), else TypeError naming what was returned."""
    todo, seen = [value], set()
    while todo:
        v = todo.pop()
        t = type(v)  # the object's real type: a __class__ property cannot change it
        if t not in PLAIN:
            raise TypeError(f"{name}() returned a {t.__module__}.{t.__qualname__}{' inside its result' if v is not value else ''}: "
                            f"the tests compare plain values only ({', '.join(p.__name__ for p in PLAIN_ORDER)})")
        if t in (list, tuple, set, frozenset, dict) and id(v) not in seen:
            seen.add(id(v))
            todo.extend(v.items() if t is dict else v)  # items: (key, value) tuples, checked in turn
    return value


def to_json(v):
    """A plain value as JSON data that from_json turns back into an equal value of the same types."""
    t = type(v)
    if v is None or t in (bool, str, float) or t is int and -(1 << 53) < v < 1 << 53:
        return v
    if t is int:
        return ["i", hex(v)]                     # no digit limit, unlike str(int)
    if t is complex:
        return ["c", v.real, v.imag]
    if t is bytes:
        return ["b", v.hex()]
    if t is dict:
        return ["d", *(to_json(x) for kv in v.items() for x in kv)]
    if t in TAGS:
        return [TAGS[t], *map(to_json, v)]
    raise TypeError(f"a {t.__module__}.{t.__qualname__} is not a plain value")


def from_json(x):
    """The plain value that to_json made x from: PLAIN types only whatever x is (malformed: raises)."""
    t = type(x)
    if x is None or t in (bool, int, float, str):
        return x
    tag = x[0] if t is list and x and type(x[0]) is str else None
    if tag in ("i", "b") and len(x) == 2 and type(x[1]) is str:
        return int(x[1], 16) if tag == "i" else bytes.fromhex(x[1])
    if tag == "c" and len(x) == 3 and all(type(p) in (int, float) for p in x[1:]):
        return complex(x[1], x[2])
    if tag not in BUILD and tag != "d" or tag == "d" and len(x) % 2 == 0:
        raise ValueError("not a plain value")
    items = [from_json(i) for i in x[1:]]
    return dict(zip(items[::2], items[1::2])) if tag == "d" else BUILD[tag](items)


def set_limits(limits):
    """setrlimit(RLIMIT_<name>, value) for each, never above the hard limit we have (CPU: the hard
    limit 1 s above, so SIGXCPU comes first); returns the names the OS refused (macOS: AS)."""
    refused = []
    for name, value in limits.items():
        limit = getattr(resource, f"RLIMIT_{name}")
        hard = resource.getrlimit(limit)[1]
        soft = value if hard == resource.RLIM_INFINITY else min(value, hard)
        try:
            resource.setrlimit(limit, (soft, soft + 1 if name == "CPU" and (soft < hard or hard < 0) else soft))
        except (ValueError, OSError):
            refused.append(name)
    return refused


def flush(streams):
    for stream in streams:
        with contextlib.suppress(BaseException):
            stream.flush()


def located(tb):
    """file:line of the last frame of the program or the tests in a traceback, or ""."""
    where = ""
    while tb is not None:
        if tb.tb_frame.f_code.co_filename in ("candidate.py", "tests.py"):
            where = f"{tb.tb_frame.f_code.co_filename}:{tb.tb_lineno}"
        tb = tb.tb_next
    return where


def describe(e, stage):
    """One line: the exception, where it was raised (file:line of the program or the tests; for a
    call, in the program's process), in what stage."""
    where = (getattr(e, "in_program", None) or ("",))[0] or located(e.__traceback__)
    text = " ".join(str(e).split())[:300]
    return f"{type(e).__name__}{': ' + text if text else ''}{' at ' + where if where else ''} (in {stage})"
