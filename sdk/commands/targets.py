"""``dsedge targets [NAME|PROFILE.toml] [--json]``: list target profiles as a table, or show one."""
from __future__ import annotations

import json

import click

from ..targets import Target, get_target, list_targets


def _trt(t: Target) -> str:
    if t.backend != "tensorrt":
        return "— (ONNX Runtime)"
    s = f"TRT {t.tensorrt.get('version')}"
    return s + (f" / JetPack {t.tensorrt['jetpack']}" if t.tensorrt.get("jetpack") else "")


def _row(t: Target) -> list[str]:
    return [
        t.name + (f" ({', '.join(t.aliases)})" if t.aliases else ""),
        t.sm or "cpu",
        ", ".join(t.precisions),
        ", ".join(t.engine_flags) or "—",
        str(t.dla_cores),
        f"{t.memory_gb:g}" if t.memory_gb else "—",
        _trt(t),
        f"{t.opset['min']}–{t.opset['max']}",
        f"{t.default_budget_ms:g}",
    ]


HEADER = ["target", "arch", "precisions", "engine flags", "DLA", "memory GiB", "TensorRT", "opset", "budget ms"]


@click.command(name="targets")
@click.argument("name", required=False)
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
def targets(name: str | None, as_json: bool) -> None:
    """List target profiles, or show one (NAME, alias, or a profile file ./my-device.toml).

    User profiles: files in $DSEDGE_TARGETS_DIR or ~/.config/dsedge/targets override built-ins of the same file name
    or the same target name.
    """
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    if name is not None and not name.strip():  # `dsedge targets ""` (an unset shell variable) is not "list them all"
        raise click.UsageError("NAME is empty: give a target name, an alias or a profile file, or leave NAME out to "
                               "list every target")
    console = Console()
    if name is not None:
        t = get_target(name)
        if as_json:
            click.echo(json.dumps(t.to_dict(), indent=2))
            return
        # a profile's free text (description, notes, its path) is shown as written, never read as rich markup
        table = Table(title=escape(f"{t.name}: {t.description}"), show_header=False)
        for key, val in zip(HEADER[1:], _row(t)[1:]):
            table.add_row(key, escape(val))
        table.add_row("precision order (auto)", " > ".join(t.precision_order))
        table.add_row("workspace MiB", str(t.workspace_mb or "—"))
        table.add_row("shapes", escape("; ".join(f"{d} {r['min']}/{r['opt']}/{r['max']}" for d, r in t.shapes.items())
                                       or "—"))
        if t.hardware_compatibility:
            table.add_row("hardware compatibility", escape(t.hardware_compatibility))
        for note in t.notes:
            table.add_row("note", escape(note))
        table.add_row("profile", escape(t.source))
        console.print(table)
        return
    all_targets = list_targets()
    if as_json:
        click.echo(json.dumps([t.to_dict() for t in all_targets], indent=2))
        return
    table = Table(title="dsedge targets")
    for h in HEADER:
        table.add_column(h)
    for t in all_targets:
        table.add_row(*map(escape, _row(t)))
    console.print(table)
