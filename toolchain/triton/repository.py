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

import os
import re
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ...runtime.batching import BatchLayout
from ...runtime.bundle import Manifest, Variant, verify_bundle
from ...runtime.errors import DsedgeError, TargetError
from .pbtxt import Enum, to_pbtxt
from .policy import BatchingPolicy, derive_policy, dynamic_batching

PLATFORMS = ("onnxruntime", "tensorrt", "python")
TRITON_DTYPES = {"float32": "TYPE_FP32", "float16": "TYPE_FP16", "bfloat16": "TYPE_BF16", "int64": "TYPE_INT64",
                 "int32": "TYPE_INT32", "int8": "TYPE_INT8", "uint8": "TYPE_UINT8", "bool": "TYPE_BOOL"}
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


def is_gpu_target(manifest: Manifest) -> bool:
    return manifest.target.get("backend") == "tensorrt" or bool(manifest.target.get("gpu"))


def default_platform(bundle: str | os.PathLike, manifest: Manifest) -> str:
    """``tensorrt`` for a GPU target whose bundle holds engines, ``onnxruntime`` otherwise (CPU, or GPU without an
    engine: Triton's ORT backend builds the TensorRT engine itself through the accelerator)."""
    if is_gpu_target(manifest) and all(_engine_file(manifest, v) for v in manifest.variants):
        return "tensorrt"
    return "onnxruntime"


def _engine_file(manifest: Manifest, variant: Variant) -> str | None:
    for rel in manifest.files:
        if rel.endswith(".plan") and Path(rel).stem == variant.name:
            return rel
    return None


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


def _warmup(manifest: Manifest, policy: BatchingPolicy, model_dir: Path, seed: int = 0) -> list[dict]:
    """Warm-up at batch 1 and at the largest preferred batch, at the optimization profile's opt sizes.

    Float inputs use Triton's ``random_data``; integer inputs with a value range (token ids < vocabulary) get random
    values inside it, written to ``warmup/<input>`` (raw row-major bytes), since Triton's random integers would index
    outside an embedding table; integer inputs without a range get ``zero_data``.
    """
    batched = policy.max_batch_size > 0
    rng = np.random.default_rng(seed)
    fields: dict[str, dict] = {}
    for s in manifest.inputs:
        dims = []
        for i, d in enumerate(s.shape):
            if isinstance(d, int) and d >= 0:
                dims.append(d)
            elif i == 0 and batched:
                continue
            else:
                r = manifest.shape_ranges.get(str(d)) or (manifest.target.get("shapes") or {}).get(str(d)) or {}
                dims.append(int(r.get("opt", r.get("min", 1))))
        entry: dict[str, Any] = {"data_type": Enum(TRITON_DTYPES[s.dtype]), "dims": dims}
        dt = np.dtype(s.dtype)
        if s.value_range is not None and dt.kind in "iu":
            lo, hi = s.value_range
            (model_dir / "warmup").mkdir(exist_ok=True)
            data = rng.integers(lo, hi + 1, size=dims, dtype=np.int64).astype(dt.newbyteorder("<"))
            (model_dir / "warmup" / s.name).write_bytes(data.tobytes())
            entry["input_data_file"] = s.name
        elif dt.kind in "biu":  # integers without a known range: zeros are always a valid index
            entry["zero_data"] = True
        else:
            entry["random_data"] = True
        fields[s.name] = entry
    inputs = [{"key": k, "value": v} for k, v in fields.items()]
    sizes = sorted({1, *(policy.preferred_batch_sizes[-1:] if batched else ())})
    return [{"name": f"random_batch_{b}", "batch_size": b, "inputs": inputs, "count": 1}
            for b in sizes]


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

        from ...runtime.backends.ort_rewrites import gather_block_quantized

        proto = onnx.load(str(src))
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
    engine = _engine_file(manifest, variant)
    if engine:
        _link_or_copy(str(bundle / engine), str(version_dir / "model.plan"))
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
    return {"platform": "tensorrt_plan", "backend": "tensorrt"}


def _write_python(bundle: Path, variant: Variant, version_dir: Path, threads: int | None) -> dict[str, Any]:
    # the model.py Triton's Python stub runs: device-side code (it loads the bundle with dsedge), kept in sdk/
    with importlib.resources.as_file(importlib.resources.files("dsedge") / "triton_model.py") as model_py:
        shutil.copyfile(model_py, version_dir / "model.py")
    shutil.copytree(bundle, version_dir / "bundle.dse", copy_function=_link_or_copy)
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


class _staged_models:
    """A temporary folder inside the repository; on success each model folder in it replaces the one of the same
    name (renamed aside, then removed), on failure it is removed and the repository is left as it was."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def __enter__(self) -> Path:
        self.out.mkdir(parents=True, exist_ok=True)
        self.tmp = Path(tempfile.mkdtemp(prefix=f".dsedge-export-{os.getpid()}-", dir=self.out))
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
            ``config.pbtxt``). The models are written to a temporary folder inside it, then each is renamed into
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
    manifest = verify_bundle(bundle)
    platform = platform or default_platform(bundle, manifest)
    if platform not in PLATFORMS:
        raise DsedgeError(f"unknown Triton platform {platform!r}", f"choose one of: {', '.join(PLATFORMS)}")
    if instances is not None and instances < 1:
        raise DsedgeError(f"--instances must be ≥ 1, got {instances}", "pass 1 or more model instances per device")
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
                head = _write_python(bundle, variant, version_dir, threads)
            inputs, outputs = _io(manifest, policy, ragged=platform == "python" and layout.can_pad)
            kind = "KIND_GPU" if gpu and platform != "python" else "KIND_CPU"
            params = head.pop("parameters", [])
            config: dict[str, Any] = {
                "name": model.name, **head, "max_batch_size": policy.max_batch_size,
                "input": inputs, "output": outputs,
                "instance_group": [{"count": int(instances or 1), "kind": Enum(kind)}],
                "dynamic_batching": dynamic_batching(policy),
                "model_warmup": _warmup(manifest, policy, model_dir),
                "parameters": params or None,
            }
            comments = [f"dsedge export of {manifest.name} ({manifest.target.get('name')}), variant {variant.name} "
                        f"({variant.precision}), platform {platform}",
                        *policy.derived_from, *model.notes]
            if platform == "python":
                comments.append("production: parameters { key: \"EXECUTION_ENV_PATH\" value: { string_value: "
                                "\"$$TRITON_MODEL_DIRECTORY/env.tar.gz\" } } names a conda-pack'd env with numpy<2, "
                                "onnxruntime, onnx, dsedge")
            (model_dir / "config.pbtxt").write_text(to_pbtxt(config, comments), encoding="utf-8")
            model.files = sorted(p.relative_to(tmp).as_posix() for p in model_dir.rglob("*") if p.is_file()
                                 and "bundle.dse/" not in p.relative_to(tmp).as_posix())
            models.append(model)
    return TritonExport(out, models)
