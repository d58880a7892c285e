"""The served models: one ``Session`` per bundle behind a ``PriorityGate``, shared by the HTTP and gRPC front ends.

A model's v2 name is the manifest's name; bundles of the same model for different targets get ``NAME-TARGET``
(``NAME=PATH`` on the command line picks a name). Each model has one version, ``"1"``: the bundle's variants are not
versions a client pins but forms the budget-aware scheduler chooses between per request (``--cascade``), so the
variant that served a request is reported in the response ``parameters`` (``variant``) instead.
"""
from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import math
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from ..runtime.errors import DsedgeError, InputError, SessionClosedError
from ..runtime.io import validate_inputs
from ..runtime.results import Rejected
from .metrics import ServeMetrics
from .model_config import ModelStats, model_config
from .priority import PriorityGate, PriorityLevels
from .protocol import PRIORITY_PARAM, Deadline, ServeError, check_unsupported, deadline, invalid, not_found, \
    rejection, v2_datatype, v2_shape

log = logging.getLogger("dsedge.serve")
VERSION = "1"


@dataclass
class InferAnswer:
    """What a front end encodes: the outputs asked for (in request order) and the response ``parameters``."""

    outputs: dict[str, np.ndarray]
    parameters: dict[str, Any]
    answered_at: float | None = None  # perf_counter when the backend answered (None: answered at admission)
    rows: int = 1  # the request's rows along the batch axis (1 without one)
    compute_ms: float = 0.0  # start of the batch that served it → its answer


_SERVED_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")


class WayBack:
    """An answer's way back, ms: from its completion on the backend thread to the end of the call over gRPC
    (gRPC's done callback: response and status handed to the transport), to its coroutine running again over HTTP;
    the ``quantile`` of the answers of the last ``horizon_s`` (at most ``window`` of them), reserved out of each
    budget. ``initial_ms`` while fewer than ``min_samples`` are that recent, so the reserve a burst left behind
    cannot keep refusing tight budgets once nothing is being answered: it ages out. Refreshed every ``every``
    answers and at least every ``horizon_s / 8`` when read.

    p99 by default, the in-budget share a budgeted server aims at: with the p90, one answer in ten whose way back
    was slower than that went out late. Measured with benchmarks/triton_baseline.py's load (MiniLM int8, 50 ms,
    2 cores, two interleaved rounds): in budget of admitted 99.2 / 95–98 % at 0.5× / 1.5× with the p99 against
    96.6–97.0 / 93–96 % with the p90, the same goodput within noise. Timed only to the handler running again,
    gRPC's way back missed the response's own send: at 3× that load (MiniLM fp32, 2 × 1-thread instances) its
    p50/p90/p99 were 0.5/2.6/6.1 ms against 2.2/6.2/10.3 ms to the call's end.

    The client's side of the way back (its transport and its own callback getting a core) is not measured here;
    it is taken as ``client_share`` (1) times this side's reserve and also left out of the scheduler's budget. A
    call with time left only for this side's half is refused ``budget``, as the scheduler refused such calls
    before (too little left for any batch). Measured through ``dsedge serve`` with benchmarks/triton_baseline.py's
    client at 3× (MiniLM int8, 50 ms, 2 cores, the client on the same cores; 16 interleaved pairs of cold 8 s
    windows, `/tmp` driver): answers leaving the server in time and reaching the client late went from 5.0 / 6.4
    to 2.9 / 4.4 per window, in budget of admitted by the client's clock was higher in 12 of 16 pairs (means
    96.5 → 98.4 % and 98.4 → 98.8 % in two rounds of 8), goodput within noise (141 / 166 against 151 / 176 per s).

    The way back grows with the answer (its serialization and send): each sample keeps its answer's size class
    (``size_class``: up to 64 KiB, then one class per 4× more bytes), and a call's reserve is the quantile of the
    samples whose class is at most that of the answer it expects, and for a big answer (class 1 and up) at least the
    median of its own class's recent samples (one 12.6 MB answer among 300 small ones left a 1.2 ms reserve). Before
    that, one 16 × 512-token MiniLM answer over gRPC (12.6 MB, 80 ms on its way back) set the p99 for every call of
    the next 2 s: 84 of 165 calls of 4 tokens with 50 ms budgets were refused ``budget`` (a user's pass,
    2026-12-05)."""

    def __init__(self, window: int = 256, every: int = 32, initial_ms: float = 1.0, quantile: float = 99.0,
                 horizon_s: float = 2.0, min_samples: int = 8, client_share: float = 1.0) -> None:
        self.client_share = float(client_share)
        self._times: collections.deque[tuple[float, float, int]] = collections.deque(maxlen=window)
        self._every = every
        self._quantile = quantile
        self._initial = initial_ms
        self._horizon = horizon_s
        self._min = min_samples
        self._n = 0
        self._ms: dict[int, float] = {}  # size class -> reserve, ms, as of self._t
        self._t = -float("inf")

    @staticmethod
    def size_class(nbytes: int) -> int:
        """0 for an answer of up to 64 KiB, then 1, 2, … for each 4× more bytes."""
        return 0 if nbytes <= 65536 else math.ceil(math.log(nbytes / 65536, 4))

    def add(self, ms: float, now: float | None = None, nbytes: int = 0) -> None:
        """One answer's way back, ``ms``, for an answer of ``nbytes`` (its outputs' bytes)."""
        now = time.perf_counter() if now is None else now
        self._times.append((now, ms, self.size_class(nbytes)))
        self._n += 1
        if self._n % self._every == 0:
            self._refresh(now)

    def client_ms(self, reserve_ms: float) -> float:
        """The client's side of the way back, ms, for a measured reserve of ``reserve_ms``: no server-side clock
        sees it, so it is taken as ``client_share`` times this side's (see the class doc)."""
        return self.client_share * reserve_ms

    def at(self, now: float, nbytes: int = 0) -> float:
        """The reserve at ``now`` (perf_counter s) for an answer of ``nbytes``, ms."""
        if now - self._t >= self._horizon / 8:
            self._refresh(now)
        c = self.size_class(nbytes)
        ms = self._ms.get(c)
        if ms is None:
            recent = [(ms, sc) for t, ms, sc in self._times if now - t <= self._horizon and sc <= c]
            ms = float(np.percentile([m for m, _ in recent], self._quantile)) if len(recent) >= self._min \
                else self._initial
            alike = [m for m, sc in recent if sc == c] if c else []
            if alike:  # a rare big answer is not lost among the small ones: at least its class's recent median
                ms = max(ms, float(np.median(alike)))
            self._ms[c] = ms
        return ms

    def _refresh(self, now: float) -> None:
        self._ms.clear()
        self._t = now


@dataclass
class ServedModel:
    name: str
    path: Path
    session: Any
    gate: PriorityGate
    levels: PriorityLevels
    metrics: ServeMetrics
    ready: bool = False
    draining: bool = False
    way_back: WayBack = field(default_factory=WayBack)
    stats: ModelStats = field(default_factory=ModelStats)  # Triton's statistics (model_config.ModelStats)
    _ids: Any = field(default_factory=itertools.count)

    def __post_init__(self) -> None:
        from ..runtime.batching import BatchLayout

        self._inflight = self.metrics.inflight.labels(self.name)  # its child, looked up once
        self._batched = BatchLayout.of(self.session.inputs, self.session.outputs).dynamic
        self._config: dict[str, Any] | None = None

    # -- metadata ---------------------------------------------------------------------------------------------
    def metadata(self) -> dict[str, Any]:
        """v2 model metadata: datatypes in v2 spelling, -1 for dynamic dims."""
        s = self.session
        return {
            "name": self.name, "versions": [VERSION], "platform": f"dsedge_{getattr(s, 'backend_name', 'onnxruntime')}",
            "inputs": [{"name": i.name, "datatype": v2_datatype(i.dtype), "shape": v2_shape(i.shape)} for i in s.inputs],
            "outputs": [{"name": o.name, "datatype": v2_datatype(o.dtype), "shape": v2_shape(o.shape)}
                        for o in s.outputs],
        }

    def config(self) -> dict[str, Any]:
        """Triton's model configuration (JSON; see model_config.model_config), built once."""
        if self._config is None:
            self._config = model_config(self.name, self.session, self.metadata()["platform"],
                                        self.default_budget_ms())
        return self._config

    def describe(self) -> dict[str, Any]:
        s = self.session
        d = s.describe() if hasattr(s, "describe") else {"bundle": str(self.path)}
        d.update(model=self.name, default_budget_ms=self.default_budget_ms(),
                 variants=[v.name for v in self.session.manifest.variants])
        return d

    def default_budget_ms(self) -> float:
        """The session's default budget (``--budget-ms``, else the manifest's, else the target's), ms."""
        s = self.session
        if hasattr(s, "default_budget_ms"):
            return float(s.default_budget_ms())
        return float(s.manifest.latency_budget_ms or 50.0)

    def check_version(self, version: str | None) -> None:
        """NOT_FOUND unless ``version`` is empty (the model's one version) or names ``VERSION`` as an integer
        (``"1"``, or ``"01"`` as Triton reads it)."""
        if version and not (version.isascii() and version.isdigit() and version.lstrip("0") == VERSION):
            raise not_found(f"model {self.name!r} has no version {version!r} (versions: {VERSION})")

    def count_failure(self, protocol: str, e: ServeError) -> None:
        """Count a request of this model that ended with ``e`` (``dsedge_requests_total``: outcome ``rejected`` for
        a refusal, ``error`` for a server fault, else ``invalid``; reason ``e.reason``)."""
        self.metrics.failed(self.name, protocol, failure_outcome(e), e.reason)
        self.stats.failed()

    # -- inference --------------------------------------------------------------------------------------------
    async def infer(self, inputs: Mapping[str, np.ndarray] | Callable[[], Mapping[str, np.ndarray]],
                    params: Mapping[str, Any],
                    outputs: Sequence[str] | None, protocol: str, *, received: float | None = None,
                    transport_deadline: float | None = None, way_back_sent: bool = False) -> InferAnswer:
        """Admit, queue and run one request; raises ServeError for every way it can end without an answer (the
        front end counts those with ``count_failure``, as it does its own refusals before this).

        Args:
            inputs: the request's arrays by name, or a function that decodes them (raising ServeError): called
                only once the call is known to have budget left, so a call refused for its spent budget is not
                decoded.
            received: ``time.perf_counter()`` when the front end got the call (default: now); the budget counts
                from here.
            transport_deadline: the call's own deadline on that clock (gRPC: receipt + ``time_remaining()``).
                When it comes before ``received + budget`` it is the deadline, and the budget's source is
                ``"grpc_deadline"``: the client's clock started when it sent the call, so this is the one bound
                that includes the time the call queued inside gRPC before its handler ran.
            way_back_sent: the front end reports when the answer left (``way_back.add`` from the backend's
                answer to the call's end, as gRPC's done callback sees it) instead of this method timing it to
                the handler running again.
        The scheduler gets the budget less what is already spent and less ``way_back.at(now)`` (the recent p99 of
        the answer's way back, so it still leaves in time).
        """
        t_arrive = time.perf_counter() if received is None else received
        try:
            answer = await self._infer(inputs, params, outputs, t_arrive, transport_deadline, way_back_sent)
        except asyncio.CancelledError:  # the client went away or its gRPC deadline passed while it waited
            self.stats.failed()
            self.metrics.failed(self.name, protocol, "rejected", "deadline" if transport_deadline is not None
                                and time.perf_counter() >= transport_deadline else "cancelled")
            raise
        p = answer.parameters
        self.metrics.answered(self.name, protocol, p["variant"], p["latency_ms"] / 1e3, p["queue_ms"] / 1e3,
                              p["batch_size"], p["latency_ms"] <= p["budget_ms"])
        self.stats.answered(answer.rows, p["batch_size"], p["latency_ms"], p["queue_ms"], answer.compute_ms)
        return answer

    def _answer_bytes(self, checked: Mapping[str, np.ndarray], wanted: Sequence[str]) -> int:
        """The bytes of the ``wanted`` outputs for these inputs: their shapes' named dims as the inputs bind them
        (a dim no input names counts 1)."""
        s = self.session
        dims: dict[str, int] = {}
        for spec in s.inputs:
            if spec.name in checked:
                dims.update((d, n) for d, n in zip(spec.shape, np.shape(checked[spec.name])) if isinstance(d, str))
        return sum(math.prod(dims.get(d, 1) if isinstance(d, str) else int(d) for d in o.shape)
                   * np.dtype(o.dtype).itemsize for o in s.outputs if o.name in wanted)

    def _left_ms(self, dl: Deadline, t_arrive: float, waited: bool, nbytes: int = 0) -> tuple[float, float, float]:
        """``(budget left for the scheduler, ms spent since arrival, way-back reserve)``, all ms; raises the
        ``budget`` or ``deadline`` refusal when nothing is left. Under the way back measured on this side of the
        call: ``deadline`` (a miss) when the call waited in the priority gate or its budget is its gRPC deadline
        (time spent in the server's queues), else ``budget``. Under that and the client's side
        (``WayBack.client_ms``) together: ``budget``, as the scheduler refused such calls before (too little left
        for any batch)."""
        now = time.perf_counter()
        waited_ms, reserve = (now - t_arrive) * 1e3, self.way_back.at(now, nbytes)
        left = dl.budget_ms - waited_ms - reserve
        if left <= 0 < dl.budget_ms - waited_ms and not waited and dl.source != "grpc_deadline":
            raise rejection("budget", f"{dl.budget_ms - waited_ms:.3g} ms of the {dl.budget_ms:.3g} ms budget "
                                      f"left, under the {reserve:.3g} ms the answer needs to get back")
        if left <= 0:  # spent in gRPC's queue or the priority queue, or a budget under the parsing time
            raise rejection("deadline" if waited or dl.source == "grpc_deadline" else "budget",
                            f"budget of {dl.budget_ms:.3g} ms spent before the request reached the scheduler")
        client = self.way_back.client_ms(reserve)
        if left - client <= 0:  # time left for the answer's way back to the server's side of the call only
            raise rejection("budget", f"{dl.budget_ms - waited_ms:.3g} ms of the {dl.budget_ms:.3g} ms budget "
                                      f"left, under the {reserve + client:.3g} ms the answer needs to get back")
        return left - client, waited_ms, reserve + client

    async def _infer(self, inputs: Mapping[str, np.ndarray] | Callable[[], Mapping[str, np.ndarray]],
                     params: Mapping[str, Any], outputs: Sequence[str] | None, t_arrive: float,
                     transport_deadline: float | None, way_back_sent: bool = False) -> InferAnswer:
        s = self.session
        if self.draining:
            raise rejection("shutdown", "the server is shutting down")
        if not self.ready:
            raise ServeError(503, "UNAVAILABLE", f"model {self.name!r} is not ready", "not_ready")
        check_unsupported(params)
        dl = deadline(params, self.default_budget_ms())
        if transport_deadline is not None and transport_deadline < t_arrive + dl.budget_ms / 1e3:
            dl = Deadline((transport_deadline - t_arrive) * 1e3, "grpc_deadline")
        level = self.levels.level(params.get(PRIORITY_PARAM))
        names = [o.name for o in s.outputs]
        wanted = list(outputs) if outputs else names
        for o in wanted:
            if o not in names:
                raise invalid(f"model {self.name!r} has no output {o!r} (outputs: {', '.join(names)})")
        # a call whose budget is already spent (in gRPC's queue, by the smallest answers' way-back reserve) is
        # refused before its inputs are checked: under overload that is most of the calls refused, and validation
        # the costliest part
        self._left_ms(dl, t_arrive, False)
        if callable(inputs):
            inputs = inputs()
        try:
            checked = validate_inputs(s.inputs, inputs, s.manifest.shape_ranges)
        except InputError as e:
            raise invalid(str(e)) from None
        nbytes = self._answer_bytes(checked, wanted)
        waited = await self.gate.enter(level, dl.budget_ms / 1e3)
        self._inflight.inc()
        try:
            left, waited_ms, reserve = self._left_ms(dl, t_arrive, waited, nbytes)
            try:
                fut = s.submit_validated(checked, left, self.levels.dsedge_priority(level), next(self._ids))
            except SessionClosedError:
                raise rejection("shutdown", "the server is shutting down") from None
            except DsedgeError as e:
                raise invalid(str(e)) from None
            done_at: list[float] = []
            if fut.done():  # refused at admission: no round trip through the event loop's wake-up pipe
                res = fut.result()
            else:
                fut.add_done_callback(lambda _: done_at.append(time.perf_counter()))
                res = await asyncio.wrap_future(fut)
                if not way_back_sent:
                    self.way_back.add((time.perf_counter() - done_at[0]) * 1e3, nbytes=nbytes)
        finally:
            self._inflight.dec()
            self.gate.leave()
        if isinstance(res, Rejected):
            detail = res.detail
            if res.reason == "budget":  # the scheduler saw what was left of the caller's budget: say so
                detail += (f" (left of the {dl.budget_ms:.3g} ms budget after {waited_ms:.3g} ms before the scheduler "
                           f"and {reserve:.3g} ms reserved for the answer's way back)")
            raise rejection(res.reason, detail)
        if res.error is not None:
            raise ServeError(500, "INTERNAL", f"the backend failed: {res.error}", "backend_error")
        latency_ms = (time.perf_counter() - t_arrive) * 1e3
        return InferAnswer(
            outputs={o: res.outputs[o] for o in wanted},
            parameters={"variant": res.variant, "latency_ms": round(latency_ms, 3),
                        "queue_ms": round(waited_ms + res.queue_ms, 3), "batch_size": int(res.batch_size),
                        "budget_ms": round(dl.budget_ms, 3), "budget_source": dl.source, "priority_level": level},
            answered_at=done_at[0] if done_at else None,
            rows=int(np.shape(next(iter(checked.values())))[0]) if self._batched and checked else 1,
            compute_ms=max(0.0, res.latency_ms - res.queue_ms),
        )


def failure_outcome(e: ServeError) -> str:
    """``dsedge_requests_total``'s outcome for a request that ended with ``e``: ``rejected`` for a refusal or a
    client that went away (``cancelled``, mid-body as while queued) or a model still loading (``not_ready``: a
    start-up's polling clients are not server faults), ``error`` for a server fault, else ``invalid``."""
    return "rejected" if e.reason in ("overload", "budget", "deadline", "shutdown", "cancelled", "not_ready") else (
        "error" if e.status >= 500 else "invalid")


class Repository:
    """The models of one server, by name. ``load()`` opens, warms up (profiles) and marks each ready."""

    def __init__(self, bundles: Sequence[str], metrics: ServeMetrics, *, variant: str | None = None,
                 cascade: bool = False, budget_ms: float | None = None, max_batch: int | None = None,
                 threads: int | None = None, providers: Sequence[str] | None = None, max_inflight: int | None = None,
                 instances: int | None = None, max_queue: int = 1024, levels: PriorityLevels | None = None,
                 worker_nice: int = 0, reserve_cores: int = 0, pin_instances: bool = True,
                 standby: bool = False) -> None:
        self.metrics = metrics
        self.models: dict[str, ServedModel] = {}
        self._specs = _name_bundles(bundles)
        self._opts = dict(variant=variant, cascade=cascade, budget_ms=budget_ms, max_batch=max_batch,
                          threads=threads, providers=providers, instances=instances,
                          worker_nice=worker_nice, reserve_cores=reserve_cores, pin_instances=pin_instances,
                          standby=standby)
        self._max_inflight = max_inflight
        self._max_queue = max_queue
        self.levels = levels or PriorityLevels()
        for name, _ in self._specs:
            metrics.ready.labels(name).set(0)

    @property
    def names(self) -> list[str]:
        return [n for n, _ in self._specs]

    def check(self) -> None:
        """What every bundle's manifest can refuse before the server binds a port: unreadable manifests, a
        ``--variant`` a bundle does not have, a ``--max-batch`` over a bundle's batch range. Raises DsedgeError
        (``load`` would, after the listeners started)."""
        from ..runtime.bundle import read_manifest
        from ..session import check_max_batch

        for _, path in self._specs:  # the checks load() makes, in the server's spelling
            m = read_manifest(path)
            m.variant(self._opts["variant"])
            check_max_batch(m, self._opts["max_batch"], "--max-batch ")

    def load(self) -> None:
        """Open and profile every bundle (blocking; run it off the event loop). Raises DsedgeError."""
        import dsedge

        for name, path in self._specs:
            t0 = time.perf_counter()
            s = dsedge.load(path, variant=self._opts["variant"], providers=self._opts["providers"],
                            threads=self._opts["threads"], budget_ms=self._opts["budget_ms"],
                            cascade=self._opts["cascade"], max_batch=self._opts["max_batch"],
                            max_queue=max(1, self._max_queue), instances=self._opts["instances"],
                            worker_nice=self._opts["worker_nice"], reserve_cores=self._opts["reserve_cores"],
                            pin_instances=self._opts["pin_instances"], standby=self._opts["standby"])
            try:
                lanes = warm_up(s)  # latency profiles measured here: admission control is usable from now on
            except DsedgeError:
                s.close(drain=False)
                raise
            max_batch = _max_batch(s, self._opts["max_batch"])
            inflight = self._max_inflight or 2 * max_batch * len(lanes)
            model = ServedModel(name, Path(path), s, PriorityGate(inflight, self._max_queue), self.levels,
                                self.metrics, ready=True)
            self.models[name] = model
            self.metrics.ready.labels(name).set(1)
            self.metrics.queued.labels(name).set_function(lambda g=model.gate: g.waiting)
            log.info("model ready", extra={"fields": {**model.describe(), "max_inflight": inflight,
                                                      "load_s": round(time.perf_counter() - t0, 3)}})

    @property
    def ready(self) -> bool:
        return len(self.models) == len(self._specs) and all(m.ready for m in self.models.values())

    def count_failure(self, protocol: str, e: ServeError) -> None:
        """Count an inference request that ended with ``e`` before a served model was chosen (an unknown model, one
        still loading, the server draining): ``dsedge_requests_total`` with ``model=""``."""
        self.metrics.failed("", protocol, failure_outcome(e), e.reason)

    def get(self, name: str, version: str | None = None) -> ServedModel:
        m = self.models.get(name)
        if m is None:
            known = ", ".join(self.names) or "none"
            if name in self.names:
                raise ServeError(503, "UNAVAILABLE", f"model {name!r} is still loading", "not_ready")
            raise not_found(f"unknown model {name!r} (served: {known})")
        m.check_version(version)
        return m

    def stop_admitting(self) -> None:
        for m in self.models.values():
            m.ready, m.draining = False, True
            m.gate.close()
            self.metrics.ready.labels(m.name).set(0)

    def close(self, timeout_s: float) -> None:
        """Drain every session (blocking): queued requests run, or are rejected "shutdown" after ``timeout_s``."""
        t_end = time.perf_counter() + timeout_s
        for m in self.models.values():
            m.session.close(drain=True, timeout_s=max(0.0, t_end - time.perf_counter()))


def warm_up(s: Any) -> dict[str, Any]:
    """Start the session's scheduler and measure its latency profiles now, not on the first request; returns
    ``{variant: profile}`` (one request of example inputs when the session has no ``warmup()``)."""
    if hasattr(s, "warmup"):
        return s.warmup()
    from ..runtime.batching import BatchLayout, example_feed

    layout = BatchLayout.of(s.inputs, s.outputs)
    r = s.submit(example_feed(layout, 1, 16 if layout.seq_symbol else None), budget_ms=60_000).result()
    return {getattr(r, "variant", "?"): None}


def _max_batch(s: Any, asked: int | None) -> int:
    """Rows per batch the session forms (as Session decides it: the option, else the batch range max, else 32)."""
    from ..runtime.batching import BatchLayout

    layout = BatchLayout.of(s.inputs, s.outputs)
    if not layout.dynamic:
        return 1
    return int(asked or s.manifest.shape_ranges.get(layout.batch_symbol or "", {}).get("max", 32))


def _name_bundles(bundles: Sequence[str]) -> list[tuple[str, str]]:
    """``[PATH | NAME=PATH]`` → ``[(name, path)]``: the manifest name, ``NAME-TARGET`` where names collide."""
    from ..runtime.bundle import read_manifest

    raw: list[tuple[str | None, str]] = []
    for b in bundles:
        name, sep, path = str(b).partition("=")
        if sep and not os.path.exists(b):
            if not path:  # (read as the bundle "", it was reported as the current directory, '.')
                raise DsedgeError(f"{b!r}: no bundle path after '{name}='",
                                  f"pass NAME=PATH, e.g. {name or 'minilm'}=out/all-minilm-l6-v2-cpu.dse")
            raw.append((name, path))
        else:
            raw.append((None, str(b)))
    for name, _ in raw:
        if name is not None and not _SERVED_NAME.fullmatch(name):
            raise DsedgeError(f"{name!r} cannot be a served model name: it is a URL path segment "
                              "(/v2/models/NAME/infer)", "use letters, digits, '_', '-' and '.', e.g. minilm=PATH")
    found: list[tuple[str | None, str, str, str]] = []
    for name, path in raw:
        m = read_manifest(path)  # the same BundleError as `dsedge inspect` for a missing or broken bundle
        base, target = m.name, str(m.target.get("name", "target"))
        found.append((name, path, base, target))
    counts: dict[str, int] = {}
    for name, _, base, _ in found:
        if name is None:
            counts[base] = counts.get(base, 0) + 1
    out: list[tuple[str, str]] = []
    for name, path, base, target in found:
        final = name or (base if counts[base] == 1 else f"{base}-{target}")
        if final in dict(out):
            raise DsedgeError(f"two bundles would both be served as {final!r}",
                              "name them on the command line: NAME=PATH")
        out.append((final, path))
    return out
