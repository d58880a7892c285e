"""Click parameter types for numeric flags: finite numbers in a range (``click.FloatRange`` lets NaN through, since
every comparison with NaN is false, and accepts infinity), and a command class that gives options with an optional
value a clear error for a negative number."""
from __future__ import annotations

import math
import re

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


_NEGATIVE = re.compile(r"-(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")


class OptionalValueCommand(click.Command):
    """A command whose options with an optional value (``is_flag=False, flag_value=…``, e.g. ``--qat-steps`` alone
    = 500) refuse a negative number given to them with a usage error naming the option (exit 2). Without this,
    click reads the ``-1`` of ``--qat-steps -1`` (and of ``--qat-steps=-1``) as an option: "No such option '-1'"."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        optional = [p for p in self.params if isinstance(p, click.Option) and getattr(p, "_flag_needs_value", False)]
        for i, arg in enumerate(args):
            if arg == "--":
                break
            for p in optional:
                for name in p.opts:
                    if arg.startswith(name + "="):
                        value = arg[len(name) + 1:]
                    elif arg == name and i + 1 < len(args):
                        value = args[i + 1]
                    else:
                        continue
                    if _NEGATIVE.fullmatch(value):
                        raise click.BadParameter(f"{value} is not a non-negative integer", ctx=ctx, param=p)
        return super().parse_args(ctx, args)
