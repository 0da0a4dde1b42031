"""A KVStore type of its own: tfkv's local store under another name."""

from tfkv.store.local import LocalStore


class TwinStore(LocalStore):
    type = "twin"
