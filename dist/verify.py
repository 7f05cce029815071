"""Cross-rank check that replicas really are identical: an exact, order-sensitive checksum."""

import torch

from dist import comm
from dist.checksum import checksum  # the one checksum, shared with sync/
from dist.plan import PlanRow


def verify_replicas(module: torch.nn.Module, what: str = "parameters") -> None:
    """Raise, naming the ranks that differ from rank 0, if parameters are not bit-identical everywhere.

    Crosses ranks: one all-gather of a single int64 per rank. Called every --dist.verify-every
    iterations and after every checkpoint load.
    """
    local = checksum(module.parameters()).reshape(1).to(comm.device())
    gathered = comm.all_gather(local, "checksum").cpu().flatten()
    diverged = [r for r in range(gathered.numel()) if gathered[r] != gathered[0]]
    if diverged:
        raise RuntimeError(f"{what} diverged across ranks: rank(s) {diverged} differ from rank 0 "
                           f"(checksums {gathered.tolist()}); something updated one replica without the others")


def verify_plan_rows(every: int, after_load: bool) -> list[PlanRow]:
    """The sync-plan rows of verify_replicas: every K iterations, and once after a checkpoint load."""
    rows = [PlanRow("checksum", "all ranks equal rank 0", "all_gather", "every", [8], every=every)] if every else []
    if after_load:
        rows.append(PlanRow("checksum", "verify after load", "all_gather", "setup", [8]))
    return rows
