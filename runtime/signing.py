"""Signed bundles: a detached Ed25519 signature over ``manifest.json`` (which lists every file's sha256), in
``manifest.sig`` beside it. Algorithm: Ed25519 (RFC 8032) through ``cryptography`` (the ``sign`` extra).

``manifest.sig`` is JSON: ``format``, ``algorithm`` (``"ed25519"``), ``key_id`` (``"ed25519:"`` + the first 16 hex
of sha256 over the raw 32-byte public key), ``public_key`` (raw, base64), ``signer`` (a name the signer chose; it is
covered by the signature), ``manifest_sha256``, ``signature`` (base64 over ``DOMAIN + signer + NUL + manifest``).

Trust: ``dsedge.load(path, trusted_keys=[...])`` or ``$DSEDGE_TRUSTED_KEYS`` (``os.pathsep``-separated ``.pub`` files
or directories of them). With trusted keys configured an unsigned bundle, one signed by another key, or one whose
manifest changed after signing is refused (``SignatureError``); without any, signatures are reported, not required.
Keys: PEM files, the private key PKCS#8 (mode 0600, unencrypted), the public key SubjectPublicKeyInfo.
"""
from __future__ import annotations

import base64
import hashlib
import json
import os
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

from .bundle import MANIFEST, SIGNATURE, Manifest, read_manifest_bytes, verify_bundle
from .files import write_bytes_atomic, write_text_atomic
from .errors import BackendUnavailable, DsedgeError, InputError, SignatureError
from .golden import has_golden, load_golden
from .storage import storage_error

FORMAT = "dsedge-signature-v1"
MAX_SIGNER = 200  # characters of --signer (a name: it is shown by inspect and verify)
DOMAIN = b"dsedge bundle manifest v1\x00"
ENV = "DSEDGE_TRUSTED_KEYS"
_HINT = "pip install 'dsedge[sign]' (cryptography)"
_KEYS_HINT = f"pass trusted_keys as .pub paths or PEM public keys (a list of them), or None to use ${ENV}"
log = logging.getLogger("dsedge.signing")


def _crypto() -> Any:
    try:
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric import ed25519
    except ImportError:
        raise BackendUnavailable("signed bundles need the Python package 'cryptography'", _HINT) from None
    return serialization, ed25519


def _raw_public(pub: Any) -> bytes:
    serialization, _ = _crypto()
    return pub.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def key_id(pub: Any) -> str:
    """``"ed25519:<16 hex>"``: the first 16 hex digits of sha256 over the raw public key."""
    return "ed25519:" + hashlib.sha256(_raw_public(pub)).hexdigest()[:16]


def generate_key(prefix: str | os.PathLike) -> tuple[Path, Path]:
    """Write a new key pair ``PREFIX.key`` (private, 0600) and ``PREFIX.pub``; returns their paths.

    Both or neither: if either write fails, nothing is left behind (a lone ``PREFIX.key`` would make a rerun refuse).

    Raises:
        DsedgeError: either path is taken already (a file, a directory or a link, even a dangling one: a key is
            never overwritten, nor written through a link), or ``prefix`` has no file name.
        StorageError: a file could not be written (``runtime/storage.storage_error``; nothing is left behind).
    """
    if not str(prefix).strip() or str(prefix).endswith(("/", os.sep)) or Path(prefix).is_dir():
        raise DsedgeError(f"--out {str(prefix)!r} has no file name for the key pair",
                          "give a path prefix such as keys/release (writes keys/release.key and keys/release.pub)")
    serialization, ed25519 = _crypto()
    priv_path, pub_path = Path(f"{prefix}.key"), Path(f"{prefix}.pub")
    for p in (priv_path, pub_path):  # both are checked before either is written
        if p.exists() or p.is_symlink():
            what = "is a link" if p.is_symlink() else "is a directory" if p.is_dir() else "exists"
            raise DsedgeError(f"{p} {what}; refusing to overwrite a key", "choose another --out prefix")
    key = ed25519.Ed25519PrivateKey.generate()
    priv = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())
    pub = key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    priv_path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(priv_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)  # 0600 from the start; never follows a link
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(priv)
        write_bytes_atomic(pub_path, pub)
    except BaseException as e:  # an interrupt too
        priv_path.unlink(missing_ok=True)  # this call created it (O_EXCL): remove it, so a rerun can write the pair
        err = storage_error(e, "writing the key pair") if isinstance(e, OSError) else None
        if err is None:
            raise
        raise err from None
    return priv_path, pub_path


def load_private_key(path: str | os.PathLike) -> Any:
    """An Ed25519 private key from a PEM file. Raises DsedgeError (unreadable, not Ed25519)."""
    serialization, ed25519 = _crypto()
    try:
        key = serialization.load_pem_private_key(Path(path).read_bytes(), password=None)
    except (OSError, ValueError, TypeError) as e:
        raise DsedgeError(f"cannot read private key {path}: {str(e).splitlines()[0][:120]}",
                          "pass the .key file `dsedge keygen` wrote") from None
    if not isinstance(key, ed25519.Ed25519PrivateKey):
        raise DsedgeError(f"{path} is not an Ed25519 private key", "make one with `dsedge keygen`")
    return key


def load_public_key(data: Any) -> Any:
    """An Ed25519 public key from a key object, PEM bytes/str, or a ``.pub`` path.

    Raises:
        SignatureError: the file is missing, or it is not an Ed25519 PEM public key.
        InputError: ``data`` is not a key, a path or PEM text (e.g. ``123``, ``False``, a private key object).
    """
    serialization, ed25519 = _crypto()
    if isinstance(data, ed25519.Ed25519PublicKey):
        return data
    if isinstance(data, ed25519.Ed25519PrivateKey):
        raise InputError("a trusted key is a private key object",
                         "trust its public key (key.public_key(), or the .pub file `dsedge keygen` wrote)")
    if isinstance(data, str) and "-----BEGIN" in data:
        data = data.encode()
    if not isinstance(data, (bytes, str, os.PathLike)):
        raise InputError(f"a trusted key is a {type(data).__name__} ({str(data)[:40]!r}), not a public key", _KEYS_HINT)
    where = "a trusted key"  # PEM bytes given directly; a file is named
    if not isinstance(data, bytes):
        p = Path(data)
        where = f"trusted key file {str(p)!r}"
        if not str(data).strip():
            raise SignatureError("a trusted key path is empty", f"check trusted_keys / ${ENV}: name .pub files")
        if p.is_dir():
            raise SignatureError(f"trusted key {str(p)!r} is a folder, not a .pub file",
                                 f"name the .pub files in it (e.g. {str(p / 'release.pub')!r}) in trusted_keys / ${ENV}")
        if not p.is_file():
            raise SignatureError(f"trusted key file {str(p)!r} not found", f"check trusted_keys / ${ENV}")
        try:
            data = p.read_bytes()
        except OSError as e:
            raise SignatureError(f"cannot read trusted key file {str(p)!r} ({e.strerror})",
                                 f"check trusted_keys / ${ENV}") from None
    try:
        key = serialization.load_pem_public_key(data)
    except (ValueError, TypeError) as e:
        raise SignatureError(f"{where} is not a PEM public key ({str(e).splitlines()[0][:80] if str(e) else e})",
                             "pass the .pub file `dsedge keygen` wrote") from None
    if not isinstance(key, ed25519.Ed25519PublicKey):
        raise SignatureError(f"{where} is not an Ed25519 public key", "make keys with `dsedge keygen`")
    return key


def trusted_from(keys: Iterable[Any] | None) -> list[Any]:
    """Public keys from ``keys`` or, when None, from ``$DSEDGE_TRUSTED_KEYS`` (files or directories of ``*.pub``).

    Raises:
        SignatureError: a key file is missing or not an Ed25519 public key, ``keys`` is empty, or the environment
            names no key file.
        InputError: ``keys`` is not None, a path, PEM text, a public key object or a list of those.
    """
    if keys is None:
        env = os.environ.get(ENV, "")
        keys = []
        for part in filter(None, env.split(os.pathsep)):
            p = Path(part)
            keys.extend(sorted(p.glob("*.pub")) if p.is_dir() else [p])
        if env and not keys:
            raise SignatureError(f"${ENV} names no public key file ({env!r})", "point it at .pub files or a folder")
    elif isinstance(keys, (str, bytes, os.PathLike)) or _is_key_object(keys):
        keys = [keys]
    elif isinstance(keys, (list, tuple, set, frozenset)) or (
            hasattr(keys, "__iter__") and not isinstance(keys, (dict, bool))):
        keys = list(keys)
        if not keys:  # an empty list must not switch off a requirement set in the environment
            raise SignatureError("trusted_keys is empty", f"pass the .pub keys to trust, or None to use ${ENV}")
    else:
        raise InputError(f"trusted_keys must be a list of public keys, got {type(keys).__name__} {keys!r}"[:160],
                         _KEYS_HINT)
    return [load_public_key(k) for k in keys]


def _is_key_object(x: Any) -> bool:
    try:
        _, ed25519 = _crypto()
    except BackendUnavailable:
        return False
    return isinstance(x, (ed25519.Ed25519PublicKey, ed25519.Ed25519PrivateKey))


def _message(signer: str, manifest: bytes) -> bytes:
    return DOMAIN + signer.encode() + b"\x00" + manifest


@dataclass(frozen=True)
class SignatureInfo:
    """What ``manifest.sig`` says; ``valid``: the signature matches the manifest under its own public key;
    ``trusted``: that key is one of the configured trusted keys (None when no keys are configured)."""

    key_id: str
    signer: str
    valid: bool
    trusted: bool | None = None
    error: str | None = None  # manifest.sig is malformed (reported only when no trusted keys are configured)

    def to_dict(self) -> dict[str, Any]:
        d = {"key_id": self.key_id, "signer": self.signer, "valid": self.valid, "trusted": self.trusted}
        if self.error:
            d["error"] = self.error
        return d


def sign_bundle(bundle: str | os.PathLike, key_path: str | os.PathLike, signer: str | None = None) -> SignatureInfo:
    """Verify ``bundle`` (hashes), then write ``manifest.sig`` for its manifest with the private key at ``key_path``.

    Raises:
        BundleError / BundleIntegrityError: the bundle does not verify (a corrupt bundle is never signed).
        BundleError: its golden I/O is malformed (``dsedge verify`` would refuse it).
        DsedgeError: the key is unreadable, or ``signer`` is empty or over 200 characters.
    """
    if signer is not None and not signer.strip():
        raise DsedgeError("--signer is empty", "name who signs (recorded in the signature), or leave it out")
    if signer is not None and len(signer) > MAX_SIGNER:
        raise DsedgeError(f"--signer is {len(signer)} characters long (at most {MAX_SIGNER})",
                          "name who signs in a few words: a person, a team or a release pipeline")
    manifest = verify_bundle(bundle)
    if has_golden(manifest):  # what `dsedge verify` reads must read: a bundle it refuses is not signed
        load_golden(bundle, manifest)
    key = load_private_key(key_path)
    root = Path(bundle)
    manifest = (root / MANIFEST).read_bytes()
    signer = signer if signer is not None else Path(key_path).stem
    pub = key.public_key()
    doc = {"format": FORMAT, "algorithm": "ed25519", "key_id": key_id(pub),
           "public_key": base64.b64encode(_raw_public(pub)).decode(), "signer": signer,
           "manifest_sha256": hashlib.sha256(manifest).hexdigest(),
           "signature": base64.b64encode(key.sign(_message(signer, manifest))).decode()}
    write_text_atomic(root / SIGNATURE, json.dumps(doc, indent=2) + "\n")  # on failure, no temp file is left
    return SignatureInfo(doc["key_id"], signer, True)


def _read(root: Path) -> dict[str, Any] | None:
    """``manifest.sig`` as checked JSON (None when there is none). Raises SignatureError (a link, malformed)."""
    p = root / SIGNATURE
    if p.is_symlink():  # as for manifest.json: nothing outside the bundle is read
        raise SignatureError(f"{SIGNATURE} of {str(root)!r} is a link", "a bundle's signature must be a file inside it")
    if not p.exists():
        return None
    try:
        if not p.is_file():
            raise ValueError("not a file")
        with open(p, "rb") as f:  # a signature is under 1 KiB: never read a huge file whole
            data = f.read((1 << 20) + 1)
        if len(data) > 1 << 20:
            raise ValueError("over 1 MiB, not a signature")
        doc = json.loads(data.decode("utf-8"))
        if not isinstance(doc, dict):
            raise ValueError(f"a JSON {type(doc).__name__}, not an object")
        if doc.get("format") != FORMAT or doc.get("algorithm") != "ed25519":
            raise ValueError("unknown format")
        for k in ("public_key", "signature", "signer", "key_id"):
            if not isinstance(doc.get(k), str):
                raise ValueError(f"{k} is missing or not a string")
        if len(base64.b64decode(doc["public_key"], validate=True)) != 32:
            raise ValueError("public_key is not 32 bytes")
        if len(base64.b64decode(doc["signature"], validate=True)) != 64:
            raise ValueError("signature is not 64 bytes")
    except RecursionError:  # '[' x 100000: one file written into a bundle must not crash every load
        raise SignatureError(f"{SIGNATURE} of {root.name} is malformed (nested deeper than a signature is)",
                             "sign the bundle again with `dsedge sign`") from None
    except (ValueError, OSError) as e:  # binascii.Error, JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise SignatureError(f"{SIGNATURE} of {root.name} is malformed ({str(e).splitlines()[0][:80]})",
                             "sign the bundle again with `dsedge sign`") from None
    return doc


def _valid(pub: Any, doc: dict[str, Any], manifest: bytes) -> bool:
    from cryptography.exceptions import InvalidSignature

    try:
        pub.verify(base64.b64decode(doc["signature"]), _message(str(doc["signer"]), manifest))
        return True
    except InvalidSignature:
        return False


def check_signature(bundle: str | os.PathLike, trusted_keys: Iterable[Any] | None = None,
                    manifest_bytes: bytes | None = None) -> SignatureInfo | None:
    """Check ``manifest.sig`` against the trusted keys (``trusted_keys``, else ``$DSEDGE_TRUSTED_KEYS``).

    ``manifest_bytes``: the manifest as already read (the signature is checked over exactly these bytes; pass the
    ones that are then parsed, or use :func:`verify_signed`); None reads ``manifest.json``.
    Returns the signature's info (None when unsigned and no keys are configured). With no keys configured a
    malformed ``manifest.sig`` is logged as a warning and reported as ``SignatureInfo(valid=False)``.
    Raises:
        SignatureError: keys are configured and the bundle is unsigned, signed by a key not among them, or its
            manifest was changed after signing, or ``manifest.sig`` is malformed.
        InputError: ``trusted_keys`` is not a list of public keys.
        BackendUnavailable: a signature must be checked and ``cryptography`` is missing.
    """
    return _check(Path(bundle), trusted_from(trusted_keys), manifest_bytes)


def verify_signed(bundle: str | os.PathLike, trusted_keys: Iterable[Any] | None = None
                  ) -> tuple[Manifest, SignatureInfo | None]:
    """What ``dsedge.load`` checks before it opens anything: the signature (:func:`check_signature`) and the manifest
    and every file hash (``verify_bundle``), over one read of ``manifest.json`` (a manifest swapped between two reads
    could otherwise be verified signed and parsed unsigned). Returns (manifest, signature info)."""
    trusted = trusted_from(trusted_keys)
    data = read_manifest_bytes(bundle)
    info = _check(Path(bundle), trusted, data)
    return verify_bundle(bundle, manifest_bytes=data), info


def _check(root: Path, trusted: list[Any], manifest: bytes | None) -> SignatureInfo | None:
    exists = (root / SIGNATURE).exists() or (root / SIGNATURE).is_symlink()
    if not trusted and not exists:
        return None
    if not trusted:
        try:
            _crypto()
        except BackendUnavailable:
            return None  # nothing is required here; the signature cannot be read without cryptography
        try:
            doc = _read(root)
        except SignatureError as e:  # nothing is required: a broken signature must not stop an unsigned-ok load
            log.warning("%s (%s); loading anyway: no trusted keys are configured", e, e.hint)
            return SignatureInfo("", "", False, None, error=str(e))
        if doc is None:
            return None
    else:
        doc = _read(root)
    if doc is None:
        raise SignatureError(f"bundle {root.name} is unsigned and trusted keys are configured",
                             "sign it with `dsedge sign BUNDLE --key K`, or load without trusted keys")
    _, ed25519 = _crypto()
    if manifest is None:
        manifest = read_manifest_bytes(root)
    kid = str(doc["key_id"])
    signer = str(doc["signer"])
    if not trusted:  # reported only: is it valid under the public key it carries?
        own = ed25519.Ed25519PublicKey.from_public_bytes(base64.b64decode(doc["public_key"]))
        valid = key_id(own) == kid and _valid(own, doc, manifest)
        return SignatureInfo(kid, signer, valid, None)
    # the trust decision uses the trusted key objects themselves: the public key and key_id written in manifest.sig
    # are only hints (anyone can write a trusted key's id beside their own key)
    raw = base64.b64decode(doc["public_key"])
    candidates = [k for k in trusted if _raw_public(k) == raw or key_id(k) == kid]
    for k in candidates:
        if _valid(k, doc, manifest):
            return SignatureInfo(key_id(k), signer, True, True)
    if not candidates:
        raise SignatureError(f"bundle {root.name} is signed by {kid} ({signer!r}), which is not a trusted key",
                             f"add its .pub to trusted_keys / ${ENV}, or get the bundle from a trusted signer")
    if not any(_raw_public(k) == raw for k in candidates):
        raise SignatureError(f"{SIGNATURE} of {root.name} names trusted key {kid} but carries another public key: "
                             "it was not signed by that key", "get the bundle from a trusted signer")
    # manifest_sha256 (not itself signed) tells which side moved
    what = ("the manifest was changed" if doc.get("manifest_sha256") != hashlib.sha256(manifest).hexdigest()
            else "the signer name or the signature in manifest.sig was changed")
    raise SignatureError(f"bundle {root.name}: {what} after it was signed by {kid} (signature does not match)",
                         "rebuild and sign it again; do not edit signed bundles")
