"""constraints.txt, the versions the suite passed with (csp_tools/lock.py): it parses, it names every package the
project's requirements pull in here, and the check names what differs and how to sync."""

from __future__ import annotations

import pytest

from csp_tools import lock


def test_the_lock_names_every_package_the_requirements_pull_in_here():
    """The lock against this interpreter's installed nxdt-launch (what .ci/run checks, less the versions): a
    requirement added to pyproject.toml without `renew` fails here."""
    pins = lock.read_lock()
    needed = lock.required()
    assert {"pyyaml", "hydra-core", "torch", "transformers", "lm-eval", "pytest"} <= set(needed)
    assert [name for name in needed if name not in pins] == []
    assert pins["torch"] == lock.TORCH and "+" not in "".join(pins.values())  # no local labels (+cpu)


def test_a_version_that_differs_and_a_package_the_lock_lacks_are_each_named():
    pins = {"pyyaml": "6.0.4", "torch": "2.13.0", "numpy": "2.4.6"}
    installed = {"pyyaml": "6.0.3", "torch": "2.13.0+cpu", "numpy": None, "click": "8.3.0"}
    assert lock.differences(pins, installed) == [
        "click 8.3.0: required, but constraints.txt does not name it: the lock is stale (python3 -m csp_tools.lock "
        "renew)",
        "numpy: not installed (lock: 2.4.6)",
        "pyyaml 6.0.3: the lock has 6.0.4",
    ]  # torch's local label (+cpu) matches the lock's 2.13.0


def test_check_says_how_to_sync(monkeypatch, capsys):
    monkeypatch.setattr(lock, "read_lock", lambda: {"pyyaml": "6.0.4"})
    monkeypatch.setattr(lock, "required", lambda: {"pyyaml": "6.0.3"})
    assert lock.check() == 1
    err = capsys.readouterr().err
    assert "pyyaml 6.0.3: the lock has 6.0.4" in err and f"sync it: {lock.SYNC}" in err


def test_a_line_that_is_no_pin_is_named(tmp_path):
    path = tmp_path / "constraints.txt"
    path.write_text("# header\nPyYAML==6.0.4  # why\n\nnumpy>=2\n")
    with pytest.raises(ValueError, match=r"constraints.txt:4: 'numpy>=2' is not name==version"):
        lock.read_lock(path)
    path.write_text("# header\nPyYAML==6.0.4  # why\nzope.interface==8.0\n")
    assert lock.read_lock(path) == {"pyyaml": "6.0.4", "zope-interface": "8.0"}
