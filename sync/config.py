"""Weight-sync configuration: dataclasses whose fields mirror RLinf's `weight_syncer` YAML. Both sides of a
transfer must build the same config: the handshake compares them, because the wire format depends on it."""

import json
from dataclasses import asdict, dataclass, field, fields, is_dataclass
from typing import Literal, Optional, get_args, get_origin

import torch

BUCKET_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class InitSyncConfig:
    enabled: bool = True
    """send the receivers a bucketed copy of the state_dict once at init, before the first patch"""
    prefixes: Optional[tuple[str, ...]] = None
    """keys to bootstrap: None = the whole state_dict (frozen parameters and persistent buffers included), else keys equal to or under one of these prefixes"""
    bucket_size: int = 128 * 2**20
    """largest bootstrap bucket in bytes (a bigger tensor travels alone)"""

    def __post_init__(self):
        _check_fields(self, "patch.init_sync.")
        if self.prefixes is not None:
            if isinstance(self.prefixes, str):
                raise ValueError(f"patch.init_sync.prefixes must be a list of key prefixes, got the string {self.prefixes!r}")
            self.prefixes = tuple(self.prefixes)
            if not self.prefixes or any(not isinstance(p, str) or not p for p in self.prefixes):
                raise ValueError(f"patch.init_sync.prefixes must be None or non-empty strings, got {self.prefixes!r}")


@dataclass
class PatchConfig:
    snapshot_device: Literal["cpu", "cuda"] = "cpu"
    """where the sender keeps its snapshot (cpu: pinned host memory when the weights are on a GPU, saves one model copy of GPU memory)"""
    transport_device: Literal["cpu", "cuda"] = "cpu"
    """where patches are staged for sending: cpu for gloo, cuda for NCCL"""
    compression: Literal["none", "zstd"] = "none"
    """lossless codec for the patch payload; zstd needs `pip install zstandard` and transport_device=cpu"""
    verify_every: int = 100
    """the receiver rescans every synced tensor against its checksum every K versions (0 = only verify() on demand)"""
    init_sync: InitSyncConfig = field(default_factory=InitSyncConfig)
    """one-off bucketed bootstrap before the first patch"""

    def __post_init__(self):
        _check_fields(self, "patch.")
        if self.compression == "zstd" and self.transport_device != "cpu":
            raise ValueError("patch.compression=zstd runs on the host: set patch.transport_device=cpu")


@dataclass
class BucketConfig:
    bucket_size: int = 512 * 2**20
    """largest bucket in bytes (a bigger tensor travels alone)"""
    bucket_dtype: Literal[None, "float32", "bfloat16", "float16"] = None
    """wire dtype for floating tensors (ints and bools keep theirs); None = the receiver's dtype, which is exact (float16 overflows past 65504)"""
    bucket_device: Literal["cpu", "cuda"] = "cpu"
    """where buckets are packed: cpu for gloo, cuda for NCCL"""
    load_instant: bool = True
    """apply each bucket as it arrives (less receiver memory); False stages all buckets and applies at the end"""

    def __post_init__(self):
        _check_fields(self, "bucket.")


@dataclass
class WeightSyncConfig:
    type: Literal["patch", "bucket"] = "patch"
    """patch: send only the elements that changed since the last sync; bucket: send whole tensors every time"""
    patch: PatchConfig = field(default_factory=PatchConfig)
    """settings used when type=patch"""
    bucket: BucketConfig = field(default_factory=BucketConfig)
    """settings used when type=bucket"""

    def __post_init__(self):
        _check_fields(self, "")


def _check_fields(section, prefix: str) -> None:
    """Each field of a config section (named `prefix` + its name) by its annotation: a Literal's value must be one
    of its choices, a bool true or false, an int a positive number of bytes (verify_every: an integer >= 0), and a
    nested section of its class (a string "false" would read as true; a YAML mapping fails later, or hangs init)."""
    for f in fields(section):
        name, value, kind = prefix + f.name, getattr(section, f.name), f.type
        if get_origin(kind) is Literal and value not in get_args(kind):
            choices = ", ".join(map(repr, get_args(kind)))
            raise ValueError(f"weight sync config: {name}={value!r} is not one of {choices}")
        if kind is int:
            low, what = (0, "an integer >= 0") if f.name == "verify_every" else (1, "a positive number of bytes")
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"weight sync config: {name} must be {what}, got {value!r}")
        if (kind is bool or is_dataclass(kind)) and not isinstance(value, kind):
            article = "an " if kind.__name__[0] in "AEIOU" else "a "
            wanted = "true or false" if kind is bool else article + kind.__name__
            raise ValueError(f"weight sync config: {name} must be {wanted}, got {value!r}")


def under_prefix(key: str, prefix: str) -> bool:
    """Whether state_dict `key` is `prefix` or a key under it (patch.init_sync.prefixes)."""
    return key == prefix or key.startswith(prefix + ".")


def is_int(value) -> bool:
    """An int that fits the wire's int64 (a float, bool, tensor or None is not a version or a rank)."""
    return isinstance(value, int) and not isinstance(value, bool) and -2**63 <= value < 2**63


def check_config(cfg: WeightSyncConfig) -> None:
    """Every section's checks again: the dataclasses are mutable, and a field set after construction was not checked."""
    if not isinstance(cfg, WeightSyncConfig):
        raise TypeError(f"weight sync needs a WeightSyncConfig, got {type(cfg).__name__}")
    for section in (cfg, cfg.patch, cfg.patch.init_sync, cfg.bucket):  # each checks the type of the next ones
        section.__post_init__()


def config_fields(cfg: WeightSyncConfig) -> dict:
    """Every field of `cfg` by dotted name (`patch.verify_every`), as JSON gives it back: what the handshake compares,
    so that a difference names its field."""
    fields, todo = {}, list(json.loads(json.dumps(asdict(cfg))).items())
    for name, value in todo:  # a section's fields, appended, are visited after the fields before them, as before
        if isinstance(value, dict):
            todo += [(f"{name}.{k}", v) for k, v in value.items()]
        else:
            fields[name] = value
    return fields
