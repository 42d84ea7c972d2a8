"""docs/recipes.md's table is what the launcher does: every recipe on every target it names composes, passes every
rule of a launch (the memory check by the estimator among them) and fits; the table in the doc is the one
`python -m launcher.recipe_table` prints. NXDT_UPDATE_GOLDEN=1 rewrites the doc's table; review the diff."""

import os

import pytest

from launcher import recipe_table
from tests.launcher.helpers import REPO

DOC = REPO / "docs" / "recipes.md"


@pytest.mark.long("composes and estimates every recipe on every target (trn1, trn2, GPU)")
def test_every_recipe_on_every_target_fits_and_the_doc_holds_the_table(recipe_results_dir, recipe_data_dir,
                                                                       monkeypatch):
    # Each row launched into the results and data directories test_recipes.py launches a recipe with: a row of a
    # recipe on the cluster it is meant for is then that file's launch of it, composed once for both (the session's
    # launch cache). The rows, and each row's launch and estimate, are recipe_table's own.
    launch_row = recipe_table.row
    monkeypatch.setattr(recipe_table, "row", lambda recipe, target, results, data: launch_row(
        recipe, target, recipe_results_dir / recipe, recipe_data_dir))
    rows = recipe_table.rows()
    for row in rows:
        assert row.memory_gib <= row.usable_gib, row
    # The targets a recipe names are the ones it lands on: Trainium layouts on Neuron workers, GPU ones on 8 GPUs.
    assert {r.target for r in rows} == {"trn1", "trn2", "gpu", "cpu"}
    for row in rows:
        assert row.workers == {"trn1": 32, "trn2": 64, "gpu": 8}.get(row.target, row.workers), row
    table = "\n".join([recipe_table.HEADER, *(r.markdown() for r in rows)]) + "\n"
    text = DOC.read_text()
    start = text.index(recipe_table.HEADER)
    end = text.index("\n\n", start) + 1
    if os.environ.get("NXDT_UPDATE_GOLDEN") == "1":
        DOC.write_text(text[:start] + table + text[end:])
        text = DOC.read_text()
    assert text[start:text.index("\n\n", start) + 1] == table, "docs/recipes.md: NXDT_UPDATE_GOLDEN=1 rewrites it"


def test_no_recipe_inherits_another_recipes_targets():
    """`targets` merges down the defaults chain: a recipe that did not set its own would send a launch to its
    parent's layouts (gpt3/6.7b to gpt3/5b_trn1)."""
    from launcher.paths import group_choices
    from launcher.targets import TARGETS, targets_of_file

    for recipe in group_choices("training"):
        own, mapping = targets_of_file(recipe)
        assert own or mapping is None, f"{recipe}: set `targets` in its own file (null to pin it)"
        assert set(mapping or {}) <= set(TARGETS), recipe
