"""Turning `cpu:N` / `gpu:N` into TensorFlow devices, splitting the host CPU into logical devices.

TensorFlow fixes its devices the first time it is used, so `setup()` runs before any tensor is
made. A process that needs more logical CPUs later (a sweep whose next job asks for more) gets a
clear error instead of silently sharing one device.

GPUs get memory growth (TensorFlow takes GPU memory as it needs it, not all of it at once), so
workers that share a GPU fit side by side; TF_FORCE_GPU_ALLOW_GROWTH=false in the environment,
TensorFlow's own switch, turns it off.
"""

from __future__ import annotations

import os
from typing import Sequence

import tensorflow as tf

from tfkv.config import parse_device
from tfkv.errors import ConfigError
from tfkv.parallel import binding

# Splitting once into a few extra logical CPUs lets later jobs of a sweep use up to this many.
_MIN_LOGICAL_CPUS = 8


def setup(devices: Sequence[str]) -> list[str]:
    """Make the listed devices exist and return their TensorFlow names, in order."""
    parsed = [parse_device(d) for d in devices]
    want_cpus = max([i + 1 for kind, i in parsed if kind == "cpu"] or [1])
    cpu = tf.config.list_physical_devices("CPU")[0]
    try:
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration()] * max(want_cpus, _MIN_LOGICAL_CPUS))
    except RuntimeError:
        pass  # already initialised by an earlier job in this process; checked below
    grow_gpu_memory()
    have_cpus = len(tf.config.list_logical_devices("CPU"))
    gpus = tf.config.list_logical_devices("GPU")
    names = []
    for (kind, i), spec in zip(parsed, devices):
        if kind == "cpu" and i >= have_cpus:
            raise ConfigError(
                f"devices: {spec} does not exist in this process (TensorFlow was started with "
                f"{have_cpus} logical CPUs); run this job on its own, not after a smaller one in a sweep")
        if kind == "gpu" and i >= len(gpus):
            found = ", ".join(f"gpu:{j}" for j in range(len(gpus))) or "no GPU"
            bound = f" ({binding.bound})" if binding.bound else ""
            raise ConfigError(
                f"devices: {spec} does not exist on this machine (found {found}){bound}; "
                f"use devices=[cpu:0] or install the GPU build with pip install 'tfkv[gpu]'")
        names.append(f"/device:{kind.upper()}:{i}")
    return names


def grow_gpu_memory() -> None:
    """Memory growth on every GPU TensorFlow sees, unless TF_FORCE_GPU_ALLOW_GROWTH decides."""
    if "TF_FORCE_GPU_ALLOW_GROWTH" in os.environ:
        return
    for gpu in tf.config.list_physical_devices("GPU"):
        try:
            tf.config.experimental.set_memory_growth(gpu, True)
        except RuntimeError:
            pass  # initialised by an earlier job in this process, which set it already
