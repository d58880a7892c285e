"""Open Inference Protocol (KServe v2) vocabulary shared by the HTTP and gRPC front ends.

Datatypes in v2 spelling (``FP32``, ``INT64``…), request parameters (dsedge's ``budget_ms``; Triton's ``priority``
and ``timeout`` in µs), and ``ServeError``: one error with the HTTP status and gRPC code it maps to.

Status mapping (what a client sees for each way a request can end):

=====================  ====  ==================  ===============================================
outcome                HTTP  gRPC                when
=====================  ====  ==================  ===============================================
answered               200   OK                  ``Result`` without error
``overload``           429   RESOURCE_EXHAUSTED  queue full / predicted queueing breaks the budget
``budget``             503   UNAVAILABLE         no variant can meet the budget even alone
``deadline``           503   UNAVAILABLE         the deadline passed (or can no longer be met) while queued
``shutdown``           503   UNAVAILABLE         the server is draining (SIGTERM)
malformed request      400   INVALID_ARGUMENT    datatype, shape, missing input, garbage JSON…
unknown model/version  404   NOT_FOUND           (gRPC ModelReady: OK with ready false, as Triton)
body over the cap      413   RESOURCE_EXHAUSTED
missing/invalid token  401   UNAUTHENTICATED
backend failure        500   INTERNAL
=====================  ====  ==================  ===============================================
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

from ..runtime.io import MAX_BUDGET_MS, real_value

# numpy dtype name ↔ v2 datatype. BYTES (strings) is not served: no dsedge bundle takes string tensors.
V2_OF_NUMPY: dict[str, str] = {
    "bool": "BOOL", "uint8": "UINT8", "uint16": "UINT16", "uint32": "UINT32", "uint64": "UINT64",
    "int8": "INT8", "int16": "INT16", "int32": "INT32", "int64": "INT64",
    "float16": "FP16", "float32": "FP32", "float64": "FP64",
}
NUMPY_OF_V2: dict[str, str] = {v: k for k, v in V2_OF_NUMPY.items()}

# Rejection reason → (HTTP status, gRPC status code name).
REJECTION_STATUS: dict[str, tuple[int, str]] = {
    "overload": (429, "RESOURCE_EXHAUSTED"),
    "budget": (503, "UNAVAILABLE"),
    "deadline": (503, "UNAVAILABLE"),
    "shutdown": (503, "UNAVAILABLE"),
}

# Parameters this server reads from a request; every other key is ignored, as in Triton.
BUDGET_PARAM, PRIORITY_PARAM, TIMEOUT_PARAM = "budget_ms", "priority", "timeout"
# Triton parameters for features this server does not have: refused instead of silently ignored.
UNSUPPORTED_PARAMS = ("sequence_id", "sequence_start", "sequence_end")


class ServeError(Exception):
    """A request that ends without an answer: HTTP ``status`` and gRPC ``code`` (a ``grpc.StatusCode`` name),
    a one-line message, and ``reason`` (a rejection reason, or ``"invalid"``/``"not_found"``/…)."""

    def __init__(self, status: int, code: str, message: str, reason: str = "invalid") -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message.replace("\n", " ")
        self.reason = reason


def invalid(message: str) -> ServeError:
    return ServeError(400, "INVALID_ARGUMENT", message, "invalid")


def not_found(message: str) -> ServeError:
    return ServeError(404, "NOT_FOUND", message, "not_found")


def rejection(reason: str, detail: str) -> ServeError:
    status, code = REJECTION_STATUS.get(reason, (503, "UNAVAILABLE"))
    return ServeError(status, code, f"{reason}: {detail}" if detail else reason, reason)


def v2_datatype(numpy_dtype: str) -> str:
    return V2_OF_NUMPY.get(numpy_dtype, numpy_dtype.upper())


def numpy_dtype(datatype: str, name: str) -> np.dtype:
    """The numpy dtype of a v2 ``datatype``; ServeError(400) for BYTES or an unknown spelling."""
    try:
        return np.dtype(NUMPY_OF_V2[str(datatype).upper()])
    except KeyError:
        raise invalid(f"input {name!r}: datatype {datatype!r} is not supported "
                      f"(use one of {', '.join(sorted(NUMPY_OF_V2))})") from None


def v2_shape(shape: tuple) -> list[int]:
    """Manifest shape → v2 shape: symbolic dims (``"batch"``) become -1."""
    return [d if isinstance(d, int) and d >= 0 else -1 for d in shape]


def check_shape(name: str, shape: Any) -> tuple[int, ...]:
    if not isinstance(shape, (list, tuple)) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                                       for d in shape):
        raise invalid(f"input {name!r}: shape must be a list of non-negative integers, got {shape!r}")
    return tuple(int(d) for d in shape)


def from_raw(name: str, datatype: str, shape: Any, raw: bytes) -> np.ndarray:
    """A little-endian raw buffer (binary extension / gRPC ``raw_input_contents``) → ndarray of ``shape``."""
    dt = numpy_dtype(datatype, name).newbyteorder("<")
    shp = check_shape(name, shape)
    want = math.prod(shp) * dt.itemsize  # Python ints: a huge shape cannot wrap around
    if len(raw) != want:
        raise invalid(f"input {name!r}: {len(raw)} bytes of data for shape {list(shp)} {datatype} "
                      f"(expected {want})")
    return np.frombuffer(raw, dtype=dt).reshape(shp)


def _value_types(data: Any) -> set[type]:
    """The Python types of the values in ``data`` (nested lists; the lists themselves not counted)."""
    out: set[type] = set()
    stack = [data]
    while stack:
        x = stack.pop()
        if isinstance(x, list):
            kinds = set(map(type, x))
            if list in kinds:
                stack.extend(v for v in x if isinstance(v, list))
                kinds.discard(list)
            out |= kinds
        else:
            out.add(type(x))
    return out


def from_list(name: str, datatype: str, shape: Any, data: Any) -> np.ndarray:
    """JSON ``data`` (flat or nested, row-major), or a gRPC typed contents field, → ndarray of ``shape``.

    Raises ServeError(400): values that are not numbers, ``true``/``false`` anywhere in a numeric tensor (JSON
    booleans would read as 1/0) or numbers in a BOOL one, non-integers for an integer datatype, and any value the
    datatype cannot hold (an integer outside its range, which ``astype`` would wrap; a finite float that would become
    infinite, e.g. 70000 as FP16); or a count that does not match ``shape``."""
    dt = numpy_dtype(datatype, name)
    shp = check_shape(name, shape)
    size = math.prod(shp)
    if isinstance(data, (list, tuple)) and data and not isinstance(data[0], (list, tuple)) and len(data) != size:
        # a flat list's count is known at once: 31 M values for [1, 4] took 2 s of the event loop to refuse
        raise invalid(f"input {name!r}: {len(data)} values for shape {list(shp)} (expected {size})")
    try:
        kinds = _value_types(data)
        if bool in kinds and dt.kind != "b":
            raise ValueError(f"true/false among the values of {datatype}")
        if dt.kind == "b" and not kinds <= {bool}:
            raise ValueError("numbers for BOOL (send true/false)")
        try:
            arr = np.asarray(data)
        except ValueError:  # numpy's own words ("setting an array element with a sequence…") said nothing useful
            raise ValueError("nested lists of unequal lengths (ragged)") from None
        if arr.size and kinds <= {int} and arr.dtype.kind not in "iub":  # past int64/uint64: object or float
            if dt.kind != "f":
                raise ValueError(f"an integer out of {datatype}'s range")
            arr = np.asarray(data, dtype=np.float64)  # a float type holds it (float64 up to ~1.8e308)
        if arr.dtype == object or (arr.size and arr.dtype.kind not in "biuf"):
            raise ValueError("not numbers")
        if dt.kind in "iu" and arr.size and arr.dtype.kind == "f":
            raise ValueError(f"non-integer values for {datatype}")
        if dt.kind in "iu" and arr.size:
            info = np.iinfo(dt)
            if int(arr.min()) < info.min or int(arr.max()) > info.max:
                raise ValueError(f"an integer out of {datatype}'s range [{info.min}, {info.max}]")
        with np.errstate(over="ignore", invalid="ignore"):
            out = arr.astype(dt, casting="unsafe").reshape(-1)
        if dt.kind == "f" and arr.size:
            grew = ~np.isfinite(out) & np.isfinite(arr.reshape(-1).astype(np.float64))
            if grew.any():
                raise ValueError(f"a value out of {datatype}'s range (±{float(np.finfo(dt).max):.6g})")
        arr = out
    except (ValueError, TypeError, OverflowError) as e:
        raise invalid(f"input {name!r}: data is not a list of {datatype} values ({e})") from None
    if arr.size != size:
        raise invalid(f"input {name!r}: {arr.size} values for shape {list(shp)} (expected {size})")
    return arr.reshape(shp)


@dataclass(frozen=True)
class Deadline:
    """The budget a request runs under and where it came from: ``"budget_ms"``, ``"timeout"`` or ``"default"``."""

    budget_ms: float
    source: str


def _number(params: Mapping[str, Any], key: str, zero_is_none: bool = False) -> float | None:
    if key not in params or params[key] is None:
        return None
    v = params[key]
    if zero_is_none and v == 0 and not isinstance(v, bool):
        return None
    f = real_value(v)  # NaN for a bool or a string, inf for an integer too large for a float
    if not math.isfinite(f) or f <= 0:
        raise invalid(f"parameter {key!r} must be a positive number, got {v!r:.40}")
    return f


def deadline(params: Mapping[str, Any], default_ms: float) -> Deadline:
    """Effective budget = min(``budget_ms``, ``timeout`` / 1000); the model's default when neither is given.

    ``timeout`` is Triton's, in microseconds: any positive value (past ``MAX_BUDGET_MS`` it bounds nothing and is
    capped there); 0 is Triton's "no timeout of its own", so it bounds nothing either. Raises ServeError(400) for a non-positive or non-number value, and for a ``budget_ms`` over
    ``MAX_BUDGET_MS`` (as ``Session.submit``: a longer "latency budget" is a unit mistake).
    """
    budget = _number(params, BUDGET_PARAM)
    if budget is not None and budget > MAX_BUDGET_MS:
        raise invalid(f"parameter {BUDGET_PARAM!r} must be at most {MAX_BUDGET_MS:.0f} ms (one hour), "
                      f"got {budget:g}")
    timeout = _number(params, TIMEOUT_PARAM, zero_is_none=True)
    timeout_ms = None if timeout is None else min(timeout / 1000.0, MAX_BUDGET_MS)
    if budget is None and timeout_ms is None:
        return Deadline(float(default_ms), "default")
    if timeout_ms is not None and (budget is None or timeout_ms < budget):
        return Deadline(timeout_ms, "timeout")
    return Deadline(float(budget), "budget_ms")


SHM_PARAM = "shared_memory_region"  # Triton's shared-memory extension (system and CUDA): not served


def check_no_shared_memory(where: str, params: Any) -> None:
    """ServeError(400) when a tensor's parameters name a shared-memory region: the server cannot read or write one,
    and an output answered inline instead would leave the client reading a region nobody wrote."""
    if SHM_PARAM in params:
        raise invalid(f"{where}: shared memory ({SHM_PARAM!r}) is not supported by dsedge serve: send the tensor "
                      "in the request (binary data or raw_input_contents) and read outputs from the response")


def check_unsupported(params: Mapping[str, Any]) -> None:
    for key in UNSUPPORTED_PARAMS:
        if params.get(key) not in (None, 0, "", False):
            raise invalid(f"parameter {key!r}: sequence batching is not supported by dsedge serve")
