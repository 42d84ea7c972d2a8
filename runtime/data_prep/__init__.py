"""The data_preparation stage: raw text -> Megatron-LM indexed datasets (`.bin` + `.idx`) and a blend file.

Run as `python -m runtime.data_prep --config F --task-index I --num-tasks N` (see __main__.py). The launcher
imports only `runtime.data_prep.plan`, which needs nothing beyond the standard library; keep this file free of
imports so that importing the plan never pulls in numpy, tokenizers or torch.
"""
