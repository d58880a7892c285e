"""ONNX Runtime backend with an honest provider list.

onnxruntime-gpu installs and falls back to CPU silently, so the providers reported are always the ones the session
really got (``InferenceSession.get_providers()``), not the ones asked for.
"""
from __future__ import annotations

import functools
import logging
import math
import os
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from ..errors import BackendUnavailable, BundleError
from ..instances import check_threads
from ..run_cancel import RunCancel, RunCancelled

log = logging.getLogger("dsedge")

# Preference order where present: TensorRT EP, CUDA EP, CPU EP. Providers outside it are used only when asked for.
PROVIDER_CHAIN = ("TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider")
# In ORT's default CPU wheels (1.16+): it runs only ONNX Runtime extensions' cloud-invoker ops (a remote endpoint),
# none of a dsedge model's, so ORT places every node on the next provider while get_providers() lists it first.
AZURE = "AzureExecutionProvider"


ORT_INSTALL_HINT = ("pip install 'dsedge[cpu]' (CPU), 'dsedge[gpu]' (x86 CUDA: onnxruntime-gpu), or on Jetson the "
                    "onnxruntime-gpu wheel built for your JetPack (docs/jetpack.md)")


def import_ort():
    """The ``onnxruntime`` module (CPU or GPU wheel, both install it under that name).

    Raises:
        BackendUnavailable: no ONNX Runtime wheel is installed (dsedge's core does not pull one: see the extras).
    """
    try:
        import onnxruntime as ort
    except ImportError:
        raise BackendUnavailable("ONNX Runtime is not installed (dsedge needs one of onnxruntime / onnxruntime-gpu)",
                                 ORT_INSTALL_HINT) from None
    if not hasattr(ort, "InferenceSession"):  # a half-removed wheel (CPU and GPU installed, one uninstalled)
        raise BackendUnavailable("the onnxruntime module is broken (no InferenceSession): the CPU and GPU wheels were "
                                 "probably installed over each other", "pip uninstall -y onnxruntime onnxruntime-gpu, "
                                 "then install one: " + ORT_INSTALL_HINT)
    return ort


def ort_distributions() -> list[str]:
    """Installed ONNX Runtime distributions (``onnxruntime``, ``onnxruntime-gpu``, …): more than one is a broken
    environment, as they install the same module."""
    from importlib.metadata import PackageNotFoundError, version

    out = []
    for name in ("onnxruntime", "onnxruntime-gpu", "onnxruntime-directml", "onnxruntime-openvino", "onnxruntime-qnn"):
        try:
            out.append(f"{name} {version(name)}")
        except PackageNotFoundError:
            continue
    return out


def available_providers() -> list[str]:
    """ORT providers this installation offers, in dsedge's preference order (others after)."""
    ort = import_ort()
    have = ort.get_available_providers()
    return [p for p in PROVIDER_CHAIN if p in have] + [p for p in have if p not in PROVIDER_CHAIN]


def check_providers_given(requested: Sequence[str] | None) -> None:
    """InputError for ``providers=[]`` (or ``()``, ``""``): a list that names no provider is a mistake, not "no
    preference" (that is None); and for anything but a str, list or tuple (``providers=123``)."""
    from ..errors import InputError

    if requested is not None and not isinstance(requested, (str, list, tuple)):
        raise InputError(f"providers must be a list of ONNX Runtime provider names, got {type(requested).__name__} "
                         f"{requested!r:.80}", "pass e.g. providers=['CPUExecutionProvider'], or omit it")
    if requested is not None and not requested:
        raise InputError(f"providers={requested!r} names no provider",
                         "omit providers= for the default chain (TensorRT → CUDA → CPU, whichever exist), or name "
                         "one, e.g. providers=['CPUExecutionProvider']")


def choose_providers(requested: Sequence[str] | None = None) -> list[str]:
    """Providers to ask for: ``requested`` (each must exist) or the chain filtered by what is installed.

    Raises:
        BackendUnavailable: a requested provider is not in this onnxruntime build. InputError: an entry is not a name,
            or ``requested`` is empty (``check_providers_given``).
    """
    check_providers_given(requested)
    have = available_providers()
    if requested:
        for odd in (p for p in requested if not isinstance(p, str)):  # e.g. ORT's ("Name", {options}) form
            from ..errors import InputError

            raise InputError(f"providers must be ONNX Runtime provider names (str), got {type(odd).__name__} "
                             f"{odd!r:.80}", "pass names, e.g. providers=['CUDAExecutionProvider', "
                             "'CPUExecutionProvider']; dsedge sets the provider options from the bundle")
        missing = [p for p in requested if p not in have]
        if missing:
            raise BackendUnavailable(f"ONNX Runtime provider {missing[0]} is not available here",
                                     f"available: {', '.join(have)}")
        return list(requested)
    return [p for p in have if p in PROVIDER_CHAIN]


# ORT CPU fuses DequantizeLinear(INT4, block_size) → MatMul into MatMulNBits, by default at accuracy level 4 (INT8
# activations). At blocks over 32 that kernel is not batch-invariant: a row alone and batched differed by 2.6e-2
# (block 64) and 3.0e-2 (block 128) of max|alone| on MiniLM's jetson int4, against 3e-7 at block 32 or at level 1
# (FP32 activations), which costs ~10 % here (b32×64: 549 vs 488 ms, one thread). Those graphs run at level 1.
WIDE_INT4_ACCURACY_LEVEL = "1"


def _cpu_rewrites(path: str) -> tuple[str | bytes, int, bool]:
    """Apply ORT-CPU load-time rewrites; returns the serialized model if anything changed, else the path, the
    number of rewrites, and whether the graph holds INT4 blocks over 32 (see ``WIDE_INT4_ACCURACY_LEVEL``). (A
    rewritten table's ids are checked at the session's input: ``dsedge.load`` reads their range from the graph.)"""
    try:
        import onnx
    except ModuleNotFoundError:  # the rewrites are a speed-up, never required
        return path, 0, False
    from .ort_rewrites import gather_block_quantized, int4_blocks_over

    try:
        model = onnx.load(path)
    except Exception:  # let ORT report an unreadable model with its own message
        return path, 0, False
    wide = int4_blocks_over(model, 32)
    n = gather_block_quantized(model)
    return (model.SerializeToString(), n, wide) if n else (path, 0, wide)


def provider_options(providers: Sequence[str], manifest: Any = None, variant: Any = None,
                     cache_dir: str | os.PathLike | None = None) -> list[dict[str, Any]]:
    """ORT provider options, one dict per provider, set from the bundle (ORT's TensorRT / CUDA EP option names).

    TensorRT EP: engine and timing caches on (``cache_dir``, default ``$DSEDGE_ENGINE_CACHE/ort-trt/ortX-trtY``, one
    folder per ONNX Runtime and TensorRT version), FP16 for
    fp16/int8/int4 variants, INT8 for int8 (explicit Q/DQ), the optimization profile from the recipe's shapes
    (``trt_profile_min/opt/max_shapes``), the target's workspace. CUDA EP: device 0, cuDNN heuristic search. Others: {}.
    """
    out: list[dict[str, Any]] = []
    precision = str(getattr(variant, "precision", "") or "")
    for p in providers:
        if p == "TensorrtExecutionProvider":
            from ..engine_cache import default_cache_dir

            root = Path(cache_dir) if cache_dir is not None else default_cache_dir() / "ort-trt" / _ort_trt_slot()
            try:
                root.mkdir(parents=True, exist_ok=True)
            except OSError:  # a read-only home: the EP then builds without a cache
                pass
            o: dict[str, Any] = {"device_id": 0, "trt_engine_cache_enable": True,
                                 "trt_engine_cache_path": os.fspath(root), "trt_timing_cache_enable": True,
                                 "trt_timing_cache_path": os.fspath(root),
                                 "trt_fp16_enable": precision in ("fp16", "int8", "int4"),
                                 "trt_int8_enable": precision == "int8"}
            o.update(_trt_profile(manifest, variant))
            out.append(o)
        elif p == "CUDAExecutionProvider":
            out.append({"device_id": 0, "cudnn_conv_algo_search": "HEURISTIC"})
        else:
            out.append({})
    return out


def _shrink_above(manifest: Any) -> tuple[str, int] | None:
    """The input with the most elements at the bundle's optimization-profile ``opt`` point (its shape ranges) and
    that count, or None (no shape ranges, or no input all of whose dims they bound).

    A run with a larger input gives ORT's CPU arena back what it took (``memory.enable_memory_arena_shrinkage``),
    so one outlier request does not keep its peak for the process's life: after one 64 × 512-token MiniLM batch a
    1-thread session held 1,319 MB against 107 MB before it, and 171 MB with the shrink (the batch itself as fast:
    7.70 against 7.75 s). Runs at or under ``opt`` keep the arena: shrinking after every 8 × 128-token run cost 6 %
    (182.1 against 171.6 ms p50), after 1 × 32 nothing measurable (2-core AMD EPYC, ORT 1.32)."""
    if manifest is None or not manifest.shape_ranges:
        return None
    from ..build_settings import resolve_shapes
    from ..errors import DsedgeError

    try:  # the optimization profile's shapes, as the TensorRT EP gets them
        shapes = resolve_shapes([i.to_dict() for i in manifest.inputs], manifest.shape_ranges)
    except DsedgeError:  # a dim without a range: no opt point to measure against
        return None
    name = max(shapes, key=lambda n: math.prod(shapes[n][1]), default=None)
    return None if name is None else (name, math.prod(shapes[name][1]))


def _ort_trt_slot() -> str:
    """The TensorRT EP names its cached engines by model hash and GPU (``_sm87``) only, and loads them after a
    TensorRT or ONNX Runtime upgrade too (its docs: delete the cache then): one folder per ORT and TensorRT version."""
    import re

    from .tensorrt import tensorrt_version

    ort = import_ort()
    return re.sub(r"[^A-Za-z0-9.]+", "-", f"ort{ort.__version__}-trt{tensorrt_version() or 'unknown'}")


def _trt_profile(manifest: Any, variant: Any) -> dict[str, Any]:
    if manifest is None or variant is None:
        return {}
    from ..build_settings import engine_build_settings
    from ..errors import DsedgeError

    try:
        s = engine_build_settings(manifest.target, {"name": variant.name, "precision": variant.precision,
                                                    "file": variant.file},
                                  [i.to_dict() for i in manifest.inputs], manifest.shape_ranges)
    except DsedgeError:  # a target without TensorRT settings: let the EP pick shapes
        return {}
    o: dict[str, Any] = {}
    if s.workspace_mb:
        o["trt_max_workspace_size"] = int(s.workspace_mb) << 20
    if s.shapes:
        for i, key in enumerate(("trt_profile_min_shapes", "trt_profile_opt_shapes", "trt_profile_max_shapes")):
            o[key] = ",".join(f"{n}:{'x'.join(map(str, shp[i]))}" for n, shp in s.shapes.items())
    return o


class OrtBackend:
    """One ``onnxruntime.InferenceSession`` over an ONNX file.

    Args:
        model_path: the ONNX file.
        providers: ORT provider names, or None for the TensorRT → CUDA → CPU chain.
        threads: intra-op threads (None: ORT's default, i.e. all cores).
        spin: let ORT's intra-op threads spin-wait between runs (ORT's default; session config key
            ``session.intra_op.allow_spinning``). Off here: a spinning pool keeps every core busy between
            batches, and the callers this session serves (its scheduler thread, a server's event loop, the
            client on the same box) then wait for a core. Measured with ``dsedge serve`` on a 2-core host at 0.5×
            and 1.5× load: in-budget answers 87–91 % / 71–82 % spinning vs 98–99 % / 86–89 % not. The price, one
            caller alone on an idle machine: MiniLM b1×32 and b32×64 run 0–15 % slower (two rounds, same host).
            With ``threads=1`` there is no pool and nothing spins.
        bundle: ``(manifest, variant)`` the model comes from: sets the TensorRT/CUDA EP options (``provider_options``).
        iobinding: run through ``IOBinding`` with outputs left on the provider's device and copied back once (default:
            when the first provider is the CUDA or TensorRT EP).
    Raises:
        BundleError: ORT cannot load the model.
    """

    name = "onnxruntime"

    def __init__(self, model_path: str | os.PathLike, providers: Sequence[str] | None = None,
                 threads: int | None = None, *, bundle: tuple[Any, Any] | None = None,
                 iobinding: bool | None = None, spin: bool = False) -> None:
        check_threads(threads)
        ort = import_ort()
        opts = ort.SessionOptions()
        if threads:
            opts.intra_op_num_threads = int(threads)
            opts.inter_op_num_threads = 1
        opts.add_session_config_entry("session.intra_op.allow_spinning", "1" if spin else "0")
        opts.log_severity_level = 3
        chosen = choose_providers(providers)
        if AZURE in chosen:  # asked for by name (never in the chain): the model would run on the next one, unsaid
            rest = [p for p in chosen if p != AZURE] or ["CPUExecutionProvider"]
            log.warning("%s runs no node of this model (it serves only ONNX Runtime extensions' cloud-invoker ops); "
                        "it runs locally on %s instead", AZURE, ", ".join(rest))
            chosen = rest
        model: str | bytes = os.fspath(model_path)
        self.rewrites = 0
        if chosen and chosen[0] == "CPUExecutionProvider":
            model, self.rewrites, wide_int4 = _cpu_rewrites(model)
            if wide_int4:  # batch invariance over INT8-activation speed (WIDE_INT4_ACCURACY_LEVEL)
                opts.add_session_config_entry("session.qdq_matmulnbits_accuracy_level", WIDE_INT4_ACCURACY_LEVEL)
        try:
            options = provider_options(chosen, *(bundle or (None, None)))
            self.session = ort.InferenceSession(model, sess_options=opts, providers=list(zip(chosen, options)))
        except Exception as e:  # ORT raises its own exception types (Fail, InvalidGraph, …)
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            versioned = any(w in first.lower() for w in ("opset", "ir version", "domain_version", "unsupported model"))
            hint = (f"this onnxruntime ({ort.__version__}) does not support the model's opset or IR version: "
                    "install a newer onnxruntime, or rebuild the bundle for this one's opset" if versioned else
                    "the graph is not one ONNX Runtime accepts (a type or shape mismatch, an unknown op): rebuild "
                    "the bundle with `dsedge build`, or check the tool that wrote the model")
            if "NOT_IMPLEMENTED" in first and chosen and chosen[0] == "CPUExecutionProvider":
                hint = ("ONNX Runtime's CPU provider has no kernel for an op of this model (a BF16 variant is for "
                        "GPUs: A100, H100, Jetson Orin): load another variant (`dsedge inspect BUNDLE` lists them) "
                        "or run it where CUDA or TensorRT is")
            raise BundleError(f"ONNX Runtime cannot load {os.fspath(model_path)!r}: {first[:300]}", hint) from None
        self.providers: list[str] = list(self.session.get_providers())
        self.output_names = [o.name for o in self.session.get_outputs()]
        first = self.providers[0] if self.providers else ""
        gpu = first in ("CUDAExecutionProvider", "TensorrtExecutionProvider")
        self.iobinding = gpu if iobinding is None else bool(iobinding)
        self._device = "cuda" if gpu else "cpu"
        # (input, elements): a run whose input is larger gives the CPU arena back what it took (``_shrink_above``)
        self.shrink_above = _shrink_above(bundle[0] if bundle else None) if first == "CPUExecutionProvider" else None
        self._shrink = None
        if self.shrink_above is not None:
            self._shrink = ort.RunOptions()
            self._shrink.add_run_config_entry("memory.enable_memory_arena_shrinkage", "cpu:0")

    def run(self, inputs: dict[str, np.ndarray], cancel: RunCancel | None = None) -> dict[str, np.ndarray]:
        """Run one batch. Inputs/outputs are numpy arrays keyed by IO name.

        ``cancel``: stops the run between two kernels when cancelled from another thread (``RunOptions.terminate``;
        runtime/run_cancel.py), raising ``RunCancelled``."""
        big = self._shrink is not None and np.size(inputs.get(self.shrink_above[0], ())) > self.shrink_above[1]
        opts = self._shrink if big else None
        if cancel is not None:
            opts = import_ort().RunOptions()  # one per run: a terminated RunOptions stops every run that uses it
            if big:
                opts.add_run_config_entry("memory.enable_memory_arena_shrinkage", "cpu:0")
            cancel.bind(functools.partial(setattr, opts, "terminate", True))
        try:
            if self.iobinding:
                io = self.session.io_binding()
                for name, value in inputs.items():
                    io.bind_cpu_input(name, np.ascontiguousarray(value))
                for name in self.output_names:
                    io.bind_output(name, self._device)
                self.session.run_with_iobinding(io, opts)
                return dict(zip(self.output_names, io.copy_outputs_to_cpu()))
            values = self.session.run(self.output_names, inputs, opts)
        except Exception:
            if cancel is not None and cancel.cancelled:
                raise RunCancelled("cancelled") from None
            raise
        return dict(zip(self.output_names, values))

    run.takes_cancel = True  # runtime/run_cancel.py: a lane's probe may be stopped for real requests
