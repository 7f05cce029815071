"""Cross-rank checks that what must be identical everywhere is: replicas, or a list of names (the metrics'), each by
an exact, order-sensitive checksum."""

from typing import Sequence

import torch

from . import comm
from .checksum import checksum  # the one checksum, shared with sync/
from .plan import PlanRow


class _Diverged(RuntimeError):
    pass


def verify_replicas(module: torch.nn.Module, what: str = "parameters", buffer_rules: dict[str, str] | None = None,
                    also: Sequence[tuple[torch.nn.Module, dict[str, str]]] = ()) -> None:
    """Raise, naming the ranks that differ from the most (then lowest-ranked) of the ranks that agree, and the tensors
    that differ, if parameters (and the buffers `buffer_rules` declares `broadcast`, `mean` or `merge`: they must be
    equal everywhere too, e.g. the normalizers' statistics) are not bit-identical everywhere: with rank 0 alone against
    two others, rank 0 is the one named. `local` buffers differ by design and are not checked. `also`: more (module,
    buffer rules) pairs checked alike in the same checksum, their tensors named `ClassName.name` (e.g. the reward
    normalizer, which is not part of the model).

    Crosses ranks: one all-gather of a single int64 per rank. Called every --dist.verify-every
    iterations and after every checkpoint load. Only when that finds a divergence (every rank sees it, so all
    take this path), one more of an int64 per rank (the tensors' names, shapes and dtypes: ranks holding other
    tensors are named as such), then one of an int64 per checked tensor, to name them before the run stops.
    """
    named = _checked(module, buffer_rules or {}, "")
    for other, rules in also:
        named += _checked(other, rules, f"{type(other).__name__}.")
    try:
        same_everywhere(checksum([t.detach() for _, t in named]), "checksum", f"{what} diverged across ranks",
                        "something updated some replicas without the others", _Diverged)
    except _Diverged as exc:
        diverged = str(exc)
    else:
        return
    # Other tensors on some rank (an extra head, another shape) cannot be compared one by one: the per-tensor
    # all-gather below then differs in length, and gloo aborted a rank there while the others waited out the timeout.
    same_names_everywhere([f"{n} {list(t.shape)} {t.dtype}" for n, t in named], "checksum",
                          f"{what} are not the same tensors (names, shapes, dtypes) on every rank",
                          f"the ranks built other modules (this rank checks {len(named)} tensors)")
    raise RuntimeError(f"{diverged}; tensors that differ: {differing_tensors(named, 'checksum')}")


def _checked(module: torch.nn.Module, rules: dict[str, str], prefix: str) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) of the parameters and the buffers whose rule is not `local`, names prefixed."""
    buffers = [(n, b) for n, b in module.named_buffers() if rules.get(n, "local") != "local"]
    return [(prefix + n, t) for n, t in [*module.named_parameters(), *buffers]]


def differing_tensors(named: Sequence[tuple[str, torch.Tensor]], purpose: str) -> list[str]:
    """The names of the tensors whose checksum differs from rank 0's on some rank, for an error that a cheaper check
    (one checksum of them all) already found. Crosses ranks once: one all-gather of an int64 per tensor, for
    `purpose`; every rank must call it (they all saw the difference)."""
    per = comm.all_gather(torch.stack([checksum([t.detach()]) for _, t in named]).to(comm.device()), purpose).cpu()
    return [n for i, (n, _) in enumerate(named) if bool((per[:, i] != per[0, i]).any())]


def same_everywhere(local: torch.Tensor, purpose: str, what: str, why: str, error=RuntimeError) -> None:
    """Raise `error` (`what`: rank(s) ... differ from rank(s) ... (checksums ...); `why`) when this 0-d int64 `local`
    is not the same on every rank, naming the ranks that differ from the most (then lowest-ranked) agreeing ones.

    Crosses ranks: one all-gather of a single int64 per rank, for `purpose`."""
    sums = comm.all_gather(local.reshape(1).to(comm.device()), purpose).cpu().flatten().tolist()
    groups: dict[int, list[int]] = {}
    for rank, value in enumerate(sums):
        groups.setdefault(value, []).append(rank)
    if len(groups) > 1:
        agree = max(groups.values(), key=len)   # the first of the largest: ties go to rank 0's group
        diverged = [r for r in range(len(sums)) if r not in agree]
        raise error(f"{what}: rank(s) {diverged} differ from rank(s) {agree} (checksums {sums}); {why}")


def verify_plan_rows(every: int, after_load: bool) -> list[PlanRow]:
    """The sync-plan rows of verify_replicas: every K iterations, and once after a checkpoint load."""
    rows = [PlanRow("checksum", "all ranks equal rank 0", "all_gather", "every", [8], every=every)] if every else []
    if after_load:
        rows.append(PlanRow("checksum", "verify after load", "all_gather", "setup", [8]))
    return rows


def same_names_everywhere(names: Sequence[str], purpose: str, what: str, why: str, error=RuntimeError) -> None:
    """same_everywhere for a list of names (their UTF-8 bytes, one per line): e.g. the metric names, which must line
    up in a packed all-reduce. Crosses ranks once: one all-gather of an int64 per rank."""
    same_everywhere(names_checksum(names), purpose, what, why, error)


def names_checksum(names: Sequence[str]) -> torch.Tensor:
    """The checksum of a list of names: their UTF-8 bytes, one per line."""
    return checksum([torch.tensor(list("\n".join(names).encode()), dtype=torch.uint8)])


def names_plan_row(purpose: str) -> PlanRow:
    return PlanRow(purpose, "same names everywhere", "all_gather", "setup", [8])
