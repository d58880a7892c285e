"""Golden I/O: check that the engine running a bundle here answers like the model that was measured at build time.

A bundle built by ``dsedge build`` holds ``golden/inputs.npz`` (a few held-out input rows), ``golden/outputs.npz`` (the
fp32 reference model's outputs on them, ORT CPU) and ``golden/golden.json`` (rows, which outputs are compared), all
hash-listed in the manifest; each variant's manifest entry holds ``golden``: per output, the cosine min and max abs
diff that variant reached against the reference on those rows at build time (ORT CPU).

The check (``dsedge verify``, ``dsedge.load(check_outputs=True)``, and every TensorRT engine built on the device
before it is cached) runs the golden inputs through the backend in use and passes when, for every compared output,

    cosine_min  >= build-time cosine_min - 0.005     (per-row cosine, rows flattened, float64)
    max_abs_diff <= 2 x build-time max_abs_diff       (the build-time figure is floored at 1% of max |reference|)

Rank-0 inputs (a scalar flag such as ``use_cache`` or ``temperature``) are stored as they are, one value, and fed
unchanged with every call of rows; the row count comes from the batched inputs. A model whose inputs are all rank-0
has no rows to check (``dsedge build`` writes no golden I/O for it). A rank-0 output (a loss, a count: one value per
call, not rows) is stored once, from one call over the golden rows, and compared with every call's value (its
cosine over one value is sign agreement).

Loading uses ``numpy.load(allow_pickle=False)``: no code runs from a bundle.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np

from .bundle import IOSpec, Manifest, Variant
from .errors import BundleError, OutputMismatchError
from .npz import read_npz

GOLDEN_DIR = "golden"
INPUTS_FILE = f"{GOLDEN_DIR}/inputs.npz"
OUTPUTS_FILE = f"{GOLDEN_DIR}/outputs.npz"
INFO_FILE = f"{GOLDEN_DIR}/golden.json"
COSINE_SLACK = 0.005
ABS_FACTOR = 2.0
ABS_FLOOR_REL = 0.01  # the build-time max abs diff is at least 1% of max |reference| (fp32 vs itself is 0)


@dataclass
class Golden:
    """The golden rows of a bundle: ``inputs`` / ``outputs`` name → array (batch axis 0; a rank-0 input is one
    value, fed with every row), and ``info``."""

    inputs: dict[str, np.ndarray]
    outputs: dict[str, np.ndarray]
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def rows(self) -> int:
        return count_rows(self.inputs) or count_rows(self.outputs)


def count_rows(arrays: Mapping[str, np.ndarray]) -> int:
    """Rows of ``arrays``: axis 0 of the first array that has one (a rank-0 array holds no rows); 0 if none has."""
    return next((int(np.shape(a)[0]) for a in arrays.values() if np.ndim(a)), 0)


def take_rows(arrays: Mapping[str, np.ndarray], index: Any) -> dict[str, np.ndarray]:
    """``arrays`` with every batched array cut to rows ``index`` (a slice or indices along axis 0); a rank-0 array
    (a scalar flag such as ``temperature``: one value, no rows) is kept whole, to go unchanged with every cut."""
    return {k: v[index] if np.ndim(v) else v for k, v in arrays.items()}


def has_golden(manifest: Manifest) -> bool:
    return INPUTS_FILE in manifest.files and OUTPUTS_FILE in manifest.files


# golden rows are at most 256 KiB uncompressed when dsedge build writes them (toolchain/golden.py): a file that
# declares far more is not one, whatever its hash says
_MAX_GOLDEN_BYTES = 64 << 20


def _npz(path: Path) -> dict[str, np.ndarray]:
    try:
        return read_npz(path, max_bytes=_MAX_GOLDEN_BYTES)
    except (OSError, ValueError) as e:
        raise BundleError(f"golden file {path.name} is unreadable ({e})", "rebuild the bundle") from None


def load_golden(bundle: str | os.PathLike, manifest: Manifest) -> Golden:
    """The bundle's golden rows (the manifest has been verified, so these files match their hashes).

    Raises:
        BundleError: the bundle has no golden I/O (built before dsedge wrote it, or by hand), or it is malformed.
    """
    if not has_golden(manifest):
        scalars = [s.name for s in manifest.inputs if not s.shape]
        if scalars and len(scalars) == len(manifest.inputs):
            hint = (f"its input(s) {', '.join(map(repr, scalars))} have no batch axis to cut golden rows from "
                    "(report.json's notes say so); check it with `dsedge bench` or your own data")
        elif scalars:  # built before golden I/O carried rank-0 inputs
            hint = (f"rebuild it with this version's `dsedge build`: it was built when a rank-0 input such as "
                    f"{scalars[0]!r} left a bundle without golden I/O")
        else:
            hint = "rebuild it with `dsedge build` (bundles carry golden I/O since dsedge 0.1)"
        raise BundleError("this bundle has no golden I/O (golden/inputs.npz, golden/outputs.npz)", hint)
    root = Path(bundle)
    inputs, outputs = _npz(root / INPUTS_FILE), _npz(root / OUTPUTS_FILE)
    try:
        info = json.loads((root / INFO_FILE).read_text(encoding="utf-8")) if INFO_FILE in manifest.files else {}
    except (ValueError, RecursionError) as e:  # hash-listed, so written like this (by hand or a foreign tool)
        raise BundleError(f"golden file {INFO_FILE} is not valid JSON ({e})", "rebuild the bundle") from None
    if not isinstance(info, dict):
        raise BundleError(f"golden file {INFO_FILE} holds a {type(info).__name__}, not a JSON object",
                          "rebuild the bundle")
    missing = [s.name for s in manifest.inputs if s.name not in inputs]
    if missing or not outputs:
        raise BundleError(f"golden I/O lacks input {missing[0]!r}" if missing else "golden I/O holds no outputs",
                          "rebuild the bundle")
    _check_golden_arrays(manifest, inputs, outputs)
    return Golden(inputs, outputs, info)


def _check_golden_arrays(manifest: Manifest, inputs: Mapping[str, np.ndarray],
                         outputs: Mapping[str, np.ndarray]) -> None:
    """Golden arrays the check can run: inputs of the manifest's dtypes and ranks (a rank-0 input is one value),
    outputs the manifest lists, and the same number (>= 1) of rows in every batched input and every output, with at
    least one batched input to count them. Raises BundleError (the bundle cannot be checked, exit 2) rather
    than a backend traceback or a misleading "outside tolerance"."""
    for s in manifest.inputs:
        a = inputs[s.name]
        if (s.dtype != "bfloat16" and a.dtype != np.dtype(s.dtype)) or a.ndim != len(s.shape):
            raise BundleError(f"golden input {s.name!r} is {a.dtype} {list(a.shape)}, the manifest's input is "
                              f"{s.dtype} {list(s.shape)}", "rebuild the bundle")
    names = {s.name for s in manifest.outputs}
    extra = sorted(set(outputs) - names)
    if extra:
        raise BundleError(f"golden output {extra[0]!r} is not an output of the bundle ({', '.join(sorted(names))})",
                          "rebuild the bundle")
    if all(not s.shape for s in manifest.inputs):
        raise BundleError("golden I/O of a bundle whose inputs are all rank-0 has no rows to check (no input has a "
                          "batch axis)", "check it with `dsedge bench` or your own data")
    for s in manifest.outputs:  # a rank-0 golden output (one value, no rows) only where the output has no axis
        if s.name in outputs and s.shape and not outputs[s.name].ndim:
            raise BundleError(f"golden output {s.name!r} is one value ({outputs[s.name].dtype} []), the manifest's "
                              f"output is {s.dtype} {list(s.shape)}", "rebuild the bundle")
    used = {**{s.name: inputs[s.name] for s in manifest.inputs if s.shape},
            **{k: a for k, a in outputs.items() if a.ndim}}
    rows = {k: (a.shape[0] if a.ndim else 0) for k, a in used.items()}
    if len(set(rows.values())) != 1 or not next(iter(rows.values())):
        raise BundleError("golden arrays hold " + ", ".join(f"{k} {n}" for k, n in rows.items()) + " rows; every "
                          "one needs the same number of rows, at least 1", "rebuild the bundle")


def batch_limits(inputs: list[IOSpec], shape_ranges: Mapping[str, Mapping[str, int]]) -> tuple[int, int]:
    """(min, max) rows one call may take: the batch symbol's shape range, a static first dim, or (1, 1 << 30), from
    the first input that has a batch axis (a rank-0 input has none)."""
    first = next((s.shape[0] for s in inputs if s.shape), None)
    if isinstance(first, int):
        return first, first
    rng = shape_ranges.get(str(first), {}) if first is not None else {}
    return int(rng.get("min", 1)), int(rng.get("max", 1 << 30))


def run_rows(run: Callable[[dict[str, np.ndarray]], Mapping[str, np.ndarray]], feeds: Mapping[str, np.ndarray],
             limits: tuple[int, int] = (1, 1 << 30), calls: dict[str, list[np.ndarray]] | None = None
             ) -> dict[str, np.ndarray]:
    """Run ``feeds`` (batch axis 0) in calls of ``limits`` rows; a short last call is padded by repeating its last
    row (an engine with a static or minimum batch), and the padding is cut from the outputs. A rank-0 feed (a scalar
    flag) is no rows: it goes unchanged with every call, and the row count comes from the batched feeds (all rank-0:
    one call, its outputs as they are).

    A rank-0 output (a loss, a count: one value per call, not rows) comes back as the first call's value; ``calls``,
    when given, receives every call's value of each rank-0 output (name → list in call order), for ``compare``."""
    if not any(np.ndim(v) for v in feeds.values()):
        out = {k: np.asarray(v) for k, v in run(dict(feeds)).items()}
        if calls is not None:
            calls.update({k: [v] for k, v in out.items() if not v.ndim})
        return out
    lo, hi = max(1, limits[0]), max(1, limits[1])
    n = count_rows(feeds)
    parts: dict[str, list[np.ndarray]] = {}
    for i in range(0, n, hi):
        chunk = take_rows(feeds, slice(i, i + hi))
        rows = count_rows(chunk)
        if rows < lo:
            chunk = {k: np.concatenate([v, np.repeat(v[-1:], lo - rows, axis=0)]) if np.ndim(v) else v
                     for k, v in chunk.items()}
        for k, v in run(chunk).items():
            v = np.asarray(v)
            parts.setdefault(k, []).append(v[:rows] if v.ndim else v)
    if calls is not None:
        calls.update({k: v for k, v in parts.items() if not v[0].ndim})
    return {k: np.concatenate(v) if v[0].ndim else v[0] for k, v in parts.items()}


def compare(reference: Mapping[str, np.ndarray], got: Mapping[str, np.ndarray],
            calls: Mapping[str, list[np.ndarray]] | None = None) -> dict[str, dict[str, float]]:
    """Per output of ``reference``: ``cosine_min`` (per row, float64) and ``max_abs_diff`` of ``got`` against it.
    A rank-0 reference output (stored once) is compared with each call's value, ``calls[name]`` from ``run_rows``
    (else ``got[name]`` alone): one value per row, its cosine is sign agreement.

    Raises:
        OutputMismatchError: an output is missing or has another shape.
    """
    out = {}
    for name, r in reference.items():
        if name not in got:
            raise OutputMismatchError(f"the backend gave no output {name!r}", "rebuild the engine / bundle")
        # a batched output: its rows; a rank-0 one: every call's value (else the one given)
        each = [np.asarray(v) for v in ((calls or {}).get(name, [got[name]]) if not r.ndim else [got[name]])]
        bad = next((g for g in each if g.shape != r.shape), None)
        if bad is not None:
            raise OutputMismatchError(f"output {name!r} has shape {list(bad.shape)}, golden {list(r.shape)}",
                                      "check the engine's optimization profile covers the golden shapes")
        if r.ndim:
            a = r.reshape(len(r), -1).astype(np.float64)
            b = each[0].reshape(len(r), -1).astype(np.float64)
        else:  # one value, stored once: a row of it per call
            b = np.stack(each).reshape(len(each), 1).astype(np.float64)
            a = np.broadcast_to(r.astype(np.float64), b.shape)
        cos = (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1) + 1e-12)
        both_zero = (np.linalg.norm(a, axis=1) == 0) & (np.linalg.norm(b, axis=1) == 0)
        cos = np.where(both_zero, 1.0, cos)
        diff = float(np.max(np.abs(a - b))) if a.size else 0.0
        out[name] = {"cosine_min": float(np.nan_to_num(cos.min(), nan=-1.0)) if len(cos) else 1.0,
                     "max_abs_diff": diff if np.isfinite(diff) else float("inf")}
    return out


def tolerances(reference: Mapping[str, np.ndarray], measured: Mapping[str, Mapping[str, float]]) -> dict[str, Any]:
    """A variant's manifest ``golden`` entry from its build-time figures (``compare`` on ORT CPU)."""
    out = {}
    for name, m in measured.items():
        floor = ABS_FLOOR_REL * float(np.max(np.abs(reference[name]))) if reference[name].size else 0.0
        out[name] = {"cosine_min": round(m["cosine_min"], 6),
                     "max_abs_diff": float(f"{max(m['max_abs_diff'], floor, 1e-6):.6g}"),
                     "measured_max_abs_diff": float(f"{m['max_abs_diff']:.6g}")}
    return out


@dataclass
class GoldenReport:
    """The outcome of a golden check. ``outputs``: per output, what was measured here, what is allowed, ``ok``."""

    variant: str
    backend: str
    providers: list[str]
    rows: int
    outputs: dict[str, dict[str, Any]]

    @property
    def passed(self) -> bool:
        return all(o["ok"] for o in self.outputs.values())

    def failures(self) -> list[str]:
        """One phrase per failing figure, e.g. ``"sentence_embedding: cosine min 0.71 < allowed 0.985"``."""
        out = []
        for name, o in self.outputs.items():
            if o["cosine_min"] < o["cosine_min_allowed"]:
                out.append(f"{name}: cosine min {o['cosine_min']:.5f} < allowed {o['cosine_min_allowed']:.5f}")
            if not o["max_abs_diff"] <= o["max_abs_diff_allowed"]:
                out.append(f"{name}: max abs diff {o['max_abs_diff']:.4g} > allowed {o['max_abs_diff_allowed']:.4g}")
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"variant": self.variant, "backend": self.backend, "providers": self.providers, "rows": self.rows,
                "passed": self.passed, "outputs": self.outputs, "failures": self.failures()}


def judge(variant: Variant, here: Mapping[str, Mapping[str, float]], *, backend: str = "", providers: list[str] = (),
          rows: int = 0) -> GoldenReport:
    """Compare figures measured here with the variant's build-time ``golden`` entry.

    Raises:
        BundleError: the variant has no golden tolerances for a compared output.
    """
    outs = {}
    for name, m in here.items():
        built = variant.golden.get(name)
        if not built:
            raise BundleError(f"variant {variant.name!r} has no golden tolerance for output {name!r}",
                              "rebuild the bundle")
        cos_allowed = float(built["cosine_min"]) - COSINE_SLACK
        abs_allowed = ABS_FACTOR * float(built["max_abs_diff"])
        outs[name] = {"cosine_min": round(m["cosine_min"], 6), "cosine_min_allowed": round(cos_allowed, 6),
                      "cosine_min_build": float(built["cosine_min"]),
                      "max_abs_diff": float(f"{m['max_abs_diff']:.6g}"),
                      "max_abs_diff_allowed": float(f"{abs_allowed:.6g}"),
                      "max_abs_diff_build": float(built["max_abs_diff"]),
                      "ok": bool(m["cosine_min"] >= cos_allowed and m["max_abs_diff"] <= abs_allowed)}
    return GoldenReport(variant.name, backend, list(providers), rows, outs)


def check_run(bundle: str | os.PathLike, manifest: Manifest, variant: Variant,
              run: Callable[[dict[str, np.ndarray]], Mapping[str, np.ndarray]], *, backend: str = "",
              providers: list[str] = (), golden: Golden | None = None,
              limits: tuple[int, int] | None = None) -> GoldenReport:
    """Run the golden inputs through ``run`` (a backend's ``run``) and judge the answers. ``limits``: rows per call
    (default: the manifest's batch range; a TensorRT engine passes its profile's).

    Raises:
        BundleError: no golden I/O. OutputMismatchError: an output is missing or misshapen.
    """
    golden = golden or load_golden(bundle, manifest)
    feeds = {s.name: golden.inputs[s.name] for s in manifest.inputs}
    calls: dict[str, list[np.ndarray]] = {}
    got = run_rows(run, feeds, limits or batch_limits(manifest.inputs, manifest.shape_ranges), calls)
    return judge(variant, compare(golden.outputs, got, calls), backend=backend, providers=providers,
                 rows=golden.rows)


def require_pass(report: GoldenReport, what: str = "") -> GoldenReport:
    """Return ``report`` if it passed; else raise OutputMismatchError with the figures.

    ``what`` names the thing checked in the message (default: the variant on its backend)."""
    if report.passed:
        return report
    subject = what or f"variant {report.variant!r} on {report.backend or 'this backend'}"
    raise OutputMismatchError(f"{subject} answers outside the build-time tolerance on the bundle's "
                              f"{report.rows} golden inputs: {'; '.join(report.failures())}",
                              "this engine/provider does not compute what was measured at build: try another "
                              "provider (providers=['CPUExecutionProvider']) or variant, and report the figures")


def check_backend(bundle: str | os.PathLike, manifest: Manifest, variant: Variant, backend: Any) -> GoldenReport:
    """``dsedge.load(check_outputs=True)``: check ``backend`` (a loaded backend) and raise if it fails.

    Raises:
        BundleError: no golden I/O. OutputMismatchError: outside tolerance (figures in the message)."""
    report = check_run(bundle, manifest, variant, backend.run, backend=getattr(backend, "name", ""),
                       providers=list(getattr(backend, "providers", [])), limits=getattr(backend, "batch_limits", None))
    return require_pass(report)
