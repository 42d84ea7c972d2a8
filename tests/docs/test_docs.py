"""Docs are tests: every ```bash block in README.md and docs/*.md runs here, so a command that drifts from the
code fails CI with its file and line.

The marker on the line before a block says how it runs:
- none: as written, from a fresh directory that looks like a checkout (tests/, conf/, ... linked in; results/,
  data/ and pcluster/ its own), with this checkout's `nxdt-launch` on PATH and a HOME of its own.
- `<!-- cluster: dry-run -->`: the block needs a cluster. Its `nxdt-launch` commands run as on a head node whose
  nodes are all busy (tests/fake_slurm.py first on PATH: a FAKE Slurm whose sbatch refuses), with `--dry-run`
  appended (for the commands that take it): a dry run must neither submit nor depend on the cluster's state; commands that only compute here (`estimate`,
  `explain-config`, `cluster-config`, `--help`) run as written; `status`, `logs`, `cancel`, `plot` and
  `cluster-validate --show` act on what a real launch recorded, so the CLI parses them (every option and argument
  checked) without running them. The block's other commands (ssh, `source` of the cluster's venv, git clone) are
  the cluster's and are not run.
- `<!-- dry-run: REASON -->`: a local command whose run the suite makes elsewhere (the reason names where): its
  `nxdt-launch` commands run here with `--dry-run` appended, the block's other commands as written.
- `<!-- not-run: REASON -->`: not run; the reason is required.
A fence marked sh, shell, console or zsh is refused: commands go in ```bash blocks. A plain ``` block is a
synopsis or output, and is not run.

Absolute paths under /fsx (the cluster's shared file system in every example) are moved under the block's own
directory, so a dry run writes nothing outside it. `nxdt-launch` commands run in this process
(launcher.cli.run, as the fuzz test does: about 0.15 s each against 1 s for a new interpreter); bash expands
their arguments first, exactly as it would for a user, and runs every other command.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shlex
import subprocess
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests import fake_slurm
from tests.launcher.helpers import REPO

DOCS = sorted([REPO / "README.md", *(REPO / "docs").glob("*.md")])
DRY_RUN = "<!-- cluster: dry-run -->"
NOT_RUN = re.compile(r"^<!--\s*not-run:(.*)-->$")
DRY_RUN_HERE = re.compile(r"^<!--\s*dry-run:(.*)-->$")
MARKER = re.compile(r"^<!--\s*(cluster|not-run|dry-run)\b.*-->$")
FENCE = re.compile(r"^(\s*)```(\S*)\s*$")
# Parts of a checkout the docs name by relative path; a block's directory links them, and owns everything else.
CHECKOUT = ("benchmarks", "conf", "csp_tools", "docs", "launcher", "runtime", "templates", "tests", "pyproject.toml")
# Subcommands that read what a real launch recorded (a dry run records nothing for them to read).
RECORD_READERS = ("status", "logs", "cancel", "plot")


@dataclass
class Command:
    doc: Path
    line: int          # 1-based line of the command's first line in the doc
    text: str          # continuations joined, comment dropped


@dataclass
class Block:
    doc: Path
    line: int          # the opening fence
    mode: str          # run | dry-run | not-run
    reason: str
    commands: list[Command]


def _where(doc: Path, line: int) -> str:
    return f"{doc.relative_to(REPO) if doc.is_relative_to(REPO) else doc}:{line}"


def _strip_comment(text: str) -> str:
    """The command without its trailing `# comment` (a # that starts a word, outside quotes)."""
    quote, previous = None, " "
    for i, char in enumerate(text):
        if quote:
            if char == quote:
                quote = None
        elif char in "'\"":
            quote = char
        elif char == "#" and previous.isspace():
            return text[:i].rstrip()
        previous = char
    return text.rstrip()


def parse(doc: Path) -> tuple[list[Block], list[str]]:
    """The doc's bash blocks, and the convention's violations (a marker with no block, a reason left out,
    commands in a fence that is not bash)."""
    lines = doc.read_text().splitlines()
    blocks, problems = [], []
    i = 0
    while i < len(lines):
        fence = FENCE.match(lines[i])
        if not fence:
            if MARKER.match(lines[i].strip()):
                following = next((ln for ln in lines[i + 1:] if ln.strip()), "")
                if not (FENCE.match(following) and FENCE.match(following).group(2) == "bash"):
                    problems.append(f"{_where(doc, i + 1)}: a marker must come right before a ```bash block")
            i += 1
            continue
        indent, language = fence.groups()
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == "```"), len(lines))
        body = [ln[len(indent):] if ln.startswith(indent) else ln.lstrip() for ln in lines[i + 1:end]]
        if language != "bash":
            if language in ("sh", "shell", "console", "zsh"):  # a plain ``` block is a synopsis or output
                problems.append(f"{_where(doc, i + 1)}: commands go in ```bash blocks (this fence is ```{language})")
            i = end + 1
            continue
        before = next((lines[j].strip() for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        mode, reason = "run", ""
        if before == DRY_RUN:
            mode = "dry-run"
        elif match := NOT_RUN.match(before) or DRY_RUN_HERE.match(before):
            mode, reason = "not-run" if before.removeprefix("<!--").strip().startswith("not-run") else "dry-run-here", \
                match.group(1).strip()
            if not reason:
                problems.append(f"{_where(doc, i + 1)}: `{mode.removesuffix('-here')}:` needs its reason")
        elif MARKER.match(before):
            problems.append(f"{_where(doc, i + 1)}: unknown marker {before!r}; use {DRY_RUN}, "
                            f"<!-- dry-run: REASON --> or <!-- not-run: REASON -->")
        commands, pending, start = [], "", 0
        for offset, raw in enumerate(body):
            if not pending:
                start = i + 2 + offset
            if raw.rstrip().endswith("\\"):
                pending += raw.rstrip()[:-1] + " "
                continue
            text = _strip_comment(pending + raw).strip()
            pending = ""
            if text:
                commands.append(Command(doc, start, text))
        blocks.append(Block(doc, i + 1, mode, reason, commands))
        i = end + 1
    return blocks, problems


def _split(text: str) -> list[str]:
    """A command line cut at `&&` and `;` outside quotes (the docs chain commands no other way)."""
    parts, quote, start, i = [], None, 0, 0
    while i < len(text):
        char = text[i]
        if quote:
            quote = None if char == quote else quote
        elif char in "'\"":
            quote = char
        elif text.startswith("&&", i) or char == ";":
            parts.append(text[start:i].strip())
            i += 2 if char == "&" else 1
            start = i
            continue
        i += 1
    parts.append(text[start:].strip())
    return [p for p in parts if p]


class Sandbox:
    """One doc's directory, HOME and environment; the doc's blocks run in order in it, as a reader follows it."""

    def __init__(self, root: Path):
        self.root = root
        self.cwd = root / "checkout"
        self.cwd.mkdir()
        for name in CHECKOUT:
            (self.cwd / name).symlink_to(REPO / name)
        home = root / "home"
        (home / ".ssh").mkdir(parents=True)
        (home / ".ssh" / "my-key.pem").write_text("placeholder: the docs' example key; a dry run connects nowhere\n")
        bin_dir = root / "bin"
        bin_dir.mkdir()
        shim = bin_dir / "nxdt-launch"
        shim.write_text(f"#!/bin/sh\nexec {shlex.quote(sys.executable)} -m launcher.cli \"$@\"\n")
        shim.chmod(0o755)
        self.env = {**os.environ, "HOME": str(home), "NXDT_STATE_DIR": str(root / "state"),
                    "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
                    "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
        # cluster_type=auto must find no Slurm, even on a machine whose /etc/slurm answers: nothing is submitted
        # from here. The cluster blocks get a fake head node instead (cluster_env).
        self.env["SLURM_CONF"] = str(root / "no-slurm.conf")
        from launcher import pcluster

        # The schema check cluster-config runs: where find_python looks, or where .ci/run installs it.
        ci_venv = Path.home() / ".cache" / "nxdt" / "pcluster-venv" / "bin" / "python"
        python = pcluster.find_python() or (str(ci_venv) if ci_venv.exists() else None)
        if python:
            self.env["NXDT_PCLUSTER_PYTHON"] = python
        fake, conf, _ = fake_slurm.install(root)
        self.cluster_env = {**self.env, "SLURM_CONF": str(conf), "PATH": f"{fake}{os.pathsep}{self.env['PATH']}"}

    def relocate(self, text: str) -> str:
        return re.sub(r"(?<![\w./])/fsx(?=/|\b)", str(self.root / "fsx"), text)

    def bash(self, script: str) -> subprocess.CompletedProcess:
        return subprocess.run(["bash", "-c", script], cwd=self.cwd, env=self.env, capture_output=True, text=True,
                              timeout=300)

    def argv(self, words: str) -> list[str]:
        """The arguments as bash passes them: quotes, $VARS, ~ and $(...) exactly as for a reader."""
        if not words.strip():
            return []
        done = self.bash(f"printf '%s\\0' {words}")
        assert done.returncode == 0, done.stderr
        return done.stdout.split("\0")[:-1]

    def nxdt(self, argv: list[str], env: dict[str, str]) -> tuple[int, str]:
        from launcher.cli import run

        out = io.StringIO()
        saved_env, saved_cwd = dict(os.environ), os.getcwd()
        os.environ.clear()
        os.environ.update(env)
        os.chdir(self.cwd)
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
                code = run(argv)
        finally:
            os.chdir(saved_cwd)
            os.environ.clear()
            os.environ.update(saved_env)
        return code, out.getvalue()


def _parse_only(argv: list[str]) -> tuple[int, str]:
    """Click's parse of a command that acts on a real launch's record: options and arguments are checked."""
    import click

    from launcher.cli import cli

    try:
        with cli.make_context("nxdt-launch", list(argv), resilient_parsing=False) as ctx:
            name, command, rest = cli.resolve_command(ctx, _tokens(ctx))
            command.make_context(name, rest, parent=ctx)
    except click.ClickException as error:
        return 2, error.format_message()
    return 0, ""


def _tokens(ctx) -> list[str]:
    """The words after the group's options. Click 9 moves protected_args into args; until then both are needed."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return [*ctx.protected_args, *ctx.args]


def _takes_dry_run(argv: list[str]) -> bool:
    from launcher.cli import cli

    import click

    with cli.make_context("nxdt-launch", list(argv), resilient_parsing=True) as ctx:
        words = _tokens(ctx)
        if not words:
            return True
        command = cli.get_command(ctx, words[0]) or cli.commands["launch"]
        return any(isinstance(p, click.Option) and p.name == "dry_run" for p in command.params)


def run_command(box: Sandbox, command: Command, mode: str) -> list[str]:
    failures = []
    for part in _split(box.relocate(command.text)):
        word, _, words = part.partition(" ")
        if word != "nxdt-launch":
            if mode == "dry-run":
                continue  # the cluster's own commands
            done = box.bash(part)
            code, output = done.returncode, done.stdout + done.stderr
        else:
            argv = box.argv(words)
            sub = next((a for a in argv if not a.startswith("-")), "")
            if mode == "dry-run" and (sub in RECORD_READERS or (sub == "cluster-validate" and "--show" in argv)):
                code, output = _parse_only(argv)
            else:
                if mode.startswith("dry-run") and "--dry-run" not in argv and "--help" not in argv \
                        and _takes_dry_run(argv):
                    argv.append("--dry-run")
                code, output = box.nxdt(argv, box.cluster_env if mode == "dry-run" else box.env)
            part = shlex.join(["nxdt-launch", *argv])
        if code != 0:
            failures.append(f"{_where(command.doc, command.line)}: exit {code}: {part}\n{output[-3000:]}")
            break  # `a && b`: b depends on a
    return failures


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_every_command_in_the_doc_runs(doc, tmp_path):
    blocks, problems = parse(doc)
    assert not problems, "\n".join(problems)
    box = Sandbox(tmp_path)
    failures = []
    for block in blocks:
        if block.mode == "not-run":
            continue
        for command in block.commands:
            failures += run_command(box, command, block.mode)
    assert not failures, "\n\n".join(failures)


def test_the_convention_is_checked(tmp_path):
    """The parser itself: markers, a missing reason, a marker without a block, commands outside ```bash."""
    text = "\n".join([
        "<!-- cluster: dry-run -->", "```bash", "nxdt-launch stages=[training] \\", "    training=llama/tiny  # a comment",
        "```", "<!-- not-run: -->", "```bash", "pip install x", "```", "```sh", "nxdt-launch status", "```",
        "<!-- not-run: needs AWS -->", "prose", "```bash", "echo '#not a comment' && true", "```",
        "<!-- dry-run: trained by test_x -->", "```bash", "nxdt-launch training.trainer.max_steps=20", "```",
        "<!-- dry-run: -->", "```bash", "nxdt-launch", "```",
    ])
    probe = tmp_path / "probe.md"
    probe.write_text(text)
    blocks, problems = parse(probe.resolve())
    assert [b.mode for b in blocks] == ["dry-run", "not-run", "run", "dry-run-here", "dry-run-here"]
    assert blocks[3].reason == "trained by test_x"
    assert blocks[0].commands[0].text.split() == ["nxdt-launch", "stages=[training]", "training=llama/tiny"]
    assert blocks[0].commands[0].line == 3
    assert blocks[2].commands[0].text == "echo '#not a comment' && true"
    assert _split(blocks[2].commands[0].text) == ["echo '#not a comment'", "true"]
    assert len(problems) == 4, problems
    assert "needs its reason" in problems[0] and "```bash blocks" in problems[1] and "marker must come" in problems[2]
    assert problems[3].endswith("`dry-run:` needs its reason")
