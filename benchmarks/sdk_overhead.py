"""Overhead of the SDK paths (``dsedge.load(...).run`` and ``submit(...).result()``) vs a bare
``onnxruntime.InferenceSession.run``, side by side.

Both sessions open the same ONNX graph of the bundle (with the SDK's load-time ORT-CPU rewrites, if it made any) with
the same options (intra-op threads, inter-op 1, CPU EP unless --providers, and no spin-waiting of the intra-op
threads between runs: ``session.intra_op.allow_spinning`` 0, as the SDK's backends open) and get the same synthetic
inputs. A third bare session with ORT's default spinning shows what that choice costs at batch 1 (column ``spin``:
the SDK trades it for cores free between batches, runtime/backends/ort.py says why). Timing alternates short blocks of SDK and bare runs so
machine noise (other processes, frequency changes) hits all alike; the ratio of medians is the figure
(goal: ≤ 1.05 at batch 1), and ``submit`` − ``run`` p50 (goal: ≤ 0.1 ms at batch 1; ``--no-submit`` skips it).
``submit`` is called as a closed-loop caller does: ``session.submit(x, budget_ms=...).result()`` one at a time.

    python benchmarks/sdk_overhead.py --bundle out/all-minilm-l6-v2-cpu.dse --batch 1,32 --seq-len 32 --threads 2
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bundle", required=True, help="a .dse bundle")
    ap.add_argument("--variant", default=None)
    ap.add_argument("--batch", default="1", help="comma-separated batch sizes")
    ap.add_argument("--seq-len", type=int, default=None)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--providers", default="CPUExecutionProvider")
    ap.add_argument("--rounds", type=int, default=20, help="alternating blocks per path")
    ap.add_argument("--block", type=int, default=10, help="runs per block")
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--budget-ms", type=float, default=1000.0, help="budget passed to submit")
    ap.add_argument("--no-submit", action="store_true", help="time run() vs bare ORT only")
    ap.add_argument("--json", action="store_true", help="print the results as JSON too")
    args = ap.parse_args(argv)
    if not Path(args.bundle).exists():
        sys.exit(f"sdk_overhead.py: bundle {args.bundle} does not exist (build one with `dsedge build`)")

    import onnxruntime as ort

    import dsedge
    from dsedge.runtime.bench import manifest_vocab_size, latency_stats, synthetic_inputs

    providers = [p for p in args.providers.split(",") if p]
    sdk = dsedge.load(args.bundle, variant=args.variant, providers=providers, threads=args.threads)
    opts = ort.SessionOptions()  # the same options OrtBackend sets
    if args.threads:
        opts.intra_op_num_threads = args.threads
        opts.inter_op_num_threads = 1
    opts.log_severity_level = 3
    model: str | bytes = str(sdk.path / sdk.variant.file)
    from dsedge.runtime.backends.ort import WIDE_INT4_ACCURACY_LEVEL, _cpu_rewrites

    # the graph and settings the SDK's session got (its ORT-CPU rewrites, the INT4 accuracy level), timed bare
    rewritten, rewrites, wide_int4 = _cpu_rewrites(model)
    if getattr(sdk._backend, "rewrites", 0):
        model = rewritten
    if wide_int4:
        opts.add_session_config_entry("session.qdq_matmulnbits_accuracy_level", WIDE_INT4_ACCURACY_LEVEL)
    opts.add_session_config_entry("session.intra_op.allow_spinning", "0")  # as OrtBackend opens its sessions
    bare = ort.InferenceSession(model, sess_options=opts, providers=providers)
    spin_opts = ort.SessionOptions()  # ORT's default: intra-op threads spin-wait between runs
    if args.threads:
        spin_opts.intra_op_num_threads, spin_opts.inter_op_num_threads = args.threads, 1
    spin_opts.log_severity_level = 3
    spin = ort.InferenceSession(model, sess_options=spin_opts, providers=providers)
    out_names = [o.name for o in bare.get_outputs()]
    print(f"bundle {args.bundle} variant {sdk.variant.name}; providers sdk={sdk.providers} bare={bare.get_providers()}; "
          f"threads {args.threads or 'default'}; onnxruntime {ort.__version__}; load-time rewrites {rewrites} (both paths)")
    from streaming import cpu_line  # benchmarks/streaming.py: CPU flags and load

    print(cpu_line())
    print("times in ms unless marked µs; ratio = sdk / bare, both without spin-waiting (goal <= 1.05 at batch 1); "
          "spin = bare with ORT's default spin-waiting, p50 (sdk/spin: what not spinning costs); "
          "submit-run = submit p50 - sdk run p50 (goal <= 100 µs at batch 1)")
    print(f"{'batch':>5} {'shape':>8} {'sdk p50 ms':>11} {'bare p50 ms':>12} {'p50 ratio':>10} "
          f"{'sdk mean':>9} {'bare mean':>10} {'mean ratio':>11} {'sdk p99':>8} {'bare p99':>9} {'Δp50 µs':>8} "
          f"{'submit p50':>11} {'submit-run µs':>14} {'spin p50':>9} {'sdk/spin':>9}  n")
    rows = []
    for b in [int(x) for x in args.batch.split(",")]:
        feed = synthetic_inputs(sdk.inputs, sdk.manifest.shape_ranges, b, args.seq_len, manifest_vocab_size(sdk.manifest))
        paths = {"sdk": lambda: sdk.run(feed), "bare": lambda: bare.run(out_names, feed),
                 "spin": lambda: spin.run(out_names, feed)}
        if not args.no_submit:
            paths["submit"] = lambda: sdk.submit(feed, budget_ms=args.budget_ms).result()
        for _ in range(args.warmup):
            for fn in paths.values():
                fn()
        samples: dict[str, list[float]] = {name: [] for name in paths}
        for r in range(args.rounds):
            order = list(paths) if r % 2 == 0 else list(paths)[::-1]  # no path always goes first
            for name in order:
                fn = paths[name]
                for _ in range(args.block):
                    t0 = time.perf_counter_ns()
                    fn()
                    samples[name].append((time.perf_counter_ns() - t0) / 1e6)
        s, o = latency_stats(np.array(samples["sdk"])), latency_stats(np.array(samples["bare"]))
        row = {"batch": b, "shape": list(next(iter(feed.values())).shape), "sdk_ms": s, "bare_ms": o,
               "p50_ratio": s["p50"] / o["p50"], "mean_ratio": s["mean"] / o["mean"], "n": len(samples["sdk"])}
        sp = latency_stats(np.array(samples["spin"]))
        row["spin_ms"], row["sdk_over_spin_p50"] = sp, s["p50"] / sp["p50"]
        sub = latency_stats(np.array(samples["submit"])) if "submit" in samples else None
        if sub is not None:
            row["submit_ms"] = sub
            row["submit_minus_run_p50_ms"] = sub["p50"] - s["p50"]
        rows.append(row)
        sub_p50 = f"{sub['p50']:.3f}" if sub else "-"
        sub_delta = f"{row['submit_minus_run_p50_ms'] * 1000:.1f}" if sub else "-"
        print(f"{b:>5} {'x'.join(map(str, row['shape'])):>8} {s['p50']:>11.3f} {o['p50']:>12.3f} {row['p50_ratio']:>10.3f} "
              f"{s['mean']:>9.3f} {o['mean']:>10.3f} {row['mean_ratio']:>11.3f} {s['p99']:>8.3f} {o['p99']:>9.3f} "
              f"{(s['p50'] - o['p50']) * 1000:>8.1f} {sub_p50:>11} {sub_delta:>14} {sp['p50']:>9.3f} "
              f"{row['sdk_over_spin_p50']:>9.3f}  {row['n']}")
    if args.json:
        print(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
