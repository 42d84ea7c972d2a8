from pathlib import Path

import pytest

from tests.estimate.demo_data import prepare_demo_data


@pytest.fixture(scope="session")
def autoconfig_data_dir(tmp_path_factory) -> Path:
    return prepare_demo_data(tmp_path_factory.mktemp("autoconfig_demo"))
