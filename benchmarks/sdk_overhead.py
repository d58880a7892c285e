"""Overhead of the SDK path (``dsedge.load(...).run``) vs a bare ``onnxruntime.InferenceSession.run``, side by side.

Both sessions open the same ONNX graph of the bundle (with the SDK's load-time ORT-CPU rewrites, if it made any) with
the same options (intra-op threads, inter-op 1, CPU EP
unless --providers) and get the same synthetic inputs. Timing alternates short blocks of SDK and bare runs so
machine noise (other processes, frequency changes) hits both alike; the ratio of medians is the figure
(goal: ≤ 1.05 at batch 1).

    python benchmarks/sdk_overhead.py --bundle out/all-minilm-l6-v2-cpu.dse --batch 1,32 --seq-len 32 --threads 2
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np


def main() -> None:
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
    ap.add_argument("--json", action="store_true", help="print the results as JSON too")
    args = ap.parse_args()

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
    rewrites = getattr(sdk._backend, "rewrites", 0)
    if rewrites:  # the SDK rewrote the graph at load (ORT-CPU speed-ups): time the bare path on the same graph
        from dsedge.runtime.backends.ort import _cpu_rewrites

        model, _ = _cpu_rewrites(model)
    bare = ort.InferenceSession(model, sess_options=opts, providers=providers)
    out_names = [o.name for o in bare.get_outputs()]
    print(f"bundle {args.bundle} variant {sdk.variant.name}; providers sdk={sdk.providers} bare={bare.get_providers()}; "
          f"threads {args.threads or 'default'}; onnxruntime {ort.__version__}; load-time rewrites {rewrites} (both paths)")
    print(f"{'batch':>5} {'shape':>8} {'sdk p50 ms':>11} {'bare p50 ms':>12} {'p50 ratio':>10} "
          f"{'sdk mean':>9} {'bare mean':>10} {'mean ratio':>11} {'sdk p99':>8} {'bare p99':>9} {'Δp50 µs':>8}  n")
    rows = []
    for b in [int(x) for x in args.batch.split(",")]:
        feed = synthetic_inputs(sdk.inputs, sdk.manifest.shape_ranges, b, args.seq_len, manifest_vocab_size(sdk.manifest))
        paths = {"sdk": lambda: sdk.run(feed), "bare": lambda: bare.run(out_names, feed)}
        for _ in range(args.warmup):
            for fn in paths.values():
                fn()
        samples: dict[str, list[float]] = {"sdk": [], "bare": []}
        for r in range(args.rounds):
            order = ("sdk", "bare") if r % 2 == 0 else ("bare", "sdk")  # neither path always goes first
            for name in order:
                fn = paths[name]
                for _ in range(args.block):
                    t0 = time.perf_counter_ns()
                    fn()
                    samples[name].append((time.perf_counter_ns() - t0) / 1e6)
        s, o = latency_stats(np.array(samples["sdk"])), latency_stats(np.array(samples["bare"]))
        row = {"batch": b, "shape": list(next(iter(feed.values())).shape), "sdk_ms": s, "bare_ms": o,
               "p50_ratio": s["p50"] / o["p50"], "mean_ratio": s["mean"] / o["mean"], "n": len(samples["sdk"])}
        rows.append(row)
        print(f"{b:>5} {'x'.join(map(str, row['shape'])):>8} {s['p50']:>11.3f} {o['p50']:>12.3f} {row['p50_ratio']:>10.3f} "
              f"{s['mean']:>9.3f} {o['mean']:>10.3f} {row['mean_ratio']:>11.3f} {s['p99']:>8.3f} {o['p99']:>9.3f} "
              f"{(s['p50'] - o['p50']) * 1000:>8.1f}  {row['n']}")
    if args.json:
        print(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
