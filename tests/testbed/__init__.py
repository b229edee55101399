"""The nebula test bed: SSH clusters in network namespaces joined by a shaped router (root only).

See bed.py for the topology, system.py for the addresses, links.py for rates and latency (with
delay_proxy.py), sshd.py for SSH, registry.py for the beds on this machine, fixtures.py for the
pytest fixtures, and `python -m tests.testbed up|down|status` for manual use.
"""

from __future__ import annotations

from .bed import Host, TestBed
from .registry import cleanup_stale
from .system import TestBedError

__all__ = ["Host", "TestBed", "TestBedError", "cleanup_stale"]
