"""Cross-rank check that replicas really are identical: an exact, order-sensitive checksum."""

import torch

from . import comm
from .checksum import checksum  # the one checksum, shared with sync/
from .plan import PlanRow


def verify_replicas(module: torch.nn.Module, what: str = "parameters") -> None:
    """Raise, naming the ranks that differ from the most (then lowest-ranked) of the ranks that agree, if parameters
    are not bit-identical everywhere: with rank 0 alone against two others, rank 0 is the one named.

    Crosses ranks: one all-gather of a single int64 per rank. Called every --dist.verify-every
    iterations and after every checkpoint load.
    """
    local = checksum(module.parameters()).reshape(1).to(comm.device())
    gathered = comm.all_gather(local, "checksum").cpu().flatten()
    sums = gathered.tolist()
    groups: dict[int, list[int]] = {}
    for rank, value in enumerate(sums):
        groups.setdefault(value, []).append(rank)
    if len(groups) > 1:
        agree = max(groups.values(), key=len)   # the first of the largest: ties go to rank 0's group
        diverged = [r for r in range(len(sums)) if r not in agree]
        raise RuntimeError(f"{what} diverged across ranks: rank(s) {diverged} differ from rank(s) {agree} "
                           f"(checksums {sums}); something updated some replicas without the others")


def verify_plan_rows(every: int, after_load: bool) -> list[PlanRow]:
    """The sync-plan rows of verify_replicas: every K iterations, and once after a checkpoint load."""
    rows = [PlanRow("checksum", "all ranks equal rank 0", "all_gather", "every", [8], every=every)] if every else []
    if after_load:
        rows.append(PlanRow("checksum", "verify after load", "all_gather", "setup", [8]))
    return rows
