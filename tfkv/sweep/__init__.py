"""Sweeps (`tfkv-run -m`): each job is a trial with a recorded result, the sweep a table of them;
the tfkv Hydra launcher (trials packed onto a cluster's hosts) and the Optuna sweeper with a
pruner plug into Hydra through the shims in hydra_plugins/tfkv_sweep."""
