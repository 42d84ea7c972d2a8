"""Single-threaded, as tests/runtime_parallel (the reason is there)."""
from tests.runtime_parallel.conftest import _single_thread  # noqa: F401  an autouse fixture, shared
