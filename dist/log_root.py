"""Where runs go (--log.root, a bench's --root): checked before anything is built, and the probe directory rank 0
leaves there for every rank to look for (dist.checkpoint.agree_on_checkpoint). Nothing here crosses ranks."""

import os
import sys
import tempfile

from dist.errors import UsageError


def check_writable_root(root: str, flag: str = "--log.root", write: bool = True) -> None:
    """Fail before anything is built (or created) when `root` (`flag`: --log.root, a bench's --root) cannot hold
    run directories, checked at its nearest existing ancestor; `write=False` asks only that it be a directory."""
    if not root:     # an unset shell variable (--log.root "$DIR"): the runs went to the working directory, unsaid
        raise UsageError(f"{flag} is empty; pass a directory ('.' for the current one)")
    if root.startswith("~"):    # --log.root=~/runs: the shell left it, the runs went to ./~/runs, said as ~/runs
        raise UsageError(f"{flag} {root!r} starts with '~', which the shell did not expand (it does not after "
                         f"'{flag}='): pass {flag} {root} (a space, not '='), or $HOME; ./{root} for a folder named ~")
    if undecodable(root):   # str.encode() below (the lengths) raised a UnicodeEncodeError traceback
        raise UsageError(f"{flag} {root!r} holds bytes that are not text in the file system's encoding "
                         f"({sys.getfilesystemencoding()}); pick a directory whose path is text")
    link = dangling_link(root)
    if link is not None:     # the nearest existing ancestor lies above it: the probe passed, the run's mkdir failed
        raise UsageError(f"{flag} {root!r}: {link!r} is a symbolic link whose target does not exist (or that loops); "
                         f"create its target or pick another {flag}")
    probe = nearest_directory(root)
    if not os.path.isdir(probe):
        raise UsageError(f"{flag} {root!r}: {probe!r} is a file, not a directory; pick another {flag}")
    # The names still to be made, and the whole path with a run directory's and a checkpoint's names (<= 64 bytes)
    # below it, within the file system's limits: else the run directory's mkdir fails once everything is built.
    name_max, path_max = os.pathconf(probe, "PC_NAME_MAX"), os.pathconf(probe, "PC_PATH_MAX")
    long_name = next((n for n in os.path.relpath(os.path.abspath(root), probe).split(os.sep) if len(n.encode()) >
                      name_max), None)
    if long_name is not None:
        raise UsageError(f"{flag}: the name {long_name[:16]!r}... ({len(long_name.encode())} bytes) is longer than the "
                         f"file system takes ({name_max} bytes a name); use a shorter one")
    length = len(root.encode())   # as typed, as the system calls get it ('./' parts count; a relative root stays so)
    if length + 64 >= path_max:
        raise UsageError(f"{flag}: the path ({length} bytes, plus 64 for the run's directory and file names) is "
                         f"longer than the file system takes ({path_max} bytes a path); use a shorter one")
    if not write:
        return
    refused = write_refusal(probe)
    if refused:
        raise UsageError(f"{flag} {root!r}: {probe!r} is not writable ({refused}); pick a directory you can write to")


def write_refusal(folder: str) -> str:
    """Why the existing directory `folder` refuses new entries, "" when it takes them: a directory made there and
    removed. os.access says yes to root where writes fail (/proc, NFS root_squash, an immutable directory)."""
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".syncppo-probe-", dir=folder))
    except OSError as exc:
        return exc.strerror or type(exc).__name__
    return ""


def undecodable(path: str) -> bool:
    """Whether `path` holds bytes the file system's encoding could not decode. Python passes them on as lone
    surrogates, which str.encode(), a strict stdout (a UTF-8 terminal's) and torch's savers refuse with a traceback."""
    return any("\udc80" <= c <= "\udcff" for c in path)


def dangling_link(root: str) -> str | None:
    """The symbolic link that `root`, or the part of it still to be made, passes through to a target that does not
    exist (or that loops); None when there is none."""
    path = os.path.abspath(root)
    while not os.path.exists(path):
        if os.path.islink(path):
            return path
        path = os.path.dirname(path)
    return None


def nearest_directory(root: str) -> str:
    """`root`, or its nearest existing ancestor (a first run creates --log.root only once it is known good)."""
    path = os.path.abspath(root)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return path


def probe_path(root: str, nonce: int) -> str:
    return os.path.join(nearest_directory(root), f".syncppo-probe-{nonce:016x}")


def make_probe(root: str) -> tuple[str, int]:
    """Rank 0's probe directory for agree_on_checkpoint: (its path, the nonzero number that names it)."""
    nonce = int.from_bytes(os.urandom(8), "little") >> 1 or 1
    path = probe_path(root, nonce)
    try:
        os.mkdir(path)
    except OSError as exc:
        raise UsageError(f"--log.root {root!r}: cannot create {path!r} ({exc.strerror}); pick a directory you can "
                         f"write to") from None
    return path, nonce
