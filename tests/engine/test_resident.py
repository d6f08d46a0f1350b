"""A process's peak memory is its own, not its parent's (benchmark probes and ranks are started by larger ones)."""
import subprocess
import sys

import pytest

from pretrain.resident import peak_resident_bytes

PARENT_BYTES = 400 * 2**20


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self")
def test_a_childs_peak_excludes_its_parents_memory():
    held = bytearray(PARENT_BYTES)
    held[::4096] = b"\1" * len(held[::4096])  # touched: resident
    assert peak_resident_bytes() >= PARENT_BYTES
    child = ("import resource; from pretrain.resident import peak_resident_bytes; "
             "print(peak_resident_bytes(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)")
    peak, inherited = map(int, subprocess.run([sys.executable, "-c", child], capture_output=True, text=True,
                                              check=True).stdout.split())
    assert inherited >= PARENT_BYTES  # what ru_maxrss says: the parent's forked image carried over exec
    assert peak < PARENT_BYTES / 4  # what the child itself held: an interpreter and a small import
