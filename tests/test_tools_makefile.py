"""The Makefile's settings checks and its mujoco install: `make train` refuses an OMP_NUM_THREADS or NPROC that is
not a count before building anything (spaces around a value are dropped), `make bench-mujoco` installs mujoco
once, and `make test` installs gymnasium + MuJoCo, never Isaac Lab. make runs for real, with a fake venv whose tools
only note their arguments, or with a Python that fails."""

import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest

from tests.test_tools import REPO


def _fake_venv(tmp_path):
    """A VENV whose bin/python and bin/pip only note their arguments (in calls.txt), with .runtime up to date."""
    venv, calls = tmp_path / "venv", tmp_path / "calls.txt"
    (venv / "bin").mkdir(parents=True)
    for tool in ("python", "pip"):
        (venv / "bin" / tool).write_text(f'#!/bin/sh\necho {tool} "$@" >> {calls}\n')
        (venv / "bin" / tool).chmod(0o755)
    (venv / ".runtime").touch()
    return venv, calls


def test_make_bench_mujoco_installs_mujoco_once(tmp_path):
    """Every `make bench-mujoco` ran `pip install gymnasium[mujoco] mujoco` (seconds online, an error offline) before
    the bench, even to be told ARGS was wrong; now a stamp (VENV/.mujoco) makes it once.

    Mutant: bench-mujoco's install without the stamp (pip as a recipe of setup-mujoco) -> pip called twice.
    """
    venv, calls = _fake_venv(tmp_path)
    for _ in range(2):
        result = subprocess.run(["make", "bench-mujoco", f"VENV={venv}", "ARGS=--jobs 0"], cwd=REPO,
                                capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stdout + result.stderr
    lines = calls.read_text().splitlines()
    assert [line.split()[0] for line in lines] == ["pip", "python", "python"], lines
    assert lines[1:] == ["python bench/bench_mujoco.py --jobs 0"] * 2 and (venv / ".mujoco").exists()


def _make_train(tmp_path, *settings: str) -> subprocess.CompletedProcess:
    """`make train settings...` where a passing check goes on to build a venv that cannot be built (PY=false)."""
    return subprocess.run(["make", "train", "NPROC=2", *settings, "ARGS=--help", f"VENV={tmp_path / 'fresh'}",
                           "PY=false"], cwd=REPO, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("threads", ["abc", "", "0", "-1", "2,1"])
def test_make_train_refuses_omp_num_threads_that_is_not_a_count(tmp_path, threads):
    """`make train OMP_NUM_THREADS=abc` (exported to every rank) made libgomp warn and run a thread per core in each.

    Mutant: no OMP_NUM_THREADS case in train-settings -> make goes on to build the venv (PY=false: exit 2, no line).
    """
    result = _make_train(tmp_path, f"OMP_NUM_THREADS={threads}")
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.splitlines()[0] == (f"error: OMP_NUM_THREADS={threads} must be a positive number of threads "
                                             f"(or unset: 1)")
    assert "venv" not in result.stdout and not (tmp_path / "fresh").exists()


def test_make_train_takes_a_thread_count(tmp_path):
    """OMP_NUM_THREADS=2 passes the check (on to building the venv, here with a Python that fails).

    Mutant: the check refuses every value -> no venv step.
    """
    result = _make_train(tmp_path, "OMP_NUM_THREADS=2")
    assert "error: OMP" not in result.stderr and "venv" in result.stdout, result.stdout + result.stderr


@pytest.mark.parametrize("setting", ["NPROC=2 ", "OMP_NUM_THREADS=1 ", "PRESET=cartpole "])
def test_make_train_takes_a_value_with_spaces_around_it(tmp_path, setting):
    """NPROC="2 " was refused as `error: NPROC=2  must be ...` (the space invisible) while PRESET="cartpole " was taken
    ($(filter) drops spaces); torchrun gets NPROC unquoted and libgomp reads "1 " as 1, so all now pass the checks.

    Mutant: train-settings checks $(NPROC) (or $(OMP_NUM_THREADS)) without $(strip) -> refused, no venv step.
    """
    result = _make_train(tmp_path, setting)
    assert "error:" not in result.stderr and "venv" in result.stdout, result.stdout + result.stderr


def test_make_train_still_refuses_a_space_inside_nproc(tmp_path):
    """Only the spaces around a value go: "2 x" is still not a count, and the refusal shows it as make holds it.

    Mutant: the NPROC case drops every space (or takes the first word) -> "2 x" passes.
    """
    result = _make_train(tmp_path, "NPROC=2 x ")
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.splitlines()[0] == "error: NPROC=2 x must be a positive number of ranks"


def _requirements(path) -> list[str]:
    """The requirement lines of a requirements file, `-r` includes followed, comments dropped."""
    lines = []
    for line in open(os.path.join(REPO, path)).read().splitlines():
        line = line.split("#")[0].strip()
        if line.startswith("-r "):
            lines += _requirements(line[3:].strip())
        elif line:
            lines.append(line)
    return lines


def test_make_test_installs_gymnasium_and_mujoco_but_never_isaac_lab(tmp_path):
    """docs/simulators.md: `make test` installs gymnasium + MuJoCo (the adapter's tests run real envs) but never
    Isaac Lab: its one install is requirements-dev.txt, before the suite runs.

    Mutant: gymnasium[mujoco] moved from requirements-dev.txt to setup-mujoco alone."""
    venv, calls = _fake_venv(tmp_path)
    result = subprocess.run(["make", "test", f"VENV={venv}"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert calls.read_text().splitlines() == ["pip install -q -r requirements-dev.txt", "python -m pytest -q tests"]
    requirements = _requirements("requirements-dev.txt")
    names = [re.match(r"[\w.-]+(\[[\w,]+\])?", line)[0] for line in requirements]
    assert "gymnasium[mujoco]" in names and "mujoco" in names, requirements
    assert not [name for name in names if "isaac" in name.lower()], requirements


def test_after_make_test_setup_mujoco_installs_nothing(tmp_path):
    """requirements-dev.txt (what `make test` installs) holds gymnasium[mujoco] and mujoco under the pins of
    setup-mujoco, so a later `make setup-mujoco` (or bench-mujoco) ran pip again for nothing: setup now leaves the
    .mujoco stamp too.

    Mutant: the .dev recipe touches only its own stamp -> the second make runs pip install gymnasium[mujoco]."""
    venv, calls = _fake_venv(tmp_path)
    for target in ("setup", "setup-mujoco"):
        result = subprocess.run(["make", target, f"VENV={venv}"], cwd=REPO, capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stdout + result.stderr
    assert calls.read_text().splitlines() == ["pip install -q -r requirements-dev.txt"]
    makefile = (Path(REPO) / "Makefile").read_text()
    recipe = re.search(r'\.mujoco: .*\n\t\$\(BIN\)/pip install -q ((?:.*\\\n)*.*)\n', makefile)[1]
    mujoco_pins = shlex.split(recipe.replace("\\\n", " "))     # quoted requirements, markers included
    assert set(mujoco_pins) <= set(_requirements("requirements-dev.txt")), mujoco_pins
