"""Property-based tests: valid and invalid manifests, target profiles, request inputs and CLI numeric flags either
work or raise a DsedgeError — never another exception type, never a hang."""
from __future__ import annotations

import contextlib
import copy
import io
import json
import math
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import dsedge
from dsedge.runtime.bundle import MANIFEST, hash_files, verify_bundle
from dsedge.runtime.errors import DsedgeError
from dsedge.runtime.io import check_request_options
from dsedge.targets import load_profile
from tiny_models import mlp_onnx, tiny_bundle

PROPS = settings(deadline=None, derandomize=True, max_examples=60, database=None,
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])

# Values a careless or hostile editor might put anywhere: wrong types, huge/negative/non-finite numbers, paths.
SCALARS = st.one_of(
    st.none(), st.booleans(),
    st.integers(min_value=-2**70, max_value=2**70),
    st.sampled_from([0, 1, -1, -5, 10**12, 2**31, 2**63, 65536, 65537]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([float("nan"), float("inf"), -float("inf"), 1.5, 0.0, -0.0]),
    st.text(max_size=12),
    st.sampled_from(["../x", "/etc/passwd", "..", "a/../../b", "models/fp32.onnx", "fp32", "batch", "1", "", "é"]),
)
VALUES = st.recursive(SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                         st.dictionaries(st.text(max_size=6), inner, max_size=3)),
                      max_leaves=6)


def _paths(doc, prefix=()):
    yield prefix
    if isinstance(doc, dict):
        for k, v in doc.items():
            yield from _paths(v, (*prefix, k))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            yield from _paths(v, (*prefix, i))


def _mutate(doc, path, value, mode):
    if not path:
        return value
    parent = doc
    for p in path[:-1]:
        parent = parent[p]
    last = path[-1]
    if mode == "delete" and isinstance(parent, dict):
        del parent[last]
    elif mode == "add" and isinstance(parent, dict):
        parent[f"{last}_x"] = value
    else:
        parent[last] = value
    return doc


@pytest.fixture(scope="module")
def base_bundle(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("props")
    return tiny_bundle(tmp / "mlp-cpu.dse", tmp)


@PROPS
@given(data=st.data())
def test_any_rehashed_manifest_edit_loads_and_runs_or_is_a_dsedge_error(base_bundle, data):
    original = json.loads((base_bundle / MANIFEST).read_text())
    doc = copy.deepcopy(original)
    paths = [p for p in _paths(doc) if p[:1] != ("files",)]
    path = data.draw(st.sampled_from(paths), label="path")
    doc = _mutate(doc, path, data.draw(VALUES, label="value"),
                  data.draw(st.sampled_from(["set", "delete", "add"]), label="mode"))
    if isinstance(doc, dict):
        doc["files"] = hash_files(base_bundle)
    try:
        (base_bundle / MANIFEST).write_text(json.dumps(doc))
        try:
            s = dsedge.load(base_bundle)
        except DsedgeError:
            return
        try:
            x = {"x": np.ones((1, 64), np.float32)}
            try:
                s.run(x)
                s.submit(x).result(timeout=30)
            except DsedgeError:
                pass
        finally:
            s.close()
    finally:
        (base_bundle / MANIFEST).write_text(json.dumps(original))
    verify_bundle(base_bundle)


def _toml(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf") if math.isinf(value) else repr(value)
    if isinstance(value, int):
        return str(value) if abs(value) < 2**63 else json.dumps(str(value))
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value if v is not None) + "]"
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{json.dumps(str(k))} = {_toml(v)}" for k, v in value.items() if v is not None) + " }"
    return '""'


PROFILE_KEYS = ["name", "backend", "precisions", "precision_order", "engine_flags", "dla_cores", "memory_gb",
                "workspace_mb", "default_budget_ms", "shapes", "opset", "compute_capability", "tensorrt", "aliases",
                "auto_by_latency", "notes", "hardware_compatibility"]
GOOD = {"name": "dev", "backend": "onnxruntime", "precisions": ["fp32", "int8"], "default_budget_ms": 20.0,
        "shapes": {"batch": {"min": 1, "opt": 4, "max": 16}}, "opset": {"min": 13, "max": 21}}


@PROPS
@given(edits=st.dictionaries(st.sampled_from(PROFILE_KEYS), VALUES, max_size=3))
def test_any_target_profile_loads_sound_or_is_a_target_error(tmp_path, edits):
    from dsedge.runtime.errors import TargetError

    doc = {**GOOD, **edits}
    p = tmp_path / "dev.toml"
    p.write_text("".join(f"{k} = {_toml(v)}\n" for k, v in doc.items() if v is not None))
    try:
        t = load_profile(p)
    except TargetError:
        return
    assert math.isfinite(t.default_budget_ms) and 0 < t.default_budget_ms <= 3.6e6
    assert all(1 <= r["min"] <= r["opt"] <= r["max"] <= 65536 for r in t.shapes.values())
    assert set(t.precision_order) <= set(t.precisions) and t.opset["min"] <= t.opset["max"]
    from dsedge.runtime.names import NAME_RE

    assert NAME_RE.match(t.name) and all(NAME_RE.match(a) for a in t.aliases)


@pytest.fixture(scope="module")
def session(base_bundle):
    s = dsedge.load(base_bundle)
    yield s
    s.close()


DTYPES = st.sampled_from([np.float32, np.float64, np.float16, np.int64, np.int32, np.uint8, np.bool_])


@PROPS
@given(dtype=DTYPES, shape=st.lists(st.integers(0, 70), max_size=3),
       fill=st.sampled_from([0.0, 1.0, float("nan"), float("inf"), -1e30]),
       name=st.sampled_from(["x", "y", ""]), budget=SCALARS, priority=SCALARS)
def test_any_request_answers_or_is_a_dsedge_error(session, dtype, shape, fill, name, budget, priority):
    with np.errstate(all="ignore"):
        arr = np.full(shape, fill).astype(dtype)
    try:
        session.run({name: arr})
    except DsedgeError:
        pass
    try:
        answer = session.submit({name: arr}, budget_ms=budget, priority=priority).result(timeout=30)
    except DsedgeError:
        return
    assert answer is not None


@settings(deadline=None, derandomize=True, max_examples=300, database=None)
@given(budget=SCALARS, priority=SCALARS)
def test_request_options_are_sound_numbers_or_input_errors(budget, priority):
    from dsedge.runtime.errors import InputError

    try:
        b, p = check_request_options(budget, priority, 50.0)
    except InputError:
        return
    assert type(b) is float and math.isfinite(b) and 0 < b <= 3.6e6 and type(p) is int


NUMBERS = st.one_of(st.sampled_from(["nan", "inf", "-inf", "1e400", "-1", "0", "abc", "", "0.5", "3"]),
                    st.integers(-3, 40).map(str), st.floats(-1e3, 1e3, allow_nan=False).map(repr))


def _cli(argv: list[str]) -> tuple[int, str]:
    from dsedge.cli import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            main(argv)
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
        else:
            code = 0
    return code, err.getvalue()


@settings(deadline=None, derandomize=True, max_examples=40, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(flag=st.sampled_from(["--iterations", "--warmup", "--duration", "--budget-ms", "--batch", "--threads",
                             "--seq-len", "--vocab-size"]), value=NUMBERS)
def test_bench_numeric_flags_work_or_fail_in_one_line(base_bundle, flag, value):
    argv = ["bench", str(base_bundle), "--iterations", "3", "--warmup", "0"]
    if flag in ("--duration",):
        argv = ["bench", str(base_bundle), "--warmup", "0"]
        if value not in ("nan", "inf", "-inf", "1e400", "abc", "") and not value.startswith("-"):
            value = str(min(float(value), 0.05)) if value.replace(".", "", 1).isdigit() else value
    code, err = _cli(argv + [flag, value])
    assert code in (0, 1, 2) and "Traceback" not in err, err


@settings(deadline=None, derandomize=True, max_examples=15, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(flag=st.sampled_from(["--threads", "--dla", "--finetune-steps", "--qat-steps", "--block-size"]), value=NUMBERS)
def test_build_numeric_flags_work_or_fail_in_one_line(tmp_path_factory, flag, value):
    tmp = tmp_path_factory.mktemp("b")
    model = mlp_onnx(Path(tmp) / "m.onnx")
    code, err = _cli(["build", "--model", str(model), "--target", "cpu", "--out", str(tmp / "o"),
                      "--precision", "fp32", flag, value])
    assert code in (0, 2) and "Traceback" not in err, err
