"""Lower the CPU priority of the calling thread (Linux ``nice`` is per thread), so that latency-critical threads of
the same process and machine preempt it; and pin it to cores of its own (Linux affinity is per thread too).

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

Pinning (``pin_current_thread``, on by default for 1-thread CPU instances: ``dsedge.load(pin_instances=)``): left
to the OS scheduler, two 1-thread instances' workers (started by one thread, woken by the one that admits requests)
were often kept on one core together while the other idled. Measured on a 2-core VM (MiniLM int8, batch 1, two
sessions started together and run back to back): both runs took 8.5-9.4 ms instead of 5.3-6.0 in 3 of 6 starts, for
every run of those starts (29 of 60 runs over 8 ms); pinned to a core each, 0 of 60.

Served in process (benchmarks/streaming.py's schedule, MiniLM int8, two 1-thread instances, a fixed budget and rate
per pair, three interleaved pairs of 10 s windows), pinned against not: 90.2-92.4 % of offered in budget against
84.9-90.1 % at 0.5x the batch-1 capacity and 78.1-84.1 against 75.0-81.8 % at 0.9x (13.5 ms budget); at 3x, goodput
331.7 / 350.0 against 287.3 / 302.2 per s (36 ms budget) and 262.2 / 274.7 against 189.8 / 266.6 (13.5 ms). In
budget of admitted moved within 98.2-99.6 % either way.
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


def pin_current_thread(cpus) -> bool:
    """Restrict the calling thread to the cores ``cpus`` (an iterable of core ids); True if it took effect.

    Linux only (``sched_setaffinity`` with pid 0 addresses the calling thread there): returns False elsewhere, for
    an empty ``cpus``, and when the call is refused (a core outside the process's cpuset). Never raises for an OS
    refusal: a worker that keeps the process's affinity still serves.
    """
    cpus = frozenset(int(c) for c in (cpus or ()))
    if not cpus or not sys.platform.startswith("linux") or not hasattr(os, "sched_setaffinity"):
        return False
    try:
        os.sched_setaffinity(0, cpus)
    except OSError:
        return False
    return True


def thread_cpus(tid: int | None = None) -> frozenset[int]:
    """The cores thread ``tid`` (default: the calling thread) may run on (Linux)."""
    return frozenset(os.sched_getaffinity(0 if tid is None else tid))
