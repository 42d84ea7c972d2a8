"""Where Slurm commands run: here (a subprocess) or on a cluster's head node over SSH (paramiko). One runner is
chosen per invocation, from `cluster.remote` for a launch or from the launch record for status/logs/cancel,
and slurm.py and runs.py send every command and file read through it. An SSH runner opens one connection
and reuses it for every command and SFTP transfer of the invocation.

Host keys are checked against known_hosts (cluster.remote.known_hosts, default ~/.ssh/known_hosts): an unknown
key or a changed one is refused, unless cluster.remote.trust_unknown_host=true, which saves an unknown key on
first use (a changed key is refused always)."""

from __future__ import annotations

import atexit
import fnmatch
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path, PurePosixPath
from typing import Any

from launcher.config import LaunchConfig
from launcher.errors import UserError

KEYS = ("host", "user", "port", "key_file", "known_hosts", "trust_unknown_host")
# A DNS name, an IPv4 address, or an IPv6 address (hex digits and colons).
_HOST = re.compile(r"[A-Za-z0-9]([A-Za-z0-9.-]*[A-Za-z0-9])?|[0-9A-Fa-f:]*:[0-9A-Fa-f:.]*")
CONNECT_TIMEOUT_S = 15


def state_dir() -> Path:
    """This machine's own nxdt-launch state: local records of remote runs, and what was sent to them."""
    default = Path(os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state") / "nxdt-launch"
    return Path(os.environ.get("NXDT_STATE_DIR") or default)


def settings(cfg: LaunchConfig) -> dict[str, Any] | None:
    """cluster.remote when it names a host (a remote launch), else None. A dict: the launch record keeps it, and
    status, logs and cancel connect with it again (runs.py)."""
    remote = cfg.cluster.remote or {}
    if not isinstance(remote, dict):
        return None  # problems() reports it
    return {k: remote.get(k) for k in KEYS} if remote.get("host") else None


def problems(cfg: LaunchConfig) -> list[str]:
    remote = cfg.cluster.remote
    if remote is None:
        return []
    if not isinstance(remote, dict):
        return ["cluster.remote: must be a mapping with host, user, port, key_file, known_hosts"]
    errors = [f"cluster.remote.{k}: unknown key; valid keys: {', '.join(KEYS)}" for k in remote if k not in KEYS]
    if not remote.get("host"):
        return errors
    host = remote["host"]
    # The host also names the local mirror of its paths (state_dir()/remote/<host>): a name, never a path.
    if not isinstance(host, str) or not _HOST.fullmatch(host) or ".." in host:
        errors.append(f"cluster.remote.host: {host!r} is not a host name or address; e.g. "
                      "cluster.remote.host=head.example.com (the user goes in cluster.remote.user)")
    port = remote.get("port")
    if port is not None and (not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536):
        errors.append(f"cluster.remote.port: {port!r} is not a TCP port; e.g. cluster.remote.port=22")
    key_file = remote.get("key_file")
    if key_file and not Path(key_file).expanduser().is_file():
        errors.append(f"cluster.remote.key_file: {key_file} does not exist; give the private key that logs in to "
                      f"{remote['host']}")
    if cfg.cluster_type == "local":
        errors.append("cluster_type: 'local' with cluster.remote.host set; a remote launch submits to Slurm, so "
                      "use cluster_type=slurm (or auto)")
    return errors


class LocalRunner:
    """Commands and files on this machine."""

    where = "this machine"

    def run(self, argv: list[str], timeout: float = 60) -> subprocess.CompletedProcess:
        try:
            return subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
        except FileNotFoundError:
            return subprocess.CompletedProcess(argv, 127, "", f"{argv[0]}: command not found")

    def glob(self, directory: str, pattern: str) -> list[str]:
        return sorted(str(p) for p in Path(directory).glob(pattern))

    def read_text(self, path: str) -> str:
        return Path(path).read_text(errors="replace")

    def follow(self, argv: list[str]) -> None:
        os.execvp(argv[0], argv)


class _TrustOnFirstUse:
    """paramiko policy: accept a host that known_hosts does not list, and append its key there."""

    def __init__(self, known_hosts: Path):
        self.known_hosts = known_hosts

    def missing_host_key(self, client, hostname, key) -> None:
        client.get_host_keys().add(hostname, key.get_name(), key)
        self.known_hosts.parent.mkdir(parents=True, exist_ok=True)
        with open(self.known_hosts, "a") as f:
            f.write(f"{hostname} {key.get_name()} {key.get_base64()}\n")
        print(f"warning: trusted the unknown host key of {hostname} ({key.get_name()}) on first use; saved to "
              f"{self.known_hosts}", file=sys.stderr)


class SSHRunner:
    """Commands over SSH (each in a login shell, so PATH has Slurm as on an interactive login), files over SFTP."""

    def __init__(self, remote: dict[str, Any]):
        self.remote = remote
        self.host = str(remote["host"])
        self.port = int(remote.get("port") or 22)
        self.user = remote.get("user") or None
        self.where = f"{self.user + '@' if self.user else ''}{self.host}:{self.port}"
        self._client = None
        self._sftp = None

    # --- the one connection -----------------------------------------------------------------------
    def client(self):
        if self._client is not None:
            return self._client
        import paramiko

        known_hosts = Path(self.remote.get("known_hosts") or "~/.ssh/known_hosts").expanduser()
        client = paramiko.SSHClient()
        if known_hosts.is_file():
            client.load_host_keys(str(known_hosts))
        trust = bool(self.remote.get("trust_unknown_host"))
        client.set_missing_host_key_policy(_TrustOnFirstUse(known_hosts) if trust else paramiko.RejectPolicy())
        key_file = self.remote.get("key_file")
        try:
            client.connect(self.host, port=self.port, username=self.user,
                           key_filename=str(Path(key_file).expanduser()) if key_file else None,
                           allow_agent=not key_file, look_for_keys=not key_file, timeout=CONNECT_TIMEOUT_S,
                           banner_timeout=CONNECT_TIMEOUT_S, auth_timeout=CONNECT_TIMEOUT_S)
        except paramiko.BadHostKeyException as e:
            raise UserError(
                f"cluster.remote.host: the host key of {self.where} changed ({e.key.get_name()} "
                f"{e.key.get_fingerprint().hex()}); refusing to connect. If the change is expected, remove the old "
                f"entry with ssh-keygen -R '[{self.host}]:{self.port}' -f {known_hosts}") from None
        except paramiko.AuthenticationException as e:
            raise UserError(f"cluster.remote: authentication to {self.where} failed ({e}); check cluster.remote.user "
                            "and cluster.remote.key_file") from None
        except paramiko.SSHException as e:
            if "not found in known_hosts" in str(e):
                raise UserError(
                    f"cluster.remote.host: the host key of {self.where} is not in {known_hosts}; check its "
                    f"fingerprint and add it (ssh-keyscan -p {self.port} {self.host} >> {known_hosts}), or set "
                    "cluster.remote.trust_unknown_host=true to trust it on first use") from None
            raise UserError(f"cluster.remote.host: SSH to {self.where} failed: {e}") from None
        except OSError as e:
            raise UserError(f"cluster.remote.host: cannot connect to {self.where}: {e}") from None
        self._client = client
        atexit.register(self.close)
        return client

    def sftp(self):
        if self._sftp is None:
            self._sftp = self.client().open_sftp()
        return self._sftp

    def close(self) -> None:
        for handle in (self._sftp, self._client):
            if handle is not None:
                handle.close()
        self._sftp = self._client = None

    # --- commands ---------------------------------------------------------------------------------
    def _command(self, argv: list[str]) -> str:
        return "bash -lc " + shlex.quote(shlex.join(argv))

    def run(self, argv: list[str], timeout: float = 60) -> subprocess.CompletedProcess:
        import paramiko

        try:
            _, stdout, stderr = self.client().exec_command(self._command(argv), timeout=timeout)
            out = stdout.read().decode(errors="replace")
            err = stderr.read().decode(errors="replace")
            return subprocess.CompletedProcess(argv, stdout.channel.recv_exit_status(), out, err)
        except (paramiko.SSHException, OSError) as e:  # the connection dropped, or the command timed out
            raise UserError(f"cluster.remote.host: {argv[0]} on {self.where} failed: {e or type(e).__name__}") from None

    def follow(self, argv: list[str]) -> None:
        """Print the command's output as it arrives, until it ends or Ctrl-C (the pty hangs it up)."""
        channel = self.client().get_transport().open_session()
        channel.get_pty()
        channel.exec_command(self._command(argv))
        try:
            while True:
                data = channel.recv(65536)
                if not data:
                    break
                sys.stdout.write(data.decode(errors="replace"))
                sys.stdout.flush()
        except KeyboardInterrupt:
            pass
        finally:
            channel.close()

    # --- files --------------------------------------------------------------------------------------
    def glob(self, directory: str, pattern: str) -> list[str]:
        try:
            names = self.sftp().listdir(directory)
        except OSError:
            return []
        return sorted(str(PurePosixPath(directory) / n) for n in names if fnmatch.fnmatchcase(n, pattern))

    def read_text(self, path: str) -> str:
        with self.sftp().open(path, "r") as f:
            return f.read().decode(errors="replace")

    def makedirs(self, path: PurePosixPath) -> None:
        sftp = self.sftp()
        missing = []
        while str(path) not in ("/", ""):
            try:
                sftp.stat(str(path))
                break
            except OSError:
                missing.append(path)
                path = path.parent
        for directory in reversed(missing):
            try:
                sftp.mkdir(str(directory))
            except OSError as e:
                raise self._unwritable(directory, e) from None

    def _unwritable(self, path: PurePosixPath, error: OSError) -> UserError:
        return UserError(f"cluster.remote.host: cannot write {path} on {self.where}: {error}; check that "
                         "base_results_dir is a path the remote user may write")

    def put(self, local: Path, remote_path: str, mode: int | None = None) -> None:
        """Copy one file, written under a temporary name and renamed, so Slurm never reads half a script."""
        sftp = self.sftp()
        target = PurePosixPath(remote_path)
        partial = str(target.with_name(f".{target.name}.part"))
        try:
            self.makedirs(target.parent)
            sftp.put(str(local), partial)
            if mode is not None:
                sftp.chmod(partial, mode)
            sftp.posix_rename(partial, str(target))
        except OSError as e:
            raise self._unwritable(target, e) from None

    def rename(self, old: str, new: str) -> None:
        self.sftp().posix_rename(old, new)


_local = LocalRunner()
_current: LocalRunner | SSHRunner = _local
_connected: dict[tuple, SSHRunner] = {}


def use(remote: dict[str, Any] | None) -> LocalRunner | SSHRunner:
    """Choose the runner for the rest of this invocation: SSH to `remote`, or this machine when None."""
    global _current
    if not remote:
        _current = _local
    else:
        key = tuple(str(remote.get(k)) for k in KEYS)
        _current = _connected.setdefault(key, SSHRunner(remote))
    return _current


def current() -> LocalRunner | SSHRunner:
    return _current
