"""The one-line errors the documentation shows are the ones tfkv-run prints: in a `text` block marked
`<!-- check: output -->`, each `$ tfkv-run ...` line is followed by the line it prints,
`tfkv-run: <message>`, and the command, composed and validated as tfkv-run does before it starts
anything (tests/docs/test_commands.py's check_run), fails with exactly that message.

Only mistakes found before anything starts can be shown so: the block's commands are composed in
this process, never run."""

from __future__ import annotations

import re
import shlex
import sys
from pathlib import Path

import pytest
from test_commands import ROOT, Command, CommandFailed, check_run

_MARKER = re.compile(r"^\s*<!--\s*check:\s*output\s*-->\s*$")
PROMPT = "$ "


def shown(root: Path = ROOT) -> list[tuple[str, int, list[str], str]]:
    """(page, line, argv, the line it prints) of each command of the marked `text` blocks."""
    found = []
    for page in [root / "README.md", *sorted((root / "docs").rglob("*.md"))]:
        lines = page.read_text().splitlines()
        for i, line in enumerate(lines):
            if line.strip() != "```text" or i == 0 or not _MARKER.match(lines[i - 1]):
                continue
            end = next(j for j in range(i + 1, len(lines)) if lines[j].strip().startswith("```"))
            body = lines[i + 1:end]
            for k, text in enumerate(body):
                if text.startswith(PROMPT):
                    said = body[k + 1] if k + 1 < len(body) else ""
                    found.append((str(page.relative_to(root)), i + 2 + k, shlex.split(text[len(PROMPT):]), said))
    return found


def test_the_marked_blocks_are_found() -> None:
    pages = {page for page, *_ in shown()}
    assert {"README.md", "docs/getting-started/first-run.md", "docs/guides/troubleshooting.md"} <= pages, pages


SHOWN = shown()


@pytest.mark.parametrize("page,line,argv,said", SHOWN, ids=[f"{p}:{n}" for p, n, *_ in SHOWN])
def test_a_shown_error_is_what_tfkv_run_says(page: str, line: int, argv: list[str], said: str,
                                             tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert argv[0] == "tfkv-run" and said.startswith("tfkv-run: "), \
        f"{page}:{line}: a marked block shows `$ tfkv-run ...` and then the line it prints, `tfkv-run: ...`"
    monkeypatch.setattr(sys, "argv", argv)  # tfkv's hints read the command line, as tfkv-run has it
    with pytest.raises(CommandFailed) as failed:
        check_run(Command(page, line, argv), tmp_path)
    assert f"tfkv-run: {failed.value}" == said, f"{page}:{line}: tfkv-run says\ntfkv-run: {failed.value}"
