"""The nebula test bed: SSH clusters in network namespaces joined by a shaped router (root only).

See bed.py for the topology and addresses, delay_proxy.py for the emulated latency, fixtures.py
for the pytest fixtures, and `python -m tests.testbed up|down|status` for manual use.
"""

from __future__ import annotations

from .bed import Host, TestBed
from .registry import cleanup_stale
from .system import TestBedError

__all__ = ["Host", "TestBed", "TestBedError", "cleanup_stale"]
