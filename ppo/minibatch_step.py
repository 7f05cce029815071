"""One minibatch step of the PPO update, and the same step with no host read (`--ppo.capture-step`).

`backward_minibatch` is forward + loss + backward (in micro-batches) + gradient sync + clip; both
paths of `ppo_update` call it. The host path then reads KL, norm and the loss terms (one host sync per
step) to apply the adaptive-LR rule and skip a non-finite step in Python. `SyncFreeStep` does the same on the
device, so that a GPU never waits for the host inside the update and the whole step can be captured
once as a CUDA graph and replayed (one copy of the packed minibatch and one launch instead of hundreds of small
kernels):

- adaptive LR: `device_adaptive_lr`, the rule of ppo/kl_schedule.py on a float64 0-dim tensor (the
  same comparisons and factors in the same precision, so the same LR sequence bit for bit; CUDA's fused
  Adam takes its LR as float32, so there the steps use it rounded: see lr_tensor);
- non-finite skip: fused Adam's `found_inf` input skips the update of parameters and moments and
  takes the step count back, exactly what the host path's `continue` does;
- statistics: summed on the device in float64 in the host path's order, read once per update.

Crosses ranks: nothing beyond what `backward_minibatch` does (the gradient all-reduce per step, one per
bucket when bucketed, KL sum and count riding in the last); the rules above act on the synchronized
values, so every rank makes the same decision.
"""

import math
import warnings

import torch

from dist import comm
from ppo.loss import gaussian_kl, ppo_loss
from ppo.storage import split_fields

CAPTURE_WARMUP_STEPS = 3    # eager steps on a side stream before capture (allocates Adam state, autograd buffers)
TERMS = ("surrogate", "value_function", "entropy", "clip_fraction")   # of ppo_loss, as backward_minibatch returns them
STEP_MEANS = TERMS + ("kl", "grad_norm")   # what an update reports as means over its steps taken, both paths


def backward_minibatch(model, batch: dict, grad_sync, cfg) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of one minibatch, synchronized and clipped. Returns (global KL (sum, count), gradient norm
    before clipping, this rank's mean loss terms in the order of TERMS), all on the device.

    Crosses ranks: the minibatch's gradient all-reduce (GradSync: one, or one per bucket), with the KL sum
    and count riding in the last. Micro-batches accumulate locally; only the last backward is armed.
    """
    q = cfg.num_micro_batches
    if batch["actions"].shape[0] % q:   # unequal chunks weighted equally would bias the gradient, silently
        raise ValueError(f"a minibatch of {batch['actions'].shape[0]} transitions does not split into {q} equal "
                         f"micro-batches (--ppo.num-micro-batches)")
    grad_sync.zero_grad()
    kl_sum = batch["actions"].new_zeros(())
    terms_sum = batch["actions"].new_zeros(len(TERMS))
    for i, micro in enumerate(zip(*(v.chunk(q) for v in batch.values()))):
        mb = dict(zip(batch.keys(), micro))
        pi = model.distribution(mb["actor_obs"])
        terms = ppo_loss(pi.log_prob(mb["actions"]).sum(-1), mb["log_probs"], mb["advantages"],
                         model.value(mb["critic_obs"]), mb["values"], mb["returns"], pi.entropy().sum(-1),
                         cfg.clip_param, cfg.clip_value_loss, cfg.value_loss_coef, cfg.entropy_coef)
        with torch.no_grad():
            kl_sum += gaussian_kl(mb["action_mean"], mb["action_std"], pi.mean, pi.stddev).sum()
            terms_sum += torch.stack([terms[name] for name in TERMS])
        if i == q - 1:   # the boundary: KL (sum, count) rides in the gradient all-reduce
            grad_sync.arm(torch.stack([kl_sum, kl_sum.new_full((), float(batch["actions"].shape[0]))]))
        (terms["loss"] / q).backward()   # equal micro-batches: mean of means
    kl_stats = grad_sync.synchronize()
    return kl_stats, grad_sync.clip_(cfg.max_grad_norm), terms_sum / q


def build_optimizer(params, cfg, device: torch.device) -> torch.optim.Adam:
    """Adam as the update expects it: the fused kernel (one pass over each parameter for moments and step, where
    the multi-tensor kernels make about ten; the update 1.75% shorter at the small bench setting on CPU), for the
    host path and --ppo.capture-step alike, so that both step with the same arithmetic. SyncFreeStep gives it a
    device LR tensor (lr_tensor) for the steps it takes; before and between updates the LR is a float. With
    --ppo.capture-step on CUDA also `capturable`: Adam refuses to be captured in a CUDA graph without it (the
    fused kernel computes the same either way). Frozen parameters (requires_grad False) are left out, as GradSync
    leaves them out: Adam would hold no state for them, and a checkpoint whose state covers only some of its
    parameters is refused as damaged (dist/checkpoint_read.py), so such a run could not resume."""
    params = [p for p in params if p.requires_grad]
    return torch.optim.Adam(params, lr=cfg.learning_rate, eps=cfg.adam_eps, fused=True,
                            capturable=cfg.capture_step and device.type == "cuda")


def lr_tensor(lr: float, device: torch.device) -> torch.Tensor:
    """The LR as the fused Adam reads it from a tensor: float64 on CPU (read as a double, like a Python float);
    float32 on CUDA, the only dtype its CUDA kernel takes, so there the LR it steps with is rounded to float32
    (SyncFreeStep keeps the exact one in float64, which its rule, its statistics and checkpoints use)."""
    return torch.tensor(lr, dtype=torch.float64 if device.type == "cpu" else torch.float32, device=device)


def saved_state_for(optimizer: torch.optim.Optimizer, saved: dict, settings: dict | None = None) -> dict:
    """A checkpoint's optimizer state_dict `saved`, made to load into `optimizer` as this run built it: the
    saved LR (as a float: earlier versions saved --ppo.capture-step's LR tensor), moments and step counts,
    with this optimizer's implementation (fused, capturable, foreach). `load_state_dict` alone would bring
    back the saving run's implementation, so a checkpoint of the host path could not resume with
    --ppo.capture-step (nor, on CUDA, the other way round). `settings` (e.g. {"eps": 1e-5}) replace the
    saved group values of the same names."""
    groups = []
    for built, group in zip(optimizer.param_groups, saved["param_groups"]):
        group = {**group, **{key: built[key] for key in ("fused", "capturable", "foreach") if key in built},
                 **(settings or {})}
        group["lr"] = float(group["lr"])
        groups.append(group)
    return {**saved, "param_groups": groups + saved["param_groups"][len(groups):]}   # a count mismatch still fails


def device_adaptive_lr(lr: torch.Tensor, kl: torch.Tensor, desired_kl: float, lr_min: float,
                       lr_max: float) -> torch.Tensor:
    """ppo.kl_schedule.adaptive_lr on 0-dim tensors (lr float64), without a host read; a non-finite KL
    leaves the LR unchanged, as the host path does."""
    kl = kl.double()
    new = torch.where(kl > 2.0 * desired_kl, lr / 1.5, torch.where((kl > 0.0) & (kl < 0.5 * desired_kl), lr * 1.5, lr))
    return torch.where(torch.isfinite(kl), new.clamp(lr_min, lr_max), lr)


class SyncFreeStep:
    """The minibatch step with every decision on the device; on CUDA captured once and replayed.

    Call `begin()` once per update, the step once per packed minibatch, `finish()` once at the end (the
    update's single host read). During an update the LR lives in `self.lr` (float64, exact) and the
    optimizer reads `self.opt_lr` (see lr_tensor); `finish()` hands it back to the param group as a float,
    so that checkpoints save it exactly, and `begin()` takes up whatever float is there (ours, or one
    assigned from outside: the linear schedule, a checkpoint load). A captured graph steps the Adam moments that
    existed when it was recorded: after `optimizer.load_state_dict` (new tensors), the step warms up and is recorded
    again.
    """

    def __init__(self, model, optimizer, grad_sync, cfg):
        group = optimizer.param_groups[0]
        if len(optimizer.param_groups) != 1 or not group.get("fused"):
            raise ValueError("--ppo.capture-step needs the fused Adam that "
                             "ppo.minibatch_step.build_optimizer(params, cfg, device) returns")
        self.model, self.optimizer, self.grad_sync, self.cfg = model, optimizer, grad_sync, cfg
        device = group["params"][0].device
        self.lr = torch.tensor(float(group["lr"]), dtype=torch.float64, device=device)
        self.opt_lr = lr_tensor(float(group["lr"]), device)   # the tensor the fused kernel reads (graph-stable)
        group["lr"] = self.opt_lr
        # STEP_MEANS summed over taken steps; taken steps; skipped steps
        self.sums = torch.zeros(len(STEP_MEANS) + 2, dtype=torch.float64, device=device)
        self.capture = device.type == "cuda"
        # The graph, its input (a packed minibatch) and that input's (shape, strides, field widths).
        self.graph, self.static, self.layout, self.ledger_per_replay, self.eager_steps = None, None, None, {}, 0
        self.captured_state: list[torch.Tensor] = []   # the Adam state tensors the graph steps

    def begin(self) -> None:
        group = self.optimizer.param_groups[0]
        if group["lr"] is not self.opt_lr:              # a float (see the class docstring): adopt it, keep our tensor
            self.lr.fill_(float(group["lr"]))
            self.opt_lr.copy_(self.lr)
            group["lr"] = self.opt_lr
        state = self._adam_state()
        if self.graph is not None and (len(state) != len(self.captured_state)
                                       or any(a is not b for a, b in zip(state, self.captured_state))):
            # load_state_dict made new moments: the graph would step the old ones. Warm up again before recording:
            # a state without moments (never stepped) would have Adam create them, zero-filled, inside the capture,
            # and every replay would zero them again.
            self.graph, self.eager_steps = None, 0
        self.sums.zero_()

    def _adam_state(self) -> list[torch.Tensor]:
        return [t for state in self.optimizer.state.values() for t in state.values() if isinstance(t, torch.Tensor)]

    def __call__(self, packed: torch.Tensor, widths: dict[str, int]) -> None:
        """Take one step on the packed minibatch `packed` [B, F], its fields laid out by `widths` (as
        ppo.storage.split_fields reads them). Crosses ranks: its gradient all-reduce(s) (backward_minibatch), issued
        eagerly or by the graph's replay, once per minibatch."""
        if self.graph is not None:
            layout = (tuple(packed.shape), packed.stride(), widths)
            if layout != self.layout:   # copy_ would broadcast a smaller batch unnoticed, or misplace the fields
                raise ValueError(f"--ppo.capture-step: the minibatch has (shape, strides, field widths) {layout}, "
                                 f"the captured step {self.layout}")
            self.static.copy_(packed)   # the graph's one input: one copy per replay
            self.graph.replay()
            for purpose, (calls, nbytes) in self.ledger_per_replay.items():   # the replayed collectives
                comm.ledger_add(purpose, calls, nbytes)
        elif self.capture and self.eager_steps >= CAPTURE_WARMUP_STEPS:
            self._capture(packed, widths)
        else:
            self._eager(split_fields(packed, widths))

    def _eager(self, batch: dict) -> None:
        """The step run, not recorded (a warm-up on a side stream before capture). Crosses ranks: _step's."""
        if not self.capture:
            self._step(batch)
            return
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), warnings.catch_warnings():
            # Adam warns that a capturable instance runs uncaptured: these warm-up steps are meant to.
            warnings.filterwarnings("ignore", message="This instance was constructed with capturable=True")
            self._step(batch)
        torch.cuda.current_stream().wait_stream(side)
        self.eager_steps += 1

    def _capture(self, packed: torch.Tensor, widths: dict[str, int]) -> None:
        """Record this step into a CUDA graph (nothing runs while recording), then replay it to take it. Crosses
        ranks once, in that replay: the step's gradient all-reduce(s).

        The graph's input is one buffer laid out as the minibatch (clone keeps a dense tensor's strides), and it
        reads the fields as views of it: the same shapes, strides and offsets as the uncaptured steps read, so the
        GEMMs see the same leading dimensions and alignment (cuBLAS picks kernels by them, and kernels round
        differently), and a replay's input is one copy of the packed minibatch."""
        self.static = packed.clone()
        self.layout = (tuple(self.static.shape), self.static.stride(), dict(widths))
        fields = split_fields(self.static, widths)
        before = comm.ledger_snapshot()
        self.graph = torch.cuda.CUDAGraph()
        # thread_local: CUDA calls that capture forbids fail it only from this thread, so another thread's work (NCCL's
        # watchdog querying its events, a weight-serving thread) neither spoils the capture nor is refused by it
        with torch.cuda.graph(self.graph, capture_error_mode="thread_local"):
            self._step(fields)
        self.captured_state = self._adam_state()
        self.ledger_per_replay = {k: (v[0] - before.get(k, (0, 0))[0], v[1] - before.get(k, (0, 0))[1])
                                  for k, v in comm.ledger_snapshot().items()}
        for purpose, (calls, nbytes) in self.ledger_per_replay.items():   # recording is not issuing
            comm.ledger_add(purpose, -calls, -nbytes)
        self(packed, widths)

    def _step(self, batch: dict) -> None:
        """The step itself (run, recorded or replayed). Crosses ranks: backward_minibatch's gradient all-reduce."""
        cfg = self.cfg
        kl_stats, norm, terms = backward_minibatch(self.model, batch, self.grad_sync, cfg)
        kl = kl_stats[0] / kl_stats[1]
        finite = torch.isfinite(norm)
        if cfg.schedule == "adaptive":     # a skipped step keeps the LR, as in the host path
            new_lr = device_adaptive_lr(self.lr, kl, cfg.desired_kl, cfg.lr_min, cfg.lr_max)
            self.lr.copy_(torch.where(finite, new_lr, self.lr))
            self.opt_lr.copy_(self.lr)
        self.optimizer.found_inf = (~finite).float()   # fused Adam skips the whole update when it is 1
        self.optimizer.step()
        taken = torch.cat([terms.double(), kl.double().reshape(1), norm.double().reshape(1), self.sums.new_ones(1)])
        self.sums[:-1] += torch.where(finite, taken, 0.0)
        self.sums[-1] += (~finite).double()

    def finish(self) -> dict[str, float]:
        """The update's statistics, as the host path reports them; the one host read of the update. The param
        group gets the exact LR back as a float (see the class docstring)."""
        *sums, taken, skipped, lr = torch.cat([self.sums, self.lr.reshape(1)]).tolist()
        self.optimizer.param_groups[0]["lr"] = lr
        stats = {k: v / taken if taken else math.nan for k, v in zip(STEP_MEANS, sums)}   # no step taken: no mean
        stats.update(learning_rate=lr, skipped_steps=skipped)
        return stats


def sync_free_step(model, optimizer, grad_sync, cfg) -> SyncFreeStep:
    """The optimizer's SyncFreeStep, created on first use and kept on the optimizer (with its CUDA graph) across
    updates: it lives as long as the optimizer does."""
    if not hasattr(optimizer, "sync_free_step"):
        optimizer.sync_free_step = SyncFreeStep(model, optimizer, grad_sync, cfg)
    return optimizer.sync_free_step
