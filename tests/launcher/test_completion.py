"""Tab completion through click's protocol, as a shell drives it: _NXDT_LAUNCH_COMPLETE=<shell>_complete with
COMP_WORDS and COMP_CWORD. Bash splits `training=gp` into `training`, `=`, `gp` (COMP_WORDBREAKS) and replaces
only the text after `=`; zsh passes the word whole. The last test sources the bash script into a real bash."""

import os
import shutil
import subprocess
import sys

import pytest

from launcher.paths import group_choices

from .helpers import REPO, nxdt


def complete(shell: str, words: str, cword: int) -> list[str]:
    result = nxdt(env={"_NXDT_LAUNCH_COMPLETE": f"{shell}_complete", "COMP_WORDS": words, "COMP_CWORD": str(cword)})
    assert result.returncode == 0, result.stderr
    if shell == "bash":  # type,value per line
        return [line.split(",", 1)[1] for line in result.stdout.splitlines()]
    lines = result.stdout.splitlines()  # zsh: type, value, help, per item
    return [lines[i + 1] for i in range(0, len(lines), 3)]


def test_bash_completes_the_choices_of_a_config_group_after_the_equals():
    assert complete("bash", "nxdt-launch training =", 2) == group_choices("training")
    assert complete("bash", "nxdt-launch training = llama3/8", 3) == ["llama3/8b", "llama3/8b_gpu", "llama3/8b_trn2"]
    assert "gpt3/126m" in complete("bash", "nxdt-launch training = gp", 3)
    # After other overrides too: they are the arguments of the launch the words go to.
    assert "slurm" in complete("bash", "nxdt-launch training = gpt3/tiny cluster = ", 5)


def test_zsh_completes_whole_key_value_words():
    assert complete("zsh", "nxdt-launch training=llama3/8", 1) == [
        "training=llama3/8b", "training=llama3/8b_gpu", "training=llama3/8b_trn2"]


def test_stages_complete_to_stage_names():
    assert complete("zsh", "nxdt-launch stages=", 1) == [
        "stages=[data_preparation]", "stages=[training]", "stages=[fine_tuning]", "stages=[peft]", "stages=[alignment]",
        "stages=[rlhf_rm]", "stages=[rl]", "stages=[conversion]", "stages=[evaluation]"]
    assert complete("bash", "nxdt-launch stages = [data_preparation,tr", 3) == ["[data_preparation,training]"]


def test_the_first_word_is_a_command_or_a_key():
    first = complete("bash", "nxdt-launch ", 1)
    assert {"status", "logs", "cancel", "estimate", "cluster-validate"} <= set(first)
    assert {"training=", "cluster=", "stages=["} <= set(first)
    assert "launch" not in first  # the hidden command the overrides go to
    assert complete("bash", "nxdt-launch sta", 1) == ["status", "stages=["]
    assert {"--dry-run", "--version", "--help"} <= set(complete("bash", "nxdt-launch --", 1))


def test_logs_completes_stage_names():
    assert complete("bash", "nxdt-launch logs myrun con", 3) == ["conversion"]


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash")
def test_the_bash_script_completes_in_bash(tmp_path):
    """The activation line of docs/cli.md, with nxdt-launch on PATH as an installed one would be."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nxdt-launch").write_text('#!/bin/sh\nexec "$NXDT_PYTHON" -m launcher.cli "$@"\n')
    (bin_dir / "nxdt-launch").chmod(0o755)
    script = ('eval "$(_NXDT_LAUNCH_COMPLETE=bash_source nxdt-launch)"\n'
              'COMP_WORDS=(nxdt-launch training = llama3/8); COMP_CWORD=3\n'
              '_nxdt_launch_completion nxdt-launch 2>/dev/null\n'
              'printf "%s\\n" "${COMPREPLY[@]}"\n')
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "NXDT_PYTHON": sys.executable,
           "PYTHONPATH": str(REPO)}
    result = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["llama3/8b", "llama3/8b_gpu", "llama3/8b_trn2"], result.stderr
