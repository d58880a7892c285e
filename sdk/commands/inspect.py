"""``dsedge inspect BUNDLE``: the checks ``dsedge.load`` makes before it opens a model (manifest, file hashes,
signature), then what is inside and what would run it. No model is opened: ``dsedge verify`` opens each variant
and runs the golden inputs."""
from __future__ import annotations

import json

import click


@click.command("inspect")
@click.argument("bundle", type=click.Path())
@click.option("--json", "as_json", is_flag=True, help="Print a JSON object instead of tables.")
def inspect(bundle: str, as_json: bool) -> None:
    """Check a bundle's manifest, file hashes and signature (no model is opened: `dsedge verify` runs them) and
    show its manifest, variants and the providers that would be used."""
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    from ..runtime.backends.ort import choose_providers
    from ..runtime.signing import verify_signed

    m, sig = verify_signed(bundle)  # refuses a bad signature when DSEDGE_TRUSTED_KEYS is set, like load
    providers = choose_providers()
    info = {
        "bundle": bundle, "verified": True, "name": m.name, "target": m.target.get("name"),
        "dsedge_version": m.dsedge_version, "schema_version": m.schema_version,
        "inputs": [s.to_dict() for s in m.inputs], "outputs": [s.to_dict() for s in m.outputs],
        "shape_ranges": m.shape_ranges, "latency_budget_ms": m.latency_budget_ms,
        "default_variant": m.default_variant,
        "variants": [{"name": v.name, "precision": v.precision, "file": v.file, "size_bytes": v.size_bytes,
                      "accuracy": v.accuracy, "notes": v.notes} for v in m.variants],
        "files": len(m.files), "providers_here": providers,
        "signature": sig.to_dict() if sig else None,
    }
    if as_json:
        click.echo(json.dumps(info, indent=2))
        return
    c = Console()
    c.print(f"[bold]{m.name}[/bold] for target [bold]{info['target']}[/bold]: manifest and {len(m.files)} file "
            f"hashes verified (schema {m.schema_version}, built by dsedge {m.dsedge_version}); no model opened: "
            f"`dsedge verify` opens each and runs its golden inputs")
    if sig is None:
        c.print("signature: [yellow]unsigned[/]")
    elif sig.error:
        c.print(f"signature: [red]{escape(sig.error)}[/] (not required here: DSEDGE_TRUSTED_KEYS is not set)")
    else:
        state = ("[green]trusted here[/]" if sig.trusted else "valid, key not in DSEDGE_TRUSTED_KEYS" if sig.valid
                 else "[red]does NOT match the manifest[/]")
        c.print(f"signed by {escape(sig.signer)!r} with {sig.key_id}: {state}")
    io = Table(title="inputs / outputs")
    for col in ("kind", "name", "dtype", "shape"):
        io.add_column(col)
    for kind, specs in (("input", m.inputs), ("output", m.outputs)):
        for s in specs:
            io.add_row(kind, s.name, s.dtype, escape("[" + ", ".join(map(str, s.shape)) + "]"))
    c.print(io)
    vt = Table(title=f"variants (default {m.default_variant})")
    for col in ("variant", "precision", "file", "size MB", "accuracy vs fp32"):
        vt.add_column(col)
    for v in m.variants:
        acc = ", ".join(f"{k} {val}" if not isinstance(val, list) else f"{k.replace('_margins', 's')} {len(val)}"
                        for k, val in v.accuracy.items() if k != "n") or "—"
        student = [n for n in v.notes if "student" in n]          # pruned / QAT builds: not the original model
        vt.add_row(v.name, v.precision, v.file, f"{v.size_bytes / 1e6:.1f}", escape(acc) + "".join(
            f"\n[yellow]{escape(n)}[/]" for n in student))
    c.print(vt)
    c.print(f"shape ranges: {m.shape_ranges}; latency budget: {m.latency_budget_ms} ms")
    c.print(f"providers that would be used here: {', '.join(providers)}")
