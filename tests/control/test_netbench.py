"""nebula bench-network: probes on this machine (fast) and across the test bed's shaped link."""

from __future__ import annotations

import datetime
import json
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from helpers.jobs import CLI, wait_for, write_spec
from helpers.sshd_bed import free_port
from testbed import TestBed

from nebula_cli import pki
from nebula_cli.errors import NebulaError

PROBE = b"nebula_cli.netbench.probe"
FIGURES = ("rtt_ms", "rtt_p95_ms", "throughput_mbit", "plain_rtt_ms", "plain_rtt_p95_ms",
           "plain_throughput_mbit")
PAIR_KEYS = {"a", "b", "src_host", "dst_host", "src_addr", "dst_addr", "measured", "cipher",
             *FIGURES}
REMOTE_NETBENCH = Path.home() / ".nebula" / "netbench"  # the bed's hosts share this filesystem

DAY = datetime.timedelta(days=1)  # certificates for a test's lifetime


def probe_processes(mark: str) -> list[str]:
    """Command lines of live probe processes on this machine (every namespace shares /proc)
    that name ``mark`` (the test's tmp_path, where its certificates are, or the run's id): the
    tests of other workers measure too."""
    found = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            argv = entry.joinpath("cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if PROBE in argv and mark.encode() in b" ".join(argv):
            found.append(b" ".join(argv).decode(errors="replace"))
    return found


def no_probe_left(mark: str | Path, timeout: float = 3.0) -> list[str]:
    deadline = time.monotonic() + timeout
    while (left := probe_processes(str(mark))) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def check_pair(pair: dict[str, Any], a: str, b: str) -> None:
    assert set(pair) >= PAIR_KEYS and "error" not in pair, pair
    assert (pair["a"], pair["b"]) == (a, b)
    assert all(isinstance(pair[k], float) and pair[k] > 0 for k in FIGURES), pair
    assert pair["rtt_p95_ms"] >= pair["rtt_ms"]
    assert pair["cipher"].startswith("TLS_")


def local_spec(tmp_path: Path, west_python: str = "python3") -> Path:
    return write_spec(tmp_path, f"""
        name: netlocal
        run: "true"
        clusters:
          - name: east
            transport: local
            hosts: [{{host: e1}}, {{host: e2}}]
          - name: west
            transport: local
            python: {west_python}
            hosts: [{{host: w1}}]
    """)


def test_bench_network_on_this_machine(cli: CLI, tmp_path: Path) -> None:
    out = tmp_path / "net.json"
    proc = cli("bench-network", str(local_spec(tmp_path)), "--duration", "1", "--streams", "2",
               "--intra", "--output", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    assert report["version"] == 1 and report["job"] == "netlocal"
    assert report["duration_s"] == 1.0 and report["streams"] == 2 and report["errors"] == []
    assert report["created"].endswith("+00:00") and report["run"].startswith("netbench-")
    assert [(p["a"], p["b"]) for p in report["pairs"]] == [("east", "west"), ("west", "east")]
    for pair in report["pairs"]:
        check_pair(pair, pair["a"], pair["b"])
        assert pair["dst_addr"] == "127.0.0.1"
    intra = report["clusters"]["east"]["intra"]
    check_pair(intra, "east", "east")
    assert (intra["src_host"], intra["dst_host"]) == ("e1", "e2")
    assert report["clusters"]["west"] == {"intra": None}
    assert "west: one host" in proc.stderr
    assert "Gbit/s TLS" in proc.stdout or "Mbit/s TLS" in proc.stdout
    assert "east -> west: e1 (127.0.0.1) -> w1 (127.0.0.1)" in proc.stdout
    assert no_probe_left(tmp_path) == []
    assert not (cli.home / "netbench").exists()


def test_a_host_that_fails_is_named_and_nothing_is_left(cli: CLI, tmp_path: Path) -> None:
    spec = local_spec(tmp_path, west_python="/nonexistent/python3")
    proc = cli("bench-network", str(spec), "--duration", "1")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "west/w1" in proc.stderr and "Traceback" not in proc.stderr
    assert no_probe_left(tmp_path) == []  # east's server had started: it was ended
    assert not (cli.home / "netbench").exists()


@pytest.mark.parametrize("args, message", [
    (["--streams", "0"], "--streams must be between 1 and 64"),
    (["--duration", "0"], "--duration must be between"),
])
def test_bad_options_exit_2(cli: CLI, tmp_path: Path, args: list[str], message: str) -> None:
    proc = cli("bench-network", str(local_spec(tmp_path)), *args)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr


def test_one_cluster_without_intra_and_a_bad_spec_exit_2(cli: CLI, tmp_path: Path) -> None:
    one = write_spec(tmp_path, """
        name: one
        run: "true"
        clusters: [{name: solo, transport: local, hosts: [{host: s1}]}]
    """)
    proc = cli("bench-network", str(one))
    assert proc.returncode == 2 and "add --intra" in proc.stderr, proc.stderr
    bad = write_spec(tmp_path, "name: Bad Name\nrun: x\nclusters: []\n", name="bad.yaml")
    proc = cli("bench-network", str(bad))
    assert proc.returncode == 2 and "bad.yaml:1" in proc.stderr, proc.stderr


def test_probe_refuses_a_certificate_of_another_run(tmp_path: Path) -> None:
    dirs = {}
    for run in ("netbench-a", "netbench-b"):
        issued = pki.issue_job_pki(run, {"east": [], "west": []}, tmp_path / run,
                                    valid_for=DAY)
        for cluster in ("east", "west"):
            d = dirs[(run, cluster)] = tmp_path / f"{run}-{cluster}"
            d.mkdir()
            pair = issued.relay(cluster)
            for name, src in (("ca.pem", issued.ca_cert), ("cert.pem", pair.cert),
                              ("key.pem", pair.key)):
                (d / name).write_bytes(src.read_bytes())

    def probe(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "nebula_cli.netbench.probe", *args],
                              capture_output=True, text=True, timeout=60,
                              stdin=subprocess.DEVNULL)

    served = probe("serve", "--run", "netbench-a", "--certs", str(dirs[("netbench-a", "west")]),
                   "--bind", "127.0.0.1", "--lifetime", "60")
    try:
        assert served.returncode == 0, served.stderr
        ports = json.loads(served.stdout)

        def measure(run: str, peer: str, *more: str) -> subprocess.CompletedProcess[str]:
            return probe("measure", "--run", run, "--certs", str(dirs[(run, "east")]),
                         "--host", "127.0.0.1", "--tls-port", str(ports["tls_port"]),
                         "--peer-cluster", peer,
                         "--duration", "0.3", "--streams", "1", "--pings", "20", *more)

        foreign = measure("netbench-b", "west")
        assert foreign.returncode == 1 and "rejected" in foreign.stderr, foreign.stderr
        wrong_cluster = measure("netbench-a", "north")
        assert "certificate of cluster west, expected north" in wrong_cluster.stderr
        for direction in ((), ("--reverse", "--streams", "2")):  # we send; the server sends
            good = measure("netbench-a", "west", *direction)
            assert good.returncode == 0, good.stderr
            assert json.loads(good.stdout)["throughput_mbit"] > 0
    finally:
        stopped = probe("stop", "--run", "netbench-a")
    assert stopped.returncode == 0 and json.loads(stopped.stdout)["stopped"] == [ports["pid"]]
    assert no_probe_left(tmp_path) == []


# ----------------------------------------------------------------------------- the test bed


def iperf3_mbit(bed: TestBed, server: str, client: str, *, seconds: int, streams: int) -> float:
    """Mbit/s received by an iperf3 server on `server` from a client on `client`."""
    address = bed.hosts[server].address
    srv = bed.popen(server, ["iperf3", "-s", "-1", "-B", address],
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        bed.wait_listening(server, 5201)
        out = bed.run(client, ["iperf3", "-c", address, "-t", str(seconds), "-P", str(streams),
                               "-J"], timeout=seconds + 30, check=True).stdout
        srv.wait(timeout=10)
    finally:
        if srv.poll() is None:
            srv.kill()
            srv.wait()
    return json.loads(out)["end"]["sum_received"]["bits_per_second"] / 1e6


@pytest.mark.testbed
@pytest.mark.slow
def test_bench_network_matches_iperf3_on_the_bed(cli: CLI, bed_clean: TestBed,
                                                 tmp_path: Path) -> None:
    bed = bed_clean
    cli.env["NEBULA_SSH_CONFIG"] = str(bed.ssh_config)
    cli.env["NEBULA_KNOWN_HOSTS"] = str(bed.known_hosts)
    spec = tmp_path / "bed.yaml"
    spec.write_text(yaml.safe_dump({
        "name": "netbed", "run": "true",
        "clusters": [{"name": c, "transport": "ssh", "python": sys.executable,
                      "hosts": [{"host": h} for h in hosts]}
                     for c, hosts in {"east": ["e1", "e2"], "west": ["w1"]}.items()],
    }))
    out = tmp_path / "net.json"
    started = time.monotonic()
    proc = cli("bench-network", str(spec), "--duration", "3", "--streams", "4", "--intra",
               "--output", str(out), timeout=180)
    bench_s = time.monotonic() - started
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    assert not (REMOTE_NETBENCH / report["run"]).exists()
    assert no_probe_left(report["run"]) == []
    iperf = {("east", "west"): iperf3_mbit(bed, "w1", "e1", seconds=3, streams=4),
             ("west", "east"): iperf3_mbit(bed, "e1", "w1", seconds=3, streams=4)}
    rate = bed.rate("east", "west")
    for pair in report["pairs"]:
        a, b = pair["a"], pair["b"]
        check_pair(pair, a, b)
        assert pair["dst_addr"] == bed.hosts[pair["dst_host"]].address
        ref, tls, plain = iperf[(a, b)], pair["throughput_mbit"], pair["plain_throughput_mbit"]
        print(f"{a} -> {b}: TLS {tls:.1f}, plain {plain:.1f}, iperf3 {ref:.1f} Mbit/s "
              f"(link {rate} Mbit/s); rtt {pair['rtt_ms']:.3f} ms (p95 "
              f"{pair['rtt_p95_ms']:.3f}), plain {pair['plain_rtt_ms']:.3f} ms")
        assert 0.8 * rate <= ref <= 1.05 * rate
        assert abs(tls - ref) <= 0.10 * ref
        assert abs(tls - plain) <= 0.10 * plain
        assert abs(plain - ref) <= 0.10 * ref
        assert 0 < pair["rtt_ms"] < 50 and 0 < pair["plain_rtt_ms"] < 50
    intra = report["clusters"]["east"]["intra"]
    check_pair(intra, "east", "east")
    print(f"east e1 -> e2 (unshaped): TLS {intra['throughput_mbit']:.0f}, plain "
          f"{intra['plain_throughput_mbit']:.0f} Mbit/s; bench-network took {bench_s:.1f} s")
    assert intra["throughput_mbit"] > 2 * rate  # inside a cluster the link is not shaped
    assert report["clusters"]["west"]["intra"] is None


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError(f"no VmRSS for {pid}")


def refused(port: int) -> bool:
    """True when nothing listens on `port`. A connection reset means a listener was there and
    is closing (queued connections are reset as it closes): not refused yet."""
    try:
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
    except ConnectionRefusedError:
        return True
    except ConnectionResetError:
        return False
    return False


def cut_off(address: tuple[str, int], sent: bytes) -> bool:
    """True when the server ends a connection that sent `sent`, by a close or, since the bytes
    are left unread, by a reset (which can reach the client while it is still sending)."""
    try:
        with socket.create_connection(address, timeout=5) as raw:
            raw.sendall(sent)
            return raw.recv(1) == b""
    except (ConnectionResetError, BrokenPipeError):
        return True


def test_plain_probe_opens_only_with_a_ticket_from_tls(tmp_path: Path) -> None:
    """The plain port is bound only while a TLS-authenticated measurement holds it open; a
    plain connection needs a one-time ticket, and before it nothing large is read."""
    from nebula_cli.netbench import measure as probe_mod
    from nebula_cli.relay.net.wire import HEADER, MAGIC, WIRE_VERSION, Frame, FrameType, send_frame

    issued = pki.issue_job_pki("netbench-t", {"east": [], "west": []}, tmp_path / "pki",
                                valid_for=DAY)
    d = tmp_path / "west"
    d.mkdir()
    for name, src in (("ca.pem", issued.ca_cert), ("cert.pem", issued.relay("west").cert),
                      ("key.pem", issued.relay("west").key)):
        (d / name).write_bytes(src.read_bytes())
    port = free_port()
    log = tmp_path / "serve.log"
    served = subprocess.run([sys.executable, "-m", "nebula_cli.netbench.probe", "serve", "--run",
                             "netbench-t", "--certs", str(d), "--bind", "127.0.0.1", "--port",
                             str(port), "--lifetime", "60", "--log", str(log)],
                            capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    try:
        assert served.returncode == 0, served.stderr
        info = json.loads(served.stdout)
        assert set(info) == {"pid", "tls_port"} and info["tls_port"] == port
        assert refused(port + 1)  # no plain port before a measurement asks for it
        ctx = pki.client_context(issued.relay("east"), issued.ca_cert)
        opened: dict[str, Any] = {}
        control = probe_mod._dial(f"127.0.0.1:{port}", ctx, "netbench-t", "west", opened,
                                  op="plain", count=1)
        try:
            assert opened["port"] == port + 1 and len(opened["tickets"]) == 1
            before = rss_kib(info["pid"])
            stranger = HEADER.pack(MAGIC, WIRE_VERSION, int(FrameType.HELLO), 0, 60000,
                                   256 << 20) + b"x" * 60000
            for _ in range(30):  # 256 MB frames declared by strangers: closed, not read
                assert cut_off(("127.0.0.1", port + 1), stranger)
            for bad in ("", "0" * 32):  # no ticket, a wrong ticket
                with pytest.raises(NebulaError):  # closed without an answer
                    probe_mod._dial(f"127.0.0.1:{port + 1}", None, "netbench-t", None,
                                    ticket=bad, op="echo")
            assert rss_kib(info["pid"]) - before < 8 * 1024
            ticket = opened["tickets"][0]
            with probe_mod._dial(f"127.0.0.1:{port + 1}", None, "netbench-t", None,
                                 ticket=ticket, op="echo") as sock:
                assert probe_mod.ping(sock, 3)["median"] > 0
            with pytest.raises(NebulaError):  # one time only
                probe_mod._dial(f"127.0.0.1:{port + 1}", None, "netbench-t", None,
                                ticket=ticket, op="echo")
        finally:
            send_frame(control, Frame(FrameType.BYE))
            control.close()
        deadline = time.monotonic() + 5
        while not refused(port + 1) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert refused(port + 1)  # the measurement is over: the plain port is closed
        text = log.read_text()
        assert "payload of 268435456 bytes exceeds the cap of 0" in text
        assert "without a valid ticket" in text and "from 127.0.0.1:" in text
    finally:
        stopped = subprocess.run([sys.executable, "-m", "nebula_cli.netbench.probe", "stop",
                                  "--run", "netbench-t"], capture_output=True, text=True,
                                 timeout=60)
    assert stopped.returncode == 0
    assert no_probe_left(tmp_path) == []


@pytest.mark.testbed
@pytest.mark.slow
def test_a_runs_tunnel_keys_last_minutes_not_a_day(cli: CLI, bed_clean: TestBed,
                                                   tmp_path: Path) -> None:
    """bench-network through a tunnel (west reached by SSH only): the key line it writes on
    w1 stops working after the job's grant period and one pair's measurement (pushed on
    between pairs, `Bench.renew`), so a run killed before its cleanup leaves a key that works
    minutes, not a day; the cleanup removes it."""
    from helpers.ssh_jobs import ssh_spec

    from nebula_cli.config.relay_plan import TUNNEL_GRANT_TTL
    from nebula_cli.control.netbench import MEASURE_SLACK
    from nebula_cli.control.netbench_tunnels import WAIT

    bed = bed_clean
    cli.env["NEBULA_SSH_CONFIG"] = str(bed.ssh_config)
    cli.env["NEBULA_KNOWN_HOSTS"] = str(bed.known_hosts)
    keys = bed.authorized_keys("w1")
    spec = ssh_spec(tmp_path, bed, clusters={"west": ["w1"], "east": ["e1"]}, run="true")
    doc = yaml.safe_load(spec.read_text())
    doc["clusters"][0].update({"relay_reach": "ssh", "authorized_keys": str(keys)})
    spec.write_text(yaml.safe_dump(doc))
    duration = 2
    proc = subprocess.Popen(
        [sys.executable, "-m", "nebula_cli", "bench-network", str(spec), "--duration",
         str(duration), "--streams", "1", "--output", str(tmp_path / "net.json")],
        env=cli.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        stdin=subprocess.DEVNULL)
    try:
        line = wait_for(lambda: next((x for x in (keys.read_text() if keys.exists() else "")
                                      .splitlines() if "nebula-tunnel:" in x), None),
                        timeout=240, every=0.05)
        now = datetime.datetime.now(datetime.UTC)
    finally:  # the run ends by itself (and cleans up) whatever was seen
        try:
            out, _ = proc.communicate(timeout=300)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)
    stamp = line.split('expiry-time="', 1)[1].split('"', 1)[0]
    until = datetime.datetime.strptime(stamp, "%Y%m%d%H%M%SZ").replace(tzinfo=datetime.UTC)
    ahead = (until - now).total_seconds()
    assert 0 < ahead <= TUNNEL_GRANT_TTL + 2 * duration + MEASURE_SLACK + WAIT + 2, line
    assert proc.returncode == 0, out
    assert "nebula-tunnel:" not in keys.read_text()  # the run's cleanup took it out
