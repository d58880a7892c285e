"""Check request inputs against a bundle's IO specs before they reach a backend."""
from __future__ import annotations

import math
import numbers
from typing import Any, Callable, Mapping

import numpy as np

from .bundle import IOSpec
from .errors import DsedgeError, InputError
from .instances import check_threads


# per (specs, shape_ranges) object pair, the checks of validate_inputs' fast path: (specs, ranges, plan), by id (both
# are read once per pair: a session's, which nothing changes after load)
_PLANS: dict[tuple[int, int], tuple[Any, Any, tuple]] = {}
_SMALL = 256  # elements up to which an integer input's range is checked in Python, not by numpy reductions


def _plan(specs: list[IOSpec], shape_ranges: Mapping[str, Mapping[str, int]] | None) -> tuple:
    # per input: (name, dtype, rank, ((axis, dim), ...) static, ((axis, symbol, lo, hi), ...) symbolic, value range)
    key = (id(specs), id(shape_ranges))
    got = _PLANS.get(key)
    if got is not None and got[0] is specs and got[1] is shape_ranges:
        return got[2]
    plan = []
    for spec in specs:
        static = tuple((a, d) for a, d in enumerate(spec.shape) if isinstance(d, int) and d >= 0)
        symbolic = []
        for a, d in enumerate(spec.shape):
            if isinstance(d, str):
                rng = (shape_ranges or {}).get(d) or {}
                symbolic.append((a, d, rng.get("min", 0), rng.get("max", math.inf)))
        dtype, rng = np.dtype(spec.dtype), spec.value_range
        if rng is not None:  # (lo, hi, integer: a small array of it is checked in Python, see _validate_fast)
            rng = (*rng, dtype.kind in "iu")
        plan.append((spec.name, dtype, len(spec.shape), static, tuple(symbolic), rng))
    if len(_PLANS) >= 64:  # sessions come and go: a bounded cache
        _PLANS.clear()
    _PLANS[key] = (specs, shape_ranges, tuple(plan))
    return _PLANS[key][2]


def _validate_fast(plan: tuple, inputs: Any) -> dict[str, np.ndarray] | None:
    # the common case, a dict of exactly the model's arrays that pass every check, at a third of the full checks'
    # cost (the fraud scorer's submit path); None for anything else, which the full checks then explain
    if type(inputs) is not dict or len(inputs) != len(plan):
        return None
    out: dict[str, np.ndarray] = {}
    symbols: dict[str, int] = {}
    for name, dtype, rank, static, symbolic, value_range in plan:
        arr = inputs.get(name)
        if type(arr) is not np.ndarray or arr.dtype != dtype or arr.ndim != rank:
            return None
        shape = arr.shape
        for axis, dim in static:
            if shape[axis] != dim:
                return None
        for axis, sym, lo, hi in symbolic:
            dim = shape[axis]
            if symbols.setdefault(sym, dim) != dim or not lo <= dim <= hi:
                return None
        if value_range is not None and arr.size:
            lo, hi, integer = value_range
            # a request's few token ids: Python's min/max over a list beat numpy's reductions here, whose code is
            # cold after every wait between requests (5 µs each then, against 3 for both of these)
            if integer and arr.size <= _SMALL:
                values = arr.ravel().tolist()
                low, high = min(values), max(values)
            else:
                low, high = arr.min(), arr.max()
            if low < lo or high > hi:
                return None
        out[name] = arr
    return out


def validate_inputs(
    specs: list[IOSpec], inputs: Mapping[str, Any], shape_ranges: Mapping[str, Mapping[str, int]] | None = None
) -> dict[str, np.ndarray]:
    """Return ``inputs`` as numpy arrays after checking names, dtypes and shapes.

    Symbolic dims (``"batch"``) must agree across inputs and, when ``shape_ranges`` gives ``{"batch": {"min": 1,
    "max": 64}}``, lie in that range. Dtypes must match exactly (no silent casts: an int32 ``input_ids`` is an error).

    Raises:
        InputError: unknown or missing name, wrong dtype, wrong rank, a static dim or a symbolic dim mismatch.
    """
    try:
        fast = _validate_fast(_plan(specs, shape_ranges), inputs)
    except TypeError:  # a spec or range the plan cannot hold: the full checks say what is wrong
        fast = None
    if fast is not None:
        return fast
    if not isinstance(inputs, Mapping):
        raise InputError(f"inputs must be a dict of name → numpy array, got {type(inputs).__name__}",
                         f"pass {{{', '.join(repr(s.name) for s in specs)}: array, …}}")
    names = {s.name for s in specs}
    unknown = sorted(set(inputs) - names)
    if unknown:
        raise InputError(f"unknown input {unknown[0]!r}", f"the model's inputs are: {', '.join(sorted(names))}")
    out: dict[str, np.ndarray] = {}
    symbols: dict[str, tuple[int, str]] = {}
    for spec in specs:
        if spec.name not in inputs:
            raise InputError(f"missing input {spec.name!r}", f"pass all of: {', '.join(s.name for s in specs)}")
        try:
            arr = np.asarray(inputs[spec.name])
        except (ValueError, TypeError) as e:  # a ragged nested list, an object numpy cannot hold as an array
            raise InputError(f"input {spec.name!r} is not an array ({str(e).splitlines()[0][:120]})",
                             f"pass a numpy array of dtype {spec.dtype}") from None
        if arr.dtype != np.dtype(spec.dtype):
            got = str(arr.dtype)
            if arr.dtype.newbyteorder("=") == np.dtype(spec.dtype):  # ">f4" alone did not say what differs
                got += f" ({'big' if arr.dtype.byteorder == '>' else 'little'}-endian {spec.dtype})"
            if isinstance(inputs[spec.name], (list, tuple)):  # numpy's default for Python numbers, not the user's
                got = f"{got} (numpy's dtype for a Python {type(inputs[spec.name]).__name__} of such values)"
            raise InputError(f"input {spec.name!r} has dtype {got}, expected {spec.dtype}",
                             f"convert it with .astype(np.{spec.dtype})" if isinstance(inputs[spec.name], np.ndarray)
                             else f"pass np.asarray(..., dtype=np.{spec.dtype})")
        if arr.ndim != len(spec.shape):
            raise InputError(f"input {spec.name!r} has shape {list(arr.shape)}, expected rank {len(spec.shape)} {list(spec.shape)}",
                             "reshape the array to the listed dims")
        for axis, (dim, want) in enumerate(zip(arr.shape, spec.shape)):
            if isinstance(want, int) and want >= 0:
                if dim != want:
                    raise InputError(f"input {spec.name!r} dim {axis} is {dim}, expected {want} (shape {list(spec.shape)})",
                                     "this axis is static in the model")
            elif isinstance(want, str):
                if want in symbols and symbols[want][0] != dim:
                    other = symbols[want][1]
                    raise InputError(f"input {spec.name!r} has {want}={dim} but {other!r} has {want}={symbols[want][0]}",
                                     f"all inputs must share the same {want!r}")
                symbols.setdefault(want, (dim, spec.name))
                rng = (shape_ranges or {}).get(want)
                if rng and not (rng.get("min", 0) <= dim <= rng.get("max", dim)):
                    raise InputError(f"input {spec.name!r} has {want}={dim}, outside the bundle's range "
                                     f"[{rng.get('min')}, {rng.get('max')}]", f"split or pad the request to fit {want}")
        if spec.value_range is not None and arr.size:
            lo, hi = spec.value_range
            amin, amax = arr.min(), arr.max()
            if amin < lo or amax > hi:
                bad = amin if amin < lo else amax
                raise InputError(f"input {spec.name!r} holds {bad}, outside the model's range [{lo}, {hi}]",
                                 "use the tokenizer / encoder the bundle was built with")
        out[spec.name] = arr
    return out


def is_integer(value: Any) -> bool:
    """An ``int`` or numpy integer, not a bool (``True`` is an ``int`` to Python, never a count to a user)."""
    return isinstance(value, (numbers.Integral, np.integer)) and not isinstance(value, (bool, np.bool_))


def is_real(value: Any) -> bool:
    """A real number (numpy scalars too), not a bool; it may still be NaN or infinite."""
    return isinstance(value, (numbers.Real, np.integer, np.floating)) and not isinstance(value, (bool, np.bool_))


def real_value(value: Any) -> float:
    """``value`` as a float: NaN for anything that is not a real number (``is_real``), ±inf for an integer too
    large for a float (``float(10**400)`` raises OverflowError)."""
    if not is_real(value):
        return math.nan
    try:
        return float(value)
    except OverflowError:
        return math.inf if value > 0 else -math.inf


MAX_BUDGET_MS = 3_600_000.0   # one hour: a longer "latency budget" is a unit mistake (s vs ms)
MAX_PRIORITY = 2**31 - 1


def check_request_options(budget_ms: Any, priority: Any,
                          default_budget_ms: Callable[[], Any] | float | None = None,
                          name: str = "budget_ms") -> tuple[float, int]:
    """A request's latency budget and priority as ``(float ms, int)``, checked before anything is queued.

    Args:
        budget_ms: latency budget in ms, a finite real number in (0, ``MAX_BUDGET_MS``]; None takes
            ``default_budget_ms`` (a value, or a callable called only then).
        priority: an integer in [-``MAX_PRIORITY``, ``MAX_PRIORITY``] (numpy integers too; bools, floats and
            strings are refused rather than truncated or compared with ints later).
        name: the budget's name in messages (``"token_budget_ms"`` for generation's per-token budget).
    Raises:
        InputError: a budget that is not a number, NaN, infinite, ≤ 0 or too large; a priority that is not an
            integer or out of range.
    """
    if (type(budget_ms) is float and 0.0 < budget_ms <= MAX_BUDGET_MS and type(priority) is int
            and -MAX_PRIORITY <= priority <= MAX_PRIORITY):
        return budget_ms, priority  # the common case, checked in one line (submit's hot path)
    if budget_ms is None:
        try:
            budget_ms = default_budget_ms() if callable(default_budget_ms) else default_budget_ms
        except (TypeError, ValueError, OverflowError) as e:
            raise InputError(f"the session's default latency budget is not a number ({e})",
                             "pass load(..., budget_ms=50.0) or submit(..., budget_ms=50.0)") from None
        what = "default latency budget"
    else:
        what = name
    if not is_real(budget_ms):
        raise InputError(f"{what} must be a number of milliseconds, got {type(budget_ms).__name__} {budget_ms!r}",
                         "pass budget_ms=50.0 (ms), or None for the session's default")
    budget = real_value(budget_ms)
    if not math.isfinite(budget) or not 0 < budget <= MAX_BUDGET_MS:
        raise InputError(f"{what} must be a finite number in (0, {MAX_BUDGET_MS:.0f}] ms, got {budget_ms!r}",
                         "pass budget_ms=50.0 (ms), or None for the session's default")
    if not is_integer(priority):
        raise InputError(f"priority must be an integer, got {type(priority).__name__} {priority!r}",
                         "pass priority=0 (higher wins among equal deadlines)")
    if not -MAX_PRIORITY <= int(priority) <= MAX_PRIORITY:
        raise InputError(f"priority {priority} is outside [-{MAX_PRIORITY}, {MAX_PRIORITY}]",
                         "pass a small integer, e.g. priority=1")
    return budget, int(priority)


PROFILE_SOURCES = ("auto", "measure", "bundle")


def check_session_options(path: Any, *, budget_ms: Any = None, max_batch: Any = None, max_queue: Any = 1024,
                          max_delay_ms: Any = None, profile: Any = "auto", threads: Any = None,
                          window: Any = None, instances: Any = None, worker_nice: Any = 0,
                          reserve_cores: Any = 0) -> None:
    """Check ``dsedge.load``'s options (and ``stream``'s ``window``) before anything is opened.

    ``path`` is a str or ``os.PathLike``; ``budget_ms``/``max_delay_ms`` None or a finite number > 0 (ms; a
    ``max_delay_ms`` of 0 holds no batch open); ``max_batch``/``threads``/``window``/``instances`` None or an integer
    ≥ 1;
    ``max_queue`` an integer ≥ 1; ``worker_nice`` an integer in 0…19; ``reserve_cores`` an integer ≥ 0; ``profile``
    one of ``PROFILE_SOURCES``.

    Raises:
        InputError: naming the first bad option.
    """
    import os

    if not isinstance(path, (str, os.PathLike)) or isinstance(os.fspath(path), bytes):
        raise InputError(f"bundle path must be a str or pathlib.Path, got {type(path).__name__}",
                         "pass the NAME-TARGET.dse directory, e.g. dsedge.load('out/model-cpu.dse')")

    def integer(name: str, value: Any, low: int, optional: bool = True, high: int | None = None) -> None:
        if value is None and optional:
            return
        top = 2**31 - 1 if high is None else high  # (ONNX Runtime and the queues take C ints)
        if not is_integer(value) or not low <= int(value) <= top:
            over = high is not None or (is_integer(value) and int(value) > top)  # say the bound it broke
            wanted = f"in {low}..{top}" if over else f">= {low}"
            hint = f"pass {name} between {low} and {top}" if over else f"pass {name}={low} or more"
            raise InputError(f"{name} must be an integer {wanted}, got {value!r}", hint)

    integer("max_batch", max_batch, 1)
    integer("max_queue", max_queue, 1, optional=False)
    integer("threads", threads, 1)
    check_threads(threads)
    integer("window", window, 1)
    integer("instances", instances, 1)
    integer("worker_nice", worker_nice, 0, optional=False, high=19)
    integer("reserve_cores", reserve_cores, 0, optional=False)
    for name, value, low_open in (("budget_ms", budget_ms, True), ("max_delay_ms", max_delay_ms, False)):
        if value is None:
            continue
        v = real_value(value)
        if not (math.isfinite(v) and (v > 0 if low_open else v >= 0) and v <= MAX_BUDGET_MS):
            raise InputError(f"{name} must be a finite number in {'(' if low_open else '['}0, {MAX_BUDGET_MS:.0f}] ms, "
                             f"got {value!r}", f"pass {name}=50.0, or None for the default")
    if profile not in PROFILE_SOURCES:
        raise InputError(f"profile must be one of {', '.join(PROFILE_SOURCES)}, got {profile!r}",
                         "pass profile='auto'")


def check_stream_inputs(inputs: Any, method: str = "stream", allow_async: bool = False) -> None:
    """Check that ``stream``'s ``inputs`` is an iterable of requests (async iterables too with ``allow_async``),
    before any thread starts: not a single request (a mapping), an array, a string or a number.

    Raises:
        InputError: naming the type given.
    """
    example = f"session.{method}([{{'x': row}} for row in rows])"
    if isinstance(inputs, Mapping):
        raise InputError(f"{method}() takes an iterable of requests, got a single request (a mapping)",
                         f"wrap it in a list: session.{method}([inputs]), or use session.submit(inputs)")
    iterable = hasattr(inputs, "__iter__") or (allow_async and hasattr(inputs, "__aiter__"))
    if not iterable or isinstance(inputs, (str, bytes, np.ndarray)):
        raise InputError(f"{method}() takes an iterable of requests (each a mapping of input name to array), "
                         f"got {type(inputs).__name__}", f"e.g. {example}")


def check_finite(arrays: Mapping[str, Any], error: type[DsedgeError] = InputError, where: str = "") -> None:
    """Refuse NaN or infinite values in float arrays (calibration and held-out data: one NaN poisons every
    activation range, a GPTQ Hessian, or a SmoothQuant scale). Raises ``error`` naming the array and the count."""
    for name, a in arrays.items():
        arr = np.asarray(a)
        if arr.dtype.kind == "f" and arr.size and not np.isfinite(arr).all():
            bad = int(arr.size - np.isfinite(arr).sum())
            raise error(f"{where + ': ' if where else ''}input {name!r} holds {bad} NaN/Inf values",
                        "clean the data (drop or impute non-finite rows) before calibrating or validating")
