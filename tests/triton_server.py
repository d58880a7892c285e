"""A real ``tritonserver`` (from the ``nvidia-pytriton`` wheel) on loopback ports, for tests and benchmarks.

The wheel ships the server binary (Triton 2.51) and the Python backend; it is used as plain Triton, not through
PyTriton's API. What it needs here:
  * a backend directory of our own: ``python/`` with the wheel's ``libtriton_python.so``,
    ``triton_python_backend_utils.py`` and the stub built for the running Python;
  * ``LD_LIBRARY_PATH`` with the wheel's ``nvidia_pytriton.libs`` (else the stub cannot load libcudart and the
    server hangs in "loading");
  * the stub's environment (numpy < 2: with numpy 2 the outputs come back empty) first on ``PATH``;
  * a shared-memory prefix of its own (``shm-region-prefix-name``), so clean-up removes only this server's
    ``/dev/shm`` regions, even after a failed start.
The CUDA/NVML/DCGM warnings it logs without a GPU are harmless.
"""
from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
import venv
from pathlib import Path
from typing import Iterator

REPO = Path(__file__).resolve().parents[1]
STUB_ENV_PACKAGES = ("numpy<2",)  # with dsedge[cpu]: its core dependencies and the CPU onnxruntime


class TritonUnavailable(RuntimeError):
    """The wheel or the stub for this Python is missing."""


def wheel_dir() -> Path:
    """The installed ``pytriton`` package folder (found without importing it: its __init__ needs pyzmq)."""
    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        raise TritonUnavailable("nvidia-pytriton is not installed: pip install nvidia-pytriton==0.7.0 --no-deps")
    return Path(list(spec.submodule_search_locations)[0])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build_stub_env(dest: Path, timeout_s: float = 300) -> Path:
    """A virtualenv for the Python-backend stub: dsedge[cpu] (editable: its core dependencies and onnxruntime) under
    numpy < 2.

    The env gets no pip of its own (ensurepip alone takes ~15 s): this interpreter's pip installs into it
    (``pip --python``, pip ≥ 22.3). Returns the env's ``bin`` folder. Raises ``subprocess.CalledProcessError`` or
    ``subprocess.TimeoutExpired`` when pip fails (e.g. no index reachable).
    """
    import pip

    own_pip = tuple(int(x) for x in pip.__version__.split(".")[:2]) >= (22, 3)
    venv.EnvBuilder(with_pip=not own_pip, clear=True).create(dest)
    py = dest / "bin" / "python"
    pip_cmd = [sys.executable, "-m", "pip", "--python", str(py)] if own_pip else [str(py), "-m", "pip"]
    pip_cmd += ["install", "-q", "--disable-pip-version-check", "--no-compile"]
    subprocess.run([*pip_cmd, *STUB_ENV_PACKAGES, "-e", f"{REPO}[cpu]"], check=True, timeout=timeout_s,
                   capture_output=True)
    return dest / "bin"


class TritonServer:
    """``tritonserver`` serving ``repository`` on free 127.0.0.1 ports; a context manager that always stops it.

    Attributes:
        http_url: ``"127.0.0.1:PORT"`` for ``tritonclient.http``; grpc_url likewise for ``tritonclient.grpc``.
        log: the server's combined stdout/stderr file.
    """

    def __init__(self, repository: str | os.PathLike, stub_bin: str | os.PathLike, workdir: str | os.PathLike,
                 extra_args: tuple[str, ...] = ()) -> None:
        self.repository = Path(repository)
        self.stub_bin = Path(stub_bin)
        self.workdir = Path(workdir)
        self.extra_args = tuple(extra_args)
        self.proc: subprocess.Popen | None = None
        self.removed_shm: list[str] = []  # regions stop() had to remove (a crashed stub leaves them behind)
        self.http_port, self.grpc_port, self.metrics_port = free_port(), free_port(), free_port()
        self.http_url = f"127.0.0.1:{self.http_port}"
        self.grpc_url = f"127.0.0.1:{self.grpc_port}"
        self.shm_prefix = f"dsedge_test_{os.getpid()}_{self.http_port}_"
        self.log = self.workdir / f"tritonserver-{self.http_port}.log"

    def _backend_dir(self) -> Path:
        wheel = wheel_dir() / "tritonserver"
        stub = wheel / "python_backend_stubs" / f"{sys.version_info.major}.{sys.version_info.minor}" \
            / "triton_python_backend_stub"
        if not stub.is_file():
            raise TritonUnavailable(f"the wheel has no Python-backend stub for Python {sys.version_info[:2]}")
        dest = self.workdir / "backends" / "python"
        dest.mkdir(parents=True, exist_ok=True)
        for src in (wheel / "backends" / "python" / "libtriton_python.so",
                    wheel / "backends" / "python" / "triton_python_backend_utils.py", stub):
            if not (dest / src.name).exists():
                shutil.copy2(src, dest / src.name)
        return dest.parent

    def start(self, timeout_s: float = 60.0) -> "TritonServer":
        """Start the server and wait until ``/v2/health/ready`` is 200. Raises RuntimeError (with the log tail)."""
        wheel = wheel_dir()
        binary = wheel / "tritonserver" / "bin" / "tritonserver"
        env = dict(os.environ)
        libs = str(wheel.parent / "nvidia_pytriton.libs")
        env["LD_LIBRARY_PATH"] = libs + (":" + env["LD_LIBRARY_PATH"] if env.get("LD_LIBRARY_PATH") else "")
        env["PATH"] = f"{self.stub_bin}:{env.get('PATH', '')}"
        env.pop("PYTHONPATH", None)
        args = [str(binary), f"--model-repository={self.repository}", f"--backend-directory={self._backend_dir()}",
                "--http-address=127.0.0.1", f"--http-port={self.http_port}",
                "--grpc-address=127.0.0.1", f"--grpc-port={self.grpc_port}",
                "--metrics-address=127.0.0.1", f"--metrics-port={self.metrics_port}",
                "--allow-sagemaker=false", "--allow-vertex-ai=false", "--exit-timeout-secs=3",
                f"--backend-config=python,shm-region-prefix-name={self.shm_prefix}",
                "--log-verbose=0", *self.extra_args]
        self.workdir.mkdir(parents=True, exist_ok=True)
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env,
                                         start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            code = self.proc.poll()
            if code is not None:
                self.stop()
                raise RuntimeError(f"tritonserver exited with {code}:\n{self.log_tail()}")
            if self.ready():
                return self
            time.sleep(0.25)
        self.stop()
        raise RuntimeError(f"tritonserver not ready after {timeout_s:.0f} s:\n{self.log_tail()}")

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://{self.http_url}/v2/health/ready", timeout=1) as r:
                return r.status == 200
        except OSError:
            return False

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"

    def shm_regions(self) -> list[Path]:
        return sorted(Path("/dev/shm").glob(self.shm_prefix + "*"))

    def stop(self, timeout_s: float = 20.0) -> None:
        """SIGTERM (Triton drains in ~4 s), SIGKILL to the process group after ``timeout_s``; then remove this
        server's shared-memory regions."""
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(5)
        if proc is not None:  # stubs are in the server's process group; a killed server may leave them behind
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
        for p in self.shm_regions():
            with contextlib.suppress(OSError):
                p.unlink()
                self.removed_shm.append(p.name)

    def __enter__(self) -> "TritonServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@contextlib.contextmanager
def serving(repository: str | os.PathLike, stub_bin: str | os.PathLike,
            workdir: str | os.PathLike | None = None, timeout_s: float = 60.0) -> Iterator[TritonServer]:
    """``with serving(repo, stub_bin) as server:`` — started, ready, and always stopped and cleaned."""
    tmp = None
    if workdir is None:
        tmp = tempfile.mkdtemp(prefix="dsedge-triton-")
        workdir = tmp
    server = TritonServer(repository, stub_bin, workdir)
    try:
        server.start(timeout_s)
        yield server
    finally:
        server.stop()
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)


def retarget_bundle(bundle: str | os.PathLike, dest: str | os.PathLike, target: str) -> Path:
    """A copy of ``bundle`` (model files hard-linked) whose manifest names another target profile, re-hashed.

    The models and their build-time latency (ORT CPU on the build machine) stay as built; budget and shape ranges
    become the profile's: for the reference model this is what ``dsedge build --target T --precision P`` writes
    (the build measures ORT CPU latency on the build host for every target), without re-running export and
    quantization.
    """
    from dataclasses import asdict

    from dsedge.runtime.bundle import read_manifest, write_manifest
    from dsedge.targets import get_target

    manifest = read_manifest(bundle)  # write_manifest re-hashes every file of the copy
    dest = Path(dest)
    shutil.copytree(bundle, dest, copy_function=lambda s, d: os.link(s, d))
    (dest / "manifest.json").unlink()  # a fresh file, not a link into the original bundle
    profile = get_target(target)
    manifest.target = asdict(profile)
    manifest.latency_budget_ms = float(profile.default_budget_ms)
    manifest.shape_ranges = {k: dict(v) for k, v in (profile.shapes or manifest.shape_ranges).items()}
    write_manifest(dest, manifest)
    return dest
