"""Fetch a data file over HTTP(S) into place atomically, or say why it could not be fetched."""

from __future__ import annotations

import hashlib
import http.client
import os
import tempfile
from urllib.request import urlopen

from tfkv.errors import TfkvError

TIMEOUT_S = 10.0  # per socket operation: an offline machine fails fast instead of hanging


class FetchError(TfkvError):
    """The file could not be downloaded; the message is the short reason."""


def fetch(url: str, dest: str, md5: str | None = None) -> str:
    """Download `url` to `dest` (via a temp file renamed into place); return `dest`.

    The rename means a killed download never leaves a truncated file that a later run would
    mistake for the data set. With `md5`, a file whose digest differs is discarded.
    """
    directory = os.path.dirname(os.path.abspath(dest))
    try:
        os.makedirs(directory, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=".part-", suffix="-" + os.path.basename(dest))
    except OSError as e:
        raise FetchError(f"cannot write to {directory}: {e}") from e
    try:
        digest = hashlib.md5()
        with os.fdopen(fd, "wb") as out, urlopen(url, timeout=TIMEOUT_S) as response:
            while True:
                chunk = response.read(1 << 20)
                if not chunk:
                    break
                digest.update(chunk)
                out.write(chunk)
        if md5 is not None and digest.hexdigest() != md5:
            raise FetchError(f"{url} has md5 {digest.hexdigest()}, expected {md5}")
        os.replace(tmp, dest)
    except (OSError, http.client.HTTPException, ValueError) as e:  # URLError and timeouts are OSError
        raise FetchError(f"{url}: {' '.join(str(e).split())}") from e  # keep errors one line
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return dest


def file_md5(path: str) -> str:
    digest = hashlib.md5()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()
