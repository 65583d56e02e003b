"""AMX tile permission for vLLM's CPU attention, asked once in each process vLLM starts.

``plugin.register`` calls it: vLLM runs its general plugins in every process, and the grant is
per process (it does not survive exec).
"""

from __future__ import annotations

import ctypes
import platform
import sys

_ARCH_REQ_XCOMP_PERM = 0x1023
_XFEATURE_XTILEDATA = 18
_SYS_ARCH_PRCTL = 158  # x86-64


def request_amx_permission() -> bool:
    """Ask Linux for AMX tile data, which vLLM's bf16 CPU attention uses without asking.

    Without it, the first AMX instruction in a process that oneDNN did not already enable
    dies with SIGILL. The grant does not survive exec, hence once per process. A no-op (False)
    off x86-64 Linux or where the CPU has no AMX.
    """
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.syscall(_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA)) == 0
    except (OSError, AttributeError):
        return False
