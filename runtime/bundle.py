"""The bundle format: ``NAME-TARGET.dse/`` with ``manifest.json``, ``models/*.onnx``, ``build/``, ``report.json``.

Reading a bundle verifies the manifest schema and the sha256 of every listed file before anything runs, and never
executes code from it (JSON and ONNX only). Writing goes to a temporary directory beside the destination and is
renamed into place with ``os.replace``, so a crash never leaves a half-written bundle.
"""
from __future__ import annotations

import contextlib
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterator

from . import schema as _schema
from .errors import BundleError, BundleIntegrityError
from .files import sha256_file, usual_mode  # noqa: F401  (re-exported: bundle.sha256_file, bundle.usual_mode)
from .external_data import check_external_data
from .names import inside
from .tempdirs import disown, exchange, owned_temp_dir, publish_lock, release, remove_stale

SCHEMA_VERSION = 1
MANIFEST_SCHEMA = "dsedge.manifest/1"
MAX_MANIFEST_BYTES = 64 << 20
MANIFEST = "manifest.json"
SIGNATURE = "manifest.sig"  # detached Ed25519 signature over manifest.json (runtime/signing.py); not hash-listed
BUNDLE_SUFFIX = ".dse"
IO_DTYPES = {"float32", "float16", "bfloat16", "int64", "int32", "int8", "uint8", "bool"}  # what a manifest IO spec may be


@dataclass(frozen=True)
class IOSpec:
    """One model input or output.

    ``dtype`` is a numpy dtype name (``"int64"``, ``"float32"``, …); ``shape`` lists ints for static dims and strings
    for symbolic ones (``["batch", "sequence"]``); the same symbol must take the same value across a request's inputs.
    """

    name: str
    dtype: str
    shape: tuple[int | str, ...]
    value_range: tuple[int, int] | None = None  # inclusive [min, max] for integer inputs (token ids < vocab size)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "IOSpec":
        try:
            name, dtype, shape = d["name"], d["dtype"], d["shape"]
            vr = d.get("value_range")
            value_range = (int(vr[0]), int(vr[1])) if vr is not None else None
            if not isinstance(shape, list) or not all(isinstance(x, (int, str)) for x in shape):
                raise TypeError("shape must be a list of ints and names")
        except (KeyError, TypeError, ValueError, IndexError, AttributeError) as e:
            raise BundleError(f"manifest IO spec {d!r} is malformed ({e})", "rebuild the bundle with `dsedge build`") from None
        if dtype not in IO_DTYPES:
            raise BundleError(f"manifest IO spec {name!r} has unknown dtype {dtype!r}", f"use one of {sorted(IO_DTYPES)}")
        return cls(str(name), str(dtype), tuple(shape), value_range)

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"name": self.name, "dtype": self.dtype, "shape": list(self.shape)}
        if self.value_range is not None:
            d["value_range"] = list(self.value_range)
        return d


@dataclass
class Variant:
    """One compiled form of the model in the bundle (e.g. ``int4``, ``fp32``).

    ``size_bytes`` is the ONNX file size; ``accuracy`` holds metrics vs fp32 (e.g. ``cosine_mean``);
    ``latency_ms`` holds build-time CPU latency by batch size (``{"1": {"p50": …, "p99": …}}``; a model with a static
    batch axis is timed at its own batch size: ``first_latency``).
    ``batch_invariant``: False when a row's output depends on its batch-mates (e.g. per-tensor dynamic INT8; the
    scheduler then serves it at batch 1 unless the caller opts in), True when checked invariant, None (omitted in
    the JSON) when not recorded.
    """

    name: str
    precision: str
    file: str
    size_bytes: int = 0
    accuracy: dict[str, Any] = field(default_factory=dict)
    latency_ms: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    # golden I/O tolerances per output (runtime/golden.py): {"cosine_min", "max_abs_diff", "measured_max_abs_diff"}
    golden: dict[str, Any] = field(default_factory=dict)
    batch_invariant: bool | None = None

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Variant":
        try:
            return cls(
                name=d["name"], precision=d["precision"], file=d["file"], size_bytes=int(d.get("size_bytes", 0)),
                accuracy=dict(d.get("accuracy", {})), latency_ms=dict(d.get("latency_ms", {})),
                notes=list(d.get("notes", [])), golden=dict(d.get("golden", {})),
                batch_invariant=_optional_bool(d.get("batch_invariant")),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise BundleError(f"manifest variant {d!r} is malformed ({e})", "rebuild the bundle") from None


def first_latency(latency_ms: Any) -> dict[str, Any]:
    """The build-time latency record of the smallest batch in a variant's ``latency_ms`` (keys ``"1"``, ``"8"`` or
    ``"8x64"``: batch 1, or the static batch of a model without a dynamic batch axis); ``{}`` when there is none."""
    best: tuple[int, dict[str, Any]] | None = None
    for key, rec in (latency_ms or {}).items() if isinstance(latency_ms, dict) else ():
        head = str(key).partition("x")[0]
        if head.isdigit() and isinstance(rec, dict) and (best is None or int(head) < best[0]):
            best = (int(head), rec)
    return best[1] if best else {}


def _optional_bool(x: Any) -> bool | None:
    if x is None or isinstance(x, bool):
        return x
    raise TypeError(f"batch_invariant must be true, false or absent, got {x!r}")


@dataclass
class Manifest:
    """``manifest.json``: what the bundle holds and how to check it. ``files`` maps relative path → sha256 hex."""

    name: str
    target: dict[str, Any]
    inputs: list[IOSpec]
    outputs: list[IOSpec]
    variants: list[Variant]
    default_variant: str
    files: dict[str, str] = field(default_factory=dict)
    source: dict[str, Any] = field(default_factory=dict)
    shape_ranges: dict[str, dict[str, int]] = field(default_factory=dict)
    latency_budget_ms: float | None = None
    dsedge_version: str = ""
    schema_version: int = SCHEMA_VERSION
    schema: str = MANIFEST_SCHEMA

    def variant(self, name: str | None = None) -> Variant:
        """The variant called ``name`` (None: ``default_variant``). Raises BundleError if there is none (an empty
        name included: it named no variant, and opening the default instead would hide the mistake)."""
        name = self.default_variant if name is None else name
        for v in self.variants:
            if v.name == name:
                return v
        raise BundleError(
            f"bundle has no variant {name!r}", f"choose one of: {', '.join(v.name for v in self.variants)}"
        )

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for v in d["variants"]:
            if v.get("batch_invariant") is None:
                v.pop("batch_invariant", None)
        d["inputs"] = [s.to_dict() for s in self.inputs]
        d["outputs"] = [s.to_dict() for s in self.outputs]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Manifest":
        """Check ``d`` against the manifest schema and its consistency rules (``runtime/schema.py``), then build it.

        Raises:
            BundleError: one line naming the first bad field.
        """
        if not isinstance(d, dict):
            raise BundleError("manifest.json is not a JSON object", "rebuild the bundle with `dsedge build`")
        version = d.get("schema_version")
        if version != SCHEMA_VERSION:
            raise BundleError(
                f"manifest schema version {version!r} is not supported (this dsedge reads {SCHEMA_VERSION})",
                "rebuild the bundle with this dsedge version",
            )
        _schema.validate("manifest", d, BundleError, "manifest.json")
        return cls(
            name=d["name"], target=dict(d["target"]),
            inputs=[IOSpec.from_dict(x) for x in d["inputs"]],
            outputs=[IOSpec.from_dict(x) for x in d["outputs"]],
            variants=[Variant.from_dict(x) for x in d["variants"]],
            default_variant=d["default_variant"], files=dict(d["files"]),
            source=dict(d.get("source", {})), shape_ranges={k: dict(v) for k, v in d.get("shape_ranges", {}).items()},
            latency_budget_ms=d.get("latency_budget_ms"), dsedge_version=d.get("dsedge_version", ""),
            schema_version=version,
        )


def read_manifest_bytes(bundle: str | os.PathLike) -> bytes:
    """The bytes of ``bundle/manifest.json``, read once (a signature is checked over the very bytes that are parsed:
    ``runtime/signing.verify_signed``). Raises BundleError (no bundle, no manifest, a linked or oversized one)."""
    root = Path(bundle)
    if not root.exists():
        raise BundleError(f"bundle {str(root)!r} does not exist", "pass the .dse directory that `dsedge build` wrote")
    if not root.is_dir():
        raise BundleError(f"{str(root)!r} is not a bundle directory", "a bundle is a NAME-TARGET.dse/ directory")
    path = root / MANIFEST
    if not path.is_file():
        inside = sorted(p for p in root.glob("*.dse") if (p / MANIFEST).is_file())  # the --out folder of a build
        if inside:
            raise BundleError(f"{str(root)!r} is a folder of bundles ({', '.join(p.name for p in inside[:4])}"
                              f"{', …' if len(inside) > 4 else ''}), not a bundle",
                              f"pass the bundle itself, e.g. {str(inside[0])!r}")
        raise BundleError(f"{str(root)!r} has no {MANIFEST}", "is this a dsedge bundle? rebuild it with `dsedge build`")
    if path.is_symlink():
        raise BundleError(f"{MANIFEST} of {str(root)!r} is a link", "a bundle's manifest must be a file inside it")
    if path.stat().st_size > MAX_MANIFEST_BYTES:
        raise BundleError(f"{path} is {path.stat().st_size} bytes, more than a manifest can be "
                          f"({MAX_MANIFEST_BYTES >> 20} MiB)", "rebuild the bundle")
    with open(path, "rb") as f:
        data = f.read(MAX_MANIFEST_BYTES + 1)
    if len(data) > MAX_MANIFEST_BYTES:  # it grew after the size check
        raise BundleError(f"{path} is more than a manifest can be ({MAX_MANIFEST_BYTES >> 20} MiB)", "rebuild the bundle")
    return data


def read_manifest(bundle: str | os.PathLike, manifest_bytes: bytes | None = None) -> Manifest:
    """Parse ``bundle/manifest.json`` (or ``manifest_bytes``, the bytes already read from it) without checking file
    hashes. Raises BundleError."""
    data = read_manifest_bytes(bundle) if manifest_bytes is None else manifest_bytes
    path = Path(bundle) / MANIFEST
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BundleError(f"{path} is not valid JSON ({e})", "rebuild the bundle") from None
    return Manifest.from_dict(_schema.loads(text, BundleError, str(path), "rebuild the bundle"))


def verify_bundle(bundle: str | os.PathLike, manifest_bytes: bytes | None = None) -> Manifest:
    """Read the manifest (or parse ``manifest_bytes``: the bytes a signature was checked over) and check every
    listed file's sha256.

    Raises:
        BundleError: missing or malformed manifest.
        BundleIntegrityError: a listed file is missing, or its sha256 differs (truncated or tampered), or a
            variant's model file is not covered by a hash.
    """
    root = Path(bundle)
    m = read_manifest(root, manifest_bytes)
    for rel, expected in m.files.items():
        p = inside(root, rel, "manifest's file", BundleIntegrityError)
        if not p.is_file():
            what = "is missing" if not p.exists() else "is not a regular file (a folder, pipe or device)"
            raise BundleIntegrityError(f"bundle file {rel!r} {what}", "copy the whole .dse directory, or rebuild it")
        actual = sha256_file(p)
        if actual != expected:
            raise BundleIntegrityError(
                f"bundle file {rel!r} is corrupt or was modified (sha256 {actual[:12]}… ≠ {expected[:12]}…)",
                "copy the bundle again or rebuild it with `dsedge build`",
            )
    for v in m.variants:
        check_external_data(root / v.file, root, m.files)
        check_model_io(m, root / v.file)
    return m


def verify_variant_files(bundle: str | os.PathLike, manifest: Manifest, variant: Variant) -> None:
    """Check again, just before a backend opens it, the sha256 of ``variant``'s model file and of every external-data
    file it reads: for a variant opened after ``load()`` verified the bundle (a cascade variant, opened on first
    use), so a file replaced since is refused, not run.

    Raises:
        BundleIntegrityError: such a file is missing, differs from its manifest hash, or is not covered by one.
    """
    root = Path(bundle)
    for rel in [variant.file, *check_external_data(root / variant.file, root, manifest.files)]:
        p = inside(root, rel, "manifest's file", BundleIntegrityError)
        expected = manifest.files.get(rel)
        actual = sha256_file(p) if p.is_file() else None
        if expected is None or actual != expected:
            raise BundleIntegrityError(
                f"bundle file {rel!r} changed after the bundle was loaded"
                + (" (it is missing)" if actual is None else f" (sha256 {actual[:12]}…)"),
                "do not edit a bundle while it is served: copy a new one elsewhere and load that")


def check_model_io(manifest: Manifest, model_path: Path) -> None:
    """The ONNX graph's inputs and outputs must be the manifest's (names, dtypes, ranks, and every dim that both
    give as a number). Raises BundleError.

    Reads only the graph's value infos (onnx's protobuf, no weights are interpreted, nothing is executed).
    """
    try:
        import onnx
        from onnx import helper
    except ModuleNotFoundError:  # onnx is a base dependency; without it only ORT will notice a mismatch
        return
    graph = onnx.load(os.fspath(model_path), load_external_data=False).graph
    inits = {t.name for t in graph.initializer}

    def of(values) -> dict[str, tuple[str, tuple]]:
        out = {}
        for vi in values:
            if vi.name not in inits:
                t = vi.type.tensor_type
                dims = tuple(d.dim_value if d.HasField("dim_value") else None for d in t.shape.dim)
                out[vi.name] = (str(helper.tensor_dtype_to_np_dtype(t.elem_type)), dims)
        return out

    for kind, actual, specs in (("inputs", of(graph.input), manifest.inputs),
                                ("outputs", of(graph.output), manifest.outputs)):
        declared = {s.name: (s.dtype, tuple(s.shape)) for s in specs}
        differ = sorted(set(actual) ^ set(declared))
        for name in sorted(set(actual) & set(declared)):
            (a_dtype, a_dims), (d_dtype, d_dims) = actual[name], declared[name]
            if a_dtype != d_dtype or len(a_dims) != len(d_dims) or any(
                    isinstance(d, int) and a is not None and a != d for a, d in zip(a_dims, d_dims)):
                differ.append(name)
        if differ:
            raise BundleError(f"manifest {kind} do not match {model_path.name} (differ at {differ[0]!r})",
                              "the manifest was edited or belongs to another model: rebuild the bundle")


def hash_files(root: str | os.PathLike, exclude: tuple[str, ...] = (MANIFEST, SIGNATURE)) -> dict[str, str]:
    """sha256 of every file under ``root`` (relative POSIX paths), except ``exclude``."""
    root = Path(root)
    out = {}
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root).as_posix()
        if p.is_file() and rel not in exclude:
            out[rel] = sha256_file(p)
    return out


def write_manifest(root: str | os.PathLike, manifest: Manifest) -> None:
    """Hash every file under ``root`` into ``manifest.files`` and write ``manifest.json``.

    Raises:
        BundleError: the manifest would not pass its schema or consistency rules (so no reader could load it).
    """
    manifest.files = hash_files(root)
    text = _schema.dumps("manifest", manifest.to_dict(), BundleError, "manifest.json", root=root)
    for v in manifest.variants:  # every file a model reads is inside the bundle and hashed, before it is published
        check_external_data(Path(root) / v.file, root, manifest.files)
    (Path(root) / MANIFEST).write_text(text, encoding="utf-8")


def remove_stale_temp(parent: str | os.PathLike) -> list[Path]:
    """Remove temporary directories in ``parent`` left by processes that died (SIGKILL runs no clean-up); never
    a live process's. Ownership is an advisory lock, not a pid in the name: see ``runtime/tempdirs.py``."""
    return remove_stale(parent)


@contextlib.contextmanager
def atomic_directory(final: str | os.PathLike) -> Iterator[Path]:
    """Yield a fresh temporary directory beside ``final``; on success rename it to ``final``.

    The temporary directory lives in ``final``'s parent so renames never cross filesystems, and is owned by this
    process (``runtime/tempdirs.py``: no other build's clean-up removes it). An existing ``final`` is swapped with
    the new one atomically (``renameat2(RENAME_EXCHANGE)``; where that is missing, moved aside and moved back on
    failure) and removed only after the new one is in place; concurrent writers of one ``final`` take turns and the
    last one wins. On any exception the temporary directory is removed and ``final`` is left as it was.
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temp(final.parent)
    tmp = owned_temp_dir(final.parent, f".{final.name}.tmp-{os.getpid()}-")
    os.chmod(tmp, usual_mode(0o777))  # a private temp directory; a published bundle gets the user's usual mode
    try:
        yield tmp
        with publish_lock(final.parent):   # concurrent writers of one destination publish one after the other
            if final.exists() and exchange(tmp, final):
                pass                         # atomic swap: `final` is new, `tmp` holds the old bundle
            elif final.exists():
                old = owned_temp_dir(final.parent, f".{final.name}.tmp-{os.getpid()}-old-")
                os.replace(final, old / final.name)
                try:
                    os.replace(tmp, final)
                except BaseException:
                    os.replace(old / final.name, final)
                    raise
                finally:
                    release(old)
            else:
                os.replace(tmp, final)
                disown(tmp)
                return
        release(tmp)                          # the old bundle (swapped), or nothing
    except BaseException:
        release(tmp)
        raise
