"""Which value a run returns (its `objective`) and which way that value is better (`direction`):
the one definition the run's return value, the sweep table, tfkv's Optuna sweeper and the check
of Hydra's Optuna sweeper's setting all use.

`objective: null` (the default) is what the run reports: test_accuracy where it reports one, else
test_loss; a run that is not a sweep never has to name one. `direction: auto` (the default)
follows the objective's name as Keras's callbacks decide `mode="auto"`: names of accuracy-like
values (acc, auc, precision, recall, ... or starting with fmeasure) are maximised, losses, errors
and everything else minimised. A metric whose name says nothing (a user's own) is given its way
with direction=maximize or minimize.
"""

from __future__ import annotations

from typing import Any, Iterable

AUTO = "auto"
DIRECTIONS = ("maximize", "minimize")
# Parts of a name that make its value better when higher: Keras 2's callbacks' "acc" in the name
# (or a name starting with fmeasure), widened to the metrics Keras 3 declares `direction="up"`
# (AUC, precision, recall, IoU (Keras names it io_u), F-scores, R2, correlations, cosine
# similarity, ...; tests/check/test_config.py checks them against Keras's) and tfkv's throughput.
HIGHER_IS_BETTER = ("acc", "auc", "precision", "recall", "iou", "io_u", "f1", "fbeta", "r2", "correlation",
                    "cosine_similarity", "specificity", "sensitivity", "samples_per_sec")


def better(name: str) -> str:
    """"maximize" or "minimize": the way `name`'s value is better, from the name alone. Matched
    on the name's words (split at "_"), never on letters inside one: `test_decoder2_loss` (one
    output's loss) and `test_header2_mae` are minimised although "r2" and "acc" hide in them."""
    words = name.lower().removeprefix("train_").removeprefix("test_").split("_")
    if words[0].startswith("fmeasure"):
        return "maximize"
    if words[-1] == "loss":  # a loss, also one output's (<output>_loss)
        return "minimize"
    joined = f"_{'_'.join(words)}_"
    if any(w.startswith("acc") for w in words) or any(f"_{part}_" in joined for part in HIGHER_IS_BETTER):
        return "maximize"
    return "minimize"


def default(reported: Iterable[str]) -> str:
    """The objective of a config that names none: test_accuracy where the run reports it."""
    return "test_accuracy" if "test_accuracy" in set(reported) else "test_loss"


def direction(objective: str, declared: Any) -> str:
    """`declared` where it is maximize or minimize, else (auto, null) the objective's own way."""
    return str(declared) if declared in DIRECTIONS else better(objective)
