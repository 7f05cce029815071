"""resync() and refused frames: queued compressed patches are drained, a damaged compressed payload or a refused
multi-bucket resync leaves the link resyncable, a refused trailer after an in-place receive says the model
was written, an apply() that meets a resync refuses it by its kind and leaves the link in step, a resync() that
meets a non-blocking apply's receive takes it in first, and a sender whose checksums fail ends its frame (and
the rest of a multi-bucket update) so that the link recovers."""

import pytest
import torch
import torch.distributed as dist

from multirank import run_ranks
from sync import BucketConfig, InitSyncConfig, PatchConfig, SyncIntegrityError, WeightSyncConfig, make_weight_syncer
from test_sync_common import bits_equal, make_state, random_update, snapshot


def _zstd_queued_then_resync(rank, world_size, undecodable=False):
    """Two compressed patches queued, then a resync; `undecodable`: their blobs are not zstd at all (64 bytes of
    0xAB, which no zstd frame starts with), which the drain must not try to decode."""
    import sync.patch

    cfg = WeightSyncConfig(type="patch", patch=PatchConfig(compression="zstd"))
    syncer = make_weight_syncer(cfg, src=0, dsts=[1])
    if rank == 0:
        state, g = make_state(seed=0), torch.Generator().manual_seed(1)
        syncer.init_sender(state)
        real = sync.patch.zstd_compress
        if undecodable:
            sync.patch.zstd_compress = lambda payload: torch.full((64,), 0xAB, dtype=torch.uint8)
        for version in (1, 2):  # both still queued when the receiver decides to resync
            random_update(state, g, 0.1)
            syncer.sync(state, version)
        sync.patch.zstd_compress = real
        syncer.resync(state, 3)
        random_update(state, g, 0.1)
        syncer.sync(state, 4)
        return snapshot(state)
    model = make_state(seed=7)
    syncer.init_receiver(model)
    assert syncer.resync(model) == 3  # drains the two compressed patches first
    assert syncer.apply(model) == 4
    return snapshot(model)


@pytest.mark.slow
def test_resync_drains_queued_compressed_patches():
    sender, receiver = run_ranks(_zstd_queued_then_resync, 2, timeout=60)
    assert bits_equal(receiver, sender)


def _zstd_damaged_blob_then_resync(rank, world_size):
    import sync.patch

    cfg = WeightSyncConfig(type="patch", patch=PatchConfig(compression="zstd"))
    syncer = make_weight_syncer(cfg, src=0, dsts=[1])
    if rank == 0:
        state, g = make_state(seed=0), torch.Generator().manual_seed(1)
        syncer.init_sender(state)
        random_update(state, g, 0.1)
        syncer.sync(state, 1)
        syncer.resync(state, 2)
        random_update(state, g, 0.1)
        syncer.sync(state, 3)
        return snapshot(state)
    model = make_state(seed=7)
    syncer.init_receiver(model)
    before = snapshot(model)
    real = sync.patch.zstd_decompress
    sync.patch.zstd_decompress = lambda data, raw: real(data[:data.numel() // 2], raw)  # damaged on the way
    try:
        with pytest.raises(SyncIntegrityError, match="zstd") as error:
            syncer.apply(model)
    finally:
        sync.patch.zstd_decompress = real
    assert "cannot recover" not in str(error.value)  # it says resync() recovers, so it must
    assert bits_equal(model, before) and syncer.version == 0
    assert syncer.resync(model) == 2
    assert syncer.apply(model) == 3
    return snapshot(model)


@pytest.mark.slow
def test_a_damaged_compressed_payload_leaves_the_link_resyncable():
    sender, receiver = run_ranks(_zstd_damaged_blob_then_resync, 2, timeout=60)
    assert bits_equal(receiver, sender)


def _bucket_trailer_damaged(rank, world_size):
    import sync.link

    syncer = make_weight_syncer(WeightSyncConfig(type="bucket"), src=0, dsts=[1])
    state = {"w": torch.zeros(1000)}  # one tensor per frame: its values are received straight into the model
    if rank == 0:
        syncer.init_sender(state)
        state["w"].copy_(torch.arange(1000.0))
        syncer.sync(state, 1)
        syncer.resync(state, 2)
        return snapshot(state)
    syncer.init_receiver(state)
    before = snapshot(state)
    real = sync.link.recv_frame

    def damaged(*args):  # a value (received straight into the model) and the trailer damaged on the way
        frame = real(*args)
        frame.wait()
        values = frame.segments[0][1]
        assert values.data_ptr() == state[syncer.keys[int(frame.table[0, 0])]].data_ptr()  # in the model
        values.view(torch.uint8)[0] ^= 0x40
        frame.trailer[0] += 1
        return frame

    sync.link.recv_frame = damaged
    try:
        with pytest.raises(SyncIntegrityError, match="trailer corrupted") as error:
            syncer.apply(state)
    finally:
        sync.link.recv_frame = real
    assert not bits_equal(state, before)  # the refused update is in the model already
    assert error.value.model_written, "the model was written: the error must say so (and refuse until resync)"
    with pytest.raises(SyncIntegrityError, match="needs resync"):
        syncer.apply(state)
    assert syncer.resync(state) == 2
    return snapshot(state)


@pytest.mark.slow
def test_a_refused_trailer_after_an_in_place_receive_says_the_model_was_written():
    sender, receiver = run_ranks(_bucket_trailer_damaged, 2, timeout=60)
    assert bits_equal(receiver, sender)


def _multi_bucket_resync_damaged(rank, world_size, mode):
    import sync.link
    from sync.wire import KIND_RESYNC

    cfg = WeightSyncConfig(type=mode)
    cfg.patch.init_sync.bucket_size = cfg.bucket.bucket_size = 50_000  # make_state's tensors: 3 buckets
    syncer = make_weight_syncer(cfg, src=0, dsts=[1])
    if rank == 0:
        state, g = make_state(seed=0), torch.Generator().manual_seed(1)
        syncer.init_sender(state)
        random_update(state, g, 0.1)
        syncer.resync(state, 1)  # its first bucket is damaged on the way to the receiver
        random_update(state, g, 0.1)
        syncer.resync(state, 2)  # so both sides resync again
        random_update(state, g, 0.1)
        syncer.sync(state, 3)
        return snapshot(state)
    model = make_state(seed=0 if mode == "bucket" else 7)  # bucket mode: frozen-free, any start works
    syncer.init_receiver(model)
    real, damaged_once = sync.link.recv_frame, []

    def damaged(*args):
        frame = real(*args)
        if frame.kind == KIND_RESYNC and not damaged_once:
            frame.wait()
            frame.segments[0][1].view(torch.uint8)[0] ^= 0x01
            damaged_once.append(True)
        return frame

    sync.link.recv_frame = damaged
    before = snapshot(model)
    try:
        with pytest.raises(SyncIntegrityError, match="does not match its checksums"):
            syncer.resync(model)
    finally:
        sync.link.recv_frame = real
    # Buckets 2 and 3 (enc.weight alone at 84,000 bytes; then the rest) are received and dropped, not written.
    later = ["enc.weight", "conv.weight", "dec.weight", "steps", "mask"]
    assert bits_equal({k: model[k] for k in later}, {k: before[k] for k in later})
    assert syncer.resync(model) == 2  # the rest of the refused resync must not be taken for the new one
    assert syncer.apply(model) == 3
    return snapshot(model)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["patch", "bucket"])
def test_resync_recovers_after_a_refused_multi_bucket_resync(mode):
    sender, receiver = run_ranks(_multi_bucket_resync_damaged, 2, args=(mode,), timeout=60)
    assert bits_equal(receiver, sender)


def _apply_meets_a_resync(rank, world_size, cfg):
    syncer = make_weight_syncer(cfg, src=0, dsts=[1])
    state = {"w": torch.zeros(1_000_000), "b": torch.zeros(5)}
    if rank == 0:
        syncer.init_sender(state)
        for version in (1, 2):          # resync(1) meets the receiver's apply; the receiver's resync takes resync(2)
            state["w"] += 1
            syncer.resync(state, version)
        state["b"] += 3
        syncer.sync(state, 3)
        return snapshot(state)
    syncer.init_receiver(state)
    refused, before = None, snapshot(state)
    try:
        syncer.apply(state)
    except (RuntimeError, SyncIntegrityError) as error:
        refused = f"{type(error).__name__}: {error}"      # a string: the error would keep the frame alive
    untouched = bits_equal(state, before)
    assert syncer.resync(state) == 2 and syncer.apply(state) == 3
    return refused, untouched, snapshot(state)


@pytest.mark.slow
@pytest.mark.parametrize("cfg", [WeightSyncConfig(type="patch"),
                                 WeightSyncConfig(type="patch", patch=PatchConfig(compression="zstd")),
                                 WeightSyncConfig(type="bucket"),
                                 WeightSyncConfig(type="bucket", bucket=BucketConfig(bucket_dtype="bfloat16"))],
                         ids=["patch", "patch-zstd", "bucket", "bucket-bf16"])
def test_an_apply_that_meets_a_resync_refuses_it_by_kind_and_the_link_recovers(cfg):
    """The sender resynced while the receiver waited in apply(): the resync's frame is refused by its kind,
    taken in whole and never written (a bfloat16 bucket wire must not size it, or it reads as a corrupt
    header; a float32 one must not receive it straight into the model, which the refusal says it left as it
    was), so the next resync pair and the update after it arrive in step."""
    sender, (refused, untouched, received) = run_ranks(_apply_meets_a_resync, 2, args=(cfg,), timeout=30)
    update_kind = 2 if cfg.type == "patch" else 1
    assert refused == (f"UnexpectedKind: weight sync: expected a message of kind {update_kind}, got kind 3; sender and "
                       f"receiver disagree on which call comes next (sync/resync/apply)")
    assert untouched, "the refused resync frame was written into the model (4 MB, in its dtype: not staged)"
    assert bits_equal(received, sender)


def _sender_fails_computing_checksums(rank, world_size, mode):
    import sync.link
    import sync.patch
    import sync.wire

    syncer = make_weight_syncer(WeightSyncConfig(type=mode), src=0, dsts=[1])
    state = make_state(seed=0)
    if rank == 0:
        g = torch.Generator().manual_seed(1)
        syncer.init_sender(state)
        random_update(state, g, 0.1)
        real = sync.wire.send_frame

        def failing(kind, version, base, table, segments, sums, *rest):  # e.g. a device error in the checksum
            def fail():
                raise ArithmeticError("checksum failed on the device")
            return real(kind, version, base, table, segments, fail, *rest)

        module = sync.patch if mode == "patch" else sync.link
        module.send_frame = failing
        try:
            with pytest.raises(ArithmeticError, match="checksum failed on the device"):
                syncer.sync(state, 1)
        finally:
            module.send_frame = real
        assert syncer.version == 0      # nothing committed: the next patch would still carry the changes
        syncer.resync(state, 2)
        random_update(state, g, 0.1)
        syncer.sync(state, 3)
        return snapshot(state)
    syncer.init_receiver(state)
    before = snapshot(state)
    with pytest.raises(SyncIntegrityError, match="the sender failed while computing them") as error:
        syncer.apply(state)
    assert error.value.model_written == (mode == "bucket")   # bucket receives straight into the model
    if mode == "patch":
        assert bits_equal(state, before)
    assert syncer.resync(state) == 2 and syncer.apply(state) == 3
    return snapshot(state)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["patch", "bucket"])
def test_a_sender_that_fails_computing_checksums_ends_the_frame_and_the_link_recovers(mode):
    """sums() raising after the payload went out: the receivers get a trailer they refuse (they were waiting for
    one), the sender raises its own error, and a resync pair brings both back in step."""
    sender, receiver = run_ranks(_sender_fails_computing_checksums, 2, args=(mode,), timeout=60)
    assert bits_equal(receiver, sender)


def _resync_meets_a_non_blocking_apply(rank, world_size, cfg, queued):
    """The receiver's background receive (apply(blocking=False)) is under way when it decides to resync; the sender
    sent `queued` updates first (the receive takes the first of them) or none (the receive takes the resync's first
    bucket, which must then start the resync rather than be lost)."""
    syncer = make_weight_syncer(cfg, src=0, dsts=[1])
    if rank == 0:
        state, g = make_state(seed=0), torch.Generator().manual_seed(1)
        syncer.init_sender(state)
        dist.barrier()
        for version in range(1, queued + 1):
            random_update(state, g, 0.1)
            syncer.sync(state, version)
        random_update(state, g, 0.1)
        syncer.resync(state, 10)
        random_update(state, g, 0.1)
        syncer.sync(state, 11)
        return snapshot(state)
    model = make_state(seed=7)
    syncer.init_receiver(model)
    assert syncer.apply(model, blocking=False) == 0
    dist.barrier()
    assert syncer.resync(model) == 10 and syncer.apply(model) == 11
    return snapshot(model)


SMALL_BUCKETS = 4096  # bytes: make_state's resync then spans several buckets, the first met by the receive


@pytest.mark.slow
@pytest.mark.parametrize("queued", [0, 2], ids=["resync-first", "updates-first"])
@pytest.mark.parametrize("cfg", [
    WeightSyncConfig(type="patch"),
    WeightSyncConfig(type="patch", patch=PatchConfig(init_sync=InitSyncConfig(bucket_size=SMALL_BUCKETS))),
    WeightSyncConfig(type="patch", patch=PatchConfig(compression="zstd")),
    WeightSyncConfig(type="bucket", bucket=BucketConfig(load_instant=False, bucket_size=SMALL_BUCKETS))],
    ids=["patch", "patch-buckets", "patch-zstd", "bucket-staged"])
def test_a_resync_takes_in_the_receive_of_a_non_blocking_apply_first(cfg, queued):
    """resync() used to refuse while a non-blocking apply was receiving, so a rollout process that polled apply()
    could not recover without an apply that never returned (the sender had moved on to its resync). Now the receive
    is taken in first: an update is dropped like the queued ones behind it, a resync's first bucket starts the
    resync, and the update after it lands bit for bit."""
    sender, receiver = run_ranks(_resync_meets_a_non_blocking_apply, 2, args=(cfg, queued), timeout=60)
    assert bits_equal(receiver, sender)


def _sender_fails_in_the_first_of_three_buckets(rank, world_size, mode):
    import sync.link

    cfg = WeightSyncConfig(type=mode)
    cfg.patch.init_sync.bucket_size = cfg.bucket.bucket_size = 50_000  # make_state's tensors: 3 buckets
    syncer = make_weight_syncer(cfg, src=0, dsts=[1])
    state = make_state(seed=0)
    if rank == 0:
        g = torch.Generator().manual_seed(1)
        syncer.init_sender(state)
        random_update(state, g, 0.1)
        real = sync.link.tensor_checksum

        def failing(tensor):                     # e.g. a device error in the first bucket's checksums
            raise ArithmeticError("checksum failed on the device")

        sync.link.tensor_checksum = failing
        try:
            with pytest.raises(ArithmeticError, match="checksum failed on the device"):
                syncer.sync(state, 1) if mode == "bucket" else syncer.resync(state, 1)   # whole tensors, 3 buckets
        finally:
            sync.link.tensor_checksum = real
        syncer.resync(state, 2)
        random_update(state, g, 0.1)
        syncer.sync(state, 3)
        return snapshot(state)
    syncer.init_receiver(state)
    try:
        syncer.apply(state) if mode == "bucket" else syncer.resync(state)
        refused = None
    except SyncIntegrityError as error:
        refused = str(error)
    assert syncer.resync(state) == 2 and syncer.apply(state) == 3
    return refused, snapshot(state)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["patch", "bucket"])
def test_a_sender_that_fails_in_the_first_of_several_buckets_still_lets_resync_recover(mode):
    """Receivers that refuse a bucket take in the rest of its update before raising. A sender whose checksums
    failed on the first of three buckets (a bucket sync, or a resync in either mode) stopped there, so receivers
    took the next resync's first two buckets for that rest and the resync after it was refused as off the
    bucket plan: the link could not recover. The sender now sends the remaining buckets with refused trailers."""
    sender, (refused, received) = run_ranks(_sender_fails_in_the_first_of_three_buckets, 2, args=(mode,),
                                            timeout=60)
    assert refused == ("weight sync: the checksums of frame version 1 failed their check (trailer corrupted, or the "
                       "sender failed while computing them: see its error); call resync() on sender and receivers")
    assert bits_equal(received, sender)


@pytest.mark.slow
def test_resync_drains_a_queued_compressed_patch_that_would_not_decompress():
    """Mutant: the drain decompresses queued blobs (zstd_discard -> zstd_decompress); a damaged one then made
    resync() raise instead of recovering the link."""
    sender, receiver = run_ranks(_zstd_queued_then_resync, 2, args=(True,), timeout=60)
    assert bits_equal(receiver, sender)
