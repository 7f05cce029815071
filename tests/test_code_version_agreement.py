"""Every rank of a run must execute the same syncppo code: the settings checksum the ranks compare at start-up covers
the .py files a run executes (configs.same_settings.source_digest), so a node holding a stale copy stops at start-up."""

import functools
import glob
import os
import shutil

import pytest

from configs import same_settings
from tests.multirank import run_ranks
from tests.test_sync_contract import one_cartpole_iteration

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def make_tree(root, files: dict[str, bytes]) -> str:
    for relative, data in files.items():
        path = os.path.join(root, relative)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(data)
    return str(root)


TREE = {"train.py": b"print(1)\n", "ppo/loss.py": b"x = 1\n", "dist/comm.py": b"y = 2\n", "README.md": b"# r\n"}


def test_source_digest_follows_the_executed_code_and_nothing_else(tmp_path):
    base = same_settings.source_digest(make_tree(tmp_path / "a", TREE))
    assert same_settings.source_digest(make_tree(tmp_path / "b", TREE)) == base          # content, not where it lies
    changed = {
        "one byte of a package file": {**TREE, "ppo/loss.py": b"x = 2\n"},
        "one byte of a top-level file": {**TREE, "train.py": b"print(2)\n"},
        "a file renamed": {k.replace("comm", "comms"): v for k, v in TREE.items()},
        "a file added": {**TREE, "envs/new_env.py": b""},
        "a file removed": {k: v for k, v in TREE.items() if k != "dist/comm.py"},
        "bytes moved across the boundary of two files": {**TREE, "dist/comm.py": b"y = 2\n\n", "ppo/loss.py": b"x = 1"},
    }
    for name, files in changed.items():
        assert same_settings.source_digest(make_tree(tmp_path / name.replace(" ", "_"), files)) != base, name
    unexecuted = {**TREE, "tests/test_x.py": b"z\n", "bench/bench_x.py": b"w\n", "README.md": b"# other\n",
                  "ppo/deeper/more.py": b"v\n"}
    assert same_settings.source_digest(make_tree(tmp_path / "u", unexecuted)) == base      # tests, benches, docs


def test_a_python_file_that_cannot_be_read_is_compared_not_fatal(tmp_path):
    """A dangling link named *.py (say, to an unmounted disk) does not stop start-up with an OSError: it counts as
    unreadable, the same on every node where it dangles, and differs from a node where the file is there."""
    base = same_settings.source_digest(make_tree(tmp_path / "a", TREE))
    dangling = []
    for name in ("b", "c"):
        root = make_tree(tmp_path / name, TREE)
        os.symlink(tmp_path / "nowhere.py", os.path.join(root, "envs_link.py"))
        dangling.append(same_settings.source_digest(root))
    readable = make_tree(tmp_path / "d", {**TREE, "envs_link.py": b""})
    assert dangling[0] == dangling[1] != base and dangling[0] != same_settings.source_digest(readable)


def stale_copy_body(rank, world_size, root, copy):
    """Cart-pole on every rank; rank 1 executes `copy` (a copy of this repository, or one with ppo/loss.py edited)
    for its checksum of the code."""
    if rank == 1:
        same_settings.source_digest = functools.partial(same_settings.source_digest, copy)
    return one_cartpole_iteration(f"{root}/{rank}")


def copy_repo(to, edit: bool) -> str:
    """A copy of the repository's .py files at its top and one folder down (what source_digest reads; not the rest,
    which can be large: virtual environments, runs)."""
    for path in glob.glob(os.path.join(REPO, "*.py")) + glob.glob(os.path.join(REPO, "*", "*.py")):
        target = os.path.join(to, os.path.relpath(path, REPO))
        os.makedirs(os.path.dirname(target), exist_ok=True)
        shutil.copyfile(path, target)
    if edit:
        with open(os.path.join(to, "ppo", "loss.py"), "a") as f:
            f.write("# edited on one node only\n")
    return str(to)


@pytest.mark.slow
def test_a_rank_running_other_code_stops_at_start_up_on_every_rank(tmp_path):
    same = run_ranks(stale_copy_body, 2, args=(str(tmp_path / "same"), copy_repo(tmp_path / "copy", edit=False)))
    assert same == ["trained", "trained"]            # an identical copy elsewhere on disk is the same code
    stale = run_ranks(stale_copy_body, 2, args=(str(tmp_path / "stale"), copy_repo(tmp_path / "edited", edit=True)))
    for said in stale:
        assert said.startswith("rank(s) [1] run with other settings than rank 0: syncppo's .py files differ on rank(s) "
                               "[1] (a checksum of every flag but ") and "and of syncppo's .py files" in said, said
