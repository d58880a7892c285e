"""The sample's report: JSON (stable field names, units in the names) and a PNG with axial slices (ground-truth
lesions and detections overlaid) and the FROC curves."""
from __future__ import annotations

import json
import os
import platform
from pathlib import Path
from typing import Any

import numpy as np

from .nms import Detection
from .scans import Scan

REPORT_SCHEMA = "dsedge.sample-ct-report/1"


def write_json(path: str | os.PathLike, report: dict[str, Any]) -> Path:
    """Write ``report`` (adds ``schema`` and the machine) atomically: temp file then rename."""
    import dsedge

    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    body = {"schema": REPORT_SCHEMA, "dsedge_version": dsedge.__version__,
            "machine": {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
                        "cpus": os.cpu_count()}, **report}
    tmp = p.with_name(p.name + ".tmp")
    tmp.write_text(json.dumps(body, indent=2, default=str) + "\n", encoding="utf-8")
    os.replace(tmp, p)
    return p


def write_png(path: str | os.PathLike, scan: Scan, detections: list[Detection], curves: dict[str, dict],
              n_slices: int = 3, min_score: float = 0.3, title: str = "", credit: str = "") -> Path:
    """Axial slices through the first ``n_slices`` lesions of ``scan`` (green circles: ground truth; red circles:
    detections with score ≥ ``min_score``, score printed) and the FROC curves (FP/scan on a log axis); ``credit``:
    a footer line (the images' licence and citation)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Circle

    sp = np.asarray(scan.spacing_mm)
    lesions, used = [], set()
    for le in sorted(scan.lesions, key=lambda le: -le.diameter_mm):      # largest first, one panel per slice
        z = int(round(le.center_mm[0] / sp[0]))
        if z not in used and len(lesions) < n_slices:
            lesions.append(le)
            used.add(z)
    fig, axes = plt.subplots(1, len(lesions) + 1, figsize=(4.2 * (len(lesions) + 1), 4.4), squeeze=False)
    axes = axes[0]
    for ax, les in zip(axes, lesions):
        z = int(round(les.center_mm[0] / sp[0]))
        ax.imshow(scan.image[z], cmap="gray", vmin=0, vmax=1)
        for other in scan.lesions:
            if abs(other.center_mm[0] - z * sp[0]) <= other.max_radius_mm:
                ax.add_patch(Circle((other.center_mm[2] / sp[2], other.center_mm[1] / sp[1]),
                                    other.max_radius_mm / sp[1] + 1, fill=False, color="lime", lw=1))
        for d in detections:
            if d.score >= min_score and abs(d.center_mm[0] - z * sp[0]) <= max(d.radius_mm, 4.0):
                ax.add_patch(Circle((d.center_mm[2] / sp[2], d.center_mm[1] / sp[1]), d.radius_mm / sp[1] + 2,
                                    fill=False, color="red", lw=1, ls="--"))
                ax.text(d.center_mm[2] / sp[2] + 4, d.center_mm[1] / sp[1] - 4, f"{d.score:.2f}", color="red",
                        fontsize=7)
        ax.set_title(f"z={z * sp[0]:.0f} mm · {les.diameter_mm:.1f} mm {les.kind}", fontsize=9)
        ax.axis("off")
    ax = axes[-1]
    plotted = 0
    for name, c in curves.items():
        if any(v is None for v in c["sensitivity"]):      # no lesions: sensitivity undefined, nothing to draw
            continue
        plotted += 1
        fps = np.maximum(np.asarray(c["fps_per_scan"]), 1e-2)
        ax.step(fps, c["sensitivity"], where="post", label=name)
    for r in (1, 2, 4):
        ax.axvline(r, color="0.8", lw=0.5)
    ax.set_xscale("log")
    ax.set_xlim(1e-2, 20)
    ax.set_ylim(0, 1.02)
    ax.set_xlabel("false positives per scan")
    ax.set_ylabel("sensitivity")
    ax.set_title("FROC (synthetic lesions, held-out volume)", fontsize=9)
    if plotted:
        ax.legend(fontsize=7, loc="lower right")
    else:
        ax.text(0.5, 0.5, "no lesions: sensitivity n/a", ha="center", va="center", transform=ax.transAxes)
    if title:
        fig.suptitle(title, fontsize=10, wrap=True)
    if credit:
        fig.text(0.01, 0.01, credit, fontsize=6, color="0.35", wrap=True)
    fig.tight_layout(rect=(0, 0.05 if credit else 0, 1, 1))
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(p.stem + ".tmp.png")
    fig.savefig(tmp, dpi=90)
    plt.close(fig)
    os.replace(tmp, p)
    return p
