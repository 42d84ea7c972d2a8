# Fixtures for the trainer tests; the functions behind them live in helpers.py.
import pytest

from tests.runtime_train.helpers import build_tokenizer, reference_training_config, write_mmidx


@pytest.fixture
def mmidx_writer():
    return write_mmidx


@pytest.fixture
def tokenizer_builder():
    return build_tokenizer


@pytest.fixture
def reference_config():
    return reference_training_config
