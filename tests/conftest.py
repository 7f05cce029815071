import os

# Multi-rank tests run several processes on 2 cores: one thread each keeps them from oversubscribing.
os.environ.setdefault("OMP_NUM_THREADS", "1")
