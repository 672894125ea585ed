"""The import graph of the top-level modules.

Proves: every module imports on its own in a fresh interpreter (so no import order hides a
cycle or a missing import); the graph of every import statement, at any depth of any top-level
file (lazy imports included), has no cycle; and no file uses another module's private names
(`from m import _x`, `m._x`, also through an alias). Modules are the root's
files and those of its one-level wings (`memory/quant.py` is `memory.quant`); the benchmark scripts in
bench/ are not modules (importing one runs it: tests/test_bench.py runs them).
"""
import ast
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


NOT_WINGS = {"tests", "configs", "bench", "docker", "runs", "docs", "data", "out"}


def wings(root=ROOT):
    """The one-level folders that hold modules (each with an empty __init__.py)."""
    return sorted(d for d in os.listdir(root) if d not in NOT_WINGS and not d.startswith((".", "_"))
                  and os.path.isfile(os.path.join(root, d, "__init__.py")))


def modules(root=ROOT):
    """The root's modules ("model") and the wings' ("memory.quant")."""
    out = [f[:-3] for f in os.listdir(root) if f.endswith(".py")]
    for w in wings(root):
        out += [f"{w}.{f[:-3]}" for f in os.listdir(os.path.join(root, w)) if f.endswith(".py") and f != "__init__.py"]
    return sorted(out)


def graph(root=ROOT):
    """{module: (set of our modules it imports, [private-name uses as 'file:line: text'])}."""
    mods = set(modules(root))

    def ours(name):  # "memory.quant.nf4" -> "memory.quant"; "model" -> "model"; not ours -> None
        parts = name.split(".")
        return next((".".join(parts[:k]) for k in (2, 1) if ".".join(parts[:k]) in mods), None)
    out = {}
    for m in mods:
        path = os.path.join(root, *m.split(".")) + ".py"
        tree = ast.parse(open(path).read())
        deps, alias, private = set(), {}, []
        for n in ast.walk(tree):
            if isinstance(n, ast.Import):
                for a in n.names:
                    if ours(a.name):
                        deps.add(ours(a.name))
                        if a.asname or "." not in a.name:
                            alias[a.asname or a.name] = ours(a.name)
            elif isinstance(n, ast.ImportFrom) and n.module and not n.level:
                for a in n.names:
                    sub = ours(f"{n.module}.{a.name}")
                    if sub and sub != ours(n.module):  # from memory import quant: the module itself
                        deps.add(sub)
                        alias[a.asname or a.name] = sub
                    elif ours(n.module):  # from model import Transformer, _x
                        deps.add(ours(n.module))
                        private += [f"{path[len(root) + 1:]}:{n.lineno}: from {n.module} import {a.name}"
                                    for a in [a] if a.name.startswith("_")]
        for n in ast.walk(tree):
            if (isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id in alias
                    and n.attr.startswith("_") and not n.attr.startswith("__") and alias[n.value.id] != m):
                private.append(f"{path[len(root) + 1:]}:{n.lineno}: {n.value.id}.{n.attr} ({alias[n.value.id]})")
        out[m] = (deps - {m}, private)
    return out


def cycles(g):
    """Every cycle a depth-first search meets (as module lists, first == last)."""
    found, state, stack = [], {}, []

    def dfs(u):
        state[u] = 1
        stack.append(u)
        for v in sorted(g[u][0]):
            if state.get(v) == 1:
                found.append(stack[stack.index(v):] + [v])
            elif v not in state:
                dfs(v)
        stack.pop()
        state[u] = 2
    for m in sorted(g):
        if m not in state:
            dfs(m)
    return found


def test_no_import_cycle():
    assert cycles(graph()) == []


def test_no_private_names_across_modules():
    assert [p for _, private in graph().values() for p in private] == []


def test_checks_catch_a_cycle_and_a_private_name(tmp_path):
    """The static checks on a made-up tree: a <-> b through a lazy import, c reads b._x."""
    (tmp_path / "a.py").write_text("import b\n")
    (tmp_path / "b.py").write_text("def f():\n    import a\n_x = 1\n")
    (tmp_path / "c.py").write_text("import b as B\nfrom b import _x\ny = B._x\nfrom w import d\nz = d._y\n")
    (tmp_path / "w").mkdir()
    (tmp_path / "w" / "__init__.py").write_text("")
    (tmp_path / "w" / "d.py").write_text("import c\n_y = 1\n")  # a wing's module: c -> w.d -> c
    g = graph(str(tmp_path))
    assert cycles(g) == [["a", "b", "a"], ["c", "w.d", "c"]]
    assert [p.split(": ")[1] for p in g["c"][1]] == ["from b import _x", "B._x (b)", "d._y (w.d)"]


IMPORT_EACH = """
import importlib, io, os, sys, traceback
import torch  # the one heavy dependency (not ours), loaded once; each module is imported in a fork
live, failed = 0, 0  # children running (two at a time: the CI machine's 2 cores); those that did not exit 0
def reap():  # one child's end: a crash that wrote no FAIL line (a signal, a hard exit) fails the run too
    global live, failed
    live, failed = live - 1, failed + (os.wait()[1] != 0)
for m in sys.argv[1:]:
    if live == 2:
        reap()
    pid = os.fork()
    if pid == 0:  # the child: a fresh interpreter as far as our modules go (the parent imported none)
        sys.stdout = out = io.StringIO()
        try:
            importlib.import_module(m)
        except BaseException:
            sys.stderr.write(f"FAIL {m}: {traceback.format_exc()[-1500:]}\\n")
            os._exit(1)
        if out.getvalue():
            sys.stderr.write(f"FAIL {m}: printed {out.getvalue()[-300:]!r}\\n")
            os._exit(1)
        os._exit(0)
    live += 1
while live:
    reap()
sys.exit(1 if failed else 0)
"""


def test_every_module_imports_alone():
    """Each module imported alone, in a process that had imported none of ours (a fork of one
    that imported only torch: a fresh interpreter each costs ~1.5 s of CPU; two forks at a time);
    importing runs nothing (no output). The check fails on a module that cannot be imported alone
    or prints."""
    mods = modules()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    res = subprocess.run([sys.executable, "-c", IMPORT_EACH, *mods], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=600)
    assert res.returncode == 0 and "FAIL" not in res.stderr, res.stderr[-5000:]
    assert len(mods) > 20
    bad = subprocess.run([sys.executable, "-c", IMPORT_EACH, "json", "no_such_module_here"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    assert "FAIL no_such_module_here" in bad.stderr and "FAIL json" not in bad.stderr and bad.returncode == 1


@pytest.mark.parametrize("script", ["pretrain", "sample"])
def test_stage_scripts_have_a_main_guard(script):
    tree = ast.parse(open(os.path.join(ROOT, script + ".py")).read())
    top = [n for n in tree.body if not isinstance(n, (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.ClassDef))]
    # only the docstring, constants and the `if __name__ == "__main__":` guard run at import
    assert all(isinstance(n, (ast.Expr, ast.Assign, ast.If)) for n in top)
    guards = [n for n in top if isinstance(n, ast.If)]
    assert len(guards) == 1 and ast.unparse(guards[0].test) == "__name__ == '__main__'"
