"""sync/'s frames byte by byte against the wire format in docs/weight_sync.md, frames a sender never
produces refused before anything is allocated, the encodings' tie and escape rules, the config's documented
defaults and refusals, the int64 range a version or rank must fit, and whole tensors sent from their own memory."""

import pytest
import torch
import torch.distributed as dist

from multirank import run_ranks
from sync import BucketConfig, InitSyncConfig, PatchConfig, SyncIntegrityError, WeightSyncConfig, make_weight_syncer
from test_checksum_reference import ref_checksum, ref_tensor_checksum
from test_sync_common import snapshot


# ----- frames on the wire, byte by byte -----------------------------------------------------------------------

MAGIC = 0x53594E43  # "SYNC"
GAPS8, DENSE = 0, 4


def _raw(shape, dtype):
    t = torch.empty(shape, dtype=dtype)
    dist.recv(t, src=0)
    return t


def _frames_on_the_wire(rank, world_size):
    """Rank 0 syncs through a real syncer; rank 1 inits a real receiver, then takes the update's messages raw."""
    received = {}
    patch = make_weight_syncer(WeightSyncConfig(type="patch"), src=0, dsts=[1])
    state = {"a": torch.zeros(300), "b": torch.zeros(4, dtype=torch.int64)}
    if rank == 0:
        patch.init_sender(state)
        state["a"][[5, 7, 290]] = torch.tensor([1.5, -2.0, 3.25])
        state["b"][:] = torch.tensor([1, 2, 3, 4])
        patch.sync(state, 5)
    else:
        patch.init_receiver(state)
        received["patch"] = [_raw(9, torch.int64), _raw((2, 4), torch.int64), _raw(48, torch.uint8),
                             _raw(3, torch.int64)]
    bucket = make_weight_syncer(WeightSyncConfig(type="bucket"), src=0, dsts=[1])
    state = {"a": torch.zeros(3), "m": torch.zeros(4, dtype=torch.bool)}
    if rank == 0:
        bucket.init_sender(state)
        state["a"][:] = torch.tensor([0.5, 1.0, -4.0])
        state["m"][:] = torch.tensor([True, False, True, True])
        bucket.sync(state, 3)
    else:
        bucket.init_receiver(state)
        received["bucket"] = [_raw(9, torch.int64), _raw((2, 4), torch.int64), _raw(16, torch.uint8),
                              _raw(3, torch.int64)]
    return received


def _expected_frame(words, table, payload_parts, after):
    """Header (7 words, the check of those words, the check of words and table), table, packed payload bytes,
    trailer (each tensor's checksum after the update, then the check of words and those checksums), from the
    reference checksum."""
    words_t, table_t = torch.tensor(words, dtype=torch.int64), torch.tensor(table, dtype=torch.int64)
    payload = torch.cat([p.reshape(-1).view(torch.uint8) for p in payload_parts])
    sums = [ref_tensor_checksum(t) for t in after]
    trailer = sums + [ref_checksum([words_t, torch.tensor(sums, dtype=torch.int64)])]
    return [words + [ref_checksum([words_t]), ref_checksum([words_t, table_t])], table, payload.tolist(), trailer]


@pytest.mark.slow
def test_patch_and_bucket_frames_match_the_documented_wire_format_byte_by_byte():
    """The wire format of docs/weight_sync.md, checked on the bytes a real sender puts on the wire: header
    words (magic, kind, version, base, rows, payload sizes, check over the words, check over words and table),
    table rows (ordinal,
    values, encoding, symbols), the packed payload widest dtype first, the trailer (checksums after the update,
    then a check bound to the header words). The round-trip tests cannot see a change made on both sides at
    once (a check that stops covering the table, a trailer no longer bound to its header's version, another
    tie rule, another escape symbol), but another build on the other end would."""
    _, received = run_ranks(_frames_on_the_wire, 2)
    # Patch 5 on base 0. a: 3 changes of 300 at 5, 7, 290: gaps 5, 1, 282; in 1-byte symbols 282 = one escape
    # (255) then 27: 4 bytes + 12 of values, less than 2-byte gaps (18), a bitmap (38 + 12) or dense (1200).
    # b: all 4 int64 changed: dense (32 bytes; a bitmap would be 33). Payload: int64, then fp32, then uint8.
    a, b = torch.zeros(300), torch.tensor([1, 2, 3, 4])
    a[[5, 7, 290]] = torch.tensor([1.5, -2.0, 3.25])
    expected = _expected_frame([MAGIC, 2, 5, 0, 2, 48, 48], [[0, 3, GAPS8, 4], [1, 4, DENSE, 0]],
                               [b, torch.tensor([1.5, -2.0, 3.25]), torch.tensor([5, 1, 255, 27], dtype=torch.uint8)],
                               [a, b])
    header, table, payload, trailer = received["patch"]
    assert [header.tolist(), table.tolist(), payload.tolist(), trailer.tolist()] == expected
    # Bucket update 3: whole tensors, base -1, dense rows; fp32 then bool in one packed payload.
    a, m = torch.tensor([0.5, 1.0, -4.0]), torch.tensor([True, False, True, True])
    expected = _expected_frame([MAGIC, 1, 3, -1, 2, 16, 16], [[0, 3, DENSE, 0], [1, 4, DENSE, 0]], [a, m], [a, m])
    header, table, payload, trailer = received["bucket"]
    assert [header.tolist(), table.tolist(), payload.tolist(), trailer.tolist()] == expected


def _send_words(words, table=None):
    table_t = torch.zeros(0, 4, dtype=torch.int64) if table is None else torch.tensor(table, dtype=torch.int64)
    check_words = torch.tensor([MAGIC, *words[1:]])  # the receiver checks the header as it should have been
    checks = [ref_checksum([check_words]), ref_checksum([check_words, table_t])]
    dist.send(torch.tensor(words + checks, dtype=torch.int64), dst=1)
    if table is not None:
        dist.send(table_t, dst=1)


MALFORMED = [  # (header words, table sent after it or None, the error, what its message says)
    ([0x1234, 2, 1, 0, 0, 0, 0], None, SyncIntegrityError, "without the sync header"),
    ([MAGIC, 2, 1, 0, 2**40, 0, 0], None, SyncIntegrityError, "announces 1099511627776 table rows"),
    ([MAGIC, 2, 1, 0, -1, 0, 0], None, SyncIntegrityError, "announces -1 table rows"),
    ([MAGIC, 2, 1, 0, 1, 20, 20], [[0, 4, DENSE, 0]], SyncIntegrityError, "payload sizes its table does not"),
    ([MAGIC, 2, 1, 0, 1, 24, 16], [[0, 4, DENSE, 0]], SyncIntegrityError, "payload sizes its table does not"),
    ([MAGIC, 2, 1, 0, 1, 16, 16], [[1, 4, DENSE, 0]], SyncIntegrityError, "malformed table row [1, 4, 4, 0]"),
]


def _malformed_frames(rank, world_size):
    from sync.wire import recv_frame
    messages = []
    for words, table, error, _ in MALFORMED:
        if rank == 0:
            _send_words(words, table)
        else:
            with pytest.raises(error) as caught:
                recv_frame(0, None, "cpu", [4], lambda kind: ("weight_sync", [torch.float32], None))
            messages.append((str(caught.value), getattr(caught.value, "link_lost", None)))
        dist.barrier()
    return messages


@pytest.mark.slow
def test_frames_with_a_consistent_check_but_impossible_contents_are_refused_before_anything_is_allocated():
    """A header's check catches damage on the way, not a sender out of step or another program on the group:
    a message without the magic word (even one whose other words pass the check), a row count beyond the
    receiver's tensors (here 2**40 rows, whose table alone would be 32 TiB to allocate), payload sizes the
    table does not account for (raw bytes, or uncompressed wire bytes unequal to raw), and a table row naming
    a tensor the receiver does not have must each be refused as they arrive, by name, before the receiver
    allocates or posts receives for them. Each refused frame leaves its payload queued, so each
    SyncIntegrityError says the link is lost (`link_lost`, which resync() raises on) and how to start again."""
    _, messages = run_ranks(_malformed_frames, 2)
    assert len(messages) == len(MALFORMED)
    for (_, _, error, expected), (message, lost) in zip(MALFORMED, messages):
        assert expected in message, message
        if error is SyncIntegrityError:
            assert lost is True and message.endswith("create both syncers again on a fresh process group"), message



# ----- encodings: ties, and symbol streams the sender never produces ------------------------------------------

@pytest.mark.parametrize("n, changed, dtype, expected", [
    (8, range(7), torch.uint8, DENSE),        # dense 8 bytes = bitmap 1 + 7 values: dense (no positions)
    (64, range(0, 64, 8), torch.bool, 3),     # 1-byte gaps 8 + 8 = bitmap 8 + 8: the bitmap (no escapes to add)
    (9, range(7), torch.uint8, DENSE),        # dense 9 = bitmap 2 (9 bits: a padded second byte) + 7: dense
], ids=["dense over bitmap", "bitmap over gaps", "dense over a padded bitmap"])
def test_a_tie_in_size_goes_to_the_encoding_cheaper_to_apply(n, changed, dtype, expected):
    """sync/encodings.py: each tensor travels in the smallest encoding "by exact size"; on a tie, the one cheaper
    to apply (dense before a bitmap before gaps). Sizes here are equal by hand (see the ids); the choice shows
    in the table row and in SyncStats' sparse/dense counts."""
    from sync.encodings import _encode
    current = torch.ones(n, dtype=dtype)
    mask = torch.zeros(n, dtype=torch.bool)
    mask[list(changed)] = True
    encoding, parts, _ = _encode(current, mask, len(changed))
    assert encoding == expected
    assert sum(p.numel() * p.element_size() for p in parts) == (n if expected == DENSE else n // 8 + len(changed))


def test_small_segments_pack_into_one_message_up_to_exactly_pack_bytes():
    """docs: segments travel as one message when they are small, at most PACK_BYTES (1 MiB) in all; one byte more
    and each is its own message. Header 72, table 32 per row, trailer 8 per row + 8."""
    from sync.wire import frame_messages
    mib = 1 << 20
    assert frame_messages(2, [mib - 16, 16]) == [72, 64, mib, 24]
    assert frame_messages(2, [mib - 15, 16]) == [72, 64, mib - 15, 16, 24]
    assert frame_messages(1, [mib + 1]) == [72, 32, mib + 1, 16]


def test_a_gap_of_exactly_one_escape_symbol_costs_an_escape():
    """A gap equal to the escape symbol (255 in 1-byte gaps) cannot travel as itself: it is an escape then a 0,
    so 1-byte gaps cost 2 symbols + 4 value bytes = 6 bytes, the same as one 2-byte gap, and the tie goes to
    2-byte gaps; the chosen encoding's bytes are the size it was chosen by, and its positions decode back."""
    from sync.encodings import _decode, _encode
    mask = torch.zeros(1000, dtype=torch.bool)
    mask[255] = True                                  # the gap before it: 255
    encoding, parts, _ = _encode(torch.ones(1000), mask, 1)
    assert encoding == 1 and parts[0].tolist() == [255] and parts[0].dtype == torch.int16
    assert _decode(parts[0], encoding, 1000)[0].tolist() == [255]
    mask[[255, 254]] = torch.tensor([False, True])     # a gap of 254: one 1-byte symbol, 5 bytes
    encoding, parts, _ = _encode(torch.ones(1000), mask, 1)
    assert encoding == GAPS8 and parts[0].tolist() == [254]
    mask[[254, 0, 256]] = torch.tensor([False, True, True])   # gaps 0, 255: 3 symbols + 8 = 11 < 2-byte 12
    encoding, parts, _ = _encode(torch.ones(1000), mask, 2)
    assert encoding == GAPS8 and parts[0].tolist() == [0, 255, 0]
    assert _decode(parts[0], encoding, 1000)[0].tolist() == [0, 256]


def test_symbol_streams_a_sender_never_produces_are_flagged():
    """_decode flags what no sender writes, so that a corrupted payload whose positions still fall inside the
    tensor (and whose count matches its row) is refused: a gap stream that ends in an escape symbol (255 in
    1-byte gaps: "skip 255 more" with no change after it), and a bitmap with a bit set in the padding past the
    tensor's last element. Well-formed streams of the same lengths are not flagged."""
    from sync.encodings import _decode
    index, flags = _decode(torch.tensor([3, 255], dtype=torch.uint8), GAPS8, 1000)
    assert index.tolist() == [3] and any(bool(f) for f in flags)
    index, flags = _decode(torch.tensor([3, 254], dtype=torch.uint8), GAPS8, 1000)
    assert index.tolist() == [3, 258] and not any(bool(f) for f in flags)
    index, flags = _decode(torch.tensor([2, 1], dtype=torch.uint8), GAPS8, 4)   # positions 2 and 4 of 0..3
    assert any(bool(f) for f in flags) and index.tolist() == [2, 3]
    # 10 elements: 2 bytes, bits 10-15 are padding. Bits 1 and 9 set; then bit 12 as well.
    index, flags = _decode(torch.tensor([0b10, 0b10], dtype=torch.uint8), 3, 10)
    assert index.tolist() == [1, 9] and not any(bool(f) for f in flags)
    index, flags = _decode(torch.tensor([0b10, 0b10010], dtype=torch.uint8), 3, 10)
    assert index.tolist() == [1, 9] and any(bool(f) for f in flags)


# ----- configuration --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("build, message", [
    (lambda: PatchConfig(verify_every=True), "patch.verify_every must be an integer >= 0, got True"),
    (lambda: PatchConfig(verify_every=-1), "patch.verify_every must be an integer >= 0"),
    (lambda: PatchConfig(transport_device="gpu"), "patch.transport_device='gpu'"),
    (lambda: BucketConfig(bucket_device="nccl"), "bucket.bucket_device='nccl'"),
    (lambda: BucketConfig(bucket_size=True), "bucket.bucket_size must be a positive number of bytes, got True"),
    (lambda: InitSyncConfig(bucket_size=0), "patch.init_sync.bucket_size must be a positive number of bytes"),
    (lambda: InitSyncConfig(prefixes=["actor", ""]), "must be None or non-empty strings"),
    (lambda: InitSyncConfig(enabled="false"), "patch.init_sync.enabled must be true or false, got 'false'"),
    (lambda: BucketConfig(load_instant=0), "bucket.load_instant must be true or false, got 0"),
    (lambda: WeightSyncConfig(type="patch", patch={"verify_every": 5}), "patch must be a PatchConfig, got"),
    (lambda: WeightSyncConfig(bucket=PatchConfig()), "bucket must be a BucketConfig, got PatchConfig("),
    (lambda: PatchConfig(init_sync={"prefixes": ["actor"]}), "patch.init_sync must be an InitSyncConfig, got"),
])
def test_each_config_field_refuses_what_its_docs_exclude(build, message):
    """docs/weight_sync.md: "Bad values are errors naming the field". The fields no other test fed a bad value:
    a bool where a count is meant (True is an int to Python), devices, the bootstrap's bucket size, an
    empty prefix (which would match every key under its `_under` rule only by accident), a switch that is
    not a bool (a hand-written config's string "false" is true to Python), and a section given as the mapping
    a YAML file holds (it was taken, then failed with an AttributeError at the syncer's construction, or, for
    init_sync, in init_sender only, while the receivers waited for the handshake's reply)."""
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        build()


def test_config_defaults_and_accepted_edge_values_are_the_documented_ones():
    """The defaults table of docs/weight_sync.md, and verify_every=0 ("only verify(model) on demand"), which
    must be accepted: both sides compare configs at init, so a default that moves breaks mixed deployments."""
    cfg = WeightSyncConfig()
    assert (cfg.type, cfg.patch.snapshot_device, cfg.patch.transport_device, cfg.patch.verify_every,
            cfg.patch.compression) == ("patch", "cpu", "cpu", 100, "none")
    assert (cfg.patch.init_sync.enabled, cfg.patch.init_sync.prefixes, cfg.patch.init_sync.bucket_size) == \
        (True, None, 128 * 2**20)
    assert (cfg.bucket.bucket_size, cfg.bucket.bucket_dtype, cfg.bucket.bucket_device, cfg.bucket.load_instant) == \
        (512 * 2**20, None, "cpu", True)
    assert PatchConfig(verify_every=0).verify_every == 0
    assert InitSyncConfig(prefixes=["actor", "critic.net"]).prefixes == ("actor", "critic.net")


def _round_trip_at_pack_bytes(rank, world_size, extra):
    """A bucket syncer's init and one sync of a float32 tensor and a bool tensor whose bytes total PACK_BYTES +
    `extra`; the sender counts its point-to-point messages."""
    import sync.wire
    messages = []
    for name in ("send", "isend"):
        real = getattr(dist, name)
        setattr(dist, name, lambda t, *a, _real=real, **k: (messages.append(t.nbytes), _real(t, *a, **k))[1])
    floats = (sync.wire.PACK_BYTES - 16) // 4
    state = {"a": torch.zeros(floats), "m": torch.zeros(16 + extra, dtype=torch.bool)}
    syncer = make_weight_syncer(WeightSyncConfig(type="bucket"), src=0, dsts=[1])
    if rank == 0:
        syncer.init_sender(state)
        messages.clear()
        state["a"][:] = torch.arange(floats, dtype=torch.float32) * 0.5 - 7.0
        state["m"][::3] = True
        syncer.sync(state, 1)
        return messages
    syncer.init_receiver(state)
    assert syncer.apply(state) == 1
    return state


@pytest.mark.slow
@pytest.mark.parametrize("extra", [0, 1])
def test_segments_of_exactly_pack_bytes_cross_as_one_message_and_one_byte_more_as_two_end_to_end(extra):
    """Sender and receiver each decide whether a frame's payload segments are packed into one message, from the
    segments' bytes: they must agree at the bound, or the receiver waits for one message the sender sent as two.
    At exactly PACK_BYTES (1 MiB) the payload is one message; one byte more, one per segment."""
    mib = 1 << 20
    floats = (mib - 16) // 4
    sent, received = run_ranks(_round_trip_at_pack_bytes, 2, (extra,))
    rows = 2 * 32                                     # header 72, table 32 per row, trailer 8 per row + 8
    assert sent == ([72, rows, mib, 8 * 3] if not extra else [72, rows, mib - 16, 17, 8 * 3])
    assert torch.equal(received["a"], torch.arange(floats, dtype=torch.float32) * 0.5 - 7.0)
    assert received["m"].tolist() == [i % 3 == 0 for i in range(16 + extra)]


def test_an_integer_fits_the_wire_only_inside_int64():
    """sync/config.py is_int: what require() and the handshake accept as a version or a rank must fit an int64
    word of the frame header, -2**63 .. 2**63 - 1 by the two's complement range. Mutant: the upper bound
    inclusive, so sync(state, 2**63) passed the version check and failed later, converting the header."""
    from sync.config import is_int
    assert is_int(2**63 - 1) and is_int(-2**63) and is_int(0)
    assert not is_int(2**63) and not is_int(-2**63 - 1)
    assert not is_int(True) and not is_int(1.0) and not is_int(torch.tensor(1))


def _sent_from_own_memory(rank, world_size, mode):
    """One sync of a 1.2 MB and a 40-byte float32 tensor, every element changed (whole rows in both modes); the
    sender records the memory of every message it posts."""
    from dist import comm
    syncer = make_weight_syncer(WeightSyncConfig(type=mode), src=0, dsts=[1])
    state = {"big": torch.zeros(300_000), "small": torch.zeros(10)}
    if rank == 0:
        syncer.init_sender(state)
        posted, real = [], comm.isend
        comm.isend = lambda t, *a: (posted.append(t.data_ptr()), real(t, *a))[1]
        for key, value in state.items():
            value.copy_(torch.arange(value.numel(), dtype=torch.float32) + len(key))  # no element stays 0
        syncer.sync(state, 1)
        return [state[k].data_ptr() in posted for k in state]
    syncer.init_receiver(state)
    assert syncer.apply(state) == 1
    return snapshot(state)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["patch", "bucket"])
def test_a_whole_tensor_in_its_wire_dtype_is_sent_from_its_own_memory(mode):
    """docs/weight_sync.md, Wire format: "A whole tensor already in the wire dtype is sent from its own memory (no
    packing copy)", here in a frame over 1 MiB (wire.PACK_BYTES), so not packed. Mutant: send_frame cloned each
    payload segment (`segments[i].reshape(-1).clone().view(torch.uint8)`)."""
    sent, received = run_ranks(_sent_from_own_memory, 2, args=(mode,))
    assert sent == [True, True]
    assert torch.equal(received["big"], torch.arange(300_000, dtype=torch.float32) + 3)
    assert torch.equal(received["small"], torch.arange(10, dtype=torch.float32) + 5)
