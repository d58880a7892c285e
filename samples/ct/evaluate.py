"""Evaluate detectors on the held-out volume: FROC per model and volume inference time, bundles (through
``dsedge.load``) side by side with the plain torch fp32 sliding window, interleaved scan by scan so that load on a
shared machine hits every model alike."""
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
             stream: bool = False, repeats: int = 1, batch_sizes: dict[str, int] | None = None) -> dict[str, Any]:
    """Run every entry over every scan and return the report body (see README for the fields).

    Args:
        budget_ms: per-batch latency budget used to plan the batch size of each bundle (``plan_batch``) and, with
            ``stream``, the per-window budget given to ``session.stream``.
        threads: CPU threads for ORT sessions and torch.
        repeats: timed passes per scan and model (the fastest is kept; detections come from the first).
        batch_sizes: entry name → batch size to use instead of planning (to time another volume with the same
            batches); the plan's latency profile is then empty.
    """
    from .infer import BatchPlan

    import dsedge

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
    dets: dict[str, list[list[Detection]]] = {e.name: [] for e in entries}
    stats: dict[str, list[dict]] = {e.name: [] for e in entries}
    for scan in scans:
        for e in entries:
            best = None
            for r in range(repeats):
                if stream and e.kind == "bundle":
                    # in flight: one planned batch, so queued windows do not push each other past the budget
                    prob, st = sliding_window_stream(sessions[e.name], scan.image, scan.mask, scan.meta, budget_ms,
                                                     window=plans[e.name].batch_size)
                else:
                    prob, st = sliding_window(runners[e.name], scan.image, scan.mask, scan.meta,
                                              plans[e.name].batch_size)
                t = time.perf_counter()
                d = detect(prob, scan.spacing_mm, scan.mask)
                st["detect_seconds"] = round(time.perf_counter() - t, 4)
                if r == 0:
                    dets[e.name].append(d)
                if best is None or st["seconds"] < best["seconds"]:
                    best = st
            stats[e.name].append(best)
    lesions = [s.lesions for s in scans]
    models = {}
    for e in entries:
        secs = [s["seconds"] + s["detect_seconds"] for s in stats[e.name]]
        windows = sum(s["windows"] for s in stats[e.name])
        f = froc(dets[e.name], lesions, FP_RATES)
        entry = {
            "kind": e.kind, "path": e.path,
            "froc": f,
            "volume_seconds_median": round(float(np.median(secs)), 4),
            "volumes_per_s": round(1.0 / float(np.median(secs)), 3),
            "patches_per_s": round(windows / sum(s["seconds"] for s in stats[e.name]), 2),
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
