"""A plug-in whose module breaks on import (a dependency its package forgot)."""

import tfkv_plugin_example_missing_dependency  # noqa: F401

Store = None
