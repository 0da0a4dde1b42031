"""tfkv: declarative multi-device and distributed training on TensorFlow through an MXNet-style KVStore.

Importing tfkv does not import TensorFlow; the modules that need it import it themselves, so the
config layer, the launcher and the parameter-server roles start fast and run without it.
"""

__version__ = "0.1.0"
