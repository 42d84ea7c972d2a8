"""Pretend nodes for tests: network namespaces on one bridge, each with its own address, optionally rate
limited with `tc tbf` (netem is not in every kernel; tbf is). Traffic never leaves the namespaces we create.

    with Bridge(3) as net:                  # namespaces <prefix>n0.. with 10.213.0.1, .2, .3 on interface cv0
        net.rate_limit(1, "40mbit")         # node 1's link, both directions
        proc = net.popen(0, ["python", ...])

Everything is removed on exit, even when the test fails: the processes started in the namespaces are killed
and the namespaces deleted (their veth pairs and the bridge go with them).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time

SUBNET = "10.213.0"
IFNAME = "cv0"


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


def available() -> str | None:
    """None when namespaces can be made here, else why not."""
    probe = f"cvprobe{os.getpid()}"
    try:
        _ip("netns", "add", probe)
    except (OSError, subprocess.CalledProcessError, subprocess.TimeoutExpired) as error:
        return f"cannot create network namespaces ({getattr(error, 'stderr', '') or error})".strip()
    _ip("netns", "del", probe)
    return None


class Bridge:
    def __init__(self, nodes: int):
        self.prefix = f"cv{os.getpid() % 100000}"
        self.hub = f"{self.prefix}hub"
        self.names = [f"{self.prefix}n{i}" for i in range(nodes)]
        self.procs: list[subprocess.Popen] = []

    def address(self, i: int) -> str:
        return f"{SUBNET}.{i + 1}"

    def __enter__(self) -> Bridge:
        try:
            _ip("netns", "add", self.hub)
            _ip("-n", self.hub, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.hub, "link", "set", "br0", "up")
            for i, ns in enumerate(self.names):
                _ip("netns", "add", ns)
                _ip("link", "add", f"h{i}", "netns", self.hub, "type", "veth", "peer", "name", IFNAME, "netns", ns)
                _ip("-n", self.hub, "link", "set", f"h{i}", "master", "br0", "up")
                _ip("-n", ns, "link", "set", "lo", "up")
                _ip("-n", ns, "addr", "add", f"{self.address(i)}/24", "dev", IFNAME)
                _ip("-n", ns, "link", "set", IFNAME, "up")
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def rate_limit(self, i: int, rate: str, burst: str = "32kb") -> None:
        """Slow node i's link: its sending side inside its namespace, its receiving side on the bridge port."""
        for ns, dev in ((self.names[i], IFNAME), (self.hub, f"h{i}")):
            subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate,
                            "burst", burst, "latency", "400ms"], check=True, capture_output=True, timeout=30)

    def popen(self, i: int, argv: list[str], **kwargs) -> subprocess.Popen:
        proc = subprocess.Popen(["ip", "netns", "exec", self.names[i], *argv], start_new_session=True, **kwargs)
        self.procs.append(proc)
        return proc

    def __exit__(self, *exc) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
        for ns in [*self.names, self.hub]:
            # Anything still inside (a worker that outlived its agent) goes with the namespace.
            pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and any(os.path.exists(f"/run/netns/{ns}") for ns in self.names):
            time.sleep(0.1)
