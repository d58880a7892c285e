"""Streaming with latency budgets, side by side in one run: dsedge's scheduler vs no batching vs a Triton-style
dynamic batcher, under open-loop bursty arrivals at 0.5×, 0.9× and 1.5× measured capacity.

    python benchmarks/streaming.py --bundle out/all-minilm-l6-v2-cpu.dse --budget-ms 100 --duration-s 20
    python benchmarks/streaming.py --small                 # a tiny text model built here (no bundle needed)

Arrivals: a Markov-modulated Poisson process — a base rate, plus bursts (by default 10 % of the time at 3× the
base rate, ~100 ms each) — with the same mean rate and the same pre-drawn schedule for every server. Requests are single
sentences of random token ids, lengths uniform in [--min-seq, --max-seq].
Capacity (1×) = the best rows/s of the backend itself over batch sizes 1…max_batch on such sentences.

Servers (all over the same ONNX Runtime session, one at a time):
  * ``none``: FIFO, one request per run; a request whose deadline has passed when it reaches the head is
    rejected instead of run (Triton's timeout-reject queue policy).
  * ``triton-D``: Triton's dynamic batcher as documented (preferred batch size = max batch, fixed max queue delay
    D ms, timeout reject at the budget, bounded queue), with dsedge's same padding to batch ragged sentences.
  * ``dsedge``: ``Session.submit`` (EDF, budget-aware batch size, admission control).
Reported per server and load: goodput (answers within budget per second of the arrival window), p99 of answered
requests, rejection rate (refused at admission) and miss rate (admitted but not answered within budget).
Timings on a shared machine are noisy: compare the ratios inside one run.
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import threading
import time
from collections import deque
from concurrent.futures import Future
from pathlib import Path

import numpy as np

import dsedge
from dsedge.runtime.batching import BatchLayout

_clock = time.perf_counter


# --- load ------------------------------------------------------------------------------------------------------
def arrivals(rate: float, duration_s: float, rng: np.random.Generator, burst_frac: float = 0.1,
             burst_x: float = 3.0, burst_s: float = 0.1) -> np.ndarray:
    """Arrival times (s) of a Poisson process with bursts whose mean rate is ``rate`` per second."""
    base = rate / (1.0 - burst_frac + burst_frac * burst_x)
    times, t, in_burst = [], 0.0, False
    # alternate exponential sojourns: mean burst_s in a burst, burst_s·(1−f)/f outside
    state_end = rng.exponential(burst_s * (1 - burst_frac) / burst_frac)
    while t < duration_s:
        r = base * (burst_x if in_burst else 1.0)
        t_next = t + rng.exponential(1.0 / r)
        if t_next >= state_end:
            t = state_end
            in_burst = not in_burst
            state_end = t + rng.exponential(burst_s if in_burst else burst_s * (1 - burst_frac) / burst_frac)
            continue
        t = t_next
        if t < duration_s:
            times.append(t)
    return np.asarray(times)


def make_requests(session: dsedge.Session, n: int, rng: np.random.Generator, vocab: int, min_seq: int,
                  max_seq: int) -> list[dict[str, np.ndarray]]:
    """``n`` one-row requests shaped like the session's inputs (ids random in [1, vocab), mask 1, types 0)."""
    out = []
    for _ in range(n):
        seq = int(rng.integers(min_seq, max_seq + 1))
        feed = {}
        for spec in session.inputs:
            dt = np.dtype(spec.dtype)
            shape = [1 if i == 0 else (seq if isinstance(d, str) else d) for i, d in enumerate(spec.shape)]
            if "mask" in spec.name:
                feed[spec.name] = np.ones(shape, dtype=dt)
            elif "type" in spec.name:
                feed[spec.name] = np.zeros(shape, dtype=dt)
            elif dt.kind in "iu":
                feed[spec.name] = rng.integers(1, vocab, size=shape).astype(dt)
            else:
                feed[spec.name] = rng.standard_normal(shape).astype(dt)
        out.append(feed)
    return out


def capacity_rows_per_s(run, layout: BatchLayout, pool, max_batch: int, repeats: int = 7) -> tuple[float, int]:
    """Best rows/s of ``run`` over batch sizes 1, 2, 4, … max_batch on ``pool`` requests (median of ``repeats``
    timed runs per size, so a burst of noise from other processes does not set the load levels)."""
    best, best_b = 0.0, 1
    sizes = sorted({min(1 << i, max_batch) for i in range(max_batch.bit_length() + 1)})
    for b in sizes:
        feed, _ = layout.stack(pool[:b])
        run(feed)
        times = []
        for _ in range(repeats):
            t0 = _clock()
            run(feed)
            times.append(_clock() - t0)
        rate = b / float(np.median(times))
        if rate > best:
            best, best_b = rate, b
    return best, best_b


# --- baselines -------------------------------------------------------------------------------------------------
class QueueBatcher:
    """The baselines: a bounded FIFO queue and one worker; ``max_batch=1`` is no batching.

    Triton's dynamic batcher: dispatch when ``preferred`` requests are queued, or when the oldest has waited
    ``max_delay_ms``; requests queued longer than their budget are rejected (timeout) instead of run.
    """

    def __init__(self, run, layout: BatchLayout, max_batch: int, max_delay_ms: float, max_queue: int,
                 preferred: int | None = None) -> None:
        self.run, self.layout = run, layout
        self.max_batch, self.preferred = max_batch, min(preferred or max_batch, max_batch)
        self.max_delay_s = max_delay_ms / 1e3
        self.max_queue = max_queue
        self.q: deque = deque()
        self.cond = threading.Condition()
        self.closing = False
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def submit(self, feed, budget_ms: float) -> Future:
        fut: Future = Future()
        now = _clock()
        with self.cond:
            if len(self.q) >= self.max_queue:
                fut.set_result(("rejected", 0.0))
                return fut
            self.q.append((now, now + budget_ms / 1e3, feed, fut))
            self.cond.notify()
        return fut

    def _loop(self) -> None:
        while True:
            with self.cond:
                while not self.q and not self.closing:
                    self.cond.wait()
                if not self.q:
                    return
                now = _clock()
                while self.q and self.q[0][1] < now:  # timeout reject
                    t_sub, _, _, fut = self.q.popleft()
                    fut.set_result(("timeout", (now - t_sub) * 1e3))
                if not self.q:
                    continue
                oldest_wait = now - self.q[0][0]
                if len(self.q) < self.preferred and oldest_wait < self.max_delay_s and not self.closing:
                    self.cond.wait(self.max_delay_s - oldest_wait)
                    continue
                batch = [self.q.popleft() for _ in range(min(self.max_batch, len(self.q)))]
            feed, _ = self.layout.stack([b[2] for b in batch])
            self.run(feed)
            done = _clock()
            for t_sub, deadline, _, fut in batch:
                fut.set_result(("answered", (done - t_sub) * 1e3))

    def close(self) -> None:
        with self.cond:
            self.closing = True
            self.cond.notify_all()
        self.thread.join()


class DsedgeServer:
    def __init__(self, session: dsedge.Session) -> None:
        self.session = session

    def submit(self, feed, budget_ms: float) -> Future:
        out: Future = Future()
        inner = self.session.submit(feed, budget_ms=budget_ms)

        def done(f: Future) -> None:
            r = f.result()
            if isinstance(r, dsedge.Rejected):
                out.set_result(("timeout" if r.reason == "deadline" else "rejected", r.latency_ms))
            else:
                out.set_result(("answered" if r.ok else "error", r.latency_ms))
        inner.add_done_callback(done)
        return out

    def close(self) -> None:
        pass


# --- one run ---------------------------------------------------------------------------------------------------
def drive(server, schedule: np.ndarray, pool, budget_ms: float) -> dict:
    """Submit ``pool[i % len(pool)]`` at ``schedule[i]`` (open loop) and tally the outcomes."""
    futures = []
    t0 = _clock()
    for i, t in enumerate(schedule):
        delay = t0 + t - _clock()
        if delay > 0:
            time.sleep(delay)
        futures.append(server.submit(pool[i % len(pool)], budget_ms))
    window = max(float(schedule[-1]) if len(schedule) else 0.0, 1e-9)
    outcomes = [f.result(timeout=120) for f in futures]
    lat = np.array([ms for kind, ms in outcomes if kind == "answered"])
    n = len(outcomes)
    rejected = sum(kind == "rejected" for kind, _ in outcomes)
    admitted = n - rejected
    within = int((lat <= budget_ms).sum()) if lat.size else 0
    return {
        "submitted": n, "admitted": admitted, "answered": int(lat.size), "within_budget": within,
        "goodput_per_s": round(within / window, 2),
        "p50_ms": round(float(np.percentile(lat, 50)), 2) if lat.size else None,
        "p99_ms": round(float(np.percentile(lat, 99)), 2) if lat.size else None,
        "rejection_rate": round(rejected / n, 4) if n else 0.0,
        "miss_rate": round((admitted - within) / admitted, 4) if admitted else 0.0,
        "admitted_within_budget": round(within / admitted, 4) if admitted else None,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--bundle", help="a .dse bundle with a dynamic batch axis (e.g. the MiniLM one)")
    src.add_argument("--small", action="store_true", help="build a tiny text model bundle here and use it")
    ap.add_argument("--variant", default=None)
    ap.add_argument("--budget-ms", type=float, default=None, help="one budget for all requests (default: bundle's)")
    ap.add_argument("--loads", default="0.5,0.9,1.5", help="multiples of measured capacity")
    ap.add_argument("--duration-s", type=float, default=10.0, help="arrival window per server and load")
    ap.add_argument("--max-batch", type=int, default=32)
    ap.add_argument("--max-queue", type=int, default=256)
    ap.add_argument("--triton-delays-ms", default="1,auto",
                    help="Triton max queue delays to try, ms ('auto' = 10 %% of the budget)")
    ap.add_argument("--triton-preferred", type=int, default=None, help="preferred batch size (default max batch)")
    ap.add_argument("--min-seq", type=int, default=8)
    ap.add_argument("--max-seq", type=int, default=48)
    ap.add_argument("--vocab", type=int, default=None, help="token ids drawn below this (default 30522; 100 --small)")
    ap.add_argument("--threads", type=int, default=None, help="ORT intra-op threads")
    ap.add_argument("--burst-x", type=float, default=3.0, help="arrival rate in a burst / base rate")
    ap.add_argument("--burst-s", type=float, default=0.1, help="mean burst length, s")
    ap.add_argument("--burst-frac", type=float, default=0.1, help="share of time in bursts")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args(argv)

    tmp = None
    if args.small:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
        from streaming_models import text_bundle  # the tests' tiny model builder (needs onnx)

        tmp = tempfile.TemporaryDirectory()
        bundle = text_bundle(Path(tmp.name), dim=512, variants={"fp32": 6}, name="toy-bench")
        vocab = args.vocab or 100
    else:
        bundle = args.bundle
        vocab = args.vocab or 30522

    session = dsedge.load(bundle, variant=args.variant, threads=args.threads, budget_ms=args.budget_ms,
                          max_batch=args.max_batch, max_queue=args.max_queue)
    budget = session.default_budget_ms()
    rng = np.random.default_rng(args.seed)
    pool = make_requests(session, 512, rng, vocab, args.min_seq, args.max_seq)
    layout = BatchLayout.of(session.inputs, session.outputs)
    max_batch = args.max_batch if layout.dynamic else 1
    run = session._backend.run
    cap, cap_b = capacity_rows_per_s(run, layout, pool, max_batch)
    session.warmup()

    import onnxruntime

    print(f"# streaming benchmark  {platform.node()}  {platform.processor() or platform.machine()}  "
          f"python {platform.python_version()}  onnxruntime {onnxruntime.__version__}  dsedge {dsedge.__version__}")
    print(f"# bundle {Path(str(bundle)).name}  variant {session.variant.name}  providers {session.providers}  "
          f"budget {budget:g} ms  capacity {cap:.0f} rows/s (batch {cap_b})  seq {args.min_seq}-{args.max_seq}  "
          f"window {args.duration_s:g} s per run  bursts {args.burst_x:g}x for ~{args.burst_s:g} s, "
          f"{100 * args.burst_frac:g} % of the time")
    delays = [0.1 * budget if d.strip() == "auto" else float(d) for d in args.triton_delays_ms.split(",") if d.strip()]
    results = []
    header = f"{'load':>5} {'server':<14} {'sent':>6} {'goodput/s':>10} {'p99 ms':>8} {'reject %':>9} {'miss %':>7} {'in-budget % of admitted':>24}"
    print(header)
    for load in [float(x) for x in args.loads.split(",")]:
        schedule = arrivals(load * cap, args.duration_s, np.random.default_rng(args.seed + int(load * 100)),
                            args.burst_frac, args.burst_x, args.burst_s)
        servers = [("none", lambda: QueueBatcher(run, layout, 1, 0.0, args.max_queue))]
        servers += [(f"triton-{d:g}ms", lambda d=d: QueueBatcher(run, layout, max_batch, d, args.max_queue,
                                                                 args.triton_preferred)) for d in delays]
        servers += [("dsedge", lambda: DsedgeServer(session))]
        for name, make in servers:
            server = make()
            row = drive(server, schedule, pool, budget)
            server.close()
            row.update(load=load, server=name)
            results.append(row)
            pct = (lambda x: f"{100 * x:.2f}" if x is not None else "-")
            print(f"{load:>5g} {name:<14} {row['submitted']:>6} {row['goodput_per_s']:>10.1f} "
                  f"{row['p99_ms'] if row['p99_ms'] is not None else '-':>8} {pct(row['rejection_rate']):>9} "
                  f"{pct(row['miss_rate']):>7} {pct(row['admitted_within_budget']):>24}", flush=True)
        m = session.metrics()
        print(f"{'':>5} dsedge so far: mean batch {m['mean_batch_size']}, rejected {m['rejected']}, "
              f"cascaded {m['cascaded']}")
        ours = next(r for r in results if r["load"] == load and r["server"] == "dsedge")
        tri = max((r for r in results if r["load"] == load and r["server"].startswith("triton")),
                  key=lambda r: r["goodput_per_s"])
        ratio = ours["goodput_per_s"] / tri["goodput_per_s"] if tri["goodput_per_s"] else float("inf")
        print(f"{'':>5} ratio dsedge/best triton goodput = {ratio:.2f}x  (triton miss {100 * tri['miss_rate']:.2f} %,"
              f" dsedge miss {100 * ours['miss_rate']:.2f} %)")
    session.close()
    if args.json:
        Path(args.json).write_text(json.dumps({"budget_ms": budget, "capacity_rows_per_s": cap, "results": results},
                                              indent=2) + "\n")
    if tmp is not None:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
