"""Click parameter types for numeric flags: finite numbers in a range (``click.FloatRange`` lets NaN through, since
every comparison with NaN is false, and accepts infinity)."""
from __future__ import annotations

import math

import click


class FiniteFloat(click.ParamType):
    """A finite float within ``[min, max]`` (``min_open``/``max_open`` exclude the bound). NaN, ±inf, and values
    that overflow to inf (``1e400``) are usage errors (exit 2, one line)."""

    name = "float"

    def __init__(self, min: float | None = None, max: float | None = None, min_open: bool = False,
                 max_open: bool = False) -> None:
        self.min, self.max, self.min_open, self.max_open = min, max, min_open, max_open

    def convert(self, value: object, param: click.Parameter | None, ctx: click.Context | None) -> float:
        if isinstance(value, float) and math.isfinite(value):
            rv = value
        else:
            try:
                rv = float(value)  # type: ignore[arg-type]
            except (TypeError, ValueError):
                self.fail(f"{value!r} is not a number", param, ctx)
        if not math.isfinite(rv):
            self.fail(f"{value!r} is not a finite number", param, ctx)
        low = self.min is not None and (rv <= self.min if self.min_open else rv < self.min)
        high = self.max is not None and (rv >= self.max if self.max_open else rv > self.max)
        if low or high:
            lo = "" if self.min is None else f"{self.min}{' <' if self.min_open else ' <='} "
            hi = "" if self.max is None else f" {'<' if self.max_open else '<='} {self.max}"
            self.fail(f"{rv} is not in the range {lo}x{hi}", param, ctx)
        return rv

    def __repr__(self) -> str:
        return f"FiniteFloat({self.min}, {self.max})"
