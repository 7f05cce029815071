"""Advantage normalization as ppo_update applies it ("local", "global", "minibatch"), checked against numpy on the
transitions each step actually received (a spy on backward_minibatch; the returns carry each transition's index),
and what each mode communicates."""

import numpy as np
import pytest
import torch

import ppo.update
from dist import comm
from dist.grad_sync import GradSync
from ppo.storage import RolloutStorage
from ppo.update import normalize_advantages, ppo_update
from tests.ppo_fixtures import A, N, OBS, T, fill, make_model, ppo_cfg

CPU = torch.device("cpu")


def seen_advantages(monkeypatch, raw: torch.Tensor, **cfg) -> list[tuple[np.ndarray, np.ndarray]]:
    """Run one ppo_update over `raw` advantages; per step, (the flat indices of its transitions, its advantages)."""
    seen = []
    original = ppo.update.backward_minibatch

    def spy(model, batch, grad_sync, cfg):
        seen.append((batch["returns"].numpy().astype(np.int64), batch["advantages"].double().numpy().copy()))
        return original(model, batch, grad_sync, cfg)

    monkeypatch.setattr(ppo.update, "backward_minibatch", spy)
    model = make_model()
    storage = RolloutStorage(T, N, OBS, A, CPU)
    fill(storage, 0, model)
    storage.advantages = raw.clone()
    storage.returns = torch.arange(T * N, dtype=torch.float32).reshape(T, N)     # each transition's flat index
    ppo_update(model, torch.optim.Adam(model.parameters(), lr=1e-3), storage,
               GradSync(model.parameters(), num_extras=2), ppo_cfg(schedule="fixed", **cfg),
               generator=torch.Generator().manual_seed(0))
    return seen


@pytest.mark.parametrize("mode", ["local", "global"])
def test_ppo_update_learns_from_the_rollout_normalized_advantages(monkeypatch, mode):
    """"local"/"global" (one rank): every step of every epoch sees (A - mean) / (population std + 1e-8) over the
    whole rollout, the statistics taken once before learning.
    Mutant: ppo_update without its normalize_advantages(storage, cfg.advantage_norm) call."""
    raw = torch.randn(T, N, generator=torch.Generator().manual_seed(3)) * 4 + 2.5
    a = raw.double().numpy().flatten()
    expected = (a - a.mean()) / (a.std() + 1e-8)
    seen = seen_advantages(monkeypatch, raw, num_epochs=2, num_mini_batches=2, advantage_norm=mode)
    assert len(seen) == 4
    for index, adv in seen:
        np.testing.assert_allclose(adv, expected[index], rtol=1e-5, atol=1e-6)


def test_minibatch_normalization_of_a_tiny_spread_divides_by_std_plus_1e_8(monkeypatch):
    """"minibatch": a spread of about 1e-9 is divided by its minibatch's unbiased std + 1e-8 (not scaled to unit
    std, and not by std - 1e-8, which flips every sign).
    Mutant: adv.std() + 1e-8 -> adv.std() - 1e-8 in ppo_update's per-minibatch normalization."""
    raw = torch.randn(T, N, generator=torch.Generator().manual_seed(4)) * 1e-9
    a = raw.double().numpy().flatten()
    seen = seen_advantages(monkeypatch, raw, num_epochs=1, num_mini_batches=2, minibatch_unit="transition",
                           advantage_norm="minibatch")
    assert len(seen) == 2
    for index, adv in seen:
        mb = a[index]
        np.testing.assert_allclose(adv, (mb - mb.mean()) / (mb.std(ddof=1) + 1e-8), rtol=1e-3, atol=1e-6)
        assert 0.05 < np.abs(adv).max() < 1.0        # far from unit std: the 1e-8 dominates


@pytest.mark.parametrize("mode, expected", [("local", []), ("global", ["advantages", "advantages"]),
                                            ("none", []), ("minibatch", [])])
def test_only_global_normalization_communicates(monkeypatch, mode, expected):
    """"global" takes global_mean_std's two all-reduces; "local" reads this rank's rollout alone (with several
    ranks an all-reduce that the sync plan does not list), "none" and "minibatch" nothing.
    Mutant: `if mode == "global"` negated (one rank: the same numbers, but "local" all-reduces)."""
    purposes = []
    monkeypatch.setattr(comm, "all_reduce", lambda tensor, purpose, async_op=False: purposes.append(purpose) or tensor)
    s = RolloutStorage(2, 3, {"policy": 1, "critic": 1}, 1, CPU)
    s.advantages = torch.randn(2, 3, generator=torch.Generator().manual_seed(6))
    normalize_advantages(s, mode)
    assert purposes == expected
