"""The test bed itself: real sshd per namespace, routing, tc shaping, the delay proxy, teardown."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from testbed import TestBed, TestBedError, cleanup_stale
from testbed.registry import STATE_ROOT
from testbed.system import list_namespaces, namespace_pids

pytestmark = pytest.mark.testbed

ECHO_SERVER = """
import socket, sys
srv = socket.create_server((sys.argv[1], int(sys.argv[2])))
srv.settimeout(30)
for _ in range(int(sys.argv[3])):
    conn, _ = srv.accept()
    conn.settimeout(30)
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    while data := conn.recv(65536):
        conn.sendall(data)
    conn.close()
"""

ECHO_CLIENT = """
import json, socket, sys, time
s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=10)
s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
rtts = []
for _ in range(5):
    t = time.monotonic()
    s.sendall(b"x")
    if s.recv(1) != b"x":
        raise SystemExit("bad echo")
    rtts.append(time.monotonic() - t)
s.close()
print(json.dumps(rtts))
"""


def ssh(bed: TestBed, alias: str, command: str, *extra: str, timeout: float = 30
        ) -> subprocess.CompletedProcess[str]:
    argv = ["ssh", "-F", str(bed.ssh_config), "-o", "StrictHostKeyChecking=yes", *extra,
            alias, command]
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)


def iperf_mbit(bed: TestBed, server: str, client: str, *, addr: str | None = None,
               port: int = 5201, reverse: bool = False) -> float:
    """Mbit/s received in a 2 s iperf3 run from `client` to `server` (or to addr:port)."""
    srv = bed.popen(server, ["iperf3", "-s", "-1", "-B", bed.hosts[server].address],
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        bed.wait_listening(server, 5201)
        target = addr or bed.hosts[server].address
        out = bed.run(client, ["iperf3", "-c", target, "-p", str(port), "-t", "2", "-J",
                               *(["-R"] if reverse else [])], timeout=30, check=True).stdout
        srv.wait(timeout=10)
    finally:
        if srv.poll() is None:
            srv.kill()
            srv.wait()
    return json.loads(out)["end"]["sum_received"]["bits_per_second"] / 1e6


def test_every_host_answers_real_ssh_with_strict_host_keys(bed_clean: TestBed) -> None:
    bed = bed_clean
    assert bed.bastion is not None
    for host in [*bed.hosts.values(), bed.bastion]:
        out = ssh(bed, host.name, f"echo $NEBULA_TESTBED_HOST; ip -o -4 addr show dev "
                                  f"{bed.interface(host.name)}")
        assert out.returncode == 0, out.stderr
        assert out.stdout.split()[0] == host.name
        assert f"inet {host.address}/24" in out.stdout
    refused = ssh(bed, "e1", "true", "-o", "UserKnownHostsFile=/dev/null")
    assert refused.returncode == 255
    assert "Host key verification failed" in refused.stderr


def test_cluster_peers_are_one_hop_and_clusters_are_routed(bed_clean: TestBed) -> None:
    bed = bed_clean
    hosts = bed.hosts
    same = bed.run("e1", ["ping", "-c", "1", "-W", "2", hosts["e2"].address], check=True)
    assert "ttl=64" in same.stdout  # same bridge, no router
    for peer in ("w1", "n2"):
        other = bed.run("e1", ["ping", "-c", "1", "-W", "2", hosts[peer].address], check=True)
        assert "ttl=63" in other.stdout  # one routed hop
    route = bed.run("e1", ["ip", "route", "get", hosts["w1"].address], check=True).stdout
    assert f"via {hosts['e1'].address.rsplit('.', 1)[0]}.254 dev eth0" in route
    no_way_out = bed.run("e1", ["ip", "route", "get", "192.0.2.1"])
    assert no_way_out.returncode != 0  # no default route: nothing leaves 198.18.0.0/15


def test_iperf_between_clusters_matches_the_shaped_rate(bed_clean: TestBed) -> None:
    bed = bed_clean
    rate = bed.rate("east", "west")
    assert rate == 100
    forward = iperf_mbit(bed, "w1", "e1")
    print(f"east->west {forward:.1f} Mbit/s at {rate} Mbit/s")
    assert 0.9 * rate <= forward <= 1.05 * rate
    bed.set_rate("east", "west", 30)
    try:
        backward = iperf_mbit(bed, "w1", "e1", reverse=True)
    finally:
        bed.set_rate("east", "west", rate)
    print(f"west->east {backward:.1f} Mbit/s at 30 Mbit/s")
    assert 27 <= backward <= 31.5


def concurrent_iperf_mbit(bed: TestBed, flows: list[tuple[str, str]], seconds: int = 3
                          ) -> list[float]:
    """Mbit/s received by each (client, server) flow, all running at once (one port each);
    each flow's first second is left out (-O 1), so the figures cover the seconds they share."""
    servers, clients = [], []
    try:
        for n, (_, server) in enumerate(flows):
            port = 5301 + n
            servers.append(bed.popen(server, ["iperf3", "-s", "-1", "-p", str(port), "-B",
                                              bed.hosts[server].address],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            bed.wait_listening(server, port)
        for n, (client, server) in enumerate(flows):
            clients.append(bed.popen(client, ["iperf3", "-c", bed.hosts[server].address, "-p",
                                              str(5301 + n), "-t", str(seconds), "-O", "1",
                                              "-J"],
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                     text=True))
        outs = [c.communicate(timeout=seconds + 30)[0] for c in clients]
    finally:
        for proc in [*servers, *clients]:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
    return [json.loads(o)["end"]["sum_received"]["bits_per_second"] / 1e6 for o in outs]


def test_one_line_per_cluster_is_shared_by_its_peers(make_testbed) -> None:
    """link="cluster": two flows into one cluster share its downlink, two flows out of one
    cluster share its uplink; a pair bed gives each pair its own rate. tcp= sets the hosts'
    congestion control."""
    three = {"a": ["a1"], "b": ["b1"], "c": ["c1"]}
    bed = make_testbed(three, rate_mbit=30, bastion=False, link="cluster", tcp="reno")
    assert bed.rate("a", "b") == 30 and bed.cluster_rate("c") == 30
    cc = bed.run("a1", ["cat", "/proc/sys/net/ipv4/tcp_congestion_control"], check=True)
    assert cc.stdout.strip() == "reno"
    with pytest.raises(TestBedError, match="set_cluster_rate"):
        bed.set_rate("a", "b", 10)
    into = concurrent_iperf_mbit(bed, [("a1", "c1"), ("b1", "c1")])
    out_of = concurrent_iperf_mbit(bed, [("c1", "a1"), ("c1", "b1")])
    alone = concurrent_iperf_mbit(bed, [("a1", "b1")])
    print(f"into c {into}, out of c {out_of}, a->b alone {alone} (Mbit/s at 30 per line)")
    assert 25 <= sum(into) <= 32 and 25 <= sum(out_of) <= 32  # a link per pair: about 60
    assert min(into + out_of) >= 6  # shared, not starved
    assert 27 <= alone[0] <= 31.5
    bed.set_cluster_rate("c", 10)
    assert bed.rate("a", "c") == 10 and bed.leaks() == ["rate of c is 10"]
    slow = concurrent_iperf_mbit(bed, [("a1", "c1"), ("b1", "c1")])
    assert 8 <= sum(slow) <= 10.7
    bed.reset()
    assert bed.leaks() == []

    pair = make_testbed(three, rate_mbit=30, bastion=False)
    both = concurrent_iperf_mbit(pair, [("a1", "c1"), ("b1", "c1")])
    print(f"pair bed: into c {both}")
    assert all(27 <= m <= 31.5 for m in both)


def test_delay_proxy_adds_the_delay_and_keeps_the_throughput(bed_clean: TestBed) -> None:
    bed = bed_clean
    w1 = bed.hosts["w1"].address
    echo = bed.popen("w1", [sys.executable, "-c", ECHO_SERVER, w1, "7000", "2"])
    try:
        bed.wait_listening("w1", 7000)
        direct = json.loads(bed.run("e1", [sys.executable, "-c", ECHO_CLIENT, w1, "7000"],
                                    check=True).stdout)
        addr, port = bed.delayed_endpoint("east", "w1", 7000, delay_ms=40)
        delayed = json.loads(bed.run("e1", [sys.executable, "-c", ECHO_CLIENT, addr, str(port)],
                                     check=True).stdout)
        echo.wait(timeout=10)
    finally:
        if echo.poll() is None:
            echo.kill()
            echo.wait()
    print(f"rtt direct {min(direct) * 1e3:.2f} ms, through the proxy {min(delayed) * 1e3:.1f} ms")
    assert min(direct) < 0.02
    assert 0.080 <= min(delayed) < 0.080 + 0.06
    bed.close_endpoint((addr, port))

    # Delay, not stop-and-wait: a 2 x 25 ms round trip barely costs throughput.
    shaped_addr, shaped_port = bed.delayed_endpoint("east", "w1", 5201, delay_ms=25)
    shaped = iperf_mbit(bed, "w1", "e1", addr=shaped_addr, port=shaped_port)
    bed.set_rate("east", "west", None)
    try:
        free_addr, free_port = bed.delayed_endpoint("east", "w1", 5201, delay_ms=25)
        free = iperf_mbit(bed, "w1", "e1", addr=free_addr, port=free_port)
    finally:
        bed.set_rate("east", "west", 100)
    print(f"through the proxy: {shaped:.1f} Mbit/s on the 100 Mbit/s link, {free:.0f} unshaped")
    assert shaped >= 85  # still shaped like the east-west link, and the delay costs little
    assert free >= 500  # stop-and-wait at 50 ms with 256 KiB chunks would give ~40


def test_proxyjump_through_the_bastion(bed_clean: TestBed) -> None:
    bed = bed_clean
    assert bed.bastion is not None
    direct = ssh(bed, "w2", "echo $SSH_CONNECTION")
    jumped = ssh(bed, "w2-jump", "echo $SSH_CONNECTION")
    assert direct.returncode == 0 and jumped.returncode == 0, direct.stderr + jumped.stderr
    assert jumped.stdout.split()[0] == bed.bastion.address
    assert direct.stdout.split()[0] != bed.bastion.address
    assert jumped.stdout.split()[2] == bed.hosts["w2"].address


def test_cut_stop_and_leaks_are_undone(bed_clean: TestBed) -> None:
    bed = bed_clean
    bed.cut("e2")
    assert ssh(bed, "e2", "true", "-o", "ConnectTimeout=1").returncode == 255
    assert bed.run("e1", ["ping", "-c", "1", "-W", "1", bed.hosts["e2"].address]).returncode != 0
    bed.restore("e2")
    assert ssh(bed, "e2", "true").returncode == 0

    bed.stop_sshd("w2")
    refused = ssh(bed, "w2", "true")
    assert refused.returncode == 255 and "refused" in refused.stderr
    bed.start_sshd("w2")
    assert ssh(bed, "w2", "true").returncode == 0

    bed.run("n1", "setsid sleep 300 >/dev/null 2>&1 &", check=True)
    leaks = bed.leaks()
    assert len(leaks) == 1 and "sleep 300" in leaks[0]
    bed.reset()
    assert bed.leaks() == []


def _bed_processes(bed: TestBed) -> list[int]:
    """Pids whose command line mentions the bed's directory (sshd configs, proxies)."""
    mark = str(bed.dir).encode()
    pids = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            if mark in entry.joinpath("cmdline").read_bytes() and int(entry.name) != os.getpid():
                pids.append(int(entry.name))
        except OSError:
            continue
    return pids


def _assert_gone(bed: TestBed, pids: list[int]) -> None:
    assert not [ns for ns in list_namespaces() if ns.startswith(f"{bed.id}-")]
    assert not Path(f"/sys/class/net/{bed.id}").exists()
    assert not [p for p in pids if Path(f"/proc/{p}").exists()
                and "Z" not in Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1][:3]]
    assert _bed_processes(bed) == []
    assert not bed.dir.exists() and not (STATE_ROOT / bed.id).exists()


def test_down_leaves_no_namespace_process_or_file(make_testbed) -> None:
    bed = make_testbed({"t": ["t1", "t2"]}, rate_mbit=None, bastion=False)
    bed.popen("t1", "sleep 300")
    bed.delayed_endpoint("t", "t2", 22, delay_ms=5)
    pids = [pid for ns in list_namespaces() if ns.startswith(f"{bed.id}-")
            for pid in namespace_pids(ns)]
    assert len(pids) >= 4 and _bed_processes(bed)  # two sshd, sleep, the proxy
    bed.down()
    _assert_gone(bed, pids)
    bed.down()  # idempotent


def test_failed_up_and_stale_beds_are_cleaned(make_testbed, tmp_path: Path) -> None:
    broken = TestBed({"t": ["t1"]}, bastion=False, workdir=tmp_path)

    def fail(host: str) -> None:
        raise TestBedError(f"sshd of {host} refused to start (on purpose)")

    broken.start_sshd = fail  # type: ignore[method-assign]
    with pytest.raises(TestBedError, match="on purpose"):
        broken.up()
    _assert_gone(broken, [])

    stale = make_testbed({"s": ["s1"]}, bastion=False)
    pids = [pid for ns in list_namespaces() if ns.startswith(f"{stale.id}-")
            for pid in namespace_pids(ns)]
    dead = subprocess.Popen(["true"])
    dead.wait()
    state_file = STATE_ROOT / stale.id / "state.json"
    state = json.loads(state_file.read_text())
    state_file.write_text(json.dumps({**state, "pid": dead.pid}))
    assert stale.id in cleanup_stale()
    _assert_gone(stale, pids)
