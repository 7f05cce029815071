"""Rollout ranks (`--rollout.ranks K`): envs and a policy copy on K ranks, learning on the other L.

    torchrun --standalone --nproc-per-node 2 train.py tracking --rollout.ranks 1                  # 1 + 1, on-policy
    torchrun --standalone --nproc-per-node 5 train.py mujoco --rollout.ranks 4 --rollout.mode async

Each iteration a rollout rank collects its [T, N] batch with its copy of the policy and sends it to its
learner (dist/batches.py); the learner concatenates its rollout ranks' batches along the env axis, runs
the unchanged PPO update, and sends the new weights back through sync/ (patch or bucket), the
observation normalizers' statistics included (they are buffers of the model).

- `sync` mode: batch k is collected with the weights after update k - 1, exactly what a colocated rank
  would use; with an fp32 copy and K = L the run is bit-identical to the colocated one.
- `async` mode: a rollout rank collects batch k + 1 while its learner updates on batch k, up to
  `--rollout.max-staleness S` versions behind. Every batch carries the version it was collected with;
  the learner logs `Perf/policy_lag` and refuses a batch older than S. The learner keeps S + 1 receives
  posted, so a rollout rank that runs ahead never blocks on its sends.

Weights are pulled: before each collection a rollout rank asks its learner for the newest version (at least
the one its bound needs) and gets it as one update, so a rollout rank that fell behind skips the versions
it missed instead of replaying them. The learner only publishes each version; threads of its WeightServer
(rollout_weights.py) answer the requests, so its loop never waits for a rollout rank to take weights.

Per iteration, in order: weights requested and sent down; batches up; the learners' agreed (stop, save)
down; at saves, each rollout rank's RNG and env state up.
"""

import os

import torch

from configs import Config
from configs.resume import shared_env_seed
from configs.typed_flags import env_label
from dist import comm
from dist.batches import (BatchReceiver, BatchSender, Layout, concat_batches, flatten_state, from_bytes, naming,
                          recv_object, send_object, setup_plan_row, to_bytes, unflatten_state)
from dist.buffers import resolve_buffer_policy
from dist.checkpoint import agree_plan_rows, rng_states, rng_states_fit, set_rng_states
from dist.errors import RunError, UsageError, one_line
from dist.plan import PlanRow
from dist.setup import rank_seed, seed_everything
from dist.stats import sum_counts, sum_counts_plan_rows
from dist.stop import StopRequests
from envs import make_env
from envs.base import MissingSimulator
from ppo.actor_critic import build_actor_critic
from ppo.env_check import check_built, check_reset, step_checker
from ppo.restore import ROLLOUT_SEEDS
from ppo.rollout import TRAIN_KEYS, EpisodeStats, check_finite, collect_rollout
from rollout_weights import WeightServer, integrity_failure, request_plan_rows, request_weights, weight_plan_rows
from sync import SyncIntegrityError, WeightSyncConfig, make_weight_syncer

FLAGS = ("version", "stop_signal", "launcher_gone")


def batch_layout(T: int, N: int, obs_dims: dict, num_actions: int, num_keys: int, episode_returns: bool) -> Layout:
    f32, a = torch.float32, num_actions
    fields = {"actor_obs": ((T, N, obs_dims["policy"]), f32), "critic_obs": ((T, N, obs_dims["critic"]), f32),
              "actions": ((T, N, a), f32), "action_mean": ((T, N, a), f32), "action_std": ((T, N, a), f32),
              "log_probs": ((T, N), f32), "values": ((T, N), f32), "rewards": ((T, N), f32),
              "bootstrap": ((T, N), f32), "dones": ((T, N), torch.bool),
              "last_critic_obs": ((N, obs_dims["critic"]), f32),
              "flags": ((len(FLAGS),), torch.float64), "sums": ((num_keys,), torch.float64),
              "counts": ((num_keys,), torch.float64)}
    if episode_returns:
        fields["episode_returns"] = ((T, N), f32)
    return Layout(fields)


def describe_rollout(cfg: Config) -> str:
    """How the rollout ranks collect, as the start-up says it (a resume continues these from its checkpoint)."""
    r = cfg.rollout
    lag = f"async, at most {r.max_staleness} version(s) stale" if r.mode == "async" else "sync (on-policy)"
    recompute = r.recompute if r.recompute != "auto" else f"auto ({'on' if recompute_on(cfg) else 'off'})"
    return f"; {lag}, weights by {r.sync}, copy in {r.dtype}, recompute {recompute}"


def recompute_on(cfg: Config) -> bool:
    """--rollout.recompute, with auto on for async mode or a bfloat16 copy (whose log-probs would bias the ratio)."""
    return {"on": True, "off": False}.get(cfg.rollout.recompute, cfg.rollout.mode == "async" or
                                          cfg.rollout.dtype != "float32")


def weight_sync_config(cfg: Config) -> WeightSyncConfig:
    return WeightSyncConfig(type=cfg.rollout.sync)


class LearnerTeam:
    """A learner's side of its rollout ranks: their batches in, decisions and weights out."""

    def __init__(self, cfg: Config, roles, device, start_iteration: int):
        """Crosses ranks once at start-up: each rollout rank's pickled env spec and batch layout (`setup`)."""
        self.cfg, self.rollouts = cfg, roles.team[1:]
        received = []
        for src in self.rollouts:
            with naming(src):
                received.append(recv_object(src, roles.batches_group, "setup"))
        specs, self.spec_sizes = [spec for spec, _ in received], [size for _, size in received]
        for src, spec in zip(self.rollouts[1:], specs[1:]):
            # state_layout too: the learner sizes every rank's checkpoint-state receive from the first rank's
            if any(spec[k] != specs[0][k] for k in ("obs_dims", "num_actions", "num_envs", "log_keys", "state_layout")):
                raise RunError(f"rollout rank {src} built a different env than rollout rank {self.rollouts[0]}")
        self.spec = specs[0]
        self.num_envs = len(self.rollouts) * self.spec["num_envs"]
        depth = 1 if cfg.rollout.mode == "sync" else cfg.rollout.max_staleness + 1
        self.receiver = BatchReceiver(self.rollouts, roles.batches_group, self.spec["layout"], self.spec["state_bytes"],
                                      depth, start_iteration, cfg.max_iterations, torch.device("cpu"))
        self.device = device
        self.weights = WeightServer(weight_sync_config(cfg), roles.rank, self.rollouts, roles.weights_group,
                                    cfg.dist.timeout_s)
        self.recompute = recompute_on(cfg)

    def start(self, model, version: int) -> None:
        """sync/'s init handshake with each rollout rank; then `version` is served to whoever asks."""
        self.weights.start(model, version)

    def receive(self, iteration: int) -> tuple[dict, dict]:
        """Batch `iteration` of every rollout rank, joined along the env axis, and what rode with it (the
        weight version, stop flags, metric sums). Crosses ranks: the team's `batches` messages (see
        dist/batches.py), once per iteration."""
        try:
            batches = self.receiver.take()
        except comm.CollectiveError as error:
            # The rank whose batch did not come is named. Its weight-serving thread's failure, if any, is the cause
            # (that rank waits for weights); another thread's is not: a healthy rollout rank that waits for the
            # decision this learner cannot make without the stalled rank's batch times out in its thread as well.
            self.weights.check(getattr(error, "peer", -1))
            raise
        flags = torch.stack([b.pop("flags") for b in batches])
        versions, signal, gone = flags[:, 0], flags[:, 1].max().item(), flags[:, 2].max().item()
        lag = iteration - int(versions.min())
        if lag > (self.cfg.rollout.max_staleness if self.cfg.rollout.mode == "async" else 0):
            raise RunError(f"batch {iteration} from rollout ranks {self.rollouts} was collected with weights "
                           f"{lag} versions old, more than --rollout.max-staleness allows")
        sums = sum(b.pop("sums") for b in batches)
        counts = sum(b.pop("counts") for b in batches)
        batch = {k: v.to(self.device) for k, v in concat_batches(batches).items()}   # staged on the host (gloo)
        return batch, {"lag": lag, "sums": sums, "counts": counts,
                       "Control/stop_signal": signal, "Control/launcher_gone": gone}   # keys of dist.stop.STOP_KEYS

    def finish(self, model, iteration: int, stop: bool, save: bool) -> torch.Tensor | None:
        """Tell the rollout ranks the decision; at a save, collect every rollout rank's state; then publish the
        next weights. Crosses ranks once per iteration: `control` down; at saves `checkpoint` up, then one
        gather of the teams' states to learner 0, which writes the checkpoint (weights go from WeightServer's
        threads). Returns the gathered states on learner 0 at a save, else None."""
        self.receiver.decide(stop, save)
        states = comm.gather(self.receiver.states(), "checkpoint") if save else None
        if not stop:          # after the last iteration too: the copies end with the final weights
            self.weights.publish(model, iteration + 1)
        return states

    def close(self) -> None:
        """Wait until the rollout ranks have read every decision and said they are done with the weights. Crosses
        ranks once, at the end: the `control` sends still in flight complete; the serving threads take each
        rollout rank's last requests."""
        self.receiver.close()
        self.weights.close()

    def plan_rows(self) -> list[PlanRow]:
        gathered = PlanRow("checkpoint", "rollout states of every team to learner 0", "gather", "checkpoint",
                           [self.spec["state_bytes"] * len(self.rollouts)], every=self.cfg.log.save_every)
        return [setup_plan_row(self.spec_sizes, "recv"), *self.receiver.plan_rows(self.cfg.log.save_every), gathered,
                *self.weights.plan_rows()]


def restore_rollout_rng(checkpoint: dict, cfg: Config, roles, env, device) -> None:
    """Rollout rank j takes the RNG states that rollout rank j saved, when the layout and --seed are the checkpoint
    run's and the states fit (the learners' rank 0 says when layout or seed differ; rollout rank 0 says this)."""
    same_run = checkpoint["config"].get("seed", cfg.seed) == cfg.seed
    if checkpoint.get("layout") == [roles.num_learners, roles.num_rollouts] and same_run:
        rng = checkpoint["rollout_rng"][roles.rollout_index]
        if rng_states_fit(rng, env, device=device):
            set_rng_states(rng, env, device=device)
        elif roles.rollout_index == 0:
            print("[syncppo] the rollout ranks' RNG states in the checkpoint do not fit their generators (saved "
                  f"on another device): their streams restart from {ROLLOUT_SEEDS}", flush=True)


def run_rollout_rank(cfg: Config, roles, device, checkpoint: dict | None, start_iteration: int) -> tuple:
    """A rollout rank's whole life: build, agree layouts with its learner, then collect until told to stop.

    Crosses ranks: at start-up its env spec up and sync/'s init handshake; per iteration a weight request (and
    update), its batch up and a decision down (once its own stop flag went up, only the batch, sent again); every
    --dist.sampler-sync-every iterations and at saves the sampler-count sum among the rollout ranks, and at saves its
    state up; at the end the final weights (after the last iteration) and a `done` request. Returns the policy copy
    and this rank's sync-plan rows."""
    j, learner = roles.rollout_index, roles.team[0]
    seed_everything(rank_seed(cfg.seed, j))      # the seeds colocated rank j would use
    try:
        env = make_env(cfg.env, device, seed=rank_seed(cfg.seed, j), base_seed=shared_env_seed(cfg, checkpoint))
    except (ValueError, MissingSimulator) as exc:   # the learners build no env: the first rollout rank says it
        raise UsageError(one_line(exc), say_here=j == 0) from exc
    check_built(env, env_label(cfg), cfg.env.num_envs)
    copy = build_actor_critic(cfg.policy, env.obs_dims, env.num_actions).to(device)
    low_precision = cfg.rollout.dtype != "float32"
    if low_precision:
        for p in copy.parameters():
            p.data = p.data.to(getattr(torch, cfg.rollout.dtype))
    if checkpoint is not None:
        env.load_state_dict(checkpoint["env"])
        restore_rollout_rng(checkpoint, cfg, roles, env, device)
    obs, T, N = check_reset(env, env.reset(), env_label(cfg), device), cfg.ppo.num_steps, env.num_envs
    keys = TRAIN_KEYS + tuple(env.log_keys)
    layout = batch_layout(T, N, env.obs_dims, env.num_actions, len(keys), cfg.log.episode_returns)

    def checkpoint_state() -> dict[str, torch.Tensor]:
        """What a checkpoint keeps of this rank: its RNG states and its env's state, as named tensors."""
        return {**{f"rng/{k}": v for k, v in rng_states(env, device=device).items()},
                **{f"env/{k}": v for k, v in flatten_state(env.state_dict()).items()}}

    state_layout = {name: (tuple(v.shape), v.dtype) for name, v in checkpoint_state().items()}
    state_bytes = to_bytes(checkpoint_state()).numel()
    spec = {"obs_dims": env.obs_dims, "num_actions": env.num_actions, "num_envs": N, "log_keys": tuple(env.log_keys),
            "layout": layout, "state_layout": state_layout, "state_bytes": state_bytes,
            "reset_obs": {"actor_obs": obs["policy"].cpu(), "critic_obs": obs["critic"].cpu()}}
    syncer = make_weight_syncer(weight_sync_config(cfg), learner, [roles.rank], roles.weights_group)
    with naming(learner, "learner"):
        spec_size = send_object(spec, learner, roles.batches_group, "setup")
        # The learners refuse a BUFFER_POLICY that cannot work once they build the model from the spec: so does this
        # copy (the same UsageError, status 2), not then fail as 'learner rank 0 died' in the handshake below.
        resolve_buffer_policy(copy, copy.BUFFER_POLICY)
        try:
            version = syncer.init_receiver(copy)      # start - 1: the first request brings the learners' weights
        except SyncIntegrityError as error:
            raise integrity_failure(error, f"the initial weights from learner rank {learner}") from error
    sender = BatchSender(learner, roles.batches_group, layout, state_bytes, torch.device("cpu"))
    plan = [*agree_plan_rows(), setup_plan_row([spec_size], "send"), *sender.plan_rows(cfg.log.save_every),
            *request_plan_rows("send", "recv", 1), *weight_plan_rows(syncer)]
    plan += sum_counts_plan_rows(env.sampler, cfg.dist.sampler_sync_every, cfg.log.save_every)   # rollout group

    def done() -> tuple:
        """Crosses ranks once, at the end: the `done` request that releases the learner's serving thread."""
        request_weights(syncer, copy, learner, roles.weights_group, version, -1)
        return copy, plan

    if cfg.dry_run:           # the learner prints the plan once the layouts are agreed
        return done()
    comm.use_group(roles.rollout_group)
    stop = StopRequests(watch_launcher="TORCHELASTIC_RUN_ID" in os.environ)
    stats = EpisodeStats(N, keys, device)
    lag = 0 if cfg.rollout.mode == "sync" else cfg.rollout.max_staleness
    decided = start_iteration - 1               # the last iteration whose (stop, save) this rank has read
    autocast = torch.autocast(device.type, dtype=getattr(torch, cfg.rollout.dtype), enabled=low_precision)

    counted = {}    # iteration -> this rank's sampler counts from collecting it, until its decision is read
    stopping, sent = False, {}    # whether a batch sent carried this rank's own stop flag; the last batch sent

    def read_decision() -> bool:
        """The learners' (stop, save) for the next undecided iteration; True if they stopped there. Crosses ranks:
        the decision down (`control`); at a save, the sampler-count sum among the rollout ranks, then this rank's
        state up (`checkpoint`)."""
        nonlocal decided
        must_stop, save = sender.decision()
        decided += 1
        counted.pop(decided, None)
        if save and env.sampler is None:
            sender.send_state(to_bytes(checkpoint_state()))
        elif save:
            # In async mode this rank has collected up to S batches past the saved iteration; a resumed run
            # collects them again, so their counts are held back from the checkpoint (they stay local here).
            ahead = sum(counted.values(), torch.zeros_like(env.sampler.local_counts))
            env.sampler.local_counts -= ahead
            sum_counts(env.sampler)
            sender.send_state(to_bytes(checkpoint_state()))
            env.sampler.local_counts += ahead
        return must_stop

    check_steps = step_checker(env, env_label(cfg), device, cfg.ppo.bootstrap_time_outs)
    try:
        for iteration in range(start_iteration, cfg.max_iterations):
            while decided < iteration - 1 - lag:    # sync: the weights after update k - 1; async: up to S older
                if read_decision():
                    return done()
            if stopping:
                # This rank's own stop flag rode in a batch already sent, so the learners stop at that batch's
                # iteration at the latest (train.py) and never train on this one (async mode: up to S of them).
                # Not collected; the last batch goes again only to complete the receive its learner posted ahead.
                sender.send(sent)
            else:
                # the newest weights, at least the bound's: sync mode gets exactly version k
                need = max(iteration - lag, start_iteration)
                version = request_weights(syncer, copy, learner, roles.weights_group, version, need)
                stats.start_iteration()
                before = env.sampler.local_counts.clone() if env.sampler is not None else None
                with autocast:
                    batch, obs = collect_rollout(copy, env, obs, T, cfg.ppo.gamma, cfg.ppo.bootstrap_time_outs, stats,
                                                 record_returns=cfg.log.episode_returns, check=check_steps)
                if env.sampler is not None:
                    counted[iteration] = env.sampler.local_counts - before
                check_finite(batch, env_label(cfg), roles.rank, iteration + 1)
                batch["flags"] = torch.tensor([version, stop.signal_name is not None, stop.launcher_gone()],
                                              dtype=torch.float64)
                batch["sums"], batch["counts"] = stats.sums, stats.counts
                if cfg.log.episode_returns:
                    batch["episode_returns"] = torch.stack(stats.ended)
                sent = {k: v.cpu() for k, v in batch.items()}
                sender.send(sent)
                stopping = bool(sent["flags"][1:].any())      # FLAGS: a signal here, or this rank's launcher gone
            # every rollout rank sums at the same iterations, stopping or not: the other ranks still collect
            if env.sampler is not None and (iteration + 1) % cfg.dist.sampler_sync_every == 0:
                sum_counts(env.sampler)
        while decided < cfg.max_iterations - 1:
            if read_decision():
                return done()
        version = request_weights(syncer, copy, learner, roles.weights_group, version, cfg.max_iterations)
        return done()
    except comm.CollectiveError as error:
        # A Ctrl-C here too: the learner was still starting, so its KeyboardInterrupt closed the connection before
        # it read the flag. The interrupt is said (as the learner says it), not a learner that "died or stalled".
        if stop.signal_name == "SIGINT":
            raise KeyboardInterrupt from error
        raise
    finally:
        stop.restore_default_handlers()


def unpack_team_states(states: torch.Tensor, spec: dict) -> tuple[list[dict], dict]:
    """From the gathered blobs: every rollout rank's RNG states, in rollout-rank order, and the first one's env
    state (the same on all of them after the sampler sum; team_checkpoint keeps that one)."""
    per = spec["state_bytes"]
    out = []
    for i in range(states.numel() // per):
        flat = from_bytes(states[i * per:(i + 1) * per], spec["state_layout"])
        out.append({"rng": {k[4:]: v for k, v in flat.items() if k.startswith("rng/")},
                    "env": {k[4:]: v for k, v in flat.items() if k.startswith("env/")}})
    # Refused, not silently replaced by the first's: every rollout rank loads the one kept on resume (envs/base.py).
    def other(j: int, key: str) -> bool:      # by bits: a NaN that every rank holds is the same state
        return not torch.equal(*(out[i]["env"][key].reshape(-1).view(torch.uint8) for i in (0, j)))
    keys = [k for k in out[0]["env"] if any(other(j, k) for j in range(1, len(out)))]
    if keys:
        ranks = [j for j in range(len(out)) if any(other(j, k) for k in keys)]
        raise RunError(f"env.state_dict() differs across rollout ranks in {', '.join(map(repr, keys))} (nested names "
                       f"joined by '/'): rollout rank(s) {ranks} hold other values than rollout rank 0, whose state a "
                       f"checkpoint keeps; every rank loads that one on resume: make it the same everywhere (summed "
                       f"across ranks, as the sampler's counts are) or re-derivable after a load (envs/base.py)")
    return [o["rng"] for o in out], unflatten_state(out[0]["env"])


def team_checkpoint(gathered: torch.Tensor, spec: dict, roles) -> dict:
    """The checkpoint entries of the rollout ranks: every one's RNG, and the env state (identical on all
    of them after the sampler sum) from the first."""
    rollout_rngs, env_state = unpack_team_states(gathered.cpu().flatten(), spec)
    return {"env": env_state, "rollout_rng": rollout_rngs, "layout": [roles.num_learners, roles.num_rollouts]}
