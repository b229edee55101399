"""The scalar field types of a spec: names, ports, environments, and what may be written where a
spec names a host, a user, an address, an interface or a program.

Names and environment variable names follow fixed patterns; numbers and booleans in `env` become
the strings a process environment holds. Hosts, users, addresses, interfaces and programs each end
up in a connection or a command line on some host (ssh_config lookups, ProxyJump, the agent's
command, GLOO_SOCKET_IFNAME, certificate and directory names), so a value is accepted only if it
could really be what the field says: a hostname, an IP address or an ssh_config alias; a user
name; an interface name; a path. Shell metacharacters, spaces, quotes and
a leading '-' (an option to ssh) never pass. Messages name the offending character.
"""

from __future__ import annotations

import ipaddress
import re
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BeforeValidator, Field, PlainValidator

from nebula_cli.config.yaml_positions import describe

_NAME_RE = re.compile(r"[a-z0-9][a-z0-9_-]{0,31}")
_ENV_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_SECRET_RE = re.compile(r"TOKEN|SECRET|PASSWORD|PASSWD|KEY|CREDENTIAL", re.IGNORECASE)


def _matching(regex: re.Pattern[str], expected: str) -> AfterValidator:
    """A validator that accepts strings matching `regex` and otherwise says what was expected."""

    def check(value: str) -> str:
        if not regex.fullmatch(value):
            raise ValueError(f"expected {expected}, found {describe(value)}")
        return value

    return AfterValidator(check)


def _coerce_env(value: Any) -> Any:
    """YAML scalars (1, 0.5, true) become the strings a process environment holds."""
    def text(v: Any) -> Any:
        if isinstance(v, bool):
            return "true" if v else "false"
        return str(v) if isinstance(v, (int, float)) else v

    return {k: text(v) for k, v in value.items()} if isinstance(value, dict) else value


def redact_env(env: dict[str, str]) -> dict[str, str]:
    """A copy of `env` with the values of secret-looking keys replaced by ``***``."""
    return {k: "***" if _SECRET_RE.search(k) else v for k, v in env.items()}


Name = Annotated[str, _matching(_NAME_RE, "a name of 1-32 characters: lowercase letters, "
                                 "digits, '-' or '_', starting with a letter or digit")]
Port = Annotated[int, Field(ge=1, le=65535)]
EnvName = Annotated[str, _matching(_ENV_NAME_RE, "an environment variable name (letters, digits "
                                                 "and '_', not starting with a digit)")]
EnvDict = Annotated[dict[EnvName, str], BeforeValidator(_coerce_env)]

HOST_MAX = 128
"""Longest host name or alias (it also names the host's certificate and directory)."""
_HOST_RE = re.compile(rf"[A-Za-z0-9][A-Za-z0-9._-]{{0,{HOST_MAX - 1}}}")
_USER_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,63}")
_IFNAME = r"[A-Za-z0-9_][A-Za-z0-9_.:-]{0,14}"
_INTERFACE_RE = re.compile(rf"[\^=]?{_IFNAME}(?:,{_IFNAME})*")
_PROGRAM_RE = re.compile(r"[A-Za-z0-9_./~+][A-Za-z0-9_./~+-]{0,1023}")
_JUMP_RE = re.compile(r"(?:\[(?P<v6>[^\]]*)\]|(?P<host>[^:\[\]]*))(?::(?P<port>\d{1,5}))?")
_OK_CHARS = re.compile(r"[A-Za-z0-9._-]")

HOST_RULE = ("a hostname, an IP address or an ssh_config alias (letters, digits, '.', '-', '_', "
             f"starting with a letter or digit, at most {HOST_MAX} characters)")


def _offending(value: str, allowed: str = "") -> str:
    """" (';' is not allowed)" for the first character outside the safe set, else ""."""
    for ch in value:
        if not _OK_CHARS.fullmatch(ch) and ch not in allowed:
            shown = repr(ch) if ch.isprintable() and ch != " " else f"U+{ord(ch):04X}"
            what = "a space" if ch == " " else shown
            return f" ({what} is not allowed)"
    if value.startswith("-"):
        return " (it may not start with '-')"
    return ""


def _is_address(value: str) -> bool:
    address, _, zone = value.partition("%")
    try:
        ipaddress.ip_address(address)
    except ValueError:
        return False
    return not zone or bool(re.fullmatch(_IFNAME, zone))


def check_host(value: str) -> str:
    """A hostname, an IPv4/IPv6 address or an ssh_config alias."""
    if _HOST_RE.fullmatch(value) or _is_address(value):
        return value
    raise ValueError(f"expected {HOST_RULE}, found {describe(value)}{_offending(value)}")


def check_user(value: str) -> str:
    """A login name."""
    if _USER_RE.fullmatch(value):
        return value
    raise ValueError("expected a user name (letters, digits, '.', '_', '-', at most 64 "
                     f"characters), found {describe(value)}{_offending(value)}")


def check_interface(value: str) -> str:
    """A network interface name (or a list as NCCL takes: 'eth0,eth1', '^docker', '=ib0')."""
    if _INTERFACE_RE.fullmatch(value):
        return value
    raise ValueError("expected a network interface name such as 'eth0' (at most 15 of letters, "
                     f"digits, '.', ':', '-', '_'), found {describe(value)}"
                     f"{_offending(value, ':,^=')}")


def check_program(value: str) -> str:
    """A program name or path (no spaces, quotes or shell metacharacters)."""
    if _PROGRAM_RE.fullmatch(value):
        return value
    raise ValueError("expected a program name or path such as 'python3' or "
                     "'/opt/conda/bin/python' (no spaces, quotes or shell characters), found "
                     f"{describe(value)}{_offending(value, '/~+')}")


def check_jump(value: str) -> str:
    """A bastion: [user@]host[:port], host also an ssh_config alias or [IPv6]."""
    user, at, rest = value.rpartition("@")
    match = _JUMP_RE.fullmatch(rest)
    parts_ok = match is not None and (not at or _USER_RE.fullmatch(user) is not None) and (
        _HOST_RE.fullmatch(match["v6"] or match["host"]) or _is_address(match["v6"] or ""))
    if _is_address(value) or (parts_ok and 1 <= int(match["port"] or 22) <= 65535):
        return value
    raise ValueError("expected [user@]host[:port] or an ssh_config alias, found "
                     f"{describe(value)}{_offending(value, '@:[]')}")


HostName = Annotated[str, AfterValidator(check_host)]
UserName = Annotated[str, AfterValidator(check_user)]
Interface = Annotated[str, AfterValidator(check_interface)]
Program = Annotated[str, AfterValidator(check_program)]
Jump = Annotated[str, AfterValidator(check_jump)]

_DURATION_RE = re.compile(r"(\d+(?:\.\d+)?)\s*(ms|s|m|min|h)?")
_DURATION_UNITS = {"ms": 0.001, None: 1.0, "s": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0}


def parse_duration(value: Any) -> Any:
    """Seconds from a number or a string such as "90", "60s", "2m", "1.5h" (> 0)."""
    if isinstance(value, bool):
        raise ValueError("expected a duration such as 60s, 2m or 1h, or a number of seconds")
    if isinstance(value, (int, float)):
        seconds = float(value)
    elif isinstance(value, str) and (m := _DURATION_RE.fullmatch(value.strip())):
        seconds = float(m.group(1)) * _DURATION_UNITS[m.group(2)]
    else:
        raise ValueError(f"{describe(value)} is not a duration: write 60s, 2m, 1h or a number of "
                         f"seconds")
    if not seconds > 0:
        raise ValueError("a duration must be longer than 0 s")
    return seconds


Duration = Annotated[float, BeforeValidator(parse_duration)]
"""Seconds; written in a spec as a number or with a unit (ms, s, m/min, h)."""


def _steps_or_auto(value: Any) -> Any:
    if value == "auto" or (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
        return value
    raise ValueError(f"expected a number of steps (1 or more) or auto, found {describe(value)}")


StepsOrAuto = Annotated[int | Literal["auto"], PlainValidator(_steps_or_auto)]
"""A number of steps (>= 1), or ``auto``."""
