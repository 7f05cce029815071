"""An explicit cross-rank rule for every registered buffer of a trained module.

Rules: `broadcast` (rank 0's value wins), `mean` (average over ranks), `merge` (the owner merges
sufficient statistics itself, e.g. ObsNormalizer.update), `local` (never synchronized: per-rank state
such as a per-env running return). A module declares its rules as {glob pattern: rule} over buffer
names; `resolve_buffer_policy` fails at start-up on any buffer that no pattern covers, naming it, so a
new buffer can never be silently broadcast or silently left to drift (DDP broadcasts them all); and on a
non-persistent buffer (`persistent=False`) declared anything but `local`: no state_dict, so no checkpoint and no
rollout-rank weight sync, carries it. Each refusal is a UsageError (a ValueError) naming the module and the fix: the
runner says it in one line, no traceback, like a bad flag. Copying this file, take `errors.py` with `comm.py` and
`plan.py` (none imports another file of dist/ beyond those).
"""

from fnmatch import fnmatch

import torch

from . import comm
from .errors import UsageError
from .plan import PlanRow

RULES = ("broadcast", "mean", "merge", "local")


def resolve_buffer_policy(module: torch.nn.Module, policy: dict[str, str]) -> dict[str, str]:
    """Return {buffer name: rule} for every buffer of `module`; UsageError on undeclared buffers or bad rules."""
    where = f"{type(module).__name__}'s BUFFER_POLICY"     # the runner's modules are ActorCritic, RewardNormalizer
    bad = {p: r for p, r in policy.items() if r not in RULES}
    if bad:
        raise UsageError(f"unknown buffer rules {bad} in {where}; use one of {RULES}")
    resolved, undeclared = {}, []
    for name, _ in module.named_buffers():
        rules = [r for pattern, r in policy.items() if fnmatch(name, pattern)]
        if not rules:
            undeclared.append(name)
        elif len(set(rules)) > 1:
            raise UsageError(f"buffer {name!r} matches patterns with different rules {sorted(set(rules))} in {where}; "
                             f"give those patterns one rule, or narrow one so that it no longer matches")
        else:
            resolved[name] = rules[0]
    if undeclared:
        raise UsageError(f"buffers without a sync rule: {undeclared}; declare each as one of {RULES} in {where}")
    buffers = dict(module.named_buffers())
    integer_means = [n for n, r in resolved.items() if r == "mean" and not buffers[n].is_floating_point()]
    if integer_means:
        raise UsageError(f"buffers {integer_means} are integer but declared `mean`: an average of counts is not an "
                         f"integer; declare them `broadcast` (e.g. BatchNorm's num_batches_tracked) or `local` in "
                         f"{where}")
    saved = set(module.state_dict())
    unsaved = [n for n, r in resolved.items() if r != "local" and n not in saved]
    if unsaved:
        raise UsageError(f"buffers {unsaved} are registered with persistent=False but declared synced: checkpoints and "
                         f"the rollout ranks' weight sync (state_dict) leave them out, so a resumed run or a rollout "
                         f"copy would silently keep another value; register them persistent, or declare them `local` "
                         f"in {where} (a constant every rank builds alike)")
    return resolved


def sync_buffers(module: torch.nn.Module, resolved: dict[str, str]) -> None:
    """Apply the `broadcast` and `mean` rules (merge and local need nothing here).

    Crosses ranks: per dtype, one coalesced broadcast of all `broadcast` buffers and one coalesced
    all-reduce of all `mean` buffers; nothing when no buffer has those rules. The runner calls this
    once per iteration, after the update.
    """
    buffers = dict(module.named_buffers())
    for rule in ("broadcast", "mean"):
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for name, r in resolved.items():
            if r == rule:
                by_dtype.setdefault(buffers[name].dtype, []).append(buffers[name])
        for group in by_dtype.values():
            flat = torch.cat([b.reshape(-1) for b in group]).to(comm.device())
            if rule == "broadcast":
                comm.broadcast(flat, "buffers", src=0)
            else:
                comm.all_reduce(flat, "buffers").div_(comm.world_size())
            offset = 0
            for b in group:
                b.copy_(flat[offset:offset + b.numel()].view_as(b))
                offset += b.numel()


def buffer_plan_rows(module: torch.nn.Module, resolved: dict[str, str]) -> list[PlanRow]:
    """The sync-plan rows of sync_buffers: per rule, the bytes of each per-dtype collective (none if unused)."""
    buffers = dict(module.named_buffers())
    rows = []
    for rule, collective, text in (("broadcast", "broadcast", "broadcast from rank 0"),
                                   ("mean", "all_reduce", "mean over ranks")):
        by_dtype: dict[torch.dtype, int] = {}
        for name, r in resolved.items():
            if r == rule:
                b = buffers[name]
                by_dtype[b.dtype] = by_dtype.get(b.dtype, 0) + b.numel() * b.element_size()
        if by_dtype:
            rows.append(PlanRow("buffers", text, collective, "iteration", list(by_dtype.values())))
    return rows
