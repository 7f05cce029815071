"""Edges that a researcher copying dist/ files into another project hits (a fresh-eyes walkthrough found them):
imports that bind a package named `dist`, an empty merge, integer batch fields (those float32 would round refused,
the narrow ones and half floats carried exactly), the plan of integer counts."""

import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

from dist.batches import Layout, concat_batches
from dist.stats import merge_moments, sum_counts_plan_rows

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_dist_modules_copied_into_a_package_of_another_name_import_from_the_copy(tmp_path):
    """buffers, verify, batches and params import their siblings relatively, as grad_sync and stats do: copied into
    `myproject.parallel` they import (an absolute `from dist import comm` failed there, or bound another project's
    `dist`), and their comm is the copy's own; buffers' refusals are the copy's own UsageError (errors.py, taken
    with it)."""
    package = tmp_path / "myproject" / "parallel"
    package.mkdir(parents=True)
    for name in ("buffers.py", "verify.py", "batches.py", "params.py", "comm.py", "plan.py", "checksum.py",
                 "errors.py"):
        shutil.copy(os.path.join(REPO, "dist", name), package / name)
    script = ("import myproject.parallel.comm as comm\n"
              "for name in ('buffers', 'verify', 'batches', 'params'):\n"
              "    module = __import__('myproject.parallel.' + name, fromlist=['comm'])\n"
              "    assert module.comm is comm, name\n"
              "import myproject.parallel.buffers as buffers, myproject.parallel.errors as errors\n"
              "assert buffers.UsageError is errors.UsageError\n"
              "import sys; assert 'dist' not in sys.modules\nprint('ok')\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(PYTHONPATH=str(tmp_path), OMP_NUM_THREADS="1")
    result = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, env=env,
                            timeout=120)
    assert result.stdout.strip() == "ok", result.stdout + result.stderr


def test_merging_an_empty_batch_leaves_the_moments_as_they_were():
    """An empty batch on every rank (say, merging only the episodes that ended, when none did) changes nothing;
    it turned the mean and M2 into NaN (0 / 0). From nothing at all it stays at nothing."""
    zero = torch.zeros((), dtype=torch.float64)
    data = torch.randn(10, 2, generator=torch.Generator().manual_seed(0))
    count, mean, m2 = merge_moments(zero, torch.zeros(2, dtype=torch.float64), torch.zeros(2, dtype=torch.float64),
                                    data)
    again = merge_moments(count, mean, m2, torch.empty(0, 2))
    assert [torch.equal(a, b) for a, b in zip(again, (count, mean, m2))] == [True] * 3
    x = data.double().numpy()
    np.testing.assert_allclose(again[1].numpy(), x.mean(0), rtol=1e-12)
    np.testing.assert_allclose(again[2].numpy(), ((x - x.mean(0)) ** 2).sum(0), rtol=1e-12)
    empty = merge_moments(zero, torch.full((2,), 3.0, dtype=torch.float64), torch.zeros(2, dtype=torch.float64),
                          torch.empty(0, 2))
    assert empty[0].item() == 0 and empty[1].tolist() == [3.0, 3.0] and empty[2].tolist() == [0.0, 0.0]


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_a_batch_layout_refuses_integers_that_float32_would_round(dtype):
    """Non-float64 fields travel as float32: 2**24 + 1 came back as 2**24 with no error. Wide integers are refused
    when the layout is built; bool and float32 fields still round-trip exactly."""
    with pytest.raises(ValueError, match=r"\{'ids': 'torch.int(32|64)'\} would travel as float32"):
        Layout({"x": ((2,), torch.float32), "ids": ((2,), dtype)})
    layout = Layout({"done": ((3,), torch.bool), "x": ((2,), torch.float32), "n": ((1,), torch.float64)})
    sent = {"done": torch.tensor([True, False, True]), "x": torch.tensor([0.1, 2.0**24 + 2]),
            "n": torch.tensor([2.0**40 + 1], dtype=torch.float64)}
    buffers = layout.buffers("cpu")
    layout.pack(sent, buffers)
    back = layout.unpack(buffers)
    assert all(torch.equal(back[k], v) and back[k].dtype == v.dtype for k, v in sent.items())


@pytest.mark.parametrize("dtype", [torch.uint32, torch.uint64])
def test_a_batch_layout_refuses_unsigned_wide_integers_too(dtype):
    """uint32 and uint64 travel as float32 like int32 and int64, and lose the same digits past 2**24.

    Mutant: torch.uint32 or torch.uint64 dropped from the refused dtypes."""
    with pytest.raises(ValueError) as exc:
        Layout({"x": ((2,), torch.float32), "ids": ((3,), dtype)})
    assert str(exc.value) == (f"batch layout: fields {{'ids': '{dtype}'}} would travel as float32, which rounds "
                              f"integers past 2**24; send them as float64")


def test_a_batch_layout_carries_narrow_integers_and_half_floats_exactly():
    """float32 holds every int8, uint8 and int16 value and every float16 and bfloat16 one: such fields are accepted
    and come back bit for bit, in their own dtype (extremes and a subnormal float16 included).

    Mutant: int16, int8 and uint8, or float16 and bfloat16, added to the refused dtypes."""
    sent = {"a": torch.tensor([-128, 127, 0], dtype=torch.int8), "b": torch.tensor([0, 255], dtype=torch.uint8),
            "c": torch.tensor([-32768, 32767, -1], dtype=torch.int16),
            "d": torch.tensor([65504.0, 2.0**-24, -0.5], dtype=torch.float16),
            "e": torch.tensor([3.0e38, -2.0**-126, 1.0 + 2.0**-7], dtype=torch.bfloat16)}
    layout = Layout({name: (tuple(t.shape), t.dtype) for name, t in sent.items()})
    buffers = layout.buffers("cpu")
    layout.pack(sent, buffers)
    back = layout.unpack(buffers)
    assert buffers[torch.float32].numel() == 14 and buffers[torch.float64].numel() == 0
    for name, tensor in sent.items():
        assert back[name].dtype == tensor.dtype and torch.equal(back[name], tensor), name


@pytest.mark.parametrize("shape", [(3, 4), (5, 3)])
def test_a_batch_layout_refuses_a_tensor_of_another_shape_naming_its_field(shape):
    """A [3, 4] tensor for a [4, 3] field went out silently reshaped, and a [5, 3] one failed with torch's "The size
    of tensor a (12) must match the size of tensor b (15)", naming no field: both are refused by name. The layout's
    own shapes (a 0-dim scalar and a zero-sized field included) still pack.

    Mutant: pack without its shape check (the [3, 4] tensor packs, the [5, 3] one raises a RuntimeError)."""
    layout = Layout({"v": ((), torch.float64), "none": ((2, 0), torch.float32), "x": ((4, 3), torch.float32)})
    buffers = layout.buffers("cpu")
    good = {"v": torch.tensor(7.0, dtype=torch.float64), "none": torch.empty(2, 0), "x": torch.ones(4, 3)}
    layout.pack(good, buffers)
    assert buffers[torch.float64].tolist() == [7.0] and buffers[torch.float32].tolist() == [1.0] * 12
    with pytest.raises(ValueError) as exc:
        layout.pack({**good, "x": torch.zeros(shape)}, buffers)
    assert str(exc.value) == f"batch field 'x' has shape {shape}; its layout says (4, 3)"


def test_concat_batches_joins_time_major_fields_on_dim_1_and_the_last_critic_obs_on_dim_0():
    a = {"rewards": torch.zeros(4, 2), "last_critic_obs": torch.zeros(2, 5)}
    b = {"rewards": torch.ones(4, 3), "last_critic_obs": torch.ones(3, 5)}
    both = concat_batches([a, b])
    assert both["rewards"].shape == (4, 5) and both["rewards"][:, 2:].eq(1).all()
    assert both["last_critic_obs"].shape == (5, 5) and both["last_critic_obs"][2:].eq(1).all()


class Counts:
    def __init__(self, dtype):
        self.local_counts = torch.zeros(2, 3, dtype=dtype)


@pytest.mark.parametrize("dtype, nbytes", [(torch.float64, 48), (torch.int32, 24)])
def test_the_sampler_plan_counts_the_counts_in_their_own_dtype(dtype, nbytes):
    """The all-reduce carries the counts as they are (the ledger counts numel x element size): the plan said 8 bytes
    each whatever the dtype."""
    rows = sum_counts_plan_rows(Counts(dtype), every=5, save_every=10)
    assert [row.call_bytes for row in rows] == [[nbytes], [nbytes]]


def test_a_batch_layout_refuses_missing_and_unknown_keys_naming_them():
    """A key the layout lacks was dropped silently (it never reached the receiver) and a missing one raised a bare
    KeyError: both are named.

    Mutant: pack without its key check (the extra key packs, the missing one raises KeyError: 'x')."""
    layout = Layout({"v": ((), torch.float64), "x": ((2,), torch.float32)})
    buffers = layout.buffers("cpu")
    with pytest.raises(ValueError) as exc:
        layout.pack({"v": torch.tensor(1.0, dtype=torch.float64), "x": torch.ones(2), "obs": torch.ones(2)}, buffers)
    assert str(exc.value) == "batch keys differ from its layout's: missing [], not in the layout ['obs']"
    with pytest.raises(ValueError) as exc:
        layout.pack({"v": torch.tensor(1.0, dtype=torch.float64)}, buffers)
    assert str(exc.value) == "batch keys differ from its layout's: missing ['x'], not in the layout []"
