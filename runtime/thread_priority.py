"""Lower the CPU priority of the calling thread (Linux ``nice`` is per thread), so that latency-critical threads of
the same process and machine preempt it.

A served model's compute runs on its lanes' worker threads (with one ONNX Runtime intra-op thread per instance, all
of it). On a machine with few cores they compete for CPU with the threads that admit requests and send answers: the
server's event loop, the gRPC poller, a client's own threads. At equal priority, under overload, a request then waits
in the front end before admission sees it, and an answer waits before it leaves, while both cores run batches. A
worker at a higher nice value still gets every idle cycle, but a woken front-end thread runs at once. Raising one's
own nice value needs no privilege (``setpriority(2)``; lowering it back does). With more than one intra-op thread per
backend, ONNX Runtime's pool threads (created when the session was opened, on another thread) keep the process's
priority: only the worker's own share of each batch is lowered.

Opt-in (default 0 everywhere): side by side in one run of benchmarks/triton_baseline.py (``--worker-nice
0,5,0,5``, MiniLM fp32 on a shared 2-core VM) nice 5 answered less within budget at every load than nice 0; runs
minutes apart had pointed the other way. Figures in docs/serve.md.
"""
from __future__ import annotations

import os
import sys
import threading

MAX_NICE = 19


def lower_current_thread(nice: int) -> bool:
    """Add ``nice`` (0…19) to the calling thread's nice value; True if it took effect.

    Linux only (elsewhere ``setpriority`` with a thread id would address a process): returns False there, and when
    the call is refused. Never raises for an OS refusal: a worker that keeps its priority still serves.

    Raises:
        ValueError: ``nice`` outside 0…19.
    """
    if not 0 <= int(nice) <= MAX_NICE:
        raise ValueError(f"nice must be in 0..{MAX_NICE}, got {nice!r}")
    if not nice or not sys.platform.startswith("linux"):
        return False
    tid = threading.get_native_id()
    try:
        current = os.getpriority(os.PRIO_PROCESS, tid)
        os.setpriority(os.PRIO_PROCESS, tid, min(current + int(nice), MAX_NICE))
    except OSError:
        return False
    return True


def thread_nice(tid: int | None = None) -> int:
    """The nice value of thread ``tid`` (default: the calling thread)."""
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id() if tid is None else tid)
