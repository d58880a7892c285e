"""Write a Triton model repository from a dsedge bundle: one model per variant (cascade variants are separate models,
no ensemble), ``REPO/<bundle>_<variant>/config.pbtxt`` and ``REPO/<bundle>_<variant>/1/…``.

Platforms:
  * ``onnxruntime``: ``1/model.onnx`` for Triton's ONNX Runtime backend. On CPU instances a 4-bit embedding table is
    rewritten to ORT's ``GatherBlockQuantized`` in the file (the SDK does it in memory at load; Triton loads the file
    as it is). GPU targets get the TensorRT execution accelerator at the target's precision.
  * ``tensorrt``: ``1/model.plan`` when the bundle holds an engine for the variant, else ``1/model.onnx`` and
    ``build_engine.sh`` with the exact ``trtexec`` command that writes ``1/model.plan`` on the server.
  * ``python``: ``1/model.py`` that runs the bundle (copied to ``1/bundle.dse``) with ``Session.run`` on the batch
    Triton formed. Runs on any Triton; the stub's environment needs numpy < 2, onnxruntime, onnx and dsedge.
"""
from __future__ import annotations

import importlib.resources
import logging
import os
import re
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


from ...runtime.batching import BatchLayout
from ...runtime.bundle import MANIFEST, SIGNATURE, Manifest, Variant
from ...runtime.errors import BundleError, DsedgeError, InputError, TargetError
from ...runtime.files import enclosing_bundle
from ...runtime.names import inside
from ...runtime.signing import verify_signed
from .pbtxt import Enum, to_pbtxt
from .policy import BatchingPolicy, derive_policy, dynamic_batching
from .warmup import TRITON_DTYPES, _warmup  # noqa: F401  (_warmup: repository._warmup as before)

log = logging.getLogger("dsedge")

PLATFORMS = ("onnxruntime", "tensorrt", "python")
# Triton ORT backend's TensorRT accelerator takes FP32/FP16/INT8; INT4 is weight-only (W4A16, FP16 activations)
_TRT_PRECISION = {"fp32": "FP32", "fp16": "FP16", "bf16": "FP32", "int8": "INT8", "int4": "FP16"}


@dataclass
class TritonModel:
    """One exported model: its Triton name, the bundle variant, platform, batching settings and notes."""

    name: str
    variant: str
    platform: str
    policy: BatchingPolicy
    files: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


@dataclass
class TritonExport:
    """What ``export_triton`` wrote: the repository and its models (the default variant first)."""

    repository: Path
    models: list[TritonModel]


# Triton's TensorRT backend loads a version-compatible plan (a100/h100 profiles) only when told to trust its embedded
# lean runtime (the backend's "version-compatible" config, tensorrt_backend README)
VERSION_COMPATIBLE_FLAG = "--backend-config=tensorrt,version-compatible=true"
VERSION_COMPATIBLE_NOTE = "version-compatible TensorRT plan"


def is_gpu_target(manifest: Manifest) -> bool:
    return manifest.target.get("backend") == "tensorrt" or bool(manifest.target.get("gpu"))


def default_platform(bundle: str | os.PathLike, manifest: Manifest) -> str:
    """``tensorrt`` for a GPU target whose bundle holds engines, ``onnxruntime`` otherwise (CPU, or GPU without an
    engine: Triton's ORT backend builds the TensorRT engine itself through the accelerator)."""
    if is_gpu_target(manifest) and all(_engine_file(Path(bundle), manifest, v) for v in manifest.variants):
        return "tensorrt"
    return "onnxruntime"


def _engine_file(bundle: Path, manifest: Manifest, variant: Variant) -> tuple[str, dict | None] | None:
    """The bundle's engine for ``variant``, hash-listed: ``(path, None)`` for a raw ``engines/<variant>.plan``, or
    ``(path, header key)`` for an engine ``dsedge build --engine`` wrote (``engines/*.engine``: a dsedge header, then
    the plan) for this variant's model file on the GPU (not a DLA core); of several, the one built for the target's
    compute capability, else the first by name. None when there is none."""
    from ...runtime.engine_cache import SUFFIX, read_engine_header
    from ...runtime.errors import EngineError

    for rel in sorted(manifest.files):
        if rel.endswith(".plan") and Path(rel).stem == variant.name:
            return rel, None
    found = []
    for rel in sorted(r for r in manifest.files if r.startswith("engines/") and r.endswith(SUFFIX)):
        try:  # the header only: the chosen engine's plan is read (and its sha256 checked) once, when written
            header = read_engine_header(bundle / rel)
        except EngineError:
            continue  # not one the export can vouch for: the ONNX and build_engine.sh stand in
        key = header["key"]
        if (key.get("variant") == variant.name and key.get("dla_core") is None
                and key.get("model_sha256") == manifest.files.get(variant.file)):
            found.append((rel, key))
    cc = str(manifest.target.get("compute_capability") or "")
    return next((f for f in found if f[1].get("compute_capability") == cc), found[0] if found else None)


def model_name(manifest: Manifest, variant: Variant) -> str:
    return f"{manifest.name}_{variant.name}"


def _dims(spec_shape: tuple, batched: bool) -> list[int]:
    dims = [d if isinstance(d, int) and d >= 0 else -1 for d in spec_shape]
    return dims[1:] if batched else dims


def _io(manifest: Manifest, policy: BatchingPolicy, ragged: bool) -> tuple[list[dict], list[dict]]:
    batched = policy.max_batch_size > 0
    layout = BatchLayout.of(manifest.inputs, manifest.outputs)
    inputs = []
    for s in manifest.inputs:
        entry: dict[str, Any] = {"name": s.name, "data_type": Enum(TRITON_DTYPES[s.dtype]),
                                 "dims": _dims(s.shape, batched)}
        if ragged and len(s.shape) > 1 and s.shape[1] == layout.seq_symbol:
            entry["allow_ragged_batch"] = True
        inputs.append(entry)
    outputs = [{"name": s.name, "data_type": Enum(TRITON_DTYPES[s.dtype]), "dims": _dims(s.shape, batched)}
               for s in manifest.outputs]
    return inputs, outputs


def _link_or_copy(src: str, dst: str) -> str:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)
    return dst


def _param(key: str, value: str) -> dict:
    return {"key": key, "value": {"string_value": value}}


def _write_onnxruntime(bundle: Path, manifest: Manifest, variant: Variant, version_dir: Path, gpu: bool,
                       model: TritonModel, threads: int | None) -> dict[str, Any]:
    src = bundle / variant.file
    dst = version_dir / "model.onnx"
    rewritten = 0
    if not gpu and variant.precision == "int4":
        import onnx

        from ...runtime.backends.ort_rewrites import gather_block_quantized, int4_blocks_over

        proto = onnx.load(str(src))
        if int4_blocks_over(proto, 32):  # dsedge runs these at FP32 activations (runtime/backends/ort.py)
            model.notes.append("INT4 blocks over 32: ORT CPU's fused MatMulNBits at its default accuracy level (INT8 "
                               "activations), which Triton's onnxruntime backend uses, is not batch-invariant for "
                               "them (a request's answer depends on its batch-mates); dsedge's runtime runs them at "
                               "level 1 (session.qdq_matmulnbits_accuracy_level)")
        rewritten = gather_block_quantized(proto)
        if rewritten:
            onnx.save(proto, str(dst))
            model.notes.append(f"{rewritten} 4-bit embedding Gather(s) rewritten to com.microsoft GatherBlockQuantized "
                               "in model.onnx (ORT CPU would dequantize the whole table on every run)")
    if not rewritten:
        _link_or_copy(str(src), str(dst))
    cfg: dict[str, Any] = {"platform": "onnxruntime_onnx", "backend": "onnxruntime"}
    if threads:  # Triton's ORT backend session options, as dsedge's OrtBackend sets them
        cfg["parameters"] = [_param("intra_op_thread_count", str(threads)), _param("inter_op_thread_count", "1")]
    if gpu:
        precision = _TRT_PRECISION.get(variant.precision, "FP32")
        params = [{"key": "precision_mode", "value": precision}, {"key": "trt_engine_cache_enable", "value": "1"},
                  {"key": "trt_engine_cache_path", "value": "/tmp/triton_trt_cache"}]
        if manifest.target.get("workspace_mb"):
            params.append({"key": "max_workspace_size_bytes",
                           "value": str(int(manifest.target["workspace_mb"]) * (1 << 20))})
        cfg["optimization"] = {"execution_accelerators": {"gpu_execution_accelerator": [
            {"name": "tensorrt", "parameters": params}]}}
        model.notes.append(f"TensorRT accelerator at {precision} for {variant.precision} (target "
                           f"{manifest.target.get('name')})")
    return cfg


def _write_tensorrt(bundle: Path, manifest: Manifest, variant: Variant, model_dir: Path, version_dir: Path,
                    model: TritonModel) -> dict[str, Any]:
    engine = _engine_file(bundle, manifest, variant)
    if engine and engine[1] is None:
        _link_or_copy(str(bundle / engine[0]), str(version_dir / "model.plan"))
    elif engine:  # dsedge's engine file: the plan after its header, for the GPU and TensorRT it was built with
        from ...runtime.engine_cache import read_engine
        from ...runtime.files import write_bytes_atomic

        _, plan = read_engine(bundle / engine[0])
        write_bytes_atomic(version_dir / "model.plan", plan)
        key = engine[1]
        model.notes.append(f"1/model.plan is {engine[0]}'s plan, built for {key.get('gpu')} (sm"
                           f"{str(key.get('compute_capability', '?')).replace('.', '')}) with TensorRT "
                           f"{key.get('tensorrt')}: the Triton server needs that GPU model and TensorRT version "
                           "(else run the trtexec recipe, build/trtexec.sh, on it)")
    else:
        from ...runtime.build_settings import engine_build_settings
        from ..recipe import trtexec_args

        settings = engine_build_settings(
            manifest.target, {"name": "model", "precision": variant.precision, "file": "1/model.onnx"},
            [s.to_dict() for s in manifest.inputs], manifest.shape_ranges)
        args = trtexec_args(settings, engine_dir="1", timing_cache="timing.cache")
        _link_or_copy(str(bundle / variant.file), str(version_dir / "model.onnx"))
        lines = ["#!/usr/bin/env bash",
                 f"# Builds 1/model.plan for {model.name} on the Triton server (same GPU and TensorRT as the server).",
                 *[f"# {n}" for n in settings.notes],
                 "set -euo pipefail", 'cd "$(dirname "$0")"', "trtexec " + " ".join(args), ""]
        script = model_dir / "build_engine.sh"
        script.write_text("\n".join(lines), encoding="utf-8")
        script.chmod(0o755)
        model.notes.append("no engine in the bundle: run build_engine.sh on the server to write 1/model.plan")
    if manifest.target.get("version_compatible"):  # the plan embeds the lean runtime: Triton must allow host code
        model.notes.append(f"{VERSION_COMPATIBLE_NOTE}: start tritonserver with {VERSION_COMPATIBLE_FLAG}")
    return {"platform": "tensorrt_plan", "backend": "tensorrt"}


def _copy_bundle(bundle: Path, manifest: Manifest, dest: Path) -> None:
    """Copy the files the manifest lists, ``manifest.json`` and ``manifest.sig`` (if any) to ``dest``: nothing else
    of the bundle's folder, and never through a link (a linked folder could hold anything, a private key included).
    ``verify_signed`` checked them just before (``inside``: no listed path leaves the bundle)."""
    names = [MANIFEST, *([SIGNATURE] if (bundle / SIGNATURE).is_file() else []), *manifest.files]
    for rel in names:
        src = inside(bundle, rel, "bundle file", BundleError)  # resolves under the bundle
        for part in [src, *src.parents]:
            if part == bundle:
                break
            if part.is_symlink():
                raise BundleError(f"bundle file {rel!r} is reached through a link ({part.name})",
                                  "a bundle's files must be inside it: rebuild or copy it without links")
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        _link_or_copy(str(src), str(target))


def _write_python(bundle: Path, manifest: Manifest, variant: Variant, version_dir: Path,
                  threads: int | None) -> dict[str, Any]:
    # the model.py Triton's Python stub runs: device-side code (it loads the bundle with dsedge), kept in sdk/
    with importlib.resources.as_file(importlib.resources.files("dsedge") / "triton_model.py") as model_py:
        shutil.copyfile(model_py, version_dir / "model.py")
    _copy_bundle(bundle, manifest, version_dir / "bundle.dse")
    params = [_param("variant", variant.name), _param("bundle", "bundle.dse")]
    if threads:
        params.append(_param("threads", str(threads)))
    return {"backend": "python", "parameters": params}


def _check_repository(out: Path) -> None:
    """Refuse an ``--out`` that is a file, or a folder holding anything but Triton models (never replace a user's
    folder, ``/`` or ``$HOME``, by a repository)."""
    if out.exists() and not out.is_dir():
        raise DsedgeError(f"--out {str(out)!r} is a file, not a model repository folder",
                          "pass a new or empty folder, or an existing Triton model repository")
    if not out.is_dir():
        return
    foreign = [p.name for p in sorted(out.iterdir())
               if not p.name.startswith(".") and not (p.is_dir() and (p / "config.pbtxt").is_file())]
    if foreign:
        raise DsedgeError(f"--out {str(out)!r} is not a Triton model repository: it holds {foreign[0]!r} (not a "
                          "model folder with config.pbtxt)", "pass a new or empty folder, or a model repository")


_EXPORTED = re.compile(r"^# dsedge export of (\S+) \(([^)]*)\)")


def _check_targets(out: Path, names: list[str], manifest: Manifest) -> None:
    """Refuse to replace a model this exporter wrote for another target: model names carry the bundle's name and
    variant, not its target, and one repository serves one machine (a jetson ``_fp32`` replaced by a cpu one, next
    to the jetson ``_int4``, mixed the two)."""
    target = str(manifest.target.get("name"))
    for name in names:
        config = out / name / "config.pbtxt"
        if not config.is_file():
            continue
        with open(config, encoding="utf-8", errors="replace") as f:
            got = _EXPORTED.match(f.readline())
        if got and got.group(2) != target:
            raise DsedgeError(f"{str(out / name)!r} holds the {got.group(2)} export of {got.group(1)}; this bundle's "
                              f"target is {target}: a repository serves one machine",
                              "export into another --out, or remove that model folder first")


def _remove_stale_staging(folder: Path, prefix: str) -> None:
    """Remove ``folder``'s ``<prefix><pid>-*`` staging folders whose process is gone (an export killed mid-way):
    tritonserver would take one inside a repository for a model and fail. One of a running process is kept."""
    for p in folder.glob(f"{prefix}*"):
        pid = p.name[len(prefix):].split("-", 1)[0]
        if not (pid.isdigit() and p.is_dir()) or int(pid) == os.getpid():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(p, ignore_errors=True)
        except OSError:  # exists, another user's (PermissionError), or cannot tell: keep it
            pass


class _staged_models:
    """A temporary folder beside the repository (inside it only when the folder above is not writable or on
    another file system, e.g. a mount point: renames cannot cross one); on success each model folder in it replaces
    the one of the same name (renamed aside, then removed), on failure it is removed and the repository is left as
    it was. Not inside by default: tritonserver takes every folder of the repository for a model, hidden ones too,
    so a staging folder there fails a server polling the repository, and one a killed export left behind fails
    every later start ("failed to load all models"). Staging folders an export killed before its clean-up left (their
    process no longer runs) are removed first, in both places; staging inside is said on the ``dsedge`` logger."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def __enter__(self) -> Path:
        self.out.mkdir(parents=True, exist_ok=True)
        here = Path(os.path.abspath(self.out))  # "." has no name and is its own parent
        _remove_stale_staging(self.out, ".dsedge-export-")
        try:
            _remove_stale_staging(here.parent, f".{here.name}.dsedge-export-")
            self.tmp = Path(tempfile.mkdtemp(prefix=f".{here.name}.dsedge-export-{os.getpid()}-", dir=here.parent))
        except OSError:
            self.tmp = None
        if self.tmp is not None and os.stat(self.tmp).st_dev != os.stat(self.out).st_dev:
            os.rmdir(self.tmp)
            self.tmp = None
        if self.tmp is None:
            self.tmp = Path(tempfile.mkdtemp(prefix=f".dsedge-export-{os.getpid()}-", dir=self.out))
            log.warning("staging the export inside %s (the folder above it is not writable or on another file "
                        "system): a Triton server polling it logs a failed load of %s until the export ends",
                        self.out, self.tmp.name)
        return self.tmp

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        try:
            if exc_type is None:
                for model in sorted(p for p in self.tmp.iterdir() if p.is_dir()):
                    dest = self.out / model.name
                    old = self.tmp / f".replaced-{model.name}"
                    if dest.exists():
                        os.replace(dest, old)
                    os.replace(model, dest)
        finally:
            shutil.rmtree(self.tmp, ignore_errors=True)


def export_triton(bundle: str | os.PathLike, out: str | os.PathLike, platform: str | None = None,
                  instances: int | None = None, threads: int | None = None) -> TritonExport:
    """Write ``out`` as a Triton model repository for every variant of ``bundle``.

    Args:
        bundle: a ``NAME-TARGET.dse`` directory (verified: manifest and every sha256).
        out: the repository directory: new, empty, or a Triton model repository (every entry a folder with a
            ``config.pbtxt``). The models are written to a temporary folder beside it, then each is renamed into
            place; a model of the same name is replaced (not one exported for another target: refused), every
            other entry is left as it is.
        platform: ``onnxruntime``, ``tensorrt`` or ``python`` (default: :func:`default_platform`).
        instances: model instances per device (default 1: on CPU one ORT session uses every core).
        threads: ORT intra-op threads per instance (``python`` and ``onnxruntime``; default: ORT's choice).
    Returns:
        :class:`TritonExport` (repository path, models with their batching settings and notes).
    Raises:
        BundleError / BundleIntegrityError: the bundle does not verify.
        TargetError: ``tensorrt`` for a bundle whose target has no TensorRT.
        DsedgeError: unknown platform, ``instances`` < 1, ``out`` holds something that is not a Triton model, or
            a model of the same name that dsedge exported for another target.
    """
    bundle = Path(bundle)
    # what dsedge.load checks (the signature too, when $DSEDGE_TRUSTED_KEYS is set): a bundle load would refuse is
    # not exported for Triton to serve
    manifest, _ = verify_signed(bundle)
    platform = platform or default_platform(bundle, manifest)
    if platform not in PLATFORMS:
        raise DsedgeError(f"unknown Triton platform {platform!r}", f"choose one of: {', '.join(PLATFORMS)}")
    if instances is not None and instances < 1:
        raise DsedgeError(f"--instances must be ≥ 1, got {instances}", "pass 1 or more model instances per device")
    if threads is not None and platform == "tensorrt":
        raise InputError("--threads sets ONNX Runtime's intra-op threads; a TensorRT plan has none to set",
                         "leave --threads out with --platform tensorrt, or export with --platform onnxruntime")
    out_abs, bundle_abs = Path(os.path.abspath(out)), Path(os.path.abspath(bundle))
    inside = bundle_abs if (out_abs == bundle_abs or bundle_abs in out_abs.parents
                            or out_abs.resolve().is_relative_to(bundle.resolve())) else enclosing_bundle(out)
    if inside is not None:  # this bundle, or another one (a user's pass wrote a repository into another bundle)
        raise DsedgeError(f"--out {str(out)!r} is inside the bundle {str(inside)!r}",
                          "write the model repository outside the bundle (a bundle holds only its listed files)")
    gpu = is_gpu_target(manifest)
    if platform == "tensorrt" and manifest.target.get("backend") != "tensorrt":
        raise TargetError(f"target {manifest.target.get('name')} runs ONNX Runtime, not TensorRT",
                          "export with --platform onnxruntime or python")
    layout = BatchLayout.of(manifest.inputs, manifest.outputs)
    ordered = [manifest.variant()] + [v for v in manifest.variants if v.name != manifest.default_variant]
    models: list[TritonModel] = []
    out = Path(out)
    _check_repository(out)
    _check_targets(out, [model_name(manifest, v) for v in ordered], manifest)
    with _staged_models(out) as tmp:
        for variant in ordered:
            policy = derive_policy(manifest, variant, gpu)
            model = TritonModel(model_name(manifest, variant), variant.name, platform, policy)
            model_dir = tmp / model.name
            version_dir = model_dir / "1"
            version_dir.mkdir(parents=True)
            if platform == "onnxruntime":
                head = _write_onnxruntime(bundle, manifest, variant, version_dir, gpu, model, threads)
            elif platform == "tensorrt":
                head = _write_tensorrt(bundle, manifest, variant, model_dir, version_dir, model)
            else:
                head = _write_python(bundle, manifest, variant, version_dir, threads)
            inputs, outputs = _io(manifest, policy, ragged=platform == "python" and layout.can_pad)
            kind = "KIND_GPU" if gpu and platform != "python" else "KIND_CPU"
            params = head.pop("parameters", [])
            config: dict[str, Any] = {
                "name": model.name, **head, "max_batch_size": policy.max_batch_size,
                "input": inputs, "output": outputs,
                "instance_group": [{"count": int(instances or 1), "kind": Enum(kind)}],
                "dynamic_batching": dynamic_batching(policy),
                "model_warmup": _warmup(manifest, policy, model_dir, notes=model.notes),
                "parameters": params or None,
            }
            comments = [f"dsedge export of {manifest.name} ({manifest.target.get('name')}), variant {variant.name} "
                        f"({variant.precision}), platform {platform}",
                        *policy.derived_from, *model.notes]
            if platform == "python":
                comments.append("production: parameters { key: \"EXECUTION_ENV_PATH\" value: { string_value: "
                                "\"$$TRITON_MODEL_DIRECTORY/dsedge-stub.tar.gz\" } } names a conda-pack'd env with numpy<2, "
                                "onnxruntime, onnx, dsedge")
            (model_dir / "config.pbtxt").write_text(to_pbtxt(config, comments), encoding="utf-8")
            model.files = sorted(p.relative_to(tmp).as_posix() for p in model_dir.rglob("*") if p.is_file()
                                 and "bundle.dse/" not in p.relative_to(tmp).as_posix())
            models.append(model)
    return TritonExport(out, models)
