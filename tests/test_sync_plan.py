"""The sync plan of a run that uses sync/ equals the ledger: init traffic and a few syncs, both modes, every
rank, frozen keys' bootstrap included; the bytes of a plan row checked by hand; and the handshake's rows on each
side."""

import pytest
import torch

from dist import comm
from dist.plan import expected_ledger
from multirank import run_ranks
from sync import BucketConfig, WeightSyncConfig, make_weight_syncer, wire
from test_sync_common import bits_equal, make_state, snapshot

SYNCS = 3


def _plan_and_ledger(rank, world_size, mode, frozen, pack_bytes):
    wire.PACK_BYTES = pack_bytes  # 0: every payload segment its own message
    cfg = WeightSyncConfig(type=mode, bucket=BucketConfig(bucket_size=50_000))
    cfg.patch.init_sync.bucket_size = 50_000
    syncer = make_weight_syncer(cfg, src=0, dsts=list(range(1, world_size)))
    state = {**make_state(seed=0), "empty": torch.zeros(0, 3)}
    keys = [k for k in state if k not in frozen]
    comm.reset_ledger()
    if rank == 0:
        syncer.init_sender(state, keys=keys)
        for version in range(1, SYNCS + 1):
            for k in keys:  # every element changes: a patch is then exactly the plan's bound
                state[k].copy_(~state[k] if state[k].dtype == torch.bool else state[k] + 1)
            syncer.sync(state, version)
    else:
        syncer.init_receiver(state)
        for version in range(1, SYNCS + 1):
            assert syncer.apply(state) == version
    return syncer.plan_rows(), {k: list(v) for k, v in comm.LEDGER.items()}, snapshot(state)


@pytest.mark.slow
@pytest.mark.parametrize("mode, frozen, pack_bytes", [("patch", (), wire.PACK_BYTES), ("patch", (), 0),
                                                      ("bucket", ("steps",), wire.PACK_BYTES)])
def test_plan_equals_ledger_for_setup_and_syncs(mode, frozen, pack_bytes):
    results = run_ranks(_plan_and_ledger, 3, args=(mode, frozen, pack_bytes))
    for rank, (rows, ledger, state) in enumerate(results):
        assert {r.purpose for r in rows} == {"weight_sync", "weight_sync_setup"}
        assert {r.collective for r in rows} == {"send", "recv"}
        assert expected_ledger(rows, SYNCS) == ledger, f"rank {rank}"
        assert torch.equal(state["enc.weight"], results[0][2]["enc.weight"])
    sender_update = [r for r in results[0][0] if r.purpose == "weight_sync"]
    receiver_update = [r for r in results[1][0] if r.purpose == "weight_sync"]
    # The sender sends each receiver what that receiver receives.
    assert sender_update[0].call_bytes == receiver_update[0].call_bytes * 2
    if mode == "bucket":
        # By hand: buckets of at most 50,000 bytes over make_state's 7 synced tensors + the empty one, fp32:
        # [scale, enc.bias] | [enc.weight (84,000 bytes)] | [conv.weight, dec.weight, mask, empty] (steps frozen);
        # a frame's payloads of at most 1 MiB travel as one message (148 + 4, then 1200 + 8000 + 6 bytes)
        frames = [[72, 2 * 32, 152, 3 * 8], [72, 32, 84_000, 16], [72, 4 * 32, 9206, 5 * 8]]
        assert sorted(receiver_update[0].call_bytes) == sorted(b for f in frames for b in f)


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


@pytest.mark.slow
def test_patch_plan_counts_the_bootstrap_of_keys_that_no_patch_carries():
    """The plan's init rows bootstrap every key (init_sync.prefixes None), frozen ones included, while patches
    carry only the synced keys; the plan must still equal the ledger (test_sync_plan covers patch mode without
    frozen keys only). Mutant: plan_rows sized the bootstrap from the synced keys, leaving "steps" out."""
    results = run_ranks(_plan_and_ledger, 3, args=("patch", ("steps",), wire.PACK_BYTES))
    for rank, (rows, ledger, state) in enumerate(results):
        assert expected_ledger(rows, SYNCS) == ledger, f"rank {rank}"
        assert bits_equal(state, results[0][2])
