# The CPU matmul probe (runtime/peak_probe.py): the best rate over sizes and repeats, within a time budget, and
# its cache per machine, which only ever rises and shrugs off a corrupt file. Fake timings: no test here multiplies
# anything large.
import json

import pytest

from runtime import peak_probe
from runtime.peak_probe import Probe, cache_path, cached_probe, machine_key, measure, record


def _scripted(seconds_by_size: dict[int, list[float]]):
    """A timed_matmul that reports the next of its size's times (the multiply itself is not run)."""
    left = {n: list(times) for n, times in seconds_by_size.items()}
    return lambda a, b, out: left[a.shape[0]].pop(0)


def _tflops(n: int, seconds: float) -> float:
    return 2.0 * n**3 / seconds / 1e12


def test_measure_keeps_the_best_rate_over_sizes_and_repeats():
    # The first multiply is slow (a cold thread pool) and never the best; the best repeat of any size wins.
    timed = _scripted({64: [1e-3, 1e-7, 1e-6], 128: [4e-6, 2e-6, 8e-6]})
    best = measure(sizes=(64, 128), repeats=3, budget_s=1.0, timed_matmul=timed)
    assert best.size == 64 and best.tflops == pytest.approx(_tflops(64, 1e-7))
    timed = _scripted({64: [1e-3, 1e-6, 1e-6], 128: [4e-6, 2e-6, 8e-6]})
    best = measure(sizes=(64, 128), repeats=3, budget_s=1.0, timed_matmul=timed)
    assert best.size == 128 and best.tflops == pytest.approx(_tflops(128, 2e-6))


def test_a_size_that_would_not_fit_the_budget_is_not_measured():
    # At 64^2's best rate, three 4096^2 multiplies would take ~0.26 s: over a 0.1 s budget (and absent from the
    # script, so measuring it would fail).
    timed = _scripted({64: [1e-5, 1e-6, 1e-6]})
    assert measure(sizes=(64, 4096), repeats=3, budget_s=0.1, timed_matmul=timed).size == 64


def test_the_cache_only_rises(tmp_path):
    path = tmp_path / "peak.json"
    assert record(Probe(0.3, 2048), "cpu A", path) == Probe(0.3, 2048)
    written = path.read_text()
    assert record(Probe(0.1, 1024), "cpu A", path) == Probe(0.3, 2048)  # measured under load: not kept
    assert path.read_text() == written
    assert record(Probe(0.4, 4096), "cpu A", path) == Probe(0.4, 4096)  # a quieter machine: kept
    assert json.loads(path.read_text()) == {"cpu A": {"tflops": 0.4, "size": 4096}}
    assert not [p for p in tmp_path.iterdir() if p != path]  # no temporary file left behind


def test_a_cached_figure_is_read_back_not_measured_again(tmp_path, monkeypatch):
    measured = []
    monkeypatch.setattr(peak_probe, "measure", lambda: measured.append(1) or Probe(0.2, 1024))
    path = tmp_path / "peak.json"
    assert cached_probe("cpu A", path) == Probe(0.2, 1024)
    assert cached_probe("cpu A", path) == Probe(0.2, 1024)
    assert len(measured) == 1


def test_the_cache_is_keyed_per_machine(tmp_path, monkeypatch):
    cpuinfo = "processor\t: 0\nmodel name\t: Example CPU 9000\n"
    key = machine_key(cpuinfo, threads=2)
    assert key.startswith("Example CPU 9000 | 2 threads | torch ")
    assert machine_key(cpuinfo, threads=1) != key  # threads
    assert machine_key(cpuinfo.replace("9000", "9001"), threads=2) != key  # the CPU model
    monkeypatch.setattr(peak_probe.torch, "__version__", "0.0.1")
    assert machine_key(cpuinfo, threads=2) != key  # torch's kernels

    path = tmp_path / "peak.json"
    record(Probe(0.5, 4096), "machine A", path)
    monkeypatch.setattr(peak_probe, "measure", lambda: Probe(0.1, 2048))
    assert cached_probe("machine B", path) == Probe(0.1, 2048)  # A's figure is not B's
    assert set(json.loads(path.read_text())) == {"machine A", "machine B"}


@pytest.mark.parametrize("content", [b"{not json", b"[0.3, 2048]", b"\xff\xfe"])
def test_a_corrupt_cache_is_ignored_with_a_one_line_warning(tmp_path, monkeypatch, capsys, content):
    path = tmp_path / "peak.json"
    path.write_bytes(content)
    monkeypatch.setattr(peak_probe, "measure", lambda: Probe(0.2, 1024))
    assert cached_probe("cpu A", path) == Probe(0.2, 1024)
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(f"warning: {path}: not a peak cache"), err
    assert json.loads(path.read_text()) == {"cpu A": {"tflops": 0.2, "size": 1024}}  # replaced by a good one


def test_an_unusable_entry_is_measured_again(tmp_path, monkeypatch):
    path = tmp_path / "peak.json"
    path.write_text(json.dumps({"cpu A": {"tflops": "fast"}, "cpu B": {"tflops": 0, "size": 1024}}))
    monkeypatch.setattr(peak_probe, "measure", lambda: Probe(0.2, 1024))
    assert cached_probe("cpu A", path) == Probe(0.2, 1024)
    assert cached_probe("cpu B", path) == Probe(0.2, 1024)


def test_cache_path_default_and_override(tmp_path):
    assert cache_path({"NXDT_PEAK_CACHE": str(tmp_path / "p.json")}) == tmp_path / "p.json"
    assert cache_path({"XDG_CACHE_HOME": str(tmp_path)}) == tmp_path / "nxdt-launch" / "peak_tflops.json"
    assert cache_path({}).parts[-3:] == (".cache", "nxdt-launch", "peak_tflops.json")
