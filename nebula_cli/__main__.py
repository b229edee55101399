"""`python -m nebula_cli` is the `nebula` command."""

from nebula_cli.cli import app

app(prog_name="nebula")
