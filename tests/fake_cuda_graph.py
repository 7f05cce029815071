"""A CUDA graph on CPU, for the tests of code that captures one (ppo/minibatch_step.py's SyncFreeStep).

What a real capture does, and this stand-in does at the level of aten ops (a TorchDispatchMode):
- `torch.cuda.graph(g)` records the kernels its block launches and runs none of them. The Python inside the block
  runs once, here: a counter it bumps, a branch it takes, a tensor it allocates are what the graph holds. The
  stand-in runs each op (Python needs the results' shapes), then puts every tensor that existed before back as it
  was and fills every floating tensor made inside with NaN (a real one is uninitialized until the first replay).
- A host read inside the block (`.item()`, `bool(t)`, `nonzero`, a boolean mask) fails the capture; here it raises.
- `g.replay()` launches the recorded kernels again on the same memory: the stand-in runs the recorded ops again on
  the recorded tensors, writing each result where the captured op wrote it, and waits for each collective it issues
  (as the recorded stream dependencies make a GPU's later kernels do). No Python of the block runs. Like a GPU's, it
  holds the memory made before the capture by address only: a tensor replaced after the capture (not written in
  place) and held by nothing else makes a replay raise, where a GPU's would work on the freed memory.
So a step that is right eagerly but leans on Python state at run time, or on something made inside the capture that
a replay makes again (Adam creating its moments, zero-filled), differs here as on a GPU. Not modelled: streams
(the stand-ins below only let the code that waits on them run), memory pools, concurrency with other threads.
"""

import contextlib

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_unflatten

aten = torch.ops.aten
HOST_READS = {aten._local_scalar_dense, aten.is_nonzero, aten.equal, aten.nonzero, aten.masked_select}


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


class _ByAddress:
    """A tensor made before the capture, as a GPU's graph holds it: its memory's address, which keeps nothing alive."""

    def __init__(self, t: torch.Tensor):
        self.storage = StorageWeakRef(t.untyped_storage())
        self.view = t.dtype, t.storage_offset(), t.size(), t.stride()

    def get(self) -> torch.Tensor:
        storage = torch.UntypedStorage._new_with_weak_ptr(self.storage.cdata)
        dtype, offset, size, stride = self.view
        if storage is None:
            raise RuntimeError(f"a replay reads or writes a {dtype} tensor of shape {tuple(size)} whose memory was "
                               f"freed after capture (the tensor replaced, not written in place): a GPU's replay "
                               f"would work on whatever reuses that memory")
        return torch.empty(0, dtype=dtype).set_(storage, offset, size, stride)


class CUDAGraph:
    """torch.cuda.CUDAGraph's stand-in: what `graph` recorded into it runs again at each `replay()`."""

    def __init__(self):
        self.ops, self.replays, self.capture_error_mode = [], 0, None

    def replay(self) -> None:
        with torch.no_grad():
            for func, args, kwargs, outs in self.ops:
                leaves, spec = tree_flatten((args, kwargs, outs))
                args, kwargs, outs = tree_unflatten([x.get() if isinstance(x, _ByAddress) else x for x in leaves], spec)
                for new, out in zip(tree_flatten(func(*args, **kwargs))[0], outs):
                    if isinstance(out, torch.Tensor) and _storage(new) != _storage(out):
                        out.copy_(new)      # a fresh result: into the memory the captured op's result has
                    elif isinstance(new, torch.ScriptObject) and hasattr(new, "wait"):
                        # A collective's work (gloo runs it on its own threads): the block's work.wait() is no op the
                        # recorder sees, yet a real graph orders the kernels after it behind the collective.
                        new.wait()
        self.replays += 1


class _Recorder(TorchDispatchMode):
    def __init__(self, cuda_graph: CUDAGraph):
        super().__init__()
        self.graph, self.before, self.born, self.born_storages = cuda_graph, {}, [], set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        masks = func.overloadpacket is aten.index and any(t.dtype == torch.bool for t in inputs[1:])
        if func.overloadpacket in HOST_READS or masks:
            raise RuntimeError(f"{func} inside a CUDA graph capture: a host read, which fails the capture")
        for t in inputs:    # first seen, so not yet written by the block: kept to be put back
            if _storage(t) not in self.born_storages and _storage(t) not in self.before:
                self.before[_storage(t)] = (t.untyped_storage(), t.untyped_storage().clone())
        result = func(*args, **kwargs)
        outs = tree_flatten(result)[0]
        if func.namespace != "profiler":     # optimizer.step's profiler marks launch no kernel
            self.graph.ops.append((func, args, kwargs, outs))
        known = {_storage(t) for t in inputs}
        fresh = [t for t in outs if isinstance(t, torch.Tensor) and _storage(t) not in known]
        self.born += fresh
        self.born_storages.update(map(_storage, fresh))
        return result


@contextlib.contextmanager
def graph(cuda_graph: CUDAGraph, pool=None, stream=None, capture_error_mode: str = "global"):
    """torch.cuda.graph's stand-in (same signature): records the block into `cuda_graph`, leaves memory as it was."""
    if capture_error_mode not in ("global", "thread_local", "relaxed"):
        raise ValueError(f"unknown capture_error_mode {capture_error_mode!r}")   # as torch's cudaStreamCaptureMode
    cuda_graph.capture_error_mode = capture_error_mode    # kept for the tests: the stand-in models no other threads
    recorder = _Recorder(cuda_graph)
    with recorder:
        yield
    with torch.no_grad():
        for storage, saved in recorder.before.values():
            storage.copy_(saved)
        for t in recorder.born:
            if t.is_floating_point():
                t.detach().fill_(float("nan"))
    # The graph's own memory (born inside: a GPU's graph keeps its pool) stays held, as does no memory at all.
    by_address = {id(x): _ByAddress(x) for op in cuda_graph.ops for x in tree_flatten(op[1:])[0]
                  if isinstance(x, torch.Tensor) and _storage(x) not in recorder.born_storages
                  and x.untyped_storage().nbytes()}
    for i, (func, *rest) in enumerate(cuda_graph.ops):
        leaves, spec = tree_flatten(rest)
        cuda_graph.ops[i] = (func, *tree_unflatten([by_address.get(id(x), x) for x in leaves], spec))


class Stream:
    """torch.cuda.Stream's stand-in: the warm-up's stream juggling runs, in order, as everything on CPU does."""

    def wait_stream(self, other) -> None:
        pass


def install(monkeypatch) -> None:
    """Make torch.cuda's graph and stream API the stand-ins above for one test."""
    monkeypatch.setattr(torch.cuda, "CUDAGraph", CUDAGraph)
    monkeypatch.setattr(torch.cuda, "graph", graph)
    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "current_stream", Stream)
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
