"""One device check for a machine with an NVIDIA GPU (run through benchmarks/device_check.sh, < 8 minutes).

Checks, each recorded as {"status": "pass" | "fail" | "skip", ...figures} in one JSON:
  gpu_facts      detect_gpu() (cuda-python → NVML → nvidia-smi), NVML memory/clocks, torch's view of the GPU
  train_bf16     the training loop with bf16 autocast and activation checkpointing (dsedge.toolchain.train)
  train_fp16     the training loop with fp16 autocast + GradScaler (loss scales recorded)
  nccl_one_rank  a one-rank NCCL process group: all_reduce, barrier, one DDP step under bf16 autocast
  cuda_buffers   the TensorRT backend's CUDA path without TensorRT: per-shape device + pinned buffers (real cudart),
                 a host→device→host round trip on one stream, and CUDA-graph capture/replay of those copies
  ort_cuda       a bundle on ORT's CUDA EP (IOBinding, provider options) vs CPU
  verify         `dsedge verify --variant all` on the provider dsedge picks here (TensorRT when installed)
Without a GPU every GPU check is "skip" with the reason; the script still runs (so it can be tried anywhere).

Exit status (a CI job may read only this):
  0  no check failed, and some GPU check passed, or no GPU here (no `nvidia-smi` GPU) and no --require-gpu: the last
     line then says "[device_check] no GPU here: every GPU check skipped", which is not a pass of the device
  1  a check failed
  2  a usage error (argparse's: a mistyped flag, a missing value): nothing ran
  3  no GPU check passed (every one skipped) on a machine where `nvidia-smi` reports a GPU, or where it is installed
     but fails (a driver error), or with --require-gpu; one stderr line says why: "every GPU check skipped: <the
     first skip reason>"
The GPU checks are train_bf16, train_fp16, nccl_one_rank, cuda_buffers and ort_cuda; gpu_facts only detects the GPU
and verify runs on whatever provider is here (the CPU included), so neither counts as the GPU passing.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))


def check(name, results):
    def wrap(fn):
        t0 = time.perf_counter()
        try:
            out = fn() or {}
            out.setdefault("status", "pass")
        except SkipCheck as e:
            out = {"status": "skip", "reason": str(e)}
        except Exception as e:  # recorded, the next check still runs
            out = {"status": "fail", "error": f"{type(e).__name__}: {e}"[:800],
                   "traceback": traceback.format_exc()[-2000:]}
        out["seconds"] = round(time.perf_counter() - t0, 2)
        results[name] = out
        print(f"[device_check] {name}: {out['status']} ({out['seconds']} s)"
              + (f" - {out.get('reason') or out.get('error')}" if out["status"] != "pass" else ""), flush=True)
        return fn
    return wrap


class SkipCheck(Exception):
    pass


def need_cuda():
    import torch

    if not torch.cuda.is_available():
        raise SkipCheck(f"torch {torch.__version__} sees no CUDA GPU")
    return torch


GPU_CHECKS = ("train_bf16", "train_fp16", "nccl_one_rank", "cuda_buffers", "ort_cuda")


def nvidia_smi_sees_a_gpu() -> bool:
    """True when `nvidia-smi -L` lists a GPU, or when nvidia-smi is installed but fails or hangs (a GPU box whose
    driver is broken is not a machine without a GPU); False where there is no nvidia-smi."""

    if shutil.which("nvidia-smi") is None:
        return False
    try:
        r = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=15)
    except (OSError, subprocess.SubprocessError):
        return True
    return r.returncode != 0 or "GPU" in r.stdout


def verdict(checks: dict, gpu_here: bool, require_gpu: bool) -> tuple[int, str | None]:
    """The exit status for ``checks`` (name -> {"status", "reason"?, ...}) and the line that explains it (None when
    there is nothing to say): 1 if any check failed; 3 if no GPU check passed where a GPU is expected (``gpu_here``
    or ``require_gpu``); else 0, with a "no GPU here" line when every GPU check skipped."""
    if any(c["status"] == "fail" for c in checks.values()):
        return 1, None
    gpu = [checks[n] for n in GPU_CHECKS if n in checks]
    if any(c["status"] == "pass" for c in gpu):
        return 0, None
    reason = next((c.get("reason") for c in gpu if c.get("reason")), "no GPU check ran")
    if gpu_here or require_gpu:
        why = "nvidia-smi is here" if gpu_here else "--require-gpu"
        return 3, f"every GPU check skipped: {reason} ({why})"
    return 0, "no GPU here: every GPU check skipped"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="device_check.json")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--require-gpu", action="store_true",
                    help="exit 3 when no GPU check passed, even where nvidia-smi reports no GPU")
    args = ap.parse_args()
    results: dict = {}
    report = {"created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "host": platform.node(),
              "python": platform.python_version(), "machine": platform.machine(), "checks": results}
    work = Path(tempfile.mkdtemp(prefix="dsedge-device-check-"))

    @check("gpu_facts", results)
    def _():
        from dsedge.runtime.gpu_info import detect_gpu, from_nvml

        gpu, nvml = detect_gpu(), from_nvml()
        out = {"detect_gpu": gpu and {"name": gpu.name, "cc": gpu.compute_capability, "sm_count": gpu.sm_count,
                                      "memory_mb": gpu.memory_mb, "clocks_mhz": gpu.clocks_mhz},
               "nvml": nvml and {"name": nvml.name, "memory_mb": nvml.memory_mb, "clocks_mhz": nvml.clocks_mhz}}
        try:
            import torch

            out["torch"] = torch.__version__
            if torch.cuda.is_available():
                p = torch.cuda.get_device_properties(0)
                out["torch_gpu"] = {"name": p.name, "cc": f"{p.major}.{p.minor}", "sm_count": p.multi_processor_count,
                                    "memory_mb": p.total_memory >> 20}
                if gpu and gpu.sm_count and gpu.sm_count != p.multi_processor_count:
                    out["status"] = "fail"
                    out["error"] = "cuda-python and torch disagree on the SM count"
        except ImportError:
            out["torch"] = None
        if gpu is None:
            out["status"] = "skip"
            out["reason"] = "no NVIDIA GPU detected"
        return out

    def train_mode(mode: str, activation_checkpointing: bool):
        torch = need_cuda()
        from dsedge.toolchain.train import train
        from dsedge.toolchain.train.config import from_dict
        from dsedge.toolchain.train.metrics import read_metrics

        torch.cuda.reset_peak_memory_stats()
        out_dir = work / f"train-{mode}"
        cfg = {"out_dir": str(out_dir), "steps": args.steps, "device": "cuda",
               "model": {"factory": "train_models:make_tiny",
                         "kwargs": {"din": 256, "d": 512, "hidden": 2048, "classes": 10, "depth": 4}},
               "data": {"factory": "train_models:make_data", "kwargs": {"n": 4096, "din": 256, "classes": 10},
                        "batch_size": 256},
               "precision": {"mode": mode, **({"initial_scale": 2.0 ** 16, "growth_interval": 10} if mode == "fp16" else {})},
               "checkpoint": {"every": args.steps, "activation_checkpointing": activation_checkpointing},
               "health": {"progress": False}}
        train.run(from_dict(cfg))
        recs = read_metrics(out_dir / "metrics.jsonl")
        losses = [r["loss"] for r in recs]
        out = {"mode": mode, "activation_checkpointing": activation_checkpointing, "steps": len(recs),
               "loss_first": losses[0], "loss_last": losses[-1],
               "median_step_ms": statistics.median(r["step_time_ms"] for r in recs[5:]) if len(recs) > 5 else None,
               "peak_memory_bytes": torch.cuda.max_memory_allocated(),
               "loss_scales": sorted({r["loss_scale"] for r in recs if "loss_scale" in r}),
               "skipped_steps": sum(1 for r in recs if r.get("skipped"))}
        if not (losses[-1] == losses[-1]) or losses[-1] >= losses[0]:
            out["status"] = "fail"
            out["error"] = "loss did not go down (or is NaN)"
        return out

    check("train_bf16", results)(lambda: train_mode("bf16", True))
    check("train_fp16", results)(lambda: train_mode("fp16", False))

    @check("nccl_one_rank", results)
    def _():
        torch = need_cuda()
        import socket

        import torch.distributed as dist

        if not dist.is_nccl_available():
            raise SkipCheck("this torch build has no NCCL")
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        s.close()
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
        try:
            x = torch.arange(4, device="cuda", dtype=torch.float32)
            dist.all_reduce(x)
            dist.barrier()
            model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(64, 8).cuda())
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(torch.randn(32, 64, device="cuda")).float().pow(2).mean()
            loss.backward()
            opt.step()
            torch.cuda.synchronize()
            return {"backend": dist.get_backend(), "all_reduce": x.tolist(), "ddp_loss": float(loss),
                    "nccl_version": ".".join(map(str, torch.cuda.nccl.version()))}
        finally:
            dist.destroy_process_group()

    @check("cuda_buffers", results)
    def _():
        import numpy as np

        from dsedge.runtime.backends import tensorrt as trt_backend
        from dsedge.runtime.errors import BackendUnavailable

        try:
            rt = trt_backend._cudart()
        except BackendUnavailable as e:
            raise SkipCheck(str(e)) from None
        err, count = rt.cudaGetDeviceCount()
        if int(err) != 0 or count == 0:
            raise SkipCheck(f"cudaGetDeviceCount: {err}, {count}")
        check_ = trt_backend._check
        shapes = {"x": (8, 1024), "y": (8, 1024)}
        slot = trt_backend._Slot(rt, shapes, {"x": np.dtype("float32"), "y": np.dtype("float32")})
        stream = check_(rt.cudaStreamCreate())
        h2d, d2h = rt.cudaMemcpyKind.cudaMemcpyHostToDevice, rt.cudaMemcpyKind.cudaMemcpyDeviceToHost
        dtod = rt.cudaMemcpyKind.cudaMemcpyDeviceToDevice
        nbytes = slot.host["x"].nbytes

        def enqueue():
            check_(rt.cudaMemcpyAsync(slot.device["x"], slot.pinned["x"], nbytes, h2d, stream))
            check_(rt.cudaMemcpyAsync(slot.device["y"], slot.device["x"], nbytes, dtod, stream))  # "the engine"
            check_(rt.cudaMemcpyAsync(slot.pinned["y"], slot.device["y"], nbytes, d2h, stream))

        a = np.random.default_rng(0).standard_normal(shapes["x"]).astype(np.float32)
        slot.host["x"][...] = a
        enqueue()
        check_(rt.cudaStreamSynchronize(stream))
        stream_ok = bool(np.array_equal(slot.host["y"], a))
        check_(rt.cudaStreamBeginCapture(stream, rt.cudaStreamCaptureMode.cudaStreamCaptureModeGlobal))
        enqueue()
        graph = check_(rt.cudaStreamEndCapture(stream))
        exec_ = check_(rt.cudaGraphInstantiate(graph, 0))
        b = a * 2 + 1
        slot.host["x"][...] = b  # the graph replays copies from the same pinned address: new data goes through
        t0 = time.perf_counter()
        for _ in range(100):
            check_(rt.cudaGraphLaunch(exec_, stream))
        check_(rt.cudaStreamSynchronize(stream))
        graph_us = (time.perf_counter() - t0) / 100 * 1e6
        graph_ok = bool(np.array_equal(slot.host["y"], b))
        rt.cudaGraphExecDestroy(exec_)
        rt.cudaGraphDestroy(graph)
        slot.free()
        rt.cudaStreamDestroy(stream)
        out = {"stream_round_trip": stream_ok, "graph_replay": graph_ok, "graph_launch_us": round(graph_us, 2)}
        if not (stream_ok and graph_ok):
            out["status"] = "fail"
        return out

    bundle_box: dict = {}

    def small_bundle() -> Path:
        if "b" not in bundle_box:
            import numpy as np

            from dsedge.toolchain.pipeline import BuildOptions, build
            from tiny_models import mlp_onnx

            calib, held = work / "calib", work / "held"
            rng = np.random.default_rng(0)
            for d in (calib, held):
                d.mkdir(exist_ok=True)
                np.savez(d / "a.npz", x=rng.standard_normal((32, 64)).astype(np.float32))
            target = os.environ.get("DSEDGE_CHECK_TARGET", "a100")
            r = build(BuildOptions(model=str(mlp_onnx(work / "clf.onnx")), target=target, out_dir=str(work / "out"),
                                   precision="int8", calib=str(calib), heldout=str(held), latency_iterations=3))
            bundle_box["b"] = r.bundle
        return bundle_box["b"]

    @check("ort_cuda", results)
    def _():
        import numpy as np

        import dsedge
        from dsedge.runtime.backends.ort import available_providers

        if "CUDAExecutionProvider" not in available_providers():
            raise SkipCheck(f"ONNX Runtime here has no CUDA EP ({', '.join(available_providers())}); install "
                            "dsedge[gpu] (onnxruntime-gpu)")
        b = small_bundle()
        gpu = dsedge.load(b, providers=["CUDAExecutionProvider", "CPUExecutionProvider"], check_outputs=True)
        cpu = dsedge.load(b, providers=["CPUExecutionProvider"])
        x = np.random.default_rng(1).standard_normal((8, 64)).astype(np.float32)
        yg, yc = gpu.run({"x": x})["logits"], cpu.run({"x": x})["logits"]
        t0 = time.perf_counter()
        for _ in range(200):
            gpu.run({"x": x})
        ms = (time.perf_counter() - t0) / 200 * 1e3
        return {"providers": gpu.providers, "iobinding": getattr(gpu._backend, "iobinding", None),
                "max_abs_diff_vs_cpu": float(np.abs(yg - yc).max()), "ms_per_run_b8": round(ms, 4)}

    @check("verify", results)
    def _():
        b = small_bundle()
        r = subprocess.run([sys.executable, "-m", "dsedge", "verify", str(b), "--variant", "all", "--json"],
                           capture_output=True, text=True, timeout=300)
        try:
            rep = json.loads(r.stdout)
        except json.JSONDecodeError:
            return {"status": "fail", "exit": r.returncode, "stderr": r.stderr[-1500:]}
        return {"status": "pass" if r.returncode == 0 else "fail", "exit": r.returncode,
                "variants": [{k: v.get(k) for k in ("variant", "backend", "providers", "passed", "failures")}
                             for v in rep["variants"]]}

    shutil.rmtree(work, ignore_errors=True)  # the bundles and models the checks wrote
    statuses = [c["status"] for c in results.values()]
    report["summary"] = {s: statuses.count(s) for s in ("pass", "fail", "skip")}
    code, why = verdict(results, nvidia_smi_sees_a_gpu(), args.require_gpu)
    report["exit"] = {"code": code, "why": why}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2, default=str) + "\n")
    print(f"[device_check] wrote {args.out}: {report['summary']}", flush=True)
    if code == 3:
        print(f"[device_check] {why}", file=sys.stderr)
    elif why:
        print(f"[device_check] {why}")
    return code


if __name__ == "__main__":
    sys.exit(main())
