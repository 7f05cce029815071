"""Tests that kill mutants of sync/'s integrity checks which the other sync tests let survive (hand-picked
mutation testing of wire.py, patch.py, encodings.py, link.py and handshake.py). Most run in one process: frames
go through tests/p2p_wire.py's `Wire`, an in-process stand-in for dist.comm's point-to-point calls (received in the
order sent, a receive of the wrong size an error as in gloo), so that recv_frame meets exactly the bytes send_frame
(or a test) put on the wire. Expected values are worked out by hand or with the reference checksum."""

import pytest
import torch

from dist import comm
from multirank import run_ranks
from sync import SyncIntegrityError, WeightSyncConfig, make_weight_syncer
from sync.encodings import _encode
from sync.wire import (BITMAP, DENSE, GAPS8, KIND_PATCH, MAGIC, _check_table, recv_frame, send_frame,
                       zstd_bound, zstd_compress, zstd_decompress)
from test_checksum_reference import ref_checksum, ref_tensor_checksum
from tests.p2p_wire import Wire


def send_words(words, table=None):
    """Rank 0 sends rank 1 a header of these 7 words with correct checks of the words (and of the table), then the
    table."""
    words_t = torch.tensor(words, dtype=torch.int64)
    table_t = torch.zeros(0, 4, dtype=torch.int64) if table is None else torch.tensor(table, dtype=torch.int64)
    checks = [ref_checksum([words_t]), ref_checksum([words_t, table_t])]
    comm.send(torch.tensor(words + checks, dtype=torch.int64), "weight_sync", 1)
    if table is not None:
        comm.send(table_t, "weight_sync", 1)


EXPECT_F32 = lambda kind: ("weight_sync", [torch.float32, torch.float32], None)  # noqa: E731


def _receive(wire, numels=(4, 4), expect=EXPECT_F32):
    """Rank 1 receives the next frame from rank 0."""
    wire.me = 1
    return recv_frame(0, None, "cpu", list(numels), expect)


# ----- wire.py: recv_frame and _check_table ------------------------------------------------------------------

def test_a_header_announcing_one_row_more_than_the_receiver_has_tensors_is_refused_before_any_table(monkeypatch):
    """A receiver of 2 tensors can take at most 2 table rows; a header (with a correct check) announcing 3 must be
    refused by its row count, as a lost link, before a 96-byte table receive is posted (the header's is the one
    receive posted; nothing more is queued, so a table receive would wait for ever).
    Mutant: `0 <= rows <= len(numels) + 1` in recv_frame."""
    wire = Wire(monkeypatch)
    send_words([MAGIC, KIND_PATCH, 1, 0, 3, 0, 0])
    with pytest.raises(SyncIntegrityError, match=r"announces 3 table rows") as caught:
        _receive(wire)
    assert caught.value.link_lost and not wire.unread() and wire.posted == 1


def test_a_bitmap_row_with_more_symbol_bytes_than_its_tensor_needs_is_refused():
    """A bitmap of a 100-element tensor is exactly ceil(100 / 8) = 13 bytes; a row announcing 14 (a byte no
    sender writes, whose bits _decode would not look at if zero) is malformed, and so is 12.
    Mutant: `symbols >= (numel + 7) // 8` for BITMAP in _check_table."""
    numels = [10, 100]
    _check_table(torch.tensor([[1, 3, BITMAP, 13]]), numels)
    for symbols in (12, 14, 26):
        with pytest.raises(SyncIntegrityError, match=r"malformed table row \[1, 3, 3, %d\]" % symbols):
            _check_table(torch.tensor([[1, 3, BITMAP, symbols]]), numels)


def test_rows_of_empty_tensors_must_still_name_a_next_tensor():
    """A whole empty tensor is a dense row of 0 values and 0 symbols (bucket frames carry them); such a row must
    still name a tensor after the previous row's and inside the receiver's list: a repeated row and an ordinal
    past the last tensor are malformed, as they are for rows of values.
    Mutant: `numel = ... else 0` (an unknown or repeated tensor given numel 0, not -1) in _check_table."""
    numels = [0, 5]
    _check_table(torch.tensor([[0, 0, DENSE, 0], [1, 5, DENSE, 0]]), numels)
    for rows in ([[0, 0, DENSE, 0], [0, 0, DENSE, 0]], [[1, 5, DENSE, 0], [0, 0, DENSE, 0]], [[2, 0, DENSE, 0]]):
        with pytest.raises(SyncIntegrityError, match=r"malformed table row \[%d, 0, 4, 0\]" % rows[-1][0]):
            _check_table(torch.tensor(rows), numels)


# ----- patch.py: _write ---------------------------------------------------------------------------------------

def _two_patches(rank, numel_v, v_at):
    """Rank 0 sends patch 1 (w[3] = 1) and patch 2 (v[v_at] = 2) of {w, v}, 100 and `numel_v` zeros, and returns
    (None, None); rank 1 returns its initialized receiver and its model."""
    syncer = make_weight_syncer(WeightSyncConfig(type="patch"), src=0, dsts=[1])
    state = {"w": torch.zeros(100), "v": torch.zeros(numel_v)}
    if rank == 0:
        syncer.init_sender(state)
        state["w"][3] = 1.0
        syncer.sync(state, 1)
        state["v"][v_at] = 2.0
        syncer.sync(state, 2)
        return None, None
    syncer.init_receiver(state)
    return syncer, state


def _two_patches_then_a_stale_one(rank, world_size):
    """Patches 1 (w[3] = 1) and 2 (v[5] = 2); rank 1 takes both with recv_update, applies them in order, then offers
    patch 1 again (its base, 0, is older than the version held, 2)."""
    syncer, state = _two_patches(rank, 100, 5)
    if syncer is None:
        return None
    first, second = syncer.recv_update(), syncer.recv_update()
    assert syncer.apply_update(state, first) == 1 and syncer.apply_update(state, second) == 2
    with pytest.raises(SyncIntegrityError, match="patch 1 applies to version 0 but this receiver holds version 2"):
        syncer.apply_update(state, first)
    return syncer.version, {k: v.clone() for k, v in state.items()}


@pytest.mark.slow
def test_a_patch_older_than_the_version_held_is_refused_not_applied_again():
    """A receiver holding version 2 must refuse patch 1 (base 0) offered again: its base is not the version held.
    Here patch 1 touches only w, whose checksum after patch 1 equals w's now, so no checksum would catch it: only
    the base check does, and the version must stay 2 (not go back to 1), the model unchanged.
    Mutant: `frame.base > self.version` in PatchSyncer._write (only a newer base refused)."""
    _, (version, state) = run_ranks(_two_patches_then_a_stale_one, 2)
    expected_w, expected_v = torch.zeros(100), torch.zeros(100)
    expected_w[3], expected_v[5] = 1.0, 2.0
    assert version == 2 and torch.equal(state["w"], expected_w) and torch.equal(state["v"], expected_v)


def test_a_gap_row_with_more_symbols_than_its_tensor_allows_is_refused_before_any_allocation(monkeypatch):
    """A gap stream of `values` changes in a tensor of `numel` elements has one symbol per change plus one escape
    per `escape` (255 for 1-byte gaps) of gap, and the gaps sum to at most numel - values: so at most
    values + (numel - values) // 255 symbols. The sender's own worst case reaches that bound and passes: changes at
    0-9 and 999 of 1000 (gaps 0 and 989: 11 + 3 escapes = 14 = 11 + 989 // 255 symbols); one more is refused. A
    row (with a correct check) announcing 1000 symbols for 3 changes in 100 elements (at most 3) is refused as a
    malformed row before the 1012-byte payload receive is sized from it (only the header and table receives are
    posted; nothing more is queued, so a payload receive would wait for ever). Until 2026-12-06 the only cap was
    2**40 symbols (4 TiB of gaps32), which the receiver allocated and waited for.
    Mutant: `values <= symbols < 2**40` (the cap before the fix) in _check_table."""
    current, mask = torch.zeros(1000), torch.zeros(1000, dtype=torch.bool)
    index = torch.tensor([*range(10), 999])
    mask[index] = True
    encoding, segments, _ = _encode(current, mask, 11, index)
    assert encoding == GAPS8 and segments[0].numel() == 14 == 11 + 989 // 255
    _check_table(torch.tensor([[0, 11, GAPS8, 14]]), [1000])
    with pytest.raises(SyncIntegrityError, match=r"malformed table row \[0, 11, 0, 15\]"):
        _check_table(torch.tensor([[0, 11, GAPS8, 15]]), [1000])
    wire = Wire(monkeypatch)
    send_words([MAGIC, KIND_PATCH, 1, 0, 1, 1012, 1012], [[1, 3, GAPS8, 1000]])
    with pytest.raises(SyncIntegrityError, match=r"malformed table row \[1, 3, 0, 1000\]") as caught:
        _receive(wire, numels=(10, 100))
    assert caught.value.link_lost and not wire.unread() and wire.posted == 2


def test_a_compressed_payload_longer_than_zstd_can_write_is_refused_before_its_receive(monkeypatch):
    """zstd writes at most raw + raw // 256 + (2**17 - raw) // 2**11 bytes for raw bytes (ZSTD_COMPRESSBOUND; 79 for
    16), and a blob only when there is a payload. A compressed frame whose header (with a correct check) announces
    80 bytes, 2**40 (a receive and an allocation of 1 TiB) or none for the 16 raw bytes of its table is refused
    before the blob's receive is sized; a real compressed frame of 16 random bytes arrives whole.
    Mutant: the compressed payload's size left unbounded (`wire != raw if decompress is None else False`)."""
    assert zstd_bound(16) == 16 + 0 + 63
    for wire_bytes in (80, 2**40, 0):
        wire = Wire(monkeypatch)
        send_words([MAGIC, KIND_PATCH, 1, 0, 1, wire_bytes, 16], [[0, 4, DENSE, 0]])
        with pytest.raises(SyncIntegrityError, match=r"announces payload sizes its table does not") as caught:
            _receive(wire, expect=lambda kind: (*EXPECT_F32(kind), zstd_decompress))
        assert caught.value.link_lost and not wire.unread() and wire.posted == 2
    wire = Wire(monkeypatch)
    values = torch.rand(4, generator=torch.Generator().manual_seed(0))
    send_frame(KIND_PATCH, 1, 0, torch.tensor([[0, 4, DENSE, 0]]), [values], lambda: [0], [1], None, "cpu",
               "weight_sync", zstd_compress)
    frame = _receive(wire, expect=lambda kind: (*EXPECT_F32(kind), zstd_decompress))
    assert 0 < frame.sizes[0] <= 79 and frame.sizes[1] == 16 and torch.equal(frame.row(0)[1], values)
    assert frame.sums() == [0] and not wire.unread()


def _a_copy_of_one_tensor(rank, world_size):
    """Patches 1 (w[3] = 1) and 2 (v[7] = 2), v of 1000 zeros; rank 1 applies patch 1 to its model, then patch 2 to a
    dict holding its own w but a copy of v that differs at v[500] (stale)."""
    syncer, state = _two_patches(rank, 1000, 7)
    if syncer is None:
        return None
    assert syncer.apply(state) == 1
    stale = state["v"].clone()
    stale[500] = 9.0
    with pytest.raises(SyncIntegrityError) as caught:
        syncer.apply({"w": state["w"], "v": stale})
    return str(caught.value), syncer.version, stale


@pytest.mark.slow
def test_a_model_with_one_tensor_in_other_memory_is_rescanned_before_a_patch():
    """apply() given tensors in other memory than the last patch wrote rescans them first; that must hold when
    only one tensor (v, the second) is a copy. The copy differs from the receiver's v at v[500], which patch 2
    (1 change in 1000: under 1/64, checked from the changed element alone) never looks at: only the rescan finds
    it. So the patch is refused naming v, and the copy is left untouched (v[7] still 0).
    Mutant: only the first synced tensor's memory compared with the last patch's (`[...][:1] != self._memory[:1]`)
    in PatchSyncer._write."""
    _, (message, version, stale) = run_ranks(_a_copy_of_one_tensor, 2)
    assert "verification found ['v'] were given to apply() in other memory than the last patch wrote" in message
    assert version == 1 and stale[7] == 0.0 and stale[500] == 9.0
