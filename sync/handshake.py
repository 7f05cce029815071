"""The tensors a syncer reads from a model or state_dict, and the init handshake's document: what sender and
receivers must agree on for the wire format to line up, and the reasons a receiver cannot take the sender's
updates. Nothing here crosses ranks (Link.agree sends the document)."""

from typing import Mapping, Sequence

import torch

from .config import WeightSyncConfig, config_fields, is_int
from .wire import FORMAT


def trainable_keys(module: torch.nn.Module) -> list[str]:
    """State-dict keys of parameters with requires_grad and of persistent buffers: what changes in training."""
    frozen = {name for name, p in module.named_parameters(remove_duplicate=False) if not p.requires_grad}
    return [k for k in module.state_dict() if k not in frozen]


def tensors_of(model) -> dict:
    if isinstance(model, torch.nn.Module):
        return model.state_dict()  # detached tensors sharing the module's memory
    if isinstance(model, Mapping):
        return {k: (v.detach() if isinstance(v, torch.Tensor) else v) for k, v in model.items()}
    raise TypeError(f"weight sync: expected an nn.Module or a state_dict, got {type(model).__name__}")


def describe(tensors: dict, cfg: WeightSyncConfig) -> dict:
    """The handshake document of `tensors` (JSON): keys, shapes, dtypes, tied keys, the sync config, and what
    cannot be synced (values that are not tensors, tensors that are not contiguous)."""
    not_tensors = [k for k, t in tensors.items() if not isinstance(t, torch.Tensor)]
    groups: dict = {}  # tied weights: keys whose tensors are the same memory
    for key, t in tensors.items():
        if key not in not_tensors and t.numel():
            place = (t.device, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
            groups.setdefault(place, []).append(key)
    return {
        "format": FORMAT, "config": config_fields(cfg), "keys": list(tensors),
        "shapes": [list(t.shape) if isinstance(t, torch.Tensor) else [] for t in tensors.values()],
        "dtypes": [str(t.dtype) if isinstance(t, torch.Tensor) else "?" for t in tensors.values()],
        "ties": [g for g in groups.values() if len(g) > 1], "not_tensors": not_tensors,
        "not_contiguous": [k for k, t in tensors.items() if k not in not_tensors and not t.is_contiguous()],
    }


def format_mismatch(sender, receiver) -> str | None:
    """Why peers of these wire formats cannot sync (None: they can). A build before format 2 names none, so each
    side checks the other's: the sender the receiver's document, the receiver the sender's reply."""
    if sender == receiver:
        return None
    return f"wire format {receiver} on the receiver, {sender} on the sender: run the same syncppo version on both sides"


def sender_problems(tensors: dict, keys, version, problems=()) -> tuple[list[str], list[str]]:
    """(the keys to sync, the reasons the sender's own arguments cannot start a sync: `problems` and these)."""
    problems = list(problems) + [f"version must be an integer, got {version!r}"] * (not is_int(version))
    if isinstance(keys, (str, bytes)):  # list() would sync its characters
        problems.append(f"keys must be a list of state_dict keys, got the string {keys!r}")
    keys = list(tensors) if keys is None or isinstance(keys, (str, bytes)) else list(keys)
    if set(keys) - set(tensors):
        problems.append(f"keys to sync not in the sender's state_dict: {sorted(set(keys) - set(tensors))}")
    if not keys:
        problems.append("the list of keys to sync is empty")
    return keys, problems


def compare(sender: dict, receiver: dict) -> list[str]:
    """Reasons the receiver's metadata cannot take the sender's updates (empty when it can)."""
    mismatch = format_mismatch(sender.get("format"), receiver.get("format"))
    if mismatch:
        return [mismatch]
    if receiver["config"] != sender["config"]:
        diff = {k: (v, receiver["config"][k]) for k, v in sender["config"].items() if v != receiver["config"][k]}
        return [f"weight sync config differs from the sender's, by field (sender, receiver): {diff}"]
    problems = [f"{what} on the {side}: {meta[what]}" for side, meta in (("sender", sender), ("receiver", receiver))
                for what in ("not_tensors", "not_contiguous") if meta[what]]
    missing = [k for k in sender["keys"] if k not in receiver["keys"]]
    unexpected = [k for k in receiver["keys"] if k not in sender["keys"]]
    if missing or unexpected:
        return problems + [f"state_dict keys differ: missing on the receiver {missing}, unexpected on the receiver "
                           f"{unexpected}"]
    mine = dict(zip(sender["keys"], zip(sender["shapes"], sender["dtypes"])))
    for key, shape, dtype in zip(receiver["keys"], receiver["shapes"], receiver["dtypes"]):
        if shape != mine[key][0]:
            problems.append(f"{key!r} has shape {shape} on the receiver and {mine[key][0]} on the sender")
        elif dtype != mine[key][1] and not all(named_dtype(d).is_floating_point for d in (dtype, mine[key][1])):
            problems.append(f"{key!r} is {dtype} on the receiver and {mine[key][1]} on the sender "
                            "(only floating dtypes may differ)")
    if sorted(receiver["ties"]) != sorted(sender["ties"]):
        problems.append(f"tied keys differ: sender {sender['ties']}, receiver {receiver['ties']}")
    return problems


def receiver_problems(sender: dict, receivers: list, ranks: Sequence[int]) -> list[str]:
    """Why the receivers' documents (None: one that arrived corrupted) cannot take the sender's updates, by rank: each
    against the sender's, and each against the first intact one (one syncer serves identical receivers)."""
    intact = [(rank, meta) for rank, meta in zip(ranks, receivers) if meta is not None]
    problems = []
    for rank, meta in zip(ranks, receivers):
        if meta is None:     # still replied to, with the refusal, so that the receiver does not wait
            problems.append(f"receiver rank {rank}: its handshake document arrived corrupted; create the syncers again")
            continue
        problems += [f"receiver rank {rank}: {p}" for p in compare(sender, meta)]
        if any(meta[field] != intact[0][1][field] for field in ("keys", "shapes", "dtypes", "ties")):
            problems.append(f"receiver rank {rank} differs from receiver rank {intact[0][0]} in key order, shapes, "
                            "dtypes or tied keys; one syncer serves identical receivers (use one per kind)")
    return problems


def named_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"weight sync: unknown dtype {name!r} in metadata")
    return dtype
