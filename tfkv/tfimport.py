"""Import TensorFlow without the C++ log lines it writes to stderr before its logging is set up.

TensorFlow 2.21, on CPUs where it turns oneDNN's custom operations on (AVX-512 ones among them),
writes two lines to file descriptor 2 while it loads, whatever TF_CPP_MIN_LOG_LEVEL says:
absl's "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR"
and an `I0000 ...] oneDNN custom operations are on` line. They turned tfkv's one-line errors into
three lines and put a WARNING into every run's output. `import_tensorflow` imports it with fd 2
going to a temporary file, then writes back every line TF_CPP_MIN_LOG_LEVEL does not hide (its
levels: 1 hides INFO, 2 also WARNING, 3 also ERROR), so nothing else TensorFlow or Python says
while importing is lost. `quietly` does the same for any module that may import TensorFlow first
(the user's model or data module, a streaming reader: tfkv.target). Imports nothing of tfkv.
"""

from __future__ import annotations

import importlib
import os
import re
import sys
import tempfile
from types import ModuleType

_ABSL_NOTICE = "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR"
_GLOG_LINE = re.compile(r"^([IWE])\d{4} ")  # I0000 00:00:1795... port.cc:153] ...
_HIDDEN_FROM = {"I": 1, "W": 2, "E": 3}  # the TF_CPP_MIN_LOG_LEVEL that hides each severity


def shown(line: str, level: int) -> bool:
    """Whether TF_CPP_MIN_LOG_LEVEL=`level` lets `line` (of TensorFlow's stderr) through."""
    if line.startswith(_ABSL_NOTICE):
        return level < 1
    m = _GLOG_LINE.match(line)
    return m is None or level < _HIDDEN_FROM[m.group(1)]


def import_tensorflow() -> ModuleType:
    """`import tensorflow`, quiet as TF_CPP_MIN_LOG_LEVEL asks (the module if already imported)."""
    return quietly("tensorflow")


def quietly(name: str) -> ModuleType:
    """`importlib.import_module(name)`, with TensorFlow's load-time lines filtered as
    TF_CPP_MIN_LOG_LEVEL asks when the import may load TensorFlow for the first time: a user's
    model or data module, a streaming reader, that imports it at its top."""
    if "tensorflow" in sys.modules or name in sys.modules:
        return importlib.import_module(name)
    try:
        level = int(os.environ.get("TF_CPP_MIN_LOG_LEVEL", "0"))
    except ValueError:
        level = 0
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as caught:
        os.dup2(caught.fileno(), 2)
        try:
            return importlib.import_module(name)
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            caught.seek(0)
            for line in caught.read().decode(errors="replace").splitlines(keepends=True):
                if shown(line, level):
                    sys.stderr.write(line)
            sys.stderr.flush()
