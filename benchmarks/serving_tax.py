"""What serving costs each run: the instances' batch-1 runs under dsedge's streaming, against the same runs back to
back in a loop on the same ONNX Runtime session, side by side in one process.

    python benchmarks/serving_tax.py --bundle out/all-minilm-l6-v2-cpu.dse   # ~1 min

benchmarks/streaming.py reads dsedge's goodput above 1x load as a batch-1 service time and finds it 1.1-1.4x the
instances' own (docs/streaming-runs.md); part of that is the runs themselves being slower while serving. This
benchmark measures that part. Per load (multiples of the batch-1 capacity, the 2-thread batch-1 p50 measured just
before, as streaming.py rebases), it opens the bundle cold (``dsedge.load``, no ``warmup()``), drives ``submit``
with streaming.py's open-loop bursty schedule at a budget of ``--budget-x`` times that p50, and records every run of
the served instances' workers (not the fallback lane's, nor a run inline on the caller's thread): wall ms, the
running thread's CPU ms (``time.thread_time``: ``getrusage``'s times come in scheduler ticks), and how often the OS
preempted it during the run (involuntary context switches, ``RUSAGE_THREAD``). Right after, the same session's
instances run batch 1 back to back on two threads pinned as the lanes' workers were, for ``--loop-s``. Reported side
by side: p50/p98 of wall and CPU in both, serving / loop ratios, CPU p50 of the serving runs never preempted (what
is left when the OS took no core), and per thread of the process the CPU it used and its voluntary / involuntary
switches per 1000 requests (which threads wake, and how often the run threads lose their core).

Linux only (``RUSAGE_THREAD``, ``/proc/self/task``). The timing wrapper is installed around
``OrtBackend.run`` for the serving window and the loop alike, so both pay its clock and ``getrusage`` calls.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from streaming import DsedgeServer, arrivals, cpu_line, drive, host_b1_ms, make_requests  # noqa: E402

_clock = time.perf_counter


class RunLog:
    """Every ``OrtBackend.run`` of the process while installed: (thread name, rows, wall ms, thread CPU ms,
    preemptions)."""

    def __init__(self) -> None:
        self.rows: list[tuple[str, int, float, float, int]] = []
        self._orig = None

    def install(self) -> None:
        from dsedge.runtime.backends.ort import OrtBackend

        orig = self._orig = OrtBackend.run
        log = self.rows

        def run(backend, inputs, cancel=None):
            n0 = resource.getrusage(resource.RUSAGE_THREAD).ru_nivcsw
            c0, t0 = time.thread_time(), _clock()
            out = orig(backend, inputs, cancel)
            wall, cpu = _clock() - t0, time.thread_time() - c0
            n1 = resource.getrusage(resource.RUSAGE_THREAD).ru_nivcsw
            rows = int(next(iter(inputs.values())).shape[0]) if inputs else 0
            log.append((threading.current_thread().name, rows, wall * 1e3, cpu * 1e3, n1 - n0))
            return out
        run.takes_cancel = True  # runtime/run_cancel.py reads it
        OrtBackend.run = run

    def uninstall(self) -> None:
        from dsedge.runtime.backends.ort import OrtBackend

        if self._orig is not None:
            OrtBackend.run = self._orig

    def take(self, prefix: str = "", rows: int = 1) -> np.ndarray:
        """(wall, cpu, preemptions) of the logged runs of ``rows`` rows on threads named ``prefix``… (not a
        fallback lane's), and clear the log."""
        got = np.array([r[2:] for r in self.rows if r[1] == rows and r[0].startswith(prefix)
                        and not r[0].endswith("-fallback")], dtype=float).reshape(-1, 3)
        self.rows.clear()
        return got


def thread_counters() -> dict[int, tuple[str, float, int, int]]:
    """tid -> (name, CPU ms, voluntary, involuntary switches) of this process's threads, from /proc (the CPU in
    scheduler ticks, 10 ms each where ``SC_CLK_TCK`` is 100: a total over the window, not per run)."""
    out, ticks = {}, os.sysconf("SC_CLK_TCK")
    for tid in os.listdir("/proc/self/task"):
        try:
            stat = Path(f"/proc/self/task/{tid}/stat").read_text()
            status = Path(f"/proc/self/task/{tid}/status").read_text()
        except OSError:  # the thread ended meanwhile
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        cpu_ms = (int(fields[11]) + int(fields[12])) * 1e3 / ticks
        vol = int(status.split("\nvoluntary_ctxt_switches:")[1].split()[0])
        invol = int(status.split("nonvoluntary_ctxt_switches:")[1].split()[0])
        out[int(tid)] = (stat[stat.index("(") + 1:stat.rindex(")")], cpu_ms, vol, invol)
    return out


def loop_runs(lanes, pool, seconds: float) -> None:
    """Batch 1 back to back on each served instance's backend, one thread each, pinned as its worker was."""
    stop = _clock() + seconds

    def work(lane, k: int) -> None:
        if lane.cpus:
            os.sched_setaffinity(0, lane.cpus)
        i = k
        while _clock() < stop:
            lane.run(pool[i % len(pool)])
            i += 2
    threads = [threading.Thread(target=work, args=(lane, k), name=f"serving-tax-loop-{k}")
               for k, lane in enumerate(lanes)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def summary(a: np.ndarray) -> dict:
    if not len(a):
        return {"runs": 0}
    calm = a[a[:, 2] == 0]
    return {"runs": int(len(a)), "wall_p50_ms": round(float(np.median(a[:, 0])), 3),
            "wall_p98_ms": round(float(np.percentile(a[:, 0], 98)), 3),
            "cpu_p50_ms": round(float(np.median(a[:, 1])), 3),
            "cpu_p98_ms": round(float(np.percentile(a[:, 1], 98)), 3),
            "preempted_per_run": round(float(a[:, 2].mean()), 2),
            "cpu_p50_never_preempted_ms": round(float(np.median(calm[:, 1])), 3) if len(calm) else None}


def level(bundle: str, load: float, budget_x: float, window_s: float, loop_s: float, pool, ref_run, seed: int,
          log: RunLog, max_batch: int = 32) -> dict:
    b1 = host_b1_ms(ref_run, pool)
    schedule = arrivals(load * 1e3 / b1, window_s, np.random.default_rng(seed))
    server = DsedgeServer(bundle, None, max_batch, 256)
    log.take()
    before = thread_counters()
    row = drive(server, schedule, pool, budget_x * b1)
    after = thread_counters()
    serving = log.take("dsedge-lane-")  # the served instances' workers
    stream = server.session._stream  # the lanes the window served on
    lanes = [ln for ln in stream.scheduler.lanes if not ln.fallback] if stream is not None else []
    if lanes:
        loop_runs(lanes, pool, loop_s)
    loop = log.take("serving-tax-loop-")
    names = {t.native_id: t.name for t in threading.enumerate()}
    server.close()
    n = max(len(schedule), 1)
    threads = []
    for tid, (name, cpu, vol, invol) in sorted(after.items()):
        name0, cpu0, vol0, invol0 = before.get(tid, (name, 0.0, 0, 0))
        if cpu - cpu0 >= 1 or vol - vol0 or invol - invol0:
            threads.append({"thread": names.get(tid, name), "cpu_ms": round(cpu - cpu0),
                            "voluntary_per_1000": round((vol - vol0) * 1e3 / n),
                            "involuntary_per_1000": round((invol - invol0) * 1e3 / n)})
    s, lp = summary(serving), summary(loop)
    ratio = {k[:-3]: round(s[k] / lp[k], 3) for k in ("wall_p50_ms", "cpu_p50_ms", "wall_p98_ms")
             if s.get(k) and lp.get(k)}  # dimensionless: "wall_p50", …
    return {"load": load, "b1_ms": b1, "budget_ms": round(budget_x * b1, 2), "offered": len(schedule),
            "in_budget_of_offered": row["in_budget_of_offered"], "serving": s, "loop": lp,
            "serving_over_loop": ratio, "threads": threads}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bundle", required=True, help="a .dse bundle with a dynamic batch axis (the MiniLM cpu one)")
    ap.add_argument("--loads", default="0.9,1.5", help="multiples of the batch-1 capacity, comma-separated")
    ap.add_argument("--budget-x", type=float, default=3.0, help="budget as a multiple of the batch-1 p50")
    ap.add_argument("--window-s", type=float, default=10.0, help="arrival window per load, s")
    ap.add_argument("--loop-s", type=float, default=3.0, help="back-to-back loop after each window, s")
    ap.add_argument("--seq", type=int, default=32, help="tokens per sentence")
    ap.add_argument("--vocab", type=int, default=None,
                    help="token ids are drawn below this (default: the manifest's input_ids range, else 30522)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args(argv)
    try:
        loads = [float(x) for x in args.loads.split(",")]
    except ValueError:
        ap.error("--loads takes comma-separated numbers, e.g. --loads 0.9,1.5")
    if min(loads) <= 0 or args.budget_x <= 1 or args.window_s <= 0 or args.loop_s <= 0:
        ap.error("--loads, --window-s and --loop-s must be > 0, --budget-x > 1")
    if not Path(args.bundle).exists():
        sys.exit(f"serving_tax.py: bundle {args.bundle} does not exist (dsedge build --target cpu --out out builds "
                 "the MiniLM one)")
    if not hasattr(resource, "RUSAGE_THREAD") or not Path("/proc/self/task").is_dir():
        sys.exit("serving_tax.py: needs Linux (per-thread CPU from RUSAGE_THREAD and /proc/self/task)")
    import dsedge
    from dsedge.runtime.backends.ort import OrtBackend

    probe = dsedge.load(args.bundle)
    ranges = [spec.value_range[1] + 1 for spec in probe.inputs if spec.value_range and "type" not in spec.name
              and "mask" not in spec.name]
    vocab = args.vocab or (min(ranges) if ranges else 30522)
    pool = make_requests(probe.inputs, 256, np.random.default_rng(args.seed), vocab, args.seq)
    ref = OrtBackend(probe.path / probe.variant.file)  # the 2-thread batch-1 p50 the loads and budget scale with
    max_batch = min(32, int((probe.manifest.shape_ranges or {}).get("batch", {}).get("max", 32)))  # as streaming.py
    probe.close()
    print(cpu_line())
    log = RunLog()
    log.install()
    rows = []
    try:
        for i, load in enumerate(loads):
            r = level(args.bundle, load, args.budget_x, args.window_s, args.loop_s, pool, ref.run,
                      args.seed + i, log, max_batch)
            rows.append(r)
            s, lp, q = r["serving"], r["loop"], r["serving_over_loop"]
            print(f"\nload {load:g}x  b1 {r['b1_ms']:.2f} ms  budget {r['budget_ms']:.1f} ms  offered {r['offered']}  "
                  f"in budget {100 * r['in_budget_of_offered']:.1f} %")
            print(f"  {'batch-1 runs':22s} {'n':>6s} {'wall p50':>9s} {'wall p98':>9s} {'cpu p50':>8s} {'cpu p98':>8s} "
                  f"{'preempted/run':>14s} {'cpu p50 never preempted':>24s}")
            for name, x in (("serving", s), ("loop, same session", lp)):
                if x["runs"]:
                    print(f"  {name:22s} {x['runs']:6d} {x['wall_p50_ms']:9.2f} {x['wall_p98_ms']:9.2f} "
                          f"{x['cpu_p50_ms']:8.2f} {x['cpu_p98_ms']:8.2f} {x['preempted_per_run']:14.2f} "
                          f"{x['cpu_p50_never_preempted_ms'] or float('nan'):24.2f}")
            print("  serving / loop: " + ", ".join(f"{k} {v:.2f}x" for k, v in q.items()))
            print("  threads (CPU ms; switches per 1000 requests, voluntary / involuntary):")
            for t in r["threads"]:
                print(f"    {t['thread'][:32]:32s} {t['cpu_ms']:7d} ms  {t['voluntary_per_1000']:6d} / "
                      f"{t['involuntary_per_1000']:6d}")
    finally:
        log.uninstall()
    if args.json:
        Path(args.json).write_text(json.dumps({"levels": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
