"""patch strategy: send only the elements whose bits changed since the last sync.

The sender keeps a snapshot of what the receivers hold (in the receivers' dtypes, on snapshot_device).
Each sync compares the current weights with it bit for bit, sends the changes, and commits them to the
snapshot only once every receiver has the patch. An update is three messages:

    header  8 x int64: kind, version, base version, table rows, payload bytes (wire and raw)
    table   [rows, 5] int64: ordinal, values sent, row index dtype, col index dtype (-1 -1 = dense), checksum
    payload per touched tensor: rows, cols and values (sparse) or all values (dense), see transport.layout

A tensor goes dense whenever its sparse form (indices + values) would not be smaller than the tensor.
The receiver refuses a patch whose base version is not the version it holds, or whose checksums do not
match after applying it (then it refuses everything until resync()).
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist

from .bucket_transfer import copy_into, recv_buckets, send_buckets
from .checksum import tensor_checksum
from .compression import compress, decompress, require_codec
from .config import WeightSyncConfig
from .coo import INDEX_DTYPES, changed_mask, decode, encode, shape_2d, smallest_index_dtype
from .syncer import SyncStats, WeightSyncer
from .transport import (HEADER_BYTES, KIND_PATCH, Header, SyncIntegrityError, isend_all, recv_bytes, recv_header,
                        pack, unpack, wait_all)

TABLE_COLUMNS = 5
DENSE = -1


@dataclass
class PatchUpdate:
    version: int
    base_version: int
    table: torch.Tensor  # [rows, TABLE_COLUMNS] int64 on the host
    payload: torch.Tensor  # uint8, still compressed when compression is on
    raw_bytes: int


class PatchSyncer(WeightSyncer):
    def __init__(self, cfg: WeightSyncConfig, src: int, dsts, group=None):
        super().__init__(cfg, src, dsts, group, device=cfg.patch.transport_device)
        require_codec(cfg.patch.compression)
        if cfg.patch.snapshot_device == "cuda" and not torch.cuda.is_available():
            raise ValueError("weight sync: patch.snapshot_device=cuda but CUDA is not available; use cpu")
        self.snapshot: dict[str, torch.Tensor] = {}

    # ----- init and resync ---------------------------------------------------------------------------

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

    def _bootstrap_bucket_size(self) -> int:
        return self.cfg.patch.init_sync.bucket_size

    def _setup_sender(self, state: dict, bootstrap: bool = True) -> None:
        """Bootstrap (or verify) the receivers, then take the snapshot later patches are computed against."""
        if bootstrap:
            keys = self._once_per_tie(self._bootstrap_keys())
            if keys:
                wire, payload = send_buckets([(state[k], self.dtypes[k]) for k in keys], self._bootstrap_bucket_size(),
                                             self.version, self.dsts, self.group, self.device)
                self.stats = SyncStats(wire, payload, sum(state[k].numel() for k in keys))
            self._verify_same_start(state, [k for k in self._once_per_tie(self.keys) if k not in keys])
        pinned = self.cfg.patch.snapshot_device == "cpu" and torch.cuda.is_available()
        self.snapshot = {}
        for key in self.synced:
            value = state[key].detach().to(self.dtypes[key])
            copy = torch.empty(value.shape, dtype=value.dtype, device=self.cfg.patch.snapshot_device, pin_memory=pinned)
            self.snapshot[key] = copy.copy_(value)

    def _setup_receiver(self, tensors: dict, bootstrap: bool = True) -> None:
        if bootstrap:
            keys = self._once_per_tie(self._bootstrap_keys())
            if keys:
                recv_buckets([(k, self.shapes[k], self.dtypes[k]) for k in keys], self._bootstrap_bucket_size(),
                             self.src, self.group, self.device, on_bucket=lambda pairs: copy_into(tensors, pairs))
            self._verify_same_start(tensors, [k for k in self._once_per_tie(self.keys) if k not in keys])

    def _verify_same_start(self, tensors: dict, keys: list[str]) -> None:
        """Patches assume the receivers hold the sender's weights for every key the bootstrap did not send
        (all keys when init_sync is off): check that once instead of diverging silently.

        Crosses ranks once at init: one int64 checksum per such key, receiver -> sender and sender ->
        receiver, so both sides raise the same error.
        """
        if not keys:
            return
        mine = torch.stack([tensor_checksum(tensors[k].detach().to(self.dtypes[k]).contiguous()) for k in keys])
        mine = mine.to(self.device)
        if self.is_sender:
            theirs = {}
            for dst in self.dsts:
                theirs[dst] = torch.empty_like(mine)
                dist.recv(theirs[dst], src=dst, group=self.group)
            wait_all(isend_all([mine], self.dsts, self.group))
        else:
            dist.send(mine, dst=self.src, group=self.group)
            theirs = {self.src: torch.empty_like(mine)}
            dist.recv(theirs[self.src], src=self.src, group=self.group)
        differ = {rank: [keys[i] for i in (other != mine).nonzero().flatten().tolist()] for rank, other in theirs.items()}
        differ = {rank: keys for rank, keys in differ.items() if keys}
        if differ:
            raise SyncIntegrityError(f"weight sync: keys outside the init bootstrap (patch.init_sync) must start equal "
                                     f"on sender and receivers, but these differ (by receiver rank): {differ}; "
                                     "bootstrap them (init_sync.enabled, prefixes) or load the same weights on both sides")

    # ----- sender --------------------------------------------------------------------------------------

    def _send(self, state: dict, version: int) -> SyncStats:
        """Build the patch against the snapshot, send it to every receiver, then commit the snapshot.

        Crosses ranks once per sync: header, table and payload to each receiver (isend to all, then wait).
        Host syncs: a few per changed tensor on the sender (its change count, its index range), none per element.
        """
        rows, checksums, segments, pending = [], [], [], []
        changed = dense = 0
        synced = set(self.synced)
        for ordinal, key in enumerate(self.keys):
            if key not in synced:
                continue
            current = state[key].detach().to(self.dtypes[key]).contiguous()
            mask = changed_mask(current, self.snapshot[key].to(current.device, non_blocking=True))
            count = int(mask.sum())
            if count == 0:
                continue
            row_code, col_code, parts, linear = _encode_changes(current, mask, count, self.cfg.patch.delta_encoding)
            rows.append([ordinal, parts[-1].numel(), row_code, col_code])
            checksums.append(tensor_checksum(current))
            segments += parts
            pending.append((key, linear, parts[-1]))
            changed += count
            dense += row_code == DENSE

        payload = pack(segments, self.device)
        wire_payload = compress(self.cfg.patch.compression, payload)
        table = torch.cat([torch.tensor(rows, dtype=torch.int64).view(-1, 4).to(self.device),
                           torch.stack(checksums).view(-1, 1).to(self.device) if checksums else
                           torch.empty(0, 1, dtype=torch.int64, device=self.device)], dim=1)
        header = Header(KIND_PATCH, version, self.version, len(rows), wire_payload.numel(), payload.numel(), 0)
        messages = [header.to_tensor(self.device)] + [t for t in (table, wire_payload) if t.numel()]
        wait_all(isend_all(messages, self.dsts, self.group))

        # Only now do all receivers hold the patch: a failed send above leaves the snapshot (and version)
        # as they were, so the next patch still carries these changes against the old base.
        for key, linear, values in pending:
            snapshot = self.snapshot[key].view(-1)
            if linear is None:
                snapshot.copy_(values)
            else:
                snapshot[linear.to(snapshot.device)] = values.to(snapshot.device)
        wire = HEADER_BYTES + table.numel() * 8 + wire_payload.numel()
        return SyncStats(wire, payload.numel(), changed, len(rows) - dense, dense)

    # ----- receiver ------------------------------------------------------------------------------------

    def recv_update(self) -> PatchUpdate:
        """Receive the next patch without applying it: a 64-byte header, a table of 40 bytes per touched
        tensor and the payload, from the sender, once per sync(). Host syncs: one (the header)."""
        header = recv_header(self.src, self.group, self.device, KIND_PATCH)
        table = torch.empty(header.count, TABLE_COLUMNS, dtype=torch.int64, device=self.device)
        if header.count:
            dist.recv(table, src=self.src, group=self.group)
        payload = recv_bytes(header.wire_bytes, self.src, self.group, self.device)
        return PatchUpdate(header.version, header.base_version, table.cpu(), payload, header.raw_bytes)

    def _write(self, tensors: dict, update: PatchUpdate) -> None:
        """Check, decode and apply a patch; two host syncs per patch (index range check, checksum check)."""
        if update.base_version != self.version:
            raise SyncIntegrityError(
                f"weight sync: patch {update.version} applies to version {update.base_version} but this receiver "
                f"holds version {self.version}: a patch was lost or reordered; call resync() on sender and receivers")
        keys, specs = self._check_table(update.table)
        try:
            payload = decompress(self.cfg.patch.compression, update.payload, update.raw_bytes)
            views = iter(unpack(payload, [spec for spec_list in specs for spec in spec_list]))
        except (ValueError, RuntimeError) as error:
            raise SyncIntegrityError(f"weight sync: patch {update.version} payload is corrupted: {error}") from error

        # Every payload byte must matter: indices inside their tensor, bools stored as 0 or 1 (copy_ would
        # quietly turn a damaged bool byte into True). One host sync for all tensors, before any write.
        writes, invalid = [], []
        for key, (_, values_sent, row_code, col_code, _) in zip(keys, update.table.tolist()):
            target = tensors[key]
            linear = None
            if row_code != DENSE:
                rows, cols = decode(next(views).to(target.device), next(views).to(target.device),
                                    self.cfg.patch.delta_encoding)
                n_rows, n_cols = shape_2d(self.shapes[key])
                invalid.append((rows.min() < 0) | (rows.max() >= n_rows) | (cols.min() < 0) | (cols.max() >= n_cols))
                linear = rows * n_cols + cols
            values = next(views).to(target.device)
            if values.dtype == torch.bool:
                invalid.append((values.view(torch.uint8) > 1).any())
            writes.append((target, linear, values))
        if invalid and bool(torch.stack([f.to(invalid[0].device) for f in invalid]).any()):
            raise SyncIntegrityError(f"weight sync: patch {update.version} has indices outside their tensors or "
                                     "invalid bools: the payload is corrupted; call resync() on sender and receivers")

        with torch.no_grad():
            for target, linear, values in writes:
                if linear is None:
                    target.view(-1).copy_(values)
                else:
                    target.view(-1)[linear] = values
        actual = [tensor_checksum(tensors[k]) for k in keys]
        matches = (torch.stack(actual).cpu() == update.table[:, 4]).tolist() if keys else []
        wrong = [k for k, ok in zip(keys, matches) if not ok]
        if wrong:
            raise SyncIntegrityError(f"weight sync: after applying patch {update.version}, {wrong} differ from the "
                                     "sender's values (corrupted payload or diverged receiver); call resync() on "
                                     "sender and receivers", model_written=True)

    def _check_table(self, table: torch.Tensor) -> tuple[list[str], list[list[tuple[torch.dtype, int]]]]:
        """Keys the table touches and the payload segments it announces; refuses anything malformed."""
        keys, specs, last = [], [], -1
        synced = set(self.synced)
        for ordinal, values_sent, row_code, col_code, _ in table.tolist():
            key = self.keys[ordinal] if 0 <= ordinal < len(self.keys) else None
            numel = int(torch.Size(self.shapes[key]).numel()) if key else 0
            sparse_ok = row_code in range(len(INDEX_DTYPES)) and col_code in range(len(INDEX_DTYPES)) \
                and 0 < values_sent < numel
            if key not in synced or ordinal <= last or not (sparse_ok or (row_code == col_code == DENSE and values_sent == numel)):
                raise SyncIntegrityError(f"weight sync: malformed patch table row {[ordinal, values_sent, row_code, col_code]} "
                                         "(unknown or repeated tensor, or impossible sizes)")
            last = ordinal
            keys.append(key)
            value = (self.dtypes[key], values_sent)
            specs.append([value] if row_code == DENSE else
                         [(INDEX_DTYPES[row_code], values_sent), (INDEX_DTYPES[col_code], values_sent), value])
        return keys, specs


def _encode_changes(current: torch.Tensor, mask: torch.Tensor, count: int, delta: bool):
    """(row code, col code, segments, linear indices) for one changed tensor: sparse, or dense when the
    sparse form would not be smaller. Dense returns codes DENSE and no indices."""
    value_size, numel = current.element_size(), current.numel()
    flat = current.view(-1)
    if count * (value_size + 2) >= numel * value_size:  # even 1-byte indices could not beat the whole tensor
        return DENSE, DENSE, [flat], None
    rows, cols = mask.nonzero().unbind(1)
    sent_rows, sent_cols = encode(rows, cols, delta)
    row_max, col_max = torch.stack([sent_rows.max(), sent_cols.max()]).tolist()
    row_code, col_code = smallest_index_dtype(row_max), smallest_index_dtype(col_max)
    index_size = INDEX_DTYPES[row_code].itemsize + INDEX_DTYPES[col_code].itemsize
    if count * (value_size + index_size) >= numel * value_size:
        return DENSE, DENSE, [flat], None
    linear = rows * mask.shape[1] + cols
    return row_code, col_code, [sent_rows.to(INDEX_DTYPES[row_code]), sent_cols.to(INDEX_DTYPES[col_code]),
                                flat[linear]], linear


def _under(key: str, prefix: str) -> bool:
    return key == prefix or key.startswith(prefix + ".")
