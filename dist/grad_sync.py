"""Gradient averaging across ranks without a DDP wrapper.

`FlatGradSync` (mode `flat`): every parameter's `.grad` is a view into one contiguous buffer, so the
whole gradient is averaged by a single all-reduce with no packing copy. A few float32 scalars
(e.g. the KL sum and count of the adaptive-LR rule) ride at the end of the same buffer, saving a
separate collective.

Usage per optimizer step (the gradient of the whole minibatch, possibly accumulated over
micro-batches with no communication in between):

    sync.zero_grad()
    loss.backward()                      # accumulate locally, as often as needed
    extras = sync.synchronize(extras)    # one all-reduce: grads averaged, extras summed
    norm = sync.clip_(max_norm)          # on the synchronized global gradient
    optimizer.step()
"""

import torch

from dist import comm


class FlatGradSync:
    def __init__(self, params: list[torch.nn.Parameter], num_extras: int = 0):
        self.params = [p for p in params if p.requires_grad]
        if not self.params:
            raise ValueError("FlatGradSync needs at least one parameter that requires grad")
        dtypes = {p.dtype for p in self.params}
        if len(dtypes) != 1:
            raise ValueError(f"flat gradient sync needs one parameter dtype, got {sorted(map(str, dtypes))}")
        self.num_grads = sum(p.numel() for p in self.params)
        self.num_extras = num_extras
        self.buffer = torch.zeros(self.num_grads + num_extras, dtype=self.params[0].dtype,
                                  device=self.params[0].device)
        self.flat_grad = self.buffer[:self.num_grads]
        offset = 0
        for p in self.params:
            # Autograd accumulates into an existing .grad in place, so the view survives every backward.
            p.grad = self.buffer[offset:offset + p.numel()].view_as(p)
            offset += p.numel()

    def zero_grad(self) -> None:
        """Zero the gradient buffer (never set grads to None: that would detach the views)."""
        self.buffer.zero_()

    def synchronize(self, extras: torch.Tensor | None = None) -> torch.Tensor:
        """Average the gradients over ranks and sum `extras` ([num_extras]) over ranks; return the summed extras.

        Crosses ranks: one all-reduce (SUM) of num_params + num_extras values per optimizer step, then a
        local scale by 1 / world size (gloo has no AVG). Every rank ends with bit-identical gradients.
        """
        if self.num_extras:
            if extras is None or extras.numel() != self.num_extras:
                raise ValueError(f"synchronize expects {self.num_extras} extra scalars, got "
                                 f"{None if extras is None else extras.numel()}")
            self.buffer[self.num_grads:] = extras.detach().to(self.buffer.dtype)
        comm.all_reduce(self.buffer, "gradients")
        world = comm.world_size()
        if world > 1:
            self.flat_grad.div_(world)
        return self.buffer[self.num_grads:].clone()

    def clip_(self, max_norm: float) -> torch.Tensor:
        """Scale the synchronized gradient to global L2 norm <= max_norm; return the norm before clipping.

        No communication: the gradient is already identical on every rank, so is its norm, so a
        non-finite norm makes every rank skip the same step.
        """
        norm = self.flat_grad.norm()
        self.flat_grad.mul_((max_norm / (norm + 1e-6)).clamp(max=1.0))
        return norm
