"""Gradient averaging across ranks without a DDP wrapper: `GradSync(params, mode="flat" | "bucketed")`.

Every parameter's `.grad` is a view into a bucket buffer (no packing copy, ever), so every parameter must share one
dtype and device (refused at construction otherwise; DDP buckets per dtype):

- `flat`: one bucket holding every gradient; one all-reduce per optimizer step, issued at
  `synchronize()`, after backward.
- `bucketed`: buckets of at most `bucket_mb` MB in reverse registration order (roughly the order
  backward produces gradients; a tensor larger than the cap gets a bucket of its own). At the
  minibatch boundary each bucket's all-reduce is launched asynchronously, from a
  post-accumulate-grad hook, as soon as its last gradient is ready, so communication overlaps the
  rest of backward. Buckets launch strictly in index order so every rank issues the same sequence;
  with unused="zero" all of them launch at `synchronize()` (no overlap: a parameter unused on one rank only
  would leave its bucket to launch there later than elsewhere, out of step with any collective in between).
  With micro-batches, unused="error" has the same gap: a parameter whose gradient came from an earlier
  micro-batch but not the armed one holds its bucket and every later one back to `synchronize()` on that rank.
  Where that can differ between ranks, issue no collective between the armed backward and `synchronize()` (a
  loss all-reduced there for logging was summed with a gradient bucket, then the ranks hung), or use unused="zero".

A few `extras` scalars (e.g. the KL sum and count of the adaptive-LR rule) ride at the end of the
last bucket to launch, saving a separate collective: they are summed, the gradients averaged. They
take the gradient dtype (float32 for fp32 parameters: counts stay exact below 2**24; bfloat16 keeps 8
significant bits, so a count of 1001 travels as 1000).

GradSync averages gradients only. Unlike DDP it broadcasts nothing at construction: start every rank
from the same parameters and buffers (same seed, or broadcast them from rank 0 before the first step),
or the ranks apply identical gradients to different weights and never notice. Nor does it touch buffers
later: BatchNorm's running statistics stay each rank's own (DDP broadcasts rank 0's before every forward);
give them a rule (dist/buffers.py) or broadcast them yourself. Nor does it compare the parameter lists:
every rank must serve the same shapes and dtypes in the same order (train.py builds one model from
settings it checks are the same everywhere); otherwise buckets pair wrong, silently when the sizes agree
(when they differ, gloo aborts a rank: "Received data size doesn't match expected size", and the others wait
out the process group's timeout). Gradients are summed, then divided: float16 ones past 65504 / world size
overflow to inf, and the step is skipped (DDP divides first).

Per optimizer step, with q micro-batches (gradients accumulate locally; only the last backward
communicates, so the accumulation window is exactly one minibatch):

    sync = GradSync(model.parameters(), mode="bucketed", bucket_mb=25, num_extras=2)   # once, after init
    ...
    sync.zero_grad()
    for i, micro in enumerate(micro_batches):
        loss = ...                               # forward
        if i == q - 1:
            sync.arm(extras)                     # the next backward is the minibatch boundary (None: no extras)
        (loss / q).backward()
    summed_extras = sync.synchronize()           # wait: grads averaged, identical on every rank
    norm = sync.clip_(max_norm)                  # global norm of the synchronized gradient
    optimizer.step()

Building a GradSync replaces each parameter's `.grad` by a zeroed view (a gradient already there is dropped).
A new GradSync over parameters that another one serves takes them over: the old one's hooks are removed
(its gradient views are replaced, so it could not synchronize anyway) and its buckets can be freed. A GradSync
nothing refers to any more is freed, its hooks removed, whether or not its model lives on.

Parameters that got no gradient in a step: `unused="error"` (default) raises naming them, because a
silently missing gradient usually means a bug in the loss; `unused="zero"` treats it as a zero
gradient (still averaged, so ranks stay identical). Unlike DDP: there a parameter no rank used keeps the
.grad None that optimizer.zero_grad() left, and torch's optimizers skip it; a zero gradient still moves it
under momentum, Adam or weight decay. Calls out of that order raise rather than return a
wrong gradient: arm() again after the armed backward, zero_grad() or clip_() between arm() and
synchronize(), a backward after synchronize() before the next zero_grad() (its gradient would stay on its
rank), synchronize() twice. A parameter listed twice (a trunk shared by actor and critic) is synchronized once.

The all-reduces run in dist.comm's current group (the whole world unless `comm.use_group(group)` set one)
and are counted in `dist.comm.LEDGER`. To copy this file into another project, take dist/comm.py and
dist/plan.py with it (the imports are relative, so the package may have any name); torch >= 2.1.
"""

import functools
import weakref

import torch
from torch.utils.weak import WeakIdKeyDictionary

from . import comm
from .plan import PlanRow


class _Bucket:
    def __init__(self, params: list[torch.nn.Parameter], num_extras: int):
        self.params = params
        self.num_grads = sum(p.numel() for p in params)
        self.buffer = torch.zeros(self.num_grads + num_extras, dtype=params[0].dtype, device=params[0].device)
        self.grads = self.buffer[:self.num_grads]
        self.extras = self.buffer[self.num_grads:]
        self.pending = 0          # gradients still to arrive in the armed backward
        self.work = None          # async all-reduce handle once launched
        offset = 0
        for p in params:
            # Autograd accumulates into an existing .grad in place, so the view survives every backward. It takes the
            # parameter's own strides (a transposed one's too): the fused Adam steps a grad laid out otherwise
            # element by element against the wrong weights.
            p.grad = self.buffer.as_strided(p.size(), p.stride(), offset)
            offset += p.numel()


def _bucket_params(params, bucket_bytes: float) -> list[list[torch.nn.Parameter]]:
    """Reverse registration order, greedily filled up to `bucket_bytes`; never splits a tensor."""
    buckets, current, size = [], [], 0
    for p in reversed(params):
        nbytes = p.numel() * p.element_size()
        if current and size + nbytes > bucket_bytes:
            buckets.append(current)
            current, size = [], 0
        current.append(p)
        size += nbytes
    if current:
        buckets.append(current)
    return buckets


# parameter -> a weak reference to the GradSync whose hooks it carries. Weak on both sides: a GradSync holds its
# parameters, so a strong value would keep its key alive (and the GradSync with it: see _grad_ready).
_SERVED_BY = WeakIdKeyDictionary()


def _served_by(p: torch.nn.Parameter):
    """The GradSync whose hooks `p` carries, or None."""
    ref = _SERVED_BY.get(p)
    return ref() if ref is not None else None


def _grad_ready(ref: weakref.ref, p: torch.Tensor) -> None:
    """Every parameter's post-accumulate-grad hook: GradSync._on_grad_ready of the GradSync `ref` names, if alive.
    Weak because torch's garbage collector does not look inside a parameter's post-accumulate-grad hooks: a bound
    method there made parameter -> hook -> GradSync -> parameter a cycle never freed, so every GradSync dropped with
    its model (train.main's, when it returns) kept the weights and its gradient buckets for the life of the process."""
    sync = ref()
    if sync is not None:
        sync._on_grad_ready(p)


def _dense(p: torch.Tensor) -> bool:
    """Whether `p`'s elements fill exactly numel() consecutive slots in some order of its dimensions."""
    if p.numel() == 0:
        return True
    expected = 1
    for size, stride in sorted(zip(p.shape, p.stride()), key=lambda dim: dim[1]):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


def _remove(hooks: list) -> None:
    for hook in hooks:
        hook.remove()


class GradSync:
    def __init__(self, params, mode: str = "flat", bucket_mb: float = 25.0, num_extras: int = 0,
                 unused: str = "error"):
        if mode not in ("flat", "bucketed"):
            raise ValueError(f"GradSync mode (--dist.grad-sync) must be flat or bucketed, got {mode!r}")
        if unused not in ("error", "zero"):
            raise ValueError(f"GradSync unused (--dist.unused-params) must be error or zero, got {unused!r}")
        if mode == "bucketed" and not bucket_mb > 0:
            raise ValueError(f"GradSync bucket_mb (--dist.bucket-mb) must be positive, got {bucket_mb}")
        # Deduplicated: a shared parameter listed twice (e.g. actor + critic parameters with a common trunk)
        # is one gradient, one bucket slot and one hook, as in DDP.
        self.params = list({id(p): p for p in params if p.requires_grad}.values())
        if not self.params:
            raise ValueError("GradSync needs at least one parameter that requires grad")
        dtypes = {p.dtype for p in self.params}
        if len(dtypes) != 1:
            raise ValueError(f"gradient buckets need one parameter dtype, got {sorted(map(str, dtypes))}")
        devices = {str(p.device) for p in self.params}
        if len(devices) != 1:
            raise ValueError(f"gradient buckets need every parameter on one device, got {sorted(devices)}")
        for i, p in enumerate(self.params):
            if not _dense(p):
                raise ValueError(f"parameter #{i} of shape {tuple(p.shape)} has strides {p.stride()}, a view with gaps "
                                 f"or overlaps: its gradient cannot be a slice of a bucket; make it a parameter of "
                                 f"its own (.contiguous())")
        for previous in {id(o): o for p in self.params if (o := _served_by(p)) is not None}.values():
            previous.remove_hooks()
        self.mode, self.unused, self.num_extras = mode, unused, num_extras
        groups = [self.params[::-1]] if mode == "flat" else _bucket_params(self.params, bucket_mb * 2**20)
        self.buckets = [_Bucket(g, num_extras if i == len(groups) - 1 else 0) for i, g in enumerate(groups)]
        self._bucket_of = {id(p): b for b in self.buckets for p in b.params}
        self._grad_ptr = {id(p): p.grad.data_ptr() for p in self.params}
        self._received: set[int] = set()
        self._armed = self._synchronized = False  # synchronized: until zero_grad(), a backward would stay local
        self._armed_received: set[int] = set()
        self._next_launch = 0
        # The hooks hold this object weakly (see _grad_ready) and go when it is freed, so a model that outlives it
        # (a successor took the parameters over, or none did) carries no dead hooks.
        hook = functools.partial(_grad_ready, weakref.ref(self))
        self._hooks = [p.register_post_accumulate_grad_hook(hook) for p in self.params]
        self._unhook = weakref.finalize(self, _remove, self._hooks)
        self._unhook.atexit = False   # the process's end needs no hooks removed
        for p in self.params:
            _SERVED_BY[p] = weakref.ref(self)

    def remove_hooks(self) -> None:
        """Stop serving the parameters: their backward no longer calls this object (which then can be freed)."""
        self._unhook()                # removes them, once
        self._hooks = []
        for p in self.params:
            if _served_by(p) is self:
                del _SERVED_BY[p]

    # ---- per step ------------------------------------------------------------------------------
    def zero_grad(self) -> None:
        """Zero every bucket (never set grads to None: that would detach the views)."""
        if self._armed:
            raise RuntimeError("zero_grad() between arm() and synchronize(): it would zero the staged extras and, "
                               "bucketed, buffers whose all-reduce may be in flight; call synchronize() first")
        for b in self.buckets:
            b.buffer.zero_()
        self._received.clear()
        self._synchronized = False

    def arm(self, extras: torch.Tensor | None = None) -> None:
        """Declare the next backward the minibatch boundary and stage the extras to sum across ranks.

        No communication here; bucketed, the armed backward itself launches the all-reduces (see
        `_on_grad_ready`), so every rank must run it.
        """
        if self._armed and self._armed_received:
            raise RuntimeError("arm() again after the armed backward: call synchronize() first (bucketed, that "
                               "backward's all-reduces are already in flight)")
        if extras is not None and not self.num_extras:
            raise ValueError("arm() got extras but this GradSync was built with num_extras=0: they would not be summed")
        if self.num_extras:
            if extras is None or extras.numel() != self.num_extras:
                raise ValueError(f"arm() expects {self.num_extras} extra scalars, got "
                                 f"{None if extras is None else extras.numel()}")
            self.buckets[-1].extras.copy_(extras.detach().reshape(-1))
        for b in self.buckets:
            b.pending, b.work = len(b.params), None
        self._armed, self._next_launch = True, 0
        self._armed_received.clear()

    def _on_grad_ready(self, p: torch.Tensor) -> None:
        """Post-accumulate-grad hook of every parameter. Crosses ranks only in an armed bucketed backward:
        launches each bucket's all-reduce (`_launch_ready`) once its last gradient arrived, once per
        optimizer step, to overlap communication with the rest of backward."""
        if self._synchronized:
            raise RuntimeError("a backward after synchronize() and before sync.zero_grad(): its gradient would be "
                               "added on this rank only and the ranks would step to different weights; call "
                               "sync.zero_grad() before the next step's backwards (and arm() before its last)")
        if self._armed:
            if id(p) in self._armed_received:
                # Bucketed: this bucket's all-reduce may already be in flight, so the second gradient
                # would be added on this rank only. Flat raises too, so both modes mean the same thing.
                raise RuntimeError("a second backward after arm(): arm() declares that exactly one more backward "
                                   "(the minibatch's last micro-batch) follows before synchronize() (a parameter "
                                   "used inside and outside a reentrant torch.utils.checkpoint also gets two)")
            self._armed_received.add(id(p))
        self._received.add(id(p))
        # unused="zero": every bucket launches at synchronize(), as flat's does. A bucket holding a parameter unused on
        # one rank only would launch there at synchronize() but during backward elsewhere, and pair with another
        # collective issued in between. (An end-of-backward callback, DDP's way, fires early under reentrant
        # checkpointing: at the end of the inner backward, before the outer parameters' gradients.)
        if not (self._armed and self.mode == "bucketed" and self.unused == "error"):
            return
        bucket = self._bucket_of[id(p)]
        bucket.pending -= 1
        self._launch_ready()

    def _launch_ready(self, force: bool = False) -> None:
        """Launch buckets in index order while the next one is complete (or `force`: all the rest).

        Crosses ranks: one asynchronous all-reduce per bucket launched (`_all_reduce`), each once per step.
        """
        while self._next_launch < len(self.buckets):
            bucket = self.buckets[self._next_launch]
            if bucket.pending > 0 and not force:
                return
            bucket.work = self._all_reduce(bucket.buffer, async_op=True)
            self._next_launch += 1

    def _all_reduce(self, buffer: torch.Tensor, async_op: bool):
        """Crosses ranks: one all-reduce of a bucket (its gradients + any extras), once per optimizer step.

        A SUM on every backend; `synchronize` divides the gradients. Not NCCL's AVG: it multiplies each rank's
        input by 1/W rounded before summing, so at a world size that is not a power of 2 the extras came back
        inexact (a count of 7 on each of 3 ranks: 21.000002) and the gradients rounded unlike gloo's.
        """
        return comm.all_reduce(buffer, "gradients", async_op=async_op)

    def synchronize(self) -> torch.Tensor:
        """Finish the step's communication; return the extras summed over ranks.

        Crosses ranks: flat, one all-reduce of every gradient + extras, issued here; bucketed, the
        per-bucket all-reduces launched during backward, waited on here. Afterwards every rank holds
        the bit-identical mean gradient.
        """
        if not self._armed and self._synchronized:
            raise RuntimeError("synchronize() twice in one step: the gradients are already averaged; call it once per "
                               "optimizer step (zero_grad(), backwards with arm() before the last, synchronize())")
        if not self._armed:
            raise RuntimeError("synchronize() without arm(): call arm() before the last micro-batch's backward")
        for i, p in enumerate(self.params):
            if _served_by(p) is not self:
                raise RuntimeError(f"parameter #{i} is no longer served by this GradSync: one built over it later took "
                                   "it over (its gradient view and hooks), or remove_hooks() ran; build one GradSync "
                                   "over all the parameters (actor and critic with their shared trunk together)")
            if p.grad is None or p.grad.data_ptr() != self._grad_ptr[id(p)]:
                raise RuntimeError(f"parameter #{i}'s .grad is no longer a view into its gradient bucket, so it would "
                                   f"not be synchronized: zero gradients with sync.zero_grad(), never with "
                                   f"optimizer.zero_grad() or model.zero_grad() (they set grads to None); build the "
                                   f"GradSync after casting or moving the model, and do not backward with "
                                   f"create_graph=True (both replace the grads)")
        missing = [(i, p) for i, p in enumerate(self.params) if id(p) not in self._received]
        if missing and self.unused == "error":
            names = ", ".join(f"#{i} of shape {tuple(p.shape)}" for i, p in missing[:5])
            raise RuntimeError(f"{len(missing)} parameter(s) received no gradient this step ({names}); fix the "
                               f"loss, or average them as zero gradients: GradSync(..., unused=\"zero\"), "
                               f"--dist.unused-params zero in train.py (or they were replaced after the GradSync "
                               f"was built, e.g. load_state_dict(assign=True): build it again)")
        self._launch_ready(force=True)      # flat: the one bucket; bucketed: only buckets with unused params
        world = comm.world_size()
        for b in self.buckets:
            if b.work is not None:
                b.work.wait()
                b.work = None     # a finished work kept alive until interpreter exit can abort the process
            if world > 1:
                b.grads.div_(world)
        self._armed, self._synchronized = False, True
        return self.buckets[-1].extras.clone()

    def clip_(self, max_norm: float) -> torch.Tensor:
        """Scale the synchronized gradient to global L2 norm <= max_norm; return the norm before clipping.

        No communication: the gradient is identical on every rank, so is its norm, so a non-finite
        norm makes every rank skip the same step.
        """
        if self._armed:
            raise RuntimeError("clip_() between arm() and synchronize(): it would clip this rank's local gradient; "
                               "call synchronize() first")
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(b.grads) for b in self.buckets]))
        scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        for b in self.buckets:
            b.grads.mul_(scale)
        return norm

    def bucket_bytes(self) -> list[int]:
        """Bytes of each bucket's all-reduce, in launch order (the sync plan prints these)."""
        return [b.buffer.numel() * b.buffer.element_size() for b in self.buckets]

    def plan_rows(self, steps_per_iteration: int) -> list[PlanRow]:
        """The sync-plan row of `steps_per_iteration` synchronized optimizer steps per iteration."""
        return [PlanRow("gradients", f"mean over ranks ({self.mode})", "all_reduce", "iteration",
                        self.bucket_bytes(), steps_per_iteration)]
