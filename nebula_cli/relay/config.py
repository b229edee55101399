"""The relay's part of the plan; the model lives with the plan (config.relay_config)."""

from nebula_cli.config.relay_config import (
    RelayConfig,
    RelayConfigError,
    ShapingConfig,
    TlsFiles,
    parse_addr,
)

__all__ = ["RelayConfig", "RelayConfigError", "ShapingConfig", "TlsFiles", "parse_addr"]
