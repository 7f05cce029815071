"""Lossless codecs for the patch payload (host side): `none` and `zstd` (optional `zstandard` package)."""

import torch

_ZSTD_LEVEL = 3  # zstd's own default: most of the ratio at a few hundred MB/s on one core


def require_codec(name: str) -> None:
    """Fail at construction, not at the first sync, when the codec's package is missing."""
    if name == "zstd":
        _zstd()


def compress(name: str, payload: torch.Tensor) -> torch.Tensor:
    """uint8 CPU tensor -> uint8 CPU tensor."""
    if name == "none":
        return payload
    return _to_tensor(_zstd().ZstdCompressor(level=_ZSTD_LEVEL).compress(payload.numpy().tobytes()))


def decompress(name: str, data: torch.Tensor, raw_bytes: int) -> torch.Tensor:
    """Inverse of `compress`; raises ValueError when the data is not a valid frame of `raw_bytes` bytes."""
    if name == "none":
        return data
    try:
        raw = _zstd().ZstdDecompressor().decompress(data.cpu().numpy().tobytes(), max_output_size=raw_bytes)
    except Exception as error:  # zstandard raises its own ZstdError
        raise ValueError(f"zstd could not decompress the patch payload: {error}") from error
    if len(raw) != raw_bytes:
        raise ValueError(f"zstd produced {len(raw)} bytes, the header announced {raw_bytes}")
    return _to_tensor(raw)


def _to_tensor(data: bytes) -> torch.Tensor:
    if not data:  # frombuffer refuses an empty buffer
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def _zstd():
    try:
        import zstandard
    except ImportError as error:
        raise ImportError("weight sync: patch.compression=zstd needs the zstandard package: pip install zstandard") from error
    return zstandard
