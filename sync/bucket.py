"""bucket strategy: every sync sends the synced tensors whole, packed into size-capped buckets.

No sender snapshot and no assumption about sparsity; the simplest semantics and the most bytes.
"""

from dataclasses import dataclass

import torch

from .bucket_transfer import copy_into, recv_buckets, send_buckets
from .config import BUCKET_DTYPES, WeightSyncConfig
from .syncer import SyncStats, WeightSyncer


@dataclass
class BucketUpdate:
    version: int
    pairs: list  # (key, flat typed view of the received bytes), all buckets of one update


class BucketSyncer(WeightSyncer):
    def __init__(self, cfg: WeightSyncConfig, src: int, dsts, group=None):
        super().__init__(cfg, src, dsts, group, device=cfg.bucket.bucket_device)

    def _wire_dtype(self, key: str) -> torch.dtype:
        """bucket_dtype for floating tensors when set; otherwise the receiver's dtype (exact, and half the
        bytes of an fp32 sender when the receiver is bf16). Ints and bools always keep their dtype."""
        dtype = self.dtypes[key]
        name = self.cfg.bucket.bucket_dtype
        return BUCKET_DTYPES[name] if name is not None and dtype.is_floating_point else dtype

    def _items(self) -> list:
        return [(k, self.shapes[k], self._wire_dtype(k)) for k in self.synced]

    def _send(self, state: dict, version: int) -> SyncStats:
        """Crosses ranks: every synced tensor whole, in buckets (see send_buckets), once per sync."""
        wire, payload = send_buckets([(state[k], self._wire_dtype(k)) for k in self.synced],
                                     self.cfg.bucket.bucket_size, version, self.dsts, self.group, self.device)
        return SyncStats(wire, payload, sum(state[k].numel() for k in self.synced), dense_tensors=len(self.synced))

    def recv_update(self) -> BucketUpdate:
        """Receive all buckets of the next update (header and bytes per bucket, from the sender, once per
        sync()) and keep them staged; nothing is written yet."""
        staged = []
        version = recv_buckets(self._items(), self.cfg.bucket.bucket_size, self.src, self.group, self.device,
                               on_bucket=staged.extend)
        return BucketUpdate(version, staged)

    def _write(self, tensors: dict, update: BucketUpdate) -> None:
        copy_into(tensors, update.pairs)

    def _receive_and_apply(self, tensors: dict) -> int:
        if not self.cfg.bucket.load_instant:
            return super()._receive_and_apply(tensors)
        # Each bucket is written as it arrives, so readers are kept out (lock) until the last one lands.
        with self.lock:
            self.version = recv_buckets(self._items(), self.cfg.bucket.bucket_size, self.src, self.group,
                                        self.device, on_bucket=lambda pairs: copy_into(tensors, pairs))
        return self.version

    def _check_async_allowed(self) -> None:
        if self.cfg.bucket.load_instant:
            raise ValueError("weight sync: bucket.load_instant=true writes buckets as they arrive, which a "
                             "non-blocking apply would expose half-done; set bucket.load_instant=false for "
                             "apply(model, blocking=False)")

    def _bootstrap_bucket_size(self) -> int:
        return self.cfg.bucket.bucket_size
