"""dist.comm's point-to-point calls (send, isend, recv, irecv, recv_then_count) between simulated ranks of one
process: the test says which rank is calling (`wire.me`). A receive is matched to its peer's messages in posting
order and must be exactly the size of the message it meets, as in gloo; the bytes are copied as they are. Sync and
batch transport checks in milliseconds, where gloo processes take seconds (slow tests)."""

import torch

from dist import comm


class Work:
    def __init__(self, filled: list):
        self.filled, self.waited = filled, False

    def wait(self):
        if not self.filled[0]:
            raise RuntimeError("wire: a receive waited for with no message from its peer (it would wait for ever)")
        self.waited = True


def _deliver(message: torch.Tensor, into: torch.Tensor) -> None:
    sent, received = message.reshape(-1).view(torch.uint8), into.reshape(-1).view(torch.uint8)
    if sent.numel() != received.numel():
        raise RuntimeError(f"wire: a {received.numel()}-byte receive met a {sent.numel()}-byte message")
    received.copy_(sent)


class Wire:
    """Installs itself in dist.comm; `me` is the calling rank, `posted` counts receives posted, `sends` holds the
    sends' work handles (waited for or not)."""

    def __init__(self, monkeypatch):
        self.me, self.queued, self.pending, self.posted, self.sends = 0, {}, {}, 0, []
        for name in ("send", "isend", "recv", "irecv", "recv_then_count"):
            monkeypatch.setattr(comm, name, getattr(self, name))

    def unread(self) -> int:
        """Messages sent that no receive has taken."""
        return sum(map(len, self.queued.values()))

    def isend(self, tensor, purpose, dst, group=None):
        key = (self.me, dst)
        if self.pending.get(key):
            into, filled = self.pending[key].pop(0)
            _deliver(tensor, into)
            filled[0] = True
        else:
            self.queued.setdefault(key, []).append(tensor.detach().clone())
        work = Work([True])
        self.sends.append(work)
        return work

    def send(self, tensor, purpose, dst, group=None):
        self.isend(tensor, purpose, dst, group).wait()

    def irecv(self, tensor, purpose, src, group=None):
        key, filled = (src, self.me), [False]
        self.posted += 1
        if self.queued.get(key):
            _deliver(self.queued[key].pop(0), tensor)
            filled[0] = True
        else:
            self.pending.setdefault(key, []).append((tensor, filled))
        return Work(filled)

    def recv(self, tensor, purpose, src, group=None):
        self.irecv(tensor, purpose, src, group).wait()
        return tensor

    def recv_then_count(self, tensor, purpose_of, src, group=None):
        return self.recv(tensor, None, src, group)
