"""Evaluate detectors on the held-out volume: FROC per model and volume inference time, bundles (through
``dsedge.load``) side by side with the plain torch fp32 sliding window.

Timing (``TIMING``): every model first runs one untimed pass over the first scan (warm-up: ORT's and torch's first-run
allocations, kernel choice, thread pools); then each scan is run ``repeats`` times per model in rounds, the models in
list order in one round and in reverse order in the next, so that no model always runs right after another (torch's
OpenMP workers still spinning slow down whatever runs next) and load on a shared machine hits every model alike. The
timed work is the same for every model: the sliding window (window gather, the model on the planned batches, Gaussian
stitching); detection (NMS, the same numpy code for all) is timed apart and not included. Reported: the median."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from .froc import froc
from .infer import plan_batch, session_runner, sliding_window, sliding_window_stream
from .nms import Detection, detect
from .scans import Scan

FP_RATES = (0.2, 1.0, 2.0, 4.0)
TIMING = ("median of REPEATS timed passes per scan and model after one untimed warm-up pass per model; models "
          "alternate order each round (list order, then reversed); timed: the sliding window (window gather, model, "
          "stitching), the same work for torch and bundles; detection excluded (detect_seconds_median)")

# The anchors, stated beside ours (see README "Against the anchors").
ANCHORS = {
    "luna16_sensitivity_at_0.2_fp_per_scan": 0.987,
    "luna16_note": "real annotated nodules (LUNA16, 888 scans, 1,186 nodules ≥ 3 mm); full-resolution thin-slice CT",
    "v100_volumes_per_s": 12.0,
    "v100_note": "volumes-or-frames/s on an NVIDIA V100 GPU",
}


@dataclass
class ModelEntry:
    """One model to evaluate: ``kind`` "bundle" (path to a .dse) or "torch" (a dsedge run dir, run in PyTorch fp32).
    ``batch_from`` names the entry whose planned batch size the torch baseline reuses (same batches, fair timing)."""

    name: str
    kind: str
    path: str
    batch_from: str | None = None


def evaluate(entries: list[ModelEntry], scans: list[Scan], budget_ms: float = 250.0, threads: int = 2,
             stream: bool = False, repeats: int = 3, batch_sizes: dict[str, int] | None = None) -> dict[str, Any]:
    """Run every entry over every scan and return the report body (see README for the fields).

    Timing as in the module docstring (``TIMING``): one untimed warm-up pass per entry on ``scans[0]``, then
    ``repeats`` timed passes per scan in alternating order; ``volume_seconds_median`` is the median over all timed
    passes (scans × repeats) of the sliding window alone, in seconds; detection is timed apart.

    Args:
        budget_ms: per-batch latency budget used to plan the batch size of each bundle (``plan_batch``) and, with
            ``stream``, the per-window budget given to ``session.stream``.
        threads: CPU threads for ORT sessions and torch.
        repeats: timed passes per scan and model (>= 1; the median is reported, detections come from the first).
        batch_sizes: entry name → batch size to use instead of planning (to time another volume with the same
            batches); the plan's latency profile is then empty.
    Raises:
        ValueError: ``repeats`` < 1.
    """
    from .infer import BatchPlan

    import dsedge

    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    runners: dict[str, Any] = {}
    plans: dict[str, Any] = {}
    sessions: dict[str, Any] = {}
    for e in entries:
        if e.kind == "bundle":
            s = dsedge.load(e.path, threads=threads)
            sessions[e.name] = s
            runners[e.name] = session_runner(s)
            plans[e.name] = (BatchPlan(batch_sizes[e.name], budget_ms) if batch_sizes and e.name in batch_sizes
                             else plan_batch(runners[e.name], budget_ms))
    for e in entries:
        if e.kind == "torch":
            from .torch_baseline import load_run, torch_runner

            runners[e.name] = torch_runner(load_run(e.path), threads)
            if batch_sizes and e.name in batch_sizes:
                plans[e.name] = BatchPlan(batch_sizes[e.name], budget_ms)
            elif e.batch_from:
                plans[e.name] = plans[e.batch_from]
            else:
                plans[e.name] = plan_batch(runners[e.name], budget_ms)

    def window_pass(e: ModelEntry, scan: Scan) -> tuple[np.ndarray, dict]:
        if stream and e.kind == "bundle":
            # in flight: one planned batch, so queued windows do not push each other past the budget
            return sliding_window_stream(sessions[e.name], scan.image, scan.mask, scan.meta, budget_ms,
                                         window=plans[e.name].batch_size)
        return sliding_window(runners[e.name], scan.image, scan.mask, scan.meta, plans[e.name].batch_size)

    if scans:
        for e in entries:                      # warm-up, untimed
            window_pass(e, scans[0])
    dets: dict[str, list[list[Detection]]] = {e.name: [] for e in entries}
    stats: dict[str, list[dict]] = {e.name: [] for e in entries}
    rounds = 0
    for scan in scans:
        first: dict[str, dict] = {}
        times: dict[str, list[float]] = {e.name: [] for e in entries}
        for _ in range(repeats):
            for e in (entries if rounds % 2 == 0 else entries[::-1]):
                prob, st = window_pass(e, scan)
                times[e.name].append(st["seconds"])
                if e.name not in first:        # detections (and the pass's other stats) from the first timed pass
                    t = time.perf_counter()
                    dets[e.name].append(detect(prob, scan.spacing_mm, scan.mask))
                    st["detect_seconds"] = round(time.perf_counter() - t, 4)
                    first[e.name] = st
            rounds += 1
        for e in entries:
            st = dict(first[e.name])
            st["seconds_passes"] = times[e.name]
            st["seconds"] = round(float(np.median(times[e.name])), 4)
            st["patches_per_s"] = round(st["windows"] / st["seconds"], 2) if st["seconds"] > 0 else None
            stats[e.name].append(st)
    lesions = [s.lesions for s in scans]
    models = {}
    for e in entries:
        secs = [t for s in stats[e.name] for t in s["seconds_passes"]]
        median = float(np.median(secs)) if secs else float("nan")
        windows = float(np.mean([s["windows"] for s in stats[e.name]])) if secs else 0.0
        f = froc(dets[e.name], lesions, FP_RATES)
        entry = {
            "kind": e.kind, "path": e.path,
            "froc": f,
            "timing": TIMING.replace("REPEATS", str(repeats)), "timed_passes": len(secs),
            "volume_seconds_median": round(median, 4),
            "volumes_per_s": round(1.0 / median, 3),
            "patches_per_s": round(windows / median, 2),
            "detect_seconds_median": round(float(np.median([s["detect_seconds"] for s in stats[e.name]])), 4)
            if secs else None,
            "batch_plan": {"batch_size": plans[e.name].batch_size, "budget_ms": plans[e.name].budget_ms,
                           "latency_ms": plans[e.name].latency_ms, "within_budget": plans[e.name].within_budget},
            "per_scan": stats[e.name],
            "detections_first_scan": [d.to_dict() for d in dets[e.name][0][:20]] if scans else [],
        }
        if e.kind == "bundle":
            entry["session"] = sessions[e.name].describe()
        models[e.name] = entry
    for s in sessions.values():
        s.close()
    return {"models": models, "detections": dets}
