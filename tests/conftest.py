"""Fixtures shared by every test directory."""

pytest_plugins = ["tests.slurm_cluster", "tests.s3_server", "tests.recipe_data"]
