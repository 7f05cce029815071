"""Bad input is a clear error naming what to fix: configs, handshakes (both sides raise), calls."""

import sys

import pytest
import torch

from multirank import run_ranks
from sync import BucketConfig, InitSyncConfig, PatchConfig, WeightSyncConfig, make_weight_syncer
from sync import handshake
from sync.wire import FORMAT, require_zstd


@pytest.mark.parametrize("build, message", [
    (lambda: WeightSyncConfig(type="delta"), "type='delta' is not one of 'patch', 'bucket'"),
    (lambda: PatchConfig(compression="lz5"), "patch.compression='lz5'"),
    (lambda: PatchConfig(compression="zstd", transport_device="cuda"), "set patch.transport_device=cpu"),
    (lambda: PatchConfig(snapshot_device="gpu"), "patch.snapshot_device='gpu'"),
    (lambda: BucketConfig(bucket_size=0), "bucket.bucket_size must be a positive number of bytes"),
    (lambda: BucketConfig(bucket_dtype="int8"), "bucket.bucket_dtype='int8'"),
    (lambda: InitSyncConfig(prefixes="actor"), "must be a list of key prefixes"),
    (lambda: InitSyncConfig(prefixes=[]), "must be None or non-empty strings"),
])
def test_bad_config_names_the_field(build, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        build()


def test_missing_codec_names_the_package(monkeypatch):
    monkeypatch.setitem(sys.modules, "zstandard", None)  # makes `import zstandard` fail
    with pytest.raises(ImportError, match="pip install zstandard"):
        require_zstd()


def _state():
    return {"a": torch.zeros(4, 3), "b": torch.zeros(5), "steps": torch.zeros(2, dtype=torch.int64)}


# (what the receiver changes, what both sides' error must say)
HANDSHAKES = [
    ("keys", "missing on the receiver ['b'], unexpected on the receiver ['extra']"),
    ("shape", "'a' has shape [3, 4] on the receiver and [4, 3] on the sender"),
    ("int dtype", "'steps' is torch.float32 on the receiver and torch.int64 on the sender"),
    ("config", "config differs from the sender's, by field (sender, receiver): {'patch.verify_every': (100, 7)}"),
    ("not contiguous", "not_contiguous on the receiver: ['a']"),
    ("not a tensor", "not_tensors on the sender: ['note']"),  # on both sides: keys, shapes and dtypes agree
    ("format", "wire format 1 on the receiver, 3 on the sender: run the same syncppo version on both sides"),
]
# (keys the sender asks to sync, what both sides' error must say)
SENDER_KEYS = [(["a", "nope"], "keys to sync not in the sender's state_dict: ['nope']"),
               ([], "the list of keys to sync is empty")]


def _bad_handshakes(rank, world_size):
    messages = []
    for change, _ in HANDSHAKES:
        cfg = WeightSyncConfig(type="patch")
        state = _state()
        if change == "not a tensor":
            state["note"] = "v1"
        if rank == 1:
            if change == "keys":
                state["extra"] = state.pop("b")
            elif change == "shape":
                state["a"] = torch.zeros(3, 4)
            elif change == "int dtype":
                state["steps"] = state["steps"].float()
            elif change == "config":
                cfg.patch.verify_every = 7
            elif change == "not contiguous":
                state["a"] = torch.zeros(3, 4).t()
            elif change == "format":  # a receiver built from an older syncppo (checksums over other lanes)
                handshake.FORMAT = 1
        syncer = make_weight_syncer(cfg, src=0, dsts=[1])
        with pytest.raises(ValueError) as error:
            syncer.init_sender(state) if rank == 0 else syncer.init_receiver(state)
        handshake.FORMAT = FORMAT
        messages.append(str(error.value))
    for keys, _ in SENDER_KEYS:
        syncer = make_weight_syncer(WeightSyncConfig(type="patch"), src=0, dsts=[1])
        with pytest.raises(ValueError) as error:
            syncer.init_sender(_state(), keys=keys) if rank == 0 else syncer.init_receiver(_state())
        messages.append(str(error.value))
    # A bf16 receiver of an fp32 sender is fine: floating dtypes may differ.
    syncer = make_weight_syncer(WeightSyncConfig(type="bucket"), src=0, dsts=[1])
    state = _state() if rank == 0 else {**_state(), "a": torch.zeros(4, 3, dtype=torch.bfloat16)}
    syncer.init_sender(state) if rank == 0 else syncer.init_receiver(state)
    return messages


@pytest.mark.slow
def test_handshake_mismatches_fail_on_both_sides_with_the_reason():
    for messages in run_ranks(_bad_handshakes, 2):
        assert len(messages) == len(HANDSHAKES) + len(SENDER_KEYS)
        for (_, expected), message in zip(HANDSHAKES + SENDER_KEYS, messages):
            assert expected in message, message


def _reply_of_an_older_sender(rank, world_size):
    import sync.link
    syncer = make_weight_syncer(WeightSyncConfig(type="patch"), src=0, dsts=[1])
    if rank == 0:
        return syncer.agree(_state())           # the handshake alone: the receiver stops there
    real = sync.link.recv_json

    def older_reply(*args):  # what a sender before format 2 replied: it compared no format and named none
        reply, size = real(*args)
        return {k: v for k, v in reply.items() if k != "format"}, size
    sync.link.recv_json = older_reply
    with pytest.raises(ValueError) as error:
        syncer.agree(_state())
    return str(error.value)


@pytest.mark.slow
def test_a_receiver_refuses_the_reply_of_a_sender_on_an_older_wire_format():
    """The sender compares formats, but a sender from before format 2 does not: it accepted a newer receiver, whose
    first frame then failed its header checksum as "corrupted". The reply carries the sender's format, and the
    receiver refuses one without it, naming both."""
    _, message = run_ranks(_reply_of_an_older_sender, 2)
    assert message == ("weight sync init: wire format 3 on the receiver, None on the sender: run the same syncppo "
                       "version on both sides")


def _bad_calls(rank, world_size):
    with pytest.raises(ValueError, match="neither the sender"):
        make_weight_syncer(WeightSyncConfig(), src=5, dsts=[6])
    with pytest.raises(ValueError, match="distinct receiver ranks other than the sender 0"):
        make_weight_syncer(WeightSyncConfig(), src=0, dsts=[0, 1])
    with pytest.raises(ValueError, match="distinct receiver ranks other than the sender 0"):
        make_weight_syncer(WeightSyncConfig(), src=0, dsts=[1, 1])
    with pytest.raises(ValueError, match=r"src=0, dsts=\[1, 2\] name ranks outside the group's \[0, 1\]"):
        make_weight_syncer(WeightSyncConfig(), src=0, dsts=[1, 2])   # the docs' example on 2 ranks: init hung
    with pytest.raises(ValueError, match="sends cuda tensors with gloo"):
        make_weight_syncer(WeightSyncConfig(type="bucket", bucket=BucketConfig(bucket_device="cuda")), 0, [1])
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="snapshot_device=cuda but CUDA is not available"):
            make_weight_syncer(WeightSyncConfig(type="patch", patch=PatchConfig(snapshot_device="cuda")), 0, [1])
    syncer = make_weight_syncer(WeightSyncConfig(type="bucket"), src=0, dsts=[1])
    state = _state()
    with pytest.raises(RuntimeError, match="call init_sender/init_receiver first"):
        syncer.sync(state, 1) if rank == 0 else syncer.apply(state)
    with pytest.raises(RuntimeError, match="call init_sender/init_receiver first"):   # not an AttributeError
        syncer.resync(state, 1) if rank == 0 else syncer.resync(state)
    if rank == 0:
        with pytest.raises(RuntimeError, match="rank 0 is the sender; call the sender methods"):
            syncer.apply(state)
        syncer.init_sender(state)
        with pytest.raises(RuntimeError, match="init already ran: call resync"):   # it had waited for a handshake
            syncer.init_sender(state)
        with pytest.raises(ValueError, match="version must increase, last sent 0, got 0"):
            syncer.sync(state, 0)
        with pytest.raises(KeyError, match=r"missing \['b'\], unexpected \['c'\]"):
            syncer.sync({"a": state["a"], "c": state["b"], "steps": state["steps"]}, 1)
        with pytest.raises(KeyError, match=r"missing \[\], unexpected \['extra'\]"):
            syncer.sync({**state, "extra": torch.zeros(1)}, 1)    # an extra key alone is refused as well
        with pytest.raises(ValueError, match=r"shape or dtype changed since init for \['a'\]"):
            syncer.sync({**state, "a": torch.zeros(3, 4)}, 1)
        with pytest.raises(ValueError, match="the sender's resync needs the .integer. version to restart from, got None"):
            syncer.resync(state)
        syncer.sync(state, 1)
    else:
        syncer.init_receiver(state)
        with pytest.raises(RuntimeError, match="init already ran: call resync"):
            syncer.init_receiver(state)
        with pytest.raises(KeyError, match=r"receiver model keys differ from init_receiver: missing \['steps'\]"):
            syncer.apply({"a": state["a"], "b": state["b"]})
        with pytest.raises(KeyError, match=r"missing \[\], unexpected \['extra'\]"):
            syncer.apply({**state, "extra": torch.zeros(1)})
        with pytest.raises(ValueError, match="load_instant=true writes buckets as they arrive"):
            syncer.apply(state, blocking=False)
        with pytest.raises(TypeError, match="expected an nn.Module or a state_dict, got list"):
            syncer.apply([state["a"]])
        assert syncer.apply(state) == 1
    return True


@pytest.mark.slow
def test_bad_calls_are_clear_errors():
    """Each wrong call raises, naming what to fix.

    Mutant: Link's check that src and dsts are ranks of the group dropped: dsts=[1, 2] on 2 ranks (the docs' example
    run on 2) was taken, and init waited for rank 2's handshake until the process group's timeout."""
    assert run_ranks(_bad_calls, 2) == [True, True]


def _unlike_receivers(rank, world_size):
    state = _state()
    if rank == 2:
        state["a"] = state["a"].to(torch.bfloat16)  # fine on its own, but unlike receiver 1
    syncer = make_weight_syncer(WeightSyncConfig(type="patch"), src=0, dsts=[1, 2])
    with pytest.raises(ValueError) as error:
        syncer.init_sender(state) if rank == 0 else syncer.init_receiver(state)
    return str(error.value)


@pytest.mark.slow
def test_receivers_of_one_syncer_must_be_alike():
    for message in run_ranks(_unlike_receivers, 3):
        assert "receiver rank 2 differs from receiver rank 1" in message


def test_make_weight_syncer_refuses_a_config_that_is_not_a_weight_sync_config():
    """Mutant: the type check dropped, a YAML mapping given in place of the config failed with an AttributeError
    (`dict` has no `type`) instead of a TypeError that names what to pass. No rank is needed: it fails first."""
    with pytest.raises(TypeError, match="weight sync needs a WeightSyncConfig, got dict"):
        make_weight_syncer({"type": "patch"}, src=0, dsts=[1])


def _receiver_with_an_extra_key(rank, world_size):
    syncer = make_weight_syncer(WeightSyncConfig(type="bucket"), src=0, dsts=[1])
    state = {"w": torch.zeros(3)} if rank == 0 else {"w": torch.zeros(3), "extra": torch.zeros(2)}
    with pytest.raises(ValueError) as caught:
        if rank == 0:
            syncer.init_sender(state)
        else:
            syncer.init_receiver(state)
    return str(caught.value)


@pytest.mark.slow
def test_a_receiver_key_the_sender_lacks_fails_the_handshake_on_both_sides():
    """Mutant: only missing keys ended the comparison; a receiver's extra key then reached the per-key shape
    check, whose lookup raised a KeyError on the sender alone, and the receiver waited for a reply never sent."""
    for message in run_ranks(_receiver_with_an_extra_key, 2, timeout=30):
        assert "missing on the receiver [], unexpected on the receiver ['extra']" in message, message


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
