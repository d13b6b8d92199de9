"""ampscope: make mixed-precision loss scaling visible.

``from ampscope import ShardedGradScaler`` (FSDP1) or ``from ampscope import GradScaler``
(FSDP2, DDP, single device); ``from ampscope import GradWatch`` for bf16 and fp32 runs.
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
]

if TYPE_CHECKING:
    from ampscope.rank import GradScaler, GradWatch, NonFiniteGradientsError, ShardedGradScaler

_LAZY = ("GradScaler", "GradWatch", "NonFiniteGradientsError", "ShardedGradScaler")


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from ampscope import rank

        return getattr(rank, name)
    raise AttributeError(f"module 'ampscope' has no attribute {name!r}")
