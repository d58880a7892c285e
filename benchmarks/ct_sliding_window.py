"""Side by side, one run: whole-volume sliding-window time of the CT student bundle (dsedge.load, ORT CPU) vs the
same student in plain PyTorch fp32 eager, same windows, same batch size, same threads, interleaved scan by scan.

    python benchmarks/ct_sliding_window.py [--bundle runs/bundles/student-cpu-fp32] [--run runs/ct-student]

Goal (issue 9): bundle ≥ 2× faster than torch fp32 at equal sensitivity. Prints the ratio; timings on a shared
machine are noisy, so after one untimed warm-up pass per model each scan is timed ``--repeats`` times, the models'
order reversed each round, and the median pass is kept (the sliding window alone; detection is timed apart:
samples/ct/evaluate.py).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from samples.ct.scans import make_scans  # noqa: E402
from samples.ct.evaluate import ModelEntry, evaluate  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from streaming import cpu_line  # noqa: E402  (benchmarks/streaming.py: CPU flags and load)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bundle", default="runs/bundles/student-cpu-fp32")
    ap.add_argument("--run", default="runs/ct-student")
    ap.add_argument("--volume", default="../shared/data/ct-totalsegmentator-example/example_ct.nii.gz")
    ap.add_argument("--scans", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--budget-ms", type=float, default=250.0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch", type=int, default=None, help="fixed batch size for both (default: planned)")
    ap.add_argument("--lesions", type=int, default=6)
    a = ap.parse_args(argv)
    bundle = (next(Path(a.bundle).glob("*.dse"), None) if not a.bundle.endswith(".dse") else Path(a.bundle))
    build = "run `python -m samples.ct train` then `python -m samples.ct build` first"
    if bundle is None or not bundle.exists():
        raise SystemExit(f"ct_sliding_window.py: no .dse bundle at {a.bundle}: {build} (or pass --bundle)")
    if not Path(a.run).is_dir():
        raise SystemExit(f"ct_sliding_window.py: no trained student at {a.run}: {build} (or pass --run)")
    if not Path(a.volume).exists():
        raise SystemExit(f"ct_sliding_window.py: no CT volume at {a.volume} (pass --volume)")
    entries = [ModelEntry("bundle", "bundle", str(bundle)), ModelEntry("torch fp32", "torch", a.run, batch_from="bundle")]
    scans = make_scans(a.volume, a.scans, a.lesions, seed=100)
    fixed = {"bundle": a.batch, "torch fp32": a.batch} if a.batch else None
    m = evaluate(entries, scans, a.budget_ms, a.threads, repeats=a.repeats, batch_sizes=fixed)["models"]
    b, t = m["bundle"], m["torch fp32"]
    print(json.dumps({k: {"volume_seconds_median": v["volume_seconds_median"], "patches_per_s": v["patches_per_s"],
                          "batch_size": v["batch_plan"]["batch_size"], "cpm": v["froc"]["cpm"],
                          "sensitivity_at": v["froc"]["sensitivity_at"]} for k, v in m.items()}, indent=2))
    print(cpu_line())
    print(f"speed-up bundle vs torch fp32: {t['volume_seconds_median'] / b['volume_seconds_median']:.2f}x "
          f"(goal >= 2x); CPM {b['froc']['cpm']} vs {t['froc']['cpm']}")


if __name__ == "__main__":
    main()
