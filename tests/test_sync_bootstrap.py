"""patch init bootstrap over gloo: prefixes, frozen parameters, tied weights sent once, checked starts, and a
disabled bootstrap (nothing sent, every key checked, its prefixes unused); bucket mode's resync (synced keys only)."""

import pytest
import torch
from torch import nn

from multirank import run_ranks
from sync import InitSyncConfig, PatchConfig, SyncIntegrityError, WeightSyncConfig, make_weight_syncer, trainable_keys
from test_sync_common import bits_equal, snapshot


class TiedNet(nn.Module):
    """Embedding tied to the output head, a frozen layer, a persistent and a non-persistent buffer."""

    def __init__(self, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(50, 8)
        self.head = nn.Linear(8, 50, bias=False)
        self.head.weight = self.embed.weight
        self.frozen = nn.Linear(8, 8)
        self.frozen.requires_grad_(False)
        self.register_buffer("count", torch.tensor(0))
        self.register_buffer("scratch", torch.zeros(3), persistent=False)


EMBED, FROZEN, COUNT = 50 * 8 * 4, (8 * 8 + 8) * 4, 8  # bytes of each part in fp32 / int64


def _frozen_and_tied(rank, world_size):
    syncer = make_weight_syncer(WeightSyncConfig(type="patch"), src=0, dsts=list(range(1, world_size)))
    net = TiedNet(seed=rank)  # every rank starts from different weights
    if rank == 0:
        syncer.init_sender(net, keys=trainable_keys(net))
        bootstrap = syncer.stats
        with torch.no_grad():
            net.embed.weight.add_(1.0)  # every element of the tied weight
            net.frozen.weight.add_(1.0)  # frozen: not part of patches
            net.count += 1
        patch = syncer.sync(net, 1)
        after_patch = snapshot(net.state_dict())
        syncer.resync(net, 2)
        resync = syncer.stats
        return [(s.wire_bytes, s.payload_bytes, s.changed_elements) for s in (bootstrap, patch, resync)], after_patch, \
            snapshot(net.state_dict())
    syncer.init_receiver(net)
    at_start = snapshot(net.state_dict())
    assert syncer.apply(net) == 1
    after_patch = snapshot(net.state_dict())
    assert syncer.resync(net) == 2
    tied = net.head.weight.data_ptr() == net.embed.weight.data_ptr()
    return at_start, after_patch, snapshot(net.state_dict()), tied


@pytest.mark.slow
def test_frozen_parameters_bootstrap_and_resync_only_and_tied_weights_travel_once():
    (stats, sender_after_patch, sender_final), *receivers = run_ranks(_frozen_and_tied, 3)
    bootstrap, patch, resync = stats
    sender_start = snapshot(TiedNet(seed=0).state_dict())
    # Bootstrap: the whole state_dict, the tied weight once, frozen layer included, no non-persistent buffer:
    # one frame of 4 rows (a 32-byte table row and an 8-byte checksum each, then the 8-byte trailer check).
    assert bootstrap == (72 + 4 * 40 + 8 + EMBED + FROZEN + COUNT, EMBED + FROZEN + COUNT, 400 + 72 + 1)
    # Patch: tied weight (dense, once) and count; the frozen layer is not tracked. Two rows.
    assert patch == (72 + 2 * 40 + 8 + EMBED + COUNT, EMBED + COUNT, 400 + 1)
    assert resync == bootstrap[:2] + (473,)
    for at_start, after_patch, final, tied in receivers:
        assert bits_equal(at_start, sender_start)
        frozen = ("frozen.weight", "frozen.bias")
        assert bits_equal({k: v for k, v in after_patch.items() if k not in frozen},
                          {k: v for k, v in sender_after_patch.items() if k not in frozen})
        assert bits_equal({k: after_patch[k] for k in frozen}, {k: sender_start[k] for k in frozen})
        assert bits_equal(final, sender_final) and tied


def _prefixes(rank, world_size, prefixes, receiver_differs_in):
    cfg = WeightSyncConfig(type="patch", patch=PatchConfig(init_sync=InitSyncConfig(prefixes=prefixes)))
    syncer = make_weight_syncer(cfg, src=0, dsts=[1])
    net = TiedNet(seed=0)
    if rank == 0:
        try:
            syncer.init_sender(net)
        except (ValueError, SyncIntegrityError) as error:
            return f"{type(error).__name__}: {error}"
        return syncer.stats.payload_bytes
    with torch.no_grad():
        getattr(net, receiver_differs_in).weight.mul_(2.0)
    try:
        syncer.init_receiver(net)
    except (ValueError, SyncIntegrityError) as error:
        return f"{type(error).__name__}: {error}"
    return bits_equal(net.state_dict(), TiedNet(seed=0).state_dict())


@pytest.mark.slow
def test_bootstrap_prefixes_send_only_their_keys_and_the_rest_must_start_equal():
    # Receiver differs only inside the prefix: the bootstrap repairs it, sending only frozen.*.
    sent, equal = run_ranks(_prefixes, 2, args=(("frozen",), "frozen"))
    assert sent == FROZEN and equal is True
    # Receiver differs outside the prefix: both sides refuse at init and name the key.
    for message in run_ranks(_prefixes, 2, args=(("frozen",), "embed")):
        assert message.startswith("SyncIntegrityError") and "embed.weight" in message and "frozen" not in message
    # A prefix that matches nothing is a configuration error on both sides ("frozen.w" is not a module path).
    for message in run_ranks(_prefixes, 2, args=(("frozen.w",), "frozen")):
        assert message.startswith("ValueError") and "['frozen.w'] match no state_dict key" in message


def _one_receiver_differs(rank, world_size):
    cfg = WeightSyncConfig(type="patch", patch=PatchConfig(init_sync=InitSyncConfig(prefixes=("frozen",))))
    syncer = make_weight_syncer(cfg, src=0, dsts=[1, 2])
    net = TiedNet(seed=0)
    if rank == 2:
        with torch.no_grad():
            net.embed.weight.mul_(2.0)      # outside the bootstrap prefix: must start equal, and does not here
    try:
        syncer.init_sender(net) if rank == 0 else syncer.init_receiver(net)
    except SyncIntegrityError as error:
        return str(error)
    return None


@pytest.mark.slow
def test_a_start_check_refuses_on_the_sender_when_any_one_receiver_differs():
    """Two receivers, only the second differs outside the bootstrap: the sender, which compares every receiver,
    must refuse naming that receiver rank and key; the differing receiver refuses too. (The equal receiver has
    nothing to refuse: it compares itself with the sender only.)"""
    sender, equal, differs = run_ranks(_one_receiver_differs, 3)
    assert sender is not None and "(by receiver rank): {2: ['embed.weight']}" in sender
    assert equal is None
    assert differs is not None and "(by receiver rank): {2: ['embed.weight']}" in differs   # itself, not the sender


def _bootstrap_disabled(rank, world_size, prefixes, receiver_doubles):
    """init_sync disabled (prefixes as given); the receiver's `receiver_doubles` weight (if any) starts doubled.
    Each rank returns its init error, else (sender) its stats after init, (receiver) whether it holds rank 0's."""
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


def _bucket_resync_with_a_frozen_key(rank, world_size):
    syncer = make_weight_syncer(WeightSyncConfig(type="bucket"), src=0, dsts=[1])
    state = {"w": torch.zeros(10), "frozen": torch.arange(6.0)}  # equal on both sides, as init checks
    if rank == 0:
        syncer.init_sender(state, keys=["w"])
        state["w"][:] = 3.0
        state["frozen"][:] = -1.0   # a later change to a key no sync carries
        syncer.resync(state, 1)
        return syncer.stats.payload_bytes
    syncer.init_receiver(state)
    assert syncer.resync(state) == 1
    return snapshot(state)


@pytest.mark.slow
def test_a_bucket_resync_resends_the_synced_keys_only():
    """docs/weight_sync.md, Frozen parameters: bucket mode "has no bootstrap, and its resync() resends the synced
    keys only" (unlike patch's resync, which resends the bootstrap keys too). Mutant: BucketSyncer.resync sent every
    key (`self.once_per_tie(self.keys)`), frozen ones included."""
    payload, receiver = run_ranks(_bucket_resync_with_a_frozen_key, 2)
    assert payload == 10 * 4                       # w's 10 float32 values alone
    assert receiver["w"].tolist() == [3.0] * 10
    assert receiver["frozen"].tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]


def _bootstrap_and_resync_sizes(rank, world_size):
    cfg = WeightSyncConfig(type="patch", patch=PatchConfig(init_sync=InitSyncConfig(bucket_size=80)))
    syncer = make_weight_syncer(cfg, src=0, dsts=[1])
    state = {"a": torch.zeros(10), "b": torch.zeros(10), "c": torch.zeros(10)}  # 40 bytes each
    if rank == 0:
        syncer.init_sender(state)
        bootstrap = syncer.stats
        for key, value in state.items():
            value += ord(key)
        syncer.resync(state, 1)
        return [(s.wire_bytes, s.payload_bytes) for s in (bootstrap, syncer.stats)]
    syncer.init_receiver(state)
    assert syncer.resync(state) == 1
    return snapshot(state)


@pytest.mark.slow
def test_init_sync_bucket_size_sizes_the_bootstrap_and_every_resync():
    """docs/weight_sync.md, Config: `patch.init_sync.bucket_size` is the "bucket size of that bootstrap (and of
    `resync()`)". Three 40-byte tensors in buckets of 80 bytes: [a, b] then [c], two frames of header (72), a
    32-byte table row and an 8-byte checksum per tensor and a trailer check (8). Mutant: PatchSyncer.resync sized its
    buckets by `bucket.bucket_size` (512 MiB: one frame)."""
    stats, receiver = run_ranks(_bootstrap_and_resync_sizes, 2)
    frames = (72 + 2 * 40 + 8) + (72 + 40 + 8) + 120
    assert stats == [(frames, 120), (frames, 120)]
    assert [receiver[k].tolist() for k in "abc"] == [[float(ord(k))] * 10 for k in "abc"]
