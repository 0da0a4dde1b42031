"""Spreading training over devices: data parallelism now, model parallelism beside it."""
