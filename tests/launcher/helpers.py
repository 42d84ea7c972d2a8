"""Shared by the launcher tests: compose a config the way the CLI does, with paths fixed so that rendered
scripts are the same on every machine (golden files depend on it), and run the CLI as a user would."""

from __future__ import annotations

import gc
import importlib
import os
import pkgutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import launcher
from launcher import cache

REPO = Path(__file__).resolve().parents[2]

STABLE = ["base_results_dir=/results", "data_dir=/data", "launcher_scripts_path=/launcher", "python=/opt/venv/bin/python"]


def resolved(*overrides: str, stable: bool = True) -> dict:
    """The resolved config as a launch composes it on a cache miss (launcher/cache.py composed): without Hydra where
    launcher/plain_compose.py reproduces it (~15x less CPU), Hydra for everything else."""
    return cache.composed([*(STABLE if stable else []), *overrides])


def _environment(env: dict | None) -> dict[str, str]:
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, **(env or {})}


def pids_with(*parts: str) -> list[int]:
    """The processes whose command line has each of `parts` in one of its arguments (say, runtime.train and a run's
    directory): a test's way to find the workers a launch started."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            args = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if all(any(part.encode() in arg for arg in args) for part in parts):
            found.append(int(entry.name))
    return found


def nxdt_subprocess(*args: str, cwd: Path | None = None, env: dict | None = None,
                    timeout: int = 600) -> subprocess.CompletedProcess:
    """The real CLI in a fresh interpreter: for the tests whose subject is the process itself (what it imports,
    how it starts). This checkout's code, from any cwd (an installed nxdt-launch elsewhere must not stand in)."""
    return subprocess.run([sys.executable, "-m", "launcher.cli", *args], cwd=cwd or REPO, env=_environment(env),
                          capture_output=True, text=True, timeout=timeout)


_warm = False


def _warm_imports() -> None:
    """Import every launcher module once in the test process, so that each forked CLI run starts with them (a
    fresh interpreter spends ~1 s on imports; a fork of a warm one ~0.05 s)."""
    global _warm
    if not _warm:
        for module in pkgutil.walk_packages(launcher.__path__, "launcher."):
            importlib.import_module(module.name)
        _warm = True


def nxdt(*args: str, cwd: Path | None = None, env: dict | None = None, timeout: int = 600) -> subprocess.CompletedProcess:
    """Run the real CLI as `nxdt-launch ARGS` would, in a forked copy of this test process (run_forked) without a
    fresh interpreter's start-up. What the CLI does on exit (sys.exit's code, the buffered streams) is what
    `python -m launcher.cli` does; Python-level atexit handlers of the test process are not run in the child. Use
    nxdt_subprocess where the interpreter's start is under test."""
    _warm_imports()

    def cli() -> int:
        sys.argv = ["nxdt-launch", *args]
        from launcher.cli import run

        return run(list(args))

    return run_forked(cli, ["nxdt-launch", *args], cwd=cwd or REPO, environ=_environment(env), timeout=timeout)


def run_forked(main: Callable[[], int | None], argv: list[str], *, cwd: Path | None = None,
               environ: dict[str, str] | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    """`main()` in a forked copy of this test process, as a subprocess running it would: a process of its own (its
    cwd, `environ` in place of this environment, stdin from /dev/null, its stdout and stderr captured, its module
    state, main's return or sys.exit code as its exit code; the scripts it starts write to the same captured
    streams), without a fresh interpreter importing everything again. `argv` names it in a TimeoutExpired."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        sys.stdout.flush()
        sys.stderr.flush()
        # The test process's objects frozen across the fork: the child's garbage collections skip them rather than
        # walk, and copy, the whole inherited heap (run_distributed does the same).
        gc.freeze()
        pid = os.fork()
        if pid != 0:
            gc.unfreeze()
        if pid == 0:  # the child: never returns into pytest
            code = 1
            try:
                if cwd is not None:
                    os.chdir(cwd)
                if environ is not None:
                    os.environ.clear()
                    os.environ.update(environ)
                devnull = os.open(os.devnull, os.O_RDONLY)
                os.dup2(devnull, 0)
                os.dup2(out.fileno(), 1)
                os.dup2(err.fileno(), 2)
                # pytest's capture replaced the sys streams: give the child ones on the real descriptors.
                sys.stdin = open(0, closefd=False)
                sys.stdout = open(1, "w", closefd=False)
                sys.stderr = open(2, "w", closefd=False)
                code = main() or 0
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            except BaseException:
                import traceback

                traceback.print_exc()
            finally:
                try:
                    sys.stdout.flush()
                    sys.stderr.flush()
                finally:
                    os._exit(code)
        deadline = time.monotonic() + timeout
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            if time.monotonic() > deadline:
                os.kill(pid, 9)
                os.waitpid(pid, 0)
                raise subprocess.TimeoutExpired(argv, timeout)
            time.sleep(0.005)
        out.seek(0)
        err.seek(0)
        # Text as subprocess.run(text=True) gives it: universal newlines.
        stdout, stderr = (f.read().decode(errors="replace").replace("\r\n", "\n").replace("\r", "\n")
                          for f in (out, err))
    return subprocess.CompletedProcess(argv, os.waitstatus_to_exitcode(status), stdout, stderr)


def edited_copy(source: Path, directory: Path, replace: dict[str, str], name: str | None = None) -> Path:
    """A published config file with each of `replace`'s texts (each must be in it) swapped for its value, written
    into `directory` (as `name`, else the source's name): a fixture stays as published, its variants are made here."""
    text = source.read_text()
    for old, new in replace.items():
        assert old in text, old
        text = text.replace(old, new)
    path = directory / (name or source.name)
    path.write_text(text)
    return path


def refused(result: subprocess.CompletedProcess, expected: str) -> list[str]:
    """The contract for a user mistake: exit 2, no traceback, only `error:` lines, one of them holding `expected`.
    Returns the lines."""
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert lines and all(line.startswith("error: ") for line in lines), result.stderr
    assert any(expected in line for line in lines), result.stderr
    return lines
