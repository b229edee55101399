"""A private key file as OpenSSH offers it: its certificates first, then the key alone.

A key's certificates are ssh_config's CertificateFile entries that match it and the
`<key>-cert.pub` beside it (sites that accept only short-lived certificates signed by their
CA). A key protected by a passphrase is asked for once per process on the terminal (never
stored on disk); without a terminal it is skipped with the fix named (load it into ssh-agent).
"""

from __future__ import annotations

import getpass
import os
import sys
import threading
from collections.abc import Iterator, Sequence

import paramiko

_passphrases: dict[str, str | None] = {}
"""Passphrases asked this process, by key path (None: the user gave none)."""
_ask_lock = threading.Lock()


def _terminal() -> bool:
    try:
        return sys.stdin.isatty() and sys.stderr.isatty()
    except (AttributeError, ValueError):
        return False


def _load(path: str, tried: list[str], host: str) -> paramiko.PKey | None:
    try:
        return paramiko.PKey.from_path(path)
    except FileNotFoundError:
        tried.append(f"{path} (missing)")
        return None
    except paramiko.PasswordRequiredException:
        pass
    except TypeError as exc:  # cryptography's word for an OpenSSH-format key with a passphrase
        if "password" not in str(exc).lower():
            tried.append(f"{path} (unreadable: {exc})")
            return None
    except (OSError, ValueError, paramiko.SSHException) as exc:
        tried.append(f"{path} (unreadable: {exc})")
        return None
    with _ask_lock:
        if path not in _passphrases:
            _passphrases[path] = (getpass.getpass(f"Passphrase for {path} ({host}): ")
                                  if _terminal() else None)
        phrase = _passphrases[path]
    if phrase is None:
        tried.append(f"{path} (encrypted and no terminal to ask on: `ssh-add {path}` to "
                     "load it into ssh-agent)")
        return None
    try:
        return paramiko.PKey.from_path(path, password=phrase.encode())  # type: ignore[arg-type]
    except (OSError, ValueError, TypeError, paramiko.SSHException) as exc:
        with _ask_lock:
            _passphrases.pop(path, None)
        tried.append(f"{path} (wrong passphrase? {exc})")
        return None


def key_identities(path: str, certificate_files: Sequence[str], tried: list[str], *,
                   host: str) -> Iterator[tuple[str, paramiko.PKey]]:
    """(what to call it, key) for the key file at `path`: with each certificate that
    matches it, then alone. Problems go to `tried` (shown if every identity fails)."""
    key = _load(path, tried, host)
    if key is None:
        return
    certs = [*certificate_files, f"{path}-cert.pub"]
    for cert in dict.fromkeys(certs):
        if not os.path.exists(cert):
            continue
        with_cert = _load(path, [], host)
        if with_cert is None:
            continue
        try:
            with_cert.load_certificate(cert)
        except (OSError, ValueError, paramiko.SSHException):
            continue  # a CertificateFile of another key
        yield f"{path} with certificate {cert}", with_cert
    yield path, key
