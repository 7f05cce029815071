"""What travels between one sender rank and its receivers: frames, whole tensors in buckets, JSON.

Every message goes through dist.comm's counted wrappers: updates under the purpose "weight_sync",
init, bootstrap, start checks and resync under "weight_sync_setup", so the ledger sees every byte.

After init, everything is a frame (patch, bucket, bootstrap and resync alike):

    header   8 x int64: magic, kind, version, base version (-1 for whole tensors), rows,
             payload bytes on the wire and raw, check (of the other words and the table)
    table    [rows, 4] int64: tensor ordinal, values sent, encoding, position symbols
    payload  one message per segment (a row's positions, then its values), widest dtype first so that
             each is an aligned view of one buffer; a single zstd blob instead when compressed
    trailer  rows + 1 int64: each row's tensor checksum after the update, then a check of them all

Header and table are known before the payload is sent, and the trailer's checksums are computed while
the payload is in flight, so the sender's checksum work overlaps the transfer. All sizes are in the
header and the table: a receiver refuses a malformed frame before allocating anything, and can drain
frames it does not want (queued updates before a resync). Nothing is pickled.
"""

import json
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from dist import comm
from dist.checksum import checksum, tensor_checksum

MAGIC = 0x53594E43  # "SYNC": a receiver reading a stray message fails loudly instead of decoding garbage
KIND_BUCKET, KIND_PATCH, KIND_RESYNC = 1, 2, 3
UPDATE, SETUP = "weight_sync", "weight_sync_setup"  # ledger purposes
GAPS8, GAPS16, GAPS32, BITMAP, DENSE = range(5)  # how a row's positions travel (see patch.py)
SYMBOL_DTYPES = {GAPS8: torch.uint8, GAPS16: torch.int16, GAPS32: torch.int32, BITMAP: torch.uint8}
HEADER_BYTES, ROW_BYTES = 8 * 8, 4 * 8


class SyncIntegrityError(RuntimeError):
    """An update was refused: lost, reordered or corrupted. Recover with resync() on both sides.

    `model_written` says whether the refusal came after the model was written (a dense-ish sparse write
    whose checksum did not match, a bucket after earlier buckets landed, or a periodic verification that
    found the model changed): the receiver then refuses every update until resync().
    """

    def __init__(self, message: str, model_written: bool = False):
        super().__init__(message)
        self.model_written = model_written


@dataclass
class SyncStats:
    """What the sender's last sync or resync put on the wire, per receiver."""
    wire_bytes: int  # headers, tables, payloads (after compression) and trailers
    payload_bytes: int  # position and value bytes before compression
    changed_elements: int  # elements whose bits differ from the previous version (whole tensors: all of them)
    sparse_tensors: int = 0
    dense_tensors: int = 0


def frame_messages(rows: int, segments: Sequence[int]) -> list[int]:
    """Bytes of each message of an uncompressed frame with these non-empty payload segments, in order."""
    return [HEADER_BYTES] + ([rows * ROW_BYTES, *segments, (rows + 1) * 8] if rows else [])


def layout(specs: Sequence[tuple[torch.dtype, int]]) -> tuple[list[int], list[int], int]:
    """Send order (widest element first: every segment an aligned view), byte offsets in spec order, total."""
    order = sorted(range(len(specs)), key=lambda i: -specs[i][0].itemsize)  # stable: ties keep their order
    offsets, cursor = [0] * len(specs), 0
    for i in order:
        offsets[i] = cursor
        cursor += specs[i][0].itemsize * specs[i][1]
    return order, offsets, cursor


def send_frame(kind: int, version: int, base: int, table: torch.Tensor, segments: Sequence[torch.Tensor],
               sums: Callable[[], list], dsts: Sequence[int], group, device, purpose: str,
               compress: Optional[Callable] = None) -> tuple[int, int]:
    """Send one frame to every receiver; returns its (wire, raw payload) bytes per receiver.

    Crosses ranks: header, table, each payload segment (or one compressed blob) and the trailer, to each
    receiver, all non-blocking; `sums()` (each row's checksum after the update) runs while the payload is
    in flight. Messages between two ranks arrive in the order they were sent. Returns once every send
    completed, so that the caller may then commit what it sent.
    """
    order, _, raw = layout([(s.dtype, s.numel()) for s in segments])
    payload = [segments[i].reshape(-1) for i in order if segments[i].numel()]
    if compress is not None and payload:
        payload = [compress(torch.cat([p.view(torch.uint8) for p in payload]))]
    payload = [p.to(device) for p in payload]
    wire = sum(p.numel() * p.element_size() for p in payload)
    words = torch.tensor([MAGIC, kind, version, base, len(table), wire, raw], dtype=torch.int64)
    head = [torch.cat([words, checksum([words, table]).view(1)]).to(device)] + ([table.to(device)] if len(table) else [])
    works = [comm.isend(t, purpose, dst, group) for t in head + payload for dst in dsts]
    if len(table):
        trailer = torch.stack([torch.as_tensor(s).cpu() for s in sums()])
        trailer = torch.cat([trailer, checksum([words, trailer]).view(1)]).to(device)
        works += [comm.isend(trailer, purpose, dst, group) for dst in dsts]
    for work in works:
        work.wait()
    return HEADER_BYTES + (len(table) * ROW_BYTES + wire + (len(table) + 1) * 8 if len(table) else 0), raw


@dataclass
class Frame:
    """A received frame whose payload may still be arriving: `row(r)` waits for row r's (positions or
    None, values); `sums()` waits for everything and returns the trailer's checksums, checked."""
    kind: int
    version: int
    base: int
    table: torch.Tensor  # [rows, 4] int64 on the host
    wire_bytes: int
    raw_bytes: int
    check: int
    payload: torch.Tensor  # uint8, raw_bytes: every segment is a typed view of it
    segments: list  # in row order: positions (unless dense), values
    works: list  # per segment: its receive while still pending, else None
    trailer: Optional[torch.Tensor]
    trailer_work: object = None

    def words(self) -> torch.Tensor:
        return torch.tensor([MAGIC, self.kind, self.version, self.base, len(self.table), self.wire_bytes,
                             self.raw_bytes], dtype=torch.int64)

    def check_header(self) -> None:
        if int(checksum([self.words(), self.table])) != self.check:
            raise SyncIntegrityError(f"weight sync: frame header {self.words().tolist()} or its table failed its "
                                     "checksum (corrupted); call resync() on sender and receivers")

    def row(self, r: int) -> tuple[Optional[torch.Tensor], torch.Tensor]:
        first = r + int((self.table[:r, 2] != DENSE).sum())  # earlier rows with a positions segment
        if int(self.table[r, 2]) == DENSE:
            return None, self._ready(first)
        return self._ready(first), self._ready(first + 1)

    def _ready(self, i: int) -> torch.Tensor:
        if self.works[i] is not None:
            self.works[i].wait()
            self.works[i] = None
        return self.segments[i]

    def wait(self) -> None:
        for i in range(len(self.segments)):
            self._ready(i)
        if self.trailer_work is not None:
            self.trailer_work.wait()
            self.trailer_work = None

    def sums(self) -> list[int]:
        """Wait for everything; the sender's checksum of each row's tensor after the update, checked."""
        self.wait()
        if self.trailer is None:
            return []
        sums = self.trailer[:-1].cpu()
        if int(checksum([self.words(), sums])) != int(self.trailer[-1]):
            raise SyncIntegrityError(f"weight sync: the checksums of frame version {self.version} failed their "
                                     "check (trailer corrupted); call resync() on sender and receivers")
        return sums.tolist()


def recv_frame(src: int, group, device, purpose: str | Callable[[int], str], numels: Sequence[int],
               value_dtypes: Sequence[torch.dtype] | Callable, staging: Optional[list] = None,
               decompress: Optional[Callable] = None) -> Frame:
    """Receive the next frame from `src`: header and table (checked, blocking), then start receiving the
    payload and trailer (see Frame). `purpose`: the ledger purpose, or a function of the frame's kind
    (resync drains queued updates under the purpose they were sent with). `numels`, `value_dtypes`: per
    tensor ordinal (dtypes: or a function of the kind). `staging`: [buffer] reused across frames (grown when too small), else a fresh buffer.
    """
    purpose_of = purpose if callable(purpose) else (lambda kind: purpose)
    head = comm.recv_then_count(torch.empty(8, dtype=torch.int64, device=device),
                                lambda h: purpose_of(int(h[1])), src, group).cpu()
    words = head[:7]
    magic, kind, version, base, rows, wire, raw = words.tolist()
    if magic != MAGIC:
        raise RuntimeError(f"weight sync: received a message without the sync header (magic {magic:#x}); "
                           "sender and receiver are out of step or share the group with other traffic")
    purpose = purpose_of(kind)
    value_dtypes = value_dtypes(kind) if callable(value_dtypes) else value_dtypes
    if not 0 <= rows <= len(numels):
        raise SyncIntegrityError(f"weight sync: frame header {words.tolist()} announces {rows} table rows")
    table = torch.empty(rows, 4, dtype=torch.int64, device=device)
    table = comm.recv(table, purpose, src, group).cpu() if rows else table.cpu()
    if int(checksum([words, table])) != int(head[7]):
        raise SyncIntegrityError(f"weight sync: frame header {words.tolist()} or its table failed its checksum "
                                 "(corrupted); call resync() on sender and receivers")
    check_table(table, numels)
    specs = [spec for ordinal, values, encoding, symbols in table.tolist()
             for spec in ([] if encoding == DENSE else [(SYMBOL_DTYPES[encoding], symbols)]) + [(value_dtypes[ordinal], values)]]
    order, offsets, total = layout(specs)
    if total != raw or (decompress is None and wire != raw):
        raise SyncIntegrityError(f"weight sync: frame header {words.tolist()} announces payload sizes its table "
                                 f"does not ({total} bytes); call resync() on sender and receivers")
    buffer = staging[0] if staging and staging[0].device == torch.device(device) else None
    if buffer is None or buffer.numel() < raw:
        buffer = torch.empty(raw, dtype=torch.uint8, device=device)
        if staging is not None:
            staging[:] = [buffer]
    segments = [buffer[off:off + dtype.itemsize * n].view(dtype) for off, (dtype, n) in zip(offsets, specs)]
    works = [None] * len(specs)
    if decompress is not None and wire:
        blob = comm.recv(torch.empty(wire, dtype=torch.uint8, device=device), purpose, src, group)
        buffer[:raw].copy_(decompress(blob, raw))
    elif decompress is None:
        for i in order:  # in send order: messages between two ranks match in the order they were posted
            works[i] = comm.irecv(segments[i], purpose, src, group) if specs[i][1] else None
    trailer = torch.empty(rows + 1, dtype=torch.int64, device=device) if rows else None
    trailer_work = comm.irecv(trailer, purpose, src, group) if rows else None
    return Frame(kind, version, base, table, wire, raw, int(head[7]), buffer[:raw], segments, works, trailer, trailer_work)


def check_table(table: torch.Tensor, numels: Sequence[int]) -> None:
    """Refuse rows that name no tensor or repeat one, or whose sizes are impossible for their encoding."""
    last = -1
    for row in table.tolist():
        ordinal, values, encoding, symbols = row
        numel = numels[ordinal] if last < ordinal < len(numels) else -1
        ok = {DENSE: values == numel and symbols == 0,
              BITMAP: 0 < values < numel and symbols == (numel + 7) // 8}.get(
            encoding, encoding in SYMBOL_DTYPES and 0 < values < numel and values <= symbols < 2**40)
        if not ok:
            raise SyncIntegrityError(f"weight sync: malformed table row {row} (unknown or repeated tensor, or "
                                     "impossible sizes); call resync() on sender and receivers")
        last = ordinal


def expect(frame: Frame, kind: int) -> None:
    if frame.kind != kind:
        raise RuntimeError(f"weight sync: expected a message of kind {kind}, got kind {frame.kind}; sender and "
                           "receiver disagree on which call comes next (sync/resync/apply)")


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


def send_buckets(items: Sequence[tuple[int, torch.Tensor, torch.dtype]], bucket_size: int, version: int, kind: int,
                 dsts: Sequence[int], group, device, purpose: str) -> tuple[int, int]:
    """Send each (ordinal, tensor, wire dtype) whole, one frame of dense rows per bucket, to every receiver;
    returns (wire, payload) bytes per receiver.

    Crosses ranks: one frame per bucket to each receiver, once per bucket sync, bootstrap or resync. A
    tensor already in its wire dtype travels from its own memory (no packing copy); the checksums that
    end each frame are computed while its values are in flight.
    """
    plan = plan_buckets([t.numel() * dtype.itemsize for _, t, dtype in items], bucket_size)
    wire = payload = 0
    for members in plan:
        values = [items[i][1].detach().reshape(-1).to(items[i][2]) for i in members]
        table = torch.tensor([[items[i][0], v.numel(), DENSE, 0] for i, v in zip(members, values)],
                             dtype=torch.int64).view(-1, 4)
        sent = send_frame(kind, version, -1, table, values, lambda: [tensor_checksum(v) for v in values],
                          dsts, group, device, purpose)
        wire, payload = wire + sent[0], payload + sent[1]
    return wire, payload


def recv_buckets(ordinals: Sequence[int], numels: Sequence[int], wire_dtypes: Sequence[torch.dtype],
                 bucket_size: int, kind: int, src: int, group, device, purpose: str,
                 on_bucket: Callable[[list[tuple[int, torch.Tensor]]], None], first: Optional[Frame] = None,
                 staging: Optional[list] = None) -> int:
    """Receive the buckets `send_buckets` sent for these tensor ordinals; returns the version.

    Crosses ranks: one frame per bucket from `src`. `first`: an already received first frame (resync finds
    it while draining). Each bucket is checked (plan, values against the trailer's checksums, checksummed
    as they arrive) before `on_bucket([(ordinal, flat typed view), ...])` sees it.
    """
    plan = plan_buckets([numels[o] * wire_dtypes[o].itemsize for o in ordinals], bucket_size)
    version = None
    for index, members in enumerate(plan):
        frame = first if (index == 0 and first) else recv_frame(src, group, device, purpose, numels, wire_dtypes, staging)
        expect(frame, kind)
        if frame.table[:, 0].tolist() != [ordinals[i] for i in members] or version not in (None, frame.version):
            raise SyncIntegrityError(
                f"weight sync: bucket {index} of {len(plan)} at version {frame.version} carries tensors "
                f"{frame.table[:, 0].tolist()}, expected {[ordinals[i] for i in members]} at version {version}; "
                "sender and receiver disagree on the bucket plan")
        got = [tensor_checksum(frame.row(r)[1]) for r in range(len(members))]  # each as soon as it arrived
        if (torch.stack(got).tolist() if got else []) != frame.sums():
            raise SyncIntegrityError(f"weight sync: bucket {index} at version {frame.version} does not match its "
                                     "checksums (corrupted on the way); call resync() on sender and receivers")
        on_bucket(list(zip(frame.table[:, 0].tolist(), frame.segments)))
        version = frame.version
    return version


def send_json(obj, dst: int, group, device) -> int:
    """Send a small JSON document to `dst`: a length word then the bytes (init only); returns its length."""
    data = torch.tensor(list(json.dumps(obj).encode()), dtype=torch.uint8, device=device)
    comm.send(torch.tensor([data.numel()], dtype=torch.int64, device=device), SETUP, dst, group)
    comm.send(data, SETUP, dst, group)
    return data.numel()


def recv_json(src: int, group, device) -> tuple[object, int]:
    length = comm.recv(torch.empty(1, dtype=torch.int64, device=device), SETUP, src, group)
    data = comm.recv(torch.empty(int(length.item()), dtype=torch.uint8, device=device), SETUP, src, group)
    return json.loads(bytes(data.cpu().tolist()).decode()), data.numel()
