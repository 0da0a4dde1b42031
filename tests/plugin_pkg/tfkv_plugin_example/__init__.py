"""One tfkv plug-in of each kind, for tfkv's own tests."""
