"""ppo/evaluate.py (`make eval CKPT=...`): a checkpoint scored in the env it trained on, counted here by hand with the
exported policy (ppo.export's torch.export program, not the code under test) on an env built as the test builds it."""

import glob
import subprocess

import numpy as np
import pytest
import torch

import train
from configs import preset
from envs import CartPole
from ppo import evaluate as evaluation
from ppo.export import export
from tests.forked_python import run_python
from tests.test_export_inputs import REPO


@pytest.fixture(scope="module")
def cartpole_checkpoint(tmp_path_factory) -> str:
    """One iteration of a small cartpole run: a policy whose episodes last tens of steps, of many lengths."""
    root = tmp_path_factory.mktemp("eval")
    cfg = preset("cartpole")
    cfg.env.num_envs, cfg.ppo.num_steps, cfg.ppo.num_mini_batches, cfg.max_iterations = 8, 16, 2, 1
    cfg.log.root, cfg.log.print_every = str(root / "runs"), 100
    train.main(cfg)
    (ckpt,) = glob.glob(str(root / "runs" / "cartpole" / "*" / "model_1.pt"))
    return ckpt


def by_hand(ckpt: str, per_env: int, num_envs: int, seed: int, stochastic: bool) -> tuple[list, list]:
    """(returns, lengths) of episodes 2 .. per_env + 1 of every env, the exported mean action plus, when stochastic,
    the model's std times standard normals drawn from the global generator seeded with `seed`."""
    policy = torch.export.load(export(ckpt, ckpt + ".out")["torch.export"]).module()
    std = torch.load(ckpt, weights_only=False)["model"]["log_std"].exp()
    torch.manual_seed(seed)
    env = CartPole(num_envs, "cpu", seed)
    obs, _ = env.reset()
    ret, length, ended = [0.0] * num_envs, [0] * num_envs, [0] * num_envs
    returns, lengths = [], []
    with torch.no_grad():
        while min(ended) <= per_env:
            mean = policy(obs["policy"])
            actions = torch.randn_like(mean).mul_(std).add_(mean) if stochastic else mean
            obs, reward, terminated, truncated, _ = env.step(actions)
            for i in range(num_envs):
                ret[i] += float(reward[i])
                length[i] += 1
                if terminated[i] or truncated[i]:
                    if 1 <= ended[i] <= per_env:
                        returns.append(ret[i])
                        lengths.append(length[i])
                    ended[i], ret[i], length[i] = ended[i] + 1, 0.0, 0
    return returns, lengths


@pytest.mark.parametrize("stochastic", [False, True])
def test_scores_are_each_envs_whole_episodes_after_its_first_as_counted_by_hand(cartpole_checkpoint, stochastic):
    """14 episodes on 4 envs: 4 each (ceil), the first of each env (begun part-way through its time limit) left out.
    Mutants: the first episode counted -> other returns; an env's episodes past its quota counted -> more episodes;
    the env seeded with the run's --seed instead of evaluate's -> other episodes; `policy.mean` for --stochastic ->
    the stochastic case differs."""
    scores = evaluation.evaluate(cartpole_checkpoint, episodes=14, num_envs=4, seed=5, stochastic=stochastic,
                                 progress=lambda line: None)
    returns, lengths = by_hand(cartpole_checkpoint, 4, 4, 5, stochastic)
    assert scores["episodes"] == len(returns) == 16
    r, n = np.array(returns), np.array(lengths)
    expected = {"return_mean": r.mean(), "return_std": r.std(), "return_min": r.min(), "return_max": r.max(),
                "length_mean": n.mean(), "length_std": n.std()}
    assert {k: scores[k] for k in expected} == pytest.approx(expected, rel=1e-6)
    assert len(set(lengths)) > 3        # a policy of many episode lengths: a miscount would show


def test_a_tracking_checkpoint_meets_the_motions_its_run_trained_on(tmp_path, monkeypatch):
    """The motion library is built from the checkpoint's shared env seed (its `env_seed` entry), not from evaluate's
    --seed, which seeds only the resets. Mutant: make_env given `seed` as the base seed -> 0 here, not 7."""
    cfg = preset("tracking")
    cfg.env.num_envs, cfg.env.num_motions, cfg.ppo.num_steps, cfg.ppo.num_mini_batches = 4, 4, 8, 2
    cfg.max_iterations, cfg.seed, cfg.log.root, cfg.log.print_every = 1, 7, str(tmp_path), 100
    train.main(cfg)
    (ckpt,) = glob.glob(str(tmp_path / "tracking" / "*" / "model_1.pt"))
    assert torch.load(ckpt, weights_only=False)["env_seed"] == 7
    built = []
    make_env = evaluation.make_env
    monkeypatch.setattr(evaluation, "make_env", lambda *args: built.append(args) or make_env(*args))
    scores = evaluation.evaluate(ckpt, episodes=2, num_envs=2, seed=0, progress=lambda line: None)
    (env_cfg, device, seed, base_seed), = built
    assert (env_cfg.name, env_cfg.num_envs, env_cfg.num_motions, seed, base_seed) == ("tracking", 2, 4, 0, 7)
    assert scores["episodes"] == 2 and scores["length_mean"] > 0


def test_bad_input_is_one_line_and_status_2(cartpole_checkpoint, tmp_path):
    """Counts that are not positive, a seed outside 32 bits, a missing file, and an Isaac Lab checkpoint (Kit needs
    its own launcher), each one `error:` line naming what to fix, exit status 2.
    Mutant: saved_env without the isaaclab refusal -> make_env starts the adapter and fails on a missing package."""
    state = torch.load(cartpole_checkpoint, weights_only=False)
    state["config"]["env"].update(name="isaaclab", task="Isaac-Velocity-Rough-G1")
    isaac = tmp_path / "model_3.pt"
    torch.save(state, isaac)
    for args, said in (([cartpole_checkpoint, "--episodes", "0"], "--episodes must be an integer in [1, inf), got 0"),
                       ([cartpole_checkpoint, "--num-envs", "-2"], "--num-envs must be an integer in [1, inf), got -2"),
                       ([cartpole_checkpoint, "--seed", str(2**32)], "--seed must be an integer in [0, 4294967296)"),
                       ([str(tmp_path / "nope.pt")], "no such checkpoint file"),
                       ([str(isaac)], "trained on Isaac Lab (Isaac-Velocity-Rough-G1), whose Kit needs its own "
                                      "launcher: export the policy (make export CKPT=...)")):
        result = run_python(["-m", "ppo.evaluate", *args], cwd=REPO, timeout=120)
        assert result.returncode == 2 and result.stderr.startswith("error: ") and said in result.stderr, result.stderr
        assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr


def test_make_eval_passes_ckpt_as_one_word_and_needs_one():
    """As `make export`: CKPT reaches the command quoted as typed; without it, one line before any venv step."""
    ckpt = "it's $HOME/model_1.pt"
    result = subprocess.run(["make", "--no-print-directory", "-n", "eval", f"CKPT={ckpt}", "ARGS=--episodes 8"],
                            cwd=REPO, capture_output=True, text=True, timeout=60)
    assert "-m ppo.evaluate 'it'\\''s $HOME/model_1.pt' --episodes 8" in result.stdout, result.stdout
    result = subprocess.run(["make", "--no-print-directory", "eval"], cwd=REPO, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 2 and result.stderr.startswith("error: make eval needs CKPT=path/to/model_")
