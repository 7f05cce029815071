"""docs/export.md's "Evaluating a checkpoint in Python" block runs as written, on a fresh cartpole checkpoint
(only its CKPT line is pointed at it), and what it prints agrees with a count made here by the env's own rule."""

import contextlib
import glob
import io
import os
import re

import torch

import train
from configs import preset
from envs import CartPole

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def doc_block() -> str:
    text = open(os.path.join(REPO, "docs", "export.md")).read()
    section = text.split("## Evaluating a checkpoint in Python", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_the_documented_evaluation_runs_on_a_real_checkpoint(tmp_path):
    cfg = preset("cartpole")
    cfg.env.num_envs, cfg.ppo.num_steps, cfg.ppo.num_mini_batches, cfg.max_iterations = 8, 16, 2, 1
    cfg.log.root, cfg.log.print_every = str(tmp_path / "runs"), 100
    train.main(cfg)
    (ckpt,) = glob.glob(str(tmp_path / "runs" / "cartpole" / "*" / "model_1.pt"))
    block = doc_block()
    assert block.count('CKPT = "') == 1
    block = re.sub(r'CKPT = ".*"', f"CKPT = {ckpt!r}", block)
    scope, out = {}, io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(block, "docs/export.md", "exec"), scope)
    episodes = int(re.search(r"^(\d+) episodes, mean return", out.getvalue(), re.M).group(1))
    # The same 1000 steps with the same seed, counted here: every step that ends an env's episode is one episode.
    policy, env = scope["policy"], CartPole(16, "cpu", 123)
    obs, _, ends = *env.reset(), 0
    with torch.no_grad():
        for _ in range(1000):
            obs, _, terminated, truncated, _ = env.step(policy(obs["policy"]))
            ends += int((terminated | truncated).sum())
    assert episodes == ends > 0
    assert os.path.isfile(ckpt.replace(".pt", ".policy.pt2"))
    assert type(scope["model"]).__name__ == "ActorCritic" and scope["config"]["env"]["name"] == "cartpole"
