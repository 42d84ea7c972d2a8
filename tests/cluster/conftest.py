"""Makes the `slurm_cluster` fixture available when tests/cluster runs on its own.

tests/conftest.py normally provides it for the whole suite (`pytest_plugins = ["tests.slurm_cluster"]`, or a
plain import). Either way the module is then already imported, and registering it again would define the
fixture twice, so this only registers it when nothing else has.
"""

import sys


def pytest_configure(config):
    if "tests.slurm_cluster" not in sys.modules:
        config.pluginmanager.import_plugin("tests.slurm_cluster")
