"""The command line and everything it draws: typer commands (`app`), rich renderables (`ui`,
`live`, `netbench_render`, `planner_render`). Calls the control plane; nothing below calls it."""

from nebula_cli.cli.app import app

__all__ = ["app"]
