"""Gaps found by a second mutation campaign over sync/patch.py, sync/encodings.py, sync/bucket.py and sync/config.py:
each test pins a behaviour that a small change to those files left unnoticed by the rest of the suite. Expected
values are worked out by hand in the comments (sizes from each encoding's definition), not read back from the
code under test."""

import pytest
import torch

from dist.plan import expected_ledger
from multirank import run_ranks
from sync import InitSyncConfig, PatchConfig, SyncIntegrityError, WeightSyncConfig, make_weight_syncer, wire
from sync.encodings import _decode, _encode
from sync.wire import BITMAP, GAPS8
from test_sync_common import bits_equal, damaged_frames, snapshot
from test_sync_plan import SYNCS, _plan_and_ledger


def _nbytes(parts) -> int:
    return sum(p.numel() * p.element_size() for p in parts)


# ----- encodings: the smallest by exact size near the gap / bitmap crossover --------------------------------------

@pytest.mark.parametrize("step, count", [(10, 100), (8, 124)], ids=["25-bytes-under", "1-byte-under"])
def test_one_byte_gaps_win_whenever_they_are_smaller_than_the_bitmap(step, count):
    """1000 float32 elements, every `step`-th changed from 0 (gaps of step - 1 < 255: no escapes). By definition:
    1-byte gaps cost count + 4 count bytes, a bitmap 125 + 4 count, 2-byte gaps 2 count + 4 count, dense 4000.
    count=100: 1-byte gaps 500 < bitmap 525 < 2-byte gaps 600; count=124 (0..984): 620 < bitmap 621 < 744.
    Mutant: gap sizes were worked out only when the smaller of dense and bitmap exceeds count * (2 + v) rather
    than count * (1 + v), so here the bitmap (the larger) was sent."""
    positions = list(range(0, 1000, step))[:count]
    mask = torch.zeros(1000, dtype=torch.bool)
    mask[positions] = True
    current = torch.arange(1000, dtype=torch.float32)
    encoding, parts, _ = _encode(current, mask, count)
    assert encoding == GAPS8
    assert _nbytes(parts) == count + 4 * count < 125 + 4 * count
    assert parts[0].tolist() == [0] + [step - 1] * (count - 1)
    assert _decode(parts[0], GAPS8, 1000)[0].tolist() == positions


def test_a_gap_encoding_pays_for_its_values_too_when_compared_with_the_bitmap():
    """8000 int8 elements (1 byte each), 990 changed: 27 after gaps of exactly 255 (positions 255, 511, ..., 6911:
    each gap one escape and a 0 in 1-byte gaps), then 963 adjacent ones (6912..7874). By definition: bitmap
    1000 + 990 = 1990 bytes; 1-byte gaps (990 + 27 symbols) + 990 = 2007; 2-byte gaps 1980 + 990; dense 8000.
    The bitmap is the smallest. Mutant: gap sizes counted their symbols only (1017 < 1990), so 1-byte gaps
    were sent, 17 bytes more than the bitmap."""
    positions = [256 * k + 255 for k in range(27)] + list(range(6912, 7875))
    assert len(positions) == 990 and positions[26] == 6911
    mask = torch.zeros(8000, dtype=torch.bool)
    mask[positions] = True
    current = (torch.arange(8000) % 100).to(torch.int8)
    encoding, parts, _ = _encode(current, mask, 990)
    assert encoding == BITMAP
    assert [p.numel() * p.element_size() for p in parts] == [1000, 990]
    index, flags = _decode(parts[0], BITMAP, 8000)
    assert index.tolist() == positions and not any(bool(f) for f in flags)


# ----- patch: init_sync.enabled=false ------------------------------------------------------------------------------

def _bootstrap_disabled(rank, world_size, prefixes, receiver_doubles):
    """init_sync disabled (prefixes as given); the receiver's `receiver_doubles` weight (if any) starts doubled.
    Each rank returns its init error, else (sender) its stats after init, (receiver) whether it holds rank 0's."""
    from test_sync_bootstrap import TiedNet
    cfg = WeightSyncConfig(type="patch", patch=PatchConfig(init_sync=InitSyncConfig(enabled=False, prefixes=prefixes)))
    syncer = make_weight_syncer(cfg, src=0, dsts=[1])
    net = TiedNet(seed=0)
    if rank == 1 and receiver_doubles:
        with torch.no_grad():
            getattr(net, receiver_doubles).weight.mul_(2.0)
    try:
        syncer.init_sender(net) if rank == 0 else syncer.init_receiver(net)
    except (ValueError, SyncIntegrityError) as error:
        return f"{type(error).__name__}: {error}"
    return syncer.stats if rank == 0 else bits_equal(net.state_dict(), TiedNet(seed=0).state_dict())


@pytest.mark.slow
def test_a_disabled_bootstrap_sends_nothing_so_every_key_must_start_equal():
    """docs (InitSyncConfig.enabled): the bootstrap is sent only when enabled. Disabled, nothing travels at init
    and every key is in the start check: a receiver that differs is refused on both sides, naming the key.
    Mutant: _bootstrap_keys ignored `enabled`, so the whole state_dict was bootstrapped anyway (and the
    differing receiver silently overwritten)."""
    for message in run_ranks(_bootstrap_disabled, 2, args=(None, "frozen")):
        assert message.startswith("SyncIntegrityError") and "frozen.weight" in message and "embed" not in message
    stats, equal = run_ranks(_bootstrap_disabled, 2, args=(None, None))
    assert stats is None and equal is True          # equal starts: accepted, and no bootstrap was sent


@pytest.mark.slow
def test_prefixes_of_a_disabled_bootstrap_are_not_required_to_match():
    """A prefix that matches no key is refused only while the bootstrap is enabled (the bootstrap test checks
    that refusal): with enabled=false the prefixes are unused, and init succeeds. Mutant: the unmatched-prefix
    check ignored `enabled`, so both sides refused init over a setting that does nothing."""
    stats, equal = run_ranks(_bootstrap_disabled, 2, args=(("frozen.w",), None))
    assert stats is None and equal is True


# ----- patch: the sync plan's bootstrap rows ------------------------------------------------------------------------

@pytest.mark.slow
def test_patch_plan_counts_the_bootstrap_of_keys_that_no_patch_carries():
    """The plan's init rows bootstrap every key (init_sync.prefixes None), frozen ones included, while patches
    carry only the synced keys; the plan must still equal the ledger (test_sync_plan covers patch mode without
    frozen keys only). Mutant: plan_rows sized the bootstrap from the synced keys, leaving "steps" out."""
    results = run_ranks(_plan_and_ledger, 3, args=("patch", ("steps",), wire.PACK_BYTES))
    for rank, (rows, ledger, state) in enumerate(results):
        assert expected_ledger(rows, SYNCS) == ledger, f"rank {rank}"
        assert bits_equal(state, results[0][2])


# ----- patch: a missing codec is refused at construction -----------------------------------------------------------

def _construct_without_zstandard(rank, world_size):
    import sys
    sys.modules["zstandard"] = None  # this rank's process only: `import zstandard` now fails
    try:
        make_weight_syncer(WeightSyncConfig(patch=PatchConfig(compression="zstd")), src=0, dsts=[1])
    except ImportError as error:
        return str(error)
    return None


@pytest.mark.slow
def test_zstd_compression_without_the_package_fails_when_the_syncer_is_made():
    """patch.py: compression=zstd without the zstandard package fails when the syncer is constructed, on every
    rank, naming the package, not later at the first sync or apply. Mutant: the construction check dropped."""
    for message in run_ranks(_construct_without_zstandard, 2):
        assert message is not None and "pip install zstandard" in message


# ----- patch: a bootstrap that lost the link leaves the receiver uninitialized -------------------------------------

def _bootstrap_header_damaged(rank, world_size):
    from dist.comm import CollectiveError
    from test_sync_common import damaged_receives
    syncer = make_weight_syncer(WeightSyncConfig(type="patch"), src=0, dsts=[1])
    if rank == 0:
        try:
            syncer.init_sender({"w": torch.zeros(100)})
        except CollectiveError:
            pass  # the receiver, which gave up on the link, may have gone before the rest of the frame was sent
        return None

    def version_flipped(header):
        if header.dtype == torch.int64 and header.numel() == 9:   # the 72-byte frame header only
            header[2] += 1

    with damaged_receives("recv_then_count", version_flipped), pytest.raises(SyncIntegrityError) as error:
        syncer.init_receiver({"w": torch.ones(100)})
    with pytest.raises(RuntimeError, match="call init_sender/init_receiver first") as uninitialized:
        syncer.plan_rows()
    return error.value.link_lost, str(error.value), str(uninitialized.value)


@pytest.mark.slow
def test_an_init_bootstrap_that_lost_the_link_leaves_the_receiver_uninitialized():
    """A bootstrap header damaged in flight is a lost link (the rest of the frame cannot be drained): the
    receiver raises at once and stays uninitialized, since resync() cannot recover it; only a refused bootstrap
    with the link intact leaves it initialized and waiting for resync(). Mutant: init_receiver treated a lost
    link like a refusal (took part in the start check, then counted as initialized, so apply() waited on a dead
    link for a patch)."""
    _, (link_lost, message, uninitialized) = run_ranks(_bootstrap_header_damaged, 2, timeout=60)
    assert link_lost is True and "resync() cannot recover this link" in message
    assert "call init_sender/init_receiver first" in uninitialized


# ----- patch: the start check leaves out what the bootstrap carried ------------------------------------------------

def _bootstrap_values_damaged_then_resync(rank, world_size):
    cfg = WeightSyncConfig(type="patch", patch=PatchConfig(init_sync=InitSyncConfig(prefixes=("w",))))
    syncer = make_weight_syncer(cfg, src=0, dsts=[1])
    if rank == 0:
        state = {"w": torch.arange(6.0), "b": torch.ones(2)}   # b: outside the bootstrap, checked at the start
        syncer.init_sender(state)   # must return: the receiver's refusal of the bootstrap is its own to report
        state["w"][1] = 7.0
        syncer.resync(state, 1)
        return snapshot(state)
    model = {"w": torch.zeros(6), "b": torch.ones(2)}

    def damaged(frame):
        frame.wait()
        frame.row(0)[1][3] += 100.0   # the value landed in the model, then found wrong by the trailer's check
        frame.trailer[0] += 1

    with damaged_frames(damaged), pytest.raises(SyncIntegrityError) as error:
        syncer.init_receiver(model)
    assert error.value.model_written and not error.value.link_lost and model["w"][3] == 103.0
    assert syncer.resync(model) == 1
    return model


@pytest.mark.slow
def test_a_bootstrap_the_receiver_refused_does_not_fail_the_sender_s_start_check():
    """The start check compares only the keys outside the bootstrap (here "b"): a bootstrapped key the receiver
    refused (its "w" left wrong in the model) is the receiver's to report, and the sender's init returns, so that
    resync() recovers both. Mutant: the start check covered the bootstrapped keys too, so the sender's init
    raised over "w" as well."""
    sender, receiver = run_ranks(_bootstrap_values_damaged_then_resync, 2, timeout=60)
    assert bits_equal(receiver, sender) and sender["w"].tolist() == [0.0, 7.0, 2.0, 3.0, 4.0, 5.0]


# ----- config: a version or rank must fit the wire's int64 ---------------------------------------------------------

def test_an_integer_fits_the_wire_only_inside_int64():
    """sync/config.py is_int: what require() and the handshake accept as a version or a rank must fit an int64
    word of the frame header, -2**63 .. 2**63 - 1 by the two's complement range. Mutant: the upper bound
    inclusive, so sync(state, 2**63) passed the version check and failed later, converting the header."""
    from sync.config import is_int
    assert is_int(2**63 - 1) and is_int(-2**63) and is_int(0)
    assert not is_int(2**63) and not is_int(-2**63 - 1)
    assert not is_int(True) and not is_int(1.0) and not is_int(torch.tensor(1))
