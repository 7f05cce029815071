"""bench/gpu_check.sh is the only way the GPU targets get measured, on a machine lent for minutes: a flag renamed
or a test selection that matches nothing would cost that time. Its command lines are checked here on the CPU:
train.py's parse and plan (--dry-run), the benches' flags against their parsers, pytest's selections collect."""

import os
import re
import shlex
import subprocess
import sys

import pytest

from tests.forked_python import run_python

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "bench", "gpu_check.sh")


def steps() -> list[tuple[str, list[str]]]:
    """(name, argv) of every `step NAME LIMIT CMD ...` line, with the script's variables put in."""
    text = open(SCRIPT).read()
    variables = dict(re.findall(r'^(big|runs)="([^"]*)"$', text, re.M))
    assert set(variables) == {"big", "runs"}, "the script's shared flags moved: update this test"
    out = []
    for line in re.findall(r"^\s*(?:\w+=\S+ )*step (.*?)(?: ;;)?$", text, re.M):
        for name, value in variables.items():
            line = line.replace(f"${name}", value)
        name, _limit, *argv = shlex.split(line.replace("$py", sys.executable))
        out.append((name, argv))
    return out


def test_the_script_has_the_steps_its_header_names():
    names = [name for name, _ in steps()]
    assert {"capture_tests", "bench_train_host", "bench_train_capture", "train_16384_capture", "sync_tests_cuda",
            "bench_sync_cuda", "torchrun_1gpu", "pytest_fast", "bench_grad_cuda"} <= set(names)


def run(argv: list[str], timeout: float = 120) -> subprocess.CompletedProcess:
    """`python ARGS` in a process of its own, forked from one that imported torch (tests/forked_python.py)."""
    assert argv[0] == sys.executable, argv
    return run_python(argv[1:], cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=timeout)


def selected(keep) -> dict:
    """parametrize arguments for the steps whose argv `keep` accepts, named by step."""
    chosen = [s for s in steps() if keep(s[1])]
    return {"argnames": "name, argv", "argvalues": chosen, "ids": [name for name, _ in chosen]}


@pytest.mark.slow
@pytest.mark.parametrize(**selected(lambda argv: "train.py" in argv))
def test_each_training_command_parses_and_plans_on_the_cpu(name, argv, tmp_path):
    """The same flags with --dry-run (torchrun's own options dropped): parsed, checked, built, plan printed."""
    argv = argv[argv.index("train.py"):]
    root = argv.index("--log.root")
    argv[root + 1] = str(tmp_path)
    result = run([sys.executable, *argv, "--dry-run"])
    assert result.returncode == 0, f"{name}: {result.stderr[-2000:]}"
    assert "sync plan" in result.stdout.lower() or "collective" in result.stdout, result.stdout[-2000:]


@pytest.mark.slow
@pytest.mark.parametrize(**selected(lambda argv: any(a.startswith("bench/") for a in argv)))
def test_each_bench_flag_is_one_its_parser_knows(name, argv):
    script = next(a for a in argv if a.startswith("bench/"))
    flags = [a for a in argv[argv.index(script) + 1:] if a.startswith("--")]
    usage = run([sys.executable, script, "--help"]).stdout
    known = set(re.findall(r"--[a-z][a-z0-9-]*", usage))
    assert flags and set(flags) <= known, f"{name}: {sorted(set(flags) - known)} not in {script} --help"


@pytest.mark.slow
@pytest.mark.parametrize(**selected(lambda argv: "pytest" in argv))
def test_each_test_selection_collects_tests(name, argv):
    """pytest exits 5 when a -k or -m selection matches nothing: the step would report a failure, not a result."""
    result = run([*argv, "--collect-only", "-q"])
    assert result.returncode == 0, f"{name}: {result.stdout[-1500:]}{result.stderr[-1500:]}"
    per_file = re.findall(r"^\S+\.py: (\d+)$", result.stdout, re.M)     # -q twice: one line per file
    assert per_file and all(int(n) > 0 for n in per_file), result.stdout[-1500:]


def test_the_default_parts_fit_the_device_run_limit_with_room_to_install():
    """The remote run stops the whole script at 540 s (the header's limit): the default parts' time boxes, plus
    installing the wheels and reading the GPU's name before them (about 15 s), must fit, and the header must say
    their total."""
    text = open(SCRIPT).read()
    default = re.search(r"^parts=\$\{\*:-([a-z ]+)\}$", text, re.M).group(1).split()
    blocks = dict(re.findall(r"^    (\w+)\)\n(.*?);;$", text, re.M | re.S))
    total = sum(int(limit) for part in default for limit in re.findall(r"\bstep \w+ (\d+) ", blocks[part]))
    assert f"time boxes total {total} s" in text and "with a 540 s limit" in text
    assert total <= 540 - 30


@pytest.mark.parametrize("parts, fake_gpu, status", [("sync", True, 0), ("sync bogus", True, 1), ("sync", False, 1)])
def test_the_script_exits_1_when_cuda_a_step_or_a_part_failed(tmp_path, parts, fake_gpu, status):
    """It exited 0 whatever happened: a remote run of it looked fine with every step failed. Here every step's
    python is `true` (rc 0), so only the unknown part or the missing GPU (nvidia-smi fails) can fail it."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text("#!/bin/sh\n" + ("echo 'GPU 0: fake'\n" if fake_gpu else "exit 9\n"))
    (bin_dir / "nvidia-smi").chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "PYTHON": "true"}
    result = subprocess.run(["bash", SCRIPT, str(tmp_path / "out"), *parts.split()], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=60)
    summary = (tmp_path / "out" / "summary.txt").read_text()
    assert result.returncode == status, summary
    assert "sync_tests_cuda rc=0" in summary and "bench_sync_cuda rc=0" in summary     # every part still ran
    assert ("failed (see summary.txt)" in summary) == bool(status)


def script_blocks() -> dict[str, list[tuple[str, int]]]:
    """Each part's (step name, time box) in the script's order."""
    text = open(SCRIPT).read()
    blocks = dict(re.findall(r"^    (\w+)\)\n(.*?);;$", text, re.M | re.S))
    return {part: [(name, int(box)) for name, box in re.findall(r"\bstep (\w+) (\d+) ", body)]
            for part, body in blocks.items()}


def test_docs_gpu_md_lists_the_script_s_steps_boxes_and_commands():
    """docs/gpu.md is what a GPU session plans its 15 minutes from: its table of the default run's steps (name and
    time box, in order), their count and total, the other parts' boxes and the commands its notes quote must be the
    script's.

    Mutant: sync_tests_cuda's -k selection or bench_sync_cuda's box changed in the script -> it fails here."""
    doc = open(os.path.join(REPO, "docs", "gpu.md")).read()
    blocks = script_blocks()
    table = [(name, int(box)) for name, box in re.findall(r"^\| `(\w+)` \((\d+) s\) \|", doc, re.M)]
    assert table == blocks["learner"] + blocks["sync"]
    assert f"`learner sync`\n   run {len(table)} steps whose time boxes total {sum(b for _, b in table)} s" in doc
    others = doc[doc.index("Other parts, named after OUT"):doc.index("## What is designed")]
    listed = re.findall(r"`(\w+)` (\d+) s", others)
    assert [(name, int(box)) for name, box in listed] == blocks["train"] + blocks["tests"] + blocks["grad"]
    argv = dict(steps())
    text = open(SCRIPT).read()
    flat = " ".join(doc.split())
    for name, quoted in (("capture_tests", "SYNCPPO_TEST_DEVICE=cuda pytest tests/test_minibatch_step.py"),
                         ("sync_tests_cuda", "SYNCPPO_TEST_DEVICE=cuda pytest tests/test_sync_patch.py")):
        command = shlex.split(flat[flat.index(quoted):].split("`")[0])
        assert argv[name][:6] == [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
        assert command[1:] == ["pytest", *argv[name][6:]], name
        assert re.search(rf"^\s*SYNCPPO_TEST_DEVICE=cuda step {name} ", text, re.M), name
    bench_sync = shlex.split(flat[flat.index("python bench/bench_sync.py"):].split("`")[0])
    assert bench_sync[1:] == argv["bench_sync_cuda"][1:]
    note_c = shlex.split(flat[flat.index("train.py tracking --env.num-envs 16384"):].split("`")[0])
    pairs = dict(zip(note_c[2::2], note_c[3::2]))
    for name in ("train_16384_capture", "train_16384_host", "train_16384_preset_capture"):
        step_argv = argv[name][argv[name].index("train.py"):]
        assert step_argv[:2] == note_c[:2] and all(pairs[k] == step_argv[step_argv.index(k) + 1] for k in pairs)
        assert ("--ppo.capture-step" in step_argv) == name.endswith("capture"), name
        assert ("512" in step_argv) == ("preset" not in name), name        # (512, 256, 128), or the preset's


def test_the_script_writes_gpu_txt_a_summary_line_and_a_logged_header_per_step_and_installs_the_wheels(tmp_path):
    """What docs/gpu.md says comes back: gpu.txt (nvidia-smi -L, torch's version and device name), one summary line
    per step (`NAME rc=N`, seconds since the start, the step's seconds), one log per part with each step under a
    `===== NAME: command` line; a failed step makes the exit status 1 and the other steps still run. Before them,
    .whl/*.whl go into /tmp/site, which every later python finds on PYTHONPATH, with GIT_PYTHON_REFRESH=quiet.
    The python here is a stand-in that notes how it was called and fails bench_sync.py only.

    Mutant: no `failed=$((failed + 1))` after a step's non-zero rc -> exit 0. Mutant: no export of
    GIT_PYTHON_REFRESH -> the steps see it unset."""
    work, bin_dir = tmp_path / "work", tmp_path / "bin"
    (work / ".whl").mkdir(parents=True)
    (work / ".whl" / "a-1.0-py3-none-any.whl").write_text("")
    bin_dir.mkdir()
    calls = tmp_path / "calls.txt"
    stub = {"nvidia-smi": "echo 'GPU 0: Fake H200'\n",
            "py": f'echo "$*|${{PYTHONPATH:-}}|${{GIT_PYTHON_REFRESH:-}}|${{SYNCPPO_TEST_DEVICE:-}}" >> {calls}\n'
                  'case "$*" in *get_device_name*) echo "9.9.9 Fake H200";; *bench_sync.py*) echo boom; exit 3;; '
                  '*) echo "ran $1";; esac\n'}
    for name, body in stub.items():
        (bin_dir / name).write_text("#!/bin/sh\n" + body)
        (bin_dir / name).chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "PYTHON": str(bin_dir / "py")}
    env.pop("PYTHONPATH", None)
    env.pop("GIT_PYTHON_REFRESH", None)
    out = tmp_path / "out"
    result = subprocess.run(["bash", SCRIPT, str(out), "sync"], cwd=work, env=env, capture_output=True, text=True,
                            timeout=60)
    summary = (out / "summary.txt").read_text().splitlines()
    assert result.returncode == 1, summary
    assert re.fullmatch(r"sync_tests_cuda rc=0 \d+s total, \d+s", summary[0]), summary
    assert re.fullmatch(r"bench_sync_cuda rc=3 \d+s total, \d+s", summary[1]), summary
    assert summary[2:] == ["1 failed (see summary.txt)"]
    assert (out / "gpu.txt").read_text() == "GPU 0: Fake H200\n9.9.9 Fake H200\n"
    log = (out / "sync.txt").read_text().splitlines()
    py = str(bin_dir / "py")
    assert log == [f"===== sync_tests_cuda: {py} -m pytest -q -p no:cacheprovider tests/test_sync_patch.py "
                   "tests/test_sync_bucket.py tests/test_checksum_reference.py -k every_update or load_instant or "
                   "test_device", "ran -m",
                   f"===== bench_sync_cuda: {py} bench/bench_sync.py --device cuda --densities 0.001 0.01 0.1 1.0 "
                   "--repeats 5", "boom"]
    install, *rest = [line.split("|") for line in calls.read_text().splitlines()]
    assert install[0] == ("-m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "
                          "/tmp/site .whl/a-1.0-py3-none-any.whl")
    assert [call[1:] for call in rest] == [["/tmp/site", "quiet", ""], ["/tmp/site", "quiet", "cuda"],
                                           ["/tmp/site", "quiet", ""]]     # the torch line, then the two steps


@pytest.mark.parametrize("venv, python_var, expected", [(True, None, "venv"), (False, None, "path"),
                                                         (True, "chosen", "chosen")])
def test_the_script_runs_the_checkouts_venv_else_python3_and_python_overrides_both(tmp_path, venv, python_var,
                                                                                   expected):
    """A GPU box set up with `make setup` has torch and tyro in .venv only: the script ran the python3 on PATH, and
    every step failed on its imports (h83's audit). Stand-in interpreters say which one ran its first command.
    Mutant: `py=${PYTHON:-python3}` as before -> the .venv case reads "path"."""
    (tmp_path / "bench").mkdir()
    (tmp_path / "bench" / "gpu_check.sh").write_text(open(SCRIPT).read())
    for where, name in (("venv", ".venv/bin/python"), ("path", "bin/python3"), ("chosen", "other/python")):
        if where == "venv" and not venv:
            continue
        fake = tmp_path / name
        fake.parent.mkdir(parents=True, exist_ok=True)
        fake.write_text(f"#!/bin/sh\necho 'ran the {where} interpreter'\n")
        fake.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != "PYTHON"}
    env["PATH"] = f"{tmp_path / 'bin'}:{env['PATH']}"
    if python_var:
        env["PYTHON"] = str(tmp_path / "other" / "python")
    result = subprocess.run(["bash", "bench/gpu_check.sh", "out", "no-such-part"], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 1, result.stdout + result.stderr        # the unknown part, and no GPU here
    assert f"ran the {expected} interpreter" in (tmp_path / "out" / "gpu.txt").read_text()
