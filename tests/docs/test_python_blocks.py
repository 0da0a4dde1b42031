"""The Python examples the documentation marks `<!-- check: run -->` run as shown: each block in a
fresh interpreter, and each `print(...)  # -> text` line prints exactly `text`.

Other Python blocks are sketches (a model to adapt, a fragment of a script) and are not run."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_MARKER = re.compile(r"^\s*<!--\s*check:\s*(.*?)\s*-->\s*$")
_EXPECT = re.compile(r"^\s*print\(.*\)\s*#\s*->\s?(.*)$")


def blocks(root: Path = ROOT) -> list[tuple[str, int, str]]:
    """(page, line, code) of every Python block whose fence follows a `check: run` marker."""
    found = []
    for page in [root / "README.md", *sorted((root / "docs").rglob("*.md"))]:
        lines = page.read_text().splitlines()
        for i, line in enumerate(lines):
            if line.strip() != "```python" or i == 0:
                continue
            marker = _MARKER.match(lines[i - 1])
            if not marker or "run" not in [m.strip() for m in marker.group(1).split(",")]:
                continue
            end = next(j for j in range(i + 1, len(lines)) if lines[j].strip().startswith("```"))
            found.append((str(page.relative_to(root)), i + 2, "\n".join(lines[i + 1:end])))
    return found


def expected_output(code: str) -> list[str]:
    return [m.group(1).rstrip() for m in map(_EXPECT.match, code.splitlines()) if m]


def test_the_marked_blocks_are_found() -> None:
    # The sparse embeddings guide's API example is marked; a parser that finds nothing fails here.
    assert any(page == "docs/guides/sparse-embeddings.md" for page, _, _ in blocks())


def test_expected_output_is_read_from_print_comments() -> None:
    assert expected_output("x = 1\nprint(x)  # -> 1\nprint(2)\nprint([1])  # -> [1]") == ["1", "[1]"]


@pytest.mark.parametrize("page,line,code", blocks(), ids=[f"{p}:{n}" for p, n, _ in blocks()])
def test_block_runs_as_shown(page: str, line: int, code: str, tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{page}:{line}: the example fails:\n{done.stderr[-2000:]}"
    printed = [line.rstrip() for line in done.stdout.splitlines()]
    want = expected_output(code)
    assert printed == want, f"{page}:{line}: printed {printed}, the page says {want}"
