"""The one harness every benchmark runs on: trials, warm-up, timing, contenders, medians, records.

A suite (benchmarks/suites/<name>.py, run as `python -m benchmarks <name>`) declares what it
measures and its contenders; this module runs them the same way everywhere:

- contenders alternate (`alternating`): the order is reversed every other trial, so that neither
  side of a ratio always runs first on a warm or a cold machine;
- a timed loop (`timed`) steps back to back, after untimed warm-up steps (`warm_up`), for at least
  a given time; a figure is the median over trials (`medians`), since these machines are shared;
- the result record: benchmarks/results/<name>.json holds what was measured (`rows`), how
  (`command`, `settings`), when (`date`, UTC), on what code (`commit`) and on which machine
  (`machine`). benchmarks/report.py (`python -m benchmarks report`) turns the latest record of each benchmark into
  docs/performance.md.

Where a record goes: `--result PATH` if given; else the directory in $TFKV_BENCH_RESULTS (the tests
set it, so a smoke run never overwrites a committed figure); else benchmarks/results/.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Hashable, Iterable, Iterator, Mapping, Sequence, TypeVar

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
RESULTS = HERE / "results"
ENV = "TFKV_BENCH_RESULTS"
# argparse destinations that are plumbing between a script and its own child processes, not settings
PLUMBING = {"result", "role", "out", "worker", "sync_dir", "keras_fit", "precision", "jit"}

T = TypeVar("T")
K = TypeVar("K", bound=Hashable)


# -- trials, warm-up, timing, medians ------------------------------------------------------------

def alternating(contenders: Sequence[T], trial: int) -> list[T]:
    """The contenders in their order on even trials, reversed on odd ones: neither side of a ratio
    always runs first (on a machine warmed or drifting during the run)."""
    return list(contenders) if trial % 2 == 0 else list(contenders)[::-1]


def warm_up(step: Callable[[], Any], steps: int = 2) -> None:
    """Untimed steps first: the first traces (tf.function), the next fills caches and pools."""
    for _ in range(steps):
        step()


def timed(step: Callable[[], Any], seconds: float, every: int = 1) -> tuple[int, float]:
    """`step()` back to back, `every` calls between looks at the clock, until `seconds` have
    passed: (steps run, seconds they took). Each call returns when its step is done."""
    n, t0 = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - t0) < seconds:
        for _ in range(every):
            step()
        n += every
    return n, elapsed


def samples_per_second(step: Callable[[], Any], batch: int, seconds: float, every: int = 1) -> float:
    """A training step's samples/s: two untimed steps (the first traces), then `timed`."""
    warm_up(step)
    n, elapsed = timed(step, seconds, every)
    return batch * n / elapsed


def medians(samples: Mapping[K, Iterable[float]]) -> dict[K, float]:
    """Each contender's median over its trials."""
    return {k: statistics.median(v) for k, v in samples.items()}


# -- what a benchmark's section of the performance page shows ----------------------------------------

@dataclass(frozen=True)
class Report:
    """How one benchmark's section reads (each suite's REPORT; benchmarks/report.py draws it): its
    title, the sentence on what it measures against which baseline, which row fields name a row
    (labels) and which are plotted (values), and which rows and columns show (a ratio is a column
    the suite computed from two contenders of the same run)."""

    title: str
    what: str
    labels: list[str]
    values: list[str]
    unit: str
    columns: list[str] | None = None  # None: every field whose values are scalars
    select: Callable[[list[dict]], list[dict]] = field(default=lambda rows: rows)
    rerun: str = ""  # the command when there is no record yet ("": the benchmark alone)


# -- child processes -------------------------------------------------------------------------------

def suite_argv(name: str, python: str = sys.executable) -> list[str]:
    """The command line that runs a suite in a child process (a job's role, a fresh process per
    round): `python -m benchmarks <name>`, from the repository root or with it on PYTHONPATH."""
    return [python, "-m", "benchmarks", name]


def module_argv(module: str, python: str = sys.executable) -> list[str]:
    """The command line of a module of this package run as a process (benchmarks.jobs' worker)."""
    return [python, "-m", f"benchmarks.{module}"]


# -- records ---------------------------------------------------------------------------------------


def default_path(bench: str) -> Path:
    """Where `bench`'s record goes when no --result is given."""
    folder = os.environ.get(ENV)
    return (Path(folder) if folder else RESULTS) / f"{bench}.json"


def add_argument(ap: argparse.ArgumentParser, bench: str, *flags: str) -> None:
    """The option that says where the record goes (`--result`; a script that had `--json` keeps it)."""
    ap.add_argument(*(flags or ("--result",)), dest="result", default=str(default_path(bench)), metavar="FILE",
                    help=f"write the result record here (default: {ENV}/{bench}.json if set, else "
                         f"benchmarks/results/{bench}.json); 'none' writes nothing")


def settings_of(args: argparse.Namespace) -> dict[str, Any]:
    """The run's options, less the ones that only carry state to the script's own child processes."""
    return {k: v for k, v in sorted(vars(args).items()) if k not in PLUMBING}


def _run(cmd: list[str]) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=30, cwd=REPO).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def commit() -> str:
    """The checkout's commit, '+dirty' when tracked files differ from it ('' outside a git checkout)."""
    sha = _run(["git", "rev-parse", "--short=12", "HEAD"])
    if sha and _run(["git", "status", "--porcelain", "--untracked-files=no"]):
        sha += "+dirty"
    return sha


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return _run(["sysctl", "-n", "machdep.cpu.brand_string"]) or platform.processor() or platform.machine()


def _memory_gib() -> float | None:
    try:
        return round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError, AttributeError):
        return None


def _gpus() -> list[str]:
    if not shutil.which("nvidia-smi"):
        return []
    out = _run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"])
    return [line.strip() for line in out.splitlines() if line.strip()]


def machine() -> dict[str, Any]:
    """What the figures depend on: host, CPU, memory, GPUs and the versions of the stack.
    The versions are tfkv.stack()'s, from package metadata: importing TensorFlow would cost seconds."""
    from tfkv import stack

    versions = stack()
    return {
        "hostname": platform.node(),
        "os": platform.platform(),
        "cpu": _cpu_model(),
        "logical_cores": os.cpu_count(),
        "memory_gib": _memory_gib(),
        "gpus": _gpus(),
        "python": platform.python_version(),
        "tensorflow": versions["tensorflow"],
        "tfkv": versions["tfkv"],
        "pyzmq": versions["pyzmq"],
        "libzmq": versions["libzmq"],
    }


def command(bench: str) -> str:
    """The command as run, from the repository root: `python -m benchmarks <bench> --flag value`
    (benchmarks/__main__.py leaves the suite's own arguments in sys.argv[1:])."""
    return shlex.join(["python", "-m", "benchmarks", bench, *sys.argv[1:]])


def make(bench: str, settings: dict[str, Any], rows: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    """A record of a run that has just finished on this machine."""
    return {
        "benchmark": bench,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "command": command(bench),
        "commit": commit(),
        "machine": machine(),
        "settings": settings,
        "rows": rows,
        **extra,
    }


def write(path: str | Path | None, bench: str, settings: dict[str, Any], rows: list[dict[str, Any]],
          **extra: Any) -> Path | None:
    """Write the record to `path` (None or 'none': nowhere) and say so on stdout."""
    if path is None or str(path) == "none":
        return None
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(make(bench, settings, rows, **extra), indent=1, default=str) + "\n")
    print(f"result: {out}", flush=True)
    return out


def load(path: str | Path) -> dict[str, Any]:
    """A record; a file holding only a list of rows (what the cluster and control_plane benchmarks
    wrote before records) is read as a record with just those rows."""
    got = json.loads(Path(path).read_text())
    return {"rows": got} if isinstance(got, list) else got


def load_rows(path: str | Path) -> list[dict[str, Any]]:
    """The rows of a record or of a bare list of rows."""
    rows = load(path).get("rows")
    if not isinstance(rows, list):
        raise ValueError(f"{path} has no list of rows")
    return rows


@contextlib.contextmanager
def closing(store: Any, who: str) -> Iterator[Any]:
    """A benchmark worker's store: closed when the block ends, aborted when it raises (so the job's
    other roles stop at once instead of waiting on this worker), the exception going on."""
    try:
        yield store
    except BaseException:
        store.abort(f"{who} worker failed")
        raise
    store.close()
