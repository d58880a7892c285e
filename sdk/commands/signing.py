"""``dsedge keygen`` and ``dsedge sign``: Ed25519 keys and detached bundle signatures (runtime/signing.py)."""
from __future__ import annotations

import click


@click.command("keygen")
@click.option("--out", "prefix", default="dsedge-signing", show_default=True,
              help="Path prefix: writes PREFIX.key (private, mode 0600) and PREFIX.pub.")
def keygen(prefix: str) -> None:
    """Make an Ed25519 key pair for signing bundles."""
    from ..runtime.signing import generate_key, key_id, load_public_key

    priv, pub = generate_key(prefix)
    click.echo(f"wrote {priv} (keep it secret) and {pub} ({key_id(load_public_key(pub))}): "
               f"devices trust it with DSEDGE_TRUSTED_KEYS={pub}")


@click.command("sign")
@click.argument("bundle", type=click.Path())
@click.option("--key", "key_path", required=True, type=click.Path(), help="The private key (PREFIX.key).")
@click.option("--signer", default=None, help="Name recorded in the signature (default: the key file's name).")
def sign(bundle: str, key_path: str, signer: str | None) -> None:
    """Verify a bundle and sign its manifest (writes BUNDLE/manifest.sig)."""
    import json
    from pathlib import Path

    from ..runtime.signing import SIGNATURE, sign_bundle

    try:  # the signature this one replaces, if any (a malformed one is replaced without a word)
        before = json.loads((Path(bundle) / SIGNATURE).read_text()).get("key_id")
    except (OSError, ValueError, AttributeError, RecursionError):
        before = None
    info = sign_bundle(bundle, key_path, signer)
    click.echo(f"signed {bundle} as {info.signer!r} with {info.key_id}")
    if before and before != info.key_id:
        click.echo(f"note: this replaced its signature by {before}: devices that trust only that key now refuse it")
