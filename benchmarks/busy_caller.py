"""A small model streamed from a Python caller that does its own work per request: ``submit`` vs a plain ``run()``
loop, side by side on the same schedule.

    python benchmarks/busy_caller.py --bundle out/fraud/bundles/student-cpu/student-run-cpu.dse   # ~2 min

The fraud scorer's case: one thread reads transactions, builds features (Python work that holds the interpreter
lock) and hands each to the model with a 3 ms budget, never waiting for the answer (open loop). A plain loop that
calls ``session.run`` itself is the reference a user compares with: its capacity (1 / (caller work + batch-1 run))
is the batch-1 capacity here (measured back to back before each caller work), and loads are multiples of it. Conditions:
  * cold: each window opens its session right before it (``dsedge.load``, no ``warmup()``);
  * open-loop arrivals (Poisson plus, every 0.5 s, a burst of 20 % extra load within 50 ms; benchmarks/streaming.py),
    the same schedule for both; a request's latency counts from its scheduled arrival;
  * the caller spins ``--work-us`` per request before handing it over (its Python work);
  * a noisy neighbour: one CPU burner process for 1 s in the middle of every window.
Reported per caller work and load: in budget of offered, p99 of answered, and dsedge's rejections by reason and
how many of its runs were on the caller's thread (``inline``). Timings on a shared machine are noisy: compare the
two servers within one row.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from streaming import arrivals, cpu_line, open_loop  # noqa: E402

_clock = time.perf_counter


def spin(us: float) -> None:
    """Hold the interpreter for ``us`` microseconds (the caller's own work)."""
    t_end = _clock() + us * 1e-6
    while _clock() < t_end:
        pass


def plain_capacity(bundle: str, feed: dict, work_us: float, threads: int, n: int = 3000) -> float:
    """Requests/s the plain loop serves back to back (its work, ``run``, the time stamp), measured now."""
    import dsedge

    s = dsedge.load(bundle, threads=threads)
    for _ in range(100):
        s.run(feed)
    t0 = _clock()
    for _ in range(n):
        spin(work_us)
        s.run(feed)
        _ = (_clock() - t0) * 1e3
    rate = n / (_clock() - t0)
    s.close()
    return rate


def window(bundle: str, schedule: np.ndarray, feed: dict, work_us: float, budget_ms: float, mode: str,
           threads: int) -> dict:
    """One cold window: ``mode`` "plain" (the caller runs each request itself) or "dsedge" (``submit``)."""
    import dsedge

    n = len(schedule)
    lat = np.full(n, np.nan)
    kinds: list = [None] * n
    s = dsedge.load(bundle, threads=threads)

    def record(i: int, f) -> None:  # a done-callback: the answer's time, then its kind
        lat[i] = (_clock() - t0 - schedule[i]) * 1e3
        r = f.result()
        kinds[i] = "ok" if r.ok else f"rejected:{r.reason}" if hasattr(r, "reason") else "error"

    def send(i: int) -> None:
        spin(work_us)
        if mode == "plain":
            s.run(feed)
            lat[i] = (_clock() - t0 - schedule[i]) * 1e3
            kinds[i] = "ok"
        else:
            s.submit(feed, budget_ms=budget_ms).add_done_callback(lambda f, i=i: record(i, f))

    t0 = _clock()  # (open_loop's own start, within µs)
    open_loop(schedule, send, stall=(float(schedule[-1]) / 2 - 0.5, 1.0), burner_procs=1)
    t_end = _clock() + 30
    while any(k is None for k in kinds) and _clock() < t_end:
        time.sleep(0.01)
    inline = 0
    if mode == "dsedge":
        inline = sum(v.get("inline", 0) for v in s.metrics()["lanes"].values())
    s.close()
    ok = np.array([k == "ok" for k in kinds])
    within = ok & (lat <= budget_ms)
    return {"offered": n, "in_budget": int(within.sum()), "in_budget_share": round(float(within.mean()), 4),
            "p99_ms": round(float(np.percentile(lat[ok], 99)), 3) if ok.any() else None,
            "rejected": dict(Counter(k for k in kinds if k and k.startswith("rejected"))), "inline": inline}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bundle", required=True, help="a .dse bundle of a small model (the fraud scorer's)")
    ap.add_argument("--work-us", default="50,200", help="the caller's Python work per request, µs")
    ap.add_argument("--loads", default="0.25,0.5", help="multiples of the plain loop's capacity")
    ap.add_argument("--budget-ms", type=float, default=3.0)
    ap.add_argument("--duration-s", type=float, default=4.0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    try:
        works = [float(w) for w in args.work_us.split(",")]
        loads = [float(x) for x in args.loads.split(",")]
    except ValueError:
        ap.error("--work-us and --loads take comma-separated numbers, e.g. --work-us 50,200 --loads 0.25,0.5")
    if min(works) < 0 or min(loads) <= 0 or args.duration_s <= 0 or args.budget_ms <= 0:
        ap.error("--work-us must be >= 0; --loads, --duration-s and --budget-ms > 0")
    if not Path(args.bundle).exists():
        sys.exit(f"busy_caller.py: bundle {args.bundle} does not exist (python -m samples.fraud.run builds it)")
    import dsedge
    from dsedge.runtime.bench import synthetic_inputs

    print(cpu_line())
    probe = dsedge.load(args.bundle, threads=args.threads)
    feed = synthetic_inputs(probe.inputs, probe.manifest.shape_ranges, batch=1, seed=args.seed)
    for _ in range(200):
        probe.run(feed)
    times = []
    for _ in range(2000):
        t = _clock()
        probe.run(feed)
        times.append(_clock() - t)
    probe.close()
    run_ms = float(np.median(times)) * 1e3
    print(f"# run() batch 1: p50 {run_ms * 1e3:.1f} µs; budget {args.budget_ms:g} ms; {args.duration_s:g} s "
          f"windows, cold; a 1 s CPU burner mid-window")
    print(f"{'work µs':>8} {'load':>5} {'rate/s':>7} | {'plain in budget':>15} {'p99 ms':>7} | "
          f"{'dsedge in budget':>16} {'p99 ms':>7} {'inline':>7}  rejected")
    rows = []
    rng = np.random.default_rng(args.seed)
    for work in works:
        capacity = plain_capacity(args.bundle, feed, work, args.threads)
        for load in loads:
            rate = load * capacity
            sched = arrivals(rate, args.duration_s, rng)
            got = {m: window(args.bundle, sched, feed, work, args.budget_ms, m, args.threads)
                   for m in ("plain", "dsedge")}
            p, d = got["plain"], got["dsedge"]
            print(f"{work:8.0f} {load:5.2f} {rate:7.0f} | {100 * p['in_budget_share']:14.1f}% {p['p99_ms']:7.2f} | "
                  f"{100 * d['in_budget_share']:15.1f}% {d['p99_ms'] or float('nan'):7.2f} {d['inline']:7d}  "
                  f"{d['rejected'] or '-'}", flush=True)
            rows.append({"work_us": work, "load": load, "rate": round(rate, 1), **got})
    if args.json:
        Path(args.json).write_text(json.dumps({"run_us": run_ms * 1e3, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
