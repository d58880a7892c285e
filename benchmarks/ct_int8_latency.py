"""Side by side, one run: ORT CPU latency per 32³ window of the CT student's fp32, INT8 Q/DQ (and other) bundles, and
their accuracy vs fp32 on the same held-out windows.

    python benchmarks/ct_int8_latency.py [--bundles runs/bundles] [--batches 1 32] [--threads 2] [--out FILE]

Every bundle is loaded with ``dsedge.load(threads=N)`` on the CPU provider; the inputs are real held-out windows
(``runs/bundles/inputs/heldout``, written by ``python -m samples.ct build``). Timing is interleaved
(``runtime.latency.time_interleaved``): each round runs every variant once at each batch size, the order rotated
each round, ``--rounds`` rounds after a warm-up, median kept, so load from other processes falls on all variants
alike. Prints ms per batch and per window and each variant's ratio to fp32.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import dsedge  # noqa: E402
from dsedge.runtime.latency import time_interleaved  # noqa: E402
from dsedge.toolchain.evaluate import two_class_metrics  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from streaming import cpu_line  # noqa: E402  (benchmarks/streaming.py: CPU flags and load)

VARIANTS = ("student-cpu-fp32", "student-cpu-int8", "student-jetson-fp16", "student-jetson-int8",
            "student-jetson-int4")


def _windows(d: Path) -> dict[str, np.ndarray]:
    files = sorted(d.glob("*.npz"))
    return {k: np.concatenate([np.load(f)[k] for f in files]) for k in ("patch", "meta")}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bundles", default="runs/bundles")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--out", default=None, help="also write the JSON here")
    a = ap.parse_args(argv)
    root = Path(a.bundles)
    if not any((root / "inputs" / "heldout").glob("*.npz")):
        raise SystemExit(f"ct_int8_latency.py: no held-out windows under {root / 'inputs' / 'heldout'}: run "
                         "`python -m samples.ct train` then `python -m samples.ct build` first (or pass --bundles)")
    held = _windows(root / "inputs" / "heldout")
    sessions = {}
    for name in VARIANTS:
        found = sorted((root / name).glob("*.dse"))
        if found:
            sessions[name] = dsedge.load(found[0], threads=a.threads, providers=["CPUExecutionProvider"])
    if "student-cpu-fp32" not in sessions:
        raise SystemExit(f"no student-cpu-fp32 bundle under {root}: run `python -m samples.ct build` first")
    # accuracy vs fp32 on every held-out window
    outs = {n: np.concatenate([s.run({k: v[i:i + 16] for k, v in held.items()})["cell_logits"]
                               for i in range(0, len(held["patch"]), 16)]) for n, s in sessions.items()}
    ref = outs["student-cpu-fp32"]
    accuracy = {}
    for n, o in outs.items():
        r, t = ref.reshape(len(ref), -1).astype(np.float64), o.reshape(len(o), -1).astype(np.float64)
        cos = (r * t).sum(1) / (np.linalg.norm(r, axis=1) * np.linalg.norm(t, axis=1) + 1e-12)
        accuracy[n] = {"windows": int(len(ref)), "cosine_mean": round(float(cos.mean()), 5),
                       "cosine_min": round(float(cos.min()), 5),
                       "pearson": round(float(np.corrcoef(r.ravel(), t.ravel())[0, 1]), 5),
                       "max_abs_diff_logits": round(float(np.abs(r - t).max()), 5), **two_class_metrics(ref, o)}
    # latency, interleaved
    feeds = {b: {k: np.ascontiguousarray(np.resize(v, (b,) + v.shape[1:])) for k, v in held.items()}
             for b in a.batches}
    names = list(sessions)
    samples = time_interleaved({(n, b): (lambda s=sessions[n], f=feeds[b]: s.run(f)) for n in names for b in a.batches},
                               rounds=a.rounds, warmup=1)
    latency = {n: {str(b): {"p50_ms_per_batch": round(float(np.median(samples[(n, b)])), 3),
                            "min_ms_per_batch": round(float(np.min(samples[(n, b)])), 3),
                            "p50_ms_per_window": round(float(np.median(samples[(n, b)])) / b, 3),
                            "vs_fp32": round(float(np.median(samples[(n, b)]) /
                                                   np.median(samples[("student-cpu-fp32", b)])), 2)}
                   for b in a.batches} for n in names}
    import onnxruntime as ort

    report = {"threads": a.threads, "rounds": a.rounds, "onnxruntime": ort.__version__, "cpu": cpu_line()[2:],
              "providers": {n: s.providers for n, s in sessions.items()},
              "note": "ORT CPU on a shared 2-core machine; interleaved rounds, medians; noisy",
              "accuracy_vs_fp32": accuracy, "latency": latency}
    text = json.dumps(report, indent=2)
    print(text)
    for n in names:
        print(f"{n:22s} " + "  ".join(f"b{b}: {latency[n][str(b)]['p50_ms_per_window']:.3f} ms/window "
                                      f"({latency[n][str(b)]['vs_fp32']:.2f}x fp32)" for b in a.batches)
              + f"  cosine {accuracy[n]['cosine_mean']}  dice@0.5 {accuracy[n]['dice_at_0.5']}", file=sys.stderr)
    print(f"(Nx fp32 = p50 time / fp32's p50 time at the same batch: below 1 is faster; threads {a.threads})\n"
          f"{cpu_line()}", file=sys.stderr)
    if a.out:
        Path(a.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
