"""ampscope: make mixed-precision loss scaling visible.

``from ampscope import ShardedGradScaler`` (FSDP1) or ``from ampscope import GradScaler``
(FSDP2, DDP, single device). Scalers are imported lazily so that ``ampscope serve``
never imports torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["GradScaler", "ShardedGradScaler", "__version__"]

if TYPE_CHECKING:
    from ampscope.scaler import GradScaler, ShardedGradScaler


def __getattr__(name: str) -> Any:
    if name in ("GradScaler", "ShardedGradScaler"):
        from ampscope import scaler

        return getattr(scaler, name)
    raise AttributeError(f"module 'ampscope' has no attribute {name!r}")
