"""One tfkv plug-in of each kind, for tfkv's own tests."""

from tfkv_plugin_example.data import make as make_blobs  # noqa: F401
