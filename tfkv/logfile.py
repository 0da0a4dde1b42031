"""The run directory's log files (`tfkv.log`, `worker0.log`), kept by Hydra's logging config.

A log file is a copy of what the console shows. When it cannot be written (a full disk), it
stops with one line on stderr instead of Python's "--- Logging error ---" traceback on every
record, and the job goes on to succeed or fail on its own account.
"""

from __future__ import annotations

import logging
import sys


class FileHandler(logging.FileHandler):
    """logging.FileHandler that gives up quietly, once, on an OSError."""

    broken = False

    def emit(self, record: logging.LogRecord) -> None:
        if not self.broken:
            super().emit(record)

    def handleError(self, record: logging.LogRecord) -> None:
        error = sys.exc_info()[1]
        if not isinstance(error, OSError):
            super().handleError(record)
            return
        self.broken = True
        stream, self.stream = self.stream, None
        try:
            if stream is not None:
                stream.close()
        except OSError:
            pass  # its buffer cannot be written either
        sys.stderr.write(f"tfkv: cannot write {self.baseFilename} ({error.strerror or error}); "
                         "logging to the console only\n")

    def flush(self) -> None:
        if not self.broken:
            super().flush()
