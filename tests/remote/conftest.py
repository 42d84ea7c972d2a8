"""A real OpenSSH server on 127.0.0.1 for the remote-submission tests: Debian's sshd on a free port with a
test-only config, host key and client key generated in a temporary directory, root login by that key only.
Its sessions get SLURM_CONF of the local 3-node Slurm (csp_tools/local_slurm), so a command run over SSH
reaches the same cluster a head node would. Started once per session, stopped at the end even on failure.

Without sshd installed (apt-get install openssh-server) or as non-root the fixture skips, except under CI."""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from csp_tools.local_slurm import DEFAULT_ROOT, LocalSlurm
from tests.servers import free_port, stop, wait_for_port

SSHD = "/usr/sbin/sshd"


@dataclass
class Sshd:
    host: str
    port: int
    key_file: Path
    known_hosts: Path        # holds this server's real host key
    host_public_key: str     # "ssh-ed25519 AAAA..."
    log: Path

    def overrides(self, known_hosts: Path | None = None) -> list[str]:
        return [f"cluster.remote.host={self.host}", f"cluster.remote.port={self.port}", "cluster.remote.user=root",
                f"cluster.remote.key_file={self.key_file}", f"cluster.remote.known_hosts={known_hosts or self.known_hosts}"]

    def remote(self, known_hosts: Path | None = None, **extra) -> dict:
        return {"host": self.host, "port": self.port, "user": "root", "key_file": str(self.key_file),
                "known_hosts": str(known_hosts or self.known_hosts), **extra}

    def connections(self) -> int:
        """Logins so far: one per SSH connection any client made."""
        return self.log.read_text(errors="replace").count("Accepted publickey for root")


def _in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def _keygen(path: Path) -> str:
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "nxdt-test", "-f", str(path)], check=True)
    return " ".join(path.with_suffix(".pub").read_text().split()[:2])


@pytest.fixture(scope="session")
def sshd(tmp_path_factory):
    missing = [p for p in (SSHD, shutil.which("ssh-keygen")) if not p or not os.path.exists(p)]
    reason = ("openssh-server is not installed (apt-get install openssh-server)" if missing
              else "sshd must be started as root for root logins" if os.geteuid() != 0 else None)
    if reason:
        if _in_ci():
            pytest.fail(f"CI is set but the test sshd cannot start: {reason}", pytrace=False)
        pytest.skip(reason)
    root = tmp_path_factory.mktemp("sshd")
    host_public_key = _keygen(root / "host_ed25519")
    client_public_key = _keygen(root / "client_ed25519")
    (root / "authorized_keys").write_text(client_public_key + "\n")
    port = free_port()
    known_hosts = root / "known_hosts"
    known_hosts.write_text(f"[127.0.0.1]:{port} {host_public_key}\n")
    slurm_conf = LocalSlurm(root=Path(os.environ.get("NXDT_SLURM_ROOT", DEFAULT_ROOT)).resolve()).conf_path
    (root / "sshd_config").write_text("\n".join([
        f"Port {port}",
        "ListenAddress 127.0.0.1",
        f"HostKey {root / 'host_ed25519'}",
        f"PidFile {root / 'sshd.pid'}",
        f"AuthorizedKeysFile {root / 'authorized_keys'}",
        "PermitRootLogin prohibit-password",
        "PubkeyAuthentication yes",
        "PasswordAuthentication no",
        "KbdInteractiveAuthentication no",
        "UsePAM no",
        "StrictModes no",
        "MaxSessions 50",
        "MaxStartups 50",
        f"SetEnv SLURM_CONF={slurm_conf}",
        "Subsystem sftp internal-sftp",
        "LogLevel VERBOSE",
        "",
    ]))
    Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # sshd's privilege-separation directory
    log = root / "sshd.log"
    log.touch()
    proc = subprocess.Popen([SSHD, "-D", "-f", str(root / "sshd_config"), "-E", str(log)],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        wait_for_port(port, proc, log, "sshd", timeout=15)
        yield Sshd("127.0.0.1", port, root / "client_ed25519", known_hosts, host_public_key, log)
    finally:
        stop(proc)
