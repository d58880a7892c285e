"""Run the whole fraud sample from the repository root with dsedge's CLI and public API:

    python -m samples.fraud.run                      # prepare → train → distill → build → evaluate → stream → report
    python -m samples.fraud.run --only evaluate,stream,report   # reuse the runs and bundles in out/fraud

Steps (each a function, runnable alone):
  prepare   split by time (data.split_by_time), fit the preprocessor → OUT/preprocess.json, OUT/split.json,
            calibration/validation inputs → OUT/calib/*.npz (train rows calibrate, validation rows validate)
  train     ``dsedge train`` then ``dsedge distill`` on samples/fraud/teacher.toml and student.toml with their paths
            under OUT → OUT/teacher.toml, OUT/student.toml, runs OUT/teacher-run, OUT/student-run
  build     ``dsedge build --model RUN_DIR`` : teacher fp32 for cpu; student int4 (+ fp32) for cpu, and for jetson the
            precision auto picks (int8: TensorRT's INT4 blocks of 64 fit none of the student's layers)
            → OUT/bundles
  evaluate  test-split metrics for teacher, student, compressed student (bundles via dsedge.load) and the
            scikit-learn baseline; the threshold is chosen on the validation split
  stream    replay the contiguous Time 0–3641 s stretch through ``session.submit`` with a budget (default 3 ms)
  report    OUT/report.json + OUT/report.png, printed summary
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

import dsedge
from dsedge.runtime.files import atomic_path, write_text_atomic
from dsedge.runtime.io import check_request_options
from dsedge.runtime.storage import storage_error

from .. import data_path
from ..progress import DEFAULT_INTERVAL_S, run_training
from .baseline import baseline_scores, fit_baseline
from .data import CITATION, DEFAULT_CSV, LICENCE, REAL_BASE_RATE, STREAM_END_S, load_transactions, split_by_time
from .features import Preprocessor, SparseEncoder
from .metrics import choose_threshold, detection_metrics, threshold_metrics
from .report import check_goals, format_table, plot, write_json
from .scorer import (DEFAULT_BUDGET_MS, StreamScorer, batched_throughput, latency_summary, read_rows,
                     stream_burst)

HERE = Path(__file__).resolve().parent
STEPS = ("prepare", "train", "build", "evaluate", "stream", "report")


def dsedge_cli(*args: str) -> None:
    """Run ``dsedge ARGS`` (this interpreter's install) and stop with its exit status if it fails."""
    cmd = [sys.executable, "-m", "dsedge", *args]
    print("$ dsedge " + " ".join(args), flush=True)
    rc = subprocess.run(cmd).returncode
    if rc != 0:
        raise SystemExit(f"`dsedge {' '.join(args)}` failed with exit status {rc}")


def prepare(out: Path, csv: Path = DEFAULT_CSV, hash_buckets: int = 10_000, calib_files: int = 4,
            calib_rows: int = 128) -> tuple[Preprocessor, Any]:
    """Split, fit and save the preprocessor; write calibration inputs. Returns (preprocessor, split).

    Every file is written to a temporary path and renamed (dsedge.runtime.files): an interrupted run leaves whole
    files or none, never a truncated one that a later step would read."""
    split = split_by_time(load_transactions(csv))
    pre = Preprocessor(SparseEncoder(128, hash_buckets, "sum")).fit(split["train"])
    out.mkdir(parents=True, exist_ok=True)
    pre.to_json(out / "preprocess.json")
    write_text_atomic(out / "split.json", json.dumps(split.summary(), indent=2) + "\n")
    calib = out / "calib"
    calib.mkdir(exist_ok=True)
    rng = np.random.default_rng(0)
    for i, name in enumerate(["train"] * calib_files + ["val"] * calib_files):
        frame = split[name]
        rows = frame.iloc[np.sort(rng.choice(len(frame), size=min(calib_rows, len(frame)), replace=False))]
        # an open file: given a path without .npz (the temporary name), np.savez would add the suffix itself
        with atomic_path(calib / f"{i:02d}_{name}.npz") as tmp, open(tmp, "wb") as f:
            np.savez(f, **pre.transform(rows))
    return pre, split


def run_dirs(out: Path) -> tuple[Path, Path]:
    """The teacher and student run directories under ``out`` (OUT/teacher-run, OUT/student-run)."""
    return out / "teacher-run", out / "student-run"


def run_configs(out: Path, csv: Path = DEFAULT_CSV) -> tuple[Path, Path]:
    """teacher.toml and student.toml beside this file, pointed at ``out``: out_dir = the ``run_dirs(out)``, the
    student's teacher = OUT/teacher-run, the data = ``csv``. Written as OUT/teacher.toml and OUT/student.toml
    (returned, in that order)."""
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover
        import tomli as tomllib
    from dsedge.toolchain.train.config import dump_toml

    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, run_dir in zip(("teacher", "student"), run_dirs(out)):
        cfg = tomllib.loads((HERE / f"{name}.toml").read_text(encoding="utf-8"))
        cfg["out_dir"] = str(run_dir)
        cfg["data"]["kwargs"]["csv"] = str(csv)
        if "distill" in cfg:
            cfg["distill"]["teacher"] = str(run_dirs(out)[0])
        paths.append(out / f"{name}.toml")
        write_text_atomic(paths[-1], f"# samples/fraud/{name}.toml with its paths under {out} (samples.fraud.run)\n"
                          + dump_toml(cfg))
    return paths[0], paths[1]


def train(out: Path = Path("out/fraud"), csv: Path = DEFAULT_CSV, quiet: bool = False,
          interval_s: float = DEFAULT_INTERVAL_S) -> None:
    """Teacher with ``dsedge train``, student with ``dsedge distill``: the configs beside this file with their runs
    under ``out`` and ``csv`` as the data (``run_configs``). A progress line (step, loss, elapsed, time left) every
    ``interval_s`` seconds on stderr unless ``quiet`` (``samples.progress``); stops with the exit status of a
    command that fails."""
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover
        import tomli as tomllib
    for verb, cfg, run_dir in zip(("train", "distill"), run_configs(out, csv), run_dirs(out)):
        steps = int(tomllib.loads(cfg.read_text(encoding="utf-8")).get("steps", 0))
        print(f"$ dsedge {verb} -q {cfg}", flush=True)
        rc = run_training([sys.executable, "-m", "dsedge", verb, "-q", str(cfg)], run_dir / "metrics.jsonl", steps,
                          run_dir.name, interval_s=interval_s, quiet=quiet)
        if rc != 0:
            raise SystemExit(f"`dsedge {verb} {cfg}` failed with exit status {rc}")


def find_bundle(folder: Path, target: str) -> Path:
    """The single ``*-TARGET.dse`` bundle in ``folder`` (the name comes from the run)."""
    found = sorted(folder.glob(f"*-{target}.dse")) or sorted(folder.glob("*.dse"))
    if not found:
        raise SystemExit(f"no bundle for target {target!r} in {folder}; run the build step")
    return found[-1]


def build(out: Path, teacher_run: Path, student_run: Path, precision: str = "int4",
          budget_ms: float = DEFAULT_BUDGET_MS) -> dict[str, Path]:
    """Build the bundles with ``dsedge build`` (student at ``precision``, with its fp32 variant beside it), each
    with the scorer's ``budget_ms`` as its default budget (what bench and the latency tests judge against);
    returns role → bundle path."""
    b = out / "bundles"
    dsedge_cli("build", "--model", str(teacher_run), "--target", "cpu", "--precision", "fp32",
               "--budget-ms", f"{budget_ms:g}", "--out", str(b / "teacher"))
    for target in ("cpu", "jetson"):
        # TensorRT's INT4 is blockwise along K in blocks of 64/128: the student's layers (K 32, 45) and embedding
        # tables (16 wide) have none that fits, so INT4 for jetson is refused; auto builds what Orin's TensorRT takes
        # (INT8 Q/DQ with the calibration rows)
        p = "auto" if target == "jetson" and precision == "int4" else precision
        dsedge_cli("build", "--model", str(student_run), "--target", target, "--precision", p,
                   "--budget-ms", f"{budget_ms:g}", "--calib", str(out / "calib"), "--out", str(b / f"student-{target}"))
    return {"teacher": find_bundle(b / "teacher", "cpu"), "student": find_bundle(b / "student-cpu", "cpu"),
            "student_jetson": find_bundle(b / "student-jetson", "jetson-orin")}


def bundle_bytes(path: Path) -> int:
    """Bytes of every file in a bundle directory (all variants, manifest, build scripts)."""
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def session_scores(session: Any, inputs: dict[str, np.ndarray], batch: int = 1024) -> np.ndarray:
    """float64 [n] fraud scores ``logits[:, 1] - logits[:, 0]`` through ``session.run`` in batches (at most the
    bundle's batch range)."""
    batch_max = session.manifest.shape_ranges.get("batch", {}).get("max")
    batch = min(batch, int(batch_max)) if batch_max else batch
    n = len(inputs["dense"])
    out = session.outputs[0].name  # "logits" for trained runs
    parts = [session.run({k: v[i:i + batch] for k, v in inputs.items()})[out] for i in range(0, n, batch)]
    logits = np.concatenate(parts).astype(np.float64)
    return logits[:, 1] - logits[:, 0]


def evaluate(out: Path, bundles: dict[str, Path], pre: Preprocessor, split: Any, threads: int | None = 1) -> dict:
    """Metrics on the test split per model, threshold chosen on validation; scores kept for the plot."""
    y_val, y_test = split["val"]["Class"].to_numpy(), split["test"]["Class"].to_numpy()
    x_val, x_test = pre.transform(split["val"]), pre.transform(split["test"])
    roles: dict[str, tuple[Path, str | None]] = {}
    teacher = dsedge.load(bundles["teacher"], threads=threads)
    roles["teacher"] = (bundles["teacher"], teacher.variant.name)
    student = dsedge.load(bundles["student"], threads=threads)
    fp32 = next((v.name for v in student.manifest.variants if v.precision == "fp32"), None)
    if fp32 is not None:
        roles["student"] = (bundles["student"], fp32)
    roles["student_compressed"] = (bundles["student"], student.variant.name)
    models: dict[str, dict] = {}
    scores: dict[str, np.ndarray] = {}
    for role, (path, variant) in roles.items():
        s = dsedge.load(path, variant=variant, threads=threads)
        sv, st = session_scores(s, x_val), session_scores(s, x_test)
        thr = choose_threshold(y_val, sv)
        models[role] = {**detection_metrics(y_test, st), "operating_point": threshold_metrics(y_test, st, thr),
                        "bundle": str(path), "variant": s.variant.name, "precision": s.variant.precision,
                        "size_bytes": s.variant.size_bytes, "bundle_bytes": bundle_bytes(path)}
        scores[role] = st
    t0 = time.perf_counter()
    clf = fit_baseline(split["train"])
    fit_s = time.perf_counter() - t0
    sv, st = baseline_scores(clf, split["val"]), baseline_scores(clf, split["test"])
    models["sklearn_hgb"] = {**detection_metrics(y_test, st),
                             "operating_point": threshold_metrics(y_test, st, choose_threshold(y_val, sv)),
                             "fit_s": fit_s, "iterations": int(clf.n_iter_)}
    scores["sklearn_hgb"] = st
    if "student_jetson" in bundles:
        j = dsedge.load(bundles["student_jetson"], threads=threads)
        models["student_compressed_jetson"] = {
            **detection_metrics(y_test, session_scores(j, x_test)), "bundle": str(bundles["student_jetson"]),
            "variant": j.variant.name, "precision": j.variant.precision, "size_bytes": j.variant.size_bytes,
            "bundle_bytes": bundle_bytes(bundles["student_jetson"]),
            "providers": j.providers}
    return {"models": models, "scores": scores, "y_test": y_test}


def stream(out: Path, bundle: Path, pre: Preprocessor, threshold: float, csv: Path = DEFAULT_CSV,
           budget_ms: float = DEFAULT_BUDGET_MS, speed: float | None = None, malformed: int = 3,
           threads: int | None = 1) -> dict:
    """Replay the Time 0–3641 s stretch one transaction at a time; ``malformed`` broken rows are mixed in
    (missing column, non-numeric, NaN) to show they are rejected and counted. Also measures batched throughput."""
    session = dsedge.load(bundle, threads=threads)
    rows = [r for r in read_rows(csv) if float(r["Time"]) <= STREAM_END_S]
    broken = [{k: v for k, v in rows[0].items() if k != "V7"}, {**rows[1], "Amount": "12,50"},
              {**rows[2], "V3": "nan"}]
    for i in range(min(malformed, len(broken))):
        rows.insert(1000 * (i + 1), broken[i])
    scorer = StreamScorer(session, pre, threshold, budget_ms, on_reject="run")
    scorer.warm_up(rows[0])
    load_before = os.getloadavg()[0]
    t0 = time.perf_counter()
    scored = scorer.replay(rows, speed=speed)
    wall = time.perf_counter() - t0
    frauds = [s for s in scored if s.label == 1]
    refused = sum(scorer.stats.rejected.values())  # each one also scored late by session.run (on_reject="run")
    frame = load_transactions(csv).query("Time <= @STREAM_END_S")
    inputs = pre.transform(frame)
    run_ms = []  # the same rows one at a time through session.run: the model without the budget scheduler
    for i in range(len(frame)):
        one = {k: v[i:i + 1] for k, v in inputs.items()}
        t = time.perf_counter()
        session.run(one)
        run_ms.append((time.perf_counter() - t) * 1e3)
    with dsedge.load(bundle, threads=None) as batch_session:  # ORT's default threads: all cores
        batched = batched_throughput(batch_session, inputs, batch=1024)
        t1 = time.perf_counter()
        for _ in range(3):  # end to end: parsed rows → features → model, batched
            session_scores(batch_session, pre.transform(frame))
        e2e = {"transactions_per_s": 3 * len(frame) / (time.perf_counter() - t1)}
    with dsedge.load(bundle, threads=None) as burst_session:
        burst = stream_burst(burst_session, inputs, budget_ms) if hasattr(burst_session, "stream") else None
    session_metrics = session.metrics() if hasattr(session, "metrics") else None
    providers = list(session.providers)  # read while open: a closed session has none
    session.close()
    return {"bundle": str(bundle), "variant": session.variant.name, "providers": providers,
            "serving_api": "session.submit" if hasattr(session, "submit") else "session.run (timed)",
            "budget_ms": budget_ms, "speed": speed, "load_average_1min": [load_before, os.getloadavg()[0]],
            "rows_in": len(rows), "wall_s": wall,
            "threshold": threshold, "stats": scorer.stats.to_dict(),
            "frauds_in_stream": len(frauds), "frauds_flagged": sum(s.flagged for s in frauds),
            "legit_flagged": sum(s.flagged for s in scored if s.label == 0),
            "within_budget": (sum(not s.late and s.model_ms <= budget_ms for s in scored) / len(scored)) if scored else None,
            # refused (budget/overload/deadline) requests count in the percentiles as never answered (P99_RULE)
            "latency": {"model": latency_summary((s.model_ms for s in scored if not s.late), refused=refused),
                        "end_to_end": latency_summary((s.latency_ms for s in scored if not s.late), refused=refused),
                        "session_run": latency_summary(run_ms)},
            "throughput_batched": batched, "throughput_batched_end_to_end": e2e,
            "throughput_stream_burst": burst, "session_metrics": session_metrics,
            "_latencies": {f"session.submit, answered ({refused} refused, not drawn)": [s.model_ms for s in scored
                                                                                      if not s.late],
                           "end to end (parse+features+submit)": [s.latency_ms for s in scored if not s.late],
                           "session.run, no scheduler": run_ms}}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("out/fraud"),
                    help="every step writes here: the preprocessor and calibration inputs, the configs and runs "
                         "(OUT/teacher-run, OUT/student-run), the bundles (OUT/bundles) and the report "
                         "(default: out/fraud)")
    ap.add_argument("--csv", type=Path, default=DEFAULT_CSV)
    ap.add_argument("--only", default=",".join(STEPS), help=f"comma-separated steps of {', '.join(STEPS)}")
    ap.add_argument("--budget-ms", type=float, default=DEFAULT_BUDGET_MS)
    ap.add_argument("--speed", type=float, default=100.0,
                    help="replay at real time x SPEED (3641 s of transactions in 36 s at 100); 0: as fast as possible")
    ap.add_argument("--precision", default="int4", help="student precision for dsedge build (int4, fp32, …)")
    ap.add_argument("--threads", type=int, default=1, help="ORT intra-op threads for single-stream scoring")
    ap.add_argument("-q", "--quiet", action="store_true",
                    help="no training progress lines (by default one every 20 s: step, loss, elapsed, time left)")
    args = ap.parse_args(argv)
    if Path.cwd() != HERE.parents[1]:  # the default --csv (and the configs' factories) are relative to the repo root
        ap.error(f"run from the repository root ({HERE.parents[1]}), not {Path.cwd()}")
    steps = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = set(steps) - set(STEPS)
    if unknown or not steps:
        ap.error(f"unknown step(s) {sorted(unknown)}; choose from {STEPS}" if unknown
                 else f"--only names no step; choose from {STEPS}")
    # checked before any step runs: a bad value would otherwise fail only at the stream step, after train and build
    try:  # the same rule as every budget the SDK takes
        check_request_options(args.budget_ms, 0, name="--budget-ms")
    except dsedge.InputError as e:
        ap.error(str(e))
    if not (math.isfinite(args.speed) and args.speed >= 0):
        ap.error(f"--speed must be a finite number >= 0 (0: as fast as possible), got {args.speed}")
    if args.threads < 1:
        ap.error(f"--threads must be >= 1, got {args.threads}")
    if args.out.exists() and not args.out.is_dir():
        ap.error(f"--out {str(args.out)!r} is a file; every step writes into a directory there")
    # every step reads the same file: the default (../shared/data/…) under $DSEDGE_DATA when that is set (the stream
    # step read the default path itself and failed after training and building)
    args.csv = data_path(args.csv)
    if not args.csv.exists():
        where = f" (DSEDGE_DATA={os.environ['DSEDGE_DATA']})" if os.environ.get("DSEDGE_DATA") else ""
        ap.error(f"no transactions file at {str(args.csv)!r}{where}: pass --csv with the ULB file, or set "
                 "DSEDGE_DATA to the folder that holds creditcard-fraud-ulb/ (samples/fraud/README.md)")
    try:
        _run(args, steps)
    except (dsedge.DsedgeError, OSError) as e:  # a user error (a missing or malformed --csv, a broken bundle, a
        # path that cannot be read or written): one line and a hint
        err = storage_error(e, "reading or writing") if isinstance(e, OSError) else e
        if err is None:
            raise
        print(f"error: {err}" + (f"\n  hint: {err.hint}" if err.hint else ""), file=sys.stderr)
        raise SystemExit(err.exit_code) from None


def _run(args: argparse.Namespace, steps: list[str]) -> None:
    """The steps of ``main`` with its checked arguments."""
    out = args.out
    teacher_run, student_run = run_dirs(out)
    if "prepare" in steps or not (out / "preprocess.json").exists():
        pre, split = prepare(out, args.csv)
    else:
        pre, split = Preprocessor.from_json(out / "preprocess.json"), split_by_time(load_transactions(args.csv))
    if "train" in steps:
        train(out, args.csv, quiet=args.quiet)
    if "build" in steps:
        bundles = build(out, teacher_run, student_run, args.precision, args.budget_ms)
    if not {"evaluate", "stream", "report"} & set(steps):
        return
    if "build" not in steps:
        b = out / "bundles"
        bundles = {"teacher": find_bundle(b / "teacher", "cpu"), "student": find_bundle(b / "student-cpu", "cpu")}
        if any((b / "student-jetson").glob("*.dse")):  # a failed build leaves at most its empty folder
            bundles["student_jetson"] = find_bundle(b / "student-jetson", "jetson-orin")
    ev = evaluate(out, bundles, pre, split, threads=args.threads)
    thr = ev["models"]["student_compressed"]["operating_point"]["threshold"]
    st = stream(out, bundles["student"], pre, thr, args.csv, args.budget_ms, args.speed or None, threads=args.threads)
    lat = st.pop("_latencies")
    report = {"data": {"csv": str(args.csv), "licence": LICENCE, "cite": CITATION, "split": split.summary(),
                       "real_base_rate": REAL_BASE_RATE,
                       "caveat": "the subsample keeps all 492 frauds (4.5 %); PR-AUC and precision are also given "
                                 "reweighted to the real 0.172 % base rate"},
              "models": ev["models"], "stream": st,
              "goals": check_goals(ev["models"], st["latency"], st["throughput_batched"]),
              "machine_note": "2 shared CPU cores, timings noisy"}
    write_json(report, out / "report.json")
    plot(out / "report.png", ev["y_test"], ev["scores"], lat, args.budget_ms)
    print(format_table(ev["models"]))
    print(json.dumps({"stream": {k: st[k] for k in ("serving_api", "frauds_in_stream", "frauds_flagged",
                                                    "legit_flagged", "stats", "latency", "throughput_batched",
                                                    "throughput_stream_burst")},
                      "goals": report["goals"]}, indent=2, default=float))
    print(f"wrote {out / 'report.json'} and {out / 'report.png'}")


if __name__ == "__main__":
    main()
