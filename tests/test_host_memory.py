"""keep_freed_host_memory (dist/setup.py): freed host memory stays in the process's heap instead of going
back to the OS, so the next allocations of the update do not page-fault. Each case runs in a fresh
process (malloc settings are process-wide and cannot be undone), reading glibc's own heap statistics."""

import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = """
import ctypes, sys, torch
sys.path.insert(0, {repo!r})
from dist.setup import keep_freed_host_memory

class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]

libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo2
applied = keep_freed_host_memory() if {tuned} else None
# 60 x 3 MiB + 20 MiB + 48 MiB, as activations: the last is above glibc's largest mmap threshold (32 MiB), as the
# large bench setting's 50 MB activations are
tensors = [torch.ones(3 << 18) for _ in range(60)] + [torch.ones(5 << 20), torch.ones(12 << 20)]
del tensors
print(applied, libc.mallinfo2().fordblks >> 20)   # MB of freed memory the heap kept
"""


def freed_memory_kept(tuned: bool) -> tuple[str, int]:
    """(what keep_freed_host_memory returned, or None when not called; MB of freed memory the heap kept)."""
    out = subprocess.run([sys.executable, "-c", SCRIPT.format(repo=REPO, tuned=tuned)], check=True,
                         capture_output=True, text=True).stdout.split()
    return out[0], int(out[1])


@pytest.mark.parametrize("tuned", [False, True])
def test_freed_activations_stay_in_the_heap_only_when_asked(tuned):
    applied, kept_mb = freed_memory_kept(tuned)
    if tuned:
        assert applied == "True" and kept_mb >= 248     # all 248 MiB kept for the next minibatch, the 48 MiB too
    else:
        assert applied == "None" and kept_mb < 10       # glibc's default: mapped fresh and returned each time
