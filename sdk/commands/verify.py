"""``dsedge verify BUNDLE``: run the bundle's golden inputs on the backend this machine would really use and compare
the answers with the fp32 reference outputs and the build-time figures. Exit 0: within tolerance; 1: outside (the
figures say what differed); 2: the bundle or backend cannot be checked (no golden I/O, corrupt, provider missing)."""
from __future__ import annotations

import json
import sys

import click

from . import provider_list


@click.command("verify")
@click.argument("bundle", type=click.Path())
@click.option("--variant", "variants", multiple=True, help="Variant to check (repeatable; 'all' for every one; "
              "default: the bundle's default variant).")
@click.option("--providers", default=None, help="Comma-separated ORT providers (default: what dsedge.load picks: "
              "a TensorRT engine where TensorRT and a GPU exist, else TensorRT EP → CUDA EP → CPU EP).")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON object instead of a table.")
def verify(bundle: str, variants: tuple[str, ...], providers: str | None, as_json: bool) -> None:
    """Check that this machine's backend answers the bundle's golden inputs within the build-time tolerance."""
    from ..runtime.bundle import verify_bundle
    from ..runtime.errors import OutputMismatchError
    from ..runtime.golden import check_run, load_golden
    from ..session import load

    provs = provider_list(providers)  # a usage error before any file is read
    m = verify_bundle(bundle)
    golden = load_golden(bundle, m)
    # a variant named twice (or beside 'all') is checked once, in the order first given
    names = [v.name for v in m.variants] if "all" in variants else list(dict.fromkeys(variants)) or [m.default_variant]
    reports, errors = [], []
    for name in names:
        try:
            s = load(bundle, variant=name, providers=provs, instances=1)
        except OutputMismatchError as e:  # an engine built here failed its golden check and was not cached
            errors.append({"variant": name, "passed": False, "error": str(e)})
            continue
        try:
            reports.append(check_run(bundle, m, s.variant, s._backend.run, backend=s.backend_name,
                                     providers=s.providers, golden=golden))
        finally:
            s.close(drain=False)
    passed = all(r.passed for r in reports) and not errors
    if as_json:
        click.echo(json.dumps({"bundle": bundle, "passed": passed, "rows": golden.rows,
                               "rule": golden.info.get("rule"), "left_out": golden.info.get("left_out", []),
                               "variants": [r.to_dict() for r in reports] + errors}, indent=2))
    else:
        _print(bundle, golden, reports, errors, passed)
    sys.exit(0 if passed else 1)


def _print(bundle, golden, reports, errors, passed) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    c = Console()
    t = Table(title=f"golden check: {golden.rows} held-out rows, fp32 reference outputs")
    for col in ("variant", "backend", "output", "cosine min", "allowed ≥", "max abs diff", "allowed ≤", "ok"):
        t.add_column(col)
    for r in reports:
        for name, o in r.outputs.items():
            t.add_row(r.variant, escape(", ".join(r.providers) or r.backend), name, f"{o['cosine_min']:.5f}",
                      f"{o['cosine_min_allowed']:.5f}", f"{o['max_abs_diff']:.4g}", f"{o['max_abs_diff_allowed']:.4g}",
                      "[green]yes[/]" if o["ok"] else "[red]NO[/]")
    c.print(t)
    for e in errors:
        c.print(f"[red]{escape(e['variant'])}: {escape(e['error'])}[/]")
    if golden.info.get("left_out"):
        c.print(f"not compared (over the golden size cap): {', '.join(golden.info['left_out'])}")
    c.print("[green]PASS[/]: answers match the build" if passed else "[red]FAIL[/]: outside the build-time tolerance")
