"""The job's peer stores (docs/fault_tolerance.md, "Recovery from a peer's memory"): one per node of the allocation,
started by the job script for the job's whole life (outliving every attempt of the training step), each holding
objects in its own memory and serving them over HTTP (the standard library's ThreadingHTTPServer: PUT, ranged GET,
HEAD, DELETE and a listing), announcing itself in a registry directory on the shared file system:

    python -m runtime.fault_tolerance.peer_store serve --registry <log_dir>/peers/<job>

Torch-free, so a store costs its objects and an interpreter. runtime/checkpoint/peer.py is the workers' side.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from runtime.fault_tolerance.progress import node_name
from runtime.io.files import atomic_write_json

REGISTRY_ENV = "NXDT_PEER_REGISTRY"   # the job script's: where the job's stores announce themselves


class _Objects:
    """The store's memory: key -> bytes, under one lock (a PUT replaces an object whole, as on disk)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.data: dict[str, bytes] = {}


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    objects: _Objects

    def log_message(self, *args) -> None:  # one line per request would drown the job's log
        pass

    def _key(self) -> tuple[str, dict]:
        parsed = urllib.parse.urlsplit(self.path)
        return urllib.parse.unquote(parsed.path.lstrip("/")), dict(urllib.parse.parse_qsl(parsed.query))

    def _reply(self, code: int, body: bytes = b"", headers: dict | None = None) -> None:
        self.send_response(code)
        for name, value in (headers or {}).items():
            self.send_header(name, str(value))
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if body and self.command != "HEAD":
            self.wfile.write(body)

    def do_PUT(self) -> None:
        key, _ = self._key()
        length = int(self.headers["Content-Length"])
        body = self.rfile.read(length)
        if len(body) != length:  # the writer died mid-object: nothing half-written is ever served
            return self._reply(400)
        with self.objects.lock:
            self.objects.data[key] = body
        self._reply(204)

    def do_GET(self) -> None:
        key, query = self._key()
        if key == "":
            prefix = query.get("prefix", "")
            with self.objects.lock:
                keys = sorted(k for k in self.objects.data if k.startswith(prefix))
                held = sum(len(v) for v in self.objects.data.values())
            return self._reply(200, json.dumps({"keys": keys, "bytes": held, "node": node_name()}).encode())
        with self.objects.lock:
            body = self.objects.data.get(key)
        if body is None:
            return self._reply(404)
        start, end = 0, len(body)
        if rng := self.headers.get("Range"):
            first, _, last = rng.removeprefix("bytes=").partition("-")
            start, end = int(first), min(len(body), int(last) + 1)
        self._reply(200, body[start:end], {"X-Size": len(body)})

    def do_HEAD(self) -> None:
        key, _ = self._key()
        with self.objects.lock:
            body = self.objects.data.get(key)
        self._reply(404) if body is None else self._reply(200, b"", {"X-Size": len(body)})

    def do_DELETE(self) -> None:
        key, query = self._key()
        with self.objects.lock:
            if "prefix" in query:
                for name in [k for k in self.objects.data if k.startswith(query["prefix"])]:
                    del self.objects.data[name]
            else:
                self.objects.data.pop(key, None)
        self._reply(204)


def serve(registry: str, host: str = "0.0.0.0", advertise: str | None = None) -> ThreadingHTTPServer:
    """Start a store (on an ephemeral port) in a background thread and announce it in the registry."""
    handler = type("Handler", (_Handler,), {"objects": _Objects()})
    server = ThreadingHTTPServer((host, 0), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="nxdt-peer-store", daemon=True).start()
    address = advertise or _own_address()
    os.makedirs(registry, exist_ok=True)
    atomic_write_json(os.path.join(registry, f"{node_name()}.json"),
                      {"node": node_name(), "host": address, "port": server.server_address[1], "pid": os.getpid(),
                       "started_at": time.time()})
    return server


def _own_address() -> str:
    """The address other nodes reach this one at: its name's first IPv4 address (as the job script's rendezvous)."""
    try:
        return socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET)[0][4][0]
    except OSError:
        return "127.0.0.1"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m runtime.fault_tolerance.peer_store")
    parser.add_argument("what", choices=("serve",))
    parser.add_argument("--registry", required=True, help="the directory the job's stores announce themselves in")
    parser.add_argument("--advertise", default=None, help="the address to announce (default: this node's)")
    args = parser.parse_args(argv)
    server = serve(args.registry, advertise=args.advertise)
    print(f"nxdt: peer store on {node_name()} at {server.server_address[1]}, announced in {args.registry}",
          flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":
    sys.exit(main())
