"""dist/log_root.py's checks of a --log.root (or a bench's --root) before anything is built: an empty root named by
its flag, a root below a device file, names and paths measured in UTF-8 bytes (a relative root as given), a refusal
without a strerror, and the write probe (its int64 number, where it goes, and the error when it cannot be made)."""

import os

import pytest
import torch

from dist import log_root
from dist.errors import UsageError


def test_an_empty_root_is_named_by_the_flag_it_came_from():
    """A bench's --root "$UNSET" is refused under its own flag, not as --log.root, which the bench has not.
    Mutant: "--log.root is empty" written out in place of `{flag}`."""
    with pytest.raises(UsageError) as caught:
        log_root.check_writable_root("", "--root")
    assert str(caught.value) == "--root is empty; pass a directory ('.' for the current one)"


def test_a_root_the_shell_left_with_its_tilde_is_refused_before_a_folder_named_tilde_is_made(tmp_path, monkeypatch):
    """`--log.root=~/runs` (no tilde expansion after '=') trained into ./~/runs while the console said "writing to
    ~/runs/...", and `--resume auto --log.root ~/runs` then found no checkpoint under $HOME/runs (found sweeping with
    `--flag=value` words). A root starting with '~' is refused, nothing made; `./~` still names such a folder.
    Mutant: check_writable_root without its startswith("~") refusal."""
    monkeypatch.chdir(tmp_path)
    for root in ("~/runs", "~", "~user/runs"):
        with pytest.raises(UsageError, match=f"^--log.root '{root}' starts with '~', which the shell did not expand"):
            log_root.check_writable_root(root)
    assert os.listdir(tmp_path) == []
    log_root.check_writable_root("./~/runs")


def test_a_root_under_a_device_file_is_not_a_directory_even_when_only_read():
    """/dev/null is no regular file and no directory: a --root below it cannot hold results, also for a bench that
    only reads its table (write=False, where no write probe would catch it). The message names the root, the
    existing path that is not a directory, and the flag to change.
    Mutant: `if os.path.isfile(probe)` for `if not os.path.isdir(probe)`; the message without the path or flag."""
    with pytest.raises(UsageError) as caught:
        log_root.check_writable_root("/dev/null/runs", "--root", write=False)
    assert str(caught.value) == "--root '/dev/null/runs': '/dev/null' is a file, not a directory; pick another --root"


def test_a_name_is_measured_in_utf_8_bytes_not_characters(tmp_path):
    """NAME_MAX counts bytes: a name of n 'é' (2 bytes each in UTF-8) with n <= NAME_MAX < 2n is too long for the
    file system, and the message gives its size in bytes.
    Mutant: `len(n)` for `len(n.encode())` in the test, or in the message."""
    name_max = os.pathconf(tmp_path, "PC_NAME_MAX")
    chars = name_max // 2 + 1
    with pytest.raises(UsageError) as caught:
        log_root.check_writable_root(str(tmp_path / "runs" / ("é" * chars)), write=False)
    assert str(caught.value) == (f"--log.root: the name {'é' * 16!r}... ({2 * chars} bytes) is longer than the file "
                                 f"system takes ({name_max} bytes a name); use a shorter one")


def deep_relative(length: int, letter: str = "d") -> str:
    """A relative path of `length` UTF-8 bytes: names of 200 bytes ('d', or 100 'é') joined by '/', a shorter last."""
    width = len(letter.encode())
    parts, left = [], length
    while left > 200:
        parts.append(letter * (200 // width))
        left -= 201
    parts.append(letter * (left // width) + "d" * (left % width))
    return "/".join(parts)


def test_the_path_limit_takes_a_relative_root_as_given_and_counts_its_bytes(tmp_path, monkeypatch):
    """The system calls get a relative root relative to the working directory: one of PATH_MAX - 65 bytes is taken
    wherever the test runs (its absolute form is longer). A root of 'é' names of PATH_MAX - 64 bytes, about half as
    many characters, is refused, its size said in bytes. Each root's first folder exists: its nearest existing
    directory is that folder, absolute.
    Mutant: `os.path.abspath(root)` for `os.path.normpath(root)`; `len(...)` of the characters, not the bytes;
    nearest_directory without `os.path.abspath` (a relative answer)."""
    monkeypatch.chdir(tmp_path)
    path_max = os.pathconf(tmp_path, "PC_PATH_MAX")
    taken, accented = deep_relative(path_max - 65), deep_relative(path_max - 64, "é")
    assert (len(taken.encode()), len(accented.encode())) == (path_max - 65, path_max - 64)
    firsts = sorted({taken.split("/")[0], accented.split("/")[0]})
    for first in firsts:
        os.mkdir(first)
    assert log_root.nearest_directory(taken) == str(tmp_path / ("d" * 200))
    log_root.check_writable_root(taken, write=False)
    with pytest.raises(UsageError) as caught:
        log_root.check_writable_root(accented, write=False)
    assert str(caught.value) == (f"--log.root: the path ({path_max - 64} bytes, plus 64 for the run's directory and "
                                 f"file names) is longer than the file system takes ({path_max} bytes a path); use a "
                                 f"shorter one")
    assert sorted(os.listdir(tmp_path)) == firsts


def test_a_refusal_without_a_strerror_still_refuses(tmp_path, monkeypatch):
    """An OSError raised without an errno has no strerror: the refusal is then its type's name, never "" (which
    reads as "writable" and lets the run fail at its first mkdir after everything was built).
    Mutant: `return exc.strerror` without `or type(exc).__name__`."""
    def refusing(prefix, dir):
        raise OSError()
    monkeypatch.setattr(log_root.tempfile, "mkdtemp", refusing)
    assert log_root.write_refusal(str(tmp_path)) == "OSError"
    with pytest.raises(UsageError) as caught:
        log_root.check_writable_root(str(tmp_path / "runs"))
    assert str(caught.value) == (f"--log.root {str(tmp_path / 'runs')!r}: {str(tmp_path)!r} is not writable (OSError); "
                                 f"pick a directory you can write to")


@pytest.mark.parametrize("drawn, nonce", [(b"\xff" * 8, 2 ** 63 - 1), (b"\x00" * 8, 1), (b"\x02" + b"\x00" * 7, 1)],
                         ids=["all-ones", "zero", "two"])
def test_the_probe_is_named_by_a_positive_int64_in_the_nearest_existing_directory(tmp_path, monkeypatch, drawn,
                                                                                  nonce):
    """Rank 0 broadcasts the probe's number as one int64, and 0 means "no probe" (a dry run): the 8 random bytes
    (little-endian) are halved into [0, 2**63) and 0 becomes 1. The probe goes in the root's nearest existing
    directory (a first run's --log.root does not exist yet, and is not created), named by 16 hex digits.
    Mutant: without `>> 1` (2**64 - 1 overflows int64); without `or 1`; the probe made inside the root itself."""
    monkeypatch.setattr(log_root.os, "urandom", lambda n: drawn[:n])
    path, made = log_root.make_probe(str(tmp_path / "runs" / "x"))
    assert (path, made) == (str(tmp_path / f".syncppo-probe-{nonce:016x}"), nonce)
    assert os.listdir(tmp_path) == [f".syncppo-probe-{nonce:016x}"] and os.path.isdir(path)
    torch.tensor([made], dtype=torch.int64)     # what agree_on_checkpoint broadcasts


def test_a_probe_that_cannot_be_made_names_the_root_the_probe_and_why(tmp_path, monkeypatch):
    """A --log.root below a file: the error names the root typed, the probe it tried, and the system's reason.
    Mutant: the message without the root, or without `({exc.strerror})`."""
    (tmp_path / "file").write_text("")
    monkeypatch.setattr(log_root.os, "urandom", lambda n: b"\x02" + b"\x00" * (n - 1))
    root = str(tmp_path / "file" / "runs")
    with pytest.raises(UsageError) as caught:
        log_root.make_probe(root)
    probe = str(tmp_path / "file" / ".syncppo-probe-0000000000000001")
    assert str(caught.value) == (f"--log.root {root!r}: cannot create {probe!r} (Not a directory); pick a directory "
                                 f"you can write to")


# ---- ppo/export.py -----------------------------------------------------------------------------------------------
