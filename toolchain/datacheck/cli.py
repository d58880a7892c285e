"""``dsedge data check DATA``: grade a data set; exit 0 pass/warn, 1 when a check fails, 2 on a usage error."""
from __future__ import annotations

import sys
from pathlib import Path

import click


@click.group(name="data")
def data() -> None:
    """Training-data tools."""


@data.command(name="check")
@click.argument("path", metavar="DATA", type=click.Path(dir_okay=True))
@click.option("--text-field", help="Field/column holding the text (default: text, content, document, ...).")
@click.option("--label", help="Label column of tabular data (default: label, class, target, y, is_fraud).")
@click.option("--tokenizer", type=click.Path(exists=True, file_okay=False),
              help="Hugging Face tokenizer directory: lengths and unknown-token rate in the model's tokens.")
@click.option("--entities", type=click.Path(exists=True, dir_okay=False), help="Entity list, one per line.")
@click.option("--config", "config_path", type=click.Path(exists=True, dir_okay=False),
              help="checks.toml: thresholds and settings (docs/datacheck.md).")
@click.option("--max-tokens", type=click.IntRange(min=1), help="Longest document allowed (default: the tokenizer's "
              "model_max_length, else 512).")
@click.option("--html", "html_out", type=click.Path(dir_okay=False),
              help="Write an HTML report with plots here, and the report as JSON beside it (.json).")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON instead of the table.")
@click.option("--engine", type=click.Choice(["local", "dask", "ray"]), default="local", show_default=True,
              help="local: this process; dask: a Dask distributed cluster (Ray is not supported).")
@click.option("--workers", type=click.IntRange(min=1), default=2, show_default=True,
              help="Local Dask cluster size (--engine dask without --scheduler).")
@click.option("--scheduler", help="Address of an existing Dask scheduler (tcp://host:8786).")
@click.option("--shard-mb", type=click.FloatRange(min=0.001), help="Shard size for --engine dask (default 64).")
def check(path: str, text_field: str | None, label: str | None, tokenizer: str | None, entities: str | None,
          config_path: str | None, max_tokens: int | None, html_out: str | None, as_json: bool, engine: str,
          workers: int, scheduler: str | None, shard_mb: float | None) -> int:
    """Check DATA (.jsonl, .csv, .parquet, plain text, or a folder of shards) and grade each check."""
    from dataclasses import replace

    from ...runtime.errors import DsedgeError
    from . import check_data, load_config
    from .render import print_table, to_json, write_html

    if not Path(path).exists():  # checked here, not by click: one line and a hint, as every dsedge error
        raise DsedgeError(f"DATA {path!r} does not exist",
                          "pass a .jsonl, .csv, .parquet or text file, or a folder of them")
    if engine == "ray":
        raise DsedgeError("--engine ray is not supported", "use --engine dask (docs/datacheck.md says why)")
    if html_out and Path(html_out).suffix.lower() == ".json":
        raise DsedgeError(f"--html {html_out}: the report's JSON is written beside the page with suffix .json, the "
                          "same path, and would overwrite the HTML", "give the page an .html name (e.g. report.html)")
    if html_out:  # both files it writes, before the scan: a directory, a file in the way, a file of a bundle
        from ...runtime.files import check_output_file

        page = check_output_file(html_out, "--html", "report.html")
        beside = check_output_file(page.with_suffix(".json"), "--html's JSON", "report.json")
        for what, out in (("page", page), ("JSON beside it", beside)):
            if out.resolve() == Path(path).resolve():
                raise DsedgeError(f"--html {html_out!r}: the {what} would be written over DATA {path!r}",
                                  "give the report its own path, e.g. --html report.html")
    cfg = load_config(config_path)
    over = {k: v for k, v in (("text_field", text_field), ("label", label), ("max_tokens", max_tokens)) if v}
    cfg = replace(cfg, **over)
    report = check_data(path, cfg, tokenizer=tokenizer, entities_file=entities, engine=engine,
                        shard_bytes=int(shard_mb * (1 << 20)) if shard_mb else None, workers=workers,
                        scheduler=scheduler)
    if html_out:
        write_html(report, html_out)
    if as_json:
        click.echo(to_json(report))
    else:
        print_table(report)
        if html_out:
            click.echo(f"wrote {html_out} and its .json", err=True)
    failed = [c["id"] for c in report["checks"] if c["status"] == "fail"]
    if failed and not as_json:
        click.echo(f"failed: {', '.join(failed)}", err=True)
    sys.stdout.flush()
    return 1 if failed else 0
