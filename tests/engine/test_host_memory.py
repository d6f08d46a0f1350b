"""A CPU process that keeps freed memory allocates a step's large temporaries again without faulting their pages in."""
import platform
import subprocess
import sys

import pytest

# In a fresh process (mallopt changes it for good): the page faults of allocating, filling and freeing a 64 MiB
# tensor (over malloc's largest mmap threshold, so glibc maps it fresh each time), as a step would, twenty times before
# keep_freed_memory and twenty times after.
STEPS = 20
CHILD = f"""
import resource, torch
from pretrain.host_memory import keep_freed_memory

def faults_per_step():
    counts = []
    for _ in range({STEPS}):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        torch.empty(16 * 2**20).fill_(1.0)  # 64 MiB of fp32, freed at once
        counts.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    return counts

default = faults_per_step()
kept = keep_freed_memory()
print(kept, *default, *faults_per_step())
"""
PAGES = 64 * 2**20 // 4096


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt's parameters are glibc's")
def test_freed_memory_is_reused_instead_of_faulted_in_again():
    kept, *counts = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True,
                                   check=True).stdout.split()
    default, after = list(map(int, counts[:STEPS])), list(map(int, counts[STEPS:]))
    assert kept == "True"
    assert min(default) > PAGES / 2  # glibc's default: every allocation maps fresh pages
    # The heap grows for a few steps (seen: 5 to 7) while each freed block, a few bytes short of the next aligned
    # request, waits for a neighbour to merge with; from then on the same pages serve every step.
    assert sum(after[-STEPS // 2:]) < PAGES / 50, after
