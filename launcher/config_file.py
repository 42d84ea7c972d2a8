"""A YAML file a user gives as a config (`training=@FILE`, `explain-config FILE`), looked at before anything parses it
in full: a config is a few KiB of plain keys, and what is far from that is refused on one line instead of costing
minutes, gigabytes or the interpreter (issue 39's sweep: a 50 MB file parsed for minutes; libyaml's composer
crashes the process on 100,000 nested brackets; a 1 KiB file of aliases expands to a billion values;
issue 57's: a 100 KB string aliased 400 times is 40 MB of text, which explain-config printed for minutes).

The scan reads libyaml's event stream, which is flat, so nothing here recurses however deep the file nests."""

from __future__ import annotations

from pathlib import Path

from launcher.errors import UserError

MAX_FILE_BYTES = 128 << 10  # NxD Training's and NeMo-Launcher's largest configs are under 16 KiB
MAX_DEPTH = 64              # theirs nest 5 deep
MAX_VALUES = 100_000        # keys, values and collections, after every alias is expanded
MAX_EXPANDED_BYTES = 1 << 20  # the text of its scalars, after every alias is expanded (8 x the largest file)
MAX_KEY_CHARS = 256         # a key is a name (theirs are under 60 characters)
EXCERPT_CHARS = 60          # what an error line quotes of a file's text


def read(path: str, at: str, what: str) -> str:
    """The text of the file behind `path`, checked: it exists, is small, is YAML, and is shaped like a config. `at`
    names it in errors (e.g. `training=@FILE`); `what` is what it should be ("an NxD Training ... training YAML")."""
    import yaml

    file = Path(path).expanduser()
    try:
        found = file.is_file()
        size = file.stat().st_size if found else 0
    except OSError as error:  # e.g. a name longer than the file system takes
        raise UserError(f"{at[:80]}...: {error.strerror}; give the path of {what}") from None
    if not found:
        raise UserError(f"{at}: {'not a file' if file.exists() else 'no such file'}; give the path of {what}")
    if size > MAX_FILE_BYTES:
        raise UserError(f"{at}: {size / 2**20:.1f} MiB is too large to be a config (at most {MAX_FILE_BYTES >> 10} "
                        f"KiB is read; configs are a few KiB); give {what}")
    try:
        text = file.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise UserError(f"{at}: not a text file (byte {error.start} is not UTF-8); give {what}") from None
    except OSError as error:
        raise UserError(f"{at}: cannot be read ({error.strerror}); give {what}") from None
    try:
        problem = _shape_problem(yaml.parse(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader)))
    except yaml.MarkedYAMLError as error:
        if "maximum nesting depth" in (error.problem or ""):  # libyaml's own cap (1,000 in PyYAML 6.0.4's wheels)
            mark = error.problem_mark          # stops its scanner before our count of events sees the file
            raise UserError(f"{at}: nests more than {MAX_DEPTH} levels deep (line {mark.line + 1 if mark else 1}); "
                            f"give {what}") from None
        raise UserError(f"{at.removesuffix(str(path))}{syntax_error(path, error, text)}") from None
    except yaml.YAMLError as error:
        raise UserError(f"{at}: not valid YAML ({str(error).splitlines()[0]})") from None
    if problem:
        raise UserError(f"{at}: {problem}; give {what}")
    return text


def _shape_problem(events) -> str | None:
    """Too deep, too many values or too much text once aliases are expanded, a document that is not a mapping, or a
    key no config has (a page of text): counted from the events alone, in one pass."""
    import yaml

    expanded: dict[str, tuple[int, int]] = {}  # anchor -> (values, bytes of text) it stands for
    open_nodes: list[list] = []  # [anchor, values in it so far, bytes so far, is a mapping, children] of each open one
    total = size = 0
    root = False  # the next node is a document's own
    for event in events:
        if isinstance(event, (yaml.MappingEndEvent, yaml.SequenceEndEvent)):
            anchor, values, text, _, _ = open_nodes.pop()
            if anchor:
                expanded[anchor] = (values, text)
            if open_nodes:
                open_nodes[-1][1] += values
                open_nodes[-1][2] += text
            continue
        if isinstance(event, yaml.DocumentStartEvent):
            root = True
            continue
        if not isinstance(event, (yaml.MappingStartEvent, yaml.SequenceStartEvent, yaml.ScalarEvent,
                                  yaml.AliasEvent)):
            continue  # stream and document ends
        line = event.start_mark.line + 1
        if root and isinstance(event, yaml.ScalarEvent) and event.value:
            return f"holds text, not a config mapping (line {line}: {excerpt(event.value)!r})"
        root = False
        is_key = bool(open_nodes) and open_nodes[-1][3] and open_nodes[-1][4] % 2 == 0
        if open_nodes:
            open_nodes[-1][4] += 1
        if isinstance(event, (yaml.MappingStartEvent, yaml.SequenceStartEvent)):
            open_nodes.append([event.anchor, 1, 0, isinstance(event, yaml.MappingStartEvent), 0])
            if len(open_nodes) > MAX_DEPTH:
                return f"nests more than {MAX_DEPTH} levels deep (line {line})"
            added, text = 1, 0  # its parent counts it, with its contents, when it closes
        elif isinstance(event, yaml.AliasEvent):
            added, text = expanded.get(event.anchor, (1, 0))
        else:
            added, text = 1, len(event.value.encode())
            if is_key and len(event.value) > MAX_KEY_CHARS:
                return (f"has a key of {len(event.value):,} characters (line {line}: {excerpt(event.value)!r}); "
                        f"a config's keys are names of at most {MAX_KEY_CHARS}")
            if event.anchor:
                expanded[event.anchor] = (1, text)
        if open_nodes:
            open_nodes[-1][1] += added
            open_nodes[-1][2] += text
        total += added
        size += text
        if total > MAX_VALUES:
            return (f"holds more than {MAX_VALUES:,} values once its aliases (*name) are expanded (line {line}); a "
                    f"config is a few hundred")
        if size > MAX_EXPANDED_BYTES:
            return (f"holds more than {MAX_EXPANDED_BYTES >> 20} MiB of text once its aliases (*name) are expanded "
                    f"(line {line}); a config is a few KiB")
    return None


def excerpt(text: str, limit: int = EXCERPT_CHARS) -> str:
    """At most `limit` characters of `text` (whitespace runs as one space), for an error line that quotes a file."""
    text = " ".join(str(text).split())
    return text if len(text) <= limit else f"{text[:limit - 1]}…"


def syntax_error(path: str, error, text: str = "") -> str:
    """A YAML syntax error as `FILE:LINE:COLUMN: what`, the way compilers name a place in a file."""
    mark = error.problem_mark or error.context_mark
    where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
    problem = error.problem or error.context or "not valid YAML"
    tab = mark is not None and text[mark.index:mark.index + 1] == "\t" or "'\\t'" in problem
    return f"{where}: not valid YAML: {problem}{'; YAML indents with spaces, not tabs' if tab else ''}"
