"""The sync plan: every collective the learner will issue for a configuration, declared up front.

Each component that communicates declares its own rows next to the code that communicates
(`GradSync.plan_rows`, `merge_plan_row`, `buffer_plan_rows`, ...); the runner only concatenates them.
Rank 0 prints it at start-up (`train.py PRESET --dry-run` prints it without training). Each row is
one piece of state with its rule, collective, cadence, and the bytes of each call. `expected_ledger`
turns the plan into call/byte counts after some iterations, which tests compare with what
`dist.comm.LEDGER` actually recorded: the printed plan cannot drift from the code.
"""

from dataclasses import dataclass, field


@dataclass
class PlanRow:
    purpose: str
    rule: str
    collective: str          # "-" when nothing crosses ranks (state kept identical by construction)
    cadence: str = "-"       # "setup", "iteration", "every", "checkpoint" or "-"
    call_bytes: list[int] = field(default_factory=list)   # bytes of each call in one round
    rounds: int = 1          # rounds per occurrence (e.g. optimizer steps per iteration)
    every: int = 1           # K for cadence "every"; the save interval for "checkpoint"
    all_ranks: bool = False  # a collective over every rank, not the current group (the learners with rollout ranks)

    @property
    def calls(self) -> int:
        return len(self.call_bytes) * self.rounds

    def occurrences(self, iterations: int, final_iteration: int | None = None, start: int = 0) -> int:
        """How often the row runs in iterations start+1 .. start+iterations (a resumed run starts past 0); "every"
        and "checkpoint" rows run after iteration k when k is a multiple of `every`."""
        if self.cadence == "setup":
            return 1
        if self.cadence == "iteration":
            return iterations
        if self.cadence in ("every", "checkpoint"):
            n = (start + iterations) // self.every - start // self.every
            if self.cadence == "checkpoint" and final_iteration is not None and final_iteration % self.every:
                n += 1      # a checkpoint is always written at the end of the run
            return n
        return 0


COLLECTIVES = ("all_reduce", "broadcast", "all_gather", "gather")


def expected_ledger(rows: list[PlanRow], iterations: int, final_iteration: int | None = None,
                    collectives: bool = True, start: int = 0) -> dict[str, list[int]]:
    """{purpose: [calls, bytes]} the plan predicts after the set-up and `iterations` iterations from iteration
    `start` (a resumed run's checkpoint).

    `collectives=False` for a rank whose collective group has one member: they are no-ops there, while
    its point-to-point messages and the collectives over all ranks still cross (at world size 1 nothing does:
    compare no ledger there)."""
    out: dict[str, list[int]] = {}
    for row in rows:
        if not collectives and row.collective in COLLECTIVES and not row.all_ranks:
            continue
        n = row.occurrences(iterations, final_iteration, start)
        if n and row.calls:
            entry = out.setdefault(row.purpose, [0, 0])
            entry[0] += n * row.calls
            entry[1] += n * row.rounds * sum(row.call_bytes)
    return out


def _size(n: int) -> str:
    for unit in ("B", "KB", "MB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GB"


def format_plan(rows: list[PlanRow], world_size: int, collective_size: int | None = None) -> str:
    """The plan as a table; more than 4 messages of a row are summed (`21 messages, 36.2 KB in all`). `collective_size`:
    the ranks of the group the collectives run in, when not all of them (the learners, with rollout ranks)."""
    if world_size == 1:
        note = "; at world size 1 none of these collectives runs: the rows say what they carry on more ranks"
    elif collective_size == 1:
        note = ("; one learner: its collectives run in a group of one, so only those over all ranks and point-to-point "
                "messages cross")
    else:
        note = ""
    table = [("state", "rule", "collective", "cadence", "calls", "bytes per call")]
    for r in rows:
        cadence = {"every": f"every {r.every} it", "checkpoint": "at saves"}.get(r.cadence, r.cadence)
        if not r.call_bytes:
            sizes = "-"
        elif len(r.call_bytes) > 4:
            sizes = f"{len(r.call_bytes)} messages, {_size(sum(r.call_bytes))} in all"
        else:
            sizes = " + ".join(_size(b) for b in r.call_bytes)
        if r.call_bytes and r.rounds > 1:
            sizes += f"  (x{r.rounds} steps)"
        collective = f"{r.collective} (all ranks)" if r.all_ranks and collective_size not in (None, world_size) \
            else r.collective
        table.append((r.purpose, r.rule, collective, cadence, str(r.calls), sizes))
    widths = [max(len(row[i]) for row in table) for i in range(5)]
    lines = [f"sync plan ({world_size} rank{'s' if world_size > 1 else ''}{note})"]
    for row in table:
        lines.append("  " + " ".join(f"{c:<{w}}" if i < 4 else f"{c:>{w}}" for i, (c, w) in enumerate(zip(row, widths)))
                     + "  " + row[5])
    return "\n".join(lines)
