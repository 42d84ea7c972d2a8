"""The evaluation stage: loss tasks, lm-evaluation-harness tasks and exact-match scoring of generated answers, of a
trained checkpoint.

`harness` is our model as an lm-eval backend and `lm_tasks` finds and checks lm-eval task names and their data
(torch-free: the launcher calls it); `tasks` checks and normalizes the local task files lm-eval scores through
`task_files/`; `synthetic` builds the demo's task. `scoring` batches log-likelihood requests through a
`LogprobFn` and knows nothing of the model; `exact_match` generates with the model itself (runtime/generate.py);
`model` loads checkpoints and the weights a run started from; `report` writes results and the table.
"""
