"""``python -m samples.ct STEP``: the CT sample end to end, each step runnable alone (run from the repo root).

    python -m samples.ct train       # dsedge train samples/ct/teacher.toml; dsedge distill samples/ct/student.toml
    python -m samples.ct build       # dsedge build --model runs/ct-{teacher,student} --target cpu / jetson
    python -m samples.ct evaluate    # FROC + timing on the held-out NIfTI volume → runs/ct-report/report.{json,png}
    python -m samples.ct plateau     # plateau-driven augmentation vs fixed, 3 seeds per arm → runs/ct-plateau
    python -m samples.ct all

Only dsedge's CLI (train, distill, build) and public API (dsedge.load, Session) are used.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import click
import numpy as np

from dsedge import DsedgeError

HERE = Path(__file__).resolve().parent
HELD_OUT = "../shared/data/ct-totalsegmentator-example/example_ct.nii.gz"
TIMING_VOLUME = "../shared/data/ct-chest-lung-pet-ct-dx-a0002"   # the whole chest: many more lung windows
# the volumes' licences and citations (their PROVENANCE.md files): CC BY 4.0 and Apache-2.0 ask for attribution
# wherever the images, or results made from them, are shown: in report.json and on report.png
BUDGET_MS = 250.0  # per batch of windows: the evaluation's planning budget, and the bundles' default budget
SOURCES = [
    {"data": "ct-chest-lung-pet-ct-dx-a0002", "licence": "CC BY 4.0 (TCIA Data Usage Policy)",
     "cite": "Li, P. et al. (2020). A Large-Scale CT and PET/CT Dataset for Lung Cancer Diagnosis (Lung-PET-CT-Dx). "
             "The Cancer Imaging Archive. https://doi.org/10.7937/TCIA.2020.NNC2-0461"},
    {"data": "ct-totalsegmentator-example", "licence": "Apache-2.0 (TotalSegmentator repository)",
     "cite": "Wasserthal, J. et al. (2023). TotalSegmentator. Radiology: Artificial Intelligence."},
]
CREDIT = ("CT: Lung-PET-CT-Dx (TCIA, CC BY 4.0), doi:10.7937/TCIA.2020.NNC2-0461; TotalSegmentator example "
          "(Apache-2.0), Wasserthal et al. 2023")
# (target, precision) builds tried per model; one that fails (e.g. a precision this dsedge version cannot build) is
# recorded with its error in builds.json, the other builds still run, and `build` then exits non-zero naming it.
# Student builds calibrate on real chest patches and validate vs fp32 on held-out NIfTI windows (calibration.py);
# ("cpu", "auto") records dsedge's own latency-measured choice (not re-evaluated: it is one of the others).
# No jetson int4: INT4 converts only the FiLM Linear layers (K 6, 16), and TensorRT's INT4 (blockwise along K,
# blocks of 64/128) takes neither, so dsedge refuses it (the bundle built before 2026-12-06 held per-channel INT4).
BUILDS = {"teacher": [("cpu", "fp32")],
          "student": [("cpu", "fp32"), ("cpu", "int8"), ("cpu", "auto"), ("jetson", "fp16"), ("jetson", "int8")]}


def _dsedge(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "dsedge", *args]
    click.echo("$ dsedge " + " ".join(args), err=True)
    return subprocess.run(cmd, text=True, capture_output=True)


@click.group()
def main() -> None:
    """The CT sample: synthetic lesions in real chest CT, 3-D detector, budgeted sliding-window inference."""


@main.command()
@click.option("-q", "--quiet", is_flag=True, help="No progress lines: dsedge's errors and result lines only.")
@click.option("--every", "interval_s", default=30.0, show_default=True, type=click.FloatRange(min=1),
              help="Seconds between progress lines (step, loss, validation loss, elapsed, time left).")
def train(quiet: bool = False, interval_s: float = 30.0) -> None:
    """Train the teacher, then distill the student (dsedge train / dsedge distill) into runs/ct-teacher and
    runs/ct-student: the out_dir of teacher.toml and student.toml (edit them to move the runs; "build --runs"
    reads them from there). Prints a progress line every --every seconds (from the run's metrics.jsonl)."""
    from ..progress import run_training

    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover
        import tomli as tomllib
    for verb, cfg, label in (("train", HERE / "teacher.toml", "teacher"),
                             ("distill", HERE / "student.toml", "student")):
        conf = tomllib.loads(cfg.read_text(encoding="utf-8"))
        click.echo(f"$ dsedge {verb} -q {cfg}", err=True)
        rc = run_training([sys.executable, "-m", "dsedge", verb, "-q", str(cfg)],
                          Path(conf["out_dir"]) / "metrics.jsonl", int(conf.get("steps", 0)), label,
                          interval_s=interval_s, quiet=quiet)
        if rc:
            raise DsedgeError(f"dsedge {verb} {cfg.name} failed (exit {rc})", "see the output above")


@main.command()
@click.option("--runs", default="runs", show_default=True)
@click.option("--out", default="runs/bundles", show_default=True)
def build(runs: str, out: str) -> None:
    """Build bundles per target and precision; writes OUT/builds.json (what built, what was refused and why), then
    exits non-zero (DsedgeError, naming them) if any build failed; DsedgeError at once if RUNS or its run
    directories ct-teacher / ct-student do not exist. A run that has not finished (no final/model.json, e.g. after
    Ctrl-C in `train`) is named once and its builds are not tried: builds.json records each of them failed.

    Student builds get ``--calib OUT/inputs/calib --heldout OUT/inputs/heldout`` (real CT patches, see
    ``calibration.py``): INT8 Q/DQ is calibrated on the first, and every variant's accuracy vs fp32 is measured on
    the second."""
    from .calibration import write_build_inputs

    _check_out_dir("--out", out)
    if not Path(runs).is_dir():
        raise DsedgeError(f"--runs {runs}: no such directory (build reads the runs ct-teacher and ct-student there)",
                          "run `python -m samples.ct train` first, or pass --runs DIR holding them")
    missing = [f"{runs}/ct-{model}" for model in BUILDS if not (Path(runs) / f"ct-{model}").is_dir()]
    if missing:
        raise DsedgeError(f"no such run directory: {', '.join(missing)}",
                          "run `python -m samples.ct train` first (it writes ct-teacher and ct-student)")
    # an unfinished run (Ctrl-C during `train`) fails every one of its builds with the same error: say it once,
    # record its rows failed without running them, and write the inputs only if a student build will run
    unfinished = {m: e for m in BUILDS if (e := _unfinished_run(Path(runs) / f"ct-{m}", f"{runs}/ct-{m}"))}
    for model, err in unfinished.items():
        n = len(BUILDS[model])
        click.echo(f"{model}: {err}; {'its build is' if n == 1 else f'its {n} builds are'} not tried\n"
                   f"hint: {UNFINISHED_HINT}", err=True)
    calib = heldout = counts = None
    if "student" not in unfinished:
        calib, heldout, counts = write_build_inputs(Path(out) / "inputs")
        click.echo(f"calibration: {counts['calibration']['patches']} chest patches; held-out: "
                   f"{counts['heldout']['patches']} windows of the held-out volume", err=True)
    results = []
    for model, plans in BUILDS.items():
        for target, precision in plans:
            if model in unfinished:
                results.append({"model": model, "target": target, "precision": precision, "ok": False,
                                "error": f"error: {unfinished[model]} hint: {UNFINISHED_HINT}"})
                continue
            dest = Path(out) / f"{model}-{target}-{precision}"
            data = ["--calib", str(calib), "--heldout", str(heldout)] if model == "student" else []
            p = _dsedge("build", "--model", f"{runs}/ct-{model}", "--target", target, "--precision", precision,
                        "--out", str(dest), "--threads", "2", "--no-fp32", "--budget-ms", f"{BUDGET_MS:g}", *data,
                        "--json")
            row = {"model": model, "target": target, "precision": precision, "ok": p.returncode == 0}
            if p.returncode == 0:
                row["bundle"] = str(next(dest.glob("*.dse")))
                try:
                    rep = json.loads(p.stdout.strip().splitlines()[-1])
                    row["wall_time_s"] = rep.get("wall_time_s")
                    row["built_precision"] = rep.get("precision")
                    row["validation"] = rep.get("validation")
                    row["compression"] = rep.get("compression")
                    row["variants"] = rep.get("variants")
                    if rep.get("precision_choice"):
                        row["precision_choice"] = rep["precision_choice"]
                except (ValueError, IndexError):
                    pass
            else:
                lines = [ln.strip() for ln in p.stderr.strip().splitlines() if ln.strip()]
                row["error"] = " ".join(lines[-2:])[:400] if lines else f"exit {p.returncode}"
            click.echo(f"{model} {target} {precision}: {'ok ' + row['bundle'] if row['ok'] else row['error']}",
                       err=True)
            results.append(row)
    Path(out).mkdir(parents=True, exist_ok=True)
    (Path(out) / "builds.json").write_text(json.dumps({"inputs": counts, "builds": results}, indent=2) + "\n")
    failed = [f"{r['model']} {r['target']} {r['precision']}" for r in results if not r["ok"]]
    if failed:
        raise DsedgeError(f"{len(failed)} of {len(results)} builds failed: {', '.join(failed)}",
                          f"their errors are above and in {Path(out) / 'builds.json'}")


@main.command()
@click.option("--runs", default="runs", show_default=True)
@click.option("--bundles", default="runs/bundles", show_default=True)
@click.option("--out", default="runs/ct-report", show_default=True)
@click.option("--volume", default=HELD_OUT, show_default=True, help="The held-out volume (NIfTI or DICOM dir).")
@click.option("--scans", "n_scans", default=4, show_default=True, type=click.IntRange(min=1),
              help="Lesion draws on the held-out volume.")
@click.option("--lesions", default=6, show_default=True, type=click.IntRange(min=0),
              help="Lesions per draw (fewer if the lung is too small; 0: timing only, sensitivity n/a).")
@click.option("--budget-ms", default=BUDGET_MS, show_default=True, type=click.FloatRange(min=0, min_open=True),
              help="Per-batch latency budget (batch planning).")
@click.option("--threads", default=2, show_default=True, type=click.IntRange(min=1))
@click.option("--stream", is_flag=True, help="Also run the student bundle through session.stream (per-window budget).")
@click.option("--timing-volume", default=TIMING_VOLUME, show_default=True,
              help="A whole chest volume timed (no scoring) for volume time and patches/s; '' to skip.")
@click.option("--repeats", default=3, show_default=True, type=click.IntRange(min=1),
              help="Timed passes per volume and model (after one untimed warm-up pass each); the median is reported.")
def evaluate(runs: str, bundles: str, out: str, volume: str, n_scans: int, lesions: int, budget_ms: float,
             threads: int, stream: bool, timing_volume: str, repeats: int) -> None:
    """FROC and timing on the held-out volume: runs/ct-report/report.json and report.png.

    Timing: one untimed warm-up pass per model, then REPEATS timed passes per volume with the models' order
    alternating each round; the median of the sliding window alone (detection excluded) is reported."""
    from .evaluate import ANCHORS, TIMING, ModelEntry, evaluate as run_eval
    from .report import write_json, write_png

    _check_out_dir("--out", out)
    builds_json = Path(bundles) / "builds.json"
    if not builds_json.is_file():
        raise DsedgeError(f"{builds_json}: no such file (evaluate reads the bundles that build wrote)",
                          f"run `python -m samples.ct build{'' if bundles == 'runs/bundles' else ' --out ' + bundles}` "
                          "first")
    try:
        builds = json.loads(builds_json.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DsedgeError(f"{builds_json}: not valid JSON ({e})", "run `python -m samples.ct build` again") from None
    builds = _check_builds(builds_json, builds)
    ok = {(b["model"], b["target"], b["precision"]): b["bundle"] for b in builds
          if b["ok"] and b["precision"] != "auto"}
    if not ok:
        raise DsedgeError(f"no bundle built; see {builds_json} ({len(builds)} build(s) listed, none ok)",
                          f"fix the errors recorded there, then run `python -m samples.ct build"
                          f"{'' if bundles == 'runs/bundles' else ' --out ' + bundles}` again")
    entries = [ModelEntry("student torch fp32", "torch", f"{runs}/ct-student", batch_from="student cpu fp32")]
    for (model, target, precision), path in ok.items():
        entries.append(ModelEntry(f"{model} {target} {precision}", "bundle", path))
    entries.append(ModelEntry("teacher torch fp32", "torch", f"{runs}/ct-teacher", batch_from="teacher cpu fp32"))
    entries = [e for e in entries if e.kind == "bundle" or e.batch_from in {x.name for x in entries}]
    # both volumes read before any model runs: a bad --timing-volume used to fail only after the whole held-out
    # evaluation, and neither error named its option
    scans = _read_scans("--volume", volume, n_scans, lesions, seed=100)
    chest = _read_scans("--timing-volume", timing_volume, 1, 0, seed=0) if timing_volume else []
    res = run_eval(entries, scans, budget_ms=budget_ms, threads=threads, repeats=repeats)
    models = res["models"]
    if stream and ("student", "cpu", "fp32") in ok:
        sres = run_eval([ModelEntry("student cpu fp32 (stream)", "bundle", ok[("student", "cpu", "fp32")])], scans,
                        budget_ms=budget_ms, threads=threads, stream=True, repeats=repeats)
        models.update(sres["models"])
    timing = {}
    if timing_volume:
        same = {k: v["batch_plan"]["batch_size"] for k, v in models.items()}
        tres = run_eval(entries, chest, budget_ms=budget_ms, threads=threads, repeats=repeats,
                        batch_sizes=same)["models"]
        timing = {"volume": timing_volume, "shape": list(chest[0].image.shape),
                  "models": {k: {"volume_seconds_median": v["volume_seconds_median"],
                                 "patches_per_s": v["patches_per_s"], "windows": v["per_scan"][0]["windows"],
                                 "batch_size": v["batch_plan"]["batch_size"]} for k, v in tres.items()}}
        for key, (fast, slow) in SPEEDUPS.items():
            if fast in tres and slow in tres:
                timing[key] = round(tres[slow]["volume_seconds_median"] / tres[fast]["volume_seconds_median"], 2)
    summary = _summary(models)
    report = {
        "data": {"held_out": volume, "scans": n_scans, "lesions": sum(len(s.lesions) for s in scans),
                 "lesion_diameters_mm": [round(le.diameter_mm, 1) for s in scans for le in s.lesions],
                 "lung_ml": round(float(scans[0].mask.sum()) * float(np.prod(scans[0].spacing_mm)) / 1000.0, 1),
                 "synthetic_lesions": True, "sources": SOURCES},
        "timing": TIMING.replace("REPEATS", str(repeats)),
        "builds": builds, "summary": summary, "chest_timing": timing, "anchors": ANCHORS, "models": models,
    }
    write_json(Path(out) / "report.json", report)
    curves = {k: v["froc"] for k, v in models.items()}
    best = "student cpu fp32" if "student cpu fp32" in res["detections"] else next(iter(res["detections"]))
    write_png(Path(out) / "report.png", scans[0], res["detections"][best][0], curves,
              title=f"{best}: synthetic lesions in the held-out volume (green: truth, red: detections)",
              credit=CREDIT)
    click.echo(json.dumps({"summary": summary, "chest_timing": timing}, indent=2))


UNFINISHED_HINT = ("finish it: `python -m samples.ct train` resumes from its latest checkpoint; or pass --runs DIR "
                   "holding finished runs")


def _unfinished_run(path: Path, name: str) -> str | None:
    """The error ``dsedge build`` gives a training run that has not finished (toolchain/sources.py); None for
    anything else (a finished run, or a directory that is no run: ``dsedge build`` says what it is)."""
    from dsedge.toolchain.sources import unfinished_run

    why = unfinished_run(path)
    return None if why is None else f"{name} is a training run that has not finished ({why})"


def _check_out_dir(option: str, out: str) -> None:
    """DsedgeError at once when ``out`` (created later, after minutes of work) cannot be a directory: it, or the
    nearest of its parents that exists, is a file or not writable. Nothing is created here."""
    p = Path(out)
    for q in (p, *p.parents):
        if q.exists() or q.is_symlink():
            if not q.is_dir():
                raise DsedgeError(f"{option} {out}: {'it' if q == p else q} is a file, not a directory",
                                  f"pass a directory for {option} (created if missing), or move the file away")
            if not os.access(q, os.W_OK | os.X_OK):
                raise DsedgeError(f"{option} {out}: {q} is not writable", f"pass a writable directory for {option}")
            return


def _read_scans(option: str, volume: str, n_scans: int, lesions: int, seed: int) -> list:
    """``make_scans`` with a ``SeriesError`` naming the option that gave the path."""
    from .scans import make_scans
    from .volume import SeriesError

    try:
        return make_scans(volume, n_scans, lesions, seed=seed)
    except SeriesError as e:
        raise SeriesError(f"{e} (the {option} path)", e.hint) from None


def _check_builds(path: Path, data: object) -> list[dict]:
    """builds.json's rows (``{"builds": [...]}`` or a bare list), each with model, target, precision, ok and, when
    ok, bundle; DsedgeError naming the first thing out of shape."""
    hint = "run `python -m samples.ct build` again (it writes builds.json)"
    rows = data.get("builds") if isinstance(data, dict) else data
    if not isinstance(rows, list):
        raise DsedgeError(f"{path}: not a builds file (expected {{\"builds\": [...]}}, got "
                          f"{type(data).__name__}{'' if not isinstance(data, dict) else ' without a builds list'})",
                          hint)
    need = {"model": str, "target": str, "precision": str, "ok": bool}
    for i, b in enumerate(rows):
        if not isinstance(b, dict):
            raise DsedgeError(f"{path}: builds[{i}] is a {type(b).__name__}, not an object", hint)
        for key, typ in need.items():
            if not isinstance(b.get(key), typ):
                raise DsedgeError(f"{path}: builds[{i}] has no {key!r} ({typ.__name__})", hint)
        if b["ok"] and not isinstance(b.get("bundle"), str):
            raise DsedgeError(f"{path}: builds[{i}] is ok but names no 'bundle' path", hint)
    return rows


def _parse_seeds(ctx: click.Context, param: click.Parameter, value: str) -> list[int]:
    """``--seeds 0,1,2`` → [0, 1, 2]: non-negative integers, at least one, no repeats."""
    parts = [x.strip() for x in value.split(",")]
    try:
        seeds = [int(x) for x in parts]
    except ValueError:
        raise click.BadParameter(f"{value!r}: expected comma-separated integers, e.g. 0,1,2") from None
    if any(x < 0 for x in seeds):
        raise click.BadParameter(f"{value!r}: seeds must be >= 0")
    if len(set(seeds)) != len(seeds):
        raise click.BadParameter(f"{value!r}: a seed is repeated")
    return seeds


@main.command()
@click.option("--out", default="runs/ct-plateau", show_default=True)
@click.option("--seeds", default="0,1,2", show_default=True, callback=_parse_seeds,
              help="Training seeds (comma separated).")
@click.option("--steps", default=240, show_default=True, type=click.IntRange(min=1))
@click.option("--every", default=20, show_default=True, type=click.IntRange(min=1),
              help="Steps between evaluations (the monitor's clock).")
@click.option("--train-volume", default=TIMING_VOLUME, show_default=True)
@click.option("--volume", default=HELD_OUT, show_default=True)
@click.option("--scans", "n_scans", default=4, show_default=True, type=click.IntRange(min=1))
@click.option("--lesions", default=6, show_default=True, type=click.IntRange(min=1),
              help="Lesions per draw (the arms are compared by sensitivity, so at least one).")
@click.option("--threads", default=2, show_default=True, type=click.IntRange(min=1))
def plateau(out: str, seeds: list[int], steps: int, every: int, train_volume: str, volume: str, n_scans: int,
            lesions: int, threads: int) -> None:
    """Plateau-driven random erasing vs fixed augmentation: FROC mean ± sd over seeds (OUT/plateau.json)."""
    from .plateau import markdown, run_experiment
    from .scans import make_scans

    scans = make_scans(volume, n_scans, lesions, seed=100)
    res = run_experiment(Path(out), seeds, steps, every, scans, threads,
                         log=lambda s: click.echo(s, err=True), train_volume=train_volume)
    (Path(out) / "plateau.json").write_text(json.dumps(res, indent=1) + "\n")
    click.echo(markdown(res))


SPEEDUPS = {"student_bundle_vs_student_torch_speedup": ("student cpu fp32", "student torch fp32"),
            "teacher_bundle_vs_teacher_torch_speedup": ("teacher cpu fp32", "teacher torch fp32"),
            "student_bundle_vs_teacher_torch_speedup": ("student cpu fp32", "teacher torch fp32")}


def _summary(models: dict) -> dict:
    """One line per model plus the bundle-vs-torch speed-up for the student and teacher."""
    rows = {k: {"sensitivity_at": v["froc"]["sensitivity_at"], "cpm": v["froc"]["cpm"],
                "volume_seconds": v["volume_seconds_median"], "patches_per_s": v["patches_per_s"],
                "batch_size": v["batch_plan"]["batch_size"]} for k, v in models.items()}
    out: dict = {"models": rows}
    for key, (fast, slow) in SPEEDUPS.items():
        if fast in models and slow in models:
            out[key] = round(models[slow]["volume_seconds_median"] / models[fast]["volume_seconds_median"], 2)
    out["chosen_precision"] = choose_precisions(models)
    return out


def choose_precisions(models: dict, max_cpm_drop: float = 0.02) -> dict:
    """Per target, the student variant with the lowest measured volume time whose CPM is within ``max_cpm_drop`` of
    the student fp32 bundle's (measured here on ORT CPU; jetson variants are timed on this CPU too, which says
    nothing about TensorRT speed: their choice is by accuracy only, then the lowest precision)."""
    ref = models.get("student cpu fp32")
    if ref is None or ref["froc"]["cpm"] is None:      # no lesions scored: no accuracy to choose by
        return {}
    ok = {k: v for k, v in models.items() if k.startswith("student ") and v["kind"] == "bundle"
          and "(stream)" not in k and v["froc"]["cpm"] >= ref["froc"]["cpm"] - max_cpm_drop}
    out = {}
    cpu = [k for k in ok if " cpu " in k]
    if cpu:
        out["cpu"] = min(cpu, key=lambda k: ok[k]["volume_seconds_median"]).split()[-1]
    order = ["int4", "int8", "fp16", "fp32"]
    jet = [k for k in ok if " jetson " in k]
    if jet:
        out["jetson"] = min(jet, key=lambda k: order.index(k.split()[-1]) if k.split()[-1] in order else 9).split()[-1]
    return out


@main.command("all")
@click.pass_context
def all_steps(ctx: click.Context) -> None:
    """train → build → evaluate."""
    ctx.invoke(train)
    ctx.invoke(build)
    ctx.invoke(evaluate)


def _entry() -> None:
    try:
        main(standalone_mode=True)
    except DsedgeError as e:
        click.echo(f"error: {e}" + (f"\nhint: {e.hint}" if e.hint else ""), err=True)
        sys.exit(e.exit_code)


if __name__ == "__main__":
    _entry()
