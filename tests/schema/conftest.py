from tests.recipes.conftest import recipe_data_dir  # noqa: F401  (tokenizers with real vocabulary sizes)
