"""Weight transfer from a trainer rank to rollout ranks over torch.distributed point-to-point messages.

    cfg = WeightSyncConfig(type="patch")
    syncer = make_weight_syncer(cfg, src=0, dsts=[1, 2])
    # sender (rank 0)                                   # receivers (ranks 1, 2)
    syncer.init_sender(model, trainable_keys(model))    syncer.init_receiver(model)
    syncer.sync(model, version=it)                      version = syncer.apply(model)

See patch.py and bucket.py for the two strategies and syncer.py for the shared flow.
"""

from .bucket import BucketSyncer
from .config import BucketConfig, InitSyncConfig, PatchConfig, WeightSyncConfig
from .patch import PatchSyncer
from .syncer import SyncStats, WeightSyncer, trainable_keys
from .transport import SyncIntegrityError

__all__ = ["BucketConfig", "BucketSyncer", "InitSyncConfig", "PatchConfig", "PatchSyncer", "SyncIntegrityError",
           "SyncStats", "WeightSyncConfig", "WeightSyncer", "make_weight_syncer", "trainable_keys"]


def make_weight_syncer(cfg: WeightSyncConfig, src: int, dsts, group=None) -> WeightSyncer:
    """The syncer `cfg.type` names, between global rank `src` (sender) and ranks `dsts` (receivers) of `group`."""
    if not isinstance(cfg, WeightSyncConfig):
        raise TypeError(f"make_weight_syncer needs a WeightSyncConfig, got {type(cfg).__name__}")
    syncer_class = {"patch": PatchSyncer, "bucket": BucketSyncer}[cfg.type]
    return syncer_class(cfg, src, dsts, group)
