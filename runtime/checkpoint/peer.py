"""Peer-held state (docs/fault_tolerance.md, "Recovery from a peer's memory"): checkpoints kept in other nodes'
host memory instead of on a file system, so a restarted job resumes over the network from the last refreshed step.

The stores are runtime/fault_tolerance/peer_store.py: one per node, for the job's whole life, each holding objects
in its memory and serving them over HTTP. PeerStorage is the Storage (storage.py) the trainer saves through: the
same rank files, done marks, commit marker and checksums as a checkpoint on disk (manager.py writes them,
integrity.py checks them), so loading, resharding and the damaged-file checks are the disk checkpoint's. Each rank file goes to two stores: its own node's and the next
node's in the registry's order, so losing any one node loses no rank's state (the dead node's ranks find theirs on
the next node; the others on their own). The small objects (done marks, config, commit marker) go to every store.
A store that does not answer is dead for this client: writes skip it, reads and listings go to the others.
"""
from __future__ import annotations

import http.client
import json
import os
import tempfile
import urllib.parse

from runtime.fault_tolerance.peer_store import REGISTRY_ENV, node_name  # noqa: F401 - REGISTRY_ENV: the trainer's

SCHEME = "peer:"                        # a PeerStorage's root: peer:<registry directory>
_TIMEOUT_S = 30.0


# ---- the client: a Storage ------------------------------------------------------------------------------------

class StoreGone(OSError):
    """A store did not answer: its node is lost (or its store was stopped)."""


class _Store:
    def __init__(self, node: str, host: str, port: int):
        self.node, self.host, self.port = node, host, port
        self.alive = True

    def request(self, method: str, key: str, body=None, headers: dict | None = None,
                query: dict | None = None) -> tuple[int, bytes, dict]:
        if not self.alive:
            raise StoreGone(f"the peer store on {self.node} is gone")
        connection = http.client.HTTPConnection(self.host, self.port, timeout=_TIMEOUT_S)
        try:
            path = "/" + urllib.parse.quote(key) + ("?" + urllib.parse.urlencode(query) if query else "")
            connection.request(method, path, body=body, headers=headers or {})
            response = connection.getresponse()
            return response.status, response.read(), dict(response.getheaders())
        except (OSError, http.client.HTTPException) as error:
            self.alive = False
            raise StoreGone(f"the peer store on {self.node} ({self.host}:{self.port}) is gone: {error}") from error
        finally:
            connection.close()


class PeerStorage:
    """Storage (storage.py) over the job's peer stores. `root` is peer:<registry directory>."""

    def __init__(self, root: str, node: str | None = None):
        self.root = root
        self.registry = root.removeprefix(SCHEME)
        self.node = node or node_name()
        self.read_workers = 4
        self._stores: list[_Store] | None = None
        self.bytes_read = 0

    def stores(self) -> list[_Store]:
        """Every store the registry names, in node order (read once: the stores outlive the attempts)."""
        if self._stores is None:
            found = []
            for name in sorted(os.listdir(self.registry)) if os.path.isdir(self.registry) else []:
                if name.endswith(".json") and not name.startswith("."):
                    with open(os.path.join(self.registry, name)) as f:
                        entry = json.load(f)
                    found.append(_Store(entry["node"], entry["host"], int(entry["port"])))
            if not found:
                raise FileNotFoundError(f"no peer store announced itself in {self.registry}")
            self._stores = found
        return self._stores

    def _live(self) -> list[_Store]:
        """This node's store first, then the others in ring order from it."""
        stores = self.stores()
        mine = next((i for i, s in enumerate(stores) if s.node == self.node), 0)
        return [s for s in stores[mine:] + stores[:mine] if s.alive]

    def holders(self) -> list[_Store]:
        """Where this rank's files go: its own node's store and the next live one's."""
        live = self._live()
        return live[:2]

    def _each(self, stores, method: str, key: str, body=None, query: dict | None = None) -> int:
        done = 0
        for store in stores:
            try:
                status, _, _ = store.request(method, key, body, query=query)
            except StoreGone:
                continue
            if status >= 300:
                raise OSError(f"peer store on {store.node}: {method} {key} answered {status}")
            done += 1
        return done

    # Storage's methods ------------------------------------------------------------------------------------------

    def put_file(self, key: str, local_path: str) -> None:
        with open(local_path, "rb") as f:
            data = f.read()
        if self._each(self.holders(), "PUT", key, data) == 0:
            raise OSError(f"no peer store took {key}: every store of {self.registry} is gone")

    def put_bytes(self, key: str, data: bytes) -> None:
        if self._each(self._live(), "PUT", key, data) == 0:
            raise OSError(f"no peer store took {key}: every store of {self.registry} is gone")

    def spool_path(self, key: str) -> str:
        shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
        fd, path = tempfile.mkstemp(prefix="nxdt-peer-", dir=shm)
        os.close(fd)
        return path

    def _find(self, key: str) -> tuple[_Store, int] | None:
        for store in self._live():
            try:
                status, _, headers = store.request("HEAD", key)
            except StoreGone:
                continue
            if status == 200:
                return store, int(headers.get("X-Size", 0))
        return None

    def get_bytes(self, key: str) -> bytes:
        found = self._find(key)
        if found is None:
            raise FileNotFoundError(f"{self.root}/{key}")
        status, body, _ = found[0].request("GET", key)
        if status != 200:
            raise FileNotFoundError(f"{self.root}/{key}")
        self.bytes_read += len(body)
        return body

    def get_file(self, key: str, local_path: str) -> None:
        with open(local_path, "wb") as f:
            f.write(self.get_bytes(key))

    def exists(self, key: str) -> bool:
        return self._find(key) is not None

    def list(self, prefix: str) -> list[str]:
        keys: set[str] = set()
        for store in self._live():
            try:
                status, body, _ = store.request("GET", "", query={"prefix": prefix})
            except StoreGone:
                continue
            if status == 200:
                keys.update(json.loads(body)["keys"])
        return sorted(keys)

    def list_dirs(self) -> list[str]:
        return sorted({key.split("/", 1)[0] for key in self.list("") if "/" in key})

    def delete_prefix(self, prefix: str) -> None:
        self._each(self._live(), "DELETE", "", query={"prefix": prefix.rstrip("/") + "/"})

    def delete(self, key: str) -> None:
        self._each(self._live(), "DELETE", key)

    def local_path(self, key: str) -> str | None:
        return None

    def reader(self, key: str) -> "_PeerReader":
        found = self._find(key)
        if found is None:
            raise FileNotFoundError(f"{self.root}/{key}")
        return _PeerReader(self, found[0], key, found[1])


class _PeerReader:
    """Ranged GETs of one object (RangeReader, storage.py)."""

    def __init__(self, storage: PeerStorage, store: _Store, key: str, size: int):
        self.storage, self.store, self.key, self.size = storage, store, key, size

    def read_into(self, offset: int, buffers: list[memoryview]) -> int:
        want = sum(len(b) for b in buffers)
        if want == 0 or offset >= self.size:
            return 0
        status, body, _ = self.store.request("GET", self.key,
                                             headers={"Range": f"bytes={offset}-{offset + want - 1}"})
        if status != 200:
            raise FileNotFoundError(f"{self.storage.root}/{self.key}")
        self.storage.bytes_read += len(body)
        done = 0
        for buffer in buffers:
            n = min(len(buffer), len(body) - done)
            buffer[:n] = body[done:done + n]
            done += n
            if n < len(buffer):
                break
        return done

    def close(self) -> None:
        pass
