"""Weight transfer from a trainer rank to rollout ranks over torch.distributed point-to-point messages.

    cfg = WeightSyncConfig(type="patch")
    syncer = make_weight_syncer(cfg, src=0, dsts=[1, 2])
    # sender (rank 0)                                   # receivers (ranks 1, 2)
    syncer.init_sender(model, trainable_keys(model))    syncer.init_receiver(model)
    syncer.sync(model, version=it + 1)                  version = syncer.apply(model)
    syncer.resync(model, version=it + 1)                syncer.resync(model)      # after a SyncIntegrityError

Versions must increase from init's (default 0), so with `it` counting iterations from 0 the first sync is 1.

patch.py and bucket.py each read top to bottom as their algorithm; link.py is what both share (roles,
handshake, checks, whole tensors, resync, non-blocking apply), handshake.py the tensors read from a model and the
init document both sides compare, encodings.py how patch.py writes a changed tensor's positions, and wire.py
what travels (frames, JSON).
"""

from .bucket import BucketSyncer
from .config import BucketConfig, InitSyncConfig, PatchConfig, WeightSyncConfig, check_config
from .handshake import trainable_keys
from .patch import PatchSyncer
from .wire import SyncIntegrityError, SyncStats

__all__ = ["BucketConfig", "BucketSyncer", "InitSyncConfig", "PatchConfig", "PatchSyncer", "SyncIntegrityError",
           "SyncStats", "WeightSyncConfig", "make_weight_syncer", "trainable_keys"]


def make_weight_syncer(cfg: WeightSyncConfig, src: int, dsts, group=None) -> PatchSyncer | BucketSyncer:
    """The syncer `cfg.type` names, between global rank `src` (sender) and ranks `dsts` (receivers) of `group`."""
    check_config(cfg)
    return {"patch": PatchSyncer, "bucket": BucketSyncer}[cfg.type](cfg, src, dsts, group)
