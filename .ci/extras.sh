#!/usr/bin/env bash
# Each extra alone: a fresh venv per extra holding tfkv with only that extra and `cpu`, in which
# the extra's promise is checked as a user meets it (the test extra brings them all at once,
# which hides an extra that does not work by itself). Also Hydra's own Optuna sweeper, which pins
# Optuna 2 and so is its own install, not tfkv[sweep]'s. Exits non-zero on the first failure.
#   cpu     tfkv-run trains; logger=mlflow and hydra/sweeper=tfkv_optuna are one line naming the extra
#   sweep   hydra/sweeper=tfkv_optuna on the Optuna pip resolves, two trials in two joblib processes
#           sharing the study's journal file; a loss is minimised
#   mlflow  logger=mlflow writes the default sqlite:///mlflow.db; `mlflow server` on it answers on
#           127.0.0.1 and lists the run
#   hydra-optuna-sweeper  hydra/sweeper=optuna (Optuna 2) searches; a direction against the
#           objective's is one line before any trial; then the test suite's tests of that sweeper
# Usage: .ci/extras.sh [--prepare] [extra ...] (default: all); EXTRAS_DIR keeps the venvs (default: a
# temporary one). --prepare only builds the venvs (network and disk, little CPU), so that CI can build
# them while the test suites run; a later call with the same EXTRAS_DIR checks in them.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
export PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1 PYTHONPATH=
WORK=${EXTRAS_DIR:-$(mktemp -d -t tfkv-extras.XXXXXX)}
mkdir -p "$WORK"
PYTHON=${PYTHON:-python3}
LEAN=(epochs=1 steps_per_epoch=4 progress=false)

PREPARE=false
[ "${1:-}" != --prepare ] || { PREPARE=true; shift; }
[ -n "$(ls "$WORK"/wheel/tfkv-*.whl 2>/dev/null)" ] || "$PYTHON" -m pip wheel -q --no-deps -w "$WORK/wheel" "$REPO"
WHEEL=$(ls "$WORK"/wheel/tfkv-*.whl)

# What each extra's venv holds (@ is the wheel). hydra-optuna-sweeper as docs/guides/sweeps.md installs it: Optuna 2
# keeps a study in a database only through SQLAlchemy 1.4; pytest for its tests of that sweeper.
declare -A PACKAGES=(
  [cpu]="@[cpu]"
  [sweep]="@[cpu,sweep]"
  [mlflow]="@[cpu,mlflow]"
  [hydra-optuna-sweeper]="@[cpu] hydra-optuna-sweeper sqlalchemy<2 alembic<1.14 pytest pytest-timeout pyyaml"
)

# uv, where it is installed, makes each venv from its cache in seconds (pip takes minutes for TensorFlow)
if command -v uv >/dev/null; then
  make_venv() { uv venv -q --python "$PYTHON" "$1"; }
  install() { local dir=$1; shift; uv pip install -q --python "$dir/bin/python" "$@"; }
else
  make_venv() { "$PYTHON" -m venv "$1"; }
  install() { local dir=$1; shift; "$dir/bin/pip" install -q "$@"; }
fi

build() {  # build NAME: a fresh venv holding PACKAGES[NAME], unless one was built for them already
  local dir="$WORK/$1" packages=${PACKAGES[$1]//@/$WHEEL}
  [ "$(cat "$dir/.packages" 2>/dev/null)" != "$packages" ] || return 0
  rm -rf "$dir"
  make_venv "$dir"
  set -f; install "$dir" $packages; set +f  # no globbing of [cpu]
  echo "$packages" >"$dir/.packages"
}

venv() {  # venv NAME: its venv built; its bin/ first on PATH
  local dir="$WORK/$1"
  build "$1"
  export PATH="$dir/bin:${PATH#"$WORK"/*/bin:}" VIRTUAL_ENV="$dir"
  echo "== $(basename "$dir"): $("$dir/bin/python" -c 'from importlib import metadata as m
print(" ".join(f"{d.name}=={d.version}" for d in m.distributions()
               if d.name.lower() in ("tfkv", "optuna", "mlflow", "hydra-optuna-sweeper", "sqlalchemy")))')"
}

fresh() { local d="$WORK/run-$1"; rm -rf "$d"; mkdir -p "$d"; echo "$d"; }

one_line() {  # one_line WORDS CMD...: CMD exits 2 with a single tfkv-run line that has WORDS
  local words=$1 out; shift
  if out=$("$@" 2>&1 >/dev/null); then echo "FAIL: $* succeeded"; return 1; fi
  [ "$(printf '%s\n' "$out" | grep -c .)" = 1 ] && [[ $out == "tfkv-run: "*"$words"* ]] \
    || { echo "FAIL: $* said:"; printf '%s\n' "$out" | tail -5; return 1; }
}

check_cpu() {
  venv cpu
  cd "$(fresh cpu)"
  tfkv-run "${LEAN[@]}" >/dev/null
  one_line "tfkv[mlflow]" tfkv-run logger=mlflow "${LEAN[@]}"
  one_line "tfkv[sweep]" tfkv-run -m hydra/sweeper=tfkv_optuna 'optimizer.lr=interval(0.01,0.1)' "${LEAN[@]}"
  cd "$REPO"
}

check_sweep() {
  venv sweep
  cd "$(fresh sweep)"
  tfkv-run -m hydra/sweeper=tfkv_optuna hydra/launcher=joblib hydra.launcher.n_jobs=2 hydra.sweeper.n_trials=2 \
    hydra.sweeper.n_jobs=2 objective=test_loss 'optimizer.lr=choice(0.1,0.00001)' hydra.sweep.dir=sweep \
    "${LEAN[@]}" >/dev/null
  python - <<'EOF'
import optuna
from tfkv.sweep import pruning
study = optuna.load_study(study_name=None, storage=pruning.open_storage(pruning.storage_url("sweep/optuna.journal")))
assert study.direction.name == "MINIMIZE", study.direction
states = sorted(t.state.name for t in study.trials)
assert states == ["COMPLETE", "COMPLETE"], states
assert all(t.intermediate_values for t in study.trials), study.trials  # each trial's worker reported its epochs
losses = {t.number: t.value for t in study.trials}
assert study.best_trial.number == min(losses, key=losses.get), losses
print(f"   optuna {optuna.__version__}: 2 trials in 2 processes, one journal file, best = lowest test_loss")
EOF
  cd "$REPO"
}

check_mlflow() {
  venv mlflow
  local d port pid
  d=$(fresh mlflow)
  cd "$d"
  tfkv-run logger=mlflow "${LEAN[@]}" >/dev/null
  [ -s mlflow.db ] || { echo "FAIL: logger=mlflow wrote no mlflow.db"; return 1; }
  port=$(python -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  mlflow server --backend-store-uri sqlite:///mlflow.db --host 127.0.0.1 --port "$port" >server.log 2>&1 &
  pid=$!
  trap 'kill $pid 2>/dev/null || true' RETURN
  python - "$port" <<'EOF'
import json, sys, time, urllib.request
base = f"http://127.0.0.1:{sys.argv[1]}"
for _ in range(120):
    try:
        urllib.request.urlopen(base + "/health", timeout=2)
        break
    except OSError:
        time.sleep(1)
else:
    sys.exit(f"FAIL: mlflow server did not answer on {base} (server.log)")
def get(path):
    return json.load(urllib.request.urlopen(base + path, timeout=10))

def post(path, body):
    ask = urllib.request.Request(base + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    return json.load(urllib.request.urlopen(ask, timeout=10))

experiment = get("/api/2.0/mlflow/experiments/get-by-name?experiment_name=tfkv")["experiment"]["experiment_id"]
runs = post("/api/2.0/mlflow/runs/search", {"experiment_ids": [experiment]}).get("runs", [])
metrics = {m["key"] for m in runs[0]["data"]["metrics"]} if runs else set()
assert len(runs) == 1 and "test_accuracy" in metrics, runs
print(f"   mlflow server on {base} lists the run with its metrics")
EOF
  cd "$REPO"
}

check_hydra-optuna-sweeper() {
  venv hydra-optuna-sweeper
  cd "$(fresh hydra-optuna)"
  one_line "hydra.sweeper.direction=minimize but objective test_accuracy is to maximize" \
    tfkv-run -m hydra/sweeper=optuna 'optimizer.lr=interval(0.01,0.1)' "${LEAN[@]}"
  [ ! -d multirun ] || [ -z "$(ls multirun/*/*/0 2>/dev/null)" ] || { echo "FAIL: a trial ran"; return 1; }
  tfkv-run -m hydra/sweeper=optuna hydra.sweeper.n_trials=2 hydra.sweeper.n_jobs=1 objective=test_loss \
    'optimizer.lr=choice(0.1,0.00001)' "${LEAN[@]}" >/dev/null
  cd "$REPO"
  python -m pytest -q -p no:randomly -p no:cacheprovider -m slow -k hydra_s_own tests/sweep/test_sweep_optuna.py
}

if $PREPARE; then
  for e in ${@:-${!PACKAGES[@]}}; do build "$e" & done
  wait  # every build's status: set -e stops at the first that failed
  for e in ${@:-${!PACKAGES[@]}}; do [ -f "$WORK/$e/.packages" ] || { echo "FAIL: the $e venv was not built"; exit 1; }; done
  exit 0
fi

if [ $# -eq 0 ]; then
  # All of them: two lanes at once, for two cores (Hydra's Optuna sweeper is as long as the other three).
  # Each check is a call of this script, with errexit of its own, and its output in a log shown on failure.
  export EXTRAS_DIR=$WORK
  lane() {
    for e in "$@"; do
      "$REPO/.ci/extras.sh" "$e" >"$WORK/check-$e.log" 2>&1 || { cat "$WORK/check-$e.log"; echo "FAIL: $e"; return 1; }
      grep -v ': ok (' "$WORK/check-$e.log" | grep '^\(== \|   [^ ]\)' || true
      tail -1 "$WORK/check-$e.log"
    done
  }
  lane hydra-optuna-sweeper &
  first=$!
  lane cpu sweep mlflow &
  second=$!
  status=0
  wait "$first" || status=1
  wait "$second" || status=1
  exit "$status"
fi

for e in "$@"; do
  start=$SECONDS
  "check_$e"
  echo "   $e: ok ($((SECONDS - start)) s)"
done
