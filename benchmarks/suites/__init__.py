"""One module per benchmark, run as `python -m benchmarks <name>` (benchmarks/__main__.py lists
them): each declares its contenders and its table and runs on benchmarks.harness."""

# The suites in the performance page's order: one process, then the parameter server, then jobs
# and clusters (benchmarks/suites/<name>.py; each writes benchmarks/results/<name>.json).
SUITES = ("local_step", "model_parallel", "data_rss", "checkpoint", "gpu", "compression_speed", "pushpull", "server_cpu",
          "security", "overlap", "dist_training", "timeline", "compression_training", "compression_accuracy", "scaling",
          "sweep", "failfast",
          "control_plane", "cluster", "embedding", "trees")
