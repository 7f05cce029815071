"""Point-to-point messages between one sender rank and its receiver ranks.

Two kinds of traffic:
- once at init, small JSON documents (metadata, handshake replies) as a length word plus UTF-8 bytes;
- every update afterwards, typed tensors only: a fixed 8-word int64 header, then byte payloads whose
  layout both sides derive from the header and the init metadata. Nothing is pickled.

A payload is several typed segments (indices, values) packed into one uint8 buffer. Segments are laid
out by element size, largest first, so that every segment starts at a multiple of its own element size
and can be read back as a typed view without padding or copies.

Ranks are global ranks; `group` is the process group the messages travel in (None = WORLD).
"""

import json
from typing import NamedTuple, Sequence

import torch
import torch.distributed as dist

MAGIC = 0x53594E43  # "SYNC": a receiver reading a stray message fails loudly instead of decoding garbage
KIND_BUCKET, KIND_PATCH = 1, 2
HEADER_WORDS = 8
HEADER_BYTES = HEADER_WORDS * 8


class SyncIntegrityError(RuntimeError):
    """An update was refused: lost, reordered or corrupted. Recover with resync() on both sides.

    `model_written` says whether the refusal came after the model was already written (checksum
    mismatch): the model is then in an unknown state and the receiver refuses everything until resync().
    """

    def __init__(self, message: str, model_written: bool = False):
        super().__init__(message)
        self.model_written = model_written


class Header(NamedTuple):
    kind: int
    version: int
    base_version: int  # patch: the version the patch applies to; other kinds: -1
    count: int  # patch: number of table rows; bucket: bucket index
    wire_bytes: int  # payload bytes on the wire (after compression)
    raw_bytes: int  # payload bytes after decompression
    total: int  # bucket: number of buckets in this update; otherwise 0

    def to_tensor(self, device) -> torch.Tensor:
        return torch.tensor([MAGIC, *self], dtype=torch.int64, device=device)

    @classmethod
    def from_tensor(cls, words: torch.Tensor, expected_kind: int) -> "Header":
        magic, *fields = words.tolist()
        if magic != MAGIC:
            raise RuntimeError(f"weight sync: received a message without the sync header (magic {magic:#x}); "
                               "sender and receiver are out of step or share the group with other traffic")
        header = cls(*fields)
        if header.kind != expected_kind:
            raise RuntimeError(f"weight sync: expected a message of kind {expected_kind}, got kind {header.kind}; "
                               "sender and receiver disagree on which call comes next (sync/resync/apply)")
        return header


def isend_all(tensors: Sequence[torch.Tensor], dsts: Sequence[int], group) -> list:
    """Start sending `tensors`, in order, to every rank in `dsts`; returns the works to wait on.

    Crosses ranks: len(tensors) messages per receiver. Messages between one pair of ranks arrive in the
    order they were sent, which is what lets a header describe the payload that follows it.
    """
    return [dist.isend(t, dst=dst, group=group) for dst in dsts for t in tensors]


def wait_all(works: list) -> None:
    for work in works:
        work.wait()


def recv_header(src: int, group, device, expected_kind: int) -> Header:
    """Receive one fixed-size header (64 bytes) from `src`: the first message of every update."""
    words = torch.empty(HEADER_WORDS, dtype=torch.int64, device=device)
    dist.recv(words, src=src, group=group)
    return Header.from_tensor(words, expected_kind)


def recv_bytes(nbytes: int, src: int, group, device) -> torch.Tensor:
    """Receive a payload of exactly `nbytes` bytes (announced by the header before it) from `src`."""
    buffer = torch.empty(nbytes, dtype=torch.uint8, device=device)
    if nbytes:
        dist.recv(buffer, src=src, group=group)
    return buffer


def send_json(obj, dst: int, group, device) -> None:
    """Send a small JSON document to `dst`: a length word then the bytes. Init and resync only."""
    data = torch.tensor(list(json.dumps(obj).encode()), dtype=torch.uint8, device=device)
    dist.send(torch.tensor([data.numel()], dtype=torch.int64, device=device), dst=dst, group=group)
    dist.send(data, dst=dst, group=group)


def recv_json(src: int, group, device):
    """Receive one document sent by `send_json` from `src`."""
    length = torch.empty(1, dtype=torch.int64, device=device)
    dist.recv(length, src=src, group=group)
    data = torch.empty(int(length.item()), dtype=torch.uint8, device=device)
    dist.recv(data, src=src, group=group)
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
    # One concatenation where the segments live, then one copy: no per-segment device round trips.
    staging = as_bytes[0].device
    return torch.cat([b.to(staging) for b in as_bytes]).to(device)


def unpack(payload: torch.Tensor, specs: Sequence[tuple[torch.dtype, int]]) -> list[torch.Tensor]:
    """Typed views into `payload` (no copies), one per (dtype, numel) spec; inverse of `pack`."""
    offsets, total = layout(specs)
    if total != payload.numel():
        raise RuntimeError(f"weight sync: payload has {payload.numel()} bytes but its description needs {total}")
    return [payload[off:off + dtype.itemsize * numel].view(dtype) for off, (dtype, numel) in zip(offsets, specs)]


def dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"weight sync: unknown dtype {name!r} in metadata")
    return dtype
