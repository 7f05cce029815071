"""What travels between the sender and its receivers: frames, and two JSON documents at init.

Every message goes through dist.comm's counted wrappers, under "weight_sync" (updates) or
"weight_sync_setup" (handshake, bootstrap, start checks, resync), so the ledger sees every byte.
After init everything is a frame (patch, bucket, bootstrap and resync alike):

    header   9 x int64: magic, kind, version, base version (-1 for whole tensors), rows,
             payload bytes on the wire and raw, check of those seven words, check of them and the table
    table    [rows, 4] int64: tensor ordinal, values sent, encoding, position symbols
    payload  one message per segment (a row's positions, then its values), widest dtype first so that
             each is an aligned view of one buffer; one message of all segments instead when they are small
             (at most PACK_BYTES: a copy that costs less than the per-message handshakes it saves), or a
             single zstd blob when compressed
    trailer  rows + 1 int64: each row's tensor checksum after the update, then a check of them all

The sender computes the trailer while the payload is in flight. All sizes are in the header and table, and each
is checked before a receive is sized by it (a table by the words' check, a payload by the table's): a receiver
refuses a malformed or damaged frame before allocating anything (a receive of the wrong size ends the process in
gloo) and can drain frames it does not want
(queued updates before a resync). Nothing is pickled. The optional zstd transform of a patch payload
(`patch.compression=zstd`) is at the end of this file.
"""

import json
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from dist import comm
from dist.checksum import checksum

MAGIC = 0x53594E43  # "SYNC": a receiver reading a stray message fails loudly instead of decoding garbage
FORMAT = 3  # of frames and checksums (2: checksums over byte lanes; 3: the header words checked before the table is
# received, and the handshake documents checksummed): the handshake refuses a peer of another
KIND_BUCKET, KIND_PATCH, KIND_RESYNC = 1, 2, 3
UPDATE, SETUP = "weight_sync", "weight_sync_setup"  # ledger purposes
GAPS8, GAPS16, GAPS32, BITMAP, DENSE = range(5)  # how a row's positions travel (see patch.py)
SYMBOL_DTYPES = {GAPS8: torch.uint8, GAPS16: torch.int16, GAPS32: torch.int32, BITMAP: torch.uint8}
HEADER_BYTES, ROW_BYTES = 9 * 8, 4 * 8
JSON_HEAD_BYTES = 3 * 8  # a handshake document's length, its checksum and a check of both
PACK_BYTES = 1 << 20
PAYLOAD = (-2, -2)  # the key of a packed payload's one receive in Frame.works
RESYNC_HINT = "call resync() on sender and receivers"
# A frame refused before its payload was received leaves that payload queued, and its sizes cannot be trusted
# to drain it: the next receive would read payload bytes as a header.
LINK_LOST = ("the rest of this frame is still queued and cannot be drained, so resync() cannot recover this "
             "link: create both syncers again on a fresh process group")


class SyncIntegrityError(RuntimeError):
    """An update was refused: lost, reordered or corrupted. Recover with resync() on both sides.

    `model_written`: the refusal came after the model was written (a whole tensor received in place, a
    dense-ish sparse write, or a periodic verification that found the model changed): the receiver then
    refuses every update until resync(). `link_lost`: the frame was refused before its payload was received,
    so resync() cannot recover (the message ends with LINK_LOST).
    """

    def __init__(self, message: str, model_written: bool = False, link_lost: bool = False):
        super().__init__(message)
        self.model_written, self.link_lost = model_written, link_lost


def lost_link(message: str) -> SyncIntegrityError:
    """The refusal of a frame whose payload is still queued: its message ends with LINK_LOST, its flag is set."""
    return SyncIntegrityError(f"{message}; {LINK_LOST}", link_lost=True)


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
    payload = [sum(segments)] if _packed(segments) else list(segments)
    return [HEADER_BYTES] + ([rows * ROW_BYTES, *payload, (rows + 1) * 8] if rows else [])


def _packed(segments: Sequence[int]) -> bool:
    """Whether these non-empty payload segments (bytes) travel as one message."""
    return len(segments) > 1 and sum(segments) <= PACK_BYTES


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
               compress: Optional[Callable] = None) -> tuple[int, int, list]:
    """Send one frame to every receiver; returns its (wire, raw payload) bytes per receiver and `sums()`.

    Crosses ranks: header, table, the payload (each segment, one packed message of them all, or one compressed
    blob) and the trailer (the header alone when no row), to each receiver, all non-blocking; `sums()` (each
    row's checksum after the update) runs while the payload is in flight. Returns once every send completed,
    so that the caller may then commit what it sent. When `sums()` raises, the receivers get a trailer that
    they refuse (the link stays in step for resync()) and the error is raised here.
    """
    order, _, raw = layout([(s.dtype, s.numel()) for s in segments])
    # Each segment crosses as its bytes: NCCL has no int16 (gaps16 symbols), uint16-64 or complex type (torch's
    # to_nccl_data_type, torch/csrc/cuda/nccl.cpp, refuses them), while gloo moves bytes whatever the dtype.
    payload = [segments[i].reshape(-1).view(torch.uint8) for i in order if segments[i].numel()]
    if (compress is not None and payload) or _packed([p.numel() for p in payload]):
        payload = [torch.cat(payload) if compress is None else compress(torch.cat(payload))]
    payload = [p.to(device) for p in payload]
    wire = sum(p.numel() * p.element_size() for p in payload)
    words = torch.tensor([MAGIC, kind, version, base, len(table), wire, raw], dtype=torch.int64)
    checks = torch.stack([checksum([words]), checksum([words, table])])
    head = [torch.cat([words, checks]).to(device)] + ([table.to(device)] if len(table) else [])
    works = [comm.isend(t, purpose, dst, group) for t in head + payload for dst in dsts]
    failure = None
    try:
        after = sums() if len(table) else []
        trailer = torch.stack([torch.as_tensor(s).cpu() for s in after]) if len(table) else None
    except BaseException as error:
        # The receivers hold this frame's header, table and payload and wait for its trailer: send one that they
        # refuse (zeros, its check off by one), so that the link stays in step for resync(), then raise.
        failure, trailer = error, torch.zeros(len(table), dtype=torch.int64)
    if trailer is not None:
        trailer = torch.cat([trailer, (checksum([words, trailer]) + (failure is not None)).view(1)]).to(device)
        works += [comm.isend(trailer, purpose, dst, group) for dst in dsts]
    for work in works:
        work.wait()
    if failure is not None:
        raise failure
    return sum(frame_messages(len(table), [wire])), raw, after  # header, table, `wire` payload bytes, trailer


@dataclass
class Frame:
    """A received frame whose payload may still be arriving: `row(r)` waits for row r's (positions or
    None, values); `sums()` waits for everything and returns the trailer's checksums, checked."""
    kind: int
    version: int
    base: int
    table: torch.Tensor  # [rows, 4] int64 on the host
    sizes: tuple  # payload bytes on the wire and raw
    check: int  # of the words and the table
    payload: torch.Tensor  # the staged bytes (uint8): segments not received in place are views of it
    segments: list  # per row: (positions or None, values)
    works: dict  # pending receives: (row, 0 positions / 1 values), PAYLOAD (packed) or (-1, -1) (trailer) -> work
    trailer: Optional[torch.Tensor]

    def words(self) -> torch.Tensor:
        return torch.tensor([MAGIC, self.kind, self.version, self.base, len(self.table), *self.sizes], dtype=torch.int64)

    def check_header(self, link_lost: bool = False) -> None:
        if int(checksum([self.words(), self.table])) != self.check:
            message = f"weight sync: frame header {self.words().tolist()} or its table failed its checksum (corrupted)"
            raise lost_link(message) if link_lost else SyncIntegrityError(f"{message}; {RESYNC_HINT}")

    def row(self, r: int) -> tuple[Optional[torch.Tensor], torch.Tensor]:
        for place in (PAYLOAD, (r, 0), (r, 1)):
            work = self.works.pop(place, None)  # a work is waited once (gloo's receive waits for a second message)
            if work is not None:
                work.wait()
        return self.segments[r]

    def wait(self) -> "Frame":
        for key in list(self.works):
            self.works.pop(key).wait()
        return self

    def sums(self) -> list[int]:
        self.wait()
        if self.trailer is None:
            return []
        sums = self.trailer[:-1].cpu()
        if int(checksum([self.words(), sums])) != int(self.trailer[-1]):
            raise SyncIntegrityError(f"weight sync: the checksums of frame version {self.version} failed their "
                                     f"check (trailer corrupted, or the sender failed while computing them: see "
                                     f"its error); {RESYNC_HINT}")
        return sums.tolist()


def recv_frame(src: int, group, device, numels: Sequence[int], expect: Callable[[int], tuple],
               staging: Optional[list] = None) -> Frame:
    """Receive the next frame from `src`: header and table (checked, blocking), then start receiving the
    payload and trailer (see Frame). Crosses ranks once per frame, send_frame's other end: the header and table,
    received here; the payload (a compressed blob received here, else each segment or one packed buffer, posted)
    and the trailer (posted), the posted ones completed by the Frame's waits.

    `expect(kind)`: for a frame of that kind, (ledger purpose, value dtype per tensor ordinal, `into` or
    None), where `into(ordinal)` gives a tensor to receive that row's whole values straight into (no staging
    copy) or None (a resync drains queued updates under the purpose they were sent with), and optionally a
    fourth item, the `decompress` of frames of that kind (compressed patches, applied or drained by a resync;
    absent or None: uncompressed). `staging`: [buffer] reused across frames (grown when too small), else a
    fresh buffer.
    """
    head = comm.recv_then_count(torch.empty(9, dtype=torch.int64, device=device), lambda h: expect(int(h[1]))[0],
                                src, group).cpu()    # a damaged kind is counted under some purpose, then refused
    magic, kind, version, base, rows, wire, raw = head[:7].tolist()
    if magic != MAGIC:
        raise lost_link(f"weight sync: received a message without the sync header (magic {magic:#x}); sender and "
                        "receiver are out of step, share the group with other traffic, or the header was corrupted")
    if int(checksum([head[:7]])) != int(head[7]):   # before `rows` sizes the table's receive
        raise lost_link(f"weight sync: frame header {head[:7].tolist()} failed its checksum (corrupted)")
    purpose, dtypes, into, *codec = expect(kind)
    decompress = codec[0] if codec else None
    if not 0 <= rows <= len(numels):
        raise lost_link(f"weight sync: frame header {head.tolist()} announces {rows} table rows")
    table = torch.zeros(rows, 4, dtype=torch.int64, device=device)
    frame = Frame(kind, version, base, (comm.recv(table, purpose, src, group) if rows else table).cpu(), (wire, raw),
                  int(head[8]), None, [], {}, None)
    frame.check_header(link_lost=True)
    _check_table(frame.table, numels)
    entries = frame.table.tolist()  # per segment: (row, 0 positions / 1 values) and (dtype, count)
    places = [(r, part) for r, entry in enumerate(entries) for part in ((0, 1) if entry[2] != DENSE else (1,))]
    specs = [(SYMBOL_DTYPES[entries[r][2]], entries[r][3]) if part == 0 else (dtypes[entries[r][0]], entries[r][1])
             for r, part in places]
    order, _, total = layout(specs)
    packed = decompress is None and _packed([d.itemsize * n for d, n in specs if n])
    target = [into(entries[r][0]) if into and part and not packed else None for r, part in places]
    _, offsets, staged = layout([(d, 0 if t is not None else n) for (d, n), t in zip(specs, target)])
    if total != raw or (wire != raw if decompress is None else wire > zstd_bound(raw) or (wire == 0) != (raw == 0)):
        raise lost_link(f"weight sync: frame header {head.tolist()} announces payload sizes its table does not "
                        f"({total} bytes)")
    buffer = staging[0] if staging else None
    if buffer is None or buffer.numel() < staged:
        buffer = torch.empty(staged, dtype=torch.uint8, device=device)
        if staging is not None:
            staging[:] = [buffer]
    frame.payload = buffer[:staged]
    parts = [t if t is not None else buffer[off:off + d.itemsize * n].view(d)
             for (d, n), t, off in zip(specs, target, offsets)]
    segment = dict(zip(places, parts))
    frame.segments = [[segment.get((r, 0)), segment[(r, 1)]] for r in range(rows)]
    blob = None
    if decompress is not None and wire:
        blob = comm.recv(torch.empty(wire, dtype=torch.uint8, device=device), purpose, src, group)
    elif packed:
        frame.works[PAYLOAD] = comm.irecv(buffer[:raw], purpose, src, group)
    elif decompress is None:
        for i in order:  # in send order: messages between two ranks match in the order they were posted
            if specs[i][1]:  # as bytes, as send_frame sends them
                frame.works[places[i]] = comm.irecv(parts[i].view(torch.uint8), purpose, src, group)
    if rows:
        frame.trailer = torch.empty(rows + 1, dtype=torch.int64, device=device)
        frame.works[(-1, -1)] = comm.irecv(frame.trailer, purpose, src, group)
    if blob is not None:
        try:
            buffer[:raw].copy_(decompress(blob, raw))
        except BaseException:
            frame.wait()  # a refused payload: still receive the trailer, so the stream stays in step for resync()
            raise
    return frame


class UnexpectedKind(RuntimeError):
    """A frame of another kind than the call expected, taken in whole and kept as `frame`: a resync's first
    frame that a non-blocking apply received starts the resync() that follows it."""

    def __init__(self, message: str, frame: Frame):
        super().__init__(message)
        self.frame = frame


def check_kind(frame: Frame, kind: int) -> None:
    """Refuse a frame of another kind, once it is taken in whole (its receives are posted: left, they would
    stall the link and resync() could not drain it)."""
    if frame.kind != kind:
        frame.wait()
        raise UnexpectedKind(f"weight sync: expected a message of kind {kind}, got kind {frame.kind}; sender and "
                             "receiver disagree on which call comes next (sync/resync/apply)", frame)


def _check_table(table: torch.Tensor, numels: Sequence[int]) -> None:
    """Refuse rows that name no tensor or repeat one, or whose sizes are impossible for their encoding. A gap row
    has a symbol per change and an escape per `escape` elements of gap, the gaps summing to at most numel - values:
    so at most values + (numel - values) // escape symbols (more would size a receive no sender fills)."""
    last = -1
    for row in table.tolist():
        ordinal, values, encoding, symbols = row
        numel = numels[ordinal] if last < ordinal < len(numels) else -1
        escape = escape_symbol(encoding) if encoding in SYMBOL_DTYPES else 1
        ok = {DENSE: values == numel and symbols == 0,
              BITMAP: 0 < values < numel and symbols == (numel + 7) // 8}.get(
            encoding, encoding in SYMBOL_DTYPES and 0 < values < numel and
            values <= symbols <= values + (numel - values) // escape)
        if not ok:
            raise lost_link(f"weight sync: malformed table row {row} (unknown or repeated tensor, or impossible "
                            "sizes)")
        last = ordinal


def escape_symbol(code: int) -> int:
    """A gap encoding's largest symbol, which means "skip that many" (255, 65,535, 2**32 - 1 for gaps8/16/32)."""
    return 2 ** (8 * SYMBOL_DTYPES[code].itemsize) - 1


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
    return buckets + [current] if current or not buckets else buckets


def bucket_messages(nbytes: Sequence[int], bucket_size: int) -> list[int]:
    """Bytes of each message that whole tensors of these sizes take, in buckets, to one receiver."""
    return [b for members in plan_buckets(nbytes, bucket_size)
            for b in frame_messages(len(members), [nbytes[i] for i in members if nbytes[i]])]


def send_json(obj, dst: int, group, device) -> int:
    """Send a small JSON document to `dst`; returns its length. Crosses ranks once per call, at init only (the
    handshake of Link.agree): three int64 words (the length, the document's checksum, a check of both), then the
    UTF-8 bytes."""
    data = torch.tensor(list(json.dumps(obj).encode()), dtype=torch.uint8)
    words = torch.stack([torch.tensor(data.numel()), checksum([data])])
    comm.send(torch.cat([words, checksum([words]).view(1)]).to(device), SETUP, dst, group)
    comm.send(data.to(device), SETUP, dst, group)
    return data.numel()


def recv_json(src: int, group, device) -> tuple[object, int]:
    """Receive send_json's document from `src`; returns (it, length), or (None, length) when it arrived corrupted
    (so that the sender can still reply with the refusal), or (None, -1) when its length word did: that sizes no
    receive, so the document stays queued and the link is lost. Crosses ranks once per call, at init only (the
    handshake of Link.agree): three int64 words, then the UTF-8 bytes."""
    words = comm.recv(torch.empty(JSON_HEAD_BYTES // 8, dtype=torch.int64, device=device), SETUP, src, group).cpu()
    if int(checksum([words[:2]])) != int(words[2]):
        return None, -1
    data = comm.recv(torch.empty(int(words[0]), dtype=torch.uint8, device=device), SETUP, src, group).cpu()
    if int(checksum([data])) != int(words[1]):
        return None, data.numel()
    return json.loads(bytes(data.tolist()).decode()), data.numel()


# ----- optional lossless compression of a patch payload (host side; patch.compression=zstd) ----------------

def zstd_compress(payload: torch.Tensor) -> torch.Tensor:
    return _as_tensor(require_zstd().ZstdCompressor(level=3).compress(payload.cpu().numpy().tobytes()))


def zstd_bound(raw_bytes: int) -> int:
    """The most bytes zstd writes for `raw_bytes` (its ZSTD_COMPRESSBOUND): a longer blob is malformed."""
    return raw_bytes + (raw_bytes >> 8) + ((2**17 - raw_bytes) >> 11 if raw_bytes < 2**17 else 0)


def zstd_discard(data: torch.Tensor, raw_bytes: int) -> torch.Tensor:
    """A compressed payload received only to drain it (a resync drops queued patches): not decoded, so a
    damaged one cannot stop the drain."""
    return torch.zeros(1, dtype=torch.uint8, device=data.device).expand(raw_bytes)


def zstd_decompress(data: torch.Tensor, raw_bytes: int) -> torch.Tensor:
    try:
        raw = require_zstd().ZstdDecompressor().decompress(data.cpu().numpy().tobytes(), max_output_size=raw_bytes)
    except Exception as error:  # zstandard raises its own ZstdError
        raise SyncIntegrityError(f"weight sync: zstd could not decompress the patch payload: {error}") from error
    if len(raw) != raw_bytes:
        raise SyncIntegrityError(f"weight sync: zstd produced {len(raw)} bytes, the header announced {raw_bytes}")
    return _as_tensor(raw)


def _as_tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)


def require_zstd():
    try:
        import zstandard
    except ImportError as error:
        raise ImportError("weight sync: patch.compression=zstd needs the zstandard package: pip install zstandard") from error
    return zstandard
