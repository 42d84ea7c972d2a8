"""The evaluation stage: zero-shot task scoring of a trained checkpoint.

`scoring`, `tasks`, `synthetic` and `report` know nothing about the model: they reach it only through a
`LogprobFn` (see `scoring`), so they run and are tested on CPU with a hand-made stand-in model.
"""
