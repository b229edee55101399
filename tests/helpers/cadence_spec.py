"""The spec a cadence test starts from (`BASE`)."""

from __future__ import annotations

BASE = """
name: t
run: python train.py
clusters:
  - {name: east, transport: local, hosts: [e1]}
  - {name: west, transport: local, hosts: [w1]}
relay:
  sync: {%s}
"""
