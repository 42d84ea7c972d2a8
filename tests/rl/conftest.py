"""The RL tests run single-threaded (tests/conftest.py: single_thread)."""
import pytest


@pytest.fixture(autouse=True, scope="module")
def _single_thread(single_thread):
    yield
