"""The benchmark result records (benchmarks/record.py) and the performance page made from them
(benchmarks/report.py): a record says when, where, how and on what code its rows were measured;
every bench_*.py writes one through the shared writer; the committed page is what the committed
records give, and `--check` notices when they part."""

import datetime
import json
import os
import shutil
import subprocess
import sys

import pytest

from conftest import REPO

BENCH = REPO / "benchmarks"
SCRIPTS = sorted(p.name for p in BENCH.glob("bench_*.py"))


@pytest.fixture
def record(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    import record

    return record


def test_a_record_says_when_where_how_and_what(record, tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", [str(BENCH / "bench_pushpull.py"), "--sizes", "4K", "--trials", "1"])
    out = record.write(tmp_path / "deep" / "pushpull.json", "pushpull", {"trials": 1}, [{"size": "4 KiB", "ratio": 0.5}],
                       unit="GB/s")
    got = json.loads(out.read_text())
    assert got["benchmark"] == "pushpull" and got["rows"] == [{"size": "4 KiB", "ratio": 0.5}] and got["unit"] == "GB/s"
    assert got["command"] == "python benchmarks/bench_pushpull.py --sizes 4K --trials 1"
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


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_benchmark_writes_through_the_shared_writer(script, tmp_path):
    """Each script records through record.write; its --help (where it is quick) names the --result
    option and the default file, redirected by $TFKV_BENCH_RESULTS (tests/test_benchmarks.py runs
    every script with tiny settings and checks the record it writes)."""
    source = (BENCH / script).read_text()
    bench = script[len("bench_"):-len(".py")]
    assert "record.write(" in source and "import record" in source, script
    if any(line.startswith(("import tensorflow", "import keras", "from tfkv")) for line in source.splitlines()):
        return  # its --help costs a TensorFlow import (tens of seconds here); the slow suite runs it
    proc = subprocess.run([sys.executable, str(BENCH / script), "--help"], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "TFKV_BENCH_RESULTS": str(tmp_path), "COLUMNS": "300"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    if bench != "trees":  # bench_trees writes OUT.json and OUT.md from --out
        assert "--result" in proc.stdout and f"{bench}.json" in proc.stdout, proc.stdout


def _report(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(BENCH / "report.py"), *args], capture_output=True, text=True, timeout=120)


def test_the_committed_page_matches_the_committed_records():
    proc = _report("--check")
    assert proc.returncode == 0, proc.stderr


def test_the_page_has_a_section_per_benchmark_script():
    page = (REPO / "docs" / "performance.md").read_text()
    sections = page.split("\n## ")[1:]
    for script in SCRIPTS:
        (mine,) = [s for s in sections if f"`benchmarks/{script}`" in s]
        assert f"python benchmarks/{script}" in mine, script  # how to rerun it
        assert "Not yet recorded" in mine or ("Measured 20" in mine and "|---|" in mine), script
    assert len(sections) == len(SCRIPTS)


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
    assert "Not yet recorded" in section and "python benchmarks/bench_sweep.py" in section
