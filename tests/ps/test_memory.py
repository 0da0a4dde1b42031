"""tfkv.ps.memory: large buffers freed and allocated again each step cost no page faults (glibc
keeps them), in a fresh process, so that the allocator's state is this test's own."""

import platform
import subprocess
import sys

import pytest

from tfkv.ps import memory

_PROBE = """
import resource, sys
import numpy as np
from tfkv.ps import memory
applied = memory.keep_freed_buffers() if sys.argv[1] == "keep" else False
for _ in range(4):  # a step: two 16 MiB chunks alive at once (a key's and its sum) and 1 MiB, then freed
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    a = np.empty(16 << 20, np.uint8); a.fill(1)
    b = np.empty(16 << 20, np.uint8); b.fill(1)
    c = np.empty(1 << 20, np.uint8); c.fill(1)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    del a, b, c
print(applied, faults)  # the last step's
"""


def _faults(mode: str, **env: str) -> tuple[str, int]:
    import os

    # glibc's own settings from this shell would make the module stand aside: only the test's count.
    mine = {k: v for k, v in os.environ.items() if k not in memory._USER_SETTINGS}
    out = subprocess.run([sys.executable, "-c", _PROBE, mode], capture_output=True, text=True, check=True,
                         env={**mine, **env})
    applied, faults = out.stdout.split()
    return applied, int(faults)


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc",
                    reason="another C library than glibc: tfkv.ps.memory leaves it alone, and its allocator "
                           "keeps or returns memory by rules of its own")
def test_a_freed_large_buffer_is_reused_without_page_faults():
    applied, faults = _faults("keep")
    assert applied == "True"
    assert faults < 100  # kept in the heap: its pages are still mapped
    # glibc's default trims the heap between steps: ~1,260 of the step's 8,448 pages fault again
    assert _faults("default")[1] >= 500


def test_the_users_own_glibc_settings_win():
    assert _faults("keep", MALLOC_TRIM_THRESHOLD_="131072")[0] == "False"



def test_a_kept_buffer_is_handed_out_again_only_once_nothing_views_it():
    import numpy as np

    buffers = memory.Buffers(keep=2)
    a = buffers.take(1 << 20)
    view = np.frombuffer(memoryview(a), np.float32)  # a payload decoded from it, still in a round
    first = id(a)
    del a
    b = buffers.take(1 << 20)
    assert id(b) != first and b.nbytes == 1 << 20 and b.flags.writeable
    c = buffers.take(1 << 20)  # both kept ones in use, and no more kept: a fresh one, not kept
    assert c is not b and c.base is None
    del view, c
    assert id(buffers.take(1 << 20)) == first  # no view left: handed out again
    assert buffers.take(1 << 20) is not b  # b is still the caller's
    assert buffers.take(4096).nbytes == 4096 and len(buffers._kept) == 2
