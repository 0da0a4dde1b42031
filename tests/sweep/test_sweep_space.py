"""hydra/sweeper=tfkv_optuna's search space: more trials than a finite space has points is told
before the first trial (Optuna's samplers other than the grid's would run points again)."""

from tfkv.sweep.optuna_sweeper import search_space, too_many_trials

CHOICES = ["optimizer=choice(sgd,adam)", "model.hidden=choice([64],[128,64])"]  # docs/guides/sweeps.md's


def test_more_trials_than_a_finite_space_has_points_is_told_with_the_fixes():
    space, _ = search_space(CHOICES)
    said = too_many_trials(12, space)
    assert said is not None and said.startswith("hydra.sweeper.n_trials=12 but the search space has only 4 point(s)")
    assert "hydra.sweeper.n_trials=4" in said and "hydra/sweeper/sampler=grid" in said and "\n" not in said
    assert too_many_trials(4, space) is None


def test_a_stepped_range_counts_its_values_and_a_continuous_key_makes_the_space_endless():
    stepped, _ = search_space(["epochs=range(1,4)", "optimizer=choice(sgd,adam)"])  # 3 x 2
    assert "has only 6 point(s)" in too_many_trials(7, stepped)
    assert too_many_trials(6, stepped) is None
    endless, _ = search_space([*CHOICES, "optimizer.lr=tag(log,interval(0.001,0.3))"])
    assert too_many_trials(1000, endless) is None
