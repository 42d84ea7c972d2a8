"""Shell completion for nxdt-launch, through click's protocol (docs/cli.md): the shell runs nxdt-launch with
_NXDT_LAUNCH_COMPLETE=<shell>_complete and COMP_WORDS/COMP_CWORD, and prints what comes back. Overrides complete
as KEY=VALUE: the config groups and their choices (read from conf/ without Hydra, as --help does) and stage
names for stages=[...]; run and stage arguments complete from the recorded runs."""
from __future__ import annotations

import os
from pathlib import Path

from click.shell_completion import BashComplete, CompletionItem, add_completion_class, split_arg_string

from launcher.paths import CONFIG_GROUPS, group_choices
from launcher.stages import STAGES


def complete_override(ctx, param, incomplete: str) -> list[CompletionItem]:
    key, equals, value = incomplete.partition("=")
    if not equals:
        keys = [*(f"{group}=" for group in CONFIG_GROUPS), "stages=["]
        return [CompletionItem(k) for k in keys if k.startswith(incomplete)]
    if key == "stages":
        # stages=[data_preparation,tr -> the last name completes, and the list closes: type `,` first for more.
        head, _, partial = value.lstrip("[").rpartition(",")
        chosen = [s for s in head.split(",") if s]
        prefix = f"stages=[{head + ',' if head else ''}"
        return [CompletionItem(f"{prefix}{stage}]") for stage in STAGES
                if stage.startswith(partial) and stage not in chosen]
    group = key.lstrip("+")
    if group in CONFIG_GROUPS:
        return [CompletionItem(f"{key}={choice}") for choice in group_choices(group) if choice.startswith(value)]
    return []


def complete_run(ctx, param, incomplete: str) -> list[CompletionItem]:
    from launcher import records, run_index

    results_dir = ctx.params.get("results_dir") or Path("results")
    names = {p.name for p in records.all_runs(Path(results_dir))} | {p.name for p in run_index.all_runs()}
    return [CompletionItem(name) for name in sorted(names) if name.startswith(incomplete)]


def complete_stage(ctx, param, incomplete: str) -> list[CompletionItem]:
    return [CompletionItem(stage) for stage in STAGES if stage.startswith(incomplete)]


class _BashComplete(BashComplete):
    """Bash splits words at `=` (COMP_WORDBREAKS), so `training=gp<TAB>` arrives as `training`, `=`, `gp`, and
    bash replaces only the text after the `=`. Glue the words back for completion, then answer only that text.
    The script adds no space after a key (`training=`) or an open list (`stages=[`): the word goes on."""

    source_template = """\
%(complete_func)s() {
    local IFS=$'\\n' line type value
    COMPREPLY=()
    for line in $(env COMP_WORDS="${COMP_WORDS[*]}" COMP_CWORD=$COMP_CWORD %(complete_var)s=bash_complete $1); do
        IFS=',' read -r type value <<< "$line"
        case $type in
            plain) COMPREPLY+=("$value")
                   case $value in *= | *\\[) compopt -o nospace ;; esac ;;
            dir) COMPREPLY=(); compopt -o dirnames ;;
            file) COMPREPLY=(); compopt -o default ;;
        esac
    done
}
complete -o nosort -F %(complete_func)s %(prog_name)s
"""

    def get_completion_args(self) -> tuple[list[str], str]:
        words = split_arg_string(os.environ.get("COMP_WORDS", ""))
        cword = int(os.environ.get("COMP_CWORD", "0"))
        words = words[:cword + 1] + [""] * (cword + 1 - len(words))  # the cursor after a space: an empty word
        glued: list[str] = []
        after_equals = False
        for word in words[1:]:
            if glued and (word == "=" or after_equals):
                glued[-1] += word
            else:
                glued.append(word)
            after_equals = word == "="
        glued = glued or [""]
        typed = "" if words[cword] == "=" else words[cword]  # what bash will replace
        self._cut = len(glued[-1]) - len(typed)
        return glued[:-1], glued[-1]

    def format_completion(self, item: CompletionItem) -> str:
        return f"{item.type},{item.value[self._cut:]}"


add_completion_class(_BashComplete, "bash")
