"""The evaluation stage: zero-shot task scoring, and exact-match scoring of generated answers, of a trained checkpoint.

`scoring`, `tasks`, `synthetic` and `report` know nothing about the model: they reach it only through a
`LogprobFn` (see `scoring`), so they run and are tested on CPU with a hand-made stand-in model. `exact_match`
generates with the model itself (runtime/generate.py); `model` loads checkpoints and the weights a run started from.
"""
