"""The VecEnv protocol: the shape of Isaac Lab's RL environments, so real simulators plug in thinly.

    obs, extras = env.reset()
    obs, reward, terminated, truncated, extras = env.step(actions)

- `obs` is a dict of observation groups, at least `policy` and `critic` (the same tensor twice when the critic
  has nothing privileged), each a float32 [num_envs, obs_dims[group]] tensor on `device`.
- `reward` is a float32 [num_envs] tensor; `num_envs` is exactly the count the env was built with.
- `terminated` (failure: no bootstrap) and `truncated` (time-out: bootstrap from the value function)
  are separate bool [num_envs] tensors (not ints: the runner negates them with `~`); an env that
  sets both for a step is taken as terminated.
- `step` may change `actions` in place (it gets the runner's copy; the runner keeps what it sampled), and may
  return tensors it writes into again later (buffers it reuses): the runner copies what it keeps before the next
  step. Not `extras["final_obs"]`, though: a buffer that the reset inside `step` writes into holds the next episode.
- `step` resets finished envs itself; the returned `obs` is already the first observation of the next
  episode. `extras["final_obs"]` holds the observation groups *before* that reset (equal to `obs`
  for envs that did not finish), which is what a time-out must be bootstrapped from.
- `extras["log"]` maps names to scalars (a 0-d tensor or a number), e.g. a mean over the envs; each value
  counts once, whatever the number of envs behind it: the runner averages the values over the steps of an
  iteration that logged the name, and across ranks. `log_keys` declares every name that can appear,
  up front, the same names on every rank: the cross-rank metrics vector must have the same layout on every rank
  even when one rank has not logged a key yet (the runner compares the names across ranks at start-up).
  `Episode/return` and names under `Train/`, `Loss/`, `Policy/`, `Perf/`, `Comm/` and `Control/` are the runner's own.
- `sampler` is the env's adaptive sampler (counts summed across ranks by the runner), or None.
- `state_dict()`/`load_state_dict()` carry sampler/curriculum state into checkpoints: tensors in (nested) dicts
  under str names without '/' (`{}` when there is none); rollout ranks send it as named tensors, their shapes and
  dtypes agreed at start-up. One rank's state is saved (rank 0's, or rollout rank 0's) and every rank loads it on
  resume: state that differs by rank (a per-env curriculum) must be made global (summed, as the sampler's counts
  are) or be re-derivable after a load (and left out of `state_dict()`). Every save checks this: state that
  differs by rank stops the run with an error naming its entries, before anything is written.
- `step` runs under `torch.inference_mode()` (the rollout's): a tensor made there is an inference
  tensor, which the env's own code outside the rollout (`sampler.commit_global`, `load_state_dict`) cannot update
  in place. Keep state in tensors made in `__init__` and update them in place; autograd inside `step` (a
  differentiable model) needs `with torch.inference_mode(False), torch.enable_grad():` around it, on clones.
"""

from typing import Protocol

import torch


class MissingSimulator(ImportError):
    """A simulator package the env needs cannot be imported; the message names the flag and what to install. The
    runner reports it in one line (any other ImportError in an env's code is a bug and keeps its traceback)."""


class VecEnv(Protocol):
    num_envs: int
    num_actions: int
    obs_dims: dict[str, int]
    max_episode_length: int
    device: torch.device
    generator: torch.Generator    # the env's RNG (rank_seed(seed, rank)), saved per rank in checkpoints
    log_keys: tuple[str, ...]
    sampler: object | None        # has local_counts, commit_global(summed); see envs/motions.py

    def reset(self) -> tuple[dict[str, torch.Tensor], dict]: ...

    def step(self, actions: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor,
                                                    torch.Tensor, dict]: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...
