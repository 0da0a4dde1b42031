"""README.md is the front door (at most 250 lines, the two set-up commands first) and its code
comes from files that tests run: each of its `bash` blocks after the set-up commands is, byte for
byte, a file of docs/snippets/, which the pages include and tests/docs/test_commands.py composes
or runs. CHANGELOG.md has a section for the version pyproject.toml declares. CI runs the README's
test command with the cluster programs hidden (.ci/bare), as on a machine with only what it installs."""

import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from conftest import need_root

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
SNIPPETS = REPO / "docs" / "snippets"
SETUP = ("python3 -m pip install '.[cpu]' && tfkv-run\n"
         "python3 -m pip install '.[cpu,test]' && pytest -n 2\n")


def bash_blocks(text: str) -> list[str]:
    return re.findall(r"^```bash\n(.*?)^```", text, flags=re.S | re.M)


def test_the_readme_is_a_front_door_of_at_most_250_lines_that_starts_with_the_two_setup_commands():
    text = README.read_text()
    assert len(text.splitlines()) <= 250
    first = re.search(r"^```(\w*)\n(.*?)^```", text, flags=re.S | re.M)
    assert first and first.group(1) == "bash" and first.group(2) == SETUP, first and first.group(0)
    assert text.index("```") < text.index("\n## ")  # before any section


def test_every_readme_command_block_is_a_snippet_file_and_every_snippet_is_shown():
    blocks = bash_blocks(README.read_text())[1:]
    snippets = {p.name: p.read_text() for p in SNIPPETS.glob("*.sh")}
    assert blocks, "the README shows no experiment, sweep or cluster run"
    unknown = [b for b in blocks if b not in snippets.values()]
    assert not unknown, f"README blocks that are no file of docs/snippets/ (copy them there): {unknown}"
    pages = "\n".join(p.read_text() for p in (REPO / "docs").rglob("*.md"))
    unused = [n for n, text in snippets.items() if text not in blocks and f'docs/snippets/{n}"' not in pages]
    assert not unused, f"snippets neither README nor a page shows: {unused}"


def test_the_changelog_has_the_declared_version_and_the_site_includes_it():
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    changelog = (REPO / "CHANGELOG.md").read_text()
    assert "## [Unreleased]" in changelog
    assert re.search(rf"^## \[{re.escape(version)}\] - \d{{4}}-\d{{2}}-\d{{2}}$", changelog, flags=re.M), version
    assert '--8<-- "CHANGELOG.md"' in (REPO / "docs" / "changelog.md").read_text()


def test_every_link_of_the_readme_leads_to_a_file_of_the_repository():
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", README.read_text())
    local = [link for link in links if "://" not in link]
    assert local, "the README links to no page"
    assert not [link for link in local if not (REPO / link).is_file()], "README links to files that are not there"


# The README's test command passes on a machine with only what the README installs; CI's machine has
# every cluster program (.ci/run installs them for the slow suite), so CI runs it with those hidden.
BARE = REPO / ".ci" / "bare"
CLUSTER_PROGRAMS = ("mpirun", "srun", "sbatch", "qsub", "sshd", "ssh", "rsync", "ip", "tc", "strace")


def test_ci_runs_the_readmes_test_command_as_on_a_bare_machine():
    run = (REPO / ".ci" / "run").read_text()
    command = SETUP.splitlines()[1].split("&& ", 1)[1]  # pytest -n 2
    assert re.search(rf"^\.ci/bare {re.escape(command)}\b", run, flags=re.M), \
        f".ci/run does not run `{command}` under .ci/bare"
    hidden = re.search(r"^PROGRAMS=\((.*?)\)", BARE.read_text(), flags=re.M | re.S).group(1).split()
    assert set(CLUSTER_PROGRAMS) <= set(hidden), set(CLUSTER_PROGRAMS) - set(hidden)


@pytest.mark.slow
def test_ci_bare_hides_the_cluster_programs_from_its_command_only():
    need_root(".ci/bare (a mount namespace)")
    here = [p for p in CLUSTER_PROGRAMS if shutil.which(p, path=os.environ["PATH"] + ":/usr/sbin:/sbin")]
    assert here, "no cluster program is installed here: run .ci/run first"
    probe = f"import shutil; print([p for p in {here!r} if shutil.which(p, path=shutil.os.environ['PATH'] + ':/usr/sbin:/sbin')])"
    inside = subprocess.run([str(BARE), sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert inside.returncode == 0 and inside.stdout.strip() == "[]", inside.stdout + inside.stderr
    failed = subprocess.run([str(BARE), here[0], "--version"], capture_output=True, text=True, timeout=60)
    assert failed.returncode == 126, failed  # found by name but not runnable: exec is refused
    assert all(shutil.which(p, path=os.environ["PATH"] + ":/usr/sbin:/sbin") for p in here)  # back outside
