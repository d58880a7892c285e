"""Triton's tooling extensions on ``dsedge serve``: model configuration, repository index and statistics, as the JSON
Triton's HTTP API answers (the gRPC front end parses the same dicts into the protobuf messages tritonclient ships).

The model configuration is derived from the bundle's manifest as ``dsedge export triton`` derives ``config.pbtxt``
(its dtype names and the bundle's batch range, toolchain/triton/): when the first dim of every input and output is
the same symbolic batch dim, ``max_batch_size`` is that dim's range max, ``dims`` leave it out and
``dynamic_batching`` is set (the server batches requests together); otherwise ``max_batch_size`` is 0 and ``dims``
are the full shapes. Symbolic dims are -1. ``backend`` is ``"dsedge"``, ``platform`` the one ``ModelMetadata``
reports (``dsedge_<backend>``); the latency budget is the parameter ``dsedge_budget_ms``.
"""
from __future__ import annotations

import time
from typing import Any

from .protocol import v2_datatype

_STATS = ("success", "fail", "queue", "compute_input", "compute_infer", "compute_output", "cache_hit", "cache_miss")


def triton_type(numpy_dtype: str) -> str:
    """A manifest dtype name as a Triton ``DataType`` (``float32`` → ``TYPE_FP32``), as the Triton export names
    them; v2 spellings for the rest (``BYTES`` is Triton's ``TYPE_STRING``)."""
    from ..toolchain.triton.warmup import TRITON_DTYPES

    if numpy_dtype in TRITON_DTYPES:
        return TRITON_DTYPES[numpy_dtype]
    v2 = v2_datatype(numpy_dtype)
    return "TYPE_STRING" if v2 == "BYTES" else f"TYPE_{v2}"


def model_config(name: str, session: Any, platform: str, budget_ms: float) -> dict[str, Any]:
    """Triton's model configuration (JSON, field names as in model_config.proto) of a served session."""
    from ..runtime.batching import BatchLayout
    from ..toolchain.triton.policy import batch_range

    manifest = session.manifest
    layout = BatchLayout.of(session.inputs, session.outputs)
    batched = layout.dynamic
    max_batch = batch_range(manifest, layout)["max"] if batched else 0

    def io(specs: Any) -> list[dict[str, Any]]:
        return [{"name": s.name, "data_type": triton_type(s.dtype),
                 "dims": [d if isinstance(d, int) and d >= 0 else -1 for d in s.shape][1 if batched else 0:]}
                for s in specs]

    cfg: dict[str, Any] = {"name": name, "platform": platform, "backend": "dsedge",
                           "version_policy": {"latest": {"num_versions": 1}}, "max_batch_size": max_batch,
                           "input": io(session.inputs), "output": io(session.outputs),
                           "parameters": {"dsedge_budget_ms": {"string_value": f"{budget_ms:g}"}}}
    if batched:
        cfg["dynamic_batching"] = {}
    return cfg


class ModelStats:
    """Triton's per-model statistics, as far as the server measures them; a few adds per request.

    Real: ``inference_count`` (rows answered: a request of ``n`` rows counts ``n``, as Triton counts),
    ``last_inference`` (ms since the epoch, last answer), ``success`` (answered requests, arrival → answer ns),
    ``fail`` (count of requests of this model that ended without an answer: refused, invalid, cancelled, failed;
    their ns are not timed and stay 0), ``queue`` (arrival → start of the batch that served it, answered requests),
    ``compute_infer`` (start of that batch → its answer: the model's time, answered requests).
    ``execution_count`` (batches run) is the sum of each answer's share of its batch (its rows / the batch's rows):
    exact when every row of a batch was answered. Zero, not measured: ``compute_input``, ``compute_output`` (the
    session does not time input and output copies apart from the run), ``cache_hit``/``cache_miss`` (no cache),
    ``batch_stats``.
    """

    __slots__ = ("rows", "ok", "ok_ns", "fail", "queue_ns", "infer_ns", "executions", "last_ms")

    def __init__(self) -> None:
        self.rows = self.ok = self.ok_ns = self.fail = self.queue_ns = self.infer_ns = self.last_ms = 0
        self.executions = 0.0

    def answered(self, rows: int, batch_rows: int, latency_ms: float, queue_ms: float, infer_ms: float) -> None:
        self.rows += rows
        self.ok += 1
        self.ok_ns += int(latency_ms * 1e6)
        self.queue_ns += int(queue_ms * 1e6)
        self.infer_ns += int(infer_ms * 1e6)
        self.executions += rows / max(batch_rows, rows, 1)
        self.last_ms = int(time.time() * 1e3)

    def failed(self) -> None:
        self.fail += 1

    def json(self, name: str, version: str) -> dict[str, Any]:
        """One entry of Triton's ``model_stats``."""
        ok, n = {"count": self.ok, "ns": self.ok_ns}, self.ok
        got = {"success": ok, "fail": {"count": self.fail, "ns": 0}, "queue": {"count": n, "ns": self.queue_ns},
               "compute_infer": {"count": n, "ns": self.infer_ns}}
        return {"name": name, "version": version, "last_inference": self.last_ms, "inference_count": self.rows,
                "execution_count": round(self.executions),
                "inference_stats": {k: got.get(k, {"count": 0, "ns": 0}) for k in _STATS}, "batch_stats": []}


def repository_index(repo: Any, version: str, draining: bool, ready_only: bool = False) -> list[dict[str, str]]:
    """Triton's repository index: every model the server was started with, ``READY`` or ``UNAVAILABLE`` (still
    loading, or the server draining) with the reason."""
    out = []
    for name in repo.names:
        m = repo.models.get(name)
        if m is not None and m.ready and not draining:
            out.append({"name": name, "version": version, "state": "READY"})
        elif not ready_only:
            why = "loading" if m is None or not (m.draining or draining) else "the server is shutting down"
            out.append({"name": name, "version": version, "state": "UNAVAILABLE", "reason": why})
    return out

