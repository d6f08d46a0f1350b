"""This process's resident memory as the kernel counts it (Linux ``/proc/self``): now, and at its peak.

The peak is ``VmHWM``, the high-water mark of the process's own address space. ``getrusage``'s ``ru_maxrss`` is
not that: ``exec`` carries the old image's high-water mark over, and a child's old image is its parent's forked
copy, so a process started by a large one (a benchmark's probe, a rank under its launcher) reports at least its
parent's size.
"""
import os
import resource


def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_resident_bytes() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024  # kB
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # no /proc: Linux's KiB, inherited peak
