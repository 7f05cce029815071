"""What travels between one sender rank and its receivers: frames, JSON documents, buckets.

Every message goes through dist.comm's counted wrappers: updates under the purpose "weight_sync",
init, bootstrap, start checks and resync under "weight_sync_setup", so the ledger sees every byte.

After init, everything is a frame: a fixed 8 x int64 header, then up to two bodies (a table of int64
rows, then a byte payload) whose sizes the header announces. Because sizes are in the header, a receiver
can drain frames it does not want (queued patches before a resync) without knowing their contents.
The header's last word checks the header itself, the table and (buckets) the payload, so a flipped
version, count or table entry is refused before anything is written. Nothing is pickled.

A payload is several typed segments packed into one uint8 buffer, laid out by element size, largest
first, so that each segment is an aligned typed view of the received buffer (no copies, no padding).
"""

import json
from dataclasses import dataclass
from typing import Callable, NamedTuple, Sequence

import torch

from dist import comm
from dist.checksum import checksum

MAGIC = 0x53594E43  # "SYNC": a receiver reading a stray message fails loudly instead of decoding garbage
KIND_BUCKET, KIND_PATCH, KIND_RESYNC = 1, 2, 3
HEADER_BYTES = 8 * 8
UPDATE, SETUP = "weight_sync", "weight_sync_setup"  # ledger purposes


class SyncIntegrityError(RuntimeError):
    """An update was refused: lost, reordered or corrupted. Recover with resync() on both sides.

    `model_written` says whether the refusal came after the model was written (a dense write whose
    checksum did not match, or a periodic verification that found the model changed): the model is then
    in an unknown state and the receiver refuses every update until resync().
    """

    def __init__(self, message: str, model_written: bool = False):
        super().__init__(message)
        self.model_written = model_written


@dataclass
class SyncStats:
    """What the sender's last sync or resync put on the wire, per receiver."""
    wire_bytes: int  # headers, tables and payloads as sent (after compression)
    payload_bytes: int  # index and value bytes before compression
    changed_elements: int  # elements whose bits differ from the previous version (bucket: all of them)
    sparse_tensors: int = 0
    dense_tensors: int = 0


class Header(NamedTuple):
    kind: int
    version: int
    base_version: int  # patch: the version it applies to; bucket and resync: -1
    rows: int  # patch: table rows; bucket and resync: bucket index
    wire_bytes: int  # payload bytes on the wire (after compression)
    raw_bytes: int  # payload bytes after decompression
    check: int = 0  # checksum of the other words, the table and (bucket, resync) the payload

    def sealed(self, table: torch.Tensor, payload: torch.Tensor | None) -> "Header":
        return self._replace(check=int(_check(self, table, payload)))

    def verify(self, table: torch.Tensor, payload: torch.Tensor | None) -> None:
        if int(_check(self, table, payload)) != self.check:
            raise SyncIntegrityError(f"weight sync: frame {tuple(self)} failed its checksum (header, table or payload "
                                     "corrupted); call resync() on sender and receivers")


def _check(header: Header, table: torch.Tensor, payload: torch.Tensor | None) -> torch.Tensor:
    device = payload.device if payload is not None else table.device
    words = torch.tensor([MAGIC, *header[:-1]], dtype=torch.int64, device=device)
    parts = [words, table.to(device)] + ([payload] if payload is not None else [])
    return checksum(parts).cpu()


def send_frame(header: Header, table: torch.Tensor, payload: torch.Tensor, dsts: Sequence[int], group, device,
               purpose: str) -> tuple[list, tuple]:
    """Start sending one frame (header, then table and payload when not empty) to every receiver.

    Crosses ranks: 1-3 messages per receiver. Messages between two ranks arrive in the order they were
    sent, which lets the header describe what follows. Returns (works, tensors that must outlive them).
    """
    words = torch.tensor([MAGIC, *header], dtype=torch.int64, device=device)
    tensors = [t for t in (words, table.to(device), payload) if t.numel()]
    return [comm.isend(t, purpose, dst, group) for dst in dsts for t in tensors], tensors


def wait_all(works: list) -> None:
    for work in works:
        work.wait()


def recv_frame(src: int, group, device, purpose: str) -> tuple[Header, torch.Tensor, torch.Tensor]:
    """Receive the next frame from `src`: header (one host sync), table, payload (still compressed)."""
    words = comm.recv(torch.empty(8, dtype=torch.int64, device=device), purpose, src, group)
    magic, *fields = words.tolist()
    if magic != MAGIC:
        raise RuntimeError(f"weight sync: received a message without the sync header (magic {magic:#x}); "
                           "sender and receiver are out of step or share the group with other traffic")
    header = Header(*fields)
    table = torch.empty(max(header.rows, 0) if header.kind == KIND_PATCH else 0, 5, dtype=torch.int64, device=device)
    if table.numel():
        comm.recv(table, purpose, src, group)
    payload = torch.empty(header.wire_bytes, dtype=torch.uint8, device=device)
    if payload.numel():
        comm.recv(payload, purpose, src, group)
    return header, table.cpu(), payload


def expect(header: Header, kind: int) -> None:
    if header.kind != kind:
        raise RuntimeError(f"weight sync: expected a message of kind {kind}, got kind {header.kind}; sender and "
                           "receiver disagree on which call comes next (sync/resync/apply)")


def send_json(obj, dst: int, group, device) -> None:
    """Send a small JSON document to `dst`: a length word then the bytes. Init only."""
    data = torch.tensor(list(json.dumps(obj).encode()), dtype=torch.uint8, device=device)
    comm.send(torch.tensor([data.numel()], dtype=torch.int64, device=device), SETUP, dst, group)
    comm.send(data, SETUP, dst, group)


def recv_json(src: int, group, device):
    length = comm.recv(torch.empty(1, dtype=torch.int64, device=device), SETUP, src, group)
    data = comm.recv(torch.empty(int(length.item()), dtype=torch.uint8, device=device), SETUP, src, group)
    return json.loads(bytes(data.cpu().tolist()).decode())


def layout(specs: Sequence[tuple[torch.dtype, int]]) -> tuple[list[int], int]:
    """Byte offset of each (dtype, numel) segment and the total size, largest element size first."""
    order = sorted(range(len(specs)), key=lambda i: -specs[i][0].itemsize)  # stable: ties keep their order
    offsets, cursor = [0] * len(specs), 0
    for i in order:
        dtype, numel = specs[i]
        offsets[i] = cursor
        cursor += dtype.itemsize * numel
    return offsets, cursor


def pack(segments: Sequence[torch.Tensor], device) -> torch.Tensor:
    """Concatenate 1-D typed tensors into one uint8 buffer on `device`, in the order `layout` gives."""
    if not segments:
        return torch.empty(0, dtype=torch.uint8, device=device)
    order = sorted(range(len(segments)), key=lambda i: -segments[i].dtype.itemsize)
    as_bytes = [segments[i].reshape(-1).view(torch.uint8) for i in order]
    return torch.cat([b.to(device) for b in as_bytes])


def unpack(payload: torch.Tensor, specs: Sequence[tuple[torch.dtype, int]]) -> list[torch.Tensor]:
    """Typed views into `payload` (no copies), one per (dtype, numel) spec; inverse of `pack`."""
    offsets, total = layout(specs)
    if total != payload.numel():
        raise SyncIntegrityError(f"weight sync: payload has {payload.numel()} bytes but its description needs {total}")
    return [payload[off:off + dtype.itemsize * numel].view(dtype) for off, (dtype, numel) in zip(offsets, specs)]


# ----- whole tensors in size-capped buckets: the bucket strategy, the patch bootstrap and every resync -----

def plan_buckets(nbytes: Sequence[int], bucket_size: int) -> list[list[int]]:
    """Consecutive runs of tensor indices, each at most `bucket_size` bytes unless a single tensor is larger.
    An empty list still gets one (empty) bucket, so that every update carries at least one header."""
    buckets, current, size = [], [], 0
    for index, n in enumerate(nbytes):
        if current and size + n > bucket_size:
            buckets.append(current)
            current, size = [], 0
        current.append(index)
        size += n
    if current or not buckets:
        buckets.append(current)
    return buckets


def send_buckets(items: Sequence[tuple[torch.Tensor, torch.dtype]], bucket_size: int, version: int, kind: int,
                 dsts: Sequence[int], group, device, purpose: str) -> tuple[int, int]:
    """Send each (tensor, wire dtype) whole, in order, to every receiver; returns (wire, payload) bytes per receiver.

    Crosses ranks: one frame (header and bytes, checksummed) per bucket to each receiver; once per bucket
    sync, bootstrap or resync. Bucket b+1 is packed while bucket b is in flight, and at most two buckets
    are alive at a time, so the sender never holds a second copy of the whole model.
    """
    plan = plan_buckets([t.numel() * dtype.itemsize for t, dtype in items], bucket_size)
    payload_bytes, in_flight = 0, None
    empty = torch.empty(0, 5, dtype=torch.int64)
    for index, members in enumerate(plan):
        payload = pack([items[i][0].detach().to(items[i][1]).reshape(-1) for i in members], device)
        header = Header(kind, version, -1, index, payload.numel(), payload.numel()).sealed(empty, payload)
        works, alive = send_frame(header, empty, payload, dsts, group, device, purpose)
        wait_all(in_flight[0] if in_flight else [])
        in_flight = (works, alive)  # what is sent must outlive its send
        payload_bytes += payload.numel()
    wait_all(in_flight[0])
    return HEADER_BYTES * len(plan) + payload_bytes, payload_bytes


def recv_buckets(items: Sequence[tuple[str, tuple, torch.dtype]], bucket_size: int, kind: int, src: int, group,
                 device, purpose: str, on_bucket: Callable[[list[tuple[str, torch.Tensor]]], None],
                 first: tuple | None = None) -> int:
    """Receive the buckets `send_buckets` sent for these (key, shape, wire dtype) items; returns the version.

    Crosses ranks: one frame per bucket from `src`. `first` is an already received first frame (resync
    finds it while draining). Each bucket is checked (header, plan, checksum) before `on_bucket([(key,
    flat typed view), ...])` sees it; the views share the bucket's buffer.
    """
    sizes = [int(torch.Size(shape).numel()) for _, shape, _ in items]
    plan = plan_buckets([n * dtype.itemsize for n, (_, _, dtype) in zip(sizes, items)], bucket_size)
    version = None
    for index, members in enumerate(plan):
        header, table, payload = first if (index == 0 and first) else recv_frame(src, group, device, purpose)
        expect(header, kind)
        header.verify(table, payload)
        specs = [(items[i][2], sizes[i]) for i in members]
        expected = sum(dtype.itemsize * n for dtype, n in specs)
        if (header.rows, header.raw_bytes, header.wire_bytes) != (index, expected, expected) \
                or version not in (None, header.version):
            raise SyncIntegrityError(
                f"weight sync: bucket header {tuple(header)} does not match the expected bucket {index} of {len(plan)} "
                f"with {expected} bytes at version {version}; sender and receiver disagree on the bucket plan")
        on_bucket([(items[i][0], view) for i, view in zip(members, unpack(payload, specs))])
        version = header.version
    return version


def copy_into(tensors: dict, pairs: Sequence[tuple[str, torch.Tensor]]) -> None:
    """Write received flat values into the model's tensors (converting the wire dtype to the model's)."""
    with torch.no_grad():
        for key, value in pairs:
            tensors[key].copy_(value.view(tensors[key].shape))
