"""The versions the suite passed with: constraints.txt at the repository's root, one `name==version` a line, read
by every install (`pip install -c constraints.txt ...`: the README's first command, .ci/run, the cluster nodes' setup
and the XLA test venv), so a fresh machine gets the libraries CI tested rather than whatever is newest that day.

    python3 -m csp_tools.lock check    # this environment against the lock: each difference, and how to sync it
    python3 -m csp_tools.lock renew    # a fresh venv, the newest versions the requirements allow -> constraints.txt

`check` walks the requirements of the installed nxdt-launch with the extras the suite installs (runtime, eval, test),
through every package they pull in (markers evaluated for this interpreter), and compares each with the lock: a
version that differs is this environment's to sync; a package the requirements need that the lock does not name is
the lock's to renew (a requirement added to pyproject.toml without `renew`). pip's own resolver does the resolving
in `renew` (a plain `pip freeze` of a fresh venv): nothing here resolves versions.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
LOCK = REPO / "constraints.txt"
EXTRAS = ("runtime", "eval", "test", "torchtitan")
PROJECT = "nxdt-launch"
# The CPU build on this machine and in CI; the lock names it without its local label (+cpu), which `==` matches.
TORCH = "2.13.0"
SYNC = f"python3 -m pip install -c constraints.txt torch=={TORCH} -e '.[{','.join(EXTRAS)}]'"
HEADER = f"""\
# The versions the test suite passed with (csp_tools/lock.py). Every install reads it:
#   {SYNC}
# Renew it on purpose, then run the suite: python3 -m csp_tools.lock renew
# Nodes that take torch from elsewhere (torch-neuronx, the XLA test venv) drop the torch line, and the triton line
# with it (torchtitan's, for torch 2.13; another torch pins its own).
"""


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def read_lock(path: Path = LOCK) -> dict[str, str]:
    """{canonical name: version} of a lock file."""
    pins = {}
    for number, line in enumerate(path.read_text().splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        name, sep, version = line.partition("==")
        if not sep or not version.strip():
            raise ValueError(f"{path}:{number}: {line!r} is not name==version")
        pins[canonical(name)] = version.strip()
    return pins


def required(project: str = PROJECT, extras: tuple[str, ...] = EXTRAS) -> dict[str, str | None]:
    """{canonical name: installed version or None} of every package `project[extras]` needs here, transitively."""
    from importlib import metadata

    from packaging.requirements import Requirement

    found: dict[str, str | None] = {}
    todo = [(project, frozenset(extras))]
    seen: set[tuple[str, frozenset]] = set()
    while todo:
        name, wanted = todo.pop()
        if (name, wanted) in seen:
            continue
        seen.add((name, wanted))
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            found[name] = None
            continue
        if name != project:
            found[name] = dist.version
        for text in dist.requires or ():
            requirement = Requirement(text)
            envs = [{"extra": extra} for extra in wanted] or [{"extra": ""}]
            if requirement.marker is not None and not any(requirement.marker.evaluate(env) for env in envs):
                continue
            todo.append((canonical(requirement.name), frozenset(requirement.extras)))
    return found


def differences(pins: dict[str, str], installed: dict[str, str | None]) -> list[str]:
    """One line per package whose installed version is not the lock's, or that the lock does not name."""
    from packaging.specifiers import SpecifierSet

    lines = []
    for name, version in sorted(installed.items()):
        pin = pins.get(name)
        if pin is None:
            lines.append(f"{name} {version or '(not installed)'}: required, but constraints.txt does not name it: "
                         f"the lock is stale (python3 -m csp_tools.lock renew)")
        elif version is None:
            lines.append(f"{name}: not installed (lock: {pin})")
        elif not SpecifierSet(f"=={pin}").contains(version, prereleases=True):
            lines.append(f"{name} {version}: the lock has {pin}")
    return lines


def check() -> int:
    lines = differences(read_lock(), required())
    if not lines:
        print(f"environment matches constraints.txt ({len(read_lock())} packages)")
        return 0
    print(f"this environment differs from constraints.txt, the versions the suite was tested with "
          f"({len(lines)}):", file=sys.stderr)
    for line in lines:
        print(f"  {line}", file=sys.stderr)
    print(f"sync it: {SYNC}", file=sys.stderr)
    return 1


def renew(python: str = sys.executable) -> int:
    """A fresh venv with the newest versions pip resolves for the project, frozen into constraints.txt."""
    with tempfile.TemporaryDirectory(prefix="nxdt-lock-") as tmp:
        venv = Path(tmp) / "venv"
        subprocess.run([python, "-m", "venv", str(venv)], check=True)
        pip = [str(venv / "bin" / "python"), "-m", "pip"]
        subprocess.run([*pip, "install", "-q", f"torch=={TORCH}", "-e", f"{REPO}[{','.join(EXTRAS)}]"], check=True)
        # --all: setuptools is a requirement too (tensorboard's, torch's); pip itself is not pinned.
        frozen = subprocess.run([*pip, "freeze", "--all", "--exclude-editable"], check=True, capture_output=True,
                                text=True).stdout
    lines = sorted((re.sub(r"\+[\w.]+$", "", line) for line in frozen.splitlines()
                    if "==" in line and canonical(line.split("==")[0]) != "pip"),
                   key=lambda line: canonical(line.split("==")[0]))
    LOCK.write_text(HEADER + "\n".join(lines) + "\n")
    print(f"wrote {LOCK} ({len(lines)} packages); run the suite (bash .ci/run) before committing it")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m csp_tools.lock", description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=("check", "renew"))
    args = parser.parse_args(argv)
    return check() if args.command == "check" else renew()


if __name__ == "__main__":
    sys.exit(main())
