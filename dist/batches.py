"""A learner and its rollout ranks: typed point-to-point messages for batches, decisions and checkpoint state.

Layouts are agreed once at start-up (each rollout rank sends one pickled description to its learner);
after that only flat tensors travel, counted in the ledger:

- `batches` (rollout -> learner, every iteration): the [T, N] batch as one float32 message plus one
  float64 message (weight version, stop flags, metric sums and counts);
- `control` (learner -> rollout, every iteration): the learners' agreed (stop, save) for that iteration;
- `checkpoint` (rollout -> learner, at saves): the rollout rank's RNG and env state as raw bytes.

All of it runs in the team's own group (`Roles.batches_group`); weights travel in another (sync/).
"""

import contextlib
import pickle
from dataclasses import dataclass

import torch

from . import comm
from .plan import PlanRow

SMALL = torch.float64     # fields of this dtype travel in the float64 message, everything else as float32
ENV_FIRST = ("last_critic_obs",)   # the [N, ...] fields of a batch; every other one is [T, N, ...]


@dataclass
class Layout:
    """name -> (shape, dtype) of every tensor of a message pair, in a fixed order. float64 fields travel as float64,
    the others as float32, which holds bool, 16-bit floats and integers up to 2**24 exactly: wider integer
    dtypes are refused."""
    fields: dict[str, tuple[tuple[int, ...], torch.dtype]]

    def __post_init__(self):
        wide = {name: str(dtype) for name, (_, dtype) in self.fields.items()
                if dtype in (torch.int32, torch.int64, torch.uint32, torch.uint64)}
        if wide:
            raise ValueError(f"batch layout: fields {wide} would travel as float32, which rounds integers past 2**24; "
                             "send them as float64")

    def wire(self, dtype: torch.dtype) -> torch.dtype:
        return SMALL if dtype == SMALL else torch.float32

    def sizes(self) -> dict[torch.dtype, int]:
        out = {torch.float32: 0, SMALL: 0}
        for shape, dtype in self.fields.values():
            out[self.wire(dtype)] += int(torch.Size(shape).numel())
        return out

    def pack(self, tensors: dict[str, torch.Tensor], out: dict[torch.dtype, torch.Tensor]) -> None:
        """Copy each field's tensor into the two wire buffers. Refused: a missing or unknown key (an unknown one would
        never reach the receiver), a tensor of another shape than its field's."""
        if tensors.keys() != self.fields.keys():
            raise ValueError(f"batch keys differ from its layout's: missing {sorted(self.fields.keys() - tensors)}, "
                             f"not in the layout {sorted(tensors.keys() - self.fields.keys())}")
        offsets = dict.fromkeys(out, 0)
        for name, (shape, dtype) in self.fields.items():
            if tuple(tensors[name].shape) != tuple(shape):
                raise ValueError(f"batch field {name!r} has shape {tuple(tensors[name].shape)}; its layout says "
                                 f"{tuple(shape)}")
            wire, n = self.wire(dtype), int(torch.Size(shape).numel())
            out[wire][offsets[wire]:offsets[wire] + n].copy_(tensors[name].reshape(-1))
            offsets[wire] += n

    def unpack(self, buffers: dict[torch.dtype, torch.Tensor]) -> dict[str, torch.Tensor]:
        offsets, out = dict.fromkeys(buffers, 0), {}
        for name, (shape, dtype) in self.fields.items():
            wire, n = self.wire(dtype), int(torch.Size(shape).numel())
            out[name] = buffers[wire][offsets[wire]:offsets[wire] + n].view(shape).to(dtype)
            offsets[wire] += n
        return out

    def message_bytes(self) -> list[int]:
        """Bytes of the two messages (float32, float64) that carry one set of these tensors."""
        return [n * (8 if dtype == SMALL else 4) for dtype, n in self.sizes().items()]

    def buffers(self, device) -> dict[torch.dtype, torch.Tensor]:
        return {dtype: torch.empty(n, dtype=dtype, device=device) for dtype, n in self.sizes().items()}


def send_object(obj, dst: int, group, purpose: str) -> int:
    """Crosses ranks once at start-up: a pickled description (size, then bytes), never per iteration.
    Returns the pickled size (for the plan row)."""
    data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    comm.send(torch.tensor([data.numel()], dtype=torch.int64), purpose, dst, group)
    comm.send(data, purpose, dst, group)
    return data.numel()


def recv_object(src: int, group, purpose: str) -> tuple[object, int]:
    """send_object's other end. Crosses ranks once at start-up: `src`'s pickled description, its size (one int64)
    then the bytes, never per iteration. Returns (object, size)."""
    size = int(comm.recv(torch.empty(1, dtype=torch.int64), purpose, src, group))
    data = comm.recv(torch.empty(size, dtype=torch.uint8), purpose, src, group)
    return pickle.loads(data.numpy().tobytes()), size


def setup_plan_row(sizes: list[int], collective: str) -> PlanRow:
    return PlanRow("setup", "layouts and env spec (pickled once)", collective, "setup",
                   [b for size in sizes for b in (8, size)])


# A learner waits for every rollout rank of its team (and the other learners) before it decides, publishes weights or
# exits: a rollout rank that sees it stall or die cannot tell whether the learner or one of those ranks is at fault.
LEARNER_WAITS = "or a rank it waits for (another rollout rank of its team or another learner)"


@contextlib.contextmanager
def naming(peer: int, role: str = "rollout"):
    """A failed message names the peer rank (it died or stalled), not only the purpose; the error's `peer` says which
    (a learner prefers it to what its weight-serving threads met meanwhile)."""
    try:
        yield
    except comm.CollectiveError as exc:
        also = f", {LEARNER_WAITS}" if role == "learner" else ""
        error = comm.CollectiveError(f"{role} rank {peer} died or stalled{also}: {exc}")
        error.peer = peer
        raise error from exc


class BatchSender:
    """A rollout rank's end: its batches up, the learners' decisions down, its state up at saves."""

    def __init__(self, learner: int, group, layout: Layout, state_bytes: int, device):
        self.learner, self.group, self.layout = learner, group, layout
        self.out = layout.buffers(device)
        self.state_bytes = state_bytes

    def send(self, tensors: dict[str, torch.Tensor]) -> None:
        """Crosses ranks: 2 sends per iteration (float32 batch, float64 extras) to this rank's learner."""
        self.layout.pack(tensors, self.out)
        with naming(self.learner, "learner"):
            for buffer in self.out.values():
                comm.send(buffer, "batches", self.learner, self.group)

    def decision(self) -> tuple[bool, bool]:
        """Crosses ranks: 1 receive per iteration, the learners' agreed (stop, save) for it."""
        with naming(self.learner, "learner"):
            stop, save = comm.recv(torch.empty(2, dtype=torch.float64), "control", self.learner, self.group).tolist()
        return bool(stop), bool(save)

    def send_state(self, blob: torch.Tensor) -> None:
        """Crosses ranks at saves: this rank's RNG and env state (uint8) to its learner."""
        with naming(self.learner, "learner"):
            comm.send(blob, "checkpoint", self.learner, self.group)

    def plan_rows(self, save_every: int) -> list[PlanRow]:
        return [PlanRow("batches", "[T, N] batch to the learner", "send", "iteration", self.layout.message_bytes()),
                PlanRow("control", "stop/save from the learners", "recv", "iteration", [16]),
                PlanRow("checkpoint", "RNG + env state to the learner", "send", "checkpoint", [self.state_bytes],
                        every=save_every)]


class BatchReceiver:
    """A learner's end. Keeps `depth` receives posted per rollout rank, so a rollout rank that runs ahead
    (async mode) can hand over its next batches while the learner is still updating.

    `layout` must be the one its rollout ranks send with (`recv_object` it from them): a message carries no layout,
    so nothing here checks it. Under gloo a receive layout larger than the sent one completes with its tail left
    uninitialized (no error), and a smaller one aborts this process (gloo's "Received data size doesn't match
    expected size"). Receives are posted for iterations `start` to `end - 1`: `take` is called `end - start` times."""

    def __init__(self, rollouts: list[int], group, layout: Layout, state_bytes: int, depth: int, start: int, end: int,
                 device):
        self.rollouts, self.group, self.layout, self.depth = rollouts, group, layout, depth
        self.state_bytes, self.device = state_bytes, device
        self.next_posted, self.end = start, end               # never post for an iteration past the run
        self.slots: list[list] = [[] for _ in rollouts]      # per rollout rank: (buffers, works) in order
        self.decisions: list = []                            # (rollout rank, tensor, work) not yet read

    def post(self) -> None:
        """Crosses ranks: 2 receives per rollout rank, posted ahead; completed by `take`."""
        for i, src in enumerate(self.rollouts):
            buffers = self.layout.buffers(self.device)
            with naming(src):      # gloo refuses to post a receive from a rank whose connection already closed
                works = [comm.irecv(b, "batches", src, self.group) for b in buffers.values()]
            self.slots[i].append((buffers, works))
        self.next_posted += 1

    def take(self) -> list[dict[str, torch.Tensor]]:
        """The oldest posted batch of every rollout rank (waits for it), topping the posted receives up.

        Crosses ranks once per iteration: completes each rollout rank's 2 posted receives (`post`)."""
        while len(self.slots[0]) < self.depth and self.next_posted < self.end:
            self.post()
        batches = []
        for i, src in enumerate(self.rollouts):
            buffers, works = self.slots[i].pop(0)
            with naming(src):
                for work in works:
                    work.wait()
            batches.append(self.layout.unpack(buffers))
        return batches

    def decide(self, stop: bool, save: bool) -> None:
        """Crosses ranks: 1 send per rollout rank per iteration. Not waited for: a rollout rank running ahead
        (async mode) reads it only before the collection that needs it, and the learner must not stall
        until then (a gloo send completes only once the receiver posts its receive)."""
        # gloo's point-to-point works report is_completed() only once waited for, so completion is inferred: a
        # rollout rank reads decision i before it sends batch i + depth, and batch i + depth has arrived once this
        # is decision i + depth, so every decision older than the last depth - 1 ones has been read (waits at once).
        while len(self.decisions) > (self.depth - 1) * len(self.rollouts):
            dst, _, work = self.decisions.pop(0)
            with naming(dst):
                work.wait()
        for dst in self.rollouts:
            decision = torch.tensor([float(stop), float(save)], dtype=torch.float64)
            with naming(dst):
                self.decisions.append((dst, decision, comm.isend(decision, "control", dst, self.group)))

    def close(self) -> None:
        """Wait until every rollout rank has read every decision sent to it. Crosses ranks once, at the end:
        completes the `control` sends still in flight (`decide`)."""
        for dst, _, work in self.decisions:
            with naming(dst):
                work.wait()
        self.decisions = []

    def states(self) -> torch.Tensor:
        """At a save: every rollout rank's state blob, concatenated in rank order. Crosses ranks once per save:
        one `checkpoint` receive from each rollout rank."""
        blobs = []
        for src in self.rollouts:
            with naming(src):
                blobs.append(comm.recv(torch.empty(self.state_bytes, dtype=torch.uint8), "checkpoint", src, self.group))
        return torch.cat(blobs)

    def plan_rows(self, save_every: int) -> list[PlanRow]:
        return [PlanRow("batches", "[T, N] batch from each rollout rank", "recv", "iteration",
                        self.layout.message_bytes() * len(self.rollouts)),
                PlanRow("control", "stop/save to each rollout rank", "send", "iteration", [16] * len(self.rollouts)),
                PlanRow("checkpoint", "RNG + env state of each rollout rank", "recv", "checkpoint",
                        [self.state_bytes] * len(self.rollouts), every=save_every)]


def concat_batches(batches: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Join rollout ranks' batches along the env axis: dim 1 of every [T, N, ...] field, dim 0 of the one [N, ...]
    field, `last_critic_obs` (ENV_FIRST); a copy with other [N, ...] fields must name them there."""
    if len(batches) == 1:
        return batches[0]
    return {k: torch.cat([b[k] for b in batches], dim=0 if k in ENV_FIRST else 1) for k in batches[0]}


def flatten_state(state: dict, prefix: str = "") -> dict[str, torch.Tensor]:
    """{"a": {"b": t}} -> {"a/b": t}: nested env state as flat named tensors (to travel as bytes)."""
    out = {}
    for key, value in state.items():
        if isinstance(value, dict):
            out.update(flatten_state(value, f"{prefix}{key}/"))
        else:
            out[f"{prefix}{key}"] = value
    return out


def unflatten_state(flat: dict[str, torch.Tensor]) -> dict:
    out: dict = {}
    for path, value in flat.items():
        *parents, leaf = path.split("/")
        node = out
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return out


def to_bytes(tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """Named tensors as one uint8 tensor (exact for every dtype); `from_bytes` with the layout undoes it."""
    return torch.cat([t.detach().cpu().contiguous().reshape(-1).view(torch.uint8) for t in tensors.values()]) \
        if tensors else torch.zeros(0, dtype=torch.uint8)


def from_bytes(blob: torch.Tensor, layout: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> dict[str, torch.Tensor]:
    out, offset = {}, 0
    for name, (shape, dtype) in layout.items():
        n = int(torch.Size(shape).numel()) * dtype.itemsize
        out[name] = blob[offset:offset + n].clone().view(dtype).reshape(shape)
        offset += n
    return out
