"""dist/checksum.py against an independent reference written from its docstring in plain Python integers
(splitmix64 weights checked against the published test vector, P = 2**31 - 1, rows of 2**14 lanes), its
incremental update at row boundaries, and the checksum of a list of names (one per line)."""

import functools
import os
import tempfile

import pytest
import torch




# ----- an independent reference of the checksum (dist/checksum.py's docstring, plain Python integers) -----

REF_P = 2**31 - 1
REF_ROW = 2**14
MASK64 = 2**64 - 1
SEEDS = (0x5EED0001, 0x5EED0002)
# Where the device test runs: SYNCPPO_TEST_DEVICE=cuda on a GPU (bench/gpu_check.sh), else the host.
DEVICE = os.environ.get("SYNCPPO_TEST_DEVICE", "cpu")


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


@functools.lru_cache(maxsize=None)
def _ref_weights(count: int, bits: int, offset: int) -> tuple:
    """Per position offset..offset+count: one weight per seed, the top `bits` bits of splitmix64(pos ^ seed << 32),
    reduced mod P, 0 replaced by 1."""
    out = []
    for pos in range(offset, offset + count):
        pair = []
        for seed in SEEDS:
            w = (_splitmix64(pos ^ (seed << 32)) >> (64 - bits)) % REF_P
            pair.append(w or 1)
        out.append(tuple(pair))
    return tuple(out)


def ref_tensor_checksum(t: torch.Tensor) -> int:
    """The tensor's bytes as signed 8-bit lanes, rows of 2**14 lanes; lane s of row r weighs W[s] * H[r] (24-bit
    lane weights, 31-bit row weights from position 2**40), mod P, per seed."""
    raw = bytes(t.detach().contiguous().reshape(-1).view(torch.uint8).tolist())
    lanes = [b - 256 if b > 127 else b for b in raw]
    rows = -(-len(lanes) // REF_ROW)
    w, h = _ref_weights(REF_ROW, 24, 0), _ref_weights(max(rows, 1), 31, 1 << 40)
    parts = []
    for k in range(2):
        total = 0
        for r in range(rows):
            row = lanes[r * REF_ROW:(r + 1) * REF_ROW]
            total = (total + sum(lane * w[s][k] for s, lane in enumerate(row)) % REF_P * h[r][k]) % REF_P
        parts.append(total)
    return parts[0] * 2**31 + parts[1]


def ref_checksum(tensors) -> int:
    """Several tensors: tensor i's two residues weighted by 31-bit weights from position 2**50, summed mod P."""
    sums = [ref_tensor_checksum(t) for t in tensors]
    w = _ref_weights(len(sums), 31, 1 << 50)
    parts = [sum((divmod(c, 2**31)[k] * w[i][k]) % REF_P for i, c in enumerate(sums)) % REF_P for k in range(2)]
    return parts[0] * 2**31 + parts[1]


def test_reference_splitmix64_matches_the_published_test_vector():
    """The reference itself: splitmix64 seeded with 1234567 yields 6457827717110365317 first (Vigna's
    splitmix64.c), so the checksum tests below compare against the real algorithm, not a copy of the code."""
    assert _splitmix64(1234567) == 6457827717110365317


@pytest.mark.parametrize("t", [
    torch.arange(256, dtype=torch.uint8),                          # bytes above 127 are negative lanes
    torch.tensor([1.5, -2.0, 3.25]),                               # one row, the host path
    torch.randn(REF_ROW + 7, generator=torch.Generator().manual_seed(3)),   # two rows, the BLAS path
    torch.tensor([-1, 2**40, -(2**62)], dtype=torch.int64),
    torch.tensor([True, False, True]),
], ids=["uint8", "fp32 one row", "fp32 two rows", "int64", "bool"])
def test_checksum_values_match_an_independent_reference(t):
    """The checksum is part of the wire format (every frame ends with one per tensor, and a receiver may run
    another build on a GPU): its constants (P, the row length, the seeds and splitmix64) and the signed
    reading of bytes are pinned here against a from-scratch reference, not against dist.checksum's own
    `weights` and `P`, which a constant change would move together with the code."""
    from dist.checksum import checksum, tensor_checksum
    assert int(tensor_checksum(t)) == ref_tensor_checksum(t)
    assert int(checksum([t, t[:1]])) == ref_checksum([t, t[:1]])



@pytest.mark.parametrize("byte", [-128, 127, -1])
def test_rows_of_extreme_bytes_stay_exact_on_both_paths(monkeypatch, byte):
    """Every lane at the int8 bound, two full rows and a partial one: the host's int8 product (per-digit int32 sums
    at their largest, 128 * 63 * 2**14) and the devices' float64 product both give the reference's value."""
    from dist import checksum as module
    t = torch.full((2 * REF_ROW + 9,), byte, dtype=torch.int8)
    expected = ref_tensor_checksum(t)
    for int8_product in (True, False):   # the host's default depends on the CPU (AVX-512 or not): both, always
        monkeypatch.setattr(module, "HOST_INT8", int8_product)
        assert int(module.tensor_checksum(t)) == expected


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64, torch.int64, torch.bool])
def test_the_host_int8_product_and_the_device_float64_product_agree(monkeypatch, dtype):
    """An AVX-512 host sums rows with torch._int_mm, GPUs and other CPUs with float64 blocks (dist/checksum.py): a
    sender on one and a receiver on the other must agree bit for bit. Both paths run here on CPU, over tensors of
    many full rows, a partial last row, and random bits of every byte value."""
    from dist import checksum as module
    g = torch.Generator().manual_seed(11)
    for numel in (40 * REF_ROW + 13, REF_ROW + 1):
        raw = torch.randint(0, 256, (numel * dtype.itemsize,), dtype=torch.uint8, generator=g)
        t = (raw % 2).view(torch.bool) if dtype == torch.bool else raw.view(dtype)
        monkeypatch.setattr(module, "HOST_INT8", True)
        host = int(module.tensor_checksum(t))
        monkeypatch.setattr(module, "HOST_INT8", False)
        assert int(module.tensor_checksum(t)) == host
        monkeypatch.setattr(module, "BLOCK", 3)          # a GPU's blocks are larger: a partial last block too
        assert int(module.tensor_checksum(t)) == host
        monkeypatch.setattr(module, "BLOCK", 32)
    assert host == ref_tensor_checksum(t)


def test_a_change_in_the_last_partial_row_updates_the_checksum():
    """update_checksum sizes its per-row sums from the element count, rounding a partial last row up; a change
    in that row (the tail of any tensor whose lanes are not a multiple of 2**14) must land there: the patch
    sender and receiver update checksums this way for every sparse tensor."""
    from dist.checksum import tensor_checksum, update_checksum
    g = torch.Generator().manual_seed(5)
    old = torch.randn(2 * REF_ROW + 5, generator=g)          # 8 full rows of byte lanes and 20 lanes more
    index = torch.tensor([3, old.numel() - 1])
    new = old.clone()
    new[index] = torch.tensor([7.0, -1.25])
    got = update_checksum(tensor_checksum(old), index, old[index], new[index], old.numel())
    assert int(got) == ref_tensor_checksum(new)


def test_checksum_of_a_tensor_longer_than_1024_rows():
    """The row weights are built for 1024 rows and grown on demand: a tensor of more than 2**24 lanes (a
    4M-element fp32 embedding) must weigh row 1024 by its own weight. One lane set to 1 in row 1024 of a
    zero tensor has the checksum W[0] * H[1024] mod P per seed, from the reference weights."""
    from dist.checksum import tensor_checksum
    t = torch.zeros(1025 * REF_ROW, dtype=torch.uint8)
    t[1024 * REF_ROW] = 1
    w, h = _ref_weights(1, 24, 0)[0], _ref_weights(1, 31, (1 << 40) + 1024)[0]
    parts = [w[k] * h[k] % REF_P for k in range(2)]
    assert int(tensor_checksum(t)) == parts[0] * 2**31 + parts[1]


def test_a_list_of_more_tensors_than_an_earlier_call_had_weighs_each_by_its_own_position(monkeypatch):
    """checksum() keeps the per-tensor weights of its first call (at least 64) and must grow them for a longer
    list (a model of more than 64 parameter tensors checked after a small one): 70 one-element tensors, each
    a different value, against the reference."""
    from dist import checksum as module
    monkeypatch.delitem(module._tables, ("I", "cpu"), raising=False)     # as in a fresh process (put back after)
    module.checksum([torch.zeros(1)])                                     # the weights of a short list exist now
    many = [torch.tensor([float(i) - 0.5]) for i in range(70)]
    assert int(module.checksum(many)) == ref_checksum(many)


def test_no_change_leaves_a_checksum_as_it_was_and_no_tensors_sum_to_zero():
    """update_checksum with no changed position (a tensor a sparse patch leaves alone) returns the checksum it was
    given; the checksum of no tensors is the reference's empty sum, 0."""
    from dist.checksum import checksum, update_checksum
    t = torch.tensor([1.5, -2.0, 3.25])
    none = torch.zeros(0, dtype=torch.int64)
    before = torch.tensor(ref_tensor_checksum(t))
    assert int(update_checksum(before, none, t[none], t[none], t.numel())) == ref_tensor_checksum(t)
    assert int(checksum([])) == ref_checksum([]) == 0


@pytest.mark.slow
@pytest.mark.parametrize("isa", ["AVX512_CORE", "AVX2"])
def test_the_int8_product_stays_exact_on_kernels_without_vnni(isa):
    """oneDNN's int8 kernels without VNNI add pairs of products in saturating int16; the 6-bit digits keep clear of
    it (7-bit digits came out wrong on both levels here). oneDNN is held to `isa` in a fresh process (it reads
    ONEDNN_MAX_CPU_ISA once): AVX512_CORE is an AVX-512 host without VNNI (Skylake-SP), which takes the int8 product;
    AVX2 the same kernels' level below. Rows of -128, of 127, of both alternating (the sums' bound) and of random
    bytes match the reference."""
    import subprocess
    import sys
    tensors = [torch.full((2 * REF_ROW + 3,), -128, dtype=torch.int8),
               torch.full((2 * REF_ROW + 3,), 127, dtype=torch.int8),
               torch.tensor([-128, 127], dtype=torch.int8).repeat(REF_ROW + 2),
               torch.randint(-128, 128, (2 * REF_ROW + 3,), dtype=torch.int8,
                             generator=torch.Generator().manual_seed(2))]
    code = ("import sys, torch, dist.checksum as c\nc.HOST_INT8 = True\n"
            "for t in torch.load(sys.argv[1]):\n    print(int(c.tensor_checksum(t)))\n")
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "tensors.pt")
        torch.save(tensors, path)
        result = subprocess.run([sys.executable, "-c", code, path], cwd=repo, capture_output=True, text=True,
                                timeout=120, env={**os.environ, "ONEDNN_MAX_CPU_ISA": isa, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr
    assert [int(v) for v in result.stdout.split()] == [ref_tensor_checksum(t) for t in tensors]


def test_an_avx512_host_with_onednn_on_takes_the_int8_product(monkeypatch):
    """Both paths give the same values, so only this shows that the fast one runs: on a host whose torch reports
    AVX-512 and has oneDNN, a checksum of several rows goes through the int8 product, and not once
    torch.backends.mkldnn.enabled is False (there torch._int_mm is a scalar loop, 50x slower)."""
    from dist import checksum as module
    calls = []
    real = module._host_row_sums
    monkeypatch.setattr(module, "_host_row_sums", lambda x: calls.append(x.numel()) or real(x))
    t = torch.randn(3 * REF_ROW)
    avx512 = torch.backends.mkldnn.is_available() and torch.backends.cpu.get_cpu_capability().startswith("AVX512")
    expected = module.tensor_checksum(t)
    assert calls == ([t.numel() * 4] if avx512 else [])
    monkeypatch.setattr(torch.backends.mkldnn, "enabled", False)
    assert not torch.backends.mkldnn.enabled and int(module.tensor_checksum(t)) == int(expected)
    assert len(calls) == (1 if avx512 else 0)


def test_the_checksum_on_the_test_device_matches_the_host():
    """On the device a run's weights live on (SYNCPPO_TEST_DEVICE=cuda in bench/gpu_check.sh: float64 blocks of 256
    rows there, update_checksum's gathers there), a tensor of more than one block and a partial row, and its update
    from changed elements, give the host's values (themselves pinned to the reference above). On a CPU-only run the
    device is the host, so only the update check can fail here; the device comparisons bite in bench/gpu_check.sh."""
    from dist.checksum import ROW, tensor_checksum, update_checksum
    g = torch.Generator().manual_seed(5)
    for dtype in (torch.float32, torch.bfloat16):
        old = torch.randn(300 * ROW // dtype.itemsize + 7, generator=g).to(dtype)
        index = torch.randperm(old.numel(), generator=g)[:1000].sort().values
        new = old.clone()
        new[index] = (old[index] * 3 + 1).to(dtype)
        on_device = tensor_checksum(old.to(DEVICE))
        assert on_device.device.type == torch.device(DEVICE).type and int(on_device) == int(tensor_checksum(old))
        changed = [x.to(DEVICE) for x in (index, old[index], new[index])]
        updated = update_checksum(on_device, *changed, old.numel())
        assert int(updated) == int(tensor_checksum(new)) == int(tensor_checksum(new.to(DEVICE)))


def test_names_checksum_separates_the_names_so_a_shifted_boundary_differs():
    """Ranks compare lists of names (metric keys packed into one all-reduce, a model's layout) by one checksum of
    their UTF-8 bytes, one name per line: ["ab", "c"] and ["a", "bc"] are different lists and must not agree, and
    the checksum is that of the bytes b"ab\\nc"."""
    from dist.checksum import checksum
    from dist.verify import names_checksum

    assert names_checksum(["ab", "c"]) != names_checksum(["a", "bc"])
    assert names_checksum(["loss", "kl"]) != names_checksum(["los", "skl"])
    assert torch.equal(names_checksum(["ab", "c"]),
                       checksum([torch.tensor([0x61, 0x62, 0x0A, 0x63], dtype=torch.uint8)]))
