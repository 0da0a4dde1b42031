"""Every command the documentation shows works: the `tfkv-run` and `tfkv-launch` lines of the
`bash` blocks in README.md and docs/**/*.md, and of docs/snippets/*.sh.

A `tfkv-run` command is composed by Hydra's own config loader, in this process, with the
command's overrides (`-m` sweeps, `+experiment=`, `hydra/...=` and `hydra.` keys included) and
validated as tfkv-run validates it before it starts anything (tfkv.check.validate; a sweep:
tfkv.sweep.precheck, every trial's config). Then the checks that need what the reader brings:
the data files it names, the cluster's hosts and tools, the GPUs. A cluster's tools and GPUs are
never taken from this machine: a command that needs them is marked so, whether or not the machine
that checks the docs has them (the fast suite passes on a machine with only what the README
installs, and a GPU or mpirun here does not hide an unmarked block). The comment on the line before
a block's fence changes what is checked (docs/development/docs.md):

    <!-- check: run -->            also run each tfkv-run command, in a temporary directory
    <!-- check: needs data -->     compose and validate only, not the data's files
    <!-- check: needs cluster -->  ... not the hosts file; required for cluster=ssh/mpi/slurm/sge/yarn
    <!-- check: needs gpu -->      required for devices that name a GPU
    <!-- check: skip -->           not checked (output shown as bash, a sketch)

Several combine, separated by commas: `<!-- check: needs data, needs gpu -->`.

In a snippet file, a `# check: <marker>` line applies to the commands after it. A `tfkv-launch`
(`tfkv-emulate`) line is parsed by its own parser; the command it launches, if tfkv-run, is checked as
one of its workers sees it. Each command is one test, named by its page and line.
"""

from __future__ import annotations

import contextlib
import copy
import glob
import io
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import pytest

ROOT = Path(__file__).resolve().parents[2]
MARKERS = ("run", "needs data", "needs cluster", "needs gpu", "skip")
_MARKER = re.compile(r"^\s*(?:<!--\s*check:\s*(.*?)\s*-->|#\s*check:\s*(.*?))\s*$")
_FENCE = re.compile(r"^\s*(```+|~~~+)\s*(\S*)")
_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
_PLACEHOLDER = re.compile(r"<[A-Za-z][^<>]*>")
_SEPARATORS = {"&&", "||", ";", "|", "&"}
# $(command), `command`, $VAR and ${VAR}: what they stand for is the reader's; a word stands in
_EXPANSION = re.compile(r"\$\([^()]*\)|`[^`]*`|\$\{\w+\}|\$\w+")
STAND_IN = "expanded"
COMMANDS = ("tfkv-run", "tfkv-launch", "tfkv-emulate")
# Dataset and model keys that name the reader's files (a glob, a path, or {train: ..., test: ...}).
_PATH_KEYS = {"dataset": ("root", "files", "directory", "x", "y", "npz"), "model": ("path",)}


def _program(launcher: str) -> str | None:
    """The program launcher `launcher` starts its job with, as its backend declares it (the first
    of its `programs` trait, tfkv.launcher.base.Backend); None for one that runs none (local)."""
    from tfkv.launcher.base import REGISTRY, backend_class

    programs = backend_class(launcher).programs if launcher in REGISTRY else ()
    return programs[0].name if programs else None


@dataclass
class Command:
    page: str  # relative to the repository
    line: int  # where the command starts
    argv: list[str]  # tfkv-run or tfkv-launch and its arguments
    env: dict[str, str] = field(default_factory=dict)  # the VAR=value prefixes
    marker: str = ""

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"


class CommandFailed(AssertionError):
    """A documented command that does not work; the message is one line naming where it is."""


def pages(root: Path = ROOT) -> list[Path]:
    """README.md, docs/**/*.md and docs/snippets/*.sh, where they exist."""
    found = [root / "README.md"] if (root / "README.md").is_file() else []
    found += sorted((root / "docs").rglob("*.md"))
    shown = "\n".join(p.read_text() for p in found)
    # a snippet the README or a page shows as a block is checked there, under that block's marker
    return found + [p for p in sorted((root / "docs" / "snippets").glob("*.sh")) if f"```bash\n{p.read_text()}```" not in shown]


def blocks(path: Path) -> Iterator[tuple[int, list[str], str]]:
    """(first line number, lines, marker) of each `bash` block of a Markdown page, or of the
    whole file for a snippet (its `# check:` lines mark what follows them)."""
    lines = path.read_text().splitlines()
    if path.suffix == ".sh":
        marker, start = "", 1
        for n, text in enumerate(lines, 1):
            m = _MARKER.match(text)
            if m:
                if n > start:
                    yield start, lines[start - 1:n - 1], marker
                marker, start = (m.group(1) or m.group(2)), n + 1
        yield start, lines[start - 1:], marker
        return
    n = 0
    while n < len(lines):
        m = _FENCE.match(lines[n])
        if not m:
            n += 1
            continue
        fence, lang = m.group(1), m.group(2).lower()
        end = next((k for k in range(n + 1, len(lines)) if lines[k].strip().startswith(fence)), len(lines))
        if lang in ("bash", "sh", "shell"):
            before = next((lines[k] for k in range(n - 1, -1, -1) if lines[k].strip()), "")
            mm = _MARKER.match(before)
            yield n + 2, lines[n + 1:end], (mm.group(1) or mm.group(2)) if mm else ""
        n = end + 1


def commands(path: Path, root: Path = ROOT) -> list[Command]:
    """The documented tfkv-run and tfkv-launch commands of a page."""
    out = []
    page = str(path.relative_to(root))
    for start, lines, marker in blocks(path):
        logical: list[tuple[int, str]] = []
        joined, first = "", None
        for n, text in enumerate(lines, start):
            first = n if first is None else first
            if text.rstrip().endswith("\\"):
                joined += text.rstrip()[:-1] + " "
                continue
            logical.append((first, joined + text))
            joined, first = "", None
        if joined:
            logical.append((first or start, joined))
        for n, text in logical:
            text = _EXPANSION.sub(STAND_IN, text)  # the reader's shell fills these in
            try:
                words = shlex.split(text, comments=True)
            except ValueError as e:  # an unclosed quote: a reader's shell would refuse it too
                if re.search(r"\btfkv-(run|launch|emulate)\b", text):
                    out.append(Command(page, n, ["(unparsable)", str(e)], marker=marker))
                continue
            segment: list[str] = []
            for word in [*words, ";"]:
                if word not in _SEPARATORS:
                    segment.append(word)
                    continue
                env = {}
                while segment and _ASSIGNMENT.match(segment[0]):
                    key, value = segment.pop(0).split("=", 1)
                    env[key] = value
                if segment and segment[0] in COMMANDS:
                    out.append(Command(page, n, segment, env, marker))
                segment = []
    return out


# ------------------------------------------------------------------------------ checking


@contextlib.contextmanager
def environment(env: dict[str, str]) -> Iterator[None]:
    """The command's VAR=value prefixes in this process's environment while it is checked."""
    before = {k: os.environ.get(k) for k in env}
    os.environ.update({k: os.path.expanduser(v) for k, v in env.items()})
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _hydra_args(args: list[str]) -> object | None:
    """tfkv-run's arguments as Hydra's own parser reads them; None for a flag that answers and
    exits (--version: tfkv-run answers it itself, before Hydra)."""
    from hydra._internal.utils import get_args_parser

    if "--version" in args:
        return None
    parser = get_args_parser()
    parser.prog = "tfkv-run"
    return _parse(parser, args)


def _load(args: object, overrides: list[str], multirun: bool) -> object:
    """Hydra's master config (with `hydra`) for these arguments, as tfkv-run's app loads it."""
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.types import RunMode

    from tfkv import conf_dir

    if args.config_dir:
        overrides = [*overrides, f"hydra.searchpath=[file://{os.path.abspath(args.config_dir)}]"]
    with initialize_config_dir(config_dir=conf_dir(), version_base="1.3"):
        loader = GlobalHydra.instance().config_loader()
        cfg = loader.load_configuration(args.config_name or "config", overrides,
                                        run_mode=RunMode.MULTIRUN if multirun else RunMode.RUN)
        if multirun:
            from tfkv.sweep import precheck

            problem = precheck.problem(cfg)  # every trial composed and validated, as tfkv-run does first
            if problem:
                raise CommandFailed(problem)
    return cfg


def check_run(command: Command, workdir: Path | None = None) -> list[object]:
    """Compose and validate a tfkv-run command; the task configs it gives (one per trial checked)."""
    from omegaconf import OmegaConf, open_dict, read_write

    from tfkv import check, cli, plugins
    from tfkv.errors import message
    from tfkv.hydra_messages import one_line

    args = [cli.expand_home(a) for a in command.argv[1:]]
    placeholder = next((a for a in args if _PLACEHOLDER.search(a)), None)
    if placeholder:
        raise CommandFailed(f"{placeholder} has a placeholder: write a concrete value")
    parsed = _hydra_args(args)
    if parsed is None or parsed.help or parsed.hydra_help or parsed.shell_completion or parsed.info:
        return []  # answers and exits: nothing to compose
    plugins.load()
    try:
        cfg = _load(parsed, list(parsed.overrides), parsed.multirun)
        task = copy.deepcopy(cfg)
        with read_write(task), open_dict(task):
            del task["hydra"]
        if not parsed.multirun:
            check.validate(task)
    except CommandFailed:
        raise
    except Exception as e:  # noqa: BLE001 - a user's mistake is one line; anything else is a bug here
        from hydra.errors import HydraException
        from omegaconf.errors import OmegaConfBaseException

        text = one_line(e) if isinstance(e, (HydraException, OmegaConfBaseException)) else message(e)
        if text is None:
            raise
        raise CommandFailed(text) from None
    return [task] + ([OmegaConf.to_container(cfg.hydra.overrides.task)] if parsed.multirun else [])


def check_needs(command: Command, task: object) -> None:
    """What the reader brings, unless the block says it is needed: the files the command names,
    the hosts file and the launcher's programs, the GPUs."""
    from omegaconf import OmegaConf

    overrides = [a.lstrip("+~") for a in command.argv[1:] if "=" in a]
    if "needs data" not in command.marker:
        for group, keys in _PATH_KEYS.items():
            for key in keys:
                if not any(o.startswith(f"{group}.{key}=") for o in overrides):
                    continue
                value = OmegaConf.select(task, f"{group}.{key}")
                named = OmegaConf.to_container(value) if OmegaConf.is_config(value) else value
                for path in (named.values() if isinstance(named, dict) else named if isinstance(named, list)
                             else [named]):
                    if path is not None and not glob.glob(os.path.expanduser(str(path))):
                        raise CommandFailed(f"{group}.{key}={path} is not here; mark the block "
                                            "<!-- check: needs data --> and say where the data comes from")
    launcher = str(OmegaConf.select(task, "cluster.launcher", default="none"))
    program = _program(launcher)
    if "needs cluster" not in command.marker and program is not None:
        hostfile = OmegaConf.select(task, "cluster.hostfile", default=None)
        if hostfile is not None and not Path(os.path.expanduser(str(hostfile))).is_file():
            raise CommandFailed(f"cluster.hostfile={hostfile} is not here; mark the block <!-- check: needs cluster -->"
                                " and say which hosts it needs")
        # whether `program` is on this machine's PATH says nothing about the reader's
        raise CommandFailed(f"cluster={launcher} runs {program}, which a reader may not have; mark the block "
                            "<!-- check: needs cluster --> and say what it needs")
    devices = [str(d) for d in OmegaConf.select(task, "devices", default=[])]
    if "needs gpu" not in command.marker and any(d.lower().startswith("gpu") for d in devices):
        raise CommandFailed(f"devices={devices} needs GPUs a reader may not have; mark the block "
                            "<!-- check: needs gpu --> and say so next to it")


def run_for_real(command: Command, workdir: Path, timeout: float = 300) -> None:
    """Run a `check: run` command as a reader would, in an empty directory, adding only where its
    run directory goes."""
    args = command.argv[1:]
    multirun = "-m" in args or "--multirun" in args
    where = f"hydra.sweep.dir={workdir / 'multirun'}" if multirun else f"hydra.run.dir={workdir / 'run'}"
    env = {**os.environ, **command.env, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", "from tfkv.cli import run; run()", *args, where], cwd=workdir,
                          env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        lines = [line for line in proc.stderr.splitlines() if line.strip()] or [f"exit status {proc.returncode}"]
        raise CommandFailed(f"exited {proc.returncode}: {lines[-1]}")


def _parse(parser: object, argv: list[str]) -> object:
    """argv as a command's own argparse parser reads it; CommandFailed with its error line."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            return parser.parse_args(argv)
        except SystemExit as e:
            if e.code == 0:  # --help, --version
                return None
            raise CommandFailed(err.getvalue().strip().splitlines()[-1]) from None


def check_launch(command: Command) -> list[str] | None:
    """Parse a tfkv-launch line with its own parser; the tfkv-run command it launches, if any."""
    from tfkv.launcher import cli

    args = _parse(cli.parser(), command.argv[1:])
    if args is None:  # --help, --version
        return None
    inner = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not inner:
        raise CommandFailed("no workers' command after --")
    return inner if inner[:1] == ["tfkv-run"] else None


def check(command: Command, workdir: Path) -> None:
    """Every check a documented command gets; CommandFailed `page:line: reason` otherwise."""
    try:
        if command.argv[0] == "(unparsable)":
            raise CommandFailed(f"the shell cannot split it: {command.argv[1]}")
        unknown = [m for m in (m.strip() for m in command.marker.split(",")) if m and m not in MARKERS]
        if unknown:  # several combine: <!-- check: needs data, needs gpu -->
            raise CommandFailed(f"unknown marker <!-- check: {unknown[0]} -->; use one of: {', '.join(MARKERS)}")
        if command.marker == "skip":
            return
        inner = command
        if command.argv[0] == "tfkv-emulate":
            from tfkv.emulate import cli

            _parse(cli._parser(), command.argv[1:])
            return
        if command.argv[0] == "tfkv-launch":
            launched = check_launch(command)
            if launched is None:
                return
            # a worker of the job: the launcher gives it its role
            inner = Command(command.page, command.line, launched, {**command.env, "DMLC_ROLE": "worker"},
                            command.marker)
        with environment(inner.env):  # CUDA_VISIBLE_DEVICES=0 tfkv-run ...: what the GPU check sees too
            tasks = check_run(inner, workdir)
            if tasks:
                check_needs(inner, tasks[0])
        if command.marker == "run" and command.argv[0] == "tfkv-run":
            run_for_real(command, workdir)
    except CommandFailed as e:
        raise CommandFailed(f"{command.id}: {e}") from None


ALL = [c for p in pages() for c in commands(p)]


@pytest.mark.parametrize("command", ALL, ids=[c.id for c in ALL])
def test_documented_command_works(command: Command, tmp_path: Path) -> None:
    try:
        check(command, tmp_path)
    except CommandFailed as e:
        pytest.fail(str(e), pytrace=False)


# ------------------------------------------------------------------------------ the checker itself

SAMPLE_PAGE = """\
# A sample page

```bash
tfkv-run epochs=3 optimizer=adam optimizer.lr=0.01
tfkv-run epoch=3
```

<!-- check: needs data -->
```bash
tfkv-run dataset=csv dataset.files=~/no/such/train.csv dataset.label=price loss=mse metrics=[mae]
```

```bash
tfkv-run dataset=csv dataset.files=/no/such/train.csv dataset.label=price loss=mse metrics=[mae]
TFKV_CHUNK_BYTES=1024 tfkv-run kvstore=dist_sync cluster=local \\
    cluster.num_workers=2 cluster.num_servers=1
tfkv-run kvstore=dist_sync
tfkv-run -m optimizer=sgd,adam optimizer.momentum=0.9
tfkv-run -m hydra/launcher=joblib epochs=1,2 +experiment=mnist_lenet hydra.sweep.dir=sweeps/a
tfkv-run dataset=mnist dataset.root=<dir>
tfkv-launch -n 2 --launcher local -- tfkv-run kvstore=dist_sync
tfkv-launch -n 2 --launcher nowhere -- python3 train.py
tfkv-run cluster=ssh kvstore=dist_sync cluster.hostfile=/no/such/hosts
tfkv-run devices=[gpu:0,gpu:99]
```

<!-- check: needs cluster, needs gpu -->
```bash
tfkv-run cluster=ssh kvstore=dist_sync cluster.hostfile=/no/such/hosts devices=[gpu:99]
```

<!-- check: sometimes -->
```bash
tfkv-run epochs=1
```

<!-- check: skip -->
```bash
tfkv-run this is not checked
```

```text
tfkv-run neither is output
```

```bash
tfkv-emulate up --hosts 2 --dir /tmp/cl
tfkv-emulate up --hosts 2
TFKV_SSH_CONFIG=${HOME}/.ssh/config tfkv-run kvstore=dist_sync cluster=local hydra.run.dir=runs/$(date +%s)
```
"""

# line -> the failure it gives (None: passes)
EXPECTED = {
    4: None,
    5: "did you mean 'epochs'?",
    10: None,
    14: "dataset.files=/no/such/train.csv is not here",
    15: None,
    17: "needs a parameter-server cluster",
    18: "trial optimizer=adam: Could not override 'optimizer.momentum'",
    19: None,
    20: "placeholder",
    21: None,
    22: "invalid choice: 'nowhere'",
    23: "cluster.hostfile=/no/such/hosts is not here",
    24: "needs GPUs a reader may not have",
    29: None,
    34: "unknown marker",
    39: None,
    47: None,
    48: "the following arguments are required: --dir",
    49: None,
}


@pytest.fixture(scope="module")
def sample(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Command]]:
    root = tmp_path_factory.mktemp("site")
    (root / "docs" / "snippets").mkdir(parents=True)
    (root / "docs" / "page.md").write_text(SAMPLE_PAGE)
    (root / "docs" / "snippets" / "job.sh").write_text(
        "#!/bin/sh\nset -e\n# check: needs cluster\nexport TFKV_SSH_CONFIG=~/.ssh/config\n"
        "tfkv-run kvstore=dist_sync cluster=ssh cluster.hostfile=/no/such/hosts\n")
    return root, [c for p in pages(root) for c in commands(p, root)]


def test_the_checker_finds_every_command_and_where_it_is(sample):
    root, found = sample
    lines = [c.line for c in found if c.page == "docs/page.md"]
    assert lines == sorted(EXPECTED), lines  # the skipped block's command is found (and not checked), output is not
    joined = next(c for c in found if c.line == 15)
    assert joined.env == {"TFKV_CHUNK_BYTES": "1024"} and joined.argv[-1] == "cluster.num_servers=1"
    (snippet,) = [c for c in found if c.page == "docs/snippets/job.sh"]
    assert snippet.marker == "needs cluster" and snippet.line == 5


@pytest.mark.parametrize("line", sorted(EXPECTED))
def test_the_checker_fails_a_broken_command_naming_page_line_and_error(sample, line, tmp_path):
    _, found = sample
    command = next(c for c in found if c.page == "docs/page.md" and c.line == line)
    expected = EXPECTED[line]
    if expected is None:
        check(command, tmp_path)
        return
    with pytest.raises(CommandFailed) as failed:
        check(command, tmp_path)
    text = str(failed.value)
    assert text.startswith(f"docs/page.md:{line}: ") and expected in text and "\n" not in text, text


def test_a_snippet_marked_needs_cluster_is_composed_only(sample, tmp_path):
    _, found = sample
    check(next(c for c in found if c.page == "docs/snippets/job.sh"), tmp_path)


def test_a_run_block_runs_the_command_in_an_empty_directory(tmp_path):
    good = Command("docs/page.md", 3, ["tfkv-run", "epochs=1", "steps_per_epoch=2", "progress=false"], marker="run")
    check(good, tmp_path)
    assert (tmp_path / "run" / "metrics.json").is_file()
    (tmp_path / "again").mkdir()
    broken = Command("docs/page.md", 7, ["tfkv-run", "epochs=1", "resume=/no/such/run"], marker="run")
    with pytest.raises(CommandFailed, match=r"^docs/page.md:7: exited 2: tfkv-run: "):
        check(broken, (tmp_path / "again").resolve())


def test_a_cluster_or_gpu_command_is_marked_even_where_this_machine_has_what_it_needs(tmp_path, monkeypatch):
    """mpirun, srun or qsub on this PATH, or GPUs here, do not stand for the reader's: an unmarked
    block fails wherever the docs are checked, not only on a machine without them (the README's
    fast suite runs where there are none, and CI's machine has them all)."""
    here = tmp_path / "bin"
    here.mkdir()
    for program in ("mpirun", "srun", "qsub", "ssh"):
        (here / program).write_text("#!/bin/sh\nexit 0\n")
        (here / program).chmod(0o755)
    monkeypatch.setenv("PATH", f"{here}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")  # two GPUs, as tfkv.gpus counts them
    for launcher, program in (("mpi", "mpirun"), ("slurm", "srun"), ("sge", "qsub")):
        argv = ["tfkv-run", "kvstore=dist_sync", f"cluster={launcher}"]
        with pytest.raises(CommandFailed, match=rf"^docs/page.md:3: cluster={launcher} runs {program}, which a "
                                                r"reader may not have; mark the block <!-- check: needs cluster -->"):
            check(Command("docs/page.md", 3, argv), tmp_path)
        check(Command("docs/page.md", 3, argv, marker="needs cluster"), tmp_path)
    gpu = ["tfkv-run", "devices=[gpu:0]"]
    with pytest.raises(CommandFailed, match=r"needs GPUs a reader may not have; mark the block <!-- check: needs gpu"):
        check(Command("docs/page.md", 3, gpu), tmp_path)
    check(Command("docs/page.md", 3, gpu, marker="needs gpu"), tmp_path)
