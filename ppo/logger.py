"""Rank-0 logging: TensorBoard scalars under RSL-RL's tag names, and one console line per iteration."""

import time

from torch.utils.tensorboard import SummaryWriter


class RunLogger:
    def __init__(self, run_dir: str, max_iterations: int, start_iteration: int):
        self.writer = SummaryWriter(run_dir)
        self.max_iterations, self.start_iteration = max_iterations, start_iteration
        self.start_time = time.time()

    def log(self, scalars: dict[str, float], step: int) -> None:
        for tag, value in scalars.items():
            self.writer.add_scalar(tag, value, step)

    def print_line(self, iteration: int, scalars: dict[str, float]) -> None:
        done = iteration + 1 - self.start_iteration
        elapsed = time.time() - self.start_time
        eta = elapsed / done * (self.max_iterations - iteration - 1)
        reward = scalars.get("Train/mean_reward", float("nan"))
        length = scalars.get("Train/mean_episode_length", float("nan"))
        print(f"it {iteration + 1:>5}/{self.max_iterations}  {scalars['Perf/total_fps']:>9.0f} steps/s  "
              f"reward {reward:8.2f}  ep_len {length:6.1f}  kl {scalars['Policy/kl']:.4f}  "
              f"lr {scalars['Loss/learning_rate']:.1e}  ETA {eta / 60:5.1f} min", flush=True)

    def close(self) -> None:
        self.writer.close()
