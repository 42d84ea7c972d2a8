"""python -m runtime.data_prep: one array task of the data_preparation stage.

    # what the launcher's job script runs, once per array task I of N
    python -m runtime.data_prep --config results/gpt3_tiny/data_preparation/data_preparation_config.yaml \\
        --task-index 0 --num-tasks 2
    # everything in one process, or just check the inputs
    python -m runtime.data_prep --config stage.yaml
    python -m runtime.data_prep --config stage.yaml --check

Exit codes: 0 this task's shards are complete; 2 a config or input mistake (one line on stderr, before any
work); 1 a failure while running (bad data under on_bad_line or on_long_record: fail, a truncated or corrupt
input, nothing tokenized, a download or worker that failed). Rerunning after any failure resumes: finished
shards are skipped. A full disk (or quota, or file-size limit) is one line too, exit 1, with no half-written file left.
"""
from __future__ import annotations

import argparse
import sys

from runtime.schema.data_preparation import DataError, UserError
from runtime.schema.facts import USER_ERROR_EXIT_CODE


def _load(path: str) -> dict:
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except FileNotFoundError:
        raise UserError(f"--config {path!r}: no such file") from None
    except yaml.YAMLError as err:
        raise UserError(f"--config {path!r}: not valid YAML ({str(err).splitlines()[0]})") from None
    if not isinstance(data, dict):
        raise UserError(f"--config {path!r}: expected a mapping of keys at the top")
    return data


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m runtime.data_prep",
                                     description="Tokenize a corpus into Megatron-LM indexed datasets.")
    parser.add_argument("--config", required=True, help="the resolved data_preparation stage YAML")
    parser.add_argument("--task-index", type=int, default=0, help="this array task, 0-based (default 0)")
    parser.add_argument("--num-tasks", type=int, default=1, help="array tasks in the stage (default 1)")
    parser.add_argument("--check", action="store_true", help="only check the config and inputs, then exit")
    args = parser.parse_args(argv)
    data: dict = {}
    try:
        from runtime.schema.data_preparation import parse_config
        from runtime.data_prep.plan import check_inputs

        data = _load(args.config)
        errors = check_inputs(data)
        for error in errors:
            print(f"error: {error}", file=sys.stderr)
        if errors:
            return USER_ERROR_EXIT_CODE
        if args.check:
            print("data_preparation config and inputs look fine")
            return 0
        from runtime.data_prep.run import run_task

        run_task(parse_config(data), args.task_index, args.num_tasks)
    except UserError as err:
        for line in err.problems:
            print(f"error: {line}", file=sys.stderr)
        return USER_ERROR_EXIT_CODE
    except DataError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    except OSError as err:
        from runtime.io.files import no_room, no_room_line

        if not no_room(err):
            raise
        # Each writer removed the file it had begun (shard.py, runtime/io/files.py); finished shards are kept.
        print(f"error: {no_room_line(err, 'output_dir', data.get('output_dir'))}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted; rerun to resume (finished shards are kept)", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
