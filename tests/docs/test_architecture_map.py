"""docs/architecture.md maps the folders: every package and top-level module of launcher/, runtime/ and csp_tools/
is named there, so a new part cannot arrive without its place in the map (and a renamed one leaves a stale name
that review sees next to this test)."""
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def top_level_parts(root: Path) -> list[Path]:
    return [p for p in sorted(root.iterdir())
            if (p.suffix == ".py" and p.name != "__init__.py") or (p.is_dir() and (p / "__init__.py").is_file())]


def unmapped(text: str, roots=("launcher", "runtime", "csp_tools"), repo: Path = REPO) -> list[str]:
    return [str(p.relative_to(repo)) for root in roots for p in top_level_parts(repo / root)
            if f"`{p.name}`" not in text and f"`{p.name}/`" not in text]


def test_every_package_and_top_level_module_is_on_the_map():
    assert unmapped((REPO / "docs/architecture.md").read_text()) == []


def test_the_map_check_catches_a_part_left_out():
    text = (REPO / "docs/architecture.md").read_text().replace("`torchrun.py`", "the torchrun wrapper")
    assert unmapped(text) == ["runtime/torchrun.py"]
