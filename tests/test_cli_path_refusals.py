"""Paths given on the command line that cannot work, refused in one line naming what to fix rather than what failed
later: a --log.root too long for the file system."""

import os

import pytest

from dist.errors import UsageError
from dist.log_root import check_writable_root


def test_log_root_path_limit_counts_64_bytes_for_the_run_and_refuses_at_path_max(tmp_path):
    """PATH_MAX counts the terminating NUL: a root of PATH_MAX - 64 bytes is refused, one byte shorter is taken."""
    path_max = os.pathconf(str(tmp_path), "PC_PATH_MAX")

    def root_of(length):
        parts, left = [str(tmp_path)], length - len(str(tmp_path))
        while left > 0:
            n = min(200, left - 1) if left > 1 else 1
            parts.append("d" * n)
            left -= n + 1
        return "/".join(parts)
    assert len(root_of(path_max - 64)) == path_max - 64 and len(root_of(path_max - 65)) == path_max - 65
    check_writable_root(root_of(path_max - 65), write=False)
    with pytest.raises(UsageError, match="longer than the file system takes"):
        check_writable_root(root_of(path_max - 64), write=False)
