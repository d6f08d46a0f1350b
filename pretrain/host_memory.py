"""Keep freed host memory for reuse, as a caching allocator does, so that a CPU step stops paying the kernel.

PyTorch allocates CPU tensors with glibc's ``malloc``, which maps a block over its mmap threshold (128 KiB, rising
with what is freed to at most 32 MiB) fresh from the kernel and unmaps it on ``free``, and hands the top of its heap
back once more than the trim threshold lies free there. A training step allocates and frees the same large
temporaries every step, so every step faults each of their 4 KiB pages in again and has the kernel zero it: on a
KDA recall run on CPU, 30–44 % of the process's time was the kernel's, and it grows as the run goes (larger
temporaries). With ``M_MMAP_MAX`` 0 and ``M_TRIM_THRESHOLD`` at its largest, every block comes from the heap and
what is freed stays there for the next step: the process holds its peak instead of returning to it each step.
"""
import ctypes
import ctypes.util

M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # mallopt's parameters (malloc.h)
LARGEST_TRIM_THRESHOLD = 2**31 - 1  # mallopt takes an int: hand back only a free top of 2 GiB or more


def keep_freed_memory() -> bool:
    """Have glibc's ``malloc`` serve every block from its heap and keep what is freed; True where it did, False
    where this is not glibc (musl, macOS: nothing changes). Blocks already mapped are unaffected; call it before the
    model is built."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, TypeError, AttributeError):  # no C library found, or one without mallopt
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(M_MMAP_MAX, 0)) and bool(mallopt(M_TRIM_THRESHOLD, LARGEST_TRIM_THRESHOLD))
