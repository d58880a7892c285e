"""``dsedge.load`` and ``Session``: a verified bundle bound to the best backend this machine has."""
from __future__ import annotations

import asyncio
import dataclasses
import gc
import logging
import os
import threading
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, AsyncIterator, Callable, Iterable, Iterator, Mapping, Sequence

import numpy as np

from .runtime.backends import Preferences, VariantFiles, open_backend
from .runtime.backends.ort import check_providers_given
from .runtime.batching import BatchLayout
from .runtime.decode import GenerationStream
from .runtime.budget import FALLBACK_BUDGET_MS, resolve_budget
from .runtime.bundle import IOSpec, Manifest, Variant, verify_variant_files
from .runtime.errors import DsedgeError, InferenceError, InputError, SessionClosedError
from .runtime.golden import check_backend
from .runtime.instances import host_cores, instance_cpus, recorded_threads, reserved_layout, thread_scale
from .runtime.signing import verify_signed
from .runtime.io import (check_request_options, check_session_options, check_stream_inputs, real_value,
                         validate_inputs)
from .runtime.metrics import StreamMetrics
from .runtime.results import Rejected, Result
from .runtime.streaming import StreamingCore


log = logging.getLogger("dsedge")


def _weak_call(method: Callable[[], float], default: float) -> Callable[[], float]:
    """``method()`` through a weak reference to its object (``default`` once it is gone), so that a streaming core
    does not keep its session alive."""
    ref = weakref.WeakMethod(method)

    def call() -> float:
        m = ref()
        return default if m is None else m()
    return call


def _close_in_background(close: Callable[[], None]) -> None:
    threading.Thread(target=close, name="dsedge-close", daemon=True).start()


class Session:
    """A loaded bundle variant, ready to run.

    Attributes:
        manifest: the verified manifest.
        variant: the variant being served (``Variant``: name, precision, file …).
        inputs / outputs: ``IOSpec`` lists (``.name``, ``.dtype``, ``.shape`` with symbolic dims as strings).
        providers: ORT providers really in use, e.g. ``["CPUExecutionProvider"]`` for a Jetson bundle on a laptop.
        backend_name: ``"onnxruntime"`` (or ``"tensorrt"`` where a TensorRT engine serves it).
        budget_ms: the session's default latency budget for streaming (None: the manifest's, else the target's).

    Streaming with latency budgets (started on first use without measuring on the caller's thread; ``warmup()``
    measures a full latency profile first, for callers who want one):
        ``submit(inputs, budget_ms, priority) -> Future[Result | Rejected]``, ``stream(iterable)``,
        ``await infer_async(...)``, ``async for r in stream_async(...)``, ``generate_stream(prompt, …)`` for
        decoders, ``metrics()``, ``close(drain=True)``. See runtime/streaming.py, runtime/scheduler.py and
        runtime/decode.py.
    """

    def __init__(self, path: str | os.PathLike, manifest: Manifest, variant: Variant, backend: Any, *,
                 budget_ms: float | None = None, cascade: bool = False, max_batch: int | None = None,
                 max_queue: int = 1024, max_delay_ms: float | None = None, profile: str = "auto",
                 open_variant: Callable[[str], Any] | None = None, batch_variant_ok: bool = False,
                 open_instances: Callable[[], list] | None = None, fallback: bool = False,
                 instance_seed_scale: float = 1.0, seed_scale: float = 1.0, worker_nice: int = 0,
                 instance_cpus: Sequence[frozenset[int]] | None = None, standby: bool = True,
                 caller_weight: float = 0.0, graph_ranges: Mapping[str, tuple[int, int]] | None = None) -> None:
        self.path = Path(path)
        self.manifest = manifest
        self.variant = variant
        self._backend = backend
        # an input the manifest gives no range for: the range the tables of the variants this session may serve
        # allow (``graph_ranges``; ORT CPU's block-quantized Gather, what an INT4 table runs as, does not check its
        # ids, and ONNX's Gather wraps negative ones), checked here like the manifest's
        graph = graph_ranges or {}
        self.inputs: list[IOSpec] = [dataclasses.replace(s, value_range=graph[s.name])
                                     if s.value_range is None and s.name in graph else s for s in manifest.inputs]
        self.outputs: list[IOSpec] = list(manifest.outputs)
        # streaming (submit/stream/infer_async): the core starts on first use, see _core()
        self.budget_ms = budget_ms
        self._default_budget: tuple[float | None, float] | None = None  # (budget_ms it was resolved for, ms)
        self._stream_opts = dict(cascade=cascade, open_variant=open_variant, max_batch=max_batch,
                                 max_queue=max_queue, max_delay_ms=max_delay_ms, profile=profile,
                                 batch_variant_ok=batch_variant_ok, worker_nice=worker_nice,
                                 instance_cpus=tuple(instance_cpus or ()), standby=bool(standby),
                                 caller_weight=float(caller_weight))
        self._open_instances = open_instances  # () -> the backends the streaming lanes run on (None: self._backend)
        self._instance_backends: list = []
        self._fallback = fallback  # with instances: self._backend (more threads) takes what they are too slow for
        self._instance_seed_scale = instance_seed_scale
        self._seed_scale = seed_scale
        self._max_batch = max_batch
        self._max_queue = max_queue
        self._metrics = StreamMetrics()
        self._prometheus: dict[tuple[int, str], Any] = {}  # (id(registry), prefix) -> collector
        self._stream: StreamingCore | None = None
        self._decoder: Any = None
        self._finalizers: list[weakref.finalize] = []
        self._threads_pid: int | None = None  # the process the lane / decode threads were started in
        self._start_lock = threading.Lock()
        self._closed = False
        self._close_done = threading.Event()  # set when the first close() has finished

    @property
    def providers(self) -> list[str]:
        return list(getattr(self._backend, "providers", []))

    @property
    def backend_name(self) -> str:
        return getattr(self._backend, "name", type(self._backend).__name__)

    @property
    def target(self) -> str:
        return str(self.manifest.target.get("name", "?"))

    def run(self, inputs: Mapping[str, Any]) -> dict[str, np.ndarray]:
        """Run one batch synchronously.

        Args:
            inputs: numpy arrays keyed by input name, dtypes and shapes as in ``self.inputs``.
        Returns:
            numpy arrays keyed by output name.
        Raises:
            InputError: a missing/unknown name, wrong dtype or shape, a value outside an input's ``value_range``
                (checked before the backend runs; ``self.inputs`` holds the manifest's ranges, and for an integer
                input it gives none, the size of the embedding table that input indexes in the served graphs).
            InferenceError: the backend failed on inputs that passed those checks (its message, one line).
            SessionClosedError: after ``close()``.
        """
        backend = self._backend  # close() drops it: a run racing close() fails closed, not on None
        self._check_open()
        checked = validate_inputs(self.inputs, inputs, self.manifest.shape_ranges)
        if backend is None:
            self._check_open()
        try:
            return backend.run(checked)
        except DsedgeError:
            raise
        except Exception as e:  # ORT's InvalidArgument/Fail/RuntimeException: one line, the cause chained
            first = (str(e).strip().splitlines() or [""])[0][:300]
            raise InferenceError(f"{self.backend_name} failed to run this batch: {type(e).__name__}: {first}",
                                 "check the input values (token ids within the vocabulary the model was built "
                                 "with, lengths within its context)") from e

    def describe(self) -> dict[str, Any]:
        """A JSON-able summary: bundle, target, variant, backend and providers in use, and how many backends
        streaming runs the variant on (``instances``), the nice value added to their workers (``worker_nice``) and
        the core each instance's worker is pinned to (``instance_cpus``, a list of core ids; empty when none is). A
        decoder bundle has 1: ``generate_stream`` runs on the session's one backend, and ``load`` opens no other."""
        return {
            "bundle": str(self.path), "name": self.manifest.name, "target": self.target,
            "variant": self.variant.name, "precision": self.variant.precision,
            "backend": self.backend_name, "providers": self.providers,
            "instances": len(self._open_instances()) if self._open_instances is not None else 1,
            "worker_nice": self._stream_opts["worker_nice"],
            "instance_cpus": [min(c) for c in self._stream_opts["instance_cpus"]],  # one core each
        }

    # -- streaming with latency budgets -----------------------------------------------------------------------
    def default_budget_ms(self) -> float:
        """The budget a request gets when it names none: the session's (``load(budget_ms=)``), else the
        manifest's ``latency_budget_ms``, else the target profile's ``default_budget_ms`` (ms); see runtime/budget.py."""
        if self._default_budget is None or self._default_budget[0] != self.budget_ms:  # submit's hot path
            budget, _ = resolve_budget(self.budget_ms, self.manifest, self._profile_budget_ms)
            self._default_budget = (self.budget_ms, FALLBACK_BUDGET_MS if budget is None else budget)
        return self._default_budget[1]

    def _profile_budget_ms(self) -> float | None:
        try:
            from .targets import get_target

            return float(get_target(self.target).default_budget_ms)
        except Exception:  # an unknown or custom target name: no profile here to ask
            return None

    def _check_open(self) -> None:
        if self._closed:
            raise SessionClosedError("this session is closed", "call dsedge.load() again to open a new session")

    def _close_when_collected(self, close: Callable[[], None]) -> None:
        """A session dropped without ``close()`` finishes what it queued and stops its worker threads once it is
        garbage collected (on a helper thread: collection never blocks; at interpreter exit the atexit hook of
        runtime/streaming.py stops what is left)."""
        f = weakref.finalize(self, _close_in_background, close)
        f.atexit = False
        self._finalizers.append(f)

    def _check_process(self) -> None:
        if self._threads_pid is not None and self._threads_pid != os.getpid():
            raise SessionClosedError(f"this session's worker threads run in process {self._threads_pid}; after a "
                                     f"fork they do not exist in this one ({os.getpid()}), so requests would wait "
                                     "forever", "call dsedge.load() in each worker process (e.g. a multiprocessing "
                                     "Pool initializer), or use the 'spawn' start method")

    def _core(self) -> StreamingCore:
        self._check_open()
        self._check_process()
        core = self._stream
        if core is None:
            with self._start_lock:
                if self._stream is None:
                    if self.is_decoder:
                        raise InputError("this bundle is a decoder with past key/values: submit/stream serve "
                                         "one-shot models", "use session.generate_stream(prompt, max_new_tokens)")
                    runs = [self._backend.run]
                    if self._open_instances is not None:
                        self._instance_backends = list(self._open_instances())
                        runs = [b.run for b in self._instance_backends] or runs
                    self._stream = StreamingCore(self.manifest, self.variant, runs[0], self._metrics,
                                                 default_budget_ms=_weak_call(self.default_budget_ms,
                                                                              FALLBACK_BUDGET_MS),
                                                 instances=runs[1:],
                                                 fallback=(self._backend.run if self._fallback and len(runs) > 1
                                                           else None),
                                                 instance_seed_scale=self._instance_seed_scale,
                                                 seed_scale=self._seed_scale, **self._stream_opts)
                    self._close_when_collected(self._stream.close)
                    self._threads_pid = os.getpid()
                core = self._stream
        return core

    def warmup(self) -> dict[str, Any]:
        """Measure every lane's latency profile now (batch 1 … max batch), blocking; optional.

        Serving does not depend on it: without it, lanes start from the bundle's figures and a warm-up run on
        their own thread. Returns ``{variant: LatencyProfile.to_dict()}`` for every lane (primary, then cascade):
        per (batch, sequence bucket) point its ``mean_ms`` and ``tail_ms`` (ms) and sample ``count``; the profile
        of a variant's instances, with that of its fallback lane (``load(instances=)``) under ``"fallback"``.

        Raises:
            InputError: on a decoder bundle (``generate_stream`` warms its own loop). SessionClosedError after
                ``close()``.
        """
        return self._core().warmup()

    def submit(self, inputs: Mapping[str, Any], budget_ms: float | None = None, priority: int = 0,
               id: Any = None) -> "Future[Result | Rejected]":
        """Queue one request; thread-safe. The future resolves to a ``Result`` or a ``Rejected``, never raises.

        A done-callback added to the future runs on the thread that answers it: a lane's worker, the standby
        list's expiry thread (a refusal), the deadline watch's (a queued request past its deadline), or the
        caller's own (an answer at admission). Keep callbacks short (hand
        long work to your own executor): while one blocks, the answers that thread owes others wait with it.

        Args:
            inputs: numpy arrays keyed by input name (usually one row on the batch axis); copied here, so the
                caller may refill its buffers for the next request at once.
            budget_ms: latency budget, ms (default ``default_budget_ms()``).
            priority: higher wins among equal deadlines.
            id: reported back in the answer (default: a per-session counter).
        Raises:
            InputError: inputs do not match the bundle, or hold more rows than ``max_batch``; ``budget_ms`` is
                not a finite number in (0, 3 600 000] ms; ``priority`` is not an integer (all checked before
                queueing).
            SessionClosedError: the session is closed, or its worker threads were started in another process
                (this one is a fork of it: load the bundle again here).
        """
        arrived = time.perf_counter()  # its latency counts from here (a first submit builds the core first)
        core = self._stream or self._core()
        if self._closed:
            self._check_open()
        self._check_process()
        checked = validate_inputs(self.inputs, inputs, self.manifest.shape_ranges)
        budget, priority = check_request_options(budget_ms, priority, self.default_budget_ms)
        # the request runs later, on another thread: an array the caller still holds (and may refill for the
        # next request) is copied now, as is whatever an array-like's __array__ handed over (it may be the
        # object's own buffer); one made here from a list or tuple is not
        checked = {k: v if isinstance(inputs[k], (list, tuple)) else v.copy() for k, v in checked.items()}
        return self._queue(core, checked, budget, priority, id, arrived)

    def submit_validated(self, checked: dict[str, np.ndarray], budget_ms: float, priority: int = 0,
                         id: Any = None) -> "Future[Result | Rejected]":
        """``submit`` for inputs the caller has already checked with ``runtime.io.validate_inputs`` against this
        session's ``inputs`` and ``manifest.shape_ranges``, and hands over: not validated again, not copied, so
        the caller must not write to the arrays afterwards. ``budget_ms`` (ms, > 0) and ``priority`` are taken as
        given. ``dsedge serve`` takes this path: its arrays are fresh from each request's bytes, and validating
        twice cost about 4 % of its event loop's CPU under overload (docs/triton.md).

        Raises:
            InputError: more rows than ``max_batch``.
            SessionClosedError: as ``submit``.
        """
        core = self._stream or self._core()
        if self._closed:
            self._check_open()
        self._check_process()
        return self._queue(core, checked, budget_ms, priority, id)

    def _queue(self, core: StreamingCore, checked: dict[str, np.ndarray], budget_ms: float, priority: int,
               id: Any, arrived: float | None = None) -> "Future[Result | Rejected]":
        rows, most = core.layout.rows(checked), core.scheduler.lanes[0].max_batch
        if rows > most:  # as Triton refuses a request above max_batch_size: batches never exceed it
            raise InputError(f"the request has {rows} rows; this session batches at most {most}",
                             "split it, or load(max_batch=…) up to the bundle's batch range")
        try:
            return core.submit(checked, budget_ms, priority, id, arrived)
        except RuntimeError:
            raise SessionClosedError("this session is closed", "call dsedge.load() again") from None

    def stream(self, inputs: Iterable[Mapping[str, Any]], budget_ms: float | None = None, ordered: bool = False,
               priority: int = 0, window: int | None = None) -> Iterator[Result | Rejected]:
        """Submit each item of ``inputs`` and yield answers: completion order, or input order with ``ordered``.

        Each answer's ``id`` is the item's index. At most ``window`` requests are in flight (default two full
        batches): the iterable is read as answers come back, so a long stream does not flood the queue. A
        separate thread reads ``inputs``, so a slow source does not hold back finished answers.
        Raises InputError (at the call for ``inputs`` that is not an iterable of requests, a bad ``window``,
        ``budget_ms`` or ``priority``; else from the item that failed validation) or SessionClosedError.
        """
        check_stream_inputs(inputs)
        check_session_options(self.path, window=window)
        check_request_options(budget_ms, priority, self.default_budget_ms)
        _check_flag("ordered", ordered, "pass ordered=True for input order, False for completion order")
        core = self._core()
        return core.stream(lambda item, i: self.submit(item, budget_ms=budget_ms, priority=priority, id=i), inputs,
                           ordered=ordered, window=window)

    async def infer_async(self, inputs: Mapping[str, Any], budget_ms: float | None = None,
                          priority: int = 0, id: Any = None) -> Result | Rejected:
        """``await`` form of ``submit(...).result()`` for asyncio code (same arguments and errors)."""
        return await asyncio.wrap_future(self.submit(inputs, budget_ms=budget_ms, priority=priority, id=id))

    def stream_async(self, inputs: Iterable[Mapping[str, Any]] | AsyncIterator[Mapping[str, Any]],
                     budget_ms: float | None = None, ordered: bool = False, priority: int = 0,
                     window: int | None = None) -> AsyncIterator[Result | Rejected]:
        """``async for`` form of ``stream`` over a sync or async iterable (same ids, order, window and errors;
        ``inputs``, ``window``, ``budget_ms`` and ``priority`` are checked at the call)."""
        check_stream_inputs(inputs, "stream_async", allow_async=True)
        check_session_options(self.path, window=window)
        check_request_options(budget_ms, priority, self.default_budget_ms)
        _check_flag("ordered", ordered, "pass ordered=True for input order, False for completion order")
        return self._stream_async(inputs, budget_ms, ordered, priority, window)

    async def _stream_async(self, inputs: Iterable[Mapping[str, Any]] | AsyncIterator[Mapping[str, Any]],
                            budget_ms: float | None, ordered: bool, priority: int,
                            window: int | None) -> AsyncIterator[Result | Rejected]:
        core = self._core()
        async for answer in core.stream_async(
                lambda item, i: self.submit(item, budget_ms=budget_ms, priority=priority, id=i), inputs,
                ordered=ordered, window=window):
            yield answer

    @property
    def is_decoder(self) -> bool:
        """True for a decoder exported with past key/values (``generate_stream`` works on it)."""
        from .runtime.decode import is_decoder

        return is_decoder([s.name for s in self.inputs])

    def generate_stream(self, prompt: Sequence[int] | np.ndarray, max_new_tokens: int = 32,
                        budget_ms: float | None = None, token_budget_ms: float | None = None, id: Any = None,
                        eos_token_id: int | Sequence[int] | None = None, window: int | None = None,
                        sink_tokens: int = 4) -> "GenerationStream":
        """Greedy generation with continuous batching; iterate the result to get token ids as they come.

        The first call starts the decode loop and times prefill and decode steps on the caller's thread
        (``DecodeLoop.warmup``: a few prompts of up to 32 tokens, steps at batch 1–8), before its own request.

        Args:
            prompt: 1-D token ids (int).
            max_new_tokens: tokens to generate at most (fewer when ``eos_token_id`` comes).
            budget_ms: time-to-first-token budget, ms (default ``default_budget_ms()``).
            token_budget_ms: budget between consecutive tokens, ms (default: ``budget_ms``).
            eos_token_id: stop token, or a list of them as Hugging Face configs may give (default: the manifest's
                ``source["eos_token_id"]``, if any).
            window, sink_tokens: sliding-window K/V cache (StreamingLLM) for RoPE decoders; see runtime/kv_cache.
        Returns:
            a ``GenerationStream``: ``for token in stream``; ``.rejected`` says why when refused; ``.ttft_ms``,
            ``.token_gaps_ms``, ``.finish_reason`` once done.
        Raises:
            InputError: not a decoder bundle; a malformed prompt (not 1-D integer ids, an id outside the
                vocabulary, longer than the model's positions); a budget that is not a finite number in
                (0, 3 600 000] ms; ``max_new_tokens`` not an integer ≥ 1; ``eos_token_id`` not integers within
                the vocabulary; ``window`` / ``sink_tokens`` not integers (bool and float refused) or out of range.
                SessionClosedError after ``close()``. BundleError: the manifest's default ``eos_token_id`` is not
                such (the bundle's fault: rebuild it).
        ``stream.cancel()`` (or leaving a ``for`` over it early) ends the request ("cancelled"). ``close()`` waits
        for running generations at most ``timeout_s`` (None: 30 s, ``runtime.decode.DRAIN_TIMEOUT_S``), then ends
        them with "shutdown"; see docs/decode.md.
        """
        from .runtime.decode import DecodeLoop

        self._check_open()
        self._check_process()
        if not self.is_decoder:
            raise InputError("generate_stream needs a decoder exported with past key/values",
                             "build the bundle from optimum's text-generation-with-past export; use submit() here")
        if not hasattr(self._backend, "session"):
            from .runtime.errors import BackendUnavailable

            raise BackendUnavailable(f"generation runs on ONNX Runtime; this session uses {self.backend_name}",
                                     "load the bundle with providers=['CPUExecutionProvider'] (or CUDA)")
        budget, _ = check_request_options(budget_ms, 0, self.default_budget_ms)
        token_budget = (budget if token_budget_ms is None
                        else check_request_options(token_budget_ms, 0, name="token_budget_ms")[0])
        with self._start_lock:
            if self._decoder is None:
                eos = self.manifest.source.get("eos_token_id")
                ids = next((i for i in self.inputs if i.name == "input_ids"), None)
                vocab = ids.value_range[1] + 1 if ids is not None and ids.value_range else None
                self._decoder = DecodeLoop(self._backend, max_batch=self._max_batch or 8,
                                           max_waiting=self._max_queue, eos_token_id=eos,
                                           model_config=self.manifest.source, vocab_size=vocab)
                self._close_when_collected(self._decoder.close)
                self._threads_pid = os.getpid()
                self._decoder.warmup()
        try:
            return self._decoder.submit(prompt, max_new_tokens, budget, token_budget, id=id,
                                        eos_token_id=eos_token_id, window=window, sink_tokens=sink_tokens)
        except RuntimeError:
            raise SessionClosedError("this session is closed", "call dsedge.load() again") from None

    def pause_spare_instances(self, paused: bool) -> None:
        """Stop (or resume) offering new requests to the spare lanes (every instance but the first, and the
        fallback lane); what they have queued still runs. ``dsedge serve`` pauses them while its front end needs the
        core they would take (docs/serve.md). No-op before streaming has started.

        Raises:
            InputError: ``paused`` not a bool (``pause_spare_instances("no")`` paused them).
        """
        _check_flag("paused", paused, "pass pause_spare_instances(True) to pause the spare lanes, False to resume them")
        if self._stream is not None:
            self._stream.pause_spares(paused)

    def metrics(self) -> dict[str, Any]:
        """Counts, p50/p90/p99 latency (ms), goodput (answers within budget per s), rejection and budget-miss
        rates for everything sent through ``submit``/``stream``/``infer_async``/``stream_async`` (not ``run``; see
        ``StreamMetrics`` for the keys and units), plus ``lanes`` (queue depth, batches per variant:
        ``StreamingCore.lane_stats``) and, once
        ``generate_stream`` was used, ``decode`` (steps, prefills, rows per step; generation requests are not in the
        request counts)."""
        snap = self._metrics.snapshot()
        if self._stream is not None:
            snap["lanes"] = self._stream.lane_stats()
        if self._decoder is not None:
            st = self._decoder.stats
            snap["decode"] = {"steps": st.steps, "prefills": st.prefills, "max_rows": st.max_rows,
                              "joins_while_running": st.joins_while_running,
                              "mean_rows": round(float(np.mean(st.rows_per_step)), 3) if st.rows_per_step else None}
        return snap

    def export_prometheus(self, registry: Any = None, prefix: str = "dsedge") -> Any:
        """Register this session's metrics with a prometheus-client registry (default: the global one), as
        ``{prefix}_requests_*`` counters and ``{prefix}_latency_ms`` / ``{prefix}_goodput_per_second`` /
        ``{prefix}_in_flight`` gauges read at scrape time. Returns the collector; calling again with the same
        registry and prefix returns the same one.

        Raises:
            BackendUnavailable: without prometheus-client (``pip install 'dsedge[serve]'``).
            InputError: another collector (e.g. a second session) already registered these names there.
        """
        key = (id(registry), prefix)
        exported = self._prometheus
        if key in exported:
            return exported[key]
        try:
            exported[key] = self._metrics.register_prometheus(registry, prefix=prefix)
        except ValueError as e:  # prometheus_client's DuplicateTimeseries
            raise InputError(f"metrics named {prefix}_* are already registered in that Prometheus registry "
                             f"({str(e).splitlines()[0][:80]}…)",
                             "give each session its own prefix (export_prometheus(prefix='dsedge_minilm')) "
                             "or registry") from None
        return exported[key]

    def close(self, drain: bool = True, timeout_s: float | None = None) -> None:
        """Stop accepting requests; finish (``drain=True``) or reject with "shutdown" what is queued. Draining also
        gives requests waiting on a standby list (``load(standby=True)``) their chance: each runs if an instance
        frees in time, else it is refused "overload" as it would have been; without draining they get "shutdown".

        After ``timeout_s`` seconds of draining (at once, without draining), whatever is still queued is rejected
        with "shutdown"; a batch already running finishes first, and ``close`` returns after it, unless it was
        expected to take over 50 ms on ONNX Runtime: such a batch is stopped between two kernels and its requests
        get "shutdown" too (two 64 × 512-token MiniLM batches had held ``close(drain=False)`` for 15 s). Every
        submitted future is resolved
        when this returns; called from a future's done-callback (the session's own worker thread), the close
        finishes on a helper thread right after the callback. Further ``submit`` calls raise SessionClosedError;
        ``run`` is no longer available either. Closing again does nothing (from another thread while the first
        ``close`` runs, it returns when that one does). Generations (``generate_stream``) are
        drained at most ``timeout_s`` (None: 30 s), then ended with "shutdown", so an unbounded generation whose
        reader is gone cannot hold ``close`` (or a ``with`` block) forever.

        Raises:
            InputError: ``drain`` not a bool, ``timeout_s`` not None or a finite number ≥ 0 (checked before anything
                is closed).
        """
        _check_flag("drain", drain, "close(drain=True) answers what is queued; drain=False rejects it")
        if timeout_s is not None and not 0 <= real_value(timeout_s) < float("inf"):
            raise InputError(f"timeout_s must be None or a finite number of seconds >= 0, got {timeout_s!r}",
                             "pass close(timeout_s=5.0), or None to wait for the queue to drain")
        if self._closed:
            # a close() racing the first (another thread) returns when that one has, so that its promise holds:
            # every future resolved. Not on the session's own threads (a done-callback): the first waits for them
            if not threading.current_thread().name.startswith("dsedge-"):
                self._close_done.wait()
            return
        self._closed = True
        try:
            for f in self._finalizers:
                f.detach()
            with self._start_lock:
                if self._stream is not None:
                    self._stream.close(drain=drain, timeout_s=timeout_s)
                if self._decoder is not None:
                    self._decoder.close(drain=drain, timeout_s=timeout_s)
            # the backends go now (ONNX Runtime sessions: their memory and intra-op threads), not when the Session
            # object is collected; metrics() still reads the closed lanes
            self._backend = None
            self._instance_backends = []
            self._open_instances = None
        finally:
            self._close_done.set()

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"Session({self.manifest.name!r}, target={self.target!r}, variant={self.variant.name!r}, "
                f"providers={self.providers})")


def load(path: str | os.PathLike, variant: str | None = None, providers: Sequence[str] | None = None,
         threads: int | None = None, *, budget_ms: float | None = None, cascade: bool = False,
         max_batch: int | None = None, max_queue: int = 1024, max_delay_ms: float | None = None,
         profile: str = "auto", batch_variant_ok: bool = False, check_outputs: bool = False,
         trusted_keys: Sequence[Any] | None = None, instances: int | None = None, worker_nice: int = 0,
         reserve_cores: int = 0, pin_instances: bool = True, standby: bool = True) -> Session:
    """Verify a bundle (manifest and every sha256) and open a variant on the best available backend.

    Args:
        path: the ``NAME-TARGET.dse`` directory.
        variant: variant name (default: the manifest's ``default_variant``).
        providers: ORT providers to use (default: TensorRT EP → CUDA EP → CPU EP, whichever exist).
        threads: intra-op CPU threads (default: ORT's choice); at most 4 per core of this host (InputError).
        budget_ms: default latency budget for ``submit``/``stream`` (else the manifest's, else the target's), ms.
        cascade: let requests that cannot meet their budget on ``variant`` be served by a cheaper variant of the
            bundle (the others are opened and warmed on a background thread when streaming starts).
        max_batch: most rows per batch (default: the bundle's batch range max, else 32; 1 without a batch axis).
        max_queue: most queued requests per lane before rejecting with "overload": each of a variant's
            ``instances`` has a queue of its own (2 instances queue up to 2 × ``max_queue``), and so does its
            standby list.
        max_delay_ms: fixed longest hold of a batch open (None: adaptive, see runtime/scheduler.py).
        profile: latency profile source: "auto" (the variant's build-time ``latency_ms`` scaled by a warm-up
            run on this machine), "measure" (this machine only), or "bundle" (the build-time figures as they
            are). Nothing is measured in ``load`` or on a caller's thread (``warmup()`` does, if called); every
            batch run refreshes the profile.
        batch_variant_ok: batch requests on a variant whose manifest says ``batch_invariant: false`` (its answer
            for a row depends on its batch-mates); by default such a variant is served at batch 1.
        check_outputs: run the bundle's golden inputs on the backend opened here and refuse it (OutputMismatchError,
            with the figures) when its answers are outside the build-time tolerance (runtime/golden.py).
        trusted_keys: Ed25519 public keys (``.pub`` paths, PEM) the bundle must be signed by (default:
            ``$DSEDGE_TRUSTED_KEYS``; with none configured, signatures are not required; runtime/signing.py).
        instances: backends the streaming scheduler runs the variant on concurrently (Triton's instance group),
            each with its own queue and worker; opened here, side by side. None: ``auto_instances`` (on ONNX
            Runtime's CPU provider, 2, each with ``cores // 2`` intra-op threads unless ``threads`` is given;
            else 1). 1-thread instances on the CPU provider share one ONNX Runtime session (one copy of the
            weights; each run computes on its instance's worker thread). ``run()`` always uses the backend opened
            here, with ORT's default threads; streaming sends it the requests the instances cannot meet even alone
            (a fallback lane of its own latency profile).
        worker_nice: 0…19 added to the nice value of the streaming lanes' worker threads (Linux; elsewhere
            ignored), so that your threads that submit requests and read answers preempt running batches on a busy
            machine (runtime/thread_priority.py; ``dsedge serve --worker-nice``). 0 (default) leaves the workers at
            your process's priority; docs/serve.md has what it measured.
        reserve_cores: on ONNX Runtime's CPU provider, cores kept free of the streaming lanes for your own threads:
            unless ``threads`` is given, the instances are spread over the other cores (2 cores, 1 reserved: one
            instance of 1 thread; ``runtime/instances.reserved_layout``), and no fallback lane is added; reserving
            every core is an ``InputError``. ``dsedge serve --reserve-cores`` (default 0) passes it; docs/serve.md
            has what it measured.
        pin_instances: on ONNX Runtime's CPU provider, pin the worker thread of each 1-thread instance to a core of
            its own when there are as many cores (``runtime/instances.instance_cpus``; Linux). Left to the OS
            scheduler, two instances' workers were often kept on one core while the other idled
            (runtime/thread_priority.py has the figures). False leaves them to the OS scheduler.
        standby: a request refused for overload only because of what runs ahead of it (it fits alone on an idle
            instance) waits, unadmitted, for an instance that frees up in time, and is admitted then; else it is
            answered ``Rejected("overload")`` once no instance could start it in time (``latency_ms`` says how
            long it waited, at most its budget). False: refused at once (runtime/standby.py has what it measured).
    ``load`` ends with one full garbage collection (``gc.collect()``, 5-30 ms), so that the one opening the bundle
    made due does not pause the first seconds of serving.
    Raises:
        BundleError / BundleIntegrityError: missing, malformed, truncated or tampered bundle.
        BackendUnavailable: a requested provider is not installed.
        SignatureError: trusted keys are configured and the bundle is unsigned, wrongly signed or was edited.
        OutputMismatchError: ``check_outputs`` and the backend's golden answers are outside tolerance.
        InputError: a bad option (``profile`` not auto/measure/bundle, a non-positive ``max_batch`` or one above
            the bundle's batch range max, a ``variant`` that is not a str, a flag that is not a bool, ``providers=[]``
            …).
    """
    check_session_options(path, budget_ms=budget_ms, max_batch=max_batch, max_queue=max_queue,
                          max_delay_ms=max_delay_ms, profile=profile, threads=threads, instances=instances,
                          worker_nice=worker_nice, reserve_cores=reserve_cores)
    check_providers_given(providers)  # providers=[]: a mistake, not "the default chain"
    if isinstance(providers, str):
        providers = [providers]
    if variant is not None and not isinstance(variant, str):
        raise InputError(f"variant must be a variant name (str) or None, got {type(variant).__name__} {variant!r}",
                         "pass variant='int8' (`dsedge inspect BUNDLE` lists them), or None for the default")
    for name, flag in (("cascade", cascade), ("batch_variant_ok", batch_variant_ok), ("check_outputs", check_outputs),
                       ("pin_instances", pin_instances), ("standby", standby)):
        _check_flag(name, flag, f"pass {name}=True")
    cores = _cores()
    if instances is not None and int(instances) > 4 * cores:  # before anything is opened
        raise InputError(f"instances={instances} is more than 4 per core ({cores} cores here): each instance is "
                         f"a worker thread (and, above 1 intra-op thread, a copy of the model) of its own",
                         f"pass instances={min(2, cores)} (the default here), or up to {4 * cores}")
    manifest, _ = verify_signed(path, trusted_keys)  # one read of manifest.json: signed bytes = parsed bytes
    path = Path(os.path.abspath(path))  # a later os.chdir must not change what a variant opened later reads
    v = manifest.variant(variant)
    check_max_batch(manifest, max_batch)
    loaded = threading.Event()

    def open_variant(name: str) -> Any:  # the target's backend (TensorRT when here), else ONNX Runtime
        files = VariantFiles(path, manifest, manifest.variant(name))
        if loaded.is_set():  # a cascade variant, opened on first use: its files are checked again first
            verify_variant_files(path, manifest, files.variant)
        return open_backend(files, Preferences(providers, threads))

    backend = open_variant(v.name)
    if check_outputs:
        check_backend(path, manifest, v, backend)
    if (manifest.target.get("backend") == "tensorrt"
            and _on_ort_cpu(backend)):
        log.warning("bundle for %s runs on ONNX Runtime's CPU provider here (no TensorRT/CUDA found)",
                 manifest.target.get("name"))
    if reserve_cores and int(reserve_cores) >= cores and _on_ort_cpu(backend):
        raise InputError(f"reserve_cores={reserve_cores} leaves none of this machine's {cores} cores to the "
                         "streaming lanes", f"reserve at most {cores - 1}" if cores > 1 else "reserve none here")
    count, per_thread = auto_instances(backend, instances, threads, int(reserve_cores))
    if _is_decoder_manifest(manifest):  # generation runs on ``backend`` only: no streaming lanes, no copies
        if instances is not None and int(instances) > 1:
            raise InputError(f"instances={instances}: a decoder bundle generates on the session's one backend "
                             "(generate_stream batches the rows of every request into each step)",
                             "drop instances= (or load the bundle once per process you want)")
        count, per_thread = 1, None
    # the streaming lanes run on backends of their own: several instances, or one on fewer threads than ``backend``
    own = count > 1 or (threads is None and per_thread is not None and per_thread < cores)
    # the bundle's latency figures were timed with ``measured`` intra-op threads (the build host's serving layout;
    # ORT's default, one per core here, for a bundle that does not say): seeds for lanes on other thread counts
    # (thread counts above the cores here count as the cores: no more of them run at once)
    measured = min(recorded_threads(v.latency_ms) or cores, cores)
    default_scale = thread_scale(measured, min(threads or cores, cores))
    instance_scale = thread_scale(measured, min(per_thread or cores, cores)) if own else default_scale
    open_instances = None
    cpus = (instance_cpus(count, per_thread, reserve=int(reserve_cores))
            if own and pin_instances and _on_ort_cpu(backend) else None)
    if own:  # opened here, side by side (ORT builds sessions off the GIL): the first submit must not wait
        # the instances run where the session's backend does: an ONNX Runtime backend hands them the providers it
        # ended up on (after falling back from TensorRT or a GPU, or dropping AzureExecutionProvider), so no
        # instance probes and logs the same fall-back again
        on_ort = getattr(backend, "name", None) == "onnxruntime"
        prefs = Preferences(list(backend.providers) if on_ort else providers, per_thread)
        # 1-thread instances on ONNX Runtime's CPU provider share one session (Triton's onnxruntime backend:
        # share_session_between_instances): each run computes on the worker thread that calls it, concurrent runs
        # are thread-safe, and one copy of the weights serves both cores' runs. Measured on a 2-core host (MiniLM
        # int8, two threads each running batch 1 with 2-5 ms gaps): p50 4.21-4.84 ms on two sessions, 3.92-4.45 on
        # one; docs/streaming.md (Instances) has what it did to goodput within budget
        shared = count > 1 and per_thread == 1 and _on_ort_cpu(backend)
        with ThreadPoolExecutor(count, thread_name_prefix="dsedge-open") as pool:
            opened = list(pool.map(lambda _: open_backend(VariantFiles(Path(path), manifest, v), prefs),
                                   range(1 if shared else count)))
        opened *= count if shared else 1
        open_instances = opened.copy
    served = [v] + ([o for o in manifest.variants if o.name != v.name] if cascade else [])
    session = Session(path, manifest, v, backend, budget_ms=budget_ms, cascade=cascade, max_batch=max_batch,
                      max_queue=max_queue, max_delay_ms=max_delay_ms, profile=profile, open_variant=open_variant,
                      batch_variant_ok=batch_variant_ok, open_instances=open_instances,
                      fallback=(count > 1 and threads is None and not reserve_cores
                                and (per_thread or cores) < cores),
                      instance_seed_scale=instance_scale, seed_scale=default_scale, worker_nice=int(worker_nice),
                      instance_cpus=cpus, standby=standby,
                      # the lanes cover every core: a caller's burst of CPU use takes one from a batch
                      caller_weight=1.0 if (_on_ort_cpu(backend) and not reserve_cores
                                            and count * (per_thread or cores) >= cores) else 0.0,
                      graph_ranges=graph_ranges(path, manifest, served))
    # the full collection that opening a bundle makes due (its objects count as the old generation's pending ones)
    # runs here rather than in the first seconds of serving, where it held the interpreter lock for 16-33 ms
    # and 4-11 requests of a 3x load around it missed their budget (about a fifth of that window's misses)
    gc.collect()
    loaded.set()
    return session


def _check_flag(name: str, value: Any, hint: str) -> None:
    """Refuse a non-bool for a True/False option (``ordered="no"`` is truthy). Raises InputError."""
    if not isinstance(value, (bool, np.bool_)):
        raise InputError(f"{name} must be True or False, got {type(value).__name__} {value!r}", hint)


def _cores() -> int:
    return host_cores()


def _narrowest(*ranges: Mapping[str, tuple[int, int]]) -> dict[str, tuple[int, int]]:
    out: dict[str, tuple[int, int]] = {}
    for r in ranges:
        for k, (lo, hi) in r.items():
            a, b = out.get(k, (lo, hi))
            out[k] = (max(a, lo), min(b, hi))
    return out


def graph_ranges(path: Path, manifest: Manifest, variants: Sequence[Variant]) -> dict[str, tuple[int, int]]:
    """``{input: (0, n - 1)}`` for the integer inputs the manifest gives no ``value_range``, from the embedding tables
    of ``variants``' graphs (``runtime/token_bounds.py``; the narrowest where variants differ). Reads each graph's
    protobuf, never its external data; {} when every integer input has a range (bundles built since these were
    recorded), so loading those reads nothing more."""
    from .runtime.token_bounds import graph_value_ranges

    missing = {s.name for s in manifest.inputs if s.value_range is None and np.dtype(s.dtype).kind in "iu"}
    if not missing:
        return {}
    import onnx

    found = []
    for v in variants:
        try:
            found.append(graph_value_ranges(onnx.load(os.fspath(path / v.file), load_external_data=False)))
        except Exception:  # noqa: BLE001 - a graph onnx cannot read: ORT already said what it could
            continue
    return {k: r for k, r in _narrowest(*found).items() if k in missing}


def _is_decoder_manifest(manifest: Manifest) -> bool:
    """A decoder with past key/values: ``generate_stream`` serves it on the session's one backend."""
    from .runtime.decode import is_decoder

    return is_decoder([s.name for s in manifest.inputs])


def _on_ort_cpu(backend: Any) -> bool:
    """``backend`` runs on ONNX Runtime's CPU provider (its first provider in use)."""
    return list(getattr(backend, "providers", []))[:1] == ["CPUExecutionProvider"]


def check_max_batch(manifest: Any, max_batch: int | None, option: str = "max_batch=") -> None:
    """Refuse a ``max_batch`` above the bundle's batch range max (``option`` spells the setting in the message:
    ``"max_batch="`` for ``load``, ``"--max-batch "`` for ``dsedge serve``). Raises InputError."""
    batch_symbol = BatchLayout.of(manifest.inputs, manifest.outputs).batch_symbol
    top = manifest.shape_ranges.get(batch_symbol or "", {}).get("max")
    if max_batch is not None and top is not None and int(max_batch) > int(top):
        raise InputError(f"{option}{max_batch} is above the bundle's batch range max {top}",
                         f"pass {option}{top} or less: batches stay within the shapes the bundle was built for")


def auto_instances(backend: Any, instances: int | None, threads: int | None,
                   reserve_cores: int = 0) -> tuple[int, int | None]:
    """``(instances, intra-op threads each)`` for the streaming lanes of ``backend``.

    ``reserve_cores``: on the CPU provider, lay the instances out over the cores left after that many (at least
    one) are kept for the caller's own threads (``runtime/instances.reserved_layout``).

    Given ``instances``, that many, each with ``threads`` (None: ``cores // instances`` on ONNX Runtime's CPU
    provider, else the backend's default). None: on the CPU provider without ``threads``, 2 instances of
    ``cores // 2`` threads each (1 instance on one core); otherwise 1 (a GPU runs one engine per device, as
    Triton's default instance group does; ``threads`` given means that one backend). Measured on a 2-core host
    (MiniLM fp32, batch 1): two 1-thread sessions run side by side serve 1.41× the rows/s of one 2-thread session
    (200 vs 142 rows/s) with a lower tail at full load (p98 11.0 vs 16.5 ms with two callers on the one session),
    at 10 ms per request instead of 7; see docs/streaming.md for what that does to goodput within budget.
    """
    if _on_ort_cpu(backend):
        return reserved_layout(instances, threads, _cores(), reserve_cores)
    return (1 if instances is None else int(instances)), threads
