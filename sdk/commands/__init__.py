"""The runtime-side CLI commands (``dsedge serve``, ``bench``, ``verify``, …) and what they share."""
from __future__ import annotations

import click


def provider_list(value: str | None) -> list[str] | None:
    """``--providers A,B`` as a list (None when the option was not given). Raises click.BadParameter for a value
    that names no provider (``","``, ``" "``): it would have fallen back to the default without a word."""
    if value is None:
        return None
    names = [p.strip() for p in value.split(",") if p.strip()]
    if not names:
        raise click.BadParameter(f"{value!r} names no provider; e.g. --providers CPUExecutionProvider, or leave "
                                 "the option out for dsedge.load's choice", param_hint="--providers")
    return names
