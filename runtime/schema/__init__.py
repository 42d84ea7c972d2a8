# One schema for every stage config, torch-free: the launcher imports it at launch (and in a dry run), the runtime
# on every node. Typed stage configs, one reader (reader.py), every pure rule once (rules.py), every choice list
# once (choices.py). Nothing here imports torch or numpy: tests/schema/test_seams.py holds that.
from runtime.schema.reader import ConfigErrors, Report

__all__ = ["ConfigErrors", "Report"]
