"""One error hierarchy for nebula; foreign errors are translated at the boundary."""

from __future__ import annotations

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as shells report a command ended by Ctrl-C


class NebulaError(Exception):
    """Base of every error nebula raises on purpose. ``exit_code`` is what the CLI returns."""

    exit_code = EXIT_FAILED

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class UsageError(NebulaError):
    """Bad command-line usage (unknown job, conflicting flags)."""

    exit_code = EXIT_USAGE


class SpecError(UsageError):
    """A job spec that cannot be used. Carries where the problem is."""

    def __init__(
        self,
        message: str,
        *,
        file: str | None = None,
        line: int | None = None,
        col: int | None = None,
        field: str | None = None,
        problems: list[SpecError] | None = None,
    ) -> None:
        super().__init__(message)
        self.file = file
        self.line = line
        self.col = col
        self.field = field
        self.problems = problems or []

    def location(self) -> str:
        parts = [self.file or "<spec>"]
        if self.line is not None:
            parts.append(str(self.line))
            if self.col is not None:
                parts.append(str(self.col))
        return ":".join(parts)

    def __str__(self) -> str:
        if self.problems:
            return "\n".join(str(p) for p in self.problems)
        field = f" {self.field}:" if self.field else ""
        return f"{self.location()}:{field} {self.message}"


class JobNotFound(UsageError):
    """No job with that id (or prefix) in the state store."""


class TransportError(NebulaError):
    """A command, a file transfer or a connection to a host failed."""

    def __init__(self, message: str, *, host: str | None = None) -> None:
        super().__init__(f"{host}: {message}" if host else message)
        self.host = host


class CommandFailed(TransportError):
    """A command ran on a host and exited non-zero; carries its result."""

    def __init__(self, result: object, *, host: str | None = None, reason: str = "") -> None:
        self.result = result
        super().__init__(reason or f"command failed: {result}", host=host)


class LaunchError(NebulaError):
    """Provisioning or starting a job failed; whatever had started was ended."""
