"""patch strategy: send only the elements whose bits changed since the last sync.

The sender keeps a snapshot of what the receivers hold (in the receivers' dtypes) and a checksum of each
snapshot tensor. Each sync compares the current weights with the snapshot bit for bit, and sends one frame:

    header  8 x int64: kind, version, base version, table rows, payload bytes (wire, raw), check
    table   [rows, 5] int64: ordinal, values sent, encoding, index symbols, checksum after the update
    payload per touched tensor: its positions (encoded) and its new values, see wire.layout

Each changed tensor takes the smallest of these encodings, by exact size:
    gaps8 / gaps16 / gaps32  the gap before each change (0 = adjacent), one symbol each in 1, 2 or 4
                             bytes; a longer gap spends escape symbols (the largest value: "skip that many")
    bitmap                   one bit per element (wins above about 1 change in 8)
    dense                    every value, no positions
Positions decoded from gaps or a bitmap are strictly increasing by construction, so no position repeats.

Both sides update a tensor's checksum from the changed elements alone (old and new values at the changed
positions) when few changed, and recompute it when many did. The receiver checks the header, the table and
every sparse tensor's new checksum before writing anything; a dense-ish tensor is checked right after it is
written (then a mismatch leaves the receiver refusing everything until resync()). Every
`patch.verify_every` versions the receiver rescans all synced tensors against their checksums.
The sender commits the snapshot only after every receiver has the frame.
"""

from dataclasses import dataclass

import torch

from dist.checksum import tensor_checksum, update_checksum
from .config import WeightSyncConfig
from .link import Link, tensors_of
from .wire import (HEADER_BYTES, KIND_BUCKET, KIND_PATCH, KIND_RESYNC, SETUP, UPDATE, Header, SyncIntegrityError,
                   SyncStats, copy_into, expect, recv_buckets, recv_frame, send_buckets, send_frame, unpack, wait_all)

GAPS8, GAPS16, GAPS32, BITMAP, DENSE = range(5)
GAP_DTYPES = {GAPS8: torch.uint8, GAPS16: torch.int16, GAPS32: torch.int32}
INCREMENTAL_BELOW = 1 / 16  # changed fraction under which updating a checksum beats recomputing it


@dataclass
class PatchUpdate:
    version: int
    base_version: int
    table: torch.Tensor  # [rows, 5] int64 on the host
    payload: torch.Tensor  # uint8, still compressed when compression is on
    raw_bytes: int
    check: int  # the header's check word

    def header(self) -> Header:
        return Header(KIND_PATCH, self.version, self.base_version, self.table.shape[0], self.payload.numel(),
                      self.raw_bytes, self.check)


class PatchSyncer(Link):
    def __init__(self, cfg: WeightSyncConfig, src: int, dsts, group=None):
        super().__init__(cfg, src, dsts, group, device=cfg.patch.transport_device)
        if cfg.patch.compression == "zstd":
            _zstd()  # fail at construction, not at the first sync, when the package is missing
        if cfg.patch.snapshot_device == "cuda" and not torch.cuda.is_available():
            raise ValueError("weight sync: patch.snapshot_device=cuda but CUDA is not available; use cpu")
        self.snapshot: dict[str, torch.Tensor] = {}
        self.checksums: dict[str, torch.Tensor] = {}  # of the snapshot (sender) or of the model (receiver)
        self._staging = torch.empty(0, dtype=torch.uint8, device=self.device)

    # ----- init: handshake, bootstrap, start check ----------------------------------------------------------

    def init_sender(self, state_dict, keys=None, version: int = 0) -> None:
        """Handshake, bootstrap the receivers, check that what was not bootstrapped starts equal, then take
        the snapshot. Crosses ranks once: see Link.agree_as_sender, wire.send_buckets, Link.verify_same_start.
        `keys`: what every patch carries (None = all), e.g. `trainable_keys(model)`."""
        self.require(sender=True, initialized=False)
        state = tensors_of(state_dict)
        self.agree_as_sender(state, keys, version, self._config_problems(state))
        self.version = version
        bootstrap = self.once_per_tie(self._bootstrap_keys())
        if bootstrap:
            wire, payload = send_buckets([(state[k], self.dtypes[k]) for k in bootstrap], self.cfg.patch.init_sync.bucket_size,
                                         version, KIND_BUCKET, self.dsts, self.group, self.device, SETUP)
            self.stats = SyncStats(wire, payload, sum(state[k].numel() for k in bootstrap))
        self._verify_unbootstrapped(state, bootstrap)
        self._take_snapshot(state)

    def init_receiver(self, model) -> int:
        """The receiver's half of init_sender; returns the starting version."""
        self.require(sender=False, initialized=False)
        tensors = tensors_of(model)
        version = self.agree_as_receiver(tensors)
        bootstrap = self.once_per_tie(self._bootstrap_keys())
        with self.lock:
            if bootstrap:
                recv_buckets([(k, self.shapes[k], self.dtypes[k]) for k in bootstrap], self.cfg.patch.init_sync.bucket_size,
                             KIND_BUCKET, self.src, self.group, self.device, SETUP, lambda pairs: copy_into(tensors, pairs))
            self._verify_unbootstrapped(tensors, bootstrap)
            self.checksums = {k: tensor_checksum(tensors[k]) for k in self.synced}
            self.version = version
        return version

    def _config_problems(self, state: dict) -> list[str]:
        init = self.cfg.patch.init_sync
        if not init.enabled or init.prefixes is None:
            return []
        unmatched = [p for p in init.prefixes if not any(_under(k, p) for k in state)]
        return [f"patch.init_sync.prefixes {unmatched} match no state_dict key"] if unmatched else []

    def _bootstrap_keys(self) -> list[str]:
        init = self.cfg.patch.init_sync
        if not init.enabled:
            return []
        return [k for k in self.keys if init.prefixes is None or any(_under(k, p) for p in init.prefixes)]

    def _verify_unbootstrapped(self, tensors: dict, bootstrap: list[str]) -> None:
        rest = [k for k in self.once_per_tie(self.keys) if k not in bootstrap]
        self.verify_same_start(tensors, rest, "keys outside the init bootstrap (patch.init_sync)")

    def _take_snapshot(self, state: dict) -> None:
        pinned = self.cfg.patch.snapshot_device == "cpu" and torch.cuda.is_available()
        self.snapshot, self.checksums = {}, {}
        for key in self.synced:
            value = state[key].detach().to(self.dtypes[key])
            copy = torch.empty(value.shape, dtype=value.dtype, device=self.cfg.patch.snapshot_device, pin_memory=pinned)
            self.snapshot[key] = copy.copy_(value)
            self.checksums[key] = tensor_checksum(self.snapshot[key])

    # ----- sender ------------------------------------------------------------------------------------------

    def sync(self, state_dict, version: int) -> SyncStats:
        """Send what changed since the last sync as patch `version` to every receiver, then commit it.

        Crosses ranks once per call (typically once per training iteration): one frame to each receiver
        (isend to all, then wait). Host syncs: one or two per tensor (its change count; its escape counts).
        """
        self.require(sender=True)
        if version <= self.version:
            raise ValueError(f"weight sync: version must increase, last sent {self.version}, got {version}")
        state = self.sender_tensors(state_dict)
        rows, segments, commits = [], [], []
        changed = dense = 0
        synced = set(self.synced)
        for ordinal, key in enumerate(self.keys):
            if key not in synced:
                continue
            snapshot = self.snapshot[key].view(-1)
            current = state[key].detach().reshape(-1).to(self.dtypes[key])
            old = snapshot.to(current.device, non_blocking=True)
            mask = torch.ne(_bits(current), _bits(old))
            count = int(torch.count_nonzero(mask))
            if count == 0:
                continue
            encoding, parts, index = _encode(current, mask, count)
            values = parts[-1]
            if index is not None and count < INCREMENTAL_BELOW * current.numel():
                checksum = update_checksum(self.checksums[key], index, old[index], values)
            else:
                checksum = tensor_checksum(current)
            rows.append([ordinal, values.numel(), encoding, parts[0].numel() if encoding != DENSE else 0, checksum])
            segments += parts
            commits.append((key, index, values if index is not None else current, checksum))
            changed += count
            dense += encoding == DENSE

        payload = self._pack(segments)
        wire_payload = _compress(self.cfg.patch.compression, payload)
        table = torch.tensor([r[:4] for r in rows], dtype=torch.int64).view(-1, 4)
        table = torch.cat([table, torch.stack([r[4].cpu() for r in rows]).view(-1, 1) if rows
                           else torch.empty(0, 1, dtype=torch.int64)], dim=1)
        header = Header(KIND_PATCH, version, self.version, len(rows), wire_payload.numel(), payload.numel())
        works, alive = send_frame(header.sealed(table, None), table, wire_payload, self.dsts, self.group, self.device, UPDATE)
        wait_all(works)

        # Only now do all receivers hold the patch: a failed send above leaves the snapshot (and version)
        # as they were, so the next patch still carries these changes against the old base.
        for key, index, values, checksum in commits:
            snapshot = self.snapshot[key].view(-1)
            if index is None:
                snapshot.copy_(values)
            else:
                snapshot[index.to(snapshot.device)] = values.to(snapshot.device)
            self.checksums[key] = checksum
        self.version = version
        self.stats = SyncStats(HEADER_BYTES + table.numel() * 8 + wire_payload.numel(), payload.numel(), changed,
                               len(rows) - dense, dense)
        return self.stats

    def _pack(self, segments: list) -> torch.Tensor:
        """The segments in one staging buffer, reused across syncs (a fresh one per sync costs page faults)."""
        order = sorted(range(len(segments)), key=lambda i: -segments[i].dtype.itemsize)
        flat = [segments[i].reshape(-1).view(torch.uint8) for i in order]
        total = sum(f.numel() for f in flat)
        if self._staging.numel() < total:
            self._staging = torch.empty(total, dtype=torch.uint8, device=self.device)
        payload = self._staging[:total]
        if flat:
            torch.cat([f.to(self.device) for f in flat], out=payload)
        return payload

    # ----- receiver ----------------------------------------------------------------------------------------

    def apply(self, model, blocking: bool = True) -> int:
        """Receive the next patch and apply it to `model`; returns the version now in place. Crosses ranks:
        receives the frame the sender's matching sync() sent. blocking=False: see Link.receive."""
        self.require(sender=False)
        return self.receive(self.receiver_tensors(model), blocking, self.recv_update, self._write)

    def recv_update(self) -> PatchUpdate:
        """Receive the next patch without applying it (one frame from the sender, once per sync())."""
        header, table, payload = recv_frame(self.src, self.group, self.device, UPDATE)
        expect(header, KIND_PATCH)
        return PatchUpdate(header.version, header.base_version, table, payload, header.raw_bytes, header.check)

    def apply_update(self, model, update: PatchUpdate) -> int:
        """Apply an update returned by `recv_update()`; returns the new version (see _write for what is refused)."""
        self.require(sender=False)
        return self.write_update(self.receiver_tensors(model), update, self._write)

    def _write(self, tensors: dict, update: PatchUpdate) -> None:
        """Check, decode and apply a patch. Host syncs: a few per patch and one per sparse tensor (its positions)."""
        update.header().verify(update.table, None)
        if update.base_version != self.version:
            raise SyncIntegrityError(
                f"weight sync: patch {update.version} applies to version {update.base_version} but this receiver "
                f"holds version {self.version}: a patch was lost or reordered; call resync() on sender and receivers")
        keys, specs = self._check_table(update.table)
        try:
            payload = _decompress(self.cfg.patch.compression, update.payload, update.raw_bytes)
            views = iter(unpack(payload, [spec for spec_list in specs for spec in spec_list]))
        except ValueError as error:
            raise SyncIntegrityError(f"weight sync: patch {update.version} payload is corrupted: {error}") from error

        # Decode every tensor and check it before anything is written: positions inside the tensor, the
        # announced number of changes, bools stored as 0 or 1, and the new checksum of each sparse tensor.
        writes, bad, sums, expected = [], [], [], []
        for key, (_, values_sent, encoding, _, checksum) in zip(keys, update.table.tolist()):
            target = tensors[key].view(-1)
            index = None
            if encoding != DENSE:
                positions = next(views).to(target.device)
                index, flags = _decode(positions, encoding, target.numel())
                bad += flags + [torch.tensor(index.numel() != values_sent)]
            values = next(views).to(target.device)
            if values.dtype == torch.bool:
                bad.append((values.view(torch.uint8) > 1).any())
            incremental = index is not None and index.numel() == values_sent and \
                values_sent < INCREMENTAL_BELOW * target.numel()
            if incremental:
                sums.append(update_checksum(self.checksums[key], index, target[index], values))
                expected.append(checksum)
            writes.append((key, target, index, values, checksum, incremental))
        if bad and bool(torch.stack([f.cpu() for f in bad]).any()):
            raise SyncIntegrityError(f"weight sync: patch {update.version} has positions outside their tensors, a "
                                     "wrong number of changes or invalid bools: the payload is corrupted; call "
                                     "resync() on sender and receivers")
        if sums and not torch.equal(torch.stack(sums).cpu(), torch.tensor(expected)):
            raise SyncIntegrityError(f"weight sync: patch {update.version} does not produce the sender's values "
                                     "(corrupted payload or diverged receiver); model untouched; call resync() on "
                                     "sender and receivers")

        with torch.no_grad():
            for _, target, index, values, _, _ in writes:
                if index is None:
                    target.copy_(values)
                else:
                    target[index] = values
        rescanned = [(key, tensor_checksum(target), checksum) for key, target, _, _, checksum, inc in writes if not inc]
        if rescanned:
            actual = torch.stack([c for _, c, _ in rescanned]).cpu().tolist()
            wrong = [key for (key, _, want), got in zip(rescanned, actual) if got != want]
            if wrong:
                raise SyncIntegrityError(f"weight sync: after applying patch {update.version}, {wrong} differ from the "
                                         "sender's values (corrupted payload or diverged receiver); call resync() on "
                                         "sender and receivers", model_written=True)
        for key, _, _, _, checksum, _ in writes:
            self.checksums[key] = torch.tensor(checksum)
        every = self.cfg.patch.verify_every
        if every and update.version // every != update.base_version // every:
            self._verify(tensors)

    def verify(self, model) -> None:
        """Rescan every synced tensor of `model` against the checksums the patches left (receiver, on demand;
        also every `patch.verify_every` versions). Raises SyncIntegrityError when the model was changed."""
        self.require(sender=False)
        tensors = self.receiver_tensors(model)
        with self.lock:
            self._verify(tensors)

    def _verify(self, tensors: dict) -> None:
        actual = torch.stack([tensor_checksum(tensors[k]) for k in self.synced]).cpu()
        wanted = torch.stack([self.checksums[k].cpu() for k in self.synced])
        wrong = [k for k, same in zip(self.synced, (actual == wanted).tolist()) if not same]
        if wrong:
            self._broken = f"{wrong} changed on the receiver since the patches that wrote them"
            raise SyncIntegrityError(f"weight sync: verification found {wrong} changed on the receiver since the "
                                     "patches that wrote them; call resync() on sender and receivers", model_written=True)

    def _check_table(self, table: torch.Tensor) -> tuple[list[str], list[list[tuple[torch.dtype, int]]]]:
        """Keys the table touches and the payload segments it announces; refuses anything malformed."""
        keys, specs, last = [], [], -1
        synced = set(self.synced)
        for ordinal, values_sent, encoding, symbols, _ in table.tolist():
            key = self.keys[ordinal] if 0 <= ordinal < len(self.keys) else None
            numel = int(torch.Size(self.shapes[key]).numel()) if key else 0
            ok = {DENSE: values_sent == numel and symbols == 0,
                  BITMAP: 0 < values_sent < numel and symbols == (numel + 7) // 8}.get(
                encoding, encoding in GAP_DTYPES and 0 < values_sent < numel and symbols >= values_sent)
            if key not in synced or ordinal <= last or not ok:
                raise SyncIntegrityError(f"weight sync: malformed patch table row {[ordinal, values_sent, encoding, symbols]} "
                                         "(unknown or repeated tensor, or impossible sizes)")
            last = ordinal
            keys.append(key)
            value = (self.dtypes[key], values_sent)
            specs.append([value] if encoding == DENSE else
                         [(GAP_DTYPES.get(encoding, torch.uint8), symbols), value])
        return keys, specs

    # ----- resync ------------------------------------------------------------------------------------------

    def resync(self, state_dict_or_model, version=None) -> int:
        """Re-bootstrap every receiver and start again from `version`: sender resync(state_dict, version),
        receivers resync(model). Any patches still queued for a receiver are received and dropped first.

        Crosses ranks: the synced and bootstrap keys whole, in the receivers' dtypes (buckets of
        patch.init_sync.bucket_size, checksummed).
        """
        self.require(sender=self.is_sender)
        wanted = set(self.synced) | set(self._bootstrap_keys())
        keys = self.once_per_tie([k for k in self.keys if k in wanted])
        items = [(k, self.shapes[k], self.dtypes[k]) for k in keys]
        size = self.cfg.patch.init_sync.bucket_size
        if self.is_sender:
            if version is None:
                raise ValueError("weight sync: the sender's resync needs the version to restart from")
            state = self.sender_tensors(state_dict_or_model)
            wire, payload = send_buckets([(state[k], self.dtypes[k]) for k in keys], size, version, KIND_RESYNC,
                                         self.dsts, self.group, self.device, SETUP)
            self.stats = SyncStats(wire, payload, sum(state[k].numel() for k in keys))
            self._take_snapshot(state)
            self.version = version
            return version
        first = self.drain_until_resync(KIND_RESYNC)
        tensors = self.receiver_tensors(state_dict_or_model)
        with self.lock:
            self.version = recv_buckets(items, size, KIND_RESYNC, self.src, self.group, self.device, SETUP,
                                        lambda pairs: copy_into(tensors, pairs), first=first)
            self.checksums = {k: tensor_checksum(tensors[k]) for k in self.synced}
            self._broken = None
        return self.version


# ----- encodings ---------------------------------------------------------------------------------------------

def _bits(t: torch.Tensor) -> torch.Tensor:
    """Integer view of the same memory: equal bits compare equal, so NaN == NaN and -0.0 != 0.0."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _encode(current: torch.Tensor, mask: torch.Tensor, count: int):
    """(encoding, segments, flat positions or None) for one changed tensor: the smallest encoding by exact size."""
    n, v = current.numel(), current.element_size()
    sizes = {DENSE: n * v, BITMAP: (n + 7) // 8 + count * v}
    if min(sizes.values()) > count * (1 + v):  # a gap encoding might be smaller: count its escapes
        index = mask.nonzero().view(-1)
        gaps = torch.diff(index, prepend=index.new_full((1,), -1)) - 1
        escapes = torch.stack([(gaps // _escape(code)).sum() for code in GAP_DTYPES]).tolist()
        for code, extra in zip(GAP_DTYPES, escapes):
            sizes[code] = (count + extra) * GAP_DTYPES[code].itemsize + count * v
    encoding = min(sizes, key=lambda code: (sizes[code], -code))  # on a tie, the cheaper to apply
    if encoding == DENSE:
        return DENSE, [current], None
    if encoding == BITMAP:
        return BITMAP, [_pack_bits(mask), current[mask]], None
    per = gaps // _escape(encoding) + 1  # symbols per change: its escapes, then its remainder
    ends = torch.cumsum(per, 0) - 1
    symbols = torch.full((int(ends[-1]) + 1,), _escape(encoding), dtype=torch.int64, device=index.device)
    symbols[ends] = gaps % _escape(encoding)
    return encoding, [_narrow(symbols, GAP_DTYPES[encoding]), current[index]], index


def _decode(symbols: torch.Tensor, encoding: int, numel: int):
    """(flat positions, [flags that are True when the positions are invalid]) from a gap or bitmap segment."""
    if encoding == BITMAP:
        bits = ((symbols.view(-1, 1) >> torch.arange(8, dtype=torch.uint8, device=symbols.device)) & 1).view(-1)
        return bits[:numel].nonzero().view(-1), [bits[numel:].any()]
    top = _escape(encoding)
    s = torch.remainder(symbols.to(torch.int64), top + 1)  # the unsigned value of each symbol
    is_change = s != top
    positions = torch.cumsum(torch.where(is_change, s + 1, s), 0) - 1
    index = positions[is_change]
    return index, [(positions[-1:] >= numel).any() if index.numel() else torch.tensor(False), ~is_change[-1:].all()]


def _escape(code: int) -> int:
    return 2 ** (8 * GAP_DTYPES[code].itemsize) - 1


def _narrow(symbols: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Unsigned symbols into a (signed) wire dtype of the same width, bit for bit."""
    if dtype == torch.uint8:
        return symbols.to(dtype)
    half = 2 ** (8 * dtype.itemsize - 1)
    return torch.where(symbols >= half, symbols - 2 * half, symbols).to(dtype)


def _pack_bits(mask: torch.Tensor) -> torch.Tensor:
    pad = (-mask.numel()) % 8
    bits = torch.cat([mask, mask.new_zeros(pad)]) if pad else mask
    shifts = torch.arange(8, dtype=torch.uint8, device=mask.device)
    return (bits.view(-1, 8).to(torch.uint8) << shifts).sum(1, dtype=torch.uint8)


def _under(key: str, prefix: str) -> bool:
    return key == prefix or key.startswith(prefix + ".")


# ----- optional lossless compression of the payload (host side) ------------------------------------------------

def _compress(name: str, payload: torch.Tensor) -> torch.Tensor:
    if name == "none":
        return payload
    return _as_tensor(_zstd().ZstdCompressor(level=3).compress(payload.numpy().tobytes()))


def _decompress(name: str, data: torch.Tensor, raw_bytes: int) -> torch.Tensor:
    if name == "none":
        return data
    try:
        raw = _zstd().ZstdDecompressor().decompress(data.cpu().numpy().tobytes(), max_output_size=raw_bytes)
    except Exception as error:  # zstandard raises its own ZstdError
        raise ValueError(f"zstd could not decompress the patch payload: {error}") from error
    if len(raw) != raw_bytes:
        raise ValueError(f"zstd produced {len(raw)} bytes, the header announced {raw_bytes}")
    return _as_tensor(raw)


def _as_tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)


def _zstd():
    try:
        import zstandard
    except ImportError as error:
        raise ImportError("weight sync: patch.compression=zstd needs the zstandard package: pip install zstandard") from error
    return zstandard
