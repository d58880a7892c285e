"""The streaming core behind ``Session.submit``/``stream``/``stream_async``: lanes, cascade, warm-up, windows.

``StreamingCore`` assembles one ``Lane`` per served variant over a ``BudgetScheduler`` (runtime/scheduler.py) and
does so without measuring anything on the caller's thread: each lane starts from its profile's seeds (the
bundle's build-time figures) and makes its own warm-up run on its worker thread, so the first ``submit`` returns
at once. Cascade variants are opened and warmed on a background thread and join the scheduler when ready (only
those predicted cheaper than the primary at batch 1). ``warmup()`` is an explicit, blocking measurement for callers
who want a full profile before traffic; nothing depends on it.

A variant whose manifest says ``batch_invariant: false`` (its answer for a row depends on its batch-mates, e.g.
per-tensor dynamic INT8) is served at batch 1 unless the caller opts in with ``batch_variant_ok=True``.

``stream``/``stream_async`` share one windowed, optionally ordered, delivery (``AnswerWindow``): at most ``window``
answers are in flight or held back for order, so a long stream does not flood the queue.
"""
from __future__ import annotations

import asyncio
import atexit
import logging
import queue as _queue
import threading
import weakref
from concurrent.futures import Future
from typing import Any, AsyncIterator, Callable, Iterable, Iterator, Mapping, Sequence

from .batching import BatchLayout, example_feed
from .bundle import Manifest, Variant
from .errors import BundleIntegrityError
from .latency_profile import LatencyProfile, measure
from .metrics import StreamMetrics
from .scheduler import BudgetScheduler, Lane, WarmUpGate

log = logging.getLogger("dsedge.streaming")

_WARM_SEQ = 32
_MEASURE_SEQS = (16, 64)

PROFILE_MODES = ("auto", "measure", "bundle")


class StartGate:
    """Where a session's lane workers wait before their first act: until the caller's first ``submit`` has queued
    its request (``submitted``, after every lane exists), or, when no request comes (a core built by ``warmup()``),
    ``grace_s`` after they started and until every lane exists (``open``). A worker let go earlier (pinning itself,
    warming up: with two 1-thread instances and the 2-thread fallback, up to four compute threads on 2 cores) held
    the interpreter lock and the cores while that submit still ran: MiniLM's first submit took 2-8 ms (over 5 ms in
    5 of 16 loads, quiet 2-core host), most of it queueing the request behind the warming workers. Thread-safe."""

    def __init__(self, grace_s: float = 0.02) -> None:
        self.grace_s = float(grace_s)
        self._made = threading.Event()
        self._first = threading.Event()

    def open(self) -> None:
        self._made.set()

    def submitted(self) -> None:
        if not self._first.is_set():
            self._first.set()

    def wait(self) -> None:
        # one wake-up, at the first request: woken at ``open`` too, three workers took the lock in turn while that
        # request was being admitted
        if not self._first.wait(self.grace_s):
            self._made.wait()


class AnswerWindow:
    """Hands answers to ``put`` as their futures finish: in completion order, or in input order (``ordered``).

    ``add(index, future)`` registers the ``index``-th submitted request; indexes start at 0 and have no gaps.
    """

    def __init__(self, ordered: bool, put: Callable[[Any], None]) -> None:
        self.ordered = ordered
        self._put = put
        self._lock = threading.Lock()
        self._held: dict[int, Any] = {}
        self._next = 0

    def add(self, index: int, fut: Future) -> None:
        fut.add_done_callback(lambda f: self._finish(index, f.result()))

    def _finish(self, index: int, answer: Any) -> None:
        with self._lock:
            if not self.ordered:
                ready = [answer]
            else:
                self._held[index] = answer
                ready = []
                while self._next in self._held:
                    ready.append(self._held.pop(self._next))
                    self._next += 1
            for a in ready:  # under the lock: two finishing threads cannot swap the order
                self._put(a)


_NO_ITEM = object()  # a sync source's end, read on a worker thread (``stream_async``)


class _End:
    def __init__(self, submitted: int, error: BaseException | None) -> None:
        self.submitted, self.error = submitted, error


class _Delivered:
    """What a stream has handed out, against the feeder's final tally (its ``_End``)."""

    def __init__(self) -> None:
        self.yielded, self.end = 0, None

    def accept(self, got: Any) -> bool:
        """True for an answer to hand out; False for the feeder's end marker (kept)."""
        if isinstance(got, _End):
            self.end = got
            return False
        self.yielded += 1
        return True

    def finished(self) -> bool:
        """True once every submitted request's answer was handed out; then raises the feeder's error, if any
        (a cancelled async feeder is not an error)."""
        if self.end is None or self.yielded < self.end.submitted:
            return False
        if self.end.error is not None and not isinstance(self.end.error, asyncio.CancelledError):
            raise self.end.error
        return True


_LIVE: "weakref.WeakSet[Any]" = weakref.WeakSet()  # StreamingCore and runtime/decode.py's DecodeLoop objects


def close_at_exit(obj: Any) -> None:
    """Have ``obj.close(drain=False, timeout_s=1.0)`` called at interpreter exit if it is still alive then (held
    weakly): a StreamingCore, or runtime/decode.py's DecodeLoop."""
    _LIVE.add(obj)


@atexit.register
def _close_live_cores() -> None:
    """At interpreter exit, stop every core and decode loop a caller left open (``close(drain=False)``): a lane or
    decode thread still inside ONNX Runtime while the interpreter tears down aborts the process ("terminate called
    without an active exception")."""
    for core in list(_LIVE):
        try:
            core.close(drain=False, timeout_s=1.0)
        except Exception:  # exiting anyway: never mask the program's own exit status
            pass


class StreamingCore:
    """Lanes, cascade and windowed streaming for one served variant of a bundle.

    Args:
        manifest: the verified manifest.
        variant: the variant served first (the primary lane).
        run: the primary backend's ``run`` (``dict[str, ndarray] -> dict[str, ndarray]``).
        metrics: where every request's fate is counted.
        default_budget_ms: ``() -> ms``, the budget of a request that names none (also bounds measurement).
        cascade: let cheaper variants serve requests the primary cannot meet.
        open_variant: ``name -> backend`` (with ``.run`` and ``.close()``-free lifetime), for the cascade.
        max_batch: most rows per batch (default: the manifest's batch range max, else 32).
        max_queue / max_delay_ms: see ``Lane``.
        profile: ``"auto"`` (bundle figures scaled by this machine's warm-up run), ``"measure"`` (this machine
            only) or ``"bundle"`` (the bundle's figures as they are; measured where it has none).
        batch_variant_ok: batch variants the manifest marks ``batch_invariant: false`` (default: batch 1).
        instances: ``run`` callables of more backends of the primary variant (Triton's instance group): each
            becomes one more lane with its own queue and worker, sharing the primary's latency profile and
            calibration; admission queues a request on the least loaded one whose plan meets its deadline.
        fallback: with ``instances``, the ``run`` of the variant's backend with more intra-op threads: a lane of
            its own profile that takes the requests the instances cannot meet even alone.
        instance_seed_scale: the factor the bundle's figures take on the lanes of ``run`` and ``instances`` until
            measured here (``runtime/instances.thread_scale``: the figures were timed on another intra-op thread
            count).
        seed_scale: the same factor for the fallback's and the cascade's lanes (the session's own thread count).
        worker_nice: added to every lane worker thread's nice value (see ``Lane``; 0: unchanged).
        instance_cpus: cores to pin the worker of ``run``'s lane and of each of ``instances``' lanes to, in that
            order (``runtime/instances.instance_cpus``; empty: none pinned).
        standby: requests refused for overload wait on their variant's standby list for an instance that frees
            up in time (runtime/standby.py); False: refused at once.
        caller_weight: plans scaled by the submitting thread's CPU use above the profile's (runtime/caller_load.py;
            1 where the lanes cover every core, 0: not counted).
    Raises:
        ValueError: an unknown ``profile`` mode.
    """

    def __init__(self, manifest: Manifest, variant: Variant, run: Callable, metrics: StreamMetrics, *,
                 default_budget_ms: Callable[[], float], cascade: bool = False,
                 open_variant: Callable[[str], Any] | None = None, max_batch: int | None = None,
                 max_queue: int = 1024, max_delay_ms: float | None = None, profile: str = "auto",
                 batch_variant_ok: bool = False, instances: Sequence[Callable] = (),
                 fallback: Callable | None = None, instance_seed_scale: float = 1.0, seed_scale: float = 1.0,
                 worker_nice: int = 0, instance_cpus: Sequence[frozenset[int] | None] = (),
                 standby: bool = True, caller_weight: float = 0.0) -> None:
        if profile not in PROFILE_MODES:
            raise ValueError(f"profile must be one of {PROFILE_MODES}, got {profile!r}")
        self.manifest = manifest
        self.layout = BatchLayout.of(manifest.inputs, manifest.outputs)
        self.metrics = metrics
        self._budget = default_budget_ms
        self._profile_mode = profile
        self._max_queue = max_queue
        self._max_delay_ms = max_delay_ms
        self._batch_variant_ok = batch_variant_ok
        self._worker_nice = int(worker_nice)
        self._seed_scale = seed_scale
        self._warm_gate = WarmUpGate()  # the lanes warm up together: none is timed against another's first run
        # the lanes' workers wait on this until every lane exists and the first request is queued: a worker that
        # went on at once (pinning itself, preparing its warm-up) held the interpreter lock while the caller, in a
        # first submit(), waited to start the next lane's thread (first submit p50 8-9 ms; 1.1 ms with a gate at
        # the last lane: 3 lanes, a busy 2-core host) and then to queue its request (``StartGate``)
        self._start_gate = StartGate()
        layout = self.layout
        batch_range = manifest.shape_ranges.get(layout.batch_symbol or "", {})
        self.max_batch = 1 if not layout.dynamic else int(max_batch or batch_range.get("max", 32))
        seq_range = manifest.shape_ranges.get(layout.seq_symbol or "", {})
        self._seq_range = (int(seq_range.get("min", 1)), int(seq_range.get("max", 1 << 30)))
        self.warm_seq = self._clip_seq(_WARM_SEQ) if layout.seq_symbol else None
        cpus = list(instance_cpus or ())
        cpus += [None] * (1 + len(instances) - len(cpus))
        try:
            primary = self._make_lane(variant, run, seed_scale=instance_seed_scale, cpus=cpus[0])
            more = [self._make_lane(variant, r, primary, i + 1, cpus=cpus[i + 1]) for i, r in enumerate(instances)]
            if fallback is not None:
                more.append(self._make_lane(variant, fallback, fallback=True, seed_scale=seed_scale))
            self.scheduler = BudgetScheduler([primary] + more, layout, metrics, standby=standby,
                                             caller_weight=caller_weight)
        finally:
            self._start_gate.open()
        self.cascade_ready = threading.Event()
        self._closed = False
        self._closing = threading.Lock()  # orders close() against the cascade thread joining its lanes
        self._cascade_thread: threading.Thread | None = None
        close_at_exit(self)
        if cascade and open_variant is not None and len(manifest.variants) > 1:
            self._cascade_thread = threading.Thread(target=self._open_cascade, args=(variant, open_variant),
                                                    name="dsedge-cascade", daemon=True)
            self._cascade_thread.start()
        else:
            self.cascade_ready.set()

    def _clip_seq(self, seq: int) -> int:
        lo, hi = self._seq_range
        return min(max(seq, lo), hi)

    # -- lanes ------------------------------------------------------------------------------------------------
    def lane_max_batch(self, variant: Variant) -> int:
        """Rows per batch for ``variant``: 1 for a batch-variant variant unless the caller opted in."""
        if getattr(variant, "batch_invariant", None) is False and not self._batch_variant_ok:
            return 1
        return self.max_batch

    def _make_lane(self, variant: Variant, run: Callable, sibling: Lane | None = None, instance: int = 0,
                   fallback: bool = False, seed_scale: float | None = None,
                   cpus: frozenset[int] | None = None) -> Lane:
        # ``sibling``: the variant's first instance, whose profile and calibration this one shares
        mode = self._profile_mode
        if sibling is not None:
            prof = sibling.profile
        elif mode == "measure":
            prof = LatencyProfile(variant.name)
        else:
            prof = LatencyProfile.from_variant(variant, sequence=self.layout.seq_symbol is not None,
                                               scale_seeds=(mode == "auto"))
            scale = self._seed_scale if seed_scale is None else seed_scale
            if scale != 1.0:  # the bundle's figures were timed on another intra-op thread count
                prof.scale_seed_figures(scale)
        layout = self.layout
        return Lane(variant.name, run, prof, layout, self.metrics, max_batch=self.lane_max_batch(variant),
                    max_queue=self._max_queue, max_delay_ms=self._max_delay_ms,
                    warm_feed=lambda b, s: example_feed(layout, b, s), warm_seq=self.warm_seq,
                    observe_warmup=(mode != "bundle" or prof.empty),
                    calibration=None if sibling is None else sibling.calibration, instance=instance,
                    fallback=fallback, nice=self._worker_nice, warm_gate=self._warm_gate, cpus=cpus,
                    start_gate=self._start_gate)

    def _open_cascade(self, primary_variant: Variant, open_variant: Callable[[str], Any]) -> None:
        try:
            primaries = [l for l in self.scheduler.lanes if l.name == primary_variant.name]
            primary = primaries[0]
            primary.warm.wait(60)
            seq = self.warm_seq
            alone = primary.predict(1, seq)
            cheaper = []
            for v in self.manifest.variants:
                if v.name == primary_variant.name or self._closed:
                    continue
                try:
                    lane = self._make_lane(v, open_variant(v.name).run)
                except BundleIntegrityError as e:  # its file changed since load() verified it: never run it
                    log.warning("cascade: variant %r is not served: %s", v.name, e)
                    continue
                except Exception:  # a variant this machine cannot open simply does not join the cascade
                    continue
                lane.warm.wait(60)
                cost = lane.predict(1, seq)
                if cost < alone:
                    cheaper.append((cost, lane))
                else:
                    lane.close(drain=False)
            with self._closing:  # close() cannot slip in between the check and the new lanes (they would leak)
                joined = bool(cheaper) and not self._closed
                if joined:  # most accurate (the dearest of the cheaper ones) first
                    self.scheduler.set_lanes(primaries + [lane for _, lane in sorted(cheaper, key=lambda x: -x[0])])
            if not joined:  # closed meanwhile (close() waited for this thread at most its timeout)
                for _, lane in cheaper:
                    lane.close(drain=False)
        finally:
            self.cascade_ready.set()

    @property
    def lanes(self) -> list[Lane]:
        return self.scheduler.lanes

    def warmup(self, timeout_s: float = 120.0) -> dict[str, Any]:
        """Wait for every lane's warm-up (and the cascade), then measure each lane at batch 1 … max_batch.

        Blocks the caller (it is the explicit form; serving never waits for it). In ``"bundle"`` mode lanes with
        build-time figures are not measured. Returns ``{variant: LatencyProfile.to_dict()}`` (its instances'
        profile; a variant's fallback lane's profile under that entry's ``"fallback"`` key).
        """
        self.cascade_ready.wait(timeout_s)
        layout = self.layout
        seqs: tuple = (None,)
        if layout.seq_symbol:
            seqs = tuple(sorted({self._clip_seq(s) for s in _MEASURE_SEQS}))
        for lane in self.lanes:
            lane.warm.wait(timeout_s)
            if lane.instance or (self._profile_mode == "bundle" and not lane.profile.empty):
                continue  # a second instance shares its variant's profile
            sizes = [b for b in (1, 2, 4, 8, 16, 32, 64, 128) if b <= lane.max_batch] + [lane.max_batch]
            measure(lane.profile, lane.run, lambda b, s: example_feed(layout, b, s), sizes, seqs, repeats=3,
                    stop_ms=2 * self._budget())
        # the variant's entry is its instances' profile; its fallback lane (same name, a profile of its own) is
        # under "fallback" there (it overwrote the instances' entry: a 2-thread profile shown as the serving one)
        out = {lane.name: lane.profile.to_dict() for lane in self.lanes if not lane.instance and not lane.fallback}
        for lane in self.lanes:
            if lane.fallback and lane.name in out:
                out[lane.name]["fallback"] = lane.profile.to_dict()
        return out

    # -- requests ---------------------------------------------------------------------------------------------
    def submit(self, feed: dict, budget_ms: float, priority: int = 0, id: Any = None,
               arrived: float | None = None) -> Future:
        """See ``BudgetScheduler.submit`` (``feed`` already validated). Raises RuntimeError after ``close``."""
        fut = self.scheduler.submit(feed, budget_ms, priority, id, arrived)
        self._start_gate.submitted()  # the workers start now (``StartGate``)
        return fut

    def default_window(self) -> int:
        return max(2, 2 * self.lanes[0].max_batch)

    def stream(self, submit_one: Callable[[Mapping[str, Any], int], Future], inputs: Iterable[Mapping[str, Any]],
               ordered: bool = False, window: int | None = None) -> Iterator[Any]:
        """Submit each item through ``submit_one(item, index)`` on a feeder thread and yield the answers.

        At most ``window`` answers are in flight or held back for order. An exception from ``submit_one`` (or the
        iterable) is raised here after the answers before it.
        """
        out: _queue.Queue = _queue.Queue()
        win = AnswerWindow(ordered, out.put)
        slots = threading.Semaphore(window or self.default_window())
        stop = threading.Event()

        def feed() -> None:
            n, error = 0, None
            try:
                for i, item in enumerate(inputs):
                    while not slots.acquire(timeout=0.1):
                        if stop.is_set():
                            return
                    if stop.is_set():
                        return
                    win.add(i, submit_one(item, i))
                    n += 1
            except BaseException as e:  # handed to the consumer, raised there
                error = e
            finally:
                out.put(_End(n, error))

        threading.Thread(target=feed, name="dsedge-stream-feed", daemon=True).start()
        try:
            tally = _Delivered()
            while not tally.finished():
                got = out.get()
                if tally.accept(got):
                    slots.release()
                    yield got
        finally:
            stop.set()

    async def stream_async(self, submit_one: Callable[[Mapping[str, Any], int], Future],
                           inputs: Iterable[Mapping[str, Any]] | AsyncIterator[Mapping[str, Any]],
                           ordered: bool = False, window: int | None = None) -> AsyncIterator[Any]:
        """``async for`` form of ``stream`` over a sync or async iterable (same window and order)."""
        loop = asyncio.get_running_loop()
        out: asyncio.Queue = asyncio.Queue()
        gone = threading.Event()  # the consumer stopped (break, cancel, end): later answers have nowhere to go

        def put(answer: Any) -> None:
            if gone.is_set() or loop.is_closed():
                return
            try:
                loop.call_soon_threadsafe(out.put_nowait, answer)
            except RuntimeError:  # the loop closed between the check and the call
                pass

        win = AnswerWindow(ordered, put)
        slots = asyncio.Semaphore(window or self.default_window())

        async def items() -> AsyncIterator[Mapping[str, Any]]:
            if hasattr(inputs, "__aiter__"):
                async for x in inputs:  # type: ignore[union-attr]
                    yield x
            else:  # read on a worker thread, as ``stream`` does: a slow source must not hold the event loop (a
                # user's pass: four items 0.5 s apart froze the loop for 2 s and every answer came at the end)
                it = iter(inputs)  # type: ignore[arg-type]
                while True:
                    x = await asyncio.to_thread(next, it, _NO_ITEM)
                    if x is _NO_ITEM:
                        return
                    yield x

        async def feed() -> None:
            n, error = 0, None
            try:
                async for item in items():
                    await slots.acquire()
                    win.add(n, submit_one(item, n))
                    n += 1
            except BaseException as e:
                error = e
            finally:
                put(_End(n, error))

        task = asyncio.ensure_future(feed())
        try:
            tally = _Delivered()
            while not tally.finished():
                got = await out.get()
                if tally.accept(got):
                    slots.release()
                    yield got
        finally:
            gone.set()
            task.cancel()

    # -- spare lanes ------------------------------------------------------------------------------------------
    def pause_spares(self, paused: bool) -> None:
        """Stop (or resume) offering new requests to the variants' spare lanes: every instance but the first,
        and the fallback. What they have queued still runs."""
        for l in self.lanes:
            if l.instance > 0 or l.fallback:
                l.paused = bool(paused)

    # -- reporting and shutdown -------------------------------------------------------------------------------
    def lane_stats(self) -> dict[str, dict[str, int]]:
        """Per variant: ``queue_depth`` (requests queued now, on all its instances), ``max_queue_depth`` (the
        deepest any one instance's queue has been: each instance batches its own queue), ``batches``, ``inline``,
        ``probes``, ``from_standby`` (of which ``joined``: taken into a batch held open under a flood) and
        ``stolen`` (requests an idle instance took from a busy one's queue; summed over its instances),
        ``standby_expired``, ``max_batch`` and ``instances``."""
        out: dict[str, dict[str, int]] = {}
        for l in self.lanes:  # a variant's instances add up
            got = out.setdefault(l.name, {"queue_depth": 0, "max_queue_depth": 0, "batches": 0, "inline": 0,
                                          "probes": 0, "max_batch": l.max_batch, "instances": 0,
                                          "from_standby": 0, "joined": 0, "stolen": 0,
                                          "standby_expired": 0})
            got["queue_depth"] += l.depth
            got["max_queue_depth"] = max(got["max_queue_depth"], l.max_depth)
            for k in ("batches", "inline", "probes", "from_standby", "joined", "stolen"):
                got[k] += getattr(l, k)
            got["instances"] += 0 if l.fallback else 1
            if l.standby is not None and l.instance == 0 and not l.fallback:  # one list per variant
                got["standby_expired"] += l.standby.expired
        return out

    def close(self, drain: bool = True, timeout_s: float | None = None) -> None:
        """Stop admitting; drain or reject what is queued (``BudgetScheduler.close``). A cascade still being opened
        is waited for (its lanes run ONNX Runtime on their own threads), at most ``timeout_s`` (30 s when None);
        past that, the cascade thread closes what it opened itself.

        Called on a lane's own thread (from a future's done-callback), which cannot wait for itself: admission stops
        at once and the rest runs on a helper thread, so every future still resolves just after the callback."""
        with self._closing:
            self._closed = True
        if threading.current_thread() in [getattr(lane, "_thread", None) for lane in self.lanes]:
            threading.Thread(target=self._finish_close, args=(drain, timeout_s), name="dsedge-close",
                             daemon=True).start()
            return
        self._finish_close(drain, timeout_s)

    def _finish_close(self, drain: bool, timeout_s: float | None) -> None:
        if self._cascade_thread is not None:
            self._cascade_thread.join(30.0 if timeout_s is None else min(max(timeout_s, 0.0), 30.0))
        self.scheduler.close(drain=drain, timeout_s=timeout_s)
