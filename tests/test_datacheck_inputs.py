"""``dsedge data check`` on awkward inputs: NA tokens in CSV, ``--html X.json``, semicolon/tab-separated ``.csv``,
non-regular paths, and the documented ``checks.toml`` example, on small slices of the real fraud CSV."""
from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path

import pytest

pytest.importorskip("datasketch", reason="dsedge data check needs the `data` extra")

from dsedge.cli import main  # noqa: E402
from dsedge.toolchain.datacheck import check_data  # noqa: E402
from dsedge.toolchain.datacheck import schema as dc_schema  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def run_cli(args: list[str], capsys) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as e:
        main(args)
    out = capsys.readouterr()
    return e.value.code, out.out, out.err


def status(report: dict) -> dict[str, str]:
    return {c["id"]: c["status"] for c in report["checks"]}


@pytest.fixture
def fraud_lines(shared_data: Path) -> list[str]:
    """The header, every 50th legitimate row and every 10th fraud of the fraud CSV: 209 + 50 rows spread over the
    file (both classes, no repeated rows, no feature that separates them alone), so every check passes."""
    lines = (shared_data / "creditcard-fraud-ulb" / "creditcard_fraud_subsample.csv").read_text().splitlines()
    header, rows = lines[0], lines[1:]
    legit = [r for r in rows if r.rsplit(",", 1)[1].strip('"') == "0"][::50]
    fraud = [r for r in rows if r.rsplit(",", 1)[1].strip('"') == "1"][::10]
    return [header] + legit + fraud


def write(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n")
    return path


# ---------------------------------------------------------------- 1. NA tokens in CSV are missing
def test_csv_na_tokens_are_pandas_defaults_less_blank():
    pd_parsers = pytest.importorskip("pandas._libs.parsers")
    assert dc_schema.CSV_NA_TOKENS == set(pd_parsers.STR_NA_VALUES) - {""}
    kinds, num = dc_schema.csv_kinds(["1.5", "NaN", " nan ", "NA", "null", "", "  ", "inf", "-inf", "abc", "N/A"])
    assert kinds.tolist() == ["number", "missing", "missing", "missing", "missing", "empty", "empty", "number",
                              "number", "string", "missing"]
    assert num[0] == 1.5 and num[7] == float("inf") and num[8] == float("-inf")


def test_nan_cells_in_a_csv_count_as_missing_not_as_type_mismatches(fraud_lines, tmp_path, capsys):
    header = fraud_lines[0].split(",")
    amount = header.index("Amount")
    rows = [r.split(",") for r in fraud_lines[1:]]
    tokens = ["NaN", "nan", "NA", "null", "N/A"]
    for i, tok in enumerate(tokens):          # 5 of 259 rows: 1.9 % missing, > warn 0.01, < fail 0.1
        rows[i * 7][amount] = tok
    p = write(tmp_path / "na.csv", [fraud_lines[0]] + [",".join(r) for r in rows])
    code, out, err = run_cli(["data", "check", str(p), "--json"], capsys)
    r = json.loads(out)
    assert code == 0, err
    f = r["fields"]["Amount"]
    assert (f["type"], f["missing"], f["empty"], f["type_mismatches"]) == ("number", 5, 0, 0)
    assert f["missing_examples"] == ["line 2", "line 9", "line 16", "line 23", "line 30"]   # rows 0, 7, ..., 28
    assert status(r)["schema.types"] == "pass" and status(r)["schema.missing"] == "warn"
    col = r["tabular"]["columns"]["Amount"]
    assert (col["finite"], col["nonfinite"]) == (254, 0) and status(r)["tabular.ranges"] == "pass"


def test_na_tokens_in_the_label_column_are_missing_labels_not_a_class(fraud_lines, tmp_path):
    header = fraud_lines[0].split(",")
    label = header.index("Class")
    rows = [r.split(",") for r in fraud_lines[1:]]
    for i, tok in enumerate(["NA", "null", "N/A", "None", ""]):  # 5 legitimate rows lose their label
        rows[i * 7][label] = tok
    r = check_data(str(write(tmp_path / "na_label.csv", [fraud_lines[0]] + [",".join(x) for x in rows])))
    assert r["tabular"]["classes"] == {"0": 204, "1": 50}  # 209 - 5: no "NA" / "null" / "N/A" / "None" class
    f = r["fields"]["Class"]
    assert (f["missing"], f["empty"], f["type_mismatches"]) == (4, 1, 0)


# ---------------------------------------------------------------- 2. --html X.json is refused
def test_html_path_ending_in_json_is_refused_and_nothing_written(fraud_lines, tmp_path, capsys):
    p = write(tmp_path / "f.csv", fraud_lines)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    for name in ("report.json", "REPORT.JSON"):
        code, out, err = run_cli(["data", "check", str(p), "--html", str(out_dir / name)], capsys)
        assert code == 2 and out == "" and "Traceback" not in err
        assert "would overwrite the HTML" in err and "hint: give the page an .html name" in err
        assert len(err.strip().splitlines()) == 2                   # error line + hint line
    assert list(out_dir.iterdir()) == []
    code, _, err = run_cli(["data", "check", str(p), "--html", str(out_dir / "report.html")], capsys)
    assert code == 0, err
    assert sorted(f.name for f in out_dir.iterdir()) == ["report.html", "report.json"]
    assert (out_dir / "report.html").read_text().startswith("<!doctype html>")


# ---------------------------------------------------------------- 3. ;- or tab-separated .csv
@pytest.mark.parametrize("sep", [";", "\t"])
def test_semicolon_or_tab_separated_csv_is_read_with_its_delimiter(fraud_lines, tmp_path, sep):
    comma = write(tmp_path / "comma.csv", fraud_lines)
    other = write(tmp_path / "other.csv", [ln.replace(",", sep) for ln in fraud_lines])
    a, b = check_data(str(comma)), check_data(str(other))
    assert b["rows"] == 259 and len(b["fields"]) == 31 and "Class" in b["fields"]
    assert b["tabular"]["label"] == "Class" and b["tabular"]["classes"] == {"0": 209, "1": 50}
    assert set(status(b).values()) == {"pass", "skip"} and status(b)["tabular.leakage"] == "pass"
    for key in ("fields", "tabular", "duplicates", "checks"):
        assert b[key] == a[key], key
    sharded = check_data(str(other), shard_bytes=2048)               # every shard reads with the sniffed delimiter
    assert sharded["run"]["shards"] > 3 and sharded["checks"] == a["checks"]


# ---------------------------------------------------------------- 4. not a regular file
def test_dev_null_is_not_a_regular_file(capsys):
    if not Path("/dev/null").exists():
        pytest.skip("no /dev/null")
    code, out, err = run_cli(["data", "check", "/dev/null"], capsys)
    assert code == 2 and out == "" and "Traceback" not in err
    assert "/dev/null: not a regular file" in err and "no such file" not in err


# ---------------------------------------------------------------- 5. the documented checks.toml
def test_a_missing_path_is_one_line_and_a_hint(tmp_path, capsys):
    """A user's pass: click's own "Error: Invalid value for 'DATA': Path ... does not exist." had no hint, where
    docs/datacheck.md promises one line and a hint."""
    code, out, err = run_cli(["data", "check", str(tmp_path / "nope.csv")], capsys)
    assert code == 2 and err.startswith("error: DATA") and "does not exist" in err and "\n  hint: " in err, err


def doc_checks_toml() -> str:
    doc = (REPO / "docs" / "datacheck.md").read_text()
    section = doc.split("## Thresholds and settings: `checks.toml`", 1)[1]
    return re.search(r"```toml\n(.*?)```", section, re.S).group(1)


def test_documented_checks_toml_runs_on_the_fraud_csv(fraud_lines, tmp_path, capsys):
    text = doc_checks_toml()
    cfg = tomllib.loads(text)
    assert cfg["tabular"]["label"] == "Class" and set(cfg["tabular"]["ranges"]) == {"Amount", "Time"}
    (tmp_path / "checks.toml").write_text(text)
    p = write(tmp_path / "f.csv", fraud_lines)
    code, out, err = run_cli(["data", "check", str(p), "--config", str(tmp_path / "checks.toml"), "--json"], capsys)
    assert code == 0, err
    r = json.loads(out)
    s = status(r)
    assert s["tokens.unknown"] == "skip" and s["tabular.ranges"] == "pass" and set(s.values()) == {"pass", "skip"}
    assert r["tabular"]["classes"] == {"0": 209, "1": 50}
    assert next(c for c in r["checks"] if c["id"] == "dedup.exact")["limits"] == "warn>0, fail>0.01"


# ---------------------------------------------------------------- --html (and its .json) inside a bundle is refused
@pytest.mark.parametrize("page", ["report.html", "manifest.html", "golden/golden.html", "models/fp32.onnx"])
def test_html_or_its_json_over_a_bundles_file_is_refused_before_the_scan(tmp_path, capsys, monkeypatch, page):
    """Found by a user: `data check X.csv --html B.dse/report.html` wrote the JSON report as B.dse/report.json,
    replacing the bundle's hash-listed build report (the bundle no longer loaded), exit 0/1 and no warning."""
    import dsedge.toolchain.datacheck as datacheck
    from dsedge.runtime.bundle import verify_bundle
    from tiny_models import tiny_bundle

    bundle = tiny_bundle(tmp_path / "mlp-cpu.dse", tmp_path, report={
        "schema": "dsedge.build-report/1", "bundle": "mlp-cpu.dse", "target": "cpu", "precision": "fp32",
        "variants": [{"name": "fp32", "precision": "fp32"}], "wall_time_s": 1.0},
        extra_files={"golden/golden.json": "{}"})
    assert {"report.json", "golden/golden.json"} <= set(json.loads((bundle / "manifest.json").read_text())["files"])
    before = {p.relative_to(bundle).as_posix(): p.read_bytes() for p in sorted(bundle.rglob("*")) if p.is_file()}
    csv = write(tmp_path / "d.csv", ["a,b", "1,2", "3,4"])

    def no_scan(*_a, **_k):
        raise AssertionError("the scan ran")

    monkeypatch.setattr(datacheck, "check_data", no_scan)
    code, out, err = run_cli(["data", "check", str(csv), "--html", str(bundle / page)], capsys)
    assert code == 2 and out == "" and "Traceback" not in err, err
    assert err.startswith("error: --html") and "is a file of the bundle" in err, err
    assert len(err.strip().splitlines()) == 2, err                  # error line + hint line
    after = {p.relative_to(bundle).as_posix(): p.read_bytes() for p in sorted(bundle.rglob("*")) if p.is_file()}
    assert after == before and verify_bundle(bundle).variant().name == "fp32"


def test_html_or_its_json_over_the_data_itself_is_refused(tmp_path, capsys):
    csv = write(tmp_path / "d.csv", ["a,b", "1,2", "3,4"])
    data = csv.read_bytes()
    code, out, err = run_cli(["data", "check", str(csv), "--html", str(csv)], capsys)
    assert code == 2 and "would be written over DATA" in err and "Traceback" not in err, err
    assert csv.read_bytes() == data and sorted(p.name for p in tmp_path.iterdir()) == ["d.csv"]
