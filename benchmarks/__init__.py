"""tfkv's benchmarks: each measures tfkv against a baseline run in the same process tree, same run.

    python -m benchmarks                 # the list
    python -m benchmarks pushpull --trials 3 --seconds 0.5

The package runs from the repository root (or with it on PYTHONPATH); it is not installed with
tfkv. `harness` is the one harness (trials, warm-up, timing, contenders, medians, result records),
`jobs` the multi-process jobs the benchmarks start (their workers run as `python -m
benchmarks.jobs`), `suites/` one module per benchmark, `report` the performance page made from
the records in `results/`.
"""
