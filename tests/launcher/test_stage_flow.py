"""A training recipe brings the data preparation that writes what it reads (as NeMo-Launcher's defaults pair
gpt3 with download_gpt3_pile), an explicit data_preparation=... still wins, and every recipe's default launch
trains on what it prepares: checked for all of conf/training, so a new recipe cannot drift."""
from pathlib import Path

import pytest

from launcher.config import parse
from launcher.validate import problems
from runtime.schema import rules

from .helpers import resolved

RECIPES = sorted(str(p.relative_to(p.parents[1]).with_suffix(""))
                 for p in (Path(__file__).resolve().parents[2] / "conf" / "training").glob("*/*.yaml"))


@pytest.mark.parametrize("recipe, preparation", [("gpt3/5b", "download_gpt3_pile"), ("gpt3/tiny", "demo_data_preparation"),
                                                 ("llama3/8b", "llama3_custom_dataset"),
                                                 ("llama3_1/70b", "llama3_custom_dataset"),
                                                 ("llama2/7b", "llama2_custom_dataset")])
def test_a_recipe_brings_its_data_preparation(recipe, preparation):
    cfg = resolved(f"training={recipe}")
    assert cfg["data_preparation"]["run"]["name"] == preparation
    explicit = resolved(f"training={recipe}", "data_preparation=custom_dataset")
    assert explicit["data_preparation"]["run"]["name"] == "custom_dataset"


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_recipe_trains_on_what_its_default_launch_prepares(recipe):
    cfg = resolved(f"training={recipe}", "cluster_type=slurm")
    errors, _ = problems(parse(cfg), dry_run=True, local=False)
    assert not [e for e in errors if "is not what data_preparation" in e], errors


def test_training_on_another_corpus_is_named_with_the_fix():
    problem = rules.trains_on_prepared_data("/d/the_pile_gpt2/blend.txt", "/d/the_pile_gpt2/tokenizer.json", "/d/demo",
                                            "demo")
    assert problem.startswith("training.model.data.data_prefix: '/d/the_pile_gpt2/blend.txt' is not what")
    assert "training.model.data.data_prefix=/d/demo/blend.txt and training.model.tokenizer.model=/d/demo/tokenizer.json" \
        in problem
    assert rules.trains_on_prepared_data([0.5, "/d/demo/a", 0.5, "/d/demo/b"], "/d/demo/tokenizer.json", "/d/demo/",
                                         "demo") is None
