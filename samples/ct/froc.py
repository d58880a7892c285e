"""FROC analysis (free-response ROC) as in the LUNA16 challenge (Setio et al., Medical Image Analysis 2017).

A detection is a true positive when its centre lies within ``max(lesion's largest semi-axis, min_hit_mm)`` of a
lesion centre (LUNA16 uses the nodule radius alone; our detector reports 4 mm cells, so tiny lesions get a 5 mm
floor). Several detections on one lesion count once and the extra ones are not false positives (as in LUNA16);
detections hitting no lesion are false positives. Sensitivity is read at given average false positives per scan,
and the CPM is the mean sensitivity at 1/8, 1/4, 1/2, 1, 2, 4 and 8 FP/scan.
"""
from __future__ import annotations

import numpy as np

from .lesions import Lesion
from .nms import Detection

CPM_FP_RATES = (0.125, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0)


def match(detections: list[Detection], lesions: list[Lesion], min_hit_mm: float = 5.0) -> list[int]:
    """For each detection, the index of the nearest lesion it hits, or -1."""
    if not lesions:
        return [-1] * len(detections)
    centers = np.asarray([les.center_mm for les in lesions])
    reach = np.asarray([max(les.max_radius_mm, min_hit_mm) for les in lesions])
    out = []
    for d in detections:
        dist = np.linalg.norm(centers - np.asarray(d.center_mm), axis=1)
        hits = np.flatnonzero(dist <= reach)
        out.append(int(hits[np.argmin(dist[hits])]) if hits.size else -1)
    return out


def froc(detections_per_scan: list[list[Detection]], lesions_per_scan: list[list[Lesion]],
         fp_rates: tuple[float, ...] = (1.0, 2.0, 4.0), min_hit_mm: float = 5.0) -> dict:
    """The FROC curve over all scans and the sensitivity at ``fp_rates`` FP/scan.

    Returns:
        dict: ``fps_per_scan`` and ``sensitivity`` (curve points, one per distinct score threshold, ascending FP),
        ``thresholds``, ``sensitivity_at`` {"1": s, "2": s, "4": s} (the best sensitivity with FP/scan ≤ rate),
        ``cpm``, ``lesions``, ``scans``, ``max_sensitivity`` (all detections kept), ``fps_per_scan_total``.
        With no lesions at all sensitivity is undefined: ``sensitivity`` points, ``sensitivity_at`` values, ``cpm``
        and ``max_sensitivity`` are None (false positives are still counted).
    """
    n_scans = len(lesions_per_scan)
    n_les = sum(len(x) for x in lesions_per_scan)
    rows = []                               # (score, scan, lesion or -1)
    for s, (dets, les) in enumerate(zip(detections_per_scan, lesions_per_scan)):
        for d, m in zip(dets, match(dets, les, min_hit_mm)):
            rows.append((d.score, s, m))
    rows.sort(key=lambda r: -r[0])
    hit: set[tuple[int, int]] = set()
    fp = 0
    fps, sens, thr = [0.0], [0.0], [1.0]
    i = 0
    while i < len(rows):
        score = rows[i][0]
        while i < len(rows) and rows[i][0] == score:    # one curve point per distinct score
            _, s, m = rows[i]
            if m < 0:
                fp += 1
            else:
                hit.add((s, m))
            i += 1
        fps.append(fp / max(n_scans, 1))
        sens.append(len(hit) / max(n_les, 1))
        thr.append(float(score))
    fps_a, sens_a = np.asarray(fps), np.asarray(sens)

    def at(rate: float) -> float:
        ok = fps_a <= rate
        return float(sens_a[ok].max()) if ok.any() else 0.0

    defined = n_les > 0
    return {
        "fps_per_scan": [round(v, 4) for v in fps],
        "sensitivity": [round(v, 4) if defined else None for v in sens],
        "thresholds": [round(v, 5) for v in thr],
        "sensitivity_at": {f"{r:g}": round(at(r), 4) if defined else None for r in fp_rates},
        "cpm": round(float(np.mean([at(r) for r in CPM_FP_RATES])), 4) if defined else None,
        "lesions": n_les, "scans": n_scans, "max_sensitivity": round(float(sens_a[-1]), 4) if defined else None,
        "fps_per_scan_total": round(float(fps_a[-1]), 3), "min_hit_mm": min_hit_mm,
    }
