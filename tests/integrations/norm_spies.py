"""What a worker learns of ampscope's gradient norms in a real library's run: the norm
passes ampscope makes of its own, and whether the records' norms are those of the
gradients the library's clip multiplies."""

from __future__ import annotations

from typing import Any

import torch


class NormSpies:
    """Counts ampscope's own norm passes (``compat.foreach_norm``; the clip's is
    ``compat.foreach_norm_typed``), and keeps per iteration the local norms the records
    take and those of the gradients the library's clip multiplies (as float32 bits)."""

    def __init__(self) -> None:
        self.own_passes = 0
        self.taken: list[list[int]] = []
        self.seen: list[list[int]] = []
        self.names: tuple[str, ...] = ()

    def __enter__(self) -> NormSpies:
        from ampscope.rank import compat
        from ampscope.rank.gradients.stats import GradStats

        compat.check_torch()  # once per process, with a norm of its own: before counting
        self._restore = (compat.foreach_norm, torch.nn.utils.clip_grads_with_norm_, GradStats.take)
        own, clip, take = self._restore

        def foreach_norm(tensors: list[torch.Tensor], low_precision: bool) -> Any:
            self.own_passes += 1
            return own(tensors, low_precision)

        def clip_grads_with_norm_(params: Any, *args: Any, **kwargs: Any) -> Any:
            params = list(params)
            local = [compat.local_tensor(p.grad) for p in params]
            self.seen.append(bits(torch.stack(torch._foreach_norm(local, 2))))
            return clip(params, *args, **kwargs)

        def taken(stats: GradStats, *args: Any) -> Any:
            result = take(stats, *args)
            for optimizer in result.optimizers:
                norms = optimizer.packed
                if norms is None:
                    norms = torch.stack(optimizer.norms)
                self.taken.append(bits(norms))
                self.names = optimizer.names
            return result

        compat.foreach_norm = foreach_norm  # type: ignore[assignment]
        torch.nn.utils.clip_grads_with_norm_ = clip_grads_with_norm_
        GradStats.take = taken  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        from ampscope.rank import compat
        from ampscope.rank.gradients.stats import GradStats

        compat.foreach_norm, torch.nn.utils.clip_grads_with_norm_, GradStats.take = self._restore


def bits(tensor: torch.Tensor) -> list[int]:
    return tensor.detach().float().view(torch.int32).flatten().tolist()
