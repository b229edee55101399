"""Hosts resolved as the user's `ssh` resolves them (nebula_cli.transport.sshconfig through
`ssh -G`, openssh_config, keyfiles, hostkeys), then reached by SSHTransport against real sshd
processes on 127.0.0.1.

REALWORLD rows (SSH): `~/.ssh/config` that starts with `Include config.d/*`, has `Match host`
blocks, wildcard `Host` patterns, tokens (`%h`, `%n`), several `IdentityFile` lines and
`IdentitiesOnly yes`; keys with non-default names; OpenSSH certificates (`CertificateFile`,
`<key>-cert.pub`) for sites that accept nothing else; hashed known_hosts (`HashKnownHosts
yes`), ports other than 22; `ProxyCommand` (cloud CLIs' tunnels)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.local_sshd import SSHD, LocalSshd, local_sshd

from nebula_cli.errors import TransportError
from nebula_cli.transport.hostkeys import host_entry_name
from nebula_cli.transport.openssh_config import expand_tokens
from nebula_cli.transport.ssh.transport import AuthError, SSHTransport, UnknownHostKey
from nebula_cli.transport.sshconfig import resolve

HELPERS = Path(__file__).resolve().parents[1] / "helpers"
pytestmark = pytest.mark.skipif(shutil.which("ssh") is None, reason="needs OpenSSH's client")
needs_sshd = pytest.mark.skipif(
    os.geteuid() != 0 or not os.path.exists(SSHD) or shutil.which("ssh-keygen") is None,
    reason="needs root, openssh-server (/usr/sbin/sshd) and ssh-keygen")


def keygen(*args: str) -> None:
    subprocess.run(["ssh-keygen", "-q", *args], check=True, capture_output=True, timeout=30)


def hashed_known_hosts(path: Path, server: LocalSshd) -> None:
    """known_hosts as Debian's `HashKnownHosts yes` leaves it: names hashed by ssh-keygen -H."""
    path.write_text(f"{host_entry_name('127.0.0.1', server.port)} {server.host_key_line}\n")
    keygen("-H", "-f", str(path))
    Path(f"{path}.old").unlink()
    assert "127.0.0.1" not in path.read_text() and path.read_text().startswith("|1|")


def new_dir(path: Path) -> Path:
    path.mkdir()
    return path


def test_ssh_g_reads_include_match_wildcards_and_tokens(tmp_path: Path) -> None:
    """Include'd files, a wildcard block, a `Match host` on the resolved name and tokens in
    IdentityFile and UserKnownHostsFile come out as `ssh` reads them (paramiko's parser
    ignored Include: the alias resolved to its bare name, the wrong user and no jump)."""
    (tmp_path / "config.d").mkdir()
    (tmp_path / "config.d" / "lab").write_text(
        "Host gpu-*\n  User alice\n  IdentityFile %d/.ssh/lab_%n\n  IdentitiesOnly yes\n"
        "  CertificateFile %d/.ssh/lab-cert.pub\n"
        f"Host gpu-7\n  HostName 10.7.0.7\n  ProxyJump bob@bastion:2222\n"
        f"  UserKnownHostsFile {tmp_path}/kh_%h %d/kh2\n  HashKnownHosts yes\n")
    config = tmp_path / "config"
    config.write_text(f"Include {tmp_path}/config.d/*\n"
                      "Match host 10.7.0.7\n  Port 2200\n"
                      "Host tunnel\n  ProxyCommand tunnel-cli connect %h:%p as %r\n"
                      "Host *\n  User fallback\n  IdentityFile ~/.ssh/one\n"
                      "  IdentityFile ~/.ssh/two\n")
    home = os.path.expanduser("~")
    got = resolve("gpu-7", config_path=str(config))
    assert got.resolved_by == "ssh -G"
    assert (got.hostname, got.user, got.port, got.jump) == ("10.7.0.7", "alice", 2200,
                                                             "bob@bastion:2222")
    assert got.identity_files == (f"{home}/.ssh/lab_gpu-7", f"{home}/.ssh/one",
                                  f"{home}/.ssh/two")
    assert got.identities_only and got.certificate_files == (f"{home}/.ssh/lab-cert.pub",)
    assert got.known_hosts_files == (f"{tmp_path}/kh_10.7.0.7", f"{home}/kh2")
    assert got.hash_known_hosts and got.proxy_command is None
    mine = resolve("gpu-7", user="carol", port=22, key="/k/key", jump="none",
                   config_path=str(config))
    assert (mine.user, mine.port, mine.jump, mine.identity_files) == ("carol", 22, None,
                                                                      ("/k/key",))
    tunnel = resolve("tunnel", config_path=str(config))
    assert tunnel.proxy_command == "tunnel-cli connect tunnel:22 as fallback"
    bare = resolve("node", config_path=str(tmp_path / "missing"))
    assert (bare.hostname, bare.port, bare.identity_files) == ("node", 22, ())
    assert expand_tokens("%%h=%h %p %r %n x%", host="a", hostname="b", port=1,
                         user="u") == "%h=b 1 u a x%"


def test_a_config_openssh_refuses_is_one_error_naming_the_host_and_file(tmp_path: Path) -> None:
    config = tmp_path / "config"
    config.write_text("Host gpu1\n  HostNme 10.0.0.1\n")
    with pytest.raises(TransportError) as caught:
        resolve("gpu1", config_path=str(config))
    text = str(caught.value)
    assert "gpu1" in text and str(config) in text and "hostnme" in text.lower()
    assert "ssh -G gpu1" in text


@needs_sshd
def test_include_match_hashed_known_hosts_and_a_non_default_key(tmp_path: Path) -> None:
    """A host known only through an Include'd wildcard block and a `Match`, its key a
    non-default name given with a token, its host key in a hashed known_hosts named by
    UserKnownHostsFile: reached with no `key:` and no known_hosts from nebula. accept-new
    records a new host hashed, as `HashKnownHosts yes` asks."""
    with local_sshd(new_dir(tmp_path / "d"), sftp=True) as server:
        keys = tmp_path / "keys"
        keys.mkdir()
        shutil.copy(server.user_key, keys / "lab-gpu-a")
        hashed_known_hosts(tmp_path / "known", server)
        (tmp_path / "config.d").mkdir()
        (tmp_path / "config.d" / "lab.conf").write_text(
            f"Host lab-*\n  HostName 127.0.0.1\n  IdentityFile {keys}/%n\n"
            f"  IdentitiesOnly yes\n  UserKnownHostsFile {tmp_path}/known\n"
            "  HashKnownHosts yes\n")
        config = tmp_path / "config"
        config.write_text(f"Include {tmp_path}/config.d/*.conf\n"
                          f"Match host 127.0.0.1\n  Port {server.port}\n  User root\n")
        t = SSHTransport("lab-gpu-a", ssh_config=str(config), connect_timeout=5.0)
        try:
            assert t.run(["echo", "reached"]).stdout == "reached\n"
            assert t.auth_method == f"publickey: {keys}/lab-gpu-a"
            assert t.known_hosts.path == f"{tmp_path}/known"
        finally:
            t.close()
        (tmp_path / "known").write_text("")
        with pytest.raises(UnknownHostKey):
            SSHTransport("lab-gpu-a", ssh_config=str(config), connect_timeout=5.0).run(["true"])
        fresh = SSHTransport("lab-gpu-a", ssh_config=str(config), connect_timeout=5.0,
                             accept_new_host_keys=True)
        try:
            assert fresh.run(["true"]).ok
        finally:
            fresh.close()
        recorded = (tmp_path / "known").read_text()
        assert recorded.startswith("|1|") and "127.0.0.1" not in recorded
        assert server.host_key_line.split()[1] in recorded


@needs_sshd
def test_a_host_behind_a_proxy_command(tmp_path: Path) -> None:
    """ProxyCommand (a cloud CLI's tunnel): the SSH connection rides the command's standard
    input and output, its tokens expanded; a command that fails is one error naming the
    host and the command."""
    with local_sshd(new_dir(tmp_path / "d"), sftp=True) as server:
        marker = tmp_path / "proxied"
        config = tmp_path / "config"
        config.write_text(
            f"Host cloud-vm\n  HostName 127.0.0.1\n  Port {server.port}\n  User root\n"
            f"  IdentityFile {server.user_key}\n"
            f"  ProxyCommand {sys.executable} {HELPERS / 'tcp_stdio.py'} %h %p {marker}\n"
            "Host broken-vm\n  ProxyCommand /bin/false\n")
        t = SSHTransport("cloud-vm", ssh_config=str(config),
                         known_hosts=str(server.known_hosts), connect_timeout=5.0)
        try:
            assert t.run(["echo", "through"]).stdout == "through\n"
            assert marker.read_text() == f"127.0.0.1 {server.port}\n"
        finally:
            t.close()
        broken = SSHTransport("broken-vm", ssh_config=str(config),
                              known_hosts=str(server.known_hosts), connect_timeout=5.0)
        with pytest.raises(TransportError) as caught:
            broken.run(["true"])
        assert caught.value.host == "broken-vm" and "/bin/false" in str(caught.value)


@needs_sshd
def test_a_site_that_accepts_only_certificates(tmp_path: Path) -> None:
    """sshd with TrustedUserCAKeys and `AuthorizedKeysFile none`: the key alone is refused;
    its certificate, beside it as `<key>-cert.pub` or named by CertificateFile, gets in."""
    ca = tmp_path / "ca"
    keygen("-t", "ed25519", "-N", "", "-f", str(ca))
    with local_sshd(new_dir(tmp_path / "d"), sftp=True, authorized_keys=False,
                    extra=f"TrustedUserCAKeys {ca}.pub\n") as server:
        config = tmp_path / "config"
        config.write_text(f"Host hpc\n  HostName 127.0.0.1\n  Port {server.port}\n"
                          f"  User root\n  IdentityFile {server.user_key}\n")

        def reach() -> SSHTransport:
            t = SSHTransport("hpc", ssh_config=str(config),
                             known_hosts=str(server.known_hosts), connect_timeout=5.0)
            try:
                assert t.run(["echo", "in"]).stdout == "in\n"
            finally:
                t.close()
            return t

        with pytest.raises(AuthError) as caught:
            reach()
        assert caught.value.host == "hpc" and str(server.user_key) in str(caught.value)
        keygen("-s", str(ca), "-I", "nebula-test", "-n", "root", "-V", "+1h",
               f"{server.user_key}.pub")
        beside = Path(f"{server.user_key}-cert.pub")
        assert beside.exists()
        assert reach().auth_method == f"publickey: {server.user_key} with certificate {beside}"
        elsewhere = tmp_path / "certs" / "site.pub"
        elsewhere.parent.mkdir()
        beside.rename(elsewhere)
        with config.open("a") as fh:
            fh.write(f"  CertificateFile {elsewhere}\n")
        assert reach().auth_method.endswith(f"with certificate {elsewhere}")
