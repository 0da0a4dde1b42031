"""The benchmark result records (benchmarks/harness.py) and the performance page made from them
(benchmarks/report.py): a record says when, where, how and on what code its rows were measured;
every benchmark (benchmarks/suites/) writes one through the shared writer; the committed page is
what the committed records give, and `--check` notices when they part."""

import datetime
import json
import os
import re
import shutil
import subprocess
import sys
import time

import pytest

from benchmark_cli import env_with_checkout, run_benchmark
from conftest import REPO

BENCH = REPO / "benchmarks"
SUITES = sorted(p.stem for p in (BENCH / "suites").glob("*.py") if p.stem != "__init__")


@pytest.fixture
def record(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO))
    from benchmarks import harness

    return harness


def test_the_package_lists_every_suite():
    """`python -m benchmarks` lists each module of benchmarks/suites/ (and nothing else), an
    unknown name is one line and exit 2."""
    proc = run_benchmark("--help", timeout=60)
    assert proc.returncode == 0, proc.stderr
    listed = [line.split()[0] for line in proc.stdout.split("benchmarks:\n")[1].split("\n\n")[0].splitlines()]
    assert sorted(listed) == SUITES, proc.stdout
    proc = run_benchmark("no_such_bench", timeout=60)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "unknown benchmark 'no_such_bench'" in proc.stderr


def test_no_benchmark_edits_sys_path_or_imports_another():
    """The package imports as a package: no sys.path edits, and a suite imports the harness and
    the jobs, never another suite."""
    for path in BENCH.rglob("*.py"):
        source = path.read_text()
        assert "sys.path" not in source, path
        if path.parent.name == "suites":
            imports = [line for line in source.splitlines() if re.match(r"\s*(from|import) benchmarks\.suites\b", line)]
            assert not imports, (path, imports)


def test_the_harness_alternates_times_and_takes_medians(record):
    """The harness alone: the contenders' order flips every other trial; a timed loop runs whole
    batches of steps until the time is up and says how long they took; a median per contender."""
    harness = record
    assert [harness.alternating("abc", t) for t in range(3)] == [list("abc"), list("cba"), list("abc")]
    calls = []
    n, elapsed = harness.timed(lambda: calls.append(time.sleep(0.002)), 0.05, every=4)
    assert n == len(calls) and n % 4 == 0 and n >= 4 and elapsed >= 0.05 and elapsed >= 0.002 * n, (n, elapsed)
    calls.clear()
    rate = harness.samples_per_second(lambda: calls.append(time.sleep(0.002)), 32, 0.05)
    assert len(calls) >= 3 and 0 < rate <= 32 / 0.002, (len(calls), rate)  # 2 untimed steps, then timed ones
    assert harness.medians({"tfkv": [3.0, 1.0, 2.0], "raw": [4.0, 5.0]}) == {"tfkv": 2.0, "raw": 4.5}


def test_every_benchmark_declares_its_section_without_tensorflow():
    """Each suite declares its section of the page (REPORT: a title of its own, the fields that
    name a row and the ones plotted); the page reads them without importing TensorFlow."""
    code = ("import sys; from benchmarks import harness, report; "
            "got = {n: report.spec_of(n) for n in report.scripts()}; "
            "assert all(isinstance(r, harness.Report) and r.labels and r.values for r in got.values()), got; "
            "assert len({r.title for r in got.values()}) == len(got); "
            "assert 'tensorflow' not in sys.modules and 'keras' not in sys.modules, 'TensorFlow imported'; "
            "print(len(got))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO,
                          env=env_with_checkout())
    assert proc.returncode == 0 and proc.stdout.strip() == str(len(SUITES)), proc.stdout + proc.stderr[-2000:]


def test_a_record_says_when_where_how_and_what(record, tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["python -m benchmarks pushpull", "--sizes", "4K", "--trials", "1"])
    out = record.write(tmp_path / "deep" / "pushpull.json", "pushpull", {"trials": 1}, [{"size": "4 KiB", "ratio": 0.5}],
                       unit="GB/s")
    got = json.loads(out.read_text())
    assert got["benchmark"] == "pushpull" and got["rows"] == [{"size": "4 KiB", "ratio": 0.5}] and got["unit"] == "GB/s"
    assert got["command"] == "python -m benchmarks pushpull --sizes 4K --trials 1"
    when = datetime.datetime.strptime(got["date"], "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=datetime.timezone.utc)
    assert abs((datetime.datetime.now(datetime.timezone.utc) - when).total_seconds()) < 60
    m = got["machine"]
    assert m["logical_cores"] == os.cpu_count() and m["python"] == ".".join(map(str, sys.version_info[:3]))
    assert m["hostname"] and m["cpu"] and m["memory_gib"] > 0 and isinstance(m["gpus"], list)
    assert m["tensorflow"] and m["pyzmq"] and m["libzmq"]
    head = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout
    assert got["commit"].split("+")[0] == head.strip()
    assert record.write("none", "pushpull", {}, []) is None


def test_results_go_where_the_environment_says(record, tmp_path, monkeypatch):
    monkeypatch.delenv(record.ENV, raising=False)
    assert record.default_path("overlap") == BENCH / "results" / "overlap.json"
    monkeypatch.setenv(record.ENV, str(tmp_path))
    assert record.default_path("overlap") == tmp_path / "overlap.json"


@pytest.mark.parametrize("bench", SUITES)
def test_every_benchmark_writes_through_the_shared_writer(bench, tmp_path):
    """Each benchmark records through harness.write; its --help (where it is quick) names the
    --result option and the default file, redirected by $TFKV_BENCH_RESULTS (tests/test_benchmarks.py
    runs every benchmark with tiny settings and checks the record it writes)."""
    source = (BENCH / "suites" / f"{bench}.py").read_text()
    assert "harness.write(" in source and re.search(r"^from benchmarks import (\w+, )*harness\b", source, re.M), bench
    if any(line.startswith(("import tensorflow", "import keras", "from tfkv")) for line in source.splitlines()):
        return  # its --help costs a TensorFlow import (tens of seconds here); the slow suite runs it
    proc = run_benchmark(bench, "--help", timeout=120,
                         env=env_with_checkout(TFKV_BENCH_RESULTS=str(tmp_path), COLUMNS="300"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    if bench != "trees":  # the trees benchmark writes OUT.json and OUT.md from --out
        assert "--result" in proc.stdout and f"{bench}.json" in proc.stdout, proc.stdout


def _report(*args: str) -> subprocess.CompletedProcess:
    return run_benchmark("report", *args, timeout=120)


def test_the_committed_page_matches_the_committed_records():
    proc = _report("--check")
    assert proc.returncode == 0, proc.stderr


def test_the_page_has_a_section_per_benchmark():
    page = (REPO / "docs" / "performance.md").read_text()
    sections = page.split("\n## ")[1:]
    for bench in SUITES:
        (mine,) = [s for s in sections if f"`benchmarks/suites/{bench}.py`" in s]
        assert f"```bash\npython -m benchmarks {bench}" in mine, bench  # how to rerun it
        assert "Not yet recorded" in mine or ("Measured 20" in mine and "|---|" in mine), bench
    assert len(sections) == len(SUITES)
    assert "python benchmarks/" not in page  # a record from before the package is rerun as the package runs


def test_check_fails_when_a_record_changes_and_passes_once_regenerated(tmp_path):
    pytest.importorskip("matplotlib")
    results, docs = tmp_path / "results", tmp_path / "docs"
    shutil.copytree(BENCH / "results", results)
    shutil.copytree(REPO / "docs" / "performance", docs / "performance")
    shutil.copy(REPO / "docs" / "performance.md", docs / "performance.md")
    assert _report("--check", "--results", str(results), "--docs", str(docs)).returncode == 0

    rec = json.loads((results / "overlap.json").read_text())
    rec["rows"][0]["GB/s"] = 9.876
    (results / "overlap.json").write_text(json.dumps(rec))
    proc = _report("--check", "--results", str(results), "--docs", str(docs))
    assert proc.returncode == 1 and "out of date" in proc.stderr

    assert _report("--results", str(results), "--docs", str(docs)).returncode == 0
    assert "| blocking | 9.876 |" in (docs / "performance.md").read_text()
    assert _report("--check", "--results", str(results), "--docs", str(docs)).returncode == 0

    (docs / "performance" / "overlap.png").unlink()  # a plot the page names must be there
    proc = _report("--check", "--results", str(results), "--docs", str(docs))
    assert proc.returncode == 1 and "missing plot" in proc.stderr


def test_a_benchmark_without_a_record_says_not_yet_recorded(tmp_path):
    pytest.importorskip("matplotlib")
    results, docs = tmp_path / "results", tmp_path / "docs"
    shutil.copytree(BENCH / "results", results)
    (results / "sweep.json").unlink()
    assert _report("--results", str(results), "--docs", str(docs)).returncode == 0
    page = (docs / "performance.md").read_text()
    section = page.split("\n## Sweeps: one by one or two at once\n")[1].split("\n## ")[0]
    assert "Not yet recorded" in section and "python -m benchmarks sweep" in section
