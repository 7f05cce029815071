"""ppo/evaluate.py (`make eval CKPT=...`): a checkpoint scored in the env it trained on, counted here by hand with the
exported policy (ppo.export's torch.export program, not the code under test) on an env built as the test builds it."""

import glob
import os
import subprocess

import numpy as np
import pytest
import torch

import train
from configs import preset
from envs import CartPole
from envs import make_env as train_make_env
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


def by_hand(ckpt: str, per_env: int, num_envs: int, seed: int, stochastic: bool, steps: int = -1,
            make=lambda num_envs, seed: CartPole(num_envs, "cpu", seed)) -> tuple[list, list]:
    """(returns, lengths) of episodes 2 .. per_env + 1 of every env of `make(num_envs, seed)`, the exported mean action
    plus, when stochastic, the model's std times standard normals drawn from the global generator seeded with `seed`;
    `steps` steps at most (-1: no bound)."""
    policy = torch.export.load(export(ckpt, ckpt + ".out")["torch.export"]).module()
    std = torch.load(ckpt, weights_only=False)["model"]["log_std"].exp()
    torch.manual_seed(seed)
    env = make(num_envs, seed)
    obs, _ = env.reset()
    ret, length, ended = [0.0] * num_envs, [0] * num_envs, [0] * num_envs
    returns, lengths = [], []
    with torch.no_grad():
        while min(ended) <= per_env and steps != 0:
            steps -= 1
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


def recording(into: list):
    """envs.make_env, appending (its positional arguments, its keyword arguments, the env) to `into` for each env."""
    def make(*args, **kwargs):
        into.append((args, kwargs, train_make_env(*args, **kwargs)))
        return into[-1][-1]
    return make


class ShortLimit:
    """An env that says its time limit is `limit` steps while its episodes run to its real one (a forked env whose
    max_episode_length is wrong): evaluate's step cap, (quota + 1) * limit steps, is then reached."""

    def __init__(self, env, limit: int):
        self.env, self.max_episode_length = env, limit

    def __getattr__(self, name):
        return getattr(self.env, name)


@pytest.mark.parametrize("limit", [1, 12])
def test_the_step_cap_reached_says_how_many_episodes_finished(cartpole_checkpoint, monkeypatch, limit):
    """8 episodes on 4 envs, 2 each, capped at 3 * limit steps: with limit 1 no counted episode ends (one `error`
    line), with 12 some do, and the scores are theirs, with a note naming how many of the 8 finished.
    Mutants: the cap's note left out -> no note; the empty case not refused -> r.min() of nothing raises
    RuntimeError; a cap of quota * limit steps -> other episodes."""
    make_env = evaluation.make_env
    monkeypatch.setattr(evaluation, "make_env", lambda *args: ShortLimit(make_env(*args), limit))
    notes = []
    returns, lengths = by_hand(cartpole_checkpoint, 2, 4, 3, False, steps=3 * limit)
    if limit == 1:
        assert not returns, "episodes ended within 3 steps: pick another policy"
        with pytest.raises(ValueError, match=r"no env finished an episode after its first within the step cap, 3 "
                                             r"steps \(3 time limits of 1 steps\)"):
            evaluation.evaluate(cartpole_checkpoint, episodes=8, num_envs=4, seed=3, progress=notes.append)
        return
    assert 0 < len(returns) < 8, "the cap did not leave some of the 8 episodes unfinished: pick another limit"
    scores = evaluation.evaluate(cartpole_checkpoint, episodes=8, num_envs=4, seed=3, progress=notes.append)
    assert [line for line in notes if "note:" in line] == [
        f"[eval] note: the step cap, {3 * limit} steps (3 time limits of {limit} steps) reached with {len(returns)} "
        f"of 8 episodes finished; scoring those"]
    assert (scores["episodes"], scores["return_mean"], scores["length_mean"]) == \
        (len(returns), pytest.approx(np.mean(returns), rel=1e-6), pytest.approx(np.mean(lengths), rel=1e-6))


def test_a_tracking_checkpoint_meets_the_motions_its_run_trained_on(tmp_path, monkeypatch):
    """The motion library is built from the checkpoint's shared env seed (its `env_seed` entry), not from evaluate's
    --seed, which seeds only the resets: its tensors are those of the env train.py built. Mutant: make_env given
    `seed` as the base seed -> other motions (and base seed 0, not 7)."""
    cfg = preset("tracking")
    cfg.env.num_envs, cfg.env.num_motions, cfg.ppo.num_steps, cfg.ppo.num_mini_batches = 4, 4, 8, 2
    cfg.max_iterations, cfg.seed, cfg.log.root, cfg.log.print_every = 1, 7, str(tmp_path), 100
    trained = []
    monkeypatch.setattr(train, "make_env", recording(trained))
    train.main(cfg)
    (ckpt,) = glob.glob(str(tmp_path / "tracking" / "*" / "model_1.pt"))
    assert torch.load(ckpt, weights_only=False)["env_seed"] == 7
    built = []
    monkeypatch.setattr(evaluation, "make_env", recording(built))
    scores = evaluation.evaluate(ckpt, episodes=2, num_envs=2, seed=0, progress=lambda line: None)
    ((env_cfg, device, seed, base_seed), _, eval_env), = built
    assert (env_cfg.name, env_cfg.num_envs, env_cfg.num_motions, seed, base_seed) == ("tracking", 2, 4, 0, 7)
    (_, _, train_env), = trained
    for name in ("difficulty", "duration", "bias", "sines"):
        torch.testing.assert_close(getattr(eval_env.motions, name), getattr(train_env.motions, name), rtol=0, atol=0)
    assert scores["episodes"] == 2 and scores["length_mean"] > 0


def relabelled(ckpt: str, path, **env) -> str:
    """A copy of checkpoint `ckpt` at `path` whose run config's env settings are updated with `env`."""
    state = torch.load(ckpt, weights_only=False)
    state["config"]["env"].update(env)
    torch.save(state, path)
    return str(path)


@pytest.mark.slow      # nine commands, each importing the project: ~17 s on 2 cores
def test_bad_input_is_one_line_and_status_2(cartpole_checkpoint, tmp_path):
    """Counts that are not positive, a seed outside 32 bits, a missing file, a directory, a checkpoint whose policy does
    not fit its config's env and an Isaac Lab checkpoint on a machine without a GPU, each one `error:` line naming
    what to fix, exit status 2 (an Isaac Lab checkpoint where Isaac Lab runs: tests/test_evaluate_isaaclab.py).
    Mutant: the size check left out -> the actor's shape error, a traceback."""
    isaac = relabelled(cartpole_checkpoint, tmp_path / "model_3.pt", name="isaaclab", task="Isaac-Velocity-Rough-G1")
    pendulum = relabelled(cartpole_checkpoint, tmp_path / "model_4.pt", name="gymnasium", task="Pendulum-v1")
    for args, said in (([cartpole_checkpoint, "--episodes", "0"], "--episodes must be an integer in [1, inf), got 0"),
                       ([cartpole_checkpoint, "--episodes", "-3"], "--episodes must be an integer in [1, inf), got -3"),
                       ([cartpole_checkpoint, "--num-envs", "0"], "--num-envs must be an integer in [1, inf), got 0"),
                       ([cartpole_checkpoint, "--num-envs", "-2"], "--num-envs must be an integer in [1, inf), got -2"),
                       ([cartpole_checkpoint, "--seed", str(2**32)], "--seed must be an integer in [0, 4294967296)"),
                       ([str(tmp_path / "nope.pt")], "no such checkpoint file"),
                       ([str(tmp_path)], "is a directory; pass a model_<iteration>.pt file inside it"),
                       ([pendulum], "its policy's actor observation size 4 (the env's: 3) does not fit the gymnasium "
                                    "Pendulum-v1 env built from its config"),
                       ([isaac], "--env.name isaaclab simulates on GPUs (cuda:LOCAL_RANK per rank), but this rank's "
                                 "device is cpu: run on a CUDA machine")):
        no_gpu = {**os.environ, "CUDA_VISIBLE_DEVICES": ""} if args == [isaac] else None   # also on a GPU machine
        result = run_python(["-m", "ppo.evaluate", *args], cwd=REPO, env=no_gpu, timeout=120)
        assert result.returncode == 2 and result.stderr.startswith("error: ") and said in result.stderr, result.stderr
        assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr


def test_a_gymnasium_checkpoint_without_gymnasium_names_make_setup_mujoco(cartpole_checkpoint, tmp_path):
    """gymnasium not importable (as before `make setup-mujoco`): one `error:` line naming the target, status 2.
    Mutant: make_env's MissingSimulator not turned into the one line -> an ImportError's traceback."""
    hopper = relabelled(cartpole_checkpoint, tmp_path / "model_5.pt", name="gymnasium", task="Hopper-v5")
    code = ("import runpy, sys; sys.modules['gymnasium'] = None; sys.argv[0] = 'ppo/evaluate.py'; "
            "runpy.run_module('ppo.evaluate', run_name='__main__')")
    result = run_python(["-c", code, hopper], cwd=REPO, timeout=120)
    assert result.returncode == 2 and result.stderr.startswith("error: --env.name gymnasium needs gymnasium"), \
        result.stderr
    assert "make setup-mujoco" in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_make_eval_passes_ckpt_as_one_word_and_needs_one():
    """As `make export`: CKPT reaches the command quoted as typed; without it, one line before any venv step (make
    then adds its own `make: ***` line, status 2). Mutants: CKPT unquoted -> split at the space; eval-needs-ckpt after
    $(VENV)/.runtime -> the venv steps come first."""
    ckpt = "it's $HOME/model_1.pt"
    result = subprocess.run(["make", "--no-print-directory", "-n", "eval", f"CKPT={ckpt}", "ARGS=--episodes 8"],
                            cwd=REPO, capture_output=True, text=True, timeout=60)
    assert "-m ppo.evaluate 'it'\\''s $HOME/model_1.pt' --episodes 8" in result.stdout, result.stdout
    result = subprocess.run(["make", "--no-print-directory", "-n", "eval"], cwd=REPO, capture_output=True, text=True,
                            timeout=60)
    assert "make eval needs CKPT=" in result.stdout.splitlines()[0], result.stdout    # before any venv step
    result = subprocess.run(["make", "--no-print-directory", "eval"], cwd=REPO, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 2 and result.stderr.startswith("error: make eval needs CKPT=path/to/model_")
    assert len(result.stderr.splitlines()) == 2 and "***" in result.stderr.splitlines()[1], result.stderr


def test_a_typed_task_whose_sizes_do_not_fit_the_policy_says_so(cartpole_checkpoint, tmp_path):
    """--env.task replaces the run's task; when the env it builds does not fit the policy, the refusal blames the typed
    setting, not the checkpoint. Mutant: the typed task ignored -> CartPole-v1's discrete actions refused instead."""
    cartpole = relabelled(cartpole_checkpoint, tmp_path / "model_6.pt", name="gymnasium", task="CartPole-v1")
    with pytest.raises(ValueError, match=r"its policy's actor observation size 4 \(the env's: 3\) does not fit the "
                                         r"gymnasium Pendulum-v1 env built from its config \(the settings typed here "
                                         r"build an env of other sizes\)$"):
        evaluation.evaluate(cartpole, episodes=2, num_envs=2, typed={"task": "Pendulum-v1"})
