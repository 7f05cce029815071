"""patch strategy: send only the elements whose bits changed since the last sync.

The sender keeps a snapshot of what the receivers hold (in the receivers' dtypes) and a checksum of each snapshot
tensor. Each sync compares the current weights with the snapshot bit for bit and sends one frame (see wire.py) with a
table row per changed tensor, each in the smallest of these encodings by exact size:

    gaps8 / gaps16 / gaps32  the gap before each change (0 = adjacent), one symbol each in 1, 2 or 4
                             bytes; a longer gap spends escape symbols (the largest value: "skip that many")
    bitmap                   one bit per element (wins above about 1 change in 8)
    dense                    every value, no positions (sent straight from the weights' memory)
Positions decoded from gaps or a bitmap are strictly increasing by construction, so no position repeats.

The frame's trailer carries each changed tensor's checksum after the update. Both sides update it from the changed
elements alone (old and new values at the changed positions) below 1/64 density and rescan the tensor above. The
receiver checks the header, the table, every dense tensor and every sparse one under 1/64 density before writing
anything; a denser sparse tensor is checked right after it is written (then a mismatch leaves the receiver refusing
everything until resync()). Every `patch.verify_every` versions the receiver rescans all synced tensors. The sender
commits the snapshot only after every receiver has the frame.
"""

import torch

from dist.checksum import tensor_checksum, update_checksum
from dist.plan import PlanRow
from .config import WeightSyncConfig, under_prefix
from .encodings import _changes, _decode, _differ, _encode
from .handshake import tensors_of
from .link import Link
from .wire import (DENSE, KIND_BUCKET, KIND_PATCH, RESYNC_HINT, SETUP, UPDATE, Frame, SyncIntegrityError, SyncStats,
                   bucket_messages, check_kind, frame_messages, recv_frame, require_zstd, send_frame, zstd_compress,
                   zstd_decompress, zstd_discard)

NOT_BOOTSTRAPPED = "keys outside the init bootstrap (patch.init_sync)"  # what the start check names
INCREMENTAL_BELOW = 1 / 64  # update a checksum below, rescan above: crossovers ~1/110 (int8), ~1/25 (float64)


class PatchSyncer(Link):
    def __init__(self, cfg: WeightSyncConfig, src: int, dsts, group=None):
        super().__init__(cfg, src, dsts, group, device=cfg.patch.transport_device)
        if cfg.patch.compression == "zstd":
            require_zstd()  # fail at construction, not at the first sync, when the package is missing
        if cfg.patch.snapshot_device == "cuda" and not torch.cuda.is_available():
            raise ValueError("weight sync: patch.snapshot_device=cuda but CUDA is not available; use cpu")
        self.snapshot: dict[str, torch.Tensor] = {}
        self.checksums: dict[str, torch.Tensor] = {}  # of the snapshot (sender) or of the model (receiver)
        self._mask = torch.empty(0, dtype=torch.bool)  # change mask, reused (a fresh one costs page faults)
        self._memory: list = []  # receiver: where the synced tensors were when last written or checked

    # ----- init: handshake, bootstrap, start check ----------------------------------------------------------

    def init_sender(self, state_dict, keys=None, version: int = 0) -> None:
        """Handshake, bootstrap the receivers, check that what was not bootstrapped starts equal, then take
        the snapshot. Crosses ranks once: see Link.agree, Link.send_whole, Link.verify_same_start.
        `keys`: what every patch carries (None = all), e.g. `trainable_keys(model)`."""
        self.require(sender=True, initialized=False)
        state, init = tensors_of(state_dict), self.cfg.patch.init_sync
        unmatched = [p for p in init.prefixes or () if init.enabled and not any(under_prefix(k, p) for k in state)]
        self.agree(state, keys, version, [f"patch.init_sync.prefixes {unmatched} match no state_dict key"] * bool(unmatched))
        self.version = version
        bootstrap = self._bootstrap_keys()
        if bootstrap:
            self.stats = self.send_whole(state, bootstrap, [self.dtypes[k] for k in self.keys], init.bucket_size,
                                         version, KIND_BUCKET, SETUP)
        self.verify_same_start(state, bootstrap, NOT_BOOTSTRAPPED)
        self._take_snapshot(state)

    def init_receiver(self, model) -> int:
        """The receiver's half of init_sender (crossing ranks as it does, once); returns the starting version."""
        self.require(sender=False, initialized=False)
        tensors = tensors_of(model)
        version = self.agree(tensors)
        bootstrap = self._bootstrap_keys()
        with self.lock:
            try:
                if bootstrap:
                    self.recv_whole(tensors, bootstrap, [self.dtypes[k] for k in self.keys],
                                    self.cfg.patch.init_sync.bucket_size, KIND_BUCKET, SETUP)
            except SyncIntegrityError as error:
                if error.link_lost:
                    raise
                # The sender's init went on: still take part in its start check, then refuse updates until the
                # resync() the error asks for (which needs the version: the receiver counts as initialized).
                self.version, self._broken = version, f"the init bootstrap was refused: {error}"
                try:
                    self.verify_same_start(tensors, bootstrap, NOT_BOOTSTRAPPED)
                except SyncIntegrityError as rest:
                    raise error from rest
                raise
            self.verify_same_start(tensors, bootstrap, NOT_BOOTSTRAPPED)
            self._adopt_checksums(tensors)
            self.version = version
        return version

    def _bootstrap_keys(self) -> list[str]:
        init = self.cfg.patch.init_sync
        return self.once_per_tie([k for k in self.keys if init.enabled and (
            init.prefixes is None or any(under_prefix(k, p) for p in init.prefixes))])

    def _take_snapshot(self, state: dict) -> None:
        # Pinned for the copies to and from weights on a GPU only: pinning opens a CUDA context (on GPU 0).
        pinned = self.cfg.patch.snapshot_device == "cpu" and any(state[k].is_cuda for k in self.synced)
        for key in self.synced:  # every entry replaced (a resync's too): the keys never change after init
            value = state[key].detach().to(self.dtypes[key])
            copy = torch.empty(value.shape, dtype=value.dtype, device=self.cfg.patch.snapshot_device, pin_memory=pinned)
            self.snapshot[key] = copy.copy_(value)
            self.checksums[key] = tensor_checksum(self.snapshot[key])

    def plan_rows(self) -> list[PlanRow]:
        """This rank's sync-plan rows (after init): the init traffic, then one frame per sync(). A patch's
        size depends on what changed; the row gives its bound, every synced tensor changed (dense)."""
        nbytes = [n for n in (self.numels[self.ordinal[k]] * self.dtypes[k].itemsize for k in self.synced) if n]
        boot = [self.numels[self.ordinal[k]] * self.dtypes[k].itemsize for k in self._bootstrap_keys()]
        return self.plan(bucket_messages(boot, self.cfg.patch.init_sync.bucket_size) if boot else [],
                         "patch: changed elements (bytes: all changed)", frame_messages(len(nbytes), nbytes))

    # ----- sender ------------------------------------------------------------------------------------------

    def sync(self, state_dict, version: int) -> SyncStats:
        """Send what changed since the last sync as patch `version` to every receiver, then commit it.

        Crosses ranks once per call (typically once per training iteration): one frame to each receiver.
        Host syncs: two per tensor (how many words changed, then the change count or the positions; on the host
        these are free), plus its longest gap (and escape counts where a gap reaches an escape) when a gap
        encoding may win."""
        state = self.tensors(state_dict, sender=True, version=version)
        rows, segments, changes = [], [], []
        for key in self.synced:  # in ordinal order: the table's rows must be
            current = state[key].detach().reshape(-1).to(self.dtypes[key])
            # Asynchronous only towards a device (numpy would read a device-to-host copy before it landed); the
            # pinned snapshot it reads is overwritten only at the commit, after _changes synced with this copy.
            old = self.snapshot[key].view(-1).to(current.device, non_blocking=current.device.type != "cpu")
            if self._mask.numel() < current.numel() or self._mask.device != current.device:
                self._mask = torch.empty(current.numel(), dtype=torch.bool, device=current.device)
            mask = _differ(current, old, self._mask[:current.numel()])
            count, index = _changes(mask)
            if count:
                encoding, parts, index = _encode(current, mask, count, index)
                rows.append([self.ordinal[key], parts[-1].numel(), encoding, parts[0].numel() if encoding != DENSE else 0])
                segments += parts
                changes.append((key, current, old, index, parts[-1], count))

        def checksums_after():  # runs while the payload is in flight
            return [update_checksum(self.checksums[key], index, old.index_select(0, index), values, current.numel())
                    if _incremental(index, current) else tensor_checksum(current)
                    for key, current, old, index, values, _ in changes]

        wire, raw, sums = send_frame(KIND_PATCH, version, self.version, torch.tensor(rows, dtype=torch.int64).view(-1, 4),
                                     segments, checksums_after, self.dsts, self.group, self.device, UPDATE,
                                     None if self.cfg.patch.compression == "none" else zstd_compress)
        # Only now do all receivers hold the patch: a failed send above leaves the snapshot (and version)
        # as they were, so the next patch still carries these changes against the old base.
        for (key, current, _, index, values, _), checksum in zip(changes, sums):
            if index is None:
                self.snapshot[key].view(-1).copy_(current)
            else:
                snapshot = self.snapshot[key].view(-1)
                snapshot.index_copy_(0, index.to(snapshot.device), values.to(snapshot.device))
            self.checksums[key] = checksum
        self.version = version
        dense = sum(row[2] == DENSE for row in rows)
        self.stats = SyncStats(wire, raw, sum(c[5] for c in changes), len(rows) - dense, dense)
        return self.stats

    # ----- receiver ----------------------------------------------------------------------------------------

    def apply(self, model, blocking: bool = True) -> int:
        """Receive the next patch and apply it to `model`; returns the version now in place. Crosses ranks:
        receives the frame the sender's matching sync() sent. blocking=False: see Link.receive."""
        tensors = self.tensors(model, sender=False)
        return self.receive(blocking, lambda: self._recv(self.staging), lambda frame: self._write(tensors, frame))

    def recv_update(self) -> Frame:
        """Receive the next patch without applying it. Crosses ranks once per sync(): its frame from the sender."""
        self.require(sender=False)
        frame = self._recv(None)
        frame.sums()  # all of it has arrived: the caller may hold several
        return frame

    def apply_update(self, model, update: Frame) -> int:
        """Apply an update returned by `recv_update()`; returns the new version (see _write for what is refused)."""
        tensors = self.tensors(model, sender=False)
        return self.write_update(lambda: self._write(tensors, update), update)

    def _recv(self, staging) -> Frame:
        """Crosses ranks once per patch: receives the next frame (recv_frame) from the sender."""
        dtypes = [self.dtypes[k] for k in self.keys]
        update = (UPDATE, dtypes, None, None if self.cfg.patch.compression == "none" else zstd_decompress)
        frame = recv_frame(self.src, self.group, self.device, self.numels,  # another kind: a resync's, uncompressed
                           lambda kind: update if kind == KIND_PATCH else (SETUP, dtypes, None, None), staging)
        check_kind(frame, KIND_PATCH)
        return frame

    def _write(self, tensors: dict, frame: Frame) -> int:
        """Check, decode and apply a patch; returns its version. Host syncs: a few per patch and one to three per
        sparse tensor (positions, escapes, a check after writing). Waits for the payload that _recv posted."""
        frame.check_header()
        if [tensors[k].data_ptr() for k in self.synced] != self._memory:  # patches apply to what the last ones wrote
            self._verify(tensors, "were given to apply() in other memory than the last patch wrote, and hold other "
                         "values (pass the receiver's own model)")
        if frame.base != self.version:
            raise SyncIntegrityError(f"weight sync: patch {frame.version} applies to version {frame.base} but this "
                                     f"receiver holds version {self.version}: a patch was lost or reordered; {RESYNC_HINT}")
        foreign = set(frame.table[:, 0].tolist()) - {self.ordinal[k] for k in self.synced}
        if foreign:
            raise SyncIntegrityError(f"weight sync: patch {frame.version} touches tensors this syncer does not sync: "
                                     f"{sorted(foreign)}; {RESYNC_HINT}")

        # Decode and check every tensor, each as soon as it arrived, before anything is written: positions
        # inside the tensor, the announced number of changes, bools stored as 0 or 1, and the checksum after.
        writes, bad, checks = [], [], {}
        for r, (ordinal, values_sent, encoding, _) in enumerate(frame.table.tolist()):
            key = self.keys[ordinal]
            target = tensors[key].view(-1)
            positions, values = frame.row(r)
            values, index = values.to(target.device), None
            if encoding == DENSE:
                checks[r] = tensor_checksum(values)
            else:
                index, flags = _decode(positions.to(target.device), encoding, target.numel())
                bad += flags + [torch.tensor(index.numel() != values_sent)]
                if index.numel() == values_sent and _incremental(index, target):
                    checks[r] = update_checksum(self.checksums[key], index, target.index_select(0, index), values,
                                                target.numel())
            if values.dtype == torch.bool:
                bad.append((values.view(torch.uint8) > 1).any())
            writes.append((key, target, index, values))
        sums = frame.sums()
        if bad and bool(torch.stack([f.cpu() for f in bad]).any()):
            raise SyncIntegrityError(f"weight sync: patch {frame.version} has positions outside their tensors, a "
                                     f"wrong number of changes or invalid bools: the payload is corrupted; {RESYNC_HINT}")
        if checks and torch.stack([c.cpu() for c in checks.values()]).tolist() != [sums[r] for r in checks]:
            raise SyncIntegrityError(f"weight sync: patch {frame.version} does not produce the sender's values "
                                     f"(corrupted payload or diverged receiver); model untouched; {RESYNC_HINT}")

        for _, target, index, values in writes:  # views of detached tensors (tensors_of): no autograd to keep out
            if index is None:
                target.copy_(values)
            else:
                target.index_copy_(0, index, values)  # positions never repeat; faster than index_put
        wrong = [key for r, (key, target, _, _) in enumerate(writes)
                 if r not in checks and int(tensor_checksum(target)) != sums[r]]
        if wrong:
            raise SyncIntegrityError(f"weight sync: after applying patch {frame.version}, {wrong} differ from the "
                                     f"sender's values (corrupted payload or diverged receiver); {RESYNC_HINT}",
                                     model_written=True)
        for (key, _, _, _), checksum in zip(writes, sums):
            self.checksums[key] = torch.tensor(checksum)
        every = self.cfg.patch.verify_every
        if every and frame.version // every != frame.base // every:
            self._verify(tensors)
        return frame.version

    def verify(self, model) -> None:
        """Rescan every synced tensor of `model` against the checksums the patches left (receiver, on demand;
        also every `patch.verify_every` versions). Raises SyncIntegrityError when the model was changed."""
        tensors = self.tensors(model, sender=False)
        with self.lock:
            self._verify(tensors)

    def _verify(self, tensors: dict, why: str = "changed on the receiver since the patches that wrote them") -> None:
        actual = torch.stack([tensor_checksum(tensors[k]).cpu() for k in self.synced])
        wrong = [k for k, a in zip(self.synced, actual.tolist()) if a != int(self.checksums[k])]
        if wrong:
            self._broken = f"{wrong} {why}"
            raise SyncIntegrityError(f"weight sync: verification found {self._broken}; {RESYNC_HINT}", model_written=True)
        self._memory = [tensors[k].data_ptr() for k in self.synced]

    # ----- resync ------------------------------------------------------------------------------------------

    def resync(self, state_dict_or_model, version=None) -> int:
        """Re-bootstrap every receiver and start again from `version`: sender resync(state_dict, version),
        receivers resync(model). Any patches still queued for a receiver are received and dropped first.
        Crosses ranks: the synced and bootstrap keys whole (see Link.resync_whole)."""
        wanted = set(self.synced) | set(self._bootstrap_keys())
        self.resync_whole(state_dict_or_model, version, self.once_per_tie([k for k in self.keys if k in wanted]),
                          self.cfg.patch.init_sync.bucket_size, [self.dtypes[k] for k in self.keys],
                          None if self.cfg.patch.compression == "none" else zstd_discard,
                          self._take_snapshot if self.is_sender else self._adopt_checksums)
        return self.version

    def _adopt_checksums(self, tensors: dict) -> None:
        self.checksums = {k: tensor_checksum(tensors[k]) for k in self.synced}
        self._memory = [tensors[k].data_ptr() for k in self.synced]


def _incremental(index, tensor: torch.Tensor) -> bool:  # whether to update a checksum rather than rescan
    return index is not None and index.numel() < INCREMENTAL_BELOW * tensor.numel()
