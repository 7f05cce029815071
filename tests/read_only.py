"""A folder made read-only for a test, whoever runs it: `chmod a-w` stops a user, but root writes anyway, so as root
the folder is also made immutable (`chattr +i`), and the test is skipped where that is not possible."""

import contextlib
import os
import subprocess

import pytest


@contextlib.contextmanager
def read_only_folder(path):
    """`path` (an existing folder) refuses new entries inside the block; writable again after it. Files already in
    it stay writable, as after `chmod a-w` of the folder alone."""
    path = str(path)
    os.chmod(path, 0o555)
    root = os.geteuid() == 0
    immutable = root and subprocess.run(["chattr", "+i", path], capture_output=True).returncode == 0
    try:
        if root and not immutable:
            pytest.skip("running as root without chattr: no way to make a folder read-only here")
        yield path
    finally:
        if immutable:
            subprocess.run(["chattr", "-i", path], check=True)
        os.chmod(path, 0o755)
