"""What a training script imports on the workers: metrics logging and the outer sync.

``log(step=..., loss=...)`` records metrics (see ``metrics``). ``OuterSync`` (see ``sync``)
wraps a DeepSpeed engine and exchanges updates with the other clusters through the relay;
it is imported on first use so that importing this package stays light (no torch).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from nebula_cli.runtime.metrics import METRICS_TAG, log, read_metrics

if TYPE_CHECKING:
    from nebula_cli.runtime.sync import OuterSync

__all__ = ["METRICS_TAG", "OuterSync", "log", "read_metrics"]


def __getattr__(name: str) -> Any:
    if name == "OuterSync":
        from nebula_cli.runtime.sync import OuterSync

        return OuterSync
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
