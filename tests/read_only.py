"""A folder made read-only for a test, whoever runs it: `chmod a-w` stops a user, but root writes anyway, so as root
the folder is also made immutable (`chattr +i`); where root cannot do that, the test fails saying so (skipped, it
would prove nothing)."""

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
            pytest.fail("running as root, and `chattr +i` failed (it needs CAP_LINUX_IMMUTABLE): no way to make a "
                        "folder read-only to root here; run the tests as a non-root user")
        yield path
    finally:
        if immutable:
            subprocess.run(["chattr", "-i", path], check=True)
        os.chmod(path, 0o755)
