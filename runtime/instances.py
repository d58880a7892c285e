"""The CPU serving layout: how many backends of one variant (Triton's instance group) serve it on ONNX Runtime's CPU
provider, with how many intra-op threads each, and how a latency measured with one thread count stands for another.

Shared by ``dsedge.load`` (which opens the instances) and ``dsedge build`` (which times the candidate precisions
and records the variants' latency in the layout the runtime will serve them in on the build host).
"""
from __future__ import annotations

import os

from .bundle import first_latency
from .errors import InputError

# (threads_a / threads_b) ** THREAD_EXPONENT: how much longer a run on threads_b intra-op threads takes than on
# threads_a, fitted on MiniLM fp32 at batch 1 on a 2-core host (10.3 ms on 1 thread, 6.6 ms on 2: 1.56x). A seed
# only: the runtime rescales a bundle's figures by this machine's own measurements as soon as there are any.
THREAD_EXPONENT = 0.64


def host_cores() -> int:
    """CPU cores this process may run on (its affinity mask; ``os.cpu_count()`` where that is unknown)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


MAX_THREADS_PER_CORE = 4  # intra-op threads past this only oversubscribe the cores (as ``instances=``)


def check_threads(threads: int | None, option: str = "threads") -> None:
    """Refuse an intra-op thread count above ``MAX_THREADS_PER_CORE`` per core of this host: ONNX Runtime starts
    every one of them (``threads=100000`` ran the host out of process ids).

    Raises:
        InputError: ``threads`` is more than 4 per core.
    """
    cores = host_cores()
    if threads is not None and int(threads) > MAX_THREADS_PER_CORE * cores:
        raise InputError(f"{option}={threads} is more than {MAX_THREADS_PER_CORE} per core ({cores} cores here): "
                         f"ONNX Runtime starts each as an OS thread",
                         f"pass {option} between 1 and {MAX_THREADS_PER_CORE * cores}, or leave it out for ONNX "
                         f"Runtime's choice")


def cpu_layout(instances: int | None, threads: int | None, cores: int) -> tuple[int, int | None]:
    """``(instances, intra-op threads each)`` on ONNX Runtime's CPU provider with ``cores`` cores.

    Given ``instances``, that many, each with ``threads`` (None: ``cores // instances`` when more than one).
    None: 2 instances of ``cores // 2`` threads each when ``threads`` is not given and there are 2 cores or more,
    else 1 (with ``threads``, or ORT's default when None). Measured on a 2-core host (MiniLM fp32, batch 1): two
    1-thread sessions side by side serve 1.41x the rows/s of one 2-thread session (200 vs 142 rows/s), with a lower
    tail at full load (p98 11.0 vs 16.5 ms with two callers on the one session); see docs/streaming.md.
    """
    if instances is None:
        instances = 2 if (threads is None and cores >= 2) else 1
    n = int(instances)
    if threads is None and n > 1:
        return n, max(1, cores // n)
    return n, threads


def reserved_layout(instances: int | None, threads: int | None, cores: int, reserve: int) -> tuple[int, int | None]:
    """The layout over the cores left after ``reserve`` of them (at least one) are kept for the caller's own
    threads (``dsedge serve``: its event loop, which parses, admits and answers every call). ``reserve`` 0:
    ``cpu_layout``. Else ``instances`` (None: one 1-thread instance per usable core up to 3, then 2) with
    ``threads`` each (None: the usable cores split between them, at least 1), so that no lane thread takes the
    reserved core: 2 cores -> one 1-thread instance, 4 -> three, 8 -> two of 3 threads."""
    if reserve <= 0:
        return cpu_layout(instances, threads, cores)
    usable = max(1, cores - int(reserve))
    n = int(instances) if instances is not None else (usable if usable <= 3 else 2)
    return n, (threads if threads is not None else max(1, usable // n))


def serving_threads(cores: int | None = None) -> int:
    """Intra-op threads of one instance in the default CPU layout here (``cpu_layout(None, None, cores)``): what a
    build times its variants with, so that the figures and the choice between precisions are those of serving."""
    cores = host_cores() if cores is None else int(cores)
    return cpu_layout(None, None, cores)[1] or cores


def thread_scale(measured_threads: int | None, threads: int | None) -> float:
    """The factor a latency measured on ``measured_threads`` intra-op threads takes on ``threads``:
    ``(measured_threads / threads) ** THREAD_EXPONENT`` (> 1 on fewer threads, < 1 on more); 1.0 when either is
    unknown (None or 0)."""
    if not measured_threads or not threads:
        return 1.0
    return (float(measured_threads) / float(threads)) ** THREAD_EXPONENT


def recorded_threads(latency_ms: dict | None) -> int | None:
    """The intra-op threads a bundle variant's build-time ``latency_ms`` was measured with (``"threads"`` of its
    batch-1 record, written by ``dsedge build`` since it times in the serving layout), or None for a bundle that
    does not say (those were timed with ORT's default: one thread per core of the build host)."""
    t = first_latency(latency_ms).get("threads")
    return int(t) if isinstance(t, int) and not isinstance(t, bool) and t > 0 else None


def instance_cpus(count: int, threads: int | None, allowed: list[int] | None = None,
                  reserve: int = 0) -> list[frozenset[int]] | None:
    """Cores for each of ``count`` instances of ``threads`` intra-op threads: one core of ``allowed`` (default: this
    process's affinity, in order) each when every instance has one thread and there are at least as many cores as
    instances, else None (no pinning: an instance of more threads runs most of its work on ONNX Runtime's own pool
    threads). See runtime/thread_priority.py for why 1-thread instances are pinned. ``reserve``: the last that many
    cores of ``allowed`` are the caller's (``load(reserve_cores=)``): no instance is pinned there (2 instances on
    2 cores with 1 reserved were pinned to both, one onto the reserved core)."""
    if allowed is None:
        try:
            allowed = sorted(os.sched_getaffinity(0))
        except (AttributeError, OSError):  # not Linux
            return None
    if reserve > 0:
        allowed = list(allowed)[:max(0, len(allowed) - int(reserve))]
    if threads != 1 or count < 1 or count > len(allowed):
        return None
    return [frozenset({allowed[i]}) for i in range(count)]
