"""Run the checks in this process or on a Dask distributed cluster; both merge shard states in data order.

Dask distributed rather than Ray Data: it is pure Python (dask + distributed + their small dependencies, a few MB),
starts a local cluster in seconds as ordinary processes, and maps a Python function over a list of shards, which is
all the checks need. Ray brings a ~100 MB native wheel, a GCS/raylet control plane and object store per node, and
its Dataset API would add a second way of reading files that this package already reads itself.
"""
from __future__ import annotations

import resource
import time
from contextlib import contextmanager
from typing import Iterator

from ...runtime.errors import DsedgeError
from .config import DataCheckConfig
from .entities import load_entities
from .report import build_report
from .scan import ScanPlan, ShardState, resolve_plan, scan_shard
from .sources import plan_shards

ENGINES = ("local", "dask")
DASK_SHARD_BYTES = 64 << 20


class EngineError(DsedgeError):
    """The distributed engine is not installed or cannot be reached."""


def require(*modules: str) -> None:
    """Raise a DsedgeError naming the ``data`` extra when one of ``modules`` is not installed."""
    import importlib.util

    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        raise DsedgeError(f"dsedge data check needs {', '.join(missing)}, which is not installed",
                          'pip install -e ".[data]"')


@contextmanager
def dask_client(workers: int = 2, scheduler: str | None = None) -> Iterator[object]:
    """A ``distributed.Client`` on ``scheduler`` (an existing cluster) or on a local cluster of ``workers``
    single-threaded worker processes, which is closed on exit."""
    try:
        from distributed import Client, LocalCluster
    except ModuleNotFoundError:
        raise EngineError("--engine dask needs dask[distributed], which is not installed",
                          'pip install -e ".[data]"') from None
    if scheduler:
        try:
            client = Client(scheduler, timeout="20s")
        except (OSError, TimeoutError) as e:
            raise EngineError(f"cannot reach the Dask scheduler at {scheduler}: {e}",
                              "start one with `dask scheduler` or drop --scheduler for a local cluster") from None
        try:
            yield client
        finally:
            client.close()
        return
    cluster = LocalCluster(n_workers=workers, threads_per_worker=1, processes=True, dashboard_address=None)
    client = Client(cluster)
    try:
        yield client
    finally:
        client.close()
        cluster.close()


def scan(plan: ScanPlan, engine: str = "local", shard_bytes: int | None = None, workers: int = 2,
         scheduler: str | None = None) -> tuple[ShardState, int]:
    """The merged state of every shard and the number of shards. ``local`` without ``shard_bytes`` reads each file
    as one stream; ``dask`` cuts shards of ``shard_bytes`` (default 64 MiB) and merges the results in data order."""
    if engine not in ENGINES:
        raise EngineError(f"unknown engine {engine!r}", f"engines: {', '.join(ENGINES)} (Ray is not supported: "
                          "see docs/datacheck.md)")
    if engine == "local":
        shards = plan_shards(plan.data, shard_bytes)
        acc = None
        for s in shards:
            st = scan_shard(plan, s)
            acc = st if acc is None else acc.merge(st)
        return acc, len(shards)
    shards = plan_shards(plan.data, shard_bytes or DASK_SHARD_BYTES)
    with dask_client(workers, scheduler) as client:
        futures = client.map(scan_shard, [plan] * len(shards), shards, pure=False)
        acc = None
        for fut in futures:                       # data order; workers run ahead
            st = fut.result()
            fut.release()
            acc = st if acc is None else acc.merge(st)
    return acc, len(shards)


def check_data(data: str, cfg: DataCheckConfig | None = None, tokenizer: str | None = None,
               entities_file: str | None = None, engine: str = "local", shard_bytes: int | None = None,
               workers: int = 2, scheduler: str | None = None, batch_rows: int = 4096) -> dict:
    """Run every check on ``data`` (file or directory) and return the report (see ``report.py``).

    ``report["run"]`` holds the engine, shard count, wall time (s), documents/s and this process's peak RSS (MiB);
    everything else is identical across engines and shardings.
    Raises DataError, ConfigError, TokenizerError, EntityFileError, EngineError (all DsedgeError).
    """
    cfg = cfg or DataCheckConfig()
    require("pandas", *(["datasketch"] if cfg.near else []))
    entities = load_entities(entities_file) if entities_file else None
    t0 = time.perf_counter()
    plan = resolve_plan(data, cfg, tokenizer, entities, batch_rows)
    state, n_shards = scan(plan, engine, shard_bytes, workers, scheduler)
    report = build_report(plan, state, cfg)
    wall = time.perf_counter() - t0
    docs = state.docs if plan.text_field else state.schema.rows
    report["run"] = {"engine": engine, "shards": n_shards, "wall_s": round(wall, 3),
                     "docs_per_s": round(docs / wall, 1) if wall else None,
                     "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)}
    return report
