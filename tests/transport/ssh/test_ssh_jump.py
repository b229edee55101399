"""SSHTransport against real sshd processes on 127.0.0.1: ssh_config resolution, ProxyJump over a
real jump host, and a host without sftp. The sshd fixture: tests/transport/ssh/test_ssh.py."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from helpers.sshd_bed import NEEDS_SSHD, Bed, free_port

from nebula_cli.errors import TransportError
from nebula_cli.transport.ssh.transport import (
    HostKeyError,
    SSHTransport,
    UnreachableError,
)
from nebula_cli.transport.sshconfig import parse_destination, resolve

pytestmark = NEEDS_SSHD

# --- ssh_config and ProxyJump ----------------------------------------------------------------

def test_ssh_config_resolution_and_explicit_fields_win(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = tmp_path / "config"
    config.write_text(
        "Host gpu1\n  HostName 10.1.2.3\n  User alice\n  Port 2200\n"
        "  IdentityFile ~/.ssh/gpu_key\n  ProxyJump bastion\n"
        "Host bastion\n  HostName 10.0.0.1\n  User bob\n  Port 2222\n"
        "Host *\n  User fallback\n")
    got = resolve("gpu1", config_path=str(config))
    assert (got.hostname, got.user, got.port, got.jump) == ("10.1.2.3", "alice", 2200, "bastion")
    assert got.identity_files == (os.path.expanduser("~/.ssh/gpu_key"),)
    assert not got.key_explicit
    mine = resolve("gpu1", user="carol", port=22, key="/keys/k", jump="none",
                   config_path=str(config))
    assert (mine.hostname, mine.user, mine.port, mine.jump) == ("10.1.2.3", "carol", 22, None)
    assert mine.identity_files == ("/keys/k",) and mine.identities_only
    other = resolve("node7", config_path=str(config))
    assert (other.hostname, other.user, other.port, other.jump) == ("node7", "fallback", 22, None)
    assert resolve("x", config_path=str(tmp_path / "missing")).port == 22

    assert parse_destination("bob@host:2222") == ("bob", "host", 2222)
    assert parse_destination("[::1]:22") == (None, "::1", 22)
    assert parse_destination("alias") == (None, "alias", None)
    with pytest.raises(TransportError):
        parse_destination("a b")

    t = SSHTransport("gpu1", ssh_config=str(config), known_hosts=str(tmp_path / "kh"))
    assert t.jump is not None and str(t.jump.target) == "bob@10.0.0.1:2222"
    assert t.connection is None  # nothing dialled yet
    chained = SSHTransport("gpu2", "10.9.9.9", jump="u@first:1,bastion",
                           ssh_config=str(config), known_hosts=str(tmp_path / "kh"))
    assert chained.jump is not None and chained.jump.jump is not None
    assert str(chained.jump.target) == "bob@10.0.0.1:2222"
    assert str(chained.jump.jump.target) == "u@first:1"
    monkeypatch.setenv("NEBULA_SSH_CONFIG", str(config))
    monkeypatch.setenv("NEBULA_KNOWN_HOSTS", str(tmp_path / "env_known_hosts"))
    by_env = SSHTransport("gpu1")
    assert by_env.target.port == 2200
    assert by_env.known_hosts.path == str(tmp_path / "env_known_hosts")
    assert by_env.known_hosts.extra_files == []
    loop = tmp_path / "loop"
    loop.write_text("Host a\n  ProxyJump b\nHost b\n  ProxyJump a\n")
    with pytest.raises(TransportError, match="ProxyJump chain"):
        SSHTransport("a", ssh_config=str(loop))


def test_alias_with_proxyjump_over_real_sshd(bed: Bed, tmp_path: Path) -> None:
    config = tmp_path / "config"
    config.write_text(
        f"Host nebula-target\n  HostName 127.0.0.1\n  Port {bed.target.port}\n  User root\n"
        f"  IdentityFile {bed.user_key}\n  IdentitiesOnly yes\n  ProxyJump nebula-jump\n"
        f"Host nebula-jump\n  HostName 127.0.0.1\n  Port {bed.jump.port}\n  User root\n"
        f"  IdentityFile {bed.user_key}\n  IdentitiesOnly yes\n")
    jumps, targets = bed.jump.accepted(), bed.target.accepted()
    with SSHTransport("nebula-target", ssh_config=str(config),
                      known_hosts=str(bed.known_hosts)) as t:
        seen = t.run("echo $SSH_CONNECTION").stdout.split()
        assert seen[-1] == str(bed.target.port)
        assert t.jump is not None and t.jump.connection is not None
        assert t.exists("/")
    assert t.jump.connection is None  # closed with its owner
    assert bed.jump.accepted() == jumps + 1 and bed.target.accepted() == targets + 1

    # An explicit jump string in the spec; the jump host is offered the target's key.
    with bed.transport(jump=f"root@127.0.0.1:{bed.jump.port}") as t:
        assert t.run(["echo", "via jump"]).stdout == "via jump\n"

    # The jump host's key is checked too.
    only_target = tmp_path / "known_hosts"
    only_target.write_text(bed.target.known_line())
    with pytest.raises(HostKeyError, match="jump host of nebula-target"):
        SSHTransport("nebula-target", ssh_config=str(config),
                     known_hosts=str(only_target)).run(["true"])

    # The jump host cannot reach the target.
    with pytest.raises(UnreachableError, match="cannot reach 127.0.0.1:"):
        bed.transport(port=free_port(), jump=f"root@127.0.0.1:{bed.jump.port}").run(["true"])


def test_a_host_without_sftp_is_served_over_exec_channels_with_a_note(
        bed: Bed, caplog: pytest.LogCaptureFixture) -> None:
    remote = f"{bed.remote_dir}/nosftp"
    with bed.transport(port=bed.nosftp.port) as t:
        t.put_bytes(b"\x00\xffbinary\n", f"{remote}/f.bin", mode=0o600)
        assert t.read_file(f"{remote}/f.bin") == b"\x00\xffbinary\n"
        assert t.home.startswith("/")  # the remote home, found without SFTP
    assert "no SFTP subsystem" in caplog.text and "exec channels" in caplog.text
