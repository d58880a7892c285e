"""A real ``dsedge serve`` subprocess on loopback ports for the serve tests, and the small bundles they serve."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

READY = re.compile(r"dsedge serve ready (?P<rest>.*)")


class ServeProcess:
    """``python -m dsedge serve BUNDLE... --http-port 0 --grpc-port 0 --metrics-port 0 EXTRA...``.

    Waits for the ready line and parses the ports it prints (``.http``, ``.grpc``, ``.metrics``: "host:port");
    stderr (the log) goes to ``log_path``.
    """

    def __init__(self, bundles: list[str], extra: list[str], log_path: Path, timeout_s: float = 240.0) -> None:
        self.log_path = Path(log_path)
        cmd = [sys.executable, "-m", "dsedge", "serve", *map(str, bundles), "--http-port", "0", "--grpc-port", "0",
               "--metrics-port", "0", *extra]
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self._log, env=env)
        self.lines: list[str] = []
        got = threading.Event()
        self.addrs: dict[str, str] = {}

        def read() -> None:
            for raw in self.proc.stdout:  # type: ignore[union-attr]
                line = raw.decode(errors="replace").rstrip()
                self.lines.append(line)
                m = READY.search(line)
                if m:
                    self.addrs = dict(kv.split("=", 1) for kv in m.group("rest").split())
                    got.set()
            got.set()

        threading.Thread(target=read, daemon=True).start()
        if not got.wait(timeout_s) or not self.addrs:
            self.kill()
            raise RuntimeError(f"dsedge serve did not become ready: {self.log()[-2000:]}")
        self.http, self.grpc, self.metrics = self.addrs["http"], self.addrs["grpc"], self.addrs["metrics"]

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log(self) -> str:
        if not self._log.closed:  # kill() closes it: a start that failed reports the log after that
            self._log.flush()
        return self.log_path.read_text(errors="replace")

    def rss_mb(self) -> float:
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        return float("nan")

    def terminate(self, timeout_s: float = 30.0) -> tuple[int, float]:
        """SIGTERM; returns (exit code, seconds to exit)."""
        t0 = time.perf_counter()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            raise
        self._log.close()
        return code, time.perf_counter() - t0

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self._log.close()


def mlp_bundle(dest: Path, tmp: Path, target: str = "cpu", budget_ms: float = 250.0) -> Path:
    """The tiny MLP (x[batch, 64] FP32 → logits[batch, 4]) as a bundle for ``target``."""
    from dsedge.runtime.bundle import IOSpec, Variant
    from dsedge.toolchain.bundle_writer import write_bundle
    from tiny_models import mlp_onnx

    model = mlp_onnx(tmp / f"mlp-{target}.onnx")
    return write_bundle(
        dest, name="mlp", target={"name": target},
        inputs=[IOSpec("x", "float32", ("batch", 64))], outputs=[IOSpec("logits", "float32", ("batch", 4))],
        models={"models/fp32.onnx": model}, variants=[Variant("fp32", "fp32", "models/fp32.onnx")],
        default_variant="fp32", shape_ranges={"batch": {"min": 1, "opt": 8, "max": 32}}, latency_budget_ms=budget_ms)


def slow_onnx(path: Path, dim: int = 192, rounds: int = 6) -> Path:
    """x[batch, dim] → outer product x xᵀ [batch, dim, dim] → ``rounds`` × (tanh(y @ y / dim)) → mean over the last
    axis → y[batch, dim]. No weights, input-dependent: ~``rounds`` · 2 · dim³ FLOPs per row (a few ms on a CPU)."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    nodes = [helper.make_node("Unsqueeze", ["x", "ax2"], ["col"]), helper.make_node("Unsqueeze", ["x", "ax1"], ["row"]),
             helper.make_node("MatMul", ["col", "row"], ["y0"])]
    for i in range(rounds):
        nodes += [helper.make_node("MatMul", [f"y{i}", f"y{i}"], [f"m{i}"]),
                  helper.make_node("Mul", [f"m{i}", "scale"], [f"s{i}"]),
                  helper.make_node("Tanh", [f"s{i}"], [f"y{i + 1}"])]
    nodes.append(helper.make_node("ReduceMean", [f"y{rounds}", "ax_last"], ["y"], keepdims=0))
    inits = [numpy_helper.from_array(np.array([2], np.int64), "ax2"),
             numpy_helper.from_array(np.array([1], np.int64), "ax1"),
             numpy_helper.from_array(np.array([-1], np.int64), "ax_last"),
             numpy_helper.from_array(np.array(1.0 / dim, np.float32), "scale")]
    graph = helper.make_graph(nodes, "slow", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", dim])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", dim])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    model.ir_version = 10
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return path


def slow_bundle(dest: Path, tmp: Path, dim: int = 192, rounds: int = 6) -> Path:
    from dsedge.runtime.bundle import IOSpec, Variant
    from dsedge.toolchain.bundle_writer import write_bundle

    model = slow_onnx(tmp / "slow.onnx", dim, rounds)
    return write_bundle(
        dest, name="slow", target={"name": "cpu"},
        inputs=[IOSpec("x", "float32", ("batch", dim))], outputs=[IOSpec("y", "float32", ("batch", dim))],
        models={"models/fp32.onnx": model}, variants=[Variant("fp32", "fp32", "models/fp32.onnx")],
        default_variant="fp32", shape_ranges={"batch": {"min": 1, "opt": 1, "max": 16}}, latency_budget_ms=5000.0)
