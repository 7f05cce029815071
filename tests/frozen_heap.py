"""Imported last by the forkserver of tests/multirank.py, after the rest of its PRELOAD: what those imports built is
frozen out of the cyclic GC (gc.freeze), so that a rank's collections do not touch, and so copy, every page of the
server's heap. Imported by nothing else."""

import gc

gc.collect()
gc.freeze()
