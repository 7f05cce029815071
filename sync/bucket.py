"""bucket strategy: every sync sends the synced tensors whole, one frame of dense rows per size-capped bucket.

No sender snapshot and no assumption about sparsity; the simplest semantics and the most bytes. A tensor
already in its wire dtype travels from its own memory (and, with load_instant, arrives straight in the
receiver's model); each frame's checksums are computed on both sides while its values are in flight (see
Link.send_whole and Link.recv_whole). Keys that no sync carries (frozen weights) must start equal on both
sides: init checks them, as the patch strategy does.
"""

import torch

from dist.plan import PlanRow
from .config import BUCKET_DTYPES, WeightSyncConfig
from .handshake import tensors_of
from .link import Link
from .wire import KIND_BUCKET, UPDATE, SyncStats, bucket_messages


class BucketSyncer(Link):
    def __init__(self, cfg: WeightSyncConfig, src: int, dsts, group=None):
        super().__init__(cfg, src, dsts, group, device=cfg.bucket.bucket_device)

    def init_sender(self, state_dict, keys=None, version: int = 0) -> None:
        """Handshake (Link.agree), then check that the keys no sync carries start equal (Link.verify_same_start).
        `keys`: what every sync carries (None = all). Crosses ranks once, at init: see those two."""
        self.require(sender=True, initialized=False)
        self._start(tensors_of(state_dict), keys, version)

    def init_receiver(self, model) -> int:
        """The receiver's half of init_sender; returns the starting version. Crosses ranks once, at init."""
        self.require(sender=False, initialized=False)
        return self._start(tensors_of(model))

    def _start(self, tensors: dict, keys=None, version: int = 0) -> int:
        """Both sides of init. Crosses ranks once: the handshake (Link.agree), then the start check of the frozen
        keys (Link.verify_same_start)."""
        self.version = self.agree(tensors, keys, version)
        self.verify_same_start(tensors, self.synced, "keys that no sync carries (frozen weights)")
        return self.version

    def _wire_dtypes(self) -> list[torch.dtype]:
        """Per ordinal: bucket_dtype for floating tensors when set, else the receiver's dtype (exact, and half
        the bytes of an fp32 sender when the receiver is bf16). Ints and bools keep the receiver's."""
        name = self.cfg.bucket.bucket_dtype
        return [BUCKET_DTYPES[name] if name and self.dtypes[k].is_floating_point else self.dtypes[k] for k in self.keys]

    def plan_rows(self) -> list[PlanRow]:
        """This rank's sync-plan rows (after init): the init traffic, then the buckets of each sync()."""
        dtypes = self._wire_dtypes()
        nbytes = [self.numels[self.ordinal[k]] * dtypes[self.ordinal[k]].itemsize for k in self.synced]
        return self.plan([], "bucket: synced tensors whole", bucket_messages(nbytes, self.cfg.bucket.bucket_size))

    def sync(self, state_dict, version: int) -> SyncStats:
        """Send every synced tensor whole as update `version`. Crosses ranks once per call: one frame per
        bucket to each receiver (see Link.send_whole)."""
        state = self.tensors(state_dict, sender=True, version=version)
        self.stats = self.send_whole(state, self.synced, self._wire_dtypes(), self.cfg.bucket.bucket_size, version,
                                     KIND_BUCKET, UPDATE)
        self.version = version
        return self.stats

    def apply(self, model, blocking: bool = True) -> int:
        """Receive the next update and write it; returns the version now in place. Crosses ranks: receives
        the frames (one per bucket) of the sender's matching sync(), once per sync(). With load_instant each
        bucket lands as it arrives, checked (readers are kept out by the lock until the last one lands);
        otherwise all buckets are staged first (blocking=False: see Link.receive), then written."""
        tensors = self.tensors(model, sender=False)
        if not self.cfg.bucket.load_instant:
            return self.receive(blocking, self.recv_update, lambda update: self._write(tensors, update))
        if not blocking:
            raise ValueError("weight sync: bucket.load_instant=true writes buckets as they arrive, which a "
                             "non-blocking apply would expose half-done; set bucket.load_instant=false for "
                             "apply(model, blocking=False)")
        return self.write_update(lambda: self._recv(tensors))

    def _recv(self, tensors: dict, staged=None) -> int:
        """Crosses ranks once per sync(): one frame per bucket from the sender (Link.recv_whole)."""
        return self.recv_whole(tensors, self.synced, self._wire_dtypes(), self.cfg.bucket.bucket_size, KIND_BUCKET,
                               UPDATE, staged)

    def recv_update(self) -> tuple[int, list]:
        """Receive all buckets of the next update and keep them staged (a buffer each): (version, [(ordinal,
        values)]); nothing is written. Crosses ranks: one frame per bucket from the sender, once per sync()."""
        staged = []
        return self._recv({}, staged), staged

    def _write(self, tensors: dict, update: tuple[int, list]) -> int:
        for ordinal, values in update[1]:  # `tensors` are detached (tensors_of)
            tensors[self.keys[ordinal]].view(-1).copy_(values)
        return update[0]

    def resync(self, state_dict_or_model, version=None) -> int:
        """Send everything again, in the receivers' dtypes, and restart from `version` (sender
        resync(state_dict, version), receivers resync(model)); queued updates are dropped first.
        Crosses ranks: the synced keys whole, once, under the setup purpose (see Link.resync_whole)."""
        self.resync_whole(state_dict_or_model, version, self.synced, self.cfg.bucket.bucket_size, self._wire_dtypes())
        return self.version
