"""Run a test function on W gloo ranks (CPU processes) and collect what each rank returns.

Usage inside a test:

    def body(rank, world_size, x):      # module-level, so it can be pickled
        ...
        return some_tensor_or_dict

    results = run_ranks(body, world_size=2, args=(x,))   # list, one entry per rank

Each rank (a fresh process, forked from a server that imported torch and the project once) joins a gloo process
group on 127.0.0.1 with a free port (bench._common.free_port, which the tests import from here), runs
`fn(rank, world_size, *args)`, and sends its return value back through a queue. A rank that raises makes `run_ranks`
raise with that rank's traceback, so failures read like ordinary test failures.
"""

import io
import os
import subprocess
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bench._common import free_port  # the one copy: the tests' ranks draw their port as the benches' ranks do
from dist.setup import shutdown


def _worker(rank, world_size, port, fn, args, queue, init_group):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)
    try:
        if init_group:
            dist.init_process_group("gloo", rank=rank, world_size=world_size)
        result = fn(rank, world_size, *args)
        # Serialized to bytes: tensors sent through the queue as-is would live in this process's shared
        # memory, which is gone once it exits.
        buffer = io.BytesIO()
        torch.save(result, buffer)
        queue.put((rank, "ok", buffer.getvalue()))
    except BaseException:  # noqa: BLE001 - every failure must reach the parent
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        shutdown()  # the product's: torch < 2.8 could deadlock destroying a group (dist/comm.py's RECENT)


# What the server imports before it forks the first rank: torch; torch._dynamo, which a rank would otherwise import
# on its first torch.optim optimizer or DistributedDataParallel (1.5-2.5 s each time); and train (the project's
# modules, tyro, TensorBoard) and pytest, which a rank imports with the test module its function is pickled from.
# Last, tests.frozen_heap: what these built, frozen out of the cyclic GC (a rank's collections would copy it).
PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "pytest", "train", "tests.multirank", "tests.frozen_heap"]


def _context():
    """Fresh processes as `spawn` makes them, forked from a server that imported PRELOAD once per test session:
    the 2-3 s import of torch (and ~2 s more) is paid once, not by every rank of every test (the server runs no
    torch op, so its children start with no threads or device state)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def run_ranks(fn, world_size: int, args: tuple = (), timeout: float = 120.0, init_group: bool = True) -> list:
    """Spawn `world_size` gloo processes running `fn(rank, world_size, *args)`; return their results by rank.

    With `init_group=False` the process group is left to `fn` (torchrun's environment variables are set).
    """
    ctx = _context()
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, fn, args, queue, init_group))
             for r in range(world_size)]
    for p in procs:
        p.start()
    results, errors = [None] * world_size, []
    try:
        for _ in range(world_size):
            rank, status, payload = queue.get(timeout=timeout)
            if status == "ok":
                results[rank] = torch.load(io.BytesIO(payload), weights_only=False)
            else:
                errors.append(f"rank {rank} failed:\n{payload}")
                break  # the other ranks may be stuck in a collective with the failed one
    finally:
        for p in procs:
            p.join(timeout=5 if not errors else 1)
            if p.is_alive():
                p.kill()
    if errors:
        raise RuntimeError("\n".join(errors))
    return results


def run_processes(cmd: list[str], world_size: int, cwd: str, timeout: float, stderr=subprocess.PIPE) -> tuple:
    """Run `cmd` as the `world_size` ranks of one job on this host, each with the variables torchrun gives a rank
    (a port from free_port; OMP_NUM_THREADS=1), and wait up to `timeout` s for each; any still running is killed.
    Returns (exit codes, (stdout, stderr) per rank); stderr=subprocess.STDOUT folds each rank's stderr in."""
    port = str(free_port())
    procs = [subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=stderr, text=True,
                              env={**os.environ, "OMP_NUM_THREADS": "1", "RANK": str(r), "LOCAL_RANK": str(r),
                                   "WORLD_SIZE": str(world_size), "LOCAL_WORLD_SIZE": str(world_size),
                                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port})
             for r in range(world_size)]
    try:
        outputs = [p.communicate(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            p.kill()
    return [p.returncode for p in procs], outputs
