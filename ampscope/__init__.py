"""ampscope: make mixed-precision loss scaling visible.

``from ampscope import ShardedGradScaler`` (FSDP1) or ``from ampscope import GradScaler``
(FSDP2, DDP, single device); ``from ampscope import GradWatch`` for bf16 and fp32 runs;
``ampscope.paused("checkpoint")`` around work that takes no step on purpose.
They are imported lazily so that ``ampscope serve`` never imports torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = [
    "GradScaler",
    "GradWatch",
    "NonFiniteGradientsError",
    "ShardedGradScaler",
    "__version__",
    "paused",
]

if TYPE_CHECKING:
    from ampscope.rank import GradScaler, GradWatch, NonFiniteGradientsError, ShardedGradScaler
    from ampscope.reporter.pause import paused

_LAZY = ("GradScaler", "GradWatch", "NonFiniteGradientsError", "ShardedGradScaler")


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from ampscope import rank

        return getattr(rank, name)
    if name == "paused":
        from ampscope.reporter.pause import paused

        return paused
    raise AttributeError(f"module 'ampscope' has no attribute {name!r}")
