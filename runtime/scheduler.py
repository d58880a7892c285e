"""Budget-aware batching: earliest-deadline-first queues, admission control and cascade across variants.

One ``Lane`` per served variant: a backend, its ``LatencyProfile``, a bounded EDF queue and one worker thread.
When the worker is free it takes the earliest deadline in its queue (priority, then arrival, break ties) and forms
a batch of compatible requests, in deadline order, whose predicted completion still meets the earliest deadline
in it (the EDF rule, Liu & Layland 1973, applied to batches as in Clipper, Crankshaw et al., NSDI 2017): the
largest such batch, unless a smaller one serves clearly more rows per ms (>5 %; padding short rows to the longest
one can make a big batch slower per row than a small one). Only sizes that run get measured, so a size measured
slow once and never picked again would stay slow in the profile: when the next size up was measured here but has
fewer than ``min_samples`` samples within the profile's horizon, the worker runs it instead (at once), at most
every ``explore_interval_ms`` and only when it meets every member's deadline at its (stale) tail and takes the
whole queue (exploration as in the epsilon-greedy bandit policy, Sutton & Barto, *Reinforcement Learning*, 2nd
ed., 2018, §2.2, here triggered by staleness, not chance). It holds the batch open only while arrivals outpace
what that batch size can serve *and* one more row still fits the deadline; it dispatches at once when waiting
would break a deadline. A queued request whose deadline cannot be met alone even at the *expected* service time
is dropped with ``Rejected("deadline")`` (a budget miss: it was admitted) instead of running late; one that fits
the expected time but not the tail runs alone. One whose deadline passes while the worker runs a batch is answered
then, by the scheduler's ``DeadlineWatch`` (runtime/deadline_watch.py), not at that batch's end.

Predictions are the profile's tail estimate of service time (see runtime/latency_profile.py: a sliding-window
quantile per batch size and length bucket, fed only by measured service times, never by request latencies).
Nothing multiplies them, so no run of late answers can lock a lane. What keeps an over-estimate from sticking when a
lane rejects everything (so nothing runs that would correct it): the request last refused (for its budget or its
plan) is kept, and the idle worker runs it again as a probe, at most every ``probe_interval_ms``, unless a real
batch of its kind (batch size, length bucket) ran within ``probe_after_ms`` and the lane took a request within the
last ``probe_interval_ms``: then real batches are measuring it already, and under overload a probe is a run nobody
asked for, which new arrivals queue behind (at 3× load through ``dsedge serve``, probing every 100 ms regardless
took a third of the backend's busy time). Probes do not count as such runs, so a lane that refuses everything (after
a stall, or a cold start whose first samples were slow) keeps probing every ``probe_interval_ms`` and its stale
estimate is replaced within about a second. (Waiting ``probe_after_ms`` after the last real batch even when nothing
was taken since refused every request of a cold start's first half second in 6 of 19 runs: MiniLM fp32, 0.5× load,
20 ms budget; none in 6 runs since.) A request expected (the median, not the tail) to take more than ``probe_limit``
(4) times its budget alone, and over 10 ms, is not kept as a probe: no plausible over-estimate would admit it (the
lock-in this corrects predicted 21.7 ms against a 20 ms budget where 6.5 ms was measured), and a probe is paid in
full by an idle backend: one refused 64 × 512-token MiniLM request (6.5 s predicted, 50 ms budget) through ``dsedge
serve`` kept a core busy for seconds and grew the server's memory from 0.4 to 2.9 GB (ONNX Runtime's arena keeps
what a shape took). Nobody waits for a probe, so on a backend that can stop a run (ONNX Runtime: runtime/run_cancel.py)
it yields: admission plans the probing lane as idle, and the first request queued there, or a batch of the other
side of its cores, stops the probe between two kernels (nothing is observed from a cut run). Before, a refused
64 × 256-token request with a 1 s budget (3.6 s predicted, under the 4× limit) was probed for seconds while every
small request through ``dsedge serve`` was refused "overload". Nor does a probe ever wait for the cores: it runs
only if the other side of them neither runs nor waits now (``CoreShare.shared``/``exclusive`` with
``wait=False``); a fallback probe that waited behind an instance's probe kept the other instance's real batches off
the cores for 3-5 s.

Cold start: a lane starts with whatever its profile was seeded with (the bundle's build-time figures, scaled once
this machine measured something) and its worker's first act is a warm-up run off the caller's thread (untimed: it
allocates), then one timed run, alone: not while another lane of the session is in its first run or timing
(``WarmUpGate``); a request queued meanwhile skips the timing (the gate is woken at once). A request already queued
when the worker starts (the caller's first ``submit``) runs instead of both, as the backend's first run, untimed:
behind them, the fraud scorer's first requests (3 ms budget) were admitted on the bundle's figures and then dropped
at their deadline (1-3 of 200 per cold start, a user's pass, 2026-12-06). Until
anything is known at all, requests are admitted (up to ``max_queue``) and queued with their own deadlines; EDF
then serves them in deadline order and drops, as counted misses, those that can no longer make it.

Admission (``BudgetScheduler.submit``), against predicted latency, in the order of lanes (primary first, then
cheaper variants — the cascade):
  * alone the request cannot meet its budget → next lane, else ``Rejected("budget")``; alone at the profile's
    median, or at its tail on an instance with nothing running or queued (whose last start has passed: nothing
    waits on the standby list for it). Only the first goes on to the variant's fallback lane;
  * the queue is full, or its plan misses the deadline → next lane, else ``Rejected("overload")`` — at once, or,
    when only what runs ahead of it broke the plan, after waiting unadmitted on the variant's standby list for an
    instance that frees in time, or for a batch held open for arrivals while they exceed what the variant's
    instances serve at batch 1, which takes the entries that fit it before it waits (it is admitted then;
    runtime/standby.py; docs/streaming.md has the measurement). With the list, a plan behind other
    batches takes ``standby_guard_z`` (1) more than its calibrated z: such a refusal is not lost (in budget of
    admitted at 3× load, 36 ms budget, five interleaved pairs of 10 s windows in process: 99.03–99.61 % with it
    against 97.94–98.76 % without, goodput 305–333 against 296–330/s; at 0.5×, 13.5 ms: 99.32–99.82 % against
    98.34–99.45 %, 90.8–95.0 % of offered against 88.5–95.4 %). The plan
    (``Lane.plan``) plays the queue forward with the request inserted in deadline order, batch by batch as the
    worker will form them (a schedulability test by simulation, as admission control for EDF does): expected
    times add, tail margins add in quadrature into the plan's spread, and the request is planned to complete at
    expected + z · spread, where z is the lane's calibration (runtime/plan_calibration.py): 1 (the profile's own
    tail) for a request planned alone on an idle lane; behind other batches, a rolling quantile of the
    standardized residuals of admitted requests planned as many batches deep, its level steered to the miss rate
    seen (normalized, adaptive, Mondrian conformal prediction); while a depth has no quantile yet and arrivals
    (runtime/arrival_rate.py) exceed what the variant's instances serve at batch 1, ``overload_cold_z`` (3)
    instead of 1 (docs/streaming.md, "A prior for the cold queue under overload": misses in a server's first
    150 ms under a 3× flood went from 3–29 to 0–6 per window). It is admitted only if that meets its deadline
    and no request queued before it loses its place.
A variant may run on several instances (Triton's instance group): consecutive lanes sharing one profile, each a backend
with its own queue and worker, sharing the variant's profile and calibration; admission plans the request on each
and queues it on the least loaded one whose plan meets its deadline (join the shortest queue, the running batch
counted; ties: the one whose running batch is expected to end first, idle ones first of all), and a refusal names
the best plan seen. An instance that goes idle with an empty queue while a sibling runs a batch takes that sibling's
queue (work stealing, as in a shared queue such as Triton's instance group has): what waited behind a batch running
long starts at once. (Four interleaved pairs of cold 10 s windows in process, MiniLM int8, two 1-thread instances on
2 cores, at 0.5×/0.9×/1.5×/3× load: 6–36 requests stolen per window; in budget of offered +0.8, −0.1, +0.2 and 0.0
points on average, of admitted unchanged: no loss, a gain within the noise.) A
request the instances cannot meet even alone (each has fewer intra-op threads) goes to the variant's ``fallback``
lane, the backend with all of them, when one is there. The fallback and the instances take turns on the cores
(runtime/core_share.py): a fallback batch runs alone, and each side's plans count the other side's running batch.
Each lane's warm-up runs at its start take the cores on its side's terms too. A fallback with no figures yet
(``profile="measure"``, before its warm-up has timed it) is offered nothing: it queued requests blind, to be dropped
at their deadline. A cascade variant's lane (``cascade=True``) is not in the sharing: with it there, requests the
cascade took waited for the instances' idle probes and for the other whole-core lanes' turns, and missed by up to
390 ms (a user's pass, 2026-12-05); ``warmup()``'s measurements are not either (the fallback's, holding the cores
alone for up to 350 ms a run, made admitted traffic miss).
Side by side they oversubscribed the cores and could lock the lane onto the fallback: with two CPU burners over the
first 2 s of cold 10 s windows (MiniLM int8, 2 × 1-thread instances, 2 cores; four interleaved pairs per level), in
budget of admitted 98.70 → 99.35 % at 0.9× load (12.6 ms budget; worst window 96.56 → 99.04 %), goodput 174.4 →
185.7/s at 1.5× (12.2 ms; worst 146.6 → 175.8/s); without the burners, three pairs at each of 0.9×, 1.5× and 3×
(two budgets): −1.5 to +1.5 points of offered, within the noise (the fallback ran about once a window there).
An idle primary lane runs a request expected to take at most ``inline_ms`` (1 ms) on the caller's thread when
the caller blocked on its previous answer (``submit(x).result()`` in a loop): no thread hand-off, which costs more
than such a model's run on a busy machine (the fraud-scorer case); the returned future is then already done.
An open-loop caller's request runs there too when it is expected to take at most 0.25 ms and either less than
the recent hand-offs to the worker took (queued on the idle lane → its batch's start; one request per 0.5 s goes
to the worker to measure that again) or the worker's own times would refuse it for its budget. A caller that keeps
the interpreter lock busy between submits (Python work per request) makes each hand-off wait up to the lock's
switch interval (5 ms) while such a run takes µs, and the worker's samples then hold those waits. Such runs are
timed apart (``Lane.inline_profile``, seeded by the bundle's figures). benchmarks/busy_caller.py measures this
case (the fraud scorer's model, open-loop arrivals with bursts, caller work per request, a CPU burner) against a
plain ``run()`` loop. Other open-loop requests, and those arriving while the lane is busy, queue and batch as above.
Every request resolves its future exactly once: a ``Result`` (maybe carrying a backend error) or a ``Rejected``.
A batch the backend fails on is run again request by request, so one bad request fails alone.
"""
from __future__ import annotations

import bisect
import collections
import contextlib
import functools
import itertools
import math
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, NamedTuple, Sequence

import numpy as np

from .arrival_rate import ArrivalRate
from .batching import BatchLayout
from .caller_load import CallerLoad
from .core_share import CoreShare
from .deadline_watch import DeadlineWatch
from .errors import SessionClosedError
from .latency_profile import LatencyProfile, seq_bucket
from .metrics import StreamMetrics
from .plan_calibration import PlanCalibration
from .results import BUDGET, DEADLINE, OVERLOAD, SHUTDOWN, Rejected, Result
from .run_cancel import RunCancel, RunCancelled, cancellable
from .standby import Standby
from .thread_priority import lower_current_thread, pin_current_thread

_clock = time.perf_counter
_PROBE_FREE_MS = 10.0  # a probe this short is worth running whatever the budget
# an open-loop caller's request runs on its thread only when shorter than this, ms: it holds that caller (a server's
# event loop) from its next request, and keeps it from batching what arrives meanwhile
_OPEN_LOOP_INLINE_MS = 0.25
_HANDOFF_S = 0.5  # an open-loop caller's request goes to the worker when the newest hand-off is older (s)
_SLOW = "slow"  # a plan's memo: the factor on its batch times (``Lane.plan``'s ``slow``)


_answering = threading.local()  # set while a lane resolves futures: result() inside a done-callback is no wait


class Answer(Future):
    """The future ``submit`` returns; it notes whether its caller asked for ``result()`` (a closed-loop caller)
    rather than a done-callback reading it."""

    waited = False

    def result(self, timeout: float | None = None) -> Any:
        if not getattr(_answering, "on", False):
            self.waited = True
        return super().result(timeout)

    def add_done_callback(self, fn: Callable[[Future], Any]) -> None:
        # on a future already done (answered inline or refused at admission) the callback runs here, on the
        # caller's thread: its result() is no wait either (counted as one, an open-loop caller's callbacks had
        # made every next request run inline on its thread)
        if not self.done():
            return super().add_done_callback(fn)
        was, _answering.on = getattr(_answering, "on", False), True
        try:
            super().add_done_callback(fn)
        finally:
            _answering.on = was


class Plan(NamedTuple):
    """An admission plan: predicted completion (expected + z · spread + margin), expected completion (both
    ``time.perf_counter()`` s) and spread (s); ``others``: the same plan's ``(request, Plan)`` for the requests
    already queued (their completions move when this one joins their batch or goes ahead of them); ``ahead``:
    batches planned before the request's own (the running one included), its calibration stratum."""

    done: float
    expected: float
    spread: float
    others: tuple = ()
    ahead: int = 0


@dataclass(eq=False)
class Request:
    """One queued request. Times are ``time.perf_counter()`` seconds."""

    id: Any
    feed: dict[str, np.ndarray]
    rows: int
    seq: int | None
    group: tuple
    budget_ms: float
    priority: int
    t_submit: float
    deadline: float
    future: Future = field(default_factory=Answer)
    plan_ms: float = 0.0  # admission's expected latency, ms; 0 = admitted without a plan
    spread_ms: float = 0.0  # the plan's spread (tail margins in quadrature), ms
    ahead: int = 0  # batches the plan put before this request's own (its calibration stratum)
    watched: bool = False  # its deadline is in the scheduler's DeadlineWatch

    def sort_key(self, order: int, tie_s: float) -> tuple:
        # deadlines within ``tie_s`` of each other count as equal, so priority can break the tie
        return (int(self.deadline / tie_s), -self.priority, order)


class WarmUpGate:
    """The lanes of one session warming up at once: a lane's timed warm-up run waits until no lane is in its first
    (untimed, allocating) run and no other lane is timing, so each backend is timed alone, not against another's
    allocation or run.

    Measured on a 2-core host (MiniLM fp32, two 1-thread instances and the 2-thread fallback starting together):
    first runs took 10–31 ms, and timed runs that overlapped them took 17.1 and 21.6 ms against about 10 ms alone.
    With two such samples the profile's tail was 29.4 ms (median + 3 robust deviations), over a 20 ms budget, and
    every request of the first half second was refused. Thread-safe.
    """

    def __init__(self, poll_s: float = 0.005) -> None:
        self.poll_s = float(poll_s)  # how often a lane waiting to time its warm-up looks again without a ``wake``
        self._cond = threading.Condition()
        self._first = 0  # lanes in their first run now
        self._timing = False  # a lane's timed warm-up run is on now

    @contextlib.contextmanager
    def first_run(self) -> Iterator[None]:
        """Around a lane's first (untimed) run."""
        with self._cond:
            self._first += 1
        try:
            yield
        finally:
            with self._cond:
                self._first -= 1
                self._cond.notify_all()

    @contextlib.contextmanager
    def timed_run(self, timeout_s: float, abort: Callable[[], bool]) -> Iterator[bool]:
        """Around a lane's timed warm-up run: waits until no lane is in its first run and no other is timing, and
        yields True, or False (run nothing) when ``abort()`` turned true or ``timeout_s`` passed first."""
        end = _clock() + timeout_s
        with self._cond:
            while self._first or self._timing:
                left = end - _clock()
                if left <= 0 or abort():
                    break
                self._cond.wait(min(left, self.poll_s))
            ok = not (self._first or self._timing) and not abort()
            if ok:
                self._timing = True
        try:
            yield ok
        finally:
            if ok:
                with self._cond:
                    self._timing = False
                    self._cond.notify_all()

    def wake(self) -> None:
        """Make the lanes waiting for their timed run check their ``abort`` now (a request was queued on one): a
        queued request skips the timing and runs at once, not at the next poll (up to ``poll_s`` later)."""
        with self._cond:
            self._cond.notify_all()


class Lane:
    """One variant's backend, latency profile, EDF queue and worker thread.

    Args:
        name: the variant name reported in each ``Result``.
        run: ``dict[str, ndarray] -> dict[str, ndarray]`` (a backend's ``run``).
        profile: the variant's ``LatencyProfile`` (may be empty: see the module doc on cold start).
        layout: the model's ``BatchLayout``.
        max_batch: most rows per batch (1 when the model has no dynamic batch axis).
        max_queue: most queued requests; more are rejected with "overload".
        max_delay_ms: None = adaptive holding (see module doc); a number = hold a batch open at most that long
            (still never past what the earliest deadline allows).
        margin_ms: safety margin kept between predicted completion and deadline (scheduling overhead), ms.
        tie_ms: deadlines closer than this count as equal; ``priority`` then orders them, ms.
        warm_feed: ``(rows, seq) -> feed`` for the warm-up run the worker makes before serving (None: none).
        warm_seq: sequence length of that warm-up run (None for models without a sequence axis).
        observe_warmup: record the warm-up run's time in the profile (False keeps seeded figures as they are).
        probe_interval_ms: shortest gap between re-measuring probes of a refused request, ms.
        probe_after_ms: a refused request is not probed while a real batch of its (batch, length bucket) ran
            within this, ms.
        inline_ms: an idle lane runs requests expected (median) to take at most this long on the submitting
            thread (0: never).
        plan_limit: admission plays the queue forward batch by batch up to this many queued requests (beyond:
            a closed-form estimate); see ``plan``.
        calibration: the ``PlanCalibration`` to use (instances of one variant share theirs, and their profile).
        instance: this lane's index among its variant's instances (0: the first).
        fallback: this lane is the variant's backend of more intra-op threads beside its instances: admission
            offers it only requests the instances refused for their budget (too slow for it even alone).
        nice: added to the worker thread's nice value (0…19, Linux) so that the threads that admit and answer
            requests preempt its batches (runtime/thread_priority.py); 0 keeps the caller's priority.
        warm_gate: the ``WarmUpGate`` of the lanes warming up beside this one (a session's lanes share one); the
            timed warm-up run waits, at most ``warm_quiet_ms``, until none of them is in its first run or timing,
            and is skipped when a request arrives meanwhile (that request's run measures instead).
        probe_limit: a request refused for its budget is kept as the re-measuring probe only when expected (the
            profile's median) to take at most this many times its budget alone (or at most 10 ms).
        explore_interval_ms: shortest gap between batches run one request bigger than the best rows per ms the
            profile predicts, to re-measure a batch size measured here whose estimate rests on old samples (see
            ``_pick``), ms; ``math.inf``: never.
        cpus: cores the worker thread is pinned to (Linux; runtime/thread_priority.py), None: the process's.
        cut_after_ms: a batch expected (the profile's median) to take longer than this runs stoppable, so that
            ``close(drain=False)`` or a drain's timeout stops it between two kernels (its requests: "shutdown")
            instead of waiting for it (two 64 × 512-token MiniLM batches held ``close(drain=False)`` for 15 s);
            None: every batch runs to its end. Only on a backend that can stop a run (ONNX Runtime).
        start_gate: what the worker waits on (its ``wait()``) before anything else (a ``threading.Event``, or the
            session's ``streaming.StartGate``); None: it starts at once.
    """

    def __init__(self, name: str, run: Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]],
                 profile: LatencyProfile, layout: BatchLayout, metrics: StreamMetrics, max_batch: int = 32,
                 max_queue: int = 1024, max_delay_ms: float | None = None, margin_ms: float = 0.5,
                 tie_ms: float = 1.0, *, warm_feed: Callable[[int, int | None], dict] | None = None,
                 warm_seq: int | None = None, observe_warmup: bool = True, probe_interval_ms: float = 100.0,
                 probe_after_ms: float = 500.0, inline_ms: float = 1.0, plan_limit: int = 16,
                 calibration: PlanCalibration | None = None, instance: int = 0, fallback: bool = False,
                 nice: int = 0, warm_gate: WarmUpGate | None = None, warm_quiet_ms: float = 500.0,
                 explore_interval_ms: float = 250.0, cpus: frozenset[int] | None = None,
                 probe_limit: float = 4.0, start_gate: Any = None, cut_after_ms: float | None = 50.0) -> None:
        self.name = name
        self.run = run
        self.profile = profile
        self.layout = layout
        self.metrics = metrics
        self.max_batch = max(1, int(max_batch)) if layout.dynamic else 1
        self.max_queue = int(max_queue)
        self.max_delay_ms = max_delay_ms
        self.margin_s = margin_ms / 1e3
        self.tie_s = max(tie_ms, 1e-3) / 1e3
        self.probe_interval_s = probe_interval_ms / 1e3
        self.probe_after_s = probe_after_ms / 1e3
        self.probe_limit = float(probe_limit)
        self.explore_interval_s = explore_interval_ms / 1e3
        self._t_explore = -math.inf
        self.inline_ms = float(inline_ms)
        self.plan_limit = int(plan_limit)
        self.calibration = calibration if calibration is not None else PlanCalibration()
        self.instance = int(instance)
        self.fallback = bool(fallback)
        # no new requests while True (dsedge serve pauses a variant's spare lanes while its front end needs the
        # core they would take); what the lane has queued still runs
        self.paused = False
        self.nice = int(nice)
        self.niced = False  # the worker's nice value was raised by ``nice``
        self.cpus = frozenset(cpus) if cpus else None
        self.pinned = False  # the worker runs on ``cpus`` only
        self.warm = threading.Event()
        self._warm_gate = warm_gate if warm_gate is not None else WarmUpGate()
        self._warm_quiet_s = warm_quiet_ms / 1e3
        self._warm_feed = warm_feed
        self._warm_seq = warm_seq
        self._observe_warmup = observe_warmup
        self._queue: list[tuple[tuple, Request]] = []
        self._order = itertools.count()
        self._cond = threading.Condition()
        self._closing = False
        self._drain = True
        self._running = False  # a batch is on the backend (the worker's or an inline one)
        # a probe on a backend that can stop a run (runtime/run_cancel.py): planned as an idle lane, and stopped
        # by the first request queued here or a batch of the other side of the cores
        self._probing: RunCancel | None = None
        self._cutting: RunCancel | None = None  # the running batch's stop, when it runs stoppable (``_execute``)
        self._cut_after_ms = cut_after_ms
        self._busy_until = 0.0
        self._run_mid = 0.0  # expected end (s) of the running batch, and its tail margin (s)
        self._run_dev = 0.0
        self._gap_s: float | None = None  # moving mean gap between arrivals
        self._last_arrival: float | None = None
        self._t_admit = -math.inf  # when this lane last took a request (queued or run inline)
        self._refused: Request | None = None  # the latest request refused for its budget: the next probe
        self._last_future: Future | None = None  # of the latest request offered to try_inline
        # the hand-off to this worker: a request queued on an idle lane, when it was queued; and the recent delays
        # from there to its batch's start, ``(time, ms)`` (thread wake-up plus the interpreter lock: see try_inline)
        self.failed: str | None = None  # why the worker thread failed (``_loop``); None while it serves
        self._current: list[Request] = []  # the batch the worker runs
        self._handoff_req: tuple[Request, float] | None = None
        self._handoffs: collections.deque = collections.deque(maxlen=5)
        # service times of runs on a caller's thread: kept apart from the worker's (``profile``), which include the
        # worker's waits for the interpreter lock while a busy caller holds it, and which an inline run never has
        self.inline_profile = LatencyProfile(name, window=64, horizon_s=1.0, min_samples=3, scale_seeds=False)
        self._t_probe = 0.0
        self._first_unobserved = False  # the next batch is the backend's first run (its warm-up was skipped for it)
        self._served: dict[tuple[int, int], float] = {}  # (rows, length bucket) -> end of its latest real batch
        self.standby: Standby | None = None  # the variant's standby list (set by BudgetScheduler; runtime/standby.py)
        self.from_standby = 0
        self.joined = 0  # of those, joined a batch held open (``_join_standby``)
        self._join_expired: list[tuple[Request, str]] = []  # standby entries expired while a held batch took from
        # the list: refused by the worker at the top of its loop, outside the lock (worker thread only)
        # whether arrivals exceed what the variant's instances serve at batch 1: ``(now, rows, alone ms)`` -> bool
        # (set by BudgetScheduler; None: never, and a held batch takes nothing from the standby list)
        self.flooded: Callable[[float, int, float], bool] | None = None
        self.siblings: tuple["Lane", ...] = ()  # the variant's other instances (set by BudgetScheduler)
        # answers a queued request at its deadline while this worker runs a batch (runtime/deadline_watch.py; set by
        # BudgetScheduler; None: the worker finds it at its next pick)
        self.deadlines: DeadlineWatch | None = None
        # the cores this lane shares with the other side (instances / the variant's fallback), and the lanes of that
        # side: a fallback batch never runs beside an instance's (runtime/core_share.py; set by BudgetScheduler)
        self.share: CoreShare | None = None
        self.across: tuple["Lane", ...] = ()
        self.alone_on_cores = False  # the exclusive side of ``share`` (the variant's fallback)
        self.stolen = 0
        self.batches = 0
        self.probes = 0
        self.probes_cut = 0  # probes stopped for real requests (not counted in ``probes``)
        self.inline = 0
        self.max_depth = 0
        label = f"dsedge-lane-{name}" + (f"-{instance}" if instance else "") + ("-fallback" if fallback else "")
        self._start_gate = start_gate
        self._thread = threading.Thread(target=self._loop, name=label, daemon=True)
        self._thread.start()

    # -- prediction -------------------------------------------------------------------------------------------
    def _mark_running(self, t0: float, rows: int, seq: int | None, times: tuple[float, float] | None = None) -> None:
        # under self._cond: the running batch's predicted end (tail) and expected end, for admission; ``times``:
        # its (expected, tail) ms when known already
        mid, tail = times or (self.predict(rows, seq, k_dev=0.0), self.predict(rows, seq))
        mid, tail = min(mid, 1e4) / 1e3, min(tail, 1e4) / 1e3
        self._busy_until = t0 + tail
        self._run_mid, self._run_dev = t0 + mid, max(tail - mid, 0.0)

    def predict(self, rows: int, seq: int | None, k_dev: float | None = None) -> float:
        """The profile's tail prediction of service time, ms (``k_dev=0``: the expected time)."""
        return self.profile.predict(rows, seq, k_dev)

    def _times(self, memo: dict, rows: int, seq: int | None) -> tuple[float, float]:
        # (expected s, tail margin s) of a batch, looked up once per plan: a plan asks for the same few batch
        # shapes many times over, and each lookup takes the profile's lock
        key = (rows, seq)
        got = memo.get(key)
        if got is None:
            got = memo[key] = _margin(self.profile.times(rows, seq), memo.get(_SLOW, 1.0))
        return got

    # -- admission --------------------------------------------------------------------------------------------
    def alone_ms(self, req: Request) -> float:
        return self.profile.predict(req.rows, req.seq)

    def last_start(self, req: Request) -> float:
        """The latest ``time.perf_counter()`` (s) at which an idle lane could start ``req`` alone and still meet
        its deadline as an idle lane's plan does (expected + the profile's tail margin + ``margin_ms``);
        ``-inf`` when nothing is known."""
        m, d = self._times({}, req.rows, req.seq)
        if math.isinf(m):
            return -math.inf
        return req.deadline - (m + self._spread(0.0, d, m) + self.margin_s)

    def _standby_pick(self, now: float, entries: list[Request]) -> tuple[list[Request], list[Request]]:
        # (the batch an idle lane runs now, the entries it cannot start in time any more), from the standby list
        # (most recent first): the first entry that fits alone heads the batch, with the following ones of its
        # shape group, the prefix serving the most rows per ms that meets every member's deadline (an idle lane's
        # plan); the entries before it fit no batch now, nor later (a plan only ages): they expire
        dead = []
        for i, head in enumerate(entries):
            cands = self._candidates(entries[i:])
            feasible = self._feasible(cands, now, now, 0.0)
            if feasible:
                return cands[:feasible[self._choose(feasible)][0]], dead
            dead.append(head)
        return [], dead

    def _join_pick(self, now: float, entries: list[Request]) -> tuple[list[Request], list[Request]]:
        # (the standby entries that join the batch held open now, none expired): most recent first, each kept while
        # the queue plus those kept still form one batch meeting every member's deadline, as an idle lane's plan
        # does (the profile's tail: the rule by which an idle lane takes from the list). The first that does not
        # fit ends it: the entries after it are older (or of lower priority), and a batch of that size misses the
        # older ones' deadlines too
        queued = [r for _, r in self._queue]
        chosen: list[Request] = []
        for e in entries:
            if e.group != queued[0].group:
                continue
            cands = self._candidates(queued + chosen + [e])
            feasible = self._feasible(cands, now, now, 0.0) if len(cands) == len(queued) + len(chosen) + 1 else []
            if not feasible or feasible[-1][0] < len(cands):
                break  # max_batch reached, or it misses a deadline
            chosen.append(e)
        return chosen, []

    def _join_standby(self, now: float) -> bool:
        # under self._cond, the queue's batch held open for arrivals under a flood: the standby entries that fit
        # it join it now (admitted now), instead of the backend idling while refused requests wait on the list;
        # True if any joined or expired (the worker then picks again)
        head = self._queue[0][1]
        if self.flooded is None or not self.flooded(now, head.rows, self.alone_ms(head)):
            return False
        taken, expired = self.standby.take(now, functools.partial(self._join_pick, now))
        self._join_expired += expired
        self._admit_from_standby(taken, now)
        self.joined += len(taken)
        return bool(taken or expired)

    def _take_standby(self) -> list[tuple[Request, str]]:
        # under self._cond, the lane idle with an empty queue: queue the standby batch that fits now (admitted
        # now); returns the expired entries for the caller to reject outside the lock
        now = _clock()
        taken, expired = self.standby.take(now, functools.partial(self._standby_pick, now))
        self._admit_from_standby(taken, now)
        return expired

    def _admit_from_standby(self, taken: list[Request], now: float) -> None:
        # under self._cond: standby entries admitted now, into the queue (without a plan of their own: refused
        # ones carry none, so they are not scored)
        for r in taken:
            self._insert(r)
        if taken:
            self._t_admit = now
            self.from_standby += len(taken)
            if any(r is self._refused for r in taken):
                self._refused = None  # it runs for real: no probe of it

    def refused(self, req: Request) -> None:
        """``req`` was refused here (its budget, or its plan): keep it as the next re-measuring probe, unless it is
        expected to take more than ``probe_limit`` times its budget alone (the profile's median, not its tail: a
        few slow samples spread the tail widely), and over 10 ms."""
        if self.predict(req.rows, req.seq, k_dev=0.0) > max(self.probe_limit * req.budget_ms, _PROBE_FREE_MS):
            return
        with self._cond:
            wake = self._refused is None
            self._refused = req
            if wake:
                self._cond.notify()

    def plan(self, req: Request, now: float, z: Callable[[int], float] = lambda _ahead: 1.0,
             slow: float = 1.0, times: tuple[float, float] | None = None) -> "Plan":
        """The plan for ``req`` if queued now: its predicted completion (s), expected completion (s) and spread
        (s); ``done`` is ``inf`` when admitting it would break its own deadline or that of a request already
        queued.

        The queue, with ``req`` inserted in deadline order, is played forward the way the worker will serve it:
        after the running batch, each batch is the prefix of what is left that the worker would pick (meeting
        every member's deadline; a head that fits no batch runs alone if it can still make its deadline, else it
        would be dropped and takes no time). Expected times (medians) add; the tail margins
        (tail − median) of the batches add in quadrature, as independent service times' deviations do; a
        completion is planned at ``expected + z(batches ahead) · spread`` (runtime/plan_calibration.py gives it
        per stratum; default 1, the profile's tail). Queues longer than ``plan_limit`` are estimated in
        closed form (batches of the largest size that fits the budget). ``slow`` (≥ 1) scales every batch's times,
        the running one's rest too: the caller's CPU use above what the profile saw (runtime/caller_load.py).
        ``times``: the profile's ``times(req.rows, req.seq)`` (expected, tail ms) when the caller has them already.
        """
        with self._cond:
            queued = [r for _, r in self._queue]
            run_end_mid, run_dev, running = self._run_mid, self._run_dev, self._running
        for other in self.across:  # the other side's running batch holds the cores (runtime/core_share.py)
            if other._running and other._run_mid > run_end_mid:
                run_end_mid, run_dev, running = other._run_mid, max(run_dev, other._run_dev), True
        rem_mid = max(run_end_mid - now, 0.0) * slow
        rem_var = (run_dev * slow) ** 2  # counted while it runs, even past its expected end
        # a batch on the backend is one batch ahead, even past its expected end with no tail margin left to count
        # (a zero-spread seed, or a slow run): the request's stratum is then 1, not an idle lane's 0 (the running
        # batch's expected end and margin are set and cleared with the running flag, so the flag says it all)
        ahead0 = 1 if running else 0
        memo: dict = {_SLOW: slow}
        if times is not None:  # what ``_times`` would look up
            memo[(req.rows, req.seq)] = _margin(times, slow)
        if not queued:  # nothing queued (most plans below capacity): ``_play`` of its one batch, inline
            m, d = self._times(memo, req.rows, req.seq)
            start = now + rem_mid
            if math.isinf(m) or start + m > req.deadline:
                return Plan(math.inf, math.inf, 0.0)
            spread = self._spread(rem_var, d, rem_mid + m)
            return Plan(start + m + z(ahead0) * spread + self.margin_s, start + m, spread, ahead=ahead0)
        if len(queued) > self.plan_limit:
            return self._closed_form(req, queued, now, rem_mid, rem_var, z, memo, ahead0)
        key = (int(req.deadline / self.tie_s), -req.priority)
        pos = next((i for i, r in enumerate(queued) if (int(r.deadline / self.tie_s), -r.priority) > key),
                   len(queued))
        with_req = self._play(queued[:pos] + [req] + queued[pos:], now, rem_mid, rem_var, z, memo, ahead0)
        got = with_req.get(id(req))
        if got is None:
            return Plan(math.inf, math.inf, 0.0)
        if pos < len(queued):
            # req goes ahead of others: it must not make an admitted request miss that would have made it
            without = self._play(queued, now, rem_mid, rem_var, z, memo, ahead0)

            def kept(plans: dict, r: Request) -> bool:
                return id(r) in plans and plans[id(r)].done <= r.deadline

            if any(kept(without, r) and not kept(with_req, r) for r in queued[pos:]):
                return Plan(math.inf, math.inf, 0.0)
        return got._replace(others=tuple((r, with_req[id(r)]) for r in queued if id(r) in with_req))

    def _play(self, order: list[Request], now: float, mid_s: float, var_s: float,
              z: Callable[[int], float], memo: dict, ahead: int) -> dict[int, "Plan"]:
        """``{id(request): Plan}`` for the requests of ``order`` (EDF order) that would be served in time,
        playing the worker's batching forward from ``now`` plus the running batch (``ahead``: 1 when one runs)."""
        out: dict[int, Plan] = {}
        left = list(order)
        while left:
            head = left[0]
            cands = self._candidates(left)
            start = now + mid_s
            zk = z(ahead)
            feasible = self._feasible(cands, now, start, var_s, zk, memo)
            if feasible:
                n, t, m, d = feasible[self._choose(feasible)]
            else:  # as the worker does: the head runs alone if it can still make its deadline at the expected
                # time (counted as served then), else it is dropped and takes no time
                m, d = self._times(memo, head.rows, head.seq)
                if math.isinf(m) or start + m > head.deadline:
                    left.pop(0)
                    continue
                n, t = 1, start + m + zk * self._spread(var_s, d, start - now + m) + self.margin_s
            chosen = cands[:n]
            plan = Plan(t, start + m, self._spread(var_s, d, start - now + m), ahead=ahead)
            for r in chosen:
                out[id(r)] = plan
            mid_s, var_s, ahead = mid_s + m, var_s + d * d, ahead + 1
            ids = set(map(id, chosen))
            left = [r for r in left if id(r) not in ids]
        return out

    @staticmethod
    def _spread(var_s: float, d: float, expected_s: float) -> float:
        # tail margins in quadrature, never below 20 % of the expected latency: a window of a few samples (a cold
        # lane, seeds without spread) says nothing about the tail, and a residual over a tiny spread would set z
        return max(math.sqrt(var_s + d * d), 0.2 * expected_s, 5e-4)

    def _candidates(self, order: list[Request]) -> list[Request]:
        """The requests that could share a batch with the head of ``order``: the same shape group, in order, up to
        ``max_batch`` rows."""
        head, cands, rows = order[0], [], 0
        for r in order:
            if r.group != head.group:
                continue
            if cands and rows + r.rows > self.max_batch:
                break
            cands.append(r)
            rows += r.rows
        return cands

    def _feasible(self, cands: list[Request], now: float, start: float, var_s: float,
                  z: float = 1.0, memo: dict | None = None) -> list[tuple[int, float, float, float]]:
        """``(rows taken, predicted completion s, expected s, tail margin s)`` for each prefix of ``cands`` that,
        started at ``start`` after work whose tail margins' squares sum to ``var_s``, meets every member's deadline,
        completions planned at expected + z · spread."""
        out, rows, seq, dl = [], 0, 0, math.inf
        memo = {} if memo is None else memo
        for i, r in enumerate(cands):
            rows, seq = rows + r.rows, max(seq, r.seq or 0)
            dl = min(dl, r.deadline)
            m, d = self._times(memo, rows, seq or None)
            t = start + m + z * self._spread(var_s, d, start - now + m) + self.margin_s
            if t > dl:
                break
            out.append((i + 1, t, m, d))
        return out

    @staticmethod
    def _choose(feasible: list[tuple[int, float, float, float]]) -> int:
        """Index of the prefix serving the most rows per ms (padding to the longest row can make a bigger batch
        slower per row), the largest one within 5 % of the best."""
        rate = [n / max(m, 1e-12) for n, _, m, _ in feasible]
        top = max(rate)
        return max(i for i in range(len(feasible)) if round(rate[i], 6) >= 0.95 * top)

    def _closed_form(self, req: Request, queued: list[Request], now: float, mid_s: float, var_s: float,
                     z: Callable[[int], float], memo: dict, ahead0: int) -> "Plan":
        # the rows due before ``req`` (EDF order) and ``req`` itself, in batches of the largest size whose time at
        # their longest length fits the budget; each batch timed at its own longest row (the worker pads to it: a
        # short request behind long ones waits for long batches, and timing them at its own length put a burst
        # of mixed lengths 2-5x too early)
        order = [r for r in queued if r.deadline <= req.deadline] + [req]
        longest = max((r.seq or 0) for r in order) or None
        b = max(1, self.profile.max_batch_within(req.budget_ms, longest, self.max_batch))
        expected, var, full = mid_s, var_s, 0
        rows, seq = 0, 0
        for r in order:
            if rows and rows + r.rows > b:
                m, d = self._times(memo, rows, seq or None)
                expected, var, full = expected + m, var + d * d, full + 1
                rows, seq = 0, 0
            rows, seq = rows + r.rows, max(seq, r.seq or 0)
        last_m, last_d = self._times(memo, rows, seq or None)
        expected += last_m
        spread = self._spread(var, last_d, expected)
        ahead = full + ahead0
        return Plan(now + expected + z(ahead) * spread + self.margin_s, now + expected, spread, ahead=ahead)

    def enqueue(self, req: Request, cold_limit: int | None = None) -> bool:
        """Queue ``req``; False when the queue is full (or holds ``cold_limit`` already) or the lane is closing."""
        with self._cond:
            limit = self.max_queue if cold_limit is None else min(self.max_queue, cold_limit)
            if self._closing or len(self._queue) >= limit:
                return False
            now = _clock()
            if self._last_arrival is not None:
                gap = now - self._last_arrival
                self._gap_s = gap if self._gap_s is None else self._gap_s + 0.1 * (gap - self._gap_s)
            self._last_arrival = self._t_admit = now
            if not (self._running or self._queue or self._probing is not None) and self.warm.is_set():
                self._handoff_req = (req, now)
            self._insert(req)
            self._cond.notify()
        if not self.warm.is_set():
            self._warm_gate.wake()  # a worker waiting to time its warm-up serves this instead
        return True

    def _insert(self, req: Request) -> None:
        # under self._cond: into the queue in EDF order (deadline, then priority, then arrival); a probe running
        # here yields to it
        if self._probing is not None:
            self._probing.cancel()
        bisect.insort(self._queue, (req.sort_key(next(self._order), self.tie_s), req), key=lambda x: x[0])
        self.max_depth = max(self.max_depth, len(self._queue))
        if self._running or not self.warm.is_set():  # it waits for a batch or the warm-up: see _watch
            self._watch(req)

    def _watch(self, req: Request) -> None:
        # under self._cond: the deadline watch answers ``req`` at its deadline should it still be queued then. Only
        # requests that wait behind work the worker cannot leave (a batch, or the warm-up) are watched: one queued
        # on an idle worker is picked at once, and one the worker leaves queued when it starts a batch is watched
        # then (``_serve``). Watching every request cost a wake-up of the watch's thread per request, each at a
        # deadline long met (that thread's CPU: 46-69 µs per request at 0.9-1.5x load, MiniLM int8, 2 x 1-thread
        # instances), and each wake-up takes a core from a running batch
        if self.deadlines is not None and not req.watched:
            req.watched = True
            self.deadlines.add(req, (self, *self.siblings))

    def expire(self, req: Request) -> bool:
        """``req``'s deadline passed (``DeadlineWatch``): if it is still queued here, take it out and answer it
        ``Rejected("deadline")`` now, a miss of its plan, as the worker's next pick would have; False if it is not
        in this lane's queue (running, answered, or on a sibling instance)."""
        with self._cond:
            at = next((i for i, (_, r) in enumerate(self._queue) if r is req), None)
            if at is None:
                return False
            del self._queue[at]
            now = _clock()
            if self._handoff_req is not None and self._handoff_req[0] is req:  # not picked up by its deadline
                self._handoffs.append((now, (now - self._handoff_req[1]) * 1e3))
                self._handoff_req = None
            self._plan_missed(req, now)
        self._reject(req, DEADLINE, f"its deadline passed {(now - req.deadline) * 1e3:.1f} ms ago, queued on "
                                    f"{self.name} behind a running batch")
        return True

    def _plan_missed(self, req: Request, now: float) -> float:
        # under self._cond: ``req`` leaves the queue at ``now`` without running; its plan is scored as missed by
        # at least its expected service time (ms, returned)
        expected = self.predict(req.rows, req.seq, k_dev=0.0)
        if req.plan_ms > 0.0:
            self.calibration.score(req.plan_ms, (now - req.t_submit) * 1e3 + expected, req.spread_ms,
                                   stratum=req.ahead)
            self.calibration.outcome(True)
        return expected

    def try_inline(self, req: Request, now: float) -> bool:
        """Run ``req`` now on the calling thread when the lane is idle, the request is short and its budget holds
        at the expected time of such runs (``inline_profile``; the bundle's figures before any), and either the
        previous request's caller waited for its answer (a closed loop: running on its thread costs it nothing)
        or, for a run of at most 0.25 ms, a hand-off to the worker is expected to delay it more: the hand-offs
        measured lately took longer than the run (``handoff_ms``; while the caller keeps the interpreter lock busy,
        each costs up to the lock's switch interval, 5 ms), or the worker's own times would refuse it for its
        budget (its idle plan's own figure, ``last_start``: not the tail alone, which for a µs model sits under
        the plan's 0.5 ms spread floor). True if it ran; otherwise the request queues and batches."""
        last, self._last_future = self._last_future, req.future
        if self.inline_ms <= 0 or not self.warm.is_set() or self.fallback:
            return False
        left = req.budget_ms - (now - req.t_submit) * 1e3 - self.margin_s * 1e3
        if self.inline_profile.measured:
            worker_refuses = self.last_start(req) < now
            # the median of such runs; the lower quartile where the worker's own times would refuse the request
            # (the caller keeps the interpreter lock busy): then the first inline runs can also wait for the lock,
            # behind the worker's warm-up, and a median over three of those had ended inline runs for good, with
            # nothing run inline left to measure again (a spinning caller at 1000/s: 3 of 2000 answered, 1 in 9)
            low = self.inline_profile.low(req.rows, req.seq) if worker_refuses else None
            alone = low if low is not None else self.inline_profile.predict(req.rows, req.seq, k_dev=0.0)
        else:  # the bundle's figures first: the worker's samples may hold lock waits an inline run has not
            alone = self.profile.seed_times(req.rows, req.seq)[0]
            if math.isinf(alone):
                alone = self.profile.predict(req.rows, req.seq, k_dev=0.0)
            if alone > self.inline_ms:
                return False  # (every request of a model too slow to run inline, MiniLM's: nothing more to look up)
            worker_refuses = self.last_start(req) < now
        # the expected time, not the tail: a run on the caller's thread waits for the interpreter lock only while
        # the worker holds it, a few samples of the window, and a tail check over them had sent every request
        # to that worker, where each waited the lock's switch interval (a collapse: 15 % in budget at 5000/s)
        if alone > self.inline_ms or alone > left:
            return False
        if not getattr(last, "waited", False):
            # an open-loop caller is held back only by a short run that a hand-off would delay more: one measured
            # longer than the run (one request per ``_HANDOFF_S`` goes to the worker to measure it again), or a
            # worker whose own times (their lock waits included) would refuse the request for its budget: queued
            # there, refused, it measured no hand-off, and the lane refused every request for 1–1.5 s at a time
            if alone > _OPEN_LOOP_INLINE_MS and not (
                    alone <= self.inline_ms
                    and self.inline_profile.recent_samples(req.rows, req.seq, now) < self.inline_profile.min_samples):
                # (an estimate on fewer than ``min_samples`` recent runs is measured again, here: with nothing run
                # inline, nothing else would, and one slow first sample had sent every request to the worker for good)
                return False
            if not worker_refuses:
                newest = self._handoffs[-1][0] if self._handoffs else -math.inf
                if now - newest > _HANDOFF_S or alone > self.handoff_ms():
                    return False
        with self._cond:
            if self._running or self._queue or self._closing or self._probing is not None:
                return False  # (a probe yields to the queued request: ``_insert``)
            self._mark_running(req.t_submit, req.rows, req.seq, (alone, 2.0 * alone))  # (a µs run: any tail)
            self._running = True
            self._t_admit = _clock()
        try:
            self._execute([req], stoppable=False, inline=True)
        finally:
            with self._cond:
                self._running = False
                self._busy_until = self._run_mid = self._run_dev = 0.0
                self.inline += 1
                if self._queue or self._closing or self._refused is not None or self._standby_waiting():
                    # the worker: a queued request, a probe or the standby list that waited for the backend (not
                    # woken otherwise: a wake-up per inline run cost the caller 11 µs and the worker the lock)
                    self._cond.notify_all()
        return True

    def handoff_ms(self) -> float:
        """Median delay, ms, of the last hand-offs (up to 5) from queueing a request on this idle lane to its
        batch's start on the worker; 0 before any."""
        recent = sorted(ms for _, ms in list(self._handoffs))
        return recent[len(recent) // 2] if recent else 0.0

    @property
    def depth(self) -> int:
        return len(self._queue)

    @property
    def outstanding(self) -> int:
        """Requests queued plus one for a batch on the backend (the instances' join-shortest-queue key)."""
        return len(self._queue) + (1 if self._running else 0)

    # -- worker -----------------------------------------------------------------------------------------------
    def _answer(self, req: Request, answer: Result | Rejected, inline: bool = False) -> None:
        # ``inline``: answered on the submitting thread before its future was handed out (nobody could cancel it)
        if req.plan_ms > 0.0 and isinstance(answer, Result):
            if answer.error is None:
                self.calibration.score(req.plan_ms, answer.latency_ms, req.spread_ms, stratum=req.ahead)
            self.calibration.outcome(answer.latency_ms > req.budget_ms or answer.error is not None)
        if not (inline or req.future.running() or req.future.set_running_or_notify_cancel()):
            self.metrics.on_cancelled()  # cancelled by its caller while queued: nobody reads this answer
            return
        _answering.on = True
        try:
            req.future.set_result(answer)
        except BaseException:
            # a done-callback raised SystemExit (concurrent.futures hands only Exception to its log): on the
            # session's own threads it must not end the worker, its queue unanswered and the count undone
            if threading.current_thread() is threading.main_thread():  # e.g. Ctrl-C in an inline answer
                self.metrics.on_answer(answer)
                raise
        finally:
            _answering.on = False
        self.metrics.on_answer(answer)

    def _steal(self) -> bool:
        # idle with an empty queue: the queue of a sibling instance running a batch comes here, where it starts
        # now instead of behind that batch; True if any came. Both locks are held, taken in instance order (no
        # two lanes wait on each other), so a request is always in exactly one queue. Stolen requests keep their
        # plans: one answered early scores the earlier completion, so the calibration learns what stealing gains
        if self._running or self._queue or not any(s._queue for s in self.siblings):
            return False  # the common case, read without locks (rechecked under them)
        for sib in self.siblings:
            low, high = (self, sib) if self.instance < sib.instance else (sib, self)
            with low._cond, high._cond:
                if self._running or self._queue or self._closing or self.paused:
                    return False
                if not sib._running or not sib._queue or sib._closing:
                    continue
                taken = [r for _, r in sib._queue]
                sib._queue.clear()
                for r in taken:
                    self._insert(r)
                self.stolen += len(taken)
                self._t_admit = _clock()
                return True
        return False

    def _standby_waiting(self) -> bool:
        # requests wait on this lane's standby list and the lane may take them (not paused; a fallback has none)
        return self.standby is not None and len(self.standby) > 0 and not self.paused

    def _reject_standby(self, expired: Sequence[tuple[Request, str]]) -> None:
        # standby entries no idle instance can start in time any more: refused now (never admitted)
        now = _clock()
        for req, detail in expired:
            waited = (now - req.t_submit) * 1e3
            self._reject(req, OVERLOAD, f"{detail}; no instance free in time (on standby {waited:.1f} ms)")

    def _reject(self, req: Request, reason: str, detail: str) -> None:
        now = _clock()
        self._answer(req, Rejected(req.id, reason, detail, req.budget_ms, (now - req.t_submit) * 1e3))

    def _pick(self, now: float) -> tuple[list[Request], float]:
        """Choose the batch to run now (``[]`` plus a wait in s when holding it open is worth it; a wait < 0 means
        the head cannot make its deadline: drop it)."""
        head = self._queue[0][1]
        cands = self._candidates([r for _, r in self._queue])
        # prefixes whose predicted completion meets every member's deadline, at the profile's own tail (z = 1):
        # how conservative to be is admission's call (a calibrated z here would only shrink batches under
        # overload, when throughput matters most); later arrivals may join an earlier request's batch while its
        # deadline holds (admission's z measures what that costs its plan)
        feasible = self._feasible(cands, now, now, 0.0)
        if not feasible:
            expected = self.predict(head.rows, head.seq, k_dev=0.0)
            if math.isinf(expected) or now + expected / 1e3 <= head.deadline:
                return [head], 0.0  # nothing known yet, or it can still make it at the expected time: run alone
            return [head], -1.0
        pick, explore = self._choose(feasible), False
        if (pick + 1 < len(feasible) and feasible[pick + 1][0] == len(self._queue)
                and self.explore_interval_s < math.inf and now - self._t_explore >= self.explore_interval_s):
            # one request more than the best predicted rows per ms, when that batch size was measured here but its
            # estimate rests on samples older than the profile's horizon (seeds stand in until measured): the
            # choice rests on estimates and only chosen sizes are measured, so a size measured slow once (its
            # first run on ORT allocates, or it ran in a slow second) was never chosen, never measured again,
            # and the lane was locked at a smaller size (at 3x load: 1-thread batches of 1 forever, batch 2
            # estimated at 23 ms where it took 11-15). It still meets every member's deadline at its tail, and it
            # takes the whole queue: no admitted request waits behind a batch its plan did not count on (exploring
            # with requests left behind kept a median 88.5 % of admitted in budget through dsedge serve at 3x load,
            # against 93.6 % unchanged, over nine noisy interleaved pairs of 8 s windows).
            nxt = cands[:feasible[pick + 1][0]]
            rows, seq = sum(r.rows for r in nxt), max(r.seq or 0 for r in nxt) or None
            if (self.profile.samples(rows, seq) > 0  # measured here (else seeds stand in), and not lately
                    and self.profile.recent_samples(rows, seq, now) < self.profile.min_samples):
                pick, explore = pick + 1, True
        best = feasible[pick][0]
        batch = cands[:best]
        if explore:  # run now: held open, a later pick would choose by the stale estimate again
            self._t_explore = now
            return batch, 0.0
        rows, seq = sum(r.rows for r in batch), max(r.seq or 0 for r in batch)
        dl = min(r.deadline for r in batch)
        more_waiting = best < len(self._queue)  # others queued (any group): holding would only delay them
        if rows >= self.max_batch or more_waiting or self._closing:
            return batch, 0.0
        slack = dl - now - self.predict(rows + 1, seq or None) / 1e3 - self.margin_s
        if slack <= 0:
            return batch, 0.0  # waiting for one more would break the earliest deadline (or plan)
        if self.max_delay_ms is not None:
            held = now - max(r.t_submit for r in batch)
            wait = min(slack, self.max_delay_ms / 1e3 - held)
        else:
            # hold only while arrivals outpace what this batch size serves, and only until the next arrival is
            # overdue (twice the mean gap since the last one: the burst is over)
            if self._gap_s is None or self._last_arrival is None:
                return batch, 0.0
            since_last = now - self._last_arrival
            gap = max(self._gap_s, since_last)
            serve_s = self.predict(rows, seq or None) / 1e3
            rate_in, rate_out = 1.0 / max(gap, 1e-6), rows / max(serve_s, 1e-6)
            if rate_in <= rate_out:
                return batch, 0.0
            wait = min(slack, 2.0 * self._gap_s - since_last)
        return (batch, 0.0) if wait <= 0 else ([], wait)

    def _warm_up(self) -> None:
        try:
            with self._cond:
                waiting = bool(self._queue)
            if waiting and self._warm_feed is not None and not self.fallback:
                # a request queued before this worker ran (the caller's first submit): it goes first, as the
                # backend's first run, untimed, instead of waiting behind two warm-up runs (the fraud scorer's
                # first requests, 3 ms budget, were admitted and then dropped at their deadline behind them)
                self._first_unobserved = True
                return
            if self._warm_feed is not None:
                feed = self._warm_feed(1, self._warm_seq)
                with self._cores(), self._warm_gate.first_run():  # on the cores' terms, as any run (core_share.py)
                    self.run(feed)  # ORT's first run of a shape allocates: untimed
                # timed alone: not against another lane's first run or timed run (see WarmUpGate); a request
                # waiting now, or arriving meanwhile, is served at once and measures instead
                with self._warm_gate.timed_run(self._warm_quiet_s, lambda: bool(self._queue) or self._closing) as ok:
                    # a fallback with no figures yet is timed anyway (its cores are its own): submit() sends it
                    # nothing until it has one
                    if not ok and (self._closing or not (self.alone_on_cores and self.profile.empty)):
                        return
                    with self._cores():
                        t0 = _clock()
                        self.run(feed)
                        ms = (_clock() - t0) * 1e3
                if self._observe_warmup:
                    self.profile.observe(1, self._warm_seq, ms)
        except Exception:  # a warm-up that cannot run says nothing about serving: real requests will tell
            pass
        finally:
            self.warm.set()

    def _probe(self, req: Request, cancel: RunCancel | None) -> bool:
        # re-measure a refused request's service time on the idle backend (its answer already went out); False if
        # it was stopped for a real request (nothing is observed: a cut run says only that it ran that long)
        try:
            with self._probe_cores() as free:
                if not free:  # the other side of the cores runs or waits: a probe does not queue for them
                    return False
                t0 = _clock()
                if cancel is None:
                    self.run(req.feed)
                else:
                    self.run(req.feed, cancel=cancel)
                ms = (_clock() - t0) * 1e3
            self.profile.observe(req.rows, req.seq, ms)
        except RunCancelled:
            return False
        except Exception:
            pass
        return True

    def _loop(self) -> None:
        # the worker thread: serve until closed; should it fail (a bug, not a backend error: those fail their
        # batch only), every request it holds is answered and the lane takes no more, instead of leaving their
        # futures unresolved and the session's callers waiting forever (a user's pass: Session.stream hung)
        try:
            self._serve()
        except BaseException as e:
            why = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200] if str(e).strip() else ''}"
            with self._cond:
                self.failed = why
                self._closing, self._drain = True, False  # enqueue refuses from here
                pending = self._take_queue() + [r for r in self._current if not r.future.done()]
                self._current = []
                self._cond.notify_all()
            self._reject_shutdown(pending, f"the worker thread of {self.name} failed ({why}); load the bundle again")
            raise  # printed by threading.excepthook, as any thread's

    def _serve(self) -> None:
        if self._start_gate is not None:  # every lane made, the first request queued (streaming.StartGate)
            self._start_gate.wait()
        self.niced = lower_current_thread(self.nice)
        self.pinned = pin_current_thread(self.cpus) if self.cpus else False
        self._warm_up()
        while True:
            if self.siblings and self._steal():
                continue
            probe, expired = None, []
            if self._join_expired:
                expired, self._join_expired = self._join_expired, []
            with self._cond:
                if not expired and (not self._running and not self._queue and self._standby_waiting()
                        and (not self._closing or self._drain)):
                    expired = self._take_standby()  # draining, too: what waits there was sent before close()
            if expired:
                self._reject_standby(expired)
                continue
            with self._cond:
                standby = False
                while self._running or (not self._queue and not self._closing):
                    if not self._running and self._standby_waiting():
                        standby = True  # take from it (at the top of the loop)
                        break
                    if not self._running and self._refused is not None and not self._closing:
                        r = self._refused
                        seen = self._served.get((r.rows, seq_bucket(r.seq)), -math.inf)
                        # real batches measure its kind only while this lane still takes requests: one that took
                        # none for a probe interval is probed then, whatever ran before (a cold start's first
                        # samples, or a stall's, can put the tail over every budget, and nothing admitted means
                        # nothing measured)
                        now = _clock()
                        taking = now - self._t_admit < self.probe_interval_s
                        after = seen + self.probe_after_s if taking else -math.inf
                        due = max(self._t_probe + self.probe_interval_s, after) - now
                        if due <= 0:
                            probe, self._refused = self._refused, None
                            break
                        self._cond.wait(timeout=min(due, self.probe_interval_s))
                    else:
                        self._cond.wait()
                if standby:
                    continue
                if probe is not None:
                    if cancellable(self.run):
                        self._probing = RunCancel()  # planned as idle; stopped by what comes (``_insert``)
                    else:
                        self._running = True
                        self._mark_running(_clock(), probe.rows, probe.seq)
                elif not self._queue:  # closing: drained, or (without draining) emptied by close()
                    if self._drain and self._standby_waiting():
                        continue  # each entry is taken or expires at the top: the list empties
                    return
                else:
                    now = _clock()
                    try:
                        batch, wait = self._pick(now)
                    except Exception:  # a planning failure must not strand queued futures: serve the head alone
                        batch, wait = [self._queue[0][1]], 0.0
                    if wait < 0:
                        r = batch[0]
                        self._queue = [it for it in self._queue if it[1] is not r]
                        expected = self._plan_missed(r, now)
                        self._reject(r, DEADLINE, f"deadline in {(r.deadline - now) * 1e3:.1f} ms < expected "
                                                  f"{expected:.1f} ms on {self.name}")
                        continue
                    if not batch:
                        self._handoff_req = None  # held open on purpose: that wait is no hand-off
                        if self._standby_waiting() and self._join_standby(now):
                            continue
                        self._cond.wait(timeout=wait)
                        continue
                    chosen = set(map(id, batch))
                    if self._handoff_req is not None:
                        if id(self._handoff_req[0]) in chosen:
                            self._handoffs.append((now, (now - self._handoff_req[1]) * 1e3))
                        self._handoff_req = None
                    self._queue = [it for it in self._queue if id(it[1]) not in chosen]
                    for _, r in self._queue:  # left behind this batch: answered at their deadline if still here
                        self._watch(r)
                    self._current = batch
                    self._mark_running(now, sum(r.rows for r in batch), max(r.seq or 0 for r in batch) or None)
                    self._running = True
            try:
                if probe is not None:
                    if self._probe(probe, self._probing):
                        self.probes += 1
                    else:
                        self.probes_cut += 1
                    self._t_probe = _clock()
                else:
                    self._execute(batch)
                    self._current = []
                    self.batches += 1
            finally:
                with self._cond:
                    self._running = False
                    self._probing = None
                    self._busy_until = self._run_mid = self._run_dev = 0.0
                    self._cond.notify_all()

    def _cores(self) -> contextlib.AbstractContextManager:
        # around a real batch: the cores, shared with the variant's other instances, or alone for its fallback;
        # first it stops the other side's probes, which would hold the cores it waits for
        if self.share is None:
            return contextlib.nullcontext()
        for other in self.across:
            running = other._probing
            if running is not None:
                running.cancel()
        return self.share.exclusive() if self.alone_on_cores else self.share.shared()

    def _probe_cores(self) -> contextlib.AbstractContextManager:
        # around a probe: the cores if the other side neither runs nor waits now (yields True), else False at once
        if self.share is None:
            return contextlib.nullcontext(True)
        return self.share.exclusive(wait=False) if self.alone_on_cores else self.share.shared(wait=False)

    def _start(self, req: Request) -> bool:
        # the request's future is RUNNING from here (its caller's cancel() no longer stops it); one its caller
        # cancelled while it was queued is dropped unrun (a user's pass: cancel() returned True, yet every
        # cancelled request ran and was counted an answer within budget)
        if req.future.running() or req.future.set_running_or_notify_cancel():
            return True
        self.metrics.on_cancelled()
        return False

    def _execute(self, batch: list[Request], stoppable: bool = True, inline: bool = False) -> None:
        # ``stoppable=False``: a short run (``try_inline``'s), never worth binding a stop to; ``inline``: on a
        # caller's thread (observed in ``inline_profile``)
        if not inline:  # (an inline request's future is not handed out yet: nobody could have cancelled it)
            batch = [r for r in batch if self._start(r)]
            if not batch:
                return
        rows = sum(r.rows for r in batch)
        failed = None
        first, self._first_unobserved = self._first_unobserved, False
        # a long batch runs stoppable: ``close(drain=False)``, or a drain whose time is up, stops it (a short one
        # is waited for: binding the stop costs a run a few µs)
        cut = (RunCancel() if stoppable and self._cut_after_ms is not None and cancellable(self.run)
               and self.predict(rows, max(r.seq or 0 for r in batch) or None, k_dev=0.0) > self._cut_after_ms
               else None)
        if cut is not None:
            with self._cond:
                self._cutting = cut
                if self._closing and not self._drain:
                    cut.cancel()
        with self._cores(), (self._warm_gate.first_run() if first else contextlib.nullcontext()):
            # timed once the cores are this lane's: a wait for the other side is no service time
            t0 = _clock()
            try:
                feed, seq = self.layout.stack([r.feed for r in batch])
                outputs = self.run(feed) if cut is None else self.run(feed, cancel=cut)
                parts = self.layout.split(outputs, [r.feed for r in batch])
                error = None
            except RunCancelled:  # stopped by close: nothing observed; its requests are refused "shutdown"
                with self._cond:
                    self._cutting = None
                self._reject_shutdown(batch, f"stopped while running on {self.name}: the session closed without "
                                             "draining")
                return
            except Exception as e:  # a backend failure fails this batch only; the lane keeps serving
                failed = e
            t1 = _clock()
        if cut is not None:
            with self._cond:
                self._cutting = None
        if failed is not None:
            if len(batch) > 1:  # one bad request must not fail its batch-mates: each runs alone once more
                for r in batch:
                    self._execute([r])
                return
            parts, seq = [{} for _ in batch], None
            e = failed
            error = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300] if str(e).strip() else ''}"
        if error is None and not first:  # a backend's first run allocates: it says nothing of the next ones
            (self.inline_profile if inline else self.profile).observe(rows, seq, (t1 - t0) * 1e3, t1)
            self._served[(rows, seq_bucket(seq))] = t1
        for r, part in zip(batch, parts):
            self._answer(r, Result(r.id, part, (t1 - r.t_submit) * 1e3, (t0 - r.t_submit) * 1e3, rows, self.name,
                                   r.budget_ms, error), inline)

    # -- shutdown ---------------------------------------------------------------------------------------------
    def close(self, drain: bool = True, timeout_s: float | None = None) -> None:
        """Stop admitting; run (drain) or reject ("shutdown") what is queued; wait for the worker to finish.
        Draining, the lane also takes from its variant's standby list what can still make its deadline (the rest
        expires, "overload"), as when open.

        After ``timeout_s`` of draining (at once, without draining), whatever is still queued is rejected with
        "shutdown" then, not after the batch running meanwhile (a long one held a 1 s drain timeout for 9 s); that
        batch, too, is stopped then when it runs stoppable (``cut_after_ms``).
        """
        self.begin_close(drain)
        self._thread.join(timeout_s)
        self.stop_draining()
        self._thread.join()
        self.release()

    def release(self) -> None:
        """After the worker ended: drop the backend (an ONNX Runtime session, its memory and intra-op threads), so
        it goes with the caller's last reference to it, not with the lane, which metrics() still reads."""
        if not self._thread.is_alive():
            self.run = _closed_run

    def begin_close(self, drain: bool = True) -> None:
        """The first step of ``close``: stop admitting, and without ``drain`` reject what is queued; returns at
        once (``stop_draining`` and a join of ``thread`` finish it)."""
        with self._cond:
            self._closing = True
            self._drain = drain
            pending = [] if drain else self._take_queue()
            if self._probing is not None:  # nobody waits for a probe: closing does not either
                self._probing.cancel()
            if not drain and self._cutting is not None:  # nor, without draining, for a long batch
                self._cutting.cancel()
            self._cond.notify_all()
        self._reject_shutdown(pending)

    def stop_draining(self) -> None:
        """A drain's time is up: reject what is still queued ("shutdown") now; the running batch finishes, unless
        it runs stoppable (``cut_after_ms``): it is stopped."""
        if not self._thread.is_alive():
            return
        with self._cond:
            self._drain = False
            pending = self._take_queue()
            if self._cutting is not None:  # a long batch still running: stopped too
                self._cutting.cancel()
            self._cond.notify_all()
        self._reject_shutdown(pending)

    @property
    def thread(self) -> threading.Thread:
        return self._thread

    def _take_queue(self) -> list[Request]:
        # under self._cond, with _closing set and _drain not: nothing can be queued after this (enqueue refuses a
        # closing lane, and only a draining one takes from the standby list), so the worker never runs it
        pending = [r for _, r in self._queue]
        self._queue.clear()
        return pending

    def _reject_shutdown(self, pending: list[Request], why: str = "session closed before this request ran") -> None:
        # from the closing thread, while a batch may still run: answered "shutdown" now, not after it
        for r in pending:
            self._reject(r, SHUTDOWN, why)


def _margin(times: tuple[float, float], slow: float) -> tuple[float, float]:
    # a batch's (expected, tail) ms as a plan counts it: (expected s, tail margin s), scaled by the caller's extra
    # CPU use now (``slow``, runtime/caller_load.py); (inf, 0) when nothing is known
    mid, tail = times
    k = slow / 1e3
    return (mid * k, max(tail - mid, 0.0) * k) if math.isfinite(mid) else (math.inf, 0.0)


def _spent(t0: float, now: float) -> str:
    # what a refusal's budget had lost before admission (a first submit builds the lanes: 1.5-3 ms), when it shows
    spent = (now - t0) * 1e3
    return f" ({spent:.1f} ms of it spent before admission)" if spent >= 0.5 else ""


def _closed_run(feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    raise SessionClosedError("this lane is closed: its backend was released", "load the bundle again")


def _instance_groups(lanes: Sequence[Lane], standby: bool = True) -> list[list[Lane]]:
    """``lanes`` split into runs of one variant's instances (consecutive lanes sharing a profile), in order; with
    ``standby``, each run but a fallback's shares one standby list (runtime/standby.py), kept if it had one. A
    variant's fallback and its instances take turns on the cores (runtime/core_share.py)."""
    groups: list[list[Lane]] = []
    for lane in lanes:
        if groups and groups[-1][0].profile is lane.profile:
            groups[-1].append(lane)
        else:
            groups.append([lane])
    for group in groups:
        shared = None
        if standby and not group[0].fallback:
            shared = next((l.standby for l in group if l.standby is not None), None)
            shared = (Standby(group[0].max_queue, on_expire=group[0]._reject_standby) if shared is None
                      else shared)
        for lane in group:
            lane.standby = shared
            lane.siblings = () if lane.fallback else tuple(l for l in group if l is not lane)
    for group in groups:  # a fallback and the instances of its variant take turns on the cores
        if group[0].fallback:
            inst = next((g for g in groups if not g[0].fallback and g[0].name == group[0].name and len(g) > 1), None)
            if inst is None:
                continue
            share = next((l.share for l in inst + group if l.share is not None), None) or CoreShare()
            for lane in inst:
                lane.share, lane.across, lane.alone_on_cores = share, tuple(group), False
            for lane in group:
                lane.share, lane.across, lane.alone_on_cores = share, tuple(inst), True
    return groups


def _join_key(lane: Lane) -> tuple:
    # join-the-shortest-queue order: requests queued plus the running batch; among equals, the instance whose
    # running batch is expected to end first (idle ones count 0, so light load stays on the first instance). A
    # probe counts as a batch that ends at once: an idle instance goes first (stopping a probe waits for the kernel
    # it is in: 75-85 ms of one 16 x 1024-token MatMul in the tests), then the probing one, then a running one
    probing = lane._probing is not None
    return (lane.outstanding + probing, lane._run_mid if lane._running else 0.0)


def restate(others: Sequence[tuple["Request", Plan]]) -> None:
    """After an admission, each queued request is scored against the plan that now holds for it (the one its
    admission made no longer does once a later request joins its batch), so that the calibration measures
    prediction error, not the planned effect of admitting more."""
    for r, p in others:
        if r.plan_ms > 0.0:
            r.plan_ms, r.spread_ms, r.ahead = (p.expected - r.t_submit) * 1e3, p.spread * 1e3, p.ahead


class BudgetScheduler:
    """Admission control and cascade over one or more lanes (primary variant first, cheaper ones after).

    Args:
        lanes: ``Lane`` objects; ``lanes[0]`` serves the session's variant, the others are cascade candidates
            tried in order (``add_lanes`` appends more once they are open).
        layout: the model's ``BatchLayout`` (shared by all variants).
        metrics: where every request's fate is counted.
        standby: each variant's instances share a standby list (runtime/standby.py); False: refusals at once.
        standby_guard_z: with a standby list, added to the calibrated z of plans behind other batches (see the
            module doc); 0: none.
        caller_weight: how much a core of the calling thread's CPU use slows a batch (``CallerLoad``: plans are
            scaled while the caller works more than over the profile's horizon); 0: not counted.
        overload_cold_z: the z of a plan behind other batches whose stratum has no calibration yet, while arrivals
            (``ArrivalRate``) exceed what the variant's unpaused instances serve at batch 1 (see the module doc);
            None: the calibration's ``default_z`` then too.
    """

    def __init__(self, lanes: Sequence[Lane], layout: BatchLayout, metrics: StreamMetrics,
                 standby: bool = True, standby_guard_z: float = 1.0, caller_weight: float = 0.0,
                 overload_cold_z: float | None = 3.0) -> None:
        if not lanes:
            raise ValueError("BudgetScheduler needs at least one lane")
        self.lanes = list(lanes)
        self.standby = bool(standby)
        self.standby_guard_z = float(standby_guard_z)
        self.caller = CallerLoad(caller_weight)
        self.arrivals = ArrivalRate()
        self.overload_cold_z = overload_cold_z
        self.deadlines = DeadlineWatch()
        self.deadlines.start()  # now, while the lanes' workers still wait for their start (deadline_watch.py)
        self._groups = self._wire(_instance_groups(self.lanes, self.standby))  # once per lane set: submit is hot
        self.layout = layout
        self.metrics = metrics
        self._ids = itertools.count()
        self._closed = False

    def set_lanes(self, lanes: Sequence[Lane]) -> None:
        """Replace the lanes (the primary stays first); submitters see the new list at their next request."""
        lanes = list(lanes)
        self._groups, self.lanes = self._wire(_instance_groups(lanes, self.standby)), lanes

    def _wire(self, groups: list[list[Lane]]) -> list[list[Lane]]:
        # each instance lane reads the flood condition of its own variant's instances (``Lane.flooded``)
        for group in groups:
            for lane in group:
                lane.flooded = functools.partial(self._flooded, group=group)
                lane.deadlines = self.deadlines
        return groups

    def submit(self, feed: dict[str, np.ndarray], budget_ms: float, priority: int = 0, id: Any = None,
               arrived: float | None = None) -> Future:
        """Admit or reject one validated request; returns a Future resolving to ``Result`` or ``Rejected``.
        ``arrived``: when the caller handed it over (``time.perf_counter()`` s; default now): its latency and
        deadline count from there (a first ``Session.submit`` builds the streaming core before it gets here).

        Raises:
            RuntimeError: after ``close()`` (callers turn it into their own error type).
        """
        now = _clock()
        if self._closed:
            raise RuntimeError("scheduler is closed")
        t0 = now if arrived is None else min(arrived, now)
        rid = next(self._ids) if id is None else id
        layout = self.layout
        rows, seq = layout.rows(feed), layout.seq_len(feed)
        req = Request(rid, feed, rows, seq, layout.group_key(feed), budget_ms, priority, t0, t0 + budget_ms / 1e3)
        self.metrics.on_submit()
        self.arrivals.add(now, rows)
        slow = self.caller.factor()
        groups = self._groups
        first = groups[0][0]
        reasons = []
        idle_tail_at = -1  # len(reasons) after a refusal on an idle instance at its tail (not the fallback's to take)
        wait_on = None  # (lane, last start s): the standby list to wait on if every lane refuses for overload
        for group in groups:
            lane = group[0]  # the instances of one variant share its profile and calibration
            if lane.fallback and not (reasons and reasons[-1][0] == BUDGET and len(reasons) != idle_tail_at):
                continue  # the variant's fallback backend takes only what its instances are too slow for alone
            if lane.paused:  # the first lane of a group pauses only when the whole group does (a fallback)
                continue
            if all(l.failed for l in group):
                reasons.append((SHUTDOWN, f"the worker thread of {lane.name} failed ({lane.failed}); load the "
                                          "bundle again"))
                continue
            if lane is first and lane.try_inline(req, now):  # before the worker's profile can refuse it: see there
                return req.future
            times = lane.profile.times(req.rows, req.seq)  # (expected, tail) ms: the tail is alone_ms
            alone = times[1]
            if lane.fallback and math.isinf(alone):
                continue  # not timed yet (profile="measure", its warm-up still on): the instances' refusal stands
            cold = None
            plan = None
            if math.isinf(alone):  # nothing known yet (no seed, warm-up still running): queued, own deadline
                if budget_ms <= lane.margin_s * 1e3:
                    reasons.append((BUDGET, f"budget {budget_ms:g} ms is within the scheduling margin of "
                                            f"{lane.margin_s * 1e3:g} ms on {lane.name}"))
                    continue
                cold = lane.max_queue
                lane = min((l for l in group if not l.paused), key=lambda l: l.outstanding)
            elif alone + lane.margin_s * 1e3 > budget_ms:
                lane.refused(req)
                margin = f" + {lane.margin_s * 1e3:g} ms margin" if lane.margin_s else ""
                where = f"{lane.name}'s fallback backend" if lane.fallback else lane.name
                reasons.append((BUDGET, f"predicted {alone:.1f} ms alone on {where}{margin} > budget "
                                        f"{budget_ms:.4g} ms"))
                continue
            else:
                room = [l for l in group if l.depth < l.max_queue and not l.paused and not l.failed]
                if not room:
                    # each instance has a queue of its own, of max_queue (the variant queues up to N x max_queue)
                    full = (f"queue of {lane.name} full ({lane.max_queue} requests)" if len(group) == 1 else
                            f"queues of {lane.name}'s {len(group)} instances full ({lane.max_queue} requests each)")
                    reasons.append((OVERLOAD, full))
                    continue
                # join the shortest queue (requests queued plus the running batch; ties: the instance expected to
                # free first, idle ones as the first instance, so light load stays on one and its batches fill)
                # whose plan meets the deadline (``_join_key``). Not the earliest
                # planned completion: beyond ``plan_limit`` a plan is a closed-form estimate, optimistic when
                # lengths differ, and a burst of 300 mixed-length requests all went to the one instance whose
                # long queue that estimate flattered (98 of its 180 then dropped at their deadline)
                best = None
                prior = self._cold_prior(now, rows, alone, group)
                for inst in sorted(room, key=_join_key):
                    p = inst.plan(req, now, functools.partial(self._plan_z, inst, now, prior), slow,
                                  times if inst.profile is lane.profile else None)
                    if best is None or p.done < best[1].done:
                        best = (inst, p)
                    if p.done <= req.deadline:
                        break
                inst, plan = best
                done = plan.done
                if done > req.deadline:
                    req.plan_ms = req.spread_ms = 0.0
                    lane.refused(req)  # an idle lane re-measures it: a stale estimate cannot keep refusing
                    where = f"{lane.name}'s fallback backend" if lane.fallback else lane.name
                    if (plan.ahead == 0 and inst.outstanding == 0 and not any(o._running for o in inst.across)
                            and (lane.standby is None or lane.last_start(req) <= now)):
                        # nothing runs or waits there, and its own batch misses at the profile's tail, alone (its
                        # last start has passed: the standby list would refuse it at once too). The caller can act
                        # on "budget" (a larger one), not on "overload" (backing off changes nothing). It is not
                        # offered to the fallback lane, as it was not before (that rule is for requests too slow at
                        # the median). A miss from the caller's CPU load (``slow``) keeps the standby list's wait
                        said = f"{(done - now) * 1e3:.1f} ms" if not math.isinf(done) else "its batch"
                        reasons.append((BUDGET, f"predicted {said} alone on idle {where} at its tail > budget "
                                                f"{budget_ms:g} ms{_spent(t0, now)}"))
                        idle_tail_at = len(reasons)
                        continue
                    said = (f"predicted {(done - now) * 1e3:.1f} ms" if not math.isinf(done)
                            else "no batch meets its deadline and those queued before it")
                    reasons.append((OVERLOAD, f"{said} with {inst.depth} queued on {where} > budget "
                                              f"{budget_ms:g} ms{_spent(t0, now)}"))
                    if wait_on is None and lane.standby is not None:
                        wait_on = (lane, lane.last_start(req))
                    continue
                if inst.profile.measured or not inst.profile.scale_seeds:
                    # a plan on seeds still waiting to be scaled to this machine says nothing about the profile's
                    # error: not scored (two such cold residuals of 8–13 held z at its cap for the first 2 s,
                    # refusing requests a 54 ms budget had room for)
                    req.plan_ms, req.spread_ms = (plan.expected - now) * 1e3, plan.spread * 1e3
                    req.ahead = plan.ahead
                lane = inst
            if lane.enqueue(req, cold):
                if plan is not None:
                    restate(plan.others)
                if lane.name != first.name:
                    self.metrics.on_cascade(lane.name)
                return req.future
            if self._closed:  # close() began while this request was being admitted
                reasons = [(SHUTDOWN, "session closed while admitting this request")]
                break
            reasons.append((OVERLOAD, f"queue of {lane.name} full" + (" while it warms up" if cold else "")))
        # the reason the caller can act on: "budget" only when no lane could meet it even alone
        reason, _ = next(((r, d) for r, d in reasons if r in (OVERLOAD, SHUTDOWN)), reasons[0])
        if reason == OVERLOAD and wait_on is not None and wait_on[1] > _clock() and not self._closed:
            # refused only for what runs ahead of it: it waits, unadmitted, for an instance that frees in time
            lane = wait_on[0]
            pushed = lane.standby.add(req, wait_on[1], "; ".join(d for _, d in reasons))
            if pushed:
                lane._reject_standby(pushed)
            if self._closed:  # close() drained the list meanwhile
                self._drain_standby()
            for inst in next(g for g in groups if g[0] is lane):
                if not inst._running:  # it may have gone idle since its plan: it takes from the list
                    with inst._cond:
                        inst._cond.notify()
            return req.future
        rej = Rejected(rid, reason, "; ".join(d for _, d in reasons), req.budget_ms, (_clock() - now) * 1e3)
        req.future.set_running_or_notify_cancel()
        req.future.set_result(rej)
        self.metrics.on_answer(rej)
        return req.future

    def _flooded(self, now: float, rows: int, alone_ms: float, group: Sequence[Lane]) -> bool:
        # arrivals (``ArrivalRate``) exceed what the unpaused instances of the variant serve at batch 1
        # (``alone_ms`` for ``rows`` rows); False while the rate is not known yet
        rate = self.arrivals.rows_per_s(now)
        if rate is None:
            return False
        serving = max(1, sum(1 for l in group if not l.paused))
        return rate * alone_ms / (1e3 * max(rows, 1) * serving) > 1.0

    def _cold_prior(self, now: float, rows: int, alone_ms: float, group: Sequence[Lane]) -> float | None:
        # ``overload_cold_z`` while arrivals exceed what the unpaused instances of the variant serve at batch 1
        # (``alone_ms`` for this request's ``rows``), else None (the calibration's own default)
        if self.overload_cold_z is None:
            return None
        return self.overload_cold_z if self._flooded(now, rows, alone_ms, group) else None

    def _plan_z(self, lane: Lane, now: float, prior: float | None, ahead: int) -> float:
        # the calibrated z of the plan's stratum (``prior`` while a stratum behind other batches has none yet and
        # arrivals exceed the instances: ``_cold_prior``); behind other batches, with a standby list,
        # ``standby_guard_z`` more: a request the plan refuses is not lost there (it waits for an idle instance,
        # where it is planned at the profile's own tail), so admission behind running work can be stricter than
        # the calibration's level, whose misses come in clusters it follows late (module doc)
        z = lane.calibration.z(now, ahead, prior)
        return z + self.standby_guard_z if ahead >= 1 and lane.standby is not None else z

    def close(self, drain: bool = True, timeout_s: float | None = None) -> None:
        """Stop admitting, then drain or reject each lane's queue (see ``Lane.close``); what still waits on a
        standby list afterwards (or at once, without ``drain``) is rejected "shutdown"."""
        self._closed = True
        if not drain:
            self._drain_standby()
        # every lane stops admitting at once and drains side by side; at the deadline every lane still draining
        # stops together (lane by lane, the others kept starting queued batches while one finished its own)
        deadline = None if timeout_s is None else _clock() + timeout_s
        for lane in self.lanes:
            lane.begin_close(drain)
        for lane in self.lanes:
            lane.thread.join(None if deadline is None else max(0.0, deadline - _clock()))
        for lane in self.lanes:
            lane.stop_draining()
        for lane in self.lanes:
            lane.thread.join()
            lane.release()
        self.deadlines.close()
        self._drain_standby()  # what no draining instance took or expired (timed out, or only paused ones)
        for group in self._groups:
            if group[0].standby is not None:
                group[0].standby.close()  # its expiry thread

    def _drain_standby(self) -> None:
        for group in self._groups:
            if group[0].standby is not None:
                for req, _ in group[0].standby.drain():
                    group[0]._reject(req, SHUTDOWN, "session closed before this request ran (on standby)")

    @property
    def closed(self) -> bool:
        return self._closed
