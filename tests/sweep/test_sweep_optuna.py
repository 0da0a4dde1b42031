"""Hyper-parameter search with the real Hydra Optuna sweepers: Hydra's own (`hydra/sweeper=optuna`)
with tfkv-run's objective, and tfkv's (`hydra/sweeper=tfkv_optuna`, on Optuna 4's public API)
whose trials report every epoch to the study so that its pruner stops bad trials early.

Hydra's own sweeper (hydra-optuna-sweeper 1.3) pins Optuna 2, so it is not in tfkv[sweep]: its
tests (named hydra_s_own) run where it is installed with its Optuna, as .ci/extras.sh installs it
in a venv of its own, and are skipped elsewhere."""

import json
import os
import re
import subprocess
import sys
from importlib import metadata, util
from pathlib import Path

import pytest
import yaml

from conftest import REPO, tfkv_run

from tfkv.errors import ConfigError

# Lean trials: CI's time is short (digits, a few epochs of a few steps each).
LEAN = ["epochs=3", "steps_per_epoch=8", "progress=false"]


def _sweep_dir(root: Path) -> Path:
    (found,) = root.glob("multirun/*/*")
    return found


def _jobs(sweep: Path) -> list[Path]:
    return sorted((p for p in sweep.iterdir() if (p / ".hydra").is_dir()), key=lambda p: int(p.name))


def _python(code: str, cwd: Path) -> subprocess.CompletedProcess:
    """`code` in a fresh interpreter: what it imports and registers starts from nothing."""
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=120)


def _study(sweep: Path):
    """The study of a tfkv_optuna sweep, from its journal file in the sweep directory."""
    import optuna

    from tfkv.sweep import pruning

    return optuna.load_study(study_name=None, storage=pruning.open_storage(f"journal:{sweep / 'optuna.journal'}"))


def _hydra_s_own_sweeper() -> bool:
    """Hydra's Optuna sweeper is installed with the Optuna it works with (below 3)."""
    try:
        return bool(util.find_spec("hydra_plugins.hydra_optuna_sweeper")) and int(metadata.version("optuna")[0]) < 3
    except metadata.PackageNotFoundError:
        return False


hydra_s_own = pytest.mark.skipif(not _hydra_s_own_sweeper(), reason="hydra-optuna-sweeper (with its Optuna 2) "
                                 "is not installed here; .ci/extras.sh runs these tests in a venv that has it")


@pytest.mark.slow
@hydra_s_own
def test_hydra_s_own_optuna_tpe_finds_a_config_as_good_as_a_hand_picked_run(tmp_path):
    hand = tmp_path / "hand"
    hand.mkdir()
    tfkv_run(*LEAN, cwd=hand)
    (run,) = hand.glob("outputs/*/*/metrics.json")
    hand_picked = json.loads(run.read_text())["test_accuracy"]

    tfkv_run("-m", "hydra/sweeper=optuna", "hydra.sweeper.n_trials=6", "hydra.sweeper.direction=maximize",
             "hydra.sweeper.sampler.seed=0", "optimizer=choice(sgd,adam)",
             "optimizer.lr=tag(log,interval(0.001,0.3))", *LEAN, cwd=tmp_path)
    sweep = _sweep_dir(tmp_path)
    result = yaml.safe_load((sweep / "optimization_results.yaml").read_text())
    jobs = _jobs(sweep)
    assert len(jobs) == 6
    reached = {json.loads((j / "metrics.json").read_text())["test_accuracy"] for j in jobs}
    assert result["best_value"] == pytest.approx(max(reached))  # the objective tfkv-run returned
    assert set(result["best_params"]) == {"optimizer", "optimizer.lr"}
    assert result["best_value"] >= hand_picked - 0.02, (result, hand_picked)


@pytest.mark.slow
@hydra_s_own
def test_hydra_s_own_optuna_marks_failed_and_diverged_trials_failed_and_the_study_goes_on(tmp_path):
    # batch_size=5000 is more than digits' training shard: the trial fails at run time; lr=1e9
    # diverges: test_loss is NaN (Hydra's Optuna sweeper 1.3.0 ends its sweep on a NaN). The
    # random sampler's seed 6 draws (5000, 0.1), (64, 0.1), (64, 1e9): failed, ok, diverged.
    proc = tfkv_run("-m", "hydra/sweeper=optuna", "hydra/sweeper/sampler=random", "hydra.sweeper.sampler.seed=6",
                    "hydra.sweeper.n_trials=3", "objective=test_loss", "direction=minimize",
                    "hydra.sweeper.direction=minimize", "hydra.sweeper.study_name=s",
                    "hydra.sweeper.storage=sqlite:///optuna.db", "batch_size=choice(5000,64)",
                    "optimizer.lr=choice(0.1,1e9)", "epochs=1", "steps_per_epoch=4", "progress=false",
                    cwd=tmp_path, check=False)
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.returncode == 1, proc.stderr[-3000:]  # trials failed: the sweep's status says so
    sweep = _sweep_dir(tmp_path)
    result = yaml.safe_load((sweep / "optimization_results.yaml").read_text())
    assert result["best_params"] == {"batch_size": 64, "optimizer.lr": 0.1}
    import optuna

    study = optuna.load_study(study_name="s", storage=f"sqlite:///{tmp_path / 'optuna.db'}")
    states = {(t.params["batch_size"], t.params["optimizer.lr"]): t.state.name for t in study.trials}
    assert states == {(5000, 0.1): "FAIL", (64, 0.1): "COMPLETE", (64, 1e9): "FAIL"}


def test_tfkv_optuna_composes_with_a_sampler_and_a_pruner():
    """The sweeper's node: the direction left to the objective's, sampler and pruner config groups."""
    code = ("from hydra import compose, initialize_config_dir\n"
            "from tfkv import cli, config\n"
            "with initialize_config_dir(config_dir=cli.conf_dir(), version_base='1.3'):\n"
            "    cfg = compose('config', overrides=['hydra/sweeper=tfkv_optuna', 'direction=minimize',\n"
            "                  'hydra/sweeper/pruner=hyperband'], return_hydra_config=True)\n"
            "s = cfg.hydra.sweeper\n"
            "print(s._target_, s.direction, s.pruner._target_, s.sampler._target_, s.storage, cfg.direction)\n"
            "import sys; print('optuna' in sys.modules)\n")
    out = _python(code, REPO)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["hydra_plugins.tfkv_sweep.tfkv_optuna.TfkvOptunaSweeper", "None",
                                  "optuna.pruners.HyperbandPruner", "optuna.samplers.TPESampler", "None",
                                  "minimize", "False"]  # composing a sweep's config leaves Optuna unimported


def test_pruning_tracker_stops_a_trial_worse_than_the_median(tmp_path):
    """Worker 0's tracker against a real study in SQLite: it reports each epoch's objective and,
    once the pruner says so, leaves pruned.json and raises TrialPruned."""
    import optuna
    from omegaconf import OmegaConf

    from tfkv.errors import TrialPruned
    from tfkv.sweep import pruning, trial

    storage = f"sqlite:///{tmp_path / 'optuna.db'}"
    study = optuna.create_study(study_name="s", storage=storage, direction="maximize")
    study.set_user_attr(pruning.PRUNER_ATTR, {"_target_": "optuna.pruners.MedianPruner",
                                              "n_startup_trials": 2, "n_warmup_steps": 2})
    for accuracy in (0.8, 0.9):  # two finished trials: the median at each epoch is 0.85
        done = study.ask()
        for epoch in (1, 2, 3):
            done.report(accuracy, step=epoch)
        study.tell(done, values=[accuracy])
    asked = study.ask()

    cfg = OmegaConf.create({"objective": "test_accuracy", "direction": "maximize", "epochs": 3,
                            "sweep": {"study": "s", "storage": storage, "trial": asked.number}})
    tracker = pruning.build(cfg, tmp_path)
    tracker.epoch(1, {"test_accuracy": 0.1})  # step = epoch: none pruned before epoch n_warmup_steps
    with pytest.raises(TrialPruned) as e:
        tracker.epoch(2, {"test_accuracy": 0.1})
    assert "\n" not in str(e.value) and "epoch 2" in str(e.value)
    assert json.loads((tmp_path / trial.PRUNED_FILE).read_text()) == {"epoch": 2, "value": 0.1, "reason": str(e.value)}
    reported = optuna.load_study(study_name="s", storage=pruning.open_storage(storage)).trials[asked.number]
    assert reported.intermediate_values == {1: 0.1, 2: 0.1}

    cfg.sweep.trial = None  # not a trial of tfkv_optuna: no tracker
    assert pruning.build(cfg, tmp_path) is None


@pytest.mark.slow
def test_tfkv_optuna_prunes_a_bad_trial_before_its_last_epoch(tmp_path):
    # RandomSampler(seed=6) draws lr 0.1, 0.1, then 1e-05: the first two trials finish (no pruning
    # before two have), the tiny-lr one falls far below their median at epoch 2.
    proc = tfkv_run("-m", "hydra/sweeper=tfkv_optuna", "hydra/sweeper/sampler=random",
                    "hydra.sweeper.sampler.seed=6", "hydra.sweeper.n_trials=3", "hydra.sweeper.n_jobs=1",
                    "hydra.sweeper.pruner.n_startup_trials=2", "hydra.sweeper.pruner.n_warmup_steps=2",
                    "optimizer.lr=choice(0.1,0.00001)", *LEAN, cwd=tmp_path)
    sweep = _sweep_dir(tmp_path)
    study = _study(sweep)
    records = {int(j.name): json.loads((j / "trial.json").read_text()) for j in _jobs(sweep)}
    pruned = [n for n, r in records.items() if r["status"] == "pruned"]
    assert pruned == [2], records
    for n in pruned:
        history = json.loads((sweep / str(n) / "metrics.json").read_text())["history"]
        assert len(history) == 2  # stopped after epoch 2 of 3: step = epoch, none pruned before n_warmup_steps
        assert study.trials[n].state == study.trials[n].state.PRUNED
        assert sorted(study.trials[n].intermediate_values) == [1, 2]
    assert all(records[n]["status"] == "ok" for n in (0, 1))
    assert [t.state.name for t in study.trials[:2]] == ["COMPLETE", "COMPLETE"]
    assert study.direction.name == "MAXIMIZE"  # the objective's, test_accuracy
    result = yaml.safe_load((sweep / "optimization_results.yaml").read_text())
    assert result["best_value"] == pytest.approx(records[result["best_trial"]]["value"])
    assert result["trials"]["pruned"] == len(pruned)
    assert "Traceback" not in proc.stderr
    table = proc.stdout[re.search(r"^#\s+overrides", proc.stdout, re.M).start():]
    assert "sweep.st" not in table and "sweep.trial" not in table  # bookkeeping, not what tells trials apart


def _job_return(run_dir: Path, value, status: str | None, completed: bool = True):
    from hydra.core.utils import JobReturn, JobStatus
    from omegaconf import OmegaConf

    from tfkv.sweep import trial

    ret = JobReturn()
    ret.hydra_cfg = OmegaConf.create({"hydra": {"runtime": {"output_dir": str(run_dir)}}})
    ret.status = JobStatus.COMPLETED if completed else JobStatus.FAILED
    ret._return_value = value
    if status is not None:
        trial.write(run_dir, {"status": status})
    return ret


def test_tfkv_optuna_tells_optuna_what_each_trial_record_says(tmp_path):
    """COMPLETE with the value of an ok trial; PRUNED from the record; FAIL for a failed record,
    a value that is not finite, a job that raised; a grid sampler's last trial told FAIL too."""
    import optuna

    from tfkv.sweep.optuna_sweeper import _outcome, _tell

    S = optuna.trial.TrialState
    cases = {"ok": (0.9, "ok", True), "pruned": (None, "pruned", True), "failed": (None, "failed", True),
             "nan": (float("nan"), "ok", True), "raised": (RuntimeError("x"), None, False),
             "no record": (0.5, None, True)}
    told = {name: _outcome(_job_return(tmp_path / name, *case)) for name, case in cases.items()}
    assert told == {"ok": (S.COMPLETE, 0.9), "pruned": (S.PRUNED, None), "failed": (S.FAIL, None),
                    "nan": (S.FAIL, None), "raised": (S.FAIL, None), "no record": (S.COMPLETE, 0.5)}

    # GridSampler stops its study after the grid's last trial, which raises outside optimize()
    study = optuna.create_study(sampler=optuna.samplers.GridSampler({"x": [1]}))
    last = study.ask()
    last.suggest_categorical("x", [1])
    _tell(study, last, S.FAIL, None)
    assert study.trials[0].state == S.FAIL


def test_a_sweeper_direction_against_the_objective_s_is_one_line_before_any_trial(tmp_path):
    proc = tfkv_run("-m", "hydra/sweeper=tfkv_optuna", "hydra.sweeper.direction=minimize",
                    "optimizer.lr=interval(0.01,0.1)", cwd=tmp_path, check=False)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "tfkv-run: hydra.sweeper.direction=minimize but objective test_accuracy is to maximize (direction=auto); "
        "set hydra.sweeper.direction=maximize, or direction= and hydra.sweeper.direction= alike where the "
        "objective's better way is the other"]
    assert not list(tmp_path.glob("multirun/*/*/0"))


def test_a_named_study_better_the_other_way_is_refused_in_one_line_before_any_trial(tmp_path):
    """hydra.sweeper.study_name of a study that exists (Optuna's load_if_exists) to maximize, and
    an objective to minimize: one line naming the study and both directions; no trial asked."""
    import optuna

    url = f"sqlite:///{tmp_path / 'optuna.db'}"
    optuna.create_study(study_name="lr", storage=url, direction="maximize")
    proc = tfkv_run("-m", "hydra/sweeper=tfkv_optuna", "hydra.sweeper.study_name=lr", f"hydra.sweeper.storage={url}",
                    "objective=test_loss", "optimizer.lr=interval(0.01,0.1)", *LEAN, cwd=tmp_path, check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines() == [
        f"tfkv-run: hydra.sweeper.study_name=lr: the study in {url} is to maximize but objective test_loss is to "
        "minimize; name another study, or sweep an objective (objective=, direction=) that is better the study's way"]
    assert optuna.load_study(study_name="lr", storage=url).trials == []
    assert not list(tmp_path.glob("multirun/*/*/0"))


def test_a_named_study_better_the_same_way_is_reused(tmp_path):
    """The check lets a study of the objective's direction through (and a name not yet used)."""
    import optuna

    from tfkv.sweep import pruning
    from tfkv.sweep.optuna_sweeper import TfkvOptunaSweeper

    url = f"sqlite:///{tmp_path / 'optuna.db'}"
    optuna.create_study(study_name="lr", storage=url, direction="minimize")
    for name in ("lr", "new"):
        sweeper = TfkvOptunaSweeper(None, None, None, url, name, 1, 1, 1.0, None)
        sweeper.objective, sweeper.direction, sweeper.storage_url = "test_loss", "minimize", url
        sweeper._same_direction(pruning.open_storage(url))
    sweeper.direction = "maximize"
    with pytest.raises(ConfigError, match="study_name=lr: the study in .* is to minimize but objective test_loss"):
        sweeper.study_name = "lr"
        sweeper._same_direction(pruning.open_storage(url))


def test_hydra_s_own_sweeper_s_direction_is_checked_against_the_objective_s():
    """Hydra's Optuna sweeper defaults to minimize: against an accuracy, one line; a loss agrees.
    (The config's node as that plug-in composes it; .ci/extras.sh runs it for real.)"""
    from omegaconf import OmegaConf

    from tfkv.sweep import precheck

    hydra = {"sweeper": {"_target_": "hydra_plugins.hydra_optuna_sweeper.optuna_sweeper.OptunaSweeper",
                         "direction": "minimize"}}
    config = OmegaConf.create({"hydra": hydra, "direction": "auto"})
    line = precheck._sweeper_direction(config, "test_accuracy", "maximize")
    assert line.startswith("hydra.sweeper.direction=minimize but objective test_accuracy is to maximize"), line
    assert precheck._sweeper_direction(config, "test_loss", "minimize") is None
    config.hydra.sweeper.direction = ["maximize", "minimize"]
    assert "direction=maximize,minimize" in precheck._sweeper_direction(config, "test_loss", "minimize")
    config.hydra.sweeper._target_ = "hydra._internal.core_plugins.basic_sweeper.BasicSweeper"
    assert precheck._sweeper_direction(config, "test_loss", "minimize") is None  # no direction to agree with


def _without_hydra_s_optuna_sweeper(argv: list[str]) -> str:
    """A fresh interpreter running tfkv-run with `argv`, where hydra-optuna-sweeper cannot be
    imported, as if it were not installed (Hydra's plug-in scan skips a module that sys.modules
    holds as None; a filter on hydra_plugins' paths would also drop tfkv's own shim where tfkv is
    installed into site-packages rather than editable)."""
    return ("import sys\n"
            "sys.modules['hydra_plugins.hydra_optuna_sweeper'] = None\n"
            f"sys.argv = ['tfkv-run', *{argv!r}]\n"
            "from tfkv import cli\n"
            "cli.run()\n")


def test_tfkv_optuna_needs_no_hydra_optuna_sweeper_and_minimises_a_loss(tmp_path):
    """Optuna's public API only: the sweep runs without hydra-optuna-sweeper, on the Optuna
    installed (4 or later), its study in the journal file; objective=test_loss is minimised: the
    study's and the table's best trial is the one with the lowest loss its metrics.json shows."""
    argv = ["-m", "hydra/sweeper=tfkv_optuna", "hydra/sweeper/sampler=grid", "objective=test_loss",
            "optimizer.lr=choice(0.1,0.00001)", "hydra.sweep.dir=sweep", "epochs=1", "steps_per_epoch=4",
            "progress=false"]
    out = _python(_without_hydra_s_optuna_sweeper(argv), tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    sweep = tmp_path / "sweep"
    study = _study(sweep)
    assert study.direction.name == "MINIMIZE"
    losses = {int(j.name): json.loads((j / "metrics.json").read_text())["test_loss"] for j in _jobs(sweep)}
    assert len(losses) == 2 and losses[0] != losses[1]
    best = min(losses, key=losses.get)
    assert study.best_trial.number == best and study.best_value == pytest.approx(losses[best])
    assert json.loads((sweep / "sweep.json").read_text())["best"] == best
    assert "hydra_optuna_sweeper" not in out.stderr


def test_without_optuna_tfkv_optuna_is_one_line_naming_the_extra(tmp_path):
    code = "import sys\nsys.modules['optuna'] = None\n" + _without_hydra_s_optuna_sweeper(
        ["-m", "hydra/sweeper=tfkv_optuna", "optimizer.lr=0.1,0.2"])
    out = _python(code, tmp_path)
    assert out.returncode == 2, out.stderr[-2000:]
    (line,) = out.stderr.strip().splitlines()
    assert line.startswith("tfkv-run: hydra/sweeper=tfkv_optuna needs Optuna") and "pip install 'tfkv[sweep]'" in line


# A trial's worker 0, as a process of its own: its pruning tracker reports epochs 1..3 to the study.
REPORTER = """
import sys
from omegaconf import OmegaConf
from tfkv.sweep import pruning
storage, number, value = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
cfg = OmegaConf.create({"objective": "test_loss", "direction": "minimize", "epochs": 3,
                        "sweep": {"study": "shared", "storage": storage, "trial": number}})
tracker = pruning.build(cfg, sys.argv[4])
for epoch in (1, 2, 3):
    tracker.epoch(epoch, {"test_loss": value + epoch})
"""


def test_trials_in_separate_processes_share_one_journal_file(tmp_path):
    """storage=journal:<file> (Optuna's JournalStorage): the sweeper's study and the trials'
    processes, four at once, meet in one file without a database server."""
    import optuna

    from tfkv.sweep import pruning

    url = pruning.storage_url(str(tmp_path / "study.journal"))  # a bare path is a journal file
    assert url == f"journal:{tmp_path / 'study.journal'}"
    study = optuna.create_study(study_name="shared", storage=pruning.open_storage(url), direction="minimize")
    study.set_user_attr(pruning.PRUNER_ATTR, {"_target_": "optuna.pruners.NopPruner"})
    trials = [study.ask() for _ in range(4)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    procs = [subprocess.Popen([sys.executable, "-c", REPORTER, url, str(t.number), str(t.number), str(tmp_path)],
                              env=env, stderr=subprocess.PIPE, text=True) for t in trials]
    for p in procs:
        assert p.wait(timeout=120) == 0, p.stderr.read()[-2000:]
    for t in trials:
        study.tell(t, values=[t.number + 3.0])
    seen = optuna.load_study(study_name="shared", storage=pruning.open_storage(url))
    assert {t.number: t.intermediate_values for t in seen.trials} == {
        n: {1: n + 1.0, 2: n + 2.0, 3: n + 3.0} for n in range(4)}
    assert seen.best_trial.number == 0
