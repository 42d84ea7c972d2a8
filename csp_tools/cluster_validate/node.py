"""The agent every node runs: `python -m csp_tools.cluster_validate --config cluster_validation_config.yaml`.

Under Slurm (one task per node, as the launcher's job script starts it) the node's rank, name and the first
node's address come from Slurm; elsewhere pass them, e.g. three agents in three network namespaces:

    python -m csp_tools.cluster_validate --config F --node-rank 1 --nodes 3 --node-name b --coordinator 10.0.0.1:29400

Without either, it validates this machine alone. Node 0 hosts the control store (a torch TCPStore) and runs
the coordinator (coordinator.py) beside its own agent. Agents register, measure their clock offset, run the
health checks, then run whatever collective tests (or health checks again) the coordinator assigns them until it
says exit. Each
collective runs in the node's worker processes (worker.py), which a stuck test cannot take down with it: the
agent kills and restarts a worker that misses its deadline.
"""

from __future__ import annotations

import argparse
import json
import os
import selectors
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from datetime import timedelta

from csp_tools.cluster_validate import config as config_module
from csp_tools.cluster_validate import health, parsers
from runtime.schema.facts import USER_ERROR_EXIT_CODE

FOREVER_S = 7 * 24 * 3600.0  # agents wait for the coordinator's next task as long as the job lives


class Control:
    """JSON values in the coordinator's TCPStore; every wait has a deadline."""

    def __init__(self, host: str, port: int, *, server: bool, timeout_s: float):
        import torch.distributed as dist

        self.store = dist.TCPStore(host, port, is_master=server, timeout=timedelta(seconds=timeout_s),
                                   wait_for_workers=False)
        self.host, self.port = host, self.store.port

    def put(self, key: str, value) -> None:
        self.store.set(key, json.dumps(value))

    def get(self, key: str, timeout_s: float):
        self.store.wait([key], timedelta(seconds=max(timeout_s, 0.001)))
        return json.loads(self.store.get(key))


@dataclass(frozen=True)
class Identity:
    rank: int
    nodes: int
    name: str
    coordinator: tuple[str, int]
    hostnames: tuple[str, ...] = ()   # every node's name when Slurm tells us (to name nodes that never start)


def _scontrol(*args: str) -> str:
    try:
        return subprocess.run(["scontrol", *args], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return ""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def identity(args, cfg: config_module.ValidationConfig) -> Identity:
    if args.coordinator:
        host, _, port = args.coordinator.rpartition(":")
        return Identity(args.node_rank, args.nodes, args.node_name or socket.gethostname(), (host, int(port)))
    if os.environ.get("SLURM_NODEID") is not None and os.environ.get("SLURM_JOB_NODELIST"):
        hostnames = tuple(_scontrol("show", "hostnames", os.environ["SLURM_JOB_NODELIST"]).split())
        first = hostnames[0] if hostnames else socket.gethostname()
        addr = next((word.split("=", 1)[1] for word in _scontrol("show", "node", first).split()
                     if word.startswith("NodeAddr=")), first)
        try:  # one IPv4 address, as the training job script does: a multi-NIC name may resolve to several
            addr = socket.getaddrinfo(addr, None, socket.AF_INET)[0][4][0]
        except (OSError, IndexError):
            pass
        port = cfg.port or 40000 + int(os.environ.get("SLURM_JOB_ID", "0")) % 20000
        return Identity(int(os.environ["SLURM_NODEID"]), int(os.environ.get("SLURM_NNODES", len(hostnames) or 1)),
                        os.environ.get("SLURMD_NODENAME", socket.gethostname()), (addr, port), hostnames)
    # This machine alone: everything stays on loopback.
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    return Identity(0, 1, socket.gethostname(), ("127.0.0.1", cfg.port or _free_port()))


class _Forked:
    """A worker forked from the pool's server process, with the part of subprocess.Popen's interface the pool uses:
    `stdin` and `stdout` are the two ends of its line protocol, poll/kill/wait its life."""

    def __init__(self, context, local_rank: int, accelerator: str, env: dict):
        from csp_tools.cluster_validate import worker
        from csp_tools.cluster_validate.worker import _take

        tasks_r, tasks_w = context.Pipe(duplex=False)
        replies_r, replies_w = context.Pipe(duplex=False)
        self.process = context.Process(target=worker.forked, args=(local_rank, accelerator, env, tasks_r, replies_w),
                                       daemon=True)
        self.process.start()
        tasks_r.close()  # only the worker may hold its ends: once it dies, its reply pipe reads end of file
        replies_w.close()
        self.pid = self.process.pid
        self.stdin = os.fdopen(_take(tasks_w), "wb")
        self.stdout = os.fdopen(_take(replies_r), "rb", buffering=0)

    def poll(self) -> int | None:
        return self.process.exitcode

    def kill(self) -> None:
        self.process.kill()

    def wait(self, timeout: float | None = None) -> int:
        self.process.join(timeout)
        if self.process.exitcode is None:
            raise subprocess.TimeoutExpired(f"cluster-validate worker {self.pid}", timeout)
        return self.process.exitcode


class WorkerPool:
    """One worker process per device, fed one JSON task per line. A worker that misses a deadline is killed and
    replaced, so one hung collective costs one test, not the validation.

    On CPUs and GPUs the workers are forked from one server process (multiprocessing's forkserver) that imported
    torch once: a node's workers would otherwise each import it (~4 s of CPU apiece, 32 at once on a trn1 node's
    cores). The server touches no device. Neuron workers start afresh for every task (--one-shot: torch-xla joins
    one process group per life) with torchrun's environment, as before."""

    def __init__(self, accelerator: str, devices: int):
        self.accelerator, self.devices = accelerator, devices
        self.one_shot = accelerator == "neuron"  # torch-xla: one process group per process
        self.procs: list = [None] * devices
        self.ready = [False] * devices
        self.buffers = [b""] * devices
        self._context = None

    def _server(self):
        if self._context is None:
            import multiprocessing

            self._context = multiprocessing.get_context("forkserver")
            self._context.set_forkserver_preload(["torch", "torch.distributed", "csp_tools.cluster_validate.worker",
                                                  "csp_tools.cluster_validate.measure"])
        return self._context

    def _spawn(self, local_rank: int, extra_env: dict | None = None) -> None:
        env = {**os.environ, **(extra_env or {})}
        env.setdefault("OMP_NUM_THREADS", "1")  # as torchrun does: workers share the node's cores
        if self.accelerator == "neuron":
            env["NEURON_RT_VISIBLE_CORES"] = str(local_rank)
        if self.one_shot:
            argv = [sys.executable, "-m", "csp_tools.cluster_validate.worker", "--local-rank", str(local_rank),
                    "--accelerator", self.accelerator, "--one-shot"]
            self.procs[local_rank] = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
        else:
            self.procs[local_rank] = _Forked(self._server(), local_rank, self.accelerator, env)
        self.ready[local_rank], self.buffers[local_rank] = False, b""

    def start(self) -> None:
        if not self.one_shot:
            for i in range(self.devices):
                self._spawn(i)

    def _kill(self, i: int) -> None:
        proc = self.procs[i]
        if proc and proc.poll() is None:
            proc.kill()
            proc.wait()
        self.procs[i] = None

    def _read_lines(self, pending: set[int], deadline: float) -> dict[int, dict]:
        """The next JSON line from each worker in `pending`, until the deadline."""
        got: dict[int, dict] = {}
        with selectors.DefaultSelector() as sel:
            for i in pending:
                if b"\n" in self.buffers[i]:
                    line, self.buffers[i] = self.buffers[i].split(b"\n", 1)
                    got[i] = json.loads(line)
                else:
                    sel.register(self.procs[i].stdout, selectors.EVENT_READ, i)
            while len(got) < len(pending) and time.monotonic() < deadline:
                for key, _ in sel.select(timeout=max(0.0, min(1.0, deadline - time.monotonic()))):
                    i = key.data
                    chunk = os.read(key.fileobj.fileno(), 1 << 16)
                    if not chunk:
                        got[i] = {"ok": False, "errors": [f"worker {i} exited (code {self.procs[i].wait()})"]}
                        sel.unregister(key.fileobj)
                        continue
                    self.buffers[i] += chunk
                    if b"\n" in self.buffers[i]:
                        line, self.buffers[i] = self.buffers[i].split(b"\n", 1)
                        got[i] = json.loads(line)
                        sel.unregister(key.fileobj)
        return got

    def run(self, tasks: list[dict], timeout_s: float, env_for=None) -> list[dict]:
        """Give task i to worker i; their replies, in order. `env_for(i)` is a one-shot worker's environment."""
        deadline = time.monotonic() + timeout_s
        for i in range(len(tasks)):
            if self.one_shot or self.procs[i] is None or self.procs[i].poll() is not None:
                self._kill(i)
                self._spawn(i, env_for(i) if env_for else None)
        starting = {i for i in range(len(tasks)) if not self.ready[i]}
        replies: dict[int, dict] = {}
        for i, hello in self._read_lines(starting, deadline).items():
            if hello.get("ready"):
                self.ready[i] = True
            else:
                replies[i] = {"ok": False, "errors": [hello.get("error") or f"worker {i} did not start"]}
        for i, task in enumerate(tasks):
            if i in replies:
                continue
            if not self.ready[i]:
                replies[i] = {"ok": False, "errors": [f"worker {i} did not start within {timeout_s:g}s"]}
                continue
            try:
                self.procs[i].stdin.write((json.dumps(task) + "\n").encode())
                self.procs[i].stdin.flush()
            except OSError as error:  # it died since it said it was ready
                replies[i] = {"ok": False, "errors": [f"worker {i} is gone: {error}"]}
        waiting = {i for i in range(len(tasks)) if i not in replies}
        replies.update(self._read_lines(waiting, deadline))
        for i in range(len(tasks)):
            if i not in replies:
                replies[i] = {"ok": False, "errors": [f"timed out after {timeout_s:g}s"]}
            if self.one_shot or (i in waiting and not replies[i].get("ok")):
                self._kill(i)  # a failed group may leave a worker stuck in a collective: start it afresh
        return [replies[i] for i in range(len(tasks))]

    def close(self) -> None:
        for i, proc in enumerate(self.procs):
            if proc and proc.poll() is None:
                proc.stdin.close()
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    self._kill(i)


def run_nccom_test(cfg: config_module.ValidationConfig, operations: list[str]) -> dict:
    """nccom-test on this node's devices, one run per operation, parsed into the report's rows."""
    c = cfg.collectives
    rows, errors = [], []
    for op in operations:
        name = cfg.nccom_test.operations.get(op)
        if not name:
            continue
        argv = ["nccom-test", "-r", str(cfg.devices), "-b", str(c.min_bytes), "-e", str(c.max_bytes),
                "-f", str(c.step_factor), "-n", str(c.iters), "-w", str(c.warmup_iters),
                *cfg.nccom_test.extra_args, name]
        found = health.run_tool(argv, cfg.task_timeout_s)
        if found is None:
            return {"ok": False, "rows": [], "errors": ["nccom-test is not on PATH"]}
        code, text = found
        try:
            parsed = parsers.parse_nccom_test(text, op, cfg.devices) if code == 0 else []
        except ValueError as error:
            parsed, code, text = [], 1, str(error)
        if code != 0:
            errors.append(f"nccom-test {name} exited {code}: {' '.join(text.split())[:200]}")
        rows += [row.to_json() for row in parsed]
    return {"ok": not errors, "rows": rows, "errors": errors}


def run_assignment(cfg, control: Control, pool: WorkerPool, job: dict) -> dict:
    if job["kind"] == "nccom":
        return run_nccom_test(cfg, job["operations"])
    tasks = [{**job["task"], "rank": job["first_rank"] + i, "report": job["report"] and i == 0,
              "store_host": control.host, "store_port": control.port} for i in range(cfg.devices)]

    def torchrun_env(i: int) -> dict:  # torch-xla joins its group through torchrun's variables
        return {"MASTER_ADDR": job["leader_address"], "MASTER_PORT": str(job["master_port"]),
                "RANK": str(job["first_rank"] + i), "WORLD_SIZE": str(job["task"]["world"]),
                "LOCAL_RANK": str(i), "LOCAL_WORLD_SIZE": str(cfg.devices),
                "GROUP_RANK": str(job["first_rank"] // cfg.devices)}

    replies = pool.run(tasks, cfg.task_timeout_s, torchrun_env if pool.one_shot else None)
    rows = next((r.get("rows") for r in replies if r.get("rows")), [])
    errors = sorted({e for r in replies for e in r.get("errors", [])})
    return {"ok": all(r.get("ok") for r in replies), "rows": rows, "errors": errors}


def _own_address(coordinator_host: str) -> str:
    """The address this node reaches the coordinator from (a UDP connect sends nothing)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((coordinator_host, 9))
            return s.getsockname()[0]
    except OSError:
        return socket.gethostname()


def agent(cfg, ident: Identity, pool: WorkerPool) -> None:
    control = Control(*ident.coordinator, server=False, timeout_s=cfg.register_timeout_s)
    control.put(f"node/{ident.rank}", {"name": ident.name, "address": _own_address(ident.coordinator[0]),
                                        "pid": os.getpid()})
    samples = []
    for k in range(3):  # NTP-style: the coordinator answers with its clock; keep the tightest round trip
        sent = time.time()
        control.put(f"clock/q/{ident.rank}/{k}", sent)
        theirs = control.get(f"clock/a/{ident.rank}/{k}", cfg.register_timeout_s)
        back = time.time()
        samples.append(((sent + back) / 2 - theirs, (back - sent) / 2))  # (our offset, uncertainty)
    start = control.get("health/start", FOREVER_S)
    instance_type = health.detect_instance_type(cfg.instance_type, cfg.health.timeout_s)
    checks = health.local_checks(cfg, ident.name, instance_type, start["token"])
    control.put(f"health/{ident.rank}", {"checks": [c.to_json() for c in checks],
                                          "clock": min(samples, key=lambda sample: sample[1]),
                                          "facts": health.node_facts(cfg, instance_type)})
    seq = 0
    while True:
        task = control.get(f"task/{seq}", FOREVER_S)
        if task["kind"] == "exit":
            control.put(f"bye/{ident.rank}", True)
            return
        job = task["assign"].get(str(ident.rank))
        if job is not None:
            try:
                if job["kind"] == "health":  # a failed check, run again before it names this node (confirm.py)
                    checks = health.local_checks(cfg, ident.name, instance_type, start["token"])
                    result = {"ok": True, "checks": [c.to_json() for c in checks]}
                else:
                    result = run_assignment(cfg, control, pool, job)
            except Exception as error:  # noqa: BLE001 - the coordinator must hear about it, not wait forever
                result = {"ok": False, "rows": [], "errors": [f"agent: {type(error).__name__}: {error}"]}
            control.put(f"result/{seq}/{ident.rank}", result)
        seq += 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m csp_tools.cluster_validate", description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--node-rank", type=int, default=0)
    parser.add_argument("--nodes", type=int, default=1)
    parser.add_argument("--node-name")
    parser.add_argument("--coordinator", help="HOST:PORT of node 0's control store (default: from Slurm)")
    args = parser.parse_args(argv)
    try:
        cfg = config_module.load(args.config)
    except (OSError, config_module.ConfigError) as error:
        for problem in getattr(error, "problems", [str(error)]):
            print(f"error: {problem}", file=sys.stderr)
        return USER_ERROR_EXIT_CODE
    ident = identity(args, cfg)
    pool = WorkerPool(cfg.accelerator, cfg.devices)
    pool.start()  # workers import torch while the health checks run
    try:
        if ident.rank != 0:
            try:
                agent(cfg, ident, pool)
            except Exception as error:  # noqa: BLE001
                # Exit 0 all the same: under `srun --kill-on-bad-exit` a failing agent would take node 0 down
                # before it writes the report, and the report is where this node's failure belongs.
                print(f"agent {ident.name}: {type(error).__name__}: {error}", file=sys.stderr, flush=True)
            return 0
        from csp_tools.cluster_validate.coordinator import Coordinator

        try:
            control = Control(*ident.coordinator, server=True, timeout_s=cfg.register_timeout_s)
        except Exception as error:  # noqa: BLE001 - torch raises a bare RuntimeError/DistNetworkError here
            print(f"error: cannot serve the control store on port {ident.coordinator[1]} ({error}); set "
                  f"cluster_validation.port to a free port", file=sys.stderr, flush=True)
            return USER_ERROR_EXIT_CODE
        ident = Identity(ident.rank, ident.nodes, ident.name, (ident.coordinator[0], control.port), ident.hostnames)
        failure: list[BaseException] = []

        def own_agent() -> None:
            try:
                agent(cfg, ident, pool)
            except BaseException as error:  # noqa: BLE001 - surfaced by the coordinator's report
                failure.append(error)

        thread = threading.Thread(target=own_agent, name="agent-0", daemon=True)
        thread.start()
        code = Coordinator(cfg, control, ident).run()
        thread.join(timeout=30)
        return code
    finally:
        pool.close()

