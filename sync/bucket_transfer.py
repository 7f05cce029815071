"""Whole tensors in size-capped buckets: the bucket strategy, the patch bootstrap and every resync.

Both sides derive the same bucket plan from the agreed keys, shapes and wire dtypes, so a bucket
travels as a fixed header plus its bytes and nothing else.
"""

from typing import Callable, Sequence

import torch

from .transport import (HEADER_BYTES, KIND_BUCKET, Header, SyncIntegrityError, isend_all, pack, recv_bytes,
                        recv_header, unpack, wait_all)


def plan_buckets(nbytes: Sequence[int], bucket_size: int) -> list[list[int]]:
    """Consecutive runs of tensor indices, each at most `bucket_size` bytes unless a single tensor is larger.

    An empty list still gets one (empty) bucket, so that every update carries at least one header.
    """
    buckets, current, size = [], [], 0
    for index, n in enumerate(nbytes):
        if current and size + n > bucket_size:
            buckets.append(current)
            current, size = [], 0
        current.append(index)
        size += n
    if current or not buckets:
        buckets.append(current)
    return buckets


def send_buckets(items: Sequence[tuple[torch.Tensor, torch.dtype]], bucket_size: int, version: int,
                 dsts: Sequence[int], group, device) -> tuple[int, int]:
    """Send each (tensor, wire dtype) whole, in order, to every receiver; returns (wire, payload) bytes per receiver.

    Crosses ranks: per bucket, a 64-byte header and the bucket's bytes, to each receiver; once per bucket
    sync, bootstrap or resync. Bucket b+1 is packed while bucket b is still in flight, and at most two
    buckets are alive at a time, so the sender never holds a second copy of the whole model.
    """
    plan = plan_buckets([t.numel() * dtype.itemsize for t, dtype in items], bucket_size)
    payload_bytes, in_flight = 0, ([], ())
    for index, members in enumerate(plan):
        payload = pack([items[i][0].detach().to(items[i][1]).reshape(-1) for i in members], device)
        header = Header(KIND_BUCKET, version, -1, index, payload.numel(), payload.numel(), len(plan)).to_tensor(device)
        works = isend_all([header, payload], dsts, group)
        wait_all(in_flight[0])
        in_flight = (works, (header, payload))  # the tensors must outlive their sends
        payload_bytes += payload.numel()
    wait_all(in_flight[0])
    return HEADER_BYTES * len(plan) + payload_bytes, payload_bytes


def recv_buckets(items: Sequence[tuple[str, tuple, torch.dtype]], bucket_size: int, src: int, group, device,
                 on_bucket: Callable[[list[tuple[str, torch.Tensor]]], None]) -> int:
    """Receive the buckets `send_buckets` sent for these (key, shape, wire dtype) items; returns the version.

    Crosses ranks: per bucket, a 64-byte header and the bucket's bytes from `src`; once per send_buckets.

    Calls `on_bucket([(key, flat typed view), ...])` as each bucket arrives; the views share the bucket's
    buffer, so `on_bucket` either copies them into the model or keeps them.
    """
    sizes = [int(torch.Size(shape).numel()) for _, shape, _ in items]
    plan = plan_buckets([n * dtype.itemsize for n, (_, _, dtype) in zip(sizes, items)], bucket_size)
    version = None
    for index, members in enumerate(plan):
        header = recv_header(src, group, device, KIND_BUCKET)
        specs = [(items[i][2], sizes[i]) for i in members]
        expected = sum(dtype.itemsize * n for dtype, n in specs)
        if (header.count, header.total, header.raw_bytes, header.wire_bytes) != (index, len(plan), expected, expected) \
                or version not in (None, header.version):
            raise SyncIntegrityError(
                f"weight sync: bucket header {header} does not match the expected bucket {index} of {len(plan)} "
                f"with {expected} bytes at version {version}; sender and receiver disagree on the bucket plan")
        payload = recv_bytes(header.wire_bytes, src, group, device)
        on_bucket([(items[i][0], view) for i, view in zip(members, unpack(payload, specs))])
        version = header.version
    return version


def copy_into(tensors: dict, pairs: Sequence[tuple[str, torch.Tensor]]) -> None:
    """Write received flat values into the model's tensors (converting the wire dtype to the model's)."""
    with torch.no_grad():
        for key, value in pairs:
            tensors[key].copy_(value.view(tensors[key].shape))
