"""Motion tracking, shaped like SONIC's task: a 6-joint planar chain hanging under gravity, driven by PD
position targets, must follow reference motions drawn from a procedural library.

Dynamics: point masses at the link ends, absolute link angles phi (0 = hanging down). With
M_j = sum of masses from link j outwards:
    mass matrix   H_jk = M_max(j,k) l_j l_k cos(phi_j - phi_k)
    velocity term C_j  = sum_k M_max(j,k) l_j l_k sin(phi_j - phi_k) phi_dot_k^2
    gravity       G_j  = g l_j M_j sin(phi_j)
    H phi_ddot = tau_phi - C - G,  with tau_phi_j = tau_j - tau_(j+1) for joint torques tau.
Joint angles q are relative (phi = cumsum q). Semi-implicit Euler at `sim_dt`, `decimation` substeps
per policy step. Gravity makes the joints sag away from their PD targets, so good tracking needs the
policy to learn a feed-forward offset, not just copy the reference.

Observations: `policy` = joint pos/vel, previous action, reference joint positions at 4 future frames
and the reference velocity; `critic` adds privileged body positions, reference body positions and the
episode phase. Reward: exp-kernels on joint and body-position error. Terminated when the mean body
position error exceeds `fail_distance`; truncated when the motion clip or the time limit ends.

Logged (extras["log"]): each step's mean over the envs, which the runner averages over the iteration's steps.
`Episode/failures_per_step` is the share of envs that fail at a step, not the share of episodes that fail (that is
about this times the mean episode length).
"""

import torch

from envs.motions import AdaptiveMotionSampler, MotionLibrary


class Tracking:
    num_joints, link_length, link_mass, gravity = 6, 0.25, 0.5, 9.81
    num_actions = num_joints      # a PD position target per joint
    kp, kd, joint_damping = 40.0, 2.0, 0.1
    sim_dt, decimation = 0.005, 4
    future_steps = (1, 2, 5, 10)     # the first must be 1 (the next frame, see _observe)
    fail_distance = 0.15
    log_keys = ("Episode/body_error", "Episode/reward_joint", "Episode/reward_body", "Episode/failures_per_step")

    @classmethod
    def observation_dims(cls) -> dict[str, int]:
        """Widths of the observation groups (see _observe), known before an env is built (configs/memory.py)."""
        j = cls.num_joints
        policy = 2 * j + j + j * len(cls.future_steps) + j
        return {"policy": policy, "critic": policy + 2 * 2 * j + 1}

    def __init__(self, num_envs: int, device: torch.device, seed: int, base_seed: int,
                 episode_length_s: float = 10.0, num_motions: int = 64, uniform_floor: float = 0.2):
        if self.future_steps[0] != 1:
            raise ValueError(f"Tracking.future_steps must start with 1 (the next frame, whose velocity the "
                             f"observation reuses); got {self.future_steps}")
        self.num_envs, self.device = num_envs, torch.device(device)
        self.dt = self.sim_dt * self.decimation
        self.max_episode_length = int(round(episode_length_s / self.dt))
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self.motions = MotionLibrary(num_motions, self.num_joints, base_seed, self.device)
        self.sampler = AdaptiveMotionSampler(num_motions, uniform_floor, self.device)
        n, j = num_envs, self.num_joints
        self.obs_dims = self.observation_dims()
        self.q = torch.zeros(n, j, device=self.device)
        self.qd = torch.zeros(n, j, device=self.device)
        self.last_action = torch.zeros(n, j, device=self.device)
        self.motion_ids = torch.zeros(n, dtype=torch.long, device=self.device)
        self.motion_time = torch.zeros(n, device=self.device)
        self.episode_length = torch.zeros(n, dtype=torch.long, device=self.device)
        # Made once: a tensor built from Python data at every step is a host-to-device copy, which on a GPU waits.
        self.future_offsets = self.dt * torch.tensor(self.future_steps, device=self.device)
        idx = torch.arange(j, device=self.device)
        mass_outwards = self.link_mass * (j - idx).float()                       # M_j
        self.mass_pair = mass_outwards[torch.maximum(idx[:, None], idx[None, :])] * self.link_length**2
        self.gravity_coef = self.gravity * self.link_length * mass_outwards
        # Joint-space PD gains seen in link-angle coordinates: q = D phi with D the difference matrix.
        to_joint = torch.eye(j, device=self.device) - torch.eye(j, device=self.device).roll(-1, 1).tril(-1)
        self.stiffness_phi = self.kp * to_joint.T @ to_joint
        self.damping_phi = (self.kd + self.joint_damping) * to_joint.T @ to_joint

    # ----- physics -------------------------------------------------------------------------------
    def _body_positions(self, q: torch.Tensor) -> torch.Tensor:
        phi = q.cumsum(-1)
        x = (self.link_length * torch.sin(phi)).cumsum(-1)
        y = (-self.link_length * torch.cos(phi)).cumsum(-1)
        return torch.stack([x, y], -1)                                            # [..., J, 2]

    def _simulate(self, target: torch.Tensor) -> None:
        """`decimation` substeps. The PD terms are integrated implicitly (stiff: an explicit step at
        sim_dt would blow up the light outer links); velocity terms and gravity explicitly."""
        dt = self.sim_dt
        for _ in range(self.decimation):
            tau = self.kp * (target - self.q)
            tau_phi = tau - torch.nn.functional.pad(tau[:, 1:], (0, 1))
            phi, phid = self.q.cumsum(-1), self.qd.cumsum(-1)
            diff = phi[:, :, None] - phi[:, None, :]
            H = self.mass_pair * torch.cos(diff)
            C = (self.mass_pair * torch.sin(diff) * (phid**2)[:, None, :]).sum(-1)
            G = self.gravity_coef * torch.sin(phi)
            lhs = H + dt * self.damping_phi + dt * dt * self.stiffness_phi
            rhs = (H @ phid.unsqueeze(-1)).squeeze(-1) + dt * (tau_phi - C - G)
            # solve_ex, not solve: the same LU solve, but solve reads its error flags on the host, which on
            # a GPU is a device sync per substep. lhs is positive definite (mass matrix plus PD terms).
            phid = torch.linalg.solve_ex(lhs, rhs.unsqueeze(-1)).result.squeeze(-1)
            phi = phi + dt * phid
            self.q = torch.diff(phi, dim=-1, prepend=torch.zeros_like(phi[:, :1]))
            self.qd = torch.diff(phid, dim=-1, prepend=torch.zeros_like(phid[:, :1]))

    # ----- task --------------------------------------------------------------------------------
    def _reset_envs(self, mask: torch.Tensor) -> None:
        """Start new episodes where `mask` is set: a sampled motion, a random start time, the reference state."""
        motion_ids = self.sampler.sample(self.num_envs, self.generator)
        start = torch.rand(self.num_envs, generator=self.generator, device=self.device)
        start = start * 0.5 * self.motions.duration[motion_ids]
        self.motion_ids = torch.where(mask, motion_ids, self.motion_ids)
        self.motion_time = torch.where(mask, start, self.motion_time)
        ref_q, ref_qd = self.motions.frame(self.motion_ids, self.motion_time)
        self.q = torch.where(mask[:, None], ref_q, self.q)
        self.qd = torch.where(mask[:, None], ref_qd, self.qd)
        self.last_action = torch.where(mask[:, None], 0.0, self.last_action)
        self.episode_length = torch.where(mask, 0, self.episode_length)

    def _observe(self, ref_q: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """Both observation groups; `ref_q`: the reference at the current time when the caller has it."""
        future = self.motion_time[:, None] + self.future_offsets
        ref_future, ref_qd_future = self.motions.frame(self.motion_ids, future)  # [N, F, J]
        # The first future frame is the next one (future_steps[0] == 1): its velocity is the policy's reference
        # velocity, the same value a separate frame() at motion_time + dt computes, at a third of the cost.
        policy = torch.cat([self.q, 0.1 * self.qd, self.last_action, ref_future.flatten(1),
                            0.1 * ref_qd_future[:, 0]], 1)
        if ref_q is None:
            ref_q, _ = self.motions.frame(self.motion_ids, self.motion_time)
        phase = (self.episode_length.float() / self.max_episode_length)[:, None]
        critic = torch.cat([policy, self._body_positions(self.q).flatten(1),
                            self._body_positions(ref_q).flatten(1), phase], 1)
        return {"policy": policy, "critic": critic}

    def reset(self):
        self._reset_envs(torch.ones(self.num_envs, dtype=torch.bool, device=self.device))
        # Spread episode ends over the time limit so rollouts do not see every env time out at once (over [0, 1)
        # for a one-step limit, --env.episode-length-s 0.02, where max // 2 is 0 and randint refuses the range).
        self.episode_length = torch.randint(0, max(self.max_episode_length // 2, 1), (self.num_envs,),
                                            generator=self.generator, device=self.device)
        return self._observe(), {"log": {}}

    def step(self, actions: torch.Tensor):
        self.last_action = actions.clamp(-5.0, 5.0)
        self._simulate(self.last_action)
        self.motion_time = self.motion_time + self.dt
        self.episode_length += 1

        ref_q, _ = self.motions.frame(self.motion_ids, self.motion_time)
        joint_err = (self.q - ref_q).square().mean(1)
        body_err = (self._body_positions(self.q) - self._body_positions(ref_q)).norm(dim=-1).mean(1)
        reward_joint = torch.exp(-joint_err / 0.05)
        reward_body = torch.exp(-body_err.square() / 0.005)
        reward = 0.5 * reward_joint + 0.5 * reward_body

        terminated = body_err > self.fail_distance
        time_out = (self.episode_length >= self.max_episode_length) | (
            self.motion_time >= self.motions.duration[self.motion_ids])
        truncated = time_out & ~terminated
        done = terminated | truncated
        final_obs = self._observe(ref_q)                   # before the resets: what the time-out bootstrap values
        self.sampler.record(self.motion_ids, done, terminated)
        log = {"Episode/body_error": body_err.mean(), "Episode/reward_joint": reward_joint.mean(),
               "Episode/reward_body": reward_body.mean(), "Episode/failures_per_step": terminated.float().mean()}
        self._reset_envs(done)
        return self._observe(), reward, terminated, truncated, {"final_obs": final_obs, "log": log}

    def state_dict(self) -> dict:
        return {"sampler": self.sampler.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.sampler.load_state_dict(state["sampler"])
