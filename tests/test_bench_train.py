"""bench/bench_train.py's logic with hand-made inputs: the interleaving with train.main, the clocks against a
faked device, the matmul limit and its table (GFLOP counts, warm-up rounds left out, ratios worked out by hand), the
two-rank rate. RSL-RL itself is never run here (a stand-in runner)."""

import os
import sys
import threading
import types

import numpy as np
import pytest
import torch

from ppo.logger import RunLogger
from tests.test_tools import exit_code, load_bench


@pytest.fixture(scope="module")
def bench_train():
    return load_bench("bench_train")


def test_bench_train_median_of_an_even_number_of_rounds(bench_train):
    # `--quick` large has 2 timed rounds, the full large setting 4: the median of two ratios is their mean,
    # not the larger one.
    assert bench_train.median([0.8, 1.0]) == pytest.approx(0.9)
    assert bench_train.median([4.0, 1.0, 3.0, 2.0]) == pytest.approx(2.5)
    assert bench_train.median([3.0, 1.0, 2.0]) == 2.0
    rng = np.random.default_rng(0)
    for n in range(1, 12):
        xs = rng.random(n).tolist()
        assert bench_train.median(xs) == pytest.approx(float(np.median(xs)))


def test_bench_train_interleaves_with_train_main(bench_train, monkeypatch, tmp_path):
    # run_interleaved replaces train.RunLogger with a subclass that times each iteration: it must take every
    # argument train.main logs with (the episode returns too; it raised TypeError at the first iteration). RSL-RL
    # is replaced by a runner that finishes at once, so syncppo runs its iterations alone.
    from configs import preset

    class NoRunner:
        logger = type("Logger", (), {"log": staticmethod(lambda **kw: None)})()
        alg = type("PPO", (), {"compute_returns": staticmethod(lambda obs: None)})()

        def learn(self, iterations):
            pass

    monkeypatch.setattr(bench_train, "rsl_rl_runner", lambda cfg, log_dir, device: NoRunner())
    cfg = preset("tracking")
    cfg.env.num_envs, cfg.ppo.num_steps, cfg.max_iterations = 16, 8, 2
    cfg.policy.actor_hidden = cfg.policy.critic_hidden = (16,)
    cfg.log.episode_returns = True
    rows = bench_train.run_interleaved(cfg, str(tmp_path), [(1, 1, 1)], torch.device("cpu"))
    assert len(rows["syncppo"]) == 2 and rows["rsl-rl"] == [] and rows["limit"] == []
    assert bench_train.train.RunLogger is RunLogger     # put back


def test_bench_train_stopped_on_request_stops_rsl_rl_too_and_prints_no_table(bench_train, monkeypatch, tmp_path,
                                                                            capsys):
    """Ctrl-C stopped syncppo at its iteration's end, then RSL-RL ran all its iterations alone and the bench printed
    a table of the few rounds there were (or crashed on none) and went on to the next setting."""
    import os
    import signal
    from configs import preset
    learned = []

    class Runner:
        def __init__(self):
            self.logger = type("Logger", (), {"log": staticmethod(self.log)})()
            self.alg = type("PPO", (), {"compute_returns": staticmethod(lambda obs: None)})()

        def log(self, **kw):
            learned.append(kw)
            if len(learned) == 1:     # a Ctrl-C while RSL-RL runs: syncppo's handler takes it (the main thread)
                os.kill(os.getpid(), signal.SIGINT)

        def learn(self, iterations):
            for _ in range(iterations):
                self.alg.compute_returns(None)
                self.logger.log(collect_time=0.1, learn_time=0.2)

    monkeypatch.setattr(bench_train, "rsl_rl_runner", lambda cfg, log_dir, device: Runner())
    monkeypatch.setattr(bench_train, "matmul_limit_seconds", lambda shapes, device: 0.01)
    cfg = preset("tracking")
    cfg.env.num_envs, cfg.ppo.num_steps, cfg.max_iterations = 16, 8, 6
    cfg.policy.actor_hidden = cfg.policy.critic_hidden = (16,)
    with pytest.raises(SystemExit) as stopped:
        bench_train.run_interleaved(cfg, str(tmp_path), [(1, 1, 1)], torch.device("cpu"))
    assert stopped.value.code == 130
    assert capsys.readouterr().err.splitlines()[-1] == ("bench_train.py: stopped on request after 2 of 6 iterations; "
                                                        "no table")
    assert len(learned) == 2     # RSL-RL's iterations alongside syncppo's, none alone after


class FakeDevice:
    """A device whose work takes time: each sync advances a fake clock by `drain` s and is logged with the learner
    whose thread called it (syncppo runs in the main thread); `work(s)` advances the clock."""

    def __init__(self, drain: float = 0.25):
        self.now, self.drain, self.events = 100.0, drain, []

    def perf_counter(self) -> float:
        return self.now

    def work(self, seconds: float) -> None:
        self.now += seconds

    def synchronize(self, device) -> None:
        self.now += self.drain
        self.events.append(("sync", "syncppo" if threading.current_thread() is threading.main_thread() else "rsl-rl"))


def test_bench_train_clocks_wait_for_the_device_and_no_learner_leaves_work_queued(bench_train, monkeypatch, tmp_path,
                                                                                   capsys):
    # RSL-RL's clocks are host clocks over queued work: the rollout's last kernels drain inside its learning clock
    # (at compute_returns), its update's at its logging call. Faked: RSL-RL logs collect 1 s, learn 2 s; each sync
    # drains 0.25 s; compute_returns (GAE, last value) takes 0.5 s. Collection gets the rollout's drain and
    # compute_returns (1 s); the update keeps the rest of its clock (1 s) plus the drain at logging.
    from configs import preset
    fake = FakeDevice()
    monkeypatch.setattr(bench_train, "_synchronize", fake.synchronize)
    monkeypatch.setattr(bench_train, "time", fake)

    class RecordingBaton(bench_train.Baton):
        def pass_on(self, name, finished=False):
            if not finished:
                fake.events.append(("pass", name))
            super().pass_on(name, finished)
    monkeypatch.setattr(bench_train, "Baton", RecordingBaton)

    class FakeRunner:
        def __init__(self):
            self.logger = type("Logger", (), {"log": staticmethod(lambda **kw: None)})()
            self.alg = type("PPO", (), {"compute_returns": staticmethod(lambda obs: fake.work(0.5))})()

        def learn(self, iterations):
            for _ in range(iterations):
                self.alg.compute_returns(None)
                self.logger.log(collect_time=1.0, learn_time=2.0)

    monkeypatch.setattr(bench_train, "rsl_rl_runner", lambda cfg, log_dir, device: FakeRunner())
    cfg = preset("tracking")
    cfg.env.num_envs, cfg.ppo.num_steps, cfg.max_iterations = 16, 8, 2
    cfg.policy.actor_hidden = cfg.policy.critic_hidden = (16,)
    rows = bench_train.run_interleaved(cfg, str(tmp_path), [(1, 1, 1)], torch.device("cpu"))
    assert rows["rsl-rl"] == [pytest.approx((2.0, 1.25, 1.0))] * 2
    assert len(rows["syncppo"]) == 2 and len(rows["limit"]) == 2
    passes = [i for i, event in enumerate(fake.events) if event[0] == "pass"]
    assert [fake.events[i][1] for i in passes] == ["syncppo", "rsl-rl"] * 2
    for i in passes:      # each learner drains the device just before the other's clock can start
        assert fake.events[i - 1] == ("sync", fake.events[i][1]), fake.events
    err = capsys.readouterr().err      # each round on stderr as it ends (what a killed run leaves)
    assert "[bench_train] rsl-rl iteration 2: collection 2.0000 s, update 1.2500 s, matmul limit" in err
    assert "[bench_train] syncppo iteration 2: collection" in err


def test_bench_train_gpu_matmul_limit_queues_the_gemms_between_two_syncs(bench_train, monkeypatch):
    # A sync around each shape timed a host round trip per GEMM, about as long as a small GEMM on a GPU.
    fake = FakeDevice()
    monkeypatch.setattr(bench_train, "_synchronize", fake.synchronize)
    monkeypatch.setattr(bench_train, "time", fake)
    cpu_randn = torch.randn
    monkeypatch.setattr(torch, "randn", lambda *shape, device=None: cpu_randn(*shape))   # no CUDA here

    def mm(a, b):
        fake.events.append(("mm", a.shape[0]))
        fake.work(0.01 * a.shape[0])
    monkeypatch.setattr(torch, "mm", mm)
    seconds = bench_train.matmul_limit_seconds([(2, 3, 4), (5, 6, 7)], torch.device("cuda"))
    assert seconds == pytest.approx(0.07 + 0.25)     # both GEMMs and one drain; no sync between them
    names = [e[0] if e[0] == "sync" else e[1] for e in fake.events]
    assert names == [2, 5] + ["sync", 2, 5, "sync"] * 3


def test_bench_train_table_labels_the_gpu_limit_and_notes_rsl_rl_s_own_split(bench_train, monkeypatch, capsys):
    from configs import preset
    cfg = preset("tracking")
    rows = {"syncppo": [(9.0, 9.0)] + [(1.0, 1.0)] * 3, "rsl-rl": [(9.0, 9.0, 9.0)] + [(2.0, 1.25, 1.0)] * 3,
            "limit": [0.5] * 4}
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "NVIDIA H200")
    for device, label in (("cpu", False), ("cuda", True)):
        bench_train.report("large", cfg, rows, 1, [(1, 1, 1)], torch.device(device))
        bench_train.report_notes(rows, 1)
        out = capsys.readouterr().out
        assert ("GEMMs' share of the update, not a roofline" in out) is label
        assert "3 interleaved rounds after 1 warm-up" in out
        assert "| syncppo | 6,144 | 1.000 | 1.000 |" in out and "| 1.62x | 0.80x |" in out   # warm-up left out
        assert "syncppo's update 0.44x of it" in out          # 1 / (1.25 + 1)
        assert all(line in out for line in bench_train.DIFFERENCES)


def test_bench_train_without_rsl_rl_is_one_line(bench_train, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "rsl_rl", None)      # import rsl_rl raises ImportError
    assert exit_code(bench_train.main, monkeypatch, ["bench_train.py", "--quick"]) == 2
    assert "RSL-RL is not installed: make bench installs it" in capsys.readouterr().err


def test_bench_train_gemm_shapes_by_hand(bench_train):
    # actor 3 -> 4 -> 2, critic 5 -> 4 -> 1, minibatch 7: forward (B, in, out), weight grad (out, B, in),
    # input grad (B, out, in) except for the first layer.
    shapes = bench_train.gemm_shapes({"policy": 3, "critic": 5}, (4,), 2, 7)
    assert shapes == [(7, 3, 4), (4, 7, 3),
                      (7, 4, 2), (2, 7, 4), (7, 2, 4),
                      (7, 5, 4), (4, 7, 5),
                      (7, 4, 1), (1, 7, 4), (7, 1, 4)]


def test_bench_train_zero_num_envs_is_a_usage_error(bench_train, monkeypatch, capsys):
    """`--num-envs 0` used to fall back to the setting's 512 envs silently (0 is falsy) and run the bench."""
    def must_not_run(*args, **kwargs):
        raise AssertionError("the bench ran with a bad --num-envs")

    monkeypatch.setattr(bench_train, "run_interleaved", must_not_run)
    monkeypatch.setattr(sys, "argv", ["bench_train.py", "--quick", "--settings", "small", "--num-envs", "0"])
    with pytest.raises(SystemExit) as exit_info:
        bench_train.main()
    assert exit_info.value.code == 2
    # argparse's usage line lists every flag: only the error line says which one is wrong
    assert capsys.readouterr().err.splitlines()[-1] == "bench_train.py: error: --num-envs must be positive, got 0"


def test_bench_train_rsl_rl_wrapper_gives_the_env_a_copy_of_the_actions(bench_train):
    """An env may change the actions it is given in place (envs/base.py); RSL-RL keeps the tensor it passes to
    step() as the transition's action, so the wrapper passes a copy, as syncppo's rollout does.

    Mutant: RslRlEnv.step passing `actions` itself."""
    seen = []

    class ClampingEnv:
        num_envs, num_actions, device, max_episode_length = 2, 1, torch.device("cpu"), 10

        def reset(self):
            return {"policy": torch.zeros(2, 1), "critic": torch.zeros(2, 1)}, {}

        def step(self, actions):
            seen.append(actions)
            actions.clamp_(-1.0, 1.0)
            obs, _ = self.reset()
            return obs, torch.zeros(2), torch.zeros(2, dtype=torch.bool), torch.zeros(2, dtype=torch.bool), {"log": {}}

    from bench.rsl_rl_adapter import RslRlEnv
    wrapper = RslRlEnv(ClampingEnv())
    actions = torch.tensor([[3.0], [-0.5]])
    wrapper.step(actions)
    assert actions.tolist() == [[3.0], [-0.5]] and seen[0].tolist() == [[1.0], [-0.5]]


def test_bench_train_table_names_the_rsl_rl_version_installed(bench_train, monkeypatch, capsys):
    """The RSL-RL row read "rsl-rl 5.5.1" whatever rsl-rl-lib was installed; now the installed version.

    Mutant: the label back to the literal "rsl-rl 5.5.1" -> the row does not name 9.9.9.
    """
    from configs import preset
    monkeypatch.setattr(bench_train.importlib.metadata, "version",
                        lambda name: "9.9.9" if name == "rsl-rl-lib" else None)
    rows = {"syncppo": [(1.0, 1.0)], "rsl-rl": [(1.0, 1.0, 0.1)], "limit": [0.5]}
    bench_train.report("small", preset("tracking"), rows, 0, [(10, 20, 30)], torch.device("cpu"))
    assert "\n| rsl-rl 9.9.9 | " in capsys.readouterr().out


def test_bench_train_table_gflop_limit_and_ratios_by_hand(bench_train, capsys):
    # Shapes (1000, 1000, 1000) and (10, 20, 30): 2 * m * k * n = 2e9 + 12e3 FLOPs per minibatch step, x 2 epochs
    # x 3 minibatches. 1 warm-up round (the 9s) left out, 2 rounds kept: medians of an even count are means. The
    # limit is the least-loaded round's (0.25 s).
    from configs import preset
    cfg = preset("tracking")
    cfg.env.num_envs, cfg.ppo.num_steps, cfg.ppo.num_epochs, cfg.ppo.num_mini_batches = 64, 8, 2, 3
    shapes = [(1000, 1000, 1000), (10, 20, 30)]
    flops = 2 * 3 * (2 * 1000**3 + 2 * 10 * 20 * 30)
    sp, rl = [(0.5, 1.0), (1.0, 1.5)], [(1.0, 2.0, 0.5), (2.0, 2.5, 1.0)]
    rows = {"syncppo": [(9.0, 9.0)] + sp, "rsl-rl": [(9.0, 9.0, 9.0)] + rl, "limit": [0.5, 0.25, 0.75]}
    bench_train.report("large", cfg, rows, 1, shapes, torch.device("cpu"))
    out = capsys.readouterr().out
    assert "2 interleaved rounds after 1 warm-up" in out
    assert f"update GEMMs {flops / 1e9:.1f} GFLOP, matmul limit {flops / 0.25 / 1e9:.0f} GFLOP/s" in out
    for label, mine in (("syncppo", sp), (f"rsl-rl {bench_train.rsl_rl_version()}", rl)):
        update = np.median([m[1] for m in mine])
        cells = [f"{np.median([512 / (m[0] + m[1]) for m in mine]):,.0f}", f"{np.median([m[0] for m in mine]):.3f}",
                 f"{update:.3f}", f"{np.median([flops / m[1] for m in mine]) / 1e9:.1f}", f"{100 * 0.25 / update:.0f}%",
                 f"{np.median([(r[0] + r[1]) / (m[0] + m[1]) for m, r in zip(mine, rl)]):.2f}x",
                 f"{np.median([m[1] / r[1] for m, r in zip(mine, rl)]):.2f}x"]
        assert f"| {label} | " + " | ".join(cells) + " |" in out, out
    # by hand, for syncppo: 512 / 1.5 and 512 / 2.5 -> 273; 12 / 1.0 and 12 / 1.5 GFLOP -> 10.0; 0.25 / 1.25 -> 20%
    assert "| syncppo | 273 | 0.750 | 1.250 | 10.0 | 20% | 1.90x | 0.55x |" in out
    # RSL-RL's own split: update = learn + compute_returns = 2.5, 3.5 -> 3.000; syncppo 1.0 / 2.5, 1.5 / 3.5 -> 0.41x
    bench_train.report_notes(rows, 1)
    assert "RSL-RL update 3.000 s/it, syncppo's update 0.41x of it" in capsys.readouterr().out


def test_bench_train_limit_row_is_one_update_of_gemms(bench_train, monkeypatch, tmp_path):
    # one update runs epochs x minibatches steps: the limit of an iteration is that many passes over the shapes
    from configs import preset

    class Runner:
        logger = type("Logger", (), {"log": staticmethod(lambda **kw: None)})()
        alg = type("PPO", (), {"compute_returns": staticmethod(lambda obs: None)})()

        def learn(self, iterations):
            for _ in range(iterations):
                self.alg.compute_returns(None)
                self.logger.log(collect_time=1.0, learn_time=2.0)

    monkeypatch.setattr(bench_train, "rsl_rl_runner", lambda cfg, log_dir, device: Runner())
    monkeypatch.setattr(bench_train, "matmul_limit_seconds", lambda shapes, device: 0.125)
    cfg = preset("tracking")
    cfg.env.num_envs, cfg.ppo.num_steps, cfg.max_iterations = 16, 8, 2
    cfg.ppo.num_epochs, cfg.ppo.num_mini_batches = 3, 2
    cfg.policy.actor_hidden = cfg.policy.critic_hidden = (16,)
    rows = bench_train.run_interleaved(cfg, str(tmp_path), [(1, 1, 1)], torch.device("cpu"))
    assert rows["limit"] == [3 * 2 * 0.125] * 2


def test_bench_train_cpu_matmul_limit_sums_each_shape_s_best_of_3(bench_train, monkeypatch):
    # shape 1: warm-up call 9 s, then 3, 1, 2 -> best 1; shape 2: warm-up 9, then 0.5, 0.25, 4 -> best 0.25
    from tests.test_bench_train import FakeDevice
    fake = FakeDevice()
    monkeypatch.setattr(bench_train, "time", fake)
    durations = iter([9.0, 3.0, 1.0, 2.0, 9.0, 0.5, 0.25, 4.0])
    monkeypatch.setattr(torch, "mm", lambda a, b: fake.work(next(durations)))
    assert bench_train.matmul_limit_seconds([(2, 3, 4), (5, 6, 7)], torch.device("cpu")) == pytest.approx(1.25)


def test_bench_train_main_times_the_minibatch_gemms_and_leaves_out_the_warm_up(bench_train, monkeypatch):
    # the GEMMs' M is the minibatch: num_envs x num_steps / num_mini_batches; report gets the setting's warm-up
    from configs import preset
    ppo = preset("tracking").ppo
    monkeypatch.setitem(sys.modules, "rsl_rl", types.ModuleType("rsl_rl"))
    got = {}
    monkeypatch.setattr(bench_train, "run_interleaved", lambda cfg, tmp, shapes, device: got.setdefault("s", shapes))
    monkeypatch.setattr(bench_train, "report", lambda name, cfg, rows, warmup, *a: got.setdefault("w", warmup))
    monkeypatch.setattr(bench_train, "report_notes", lambda rows, warmup: None)
    monkeypatch.setattr(sys, "argv", ["bench_train.py", "--quick", "--settings", "large", "--num-envs", "64"])
    bench_train.main()
    assert got["s"][0][0] == 64 * ppo.num_steps // ppo.num_mini_batches
    assert got["w"] == 1                    # --quick large: 3 iterations, the first left out


def test_bench_train_two_rank_rate_leaves_out_the_warm_up(bench_train, monkeypatch, tmp_path):
    """total_fps 100, 1 (warm-up), then 10, 20, 30, 40: median of the last four = 25; the job draws the table's
    minibatches. Mutant: two_rank_rate's command without `--ppo.minibatch-unit transition` (the preset's)."""
    from torch.utils.tensorboard import SummaryWriter

    def fake_torchrun(command, **kwargs):
        assert command[command.index("--ppo.minibatch-unit") + 1] == "transition"
        writer = SummaryWriter(os.path.join(str(tmp_path), "two-ranks", "run"))
        for step, value in enumerate([100.0, 1.0, 10.0, 20.0, 30.0, 40.0], start=1):
            writer.add_scalar("Perf/total_fps", value, step)
        writer.close()
        return 0
    monkeypatch.setattr(bench_train, "run_child", fake_torchrun)
    assert bench_train.two_rank_rate("tracking", 16, 6, 2, str(tmp_path)) == 25.0


@pytest.mark.parametrize("failure", [RuntimeError("rsl-rl broke"), InterruptedError("rsl-rl broke")])
def test_bench_train_rsl_rl_failure_is_raised_not_a_table_without_it(monkeypatch, tmp_path, failure):
    """RSL-RL failing in its thread (anything but the bench's own StopRslRl, an InterruptedError of RSL-RL's too) is
    raised in the main thread once syncppo is done, rather than returning rows with no RSL-RL rounds.

    Mutant: `if errors: raise errors[0]` dropped (an unchanged line next to the stop's, checked here too); rsl_thread
    catching InterruptedError (the stop's exception before StopRslRl)."""
    from configs import preset
    bt = load_bench("bench_train")

    class BrokenRunner:
        logger = type("Logger", (), {"log": staticmethod(lambda **kw: None)})()
        alg = type("PPO", (), {"compute_returns": staticmethod(lambda obs: None)})()

        def learn(self, iterations):
            raise failure
    monkeypatch.setattr(bt, "rsl_rl_runner", lambda cfg, log_dir, device: BrokenRunner())
    cfg = preset("tracking")
    cfg.env.num_envs, cfg.ppo.num_steps, cfg.max_iterations = 16, 8, 2
    cfg.policy.actor_hidden = cfg.policy.critic_hidden = (16,)
    with pytest.raises(type(failure), match="^rsl-rl broke$"):
        bt.run_interleaved(cfg, str(tmp_path), [(1, 1, 1)], torch.device("cpu"))


def test_bench_train_both_learners_draw_the_same_minibatches_and_learn_the_same_std(bench_train, monkeypatch,
                                                                                    tmp_path):
    """Said to run the same minibatches and networks (DIFFERENCES: the rest), syncppo drew whole-trajectory minibatches
    where RSL-RL shuffles transitions, and RSL-RL learned the std itself where syncppo learns log std. Now both alike.

    Mutant: bench_train.main without `cfg.ppo.minibatch_unit = "transition"` -> "trajectory".
    Mutant: rsl_rl_adapter without `"std_type": "log"` -> RSL-RL's actor has std_param, no log_std_param."""
    from bench.rsl_rl_adapter import rsl_rl_runner
    from configs import preset
    seen = {}
    monkeypatch.setattr(bench_train, "bench", lambda args, configs, iterations, device: seen.update(configs))
    monkeypatch.setattr(sys, "argv", ["bench_train.py", "--quick", "--settings", "small", "large"])
    bench_train.main()
    assert [cfg.ppo.minibatch_unit for cfg in seen.values()] == ["transition", "transition"]

    cfg = preset("tracking")
    cfg.env.num_envs, cfg.policy.init_noise_std = 4, 0.5
    cfg.policy.actor_hidden = cfg.policy.critic_hidden = (8,)
    runner = rsl_rl_runner(cfg, str(tmp_path), torch.device("cpu"))
    params = dict(runner.alg.actor.named_parameters())
    std = [name for name in params if "std" in name]
    assert std == ["distribution.log_std_param"]
    assert torch.allclose(params[std[0]], torch.full_like(params[std[0]], float(np.log(0.5))))
