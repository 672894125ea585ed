"""The import graph of the top-level modules.

Proves: every module imports on its own in a fresh interpreter (so no import order hides a
cycle or a missing import); the graph of every import statement, at any depth of any top-level
file (lazy imports included), has no cycle; and no file uses another module's private names
(`from m import _x`, `m._x`, also through an alias). The benchmark scripts (bench*.py) are part
of the static checks but are not imported: importing one runs it (tests/test_bench.py does).
"""
import ast
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def modules(root=ROOT):
    return sorted(f[:-3] for f in os.listdir(root) if f.endswith(".py"))


def graph(root=ROOT):
    """{module: (set of our modules it imports, [private-name uses as 'file:line: text'])}."""
    mods = set(modules(root))
    out = {}
    for m in mods:
        tree = ast.parse(open(os.path.join(root, m + ".py")).read())
        deps, alias, private = set(), {}, []
        for n in ast.walk(tree):
            if isinstance(n, ast.Import):
                for a in n.names:
                    top = a.name.split(".")[0]
                    if top in mods:
                        deps.add(top)
                        alias[a.asname or top] = top
            elif isinstance(n, ast.ImportFrom) and n.module and not n.level and n.module.split(".")[0] in mods:
                deps.add(n.module.split(".")[0])
                private += [f"{m}.py:{n.lineno}: from {n.module} import {a.name}" for a in n.names
                            if a.name.startswith("_")]
        for n in ast.walk(tree):
            if (isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id in alias
                    and n.attr.startswith("_") and not n.attr.startswith("__") and alias[n.value.id] != m):
                private.append(f"{m}.py:{n.lineno}: {n.value.id}.{n.attr} ({alias[n.value.id]}.py)")
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
    (tmp_path / "c.py").write_text("import b as B\nfrom b import _x\ny = B._x\n")
    g = graph(str(tmp_path))
    assert cycles(g) == [["a", "b", "a"]]
    assert [p.split(": ")[1] for p in g["c"][1]] == ["from b import _x", "B._x (b.py)"]


def test_every_module_imports_alone():
    """A fresh interpreter per module, a few at a time; importing runs nothing (no output)."""
    mods = [m for m in modules() if not m.startswith("bench")]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    failed = []
    for i in range(0, len(mods), 4):
        procs = {m: subprocess.Popen([sys.executable, "-c", f"import {m}"], cwd=ROOT, env=env,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for m in mods[i:i + 4]}
        for m, p in procs.items():
            out, err = p.communicate(timeout=300)
            if p.returncode != 0 or out:
                failed.append(f"{m}: rc {p.returncode}, stdout {out[-300:]!r}, stderr {err[-1500:]}")
    assert not failed, "\n".join(failed)


@pytest.mark.parametrize("script", ["pretrain", "sample"])
def test_stage_scripts_have_a_main_guard(script):
    tree = ast.parse(open(os.path.join(ROOT, script + ".py")).read())
    top = [n for n in tree.body if not isinstance(n, (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.ClassDef))]
    # only the docstring, constants and the `if __name__ == "__main__":` guard run at import
    assert all(isinstance(n, (ast.Expr, ast.Assign, ast.If)) for n in top)
    guards = [n for n in top if isinstance(n, ast.If)]
    assert len(guards) == 1 and ast.unparse(guards[0].test) == "__name__ == '__main__'"
