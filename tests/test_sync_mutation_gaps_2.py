"""Gaps found by a second mutation campaign over sync/link.py, sync/wire.py and sync/handshake.py (the header's
check word, the checksummed handshake, bootstrap and resync recovery, lost-link flags): each test pins a behaviour
that a small change to sync/ left unnoticed by the rest of the suite. Expected values are worked out by hand in
the comments, not read back from the code under test."""

import pytest
import torch

from multirank import run_ranks
from sync import SyncIntegrityError, WeightSyncConfig, make_weight_syncer
from sync.wire import LINK_LOST
from test_sync_common import damaged_receives, drain, small_patch_sent


def _table_damaged(rank, world_size):
    if rank == 0:
        return small_patch_sent(rank)
    syncer, state = small_patch_sent(rank)

    def table_word_changed(tensor):
        if tensor.dim() == 2 and tensor.shape[1] == 4:   # the table, [rows, 4]; its header words left intact
            tensor[1, 1] += 1                            # v's count of values sent: 1 -> 2

    with damaged_receives("recv", table_word_changed), pytest.raises(SyncIntegrityError) as error:
        syncer.apply(state)
    assert not state["w"].any() and not state["v"].any()
    # The rest of the frame: one packed payload (w: 2 one-byte gaps and 2 float32 values; v: 1 gap and 1 value,
    # 2 + 8 + 1 + 4 = 15 bytes) and the trailer (2 checksums and their check).
    drain(0, torch.empty(15, dtype=torch.uint8), torch.empty(3, dtype=torch.int64))
    return str(error.value), error.value.link_lost


@pytest.mark.slow
def test_a_damaged_table_is_a_lost_link():
    """A table that fails the header's second check word is refused before its payload is received: that payload
    is still queued and a resync() would read it as a header, so the refusal must say the link is lost (flag and
    message). Mutant: recv_frame's check_header(link_lost=False), which told the caller that resync() recovers."""
    _, (message, link_lost) = run_ranks(_table_damaged, 2, timeout=30)
    assert link_lost is True
    # Header words as sent: magic 0x53594E43, kind 2 (patch), version 1, base 0, 2 rows, 15 bytes on the wire and raw.
    assert message == ("weight sync: frame header [1398361667, 2, 1, 0, 2, 15, 15] or its table failed its checksum "
                       f"(corrupted); {LINK_LOST}")


def _reply_damaged(rank, world_size):
    syncer = make_weight_syncer(WeightSyncConfig(type="bucket"), src=0, dsts=[1])
    state = {"w": torch.zeros(10)}     # every key synced: no start check follows the handshake
    if rank == 0:
        syncer.init_sender(state)      # its reply went out intact; the damage happens on the receiver's side
        return None

    def reply_byte_changed(tensor):
        if tensor.dtype == torch.uint8:    # the sender's JSON reply: its first byte, '{', becomes '['
            tensor[0] = ord("[")

    with damaged_receives("recv", reply_byte_changed), pytest.raises(SyncIntegrityError) as error:
        syncer.init_receiver(state)
    return str(error.value), error.value.link_lost


@pytest.mark.slow
def test_a_damaged_handshake_reply_is_a_lost_link_on_the_receiver():
    """The sender's reply fails its document checksum on the receiver: init_receiver raises a SyncIntegrityError
    flagged link_lost (the sender went on to init's next messages), not an error from reading a reply that is not
    there. Mutant: Link.agree without its `reply is None` test (a TypeError on None["error"])."""
    _, (message, link_lost) = run_ranks(_reply_damaged, 2, timeout=30)
    assert link_lost is True
    assert message == f"weight sync init: the sender's handshake reply arrived corrupted; {LINK_LOST}"


def _handshake_rows(rank, world_size):
    syncer = make_weight_syncer(WeightSyncConfig(type="bucket"), src=0, dsts=[1])
    state = {"w": torch.zeros(10)}
    syncer.init_sender(state) if rank == 0 else syncer.init_receiver(state)
    return {r.rule: (r.collective, r.call_bytes) for r in syncer.plan_rows() if r.rule.startswith("handshake")}


@pytest.mark.slow
def test_the_receiver_s_plan_names_the_sizes_of_the_document_it_sent_and_the_reply_it_received():
    """A receiver's plan rows of the handshake: it sends its metadata document and receives the sender's reply, each
    a 24-byte head (length, checksum, check) then the JSON bytes. Mutant: the receiver's (sent, received) lengths
    swapped in Link.agree, so its plan sent the reply's size and received the document's (the ledger, summed per
    purpose, could not tell)."""
    sender, receiver = run_ranks(_handshake_rows, 2, timeout=30)
    # The sender's reply, as written in Link.agree: no error, version 0, wire format 3, the one synced key.
    reply = len('{"error": null, "version": 0, "format": 3, "keys": ["w"]}')
    assert receiver["handshake: reply (JSON)"] == ("recv", [24, reply])
    assert sender["handshake: reply (JSON)"] == ("send", [24, reply])
    # The document: its length as the sender measured it on arrival, the same bytes the receiver sent.
    document = sender["handshake: metadata (JSON)"][1]
    assert sender["handshake: metadata (JSON)"][0] == "recv" and document[0] == 24 and document[1] > reply
    assert receiver["handshake: metadata (JSON)"] == ("send", document)
