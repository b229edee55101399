"""The host agent: runs on every host, supervises one role's processes (`python -m
nebula_cli.agent`). Standard library only."""
