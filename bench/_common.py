"""Checks more than one bench makes on its command line, in one place so their wording stays the same."""

import argparse
import os


def omp_threads(parser: argparse.ArgumentParser) -> int:
    """OMP_NUM_THREADS as a count (unset: 1), or argparse's one-line error: "", "abc" or "0" made libgomp warn and
    run a thread per core (torch: a ValueError or RuntimeError traceback)."""
    threads = os.environ.get("OMP_NUM_THREADS", "1")
    if not (threads.isascii() and threads.isdigit() and int(threads) >= 1):
        parser.error(f"OMP_NUM_THREADS={threads!r} is not a positive number of threads; set it to one (or unset it: 1)")
    return int(threads)


def refuse_repeats(parser: argparse.ArgumentParser, flag: str, values) -> None:
    """argparse's one-line error for a value listed twice (as parsed: 0 and 00 are one seed): each bench ran it once
    and dropped the other silently, or ran it twice into one folder, so a typo never showed."""
    twice = next((v for i, v in enumerate(values) if v in values[:i]), None)
    if twice is not None:
        parser.error(f"{flag} names {twice} twice; list each once")
