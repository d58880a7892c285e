"""benchmarks/*.py as a user first runs them: a missing prerequisite or a wrong option ends in one clear line
(no traceback), before anything slow starts."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def bench(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def _torch_has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


@pytest.mark.parametrize("argv, says", [
    (["benchmarks/train_step.py", "--steps", "3"], "--steps must be more than 5"),
    (["benchmarks/train_step.py", "--skip-dist", "--only-dist"], "not allowed with"),
    (["benchmarks/compression.py", "--extra", "no-equals-sign"], "expected NAME=PATH"),
    (["benchmarks/compression.py", "--extra", "x=/no/such/model.onnx"], "no such file"),
    (["benchmarks/cpu_ceiling.py", "--bundle", "/no/such/bundle.dse"], "does not exist"),
    (["benchmarks/sdk_overhead.py", "--bundle", "/no/such/bundle.dse"], "does not exist"),
    (["benchmarks/reference_latency.py", "--bundle", "/no/such/bundle.dse"], "does not exist"),
    (["benchmarks/ct_int8_latency.py", "--bundles", "/no/such/dir"], "python -m samples.ct build"),
    (["benchmarks/ct_sliding_window.py", "--bundle", "/no/such/dir"], "python -m samples.ct build"),
    (["benchmarks/datacheck_throughput.py", "--mib", "1", "--dir", "/no/such/dir"], "no such directory"),
    (["benchmarks/datacheck_throughput.py", "--corpus", "/no/such/corpus.jsonl"], "no such file"),
    (["benchmarks/decode_window.py", "--rounds", "0"], "--rounds must be at least 1"),
    (["benchmarks/qat_prune.py", "--qat-steps", "two hundred"], "expected comma-separated step counts"),
    (["benchmarks/qat_prune.py", "--prune", "30"], "between 0 and 1"),
    (["benchmarks/int8_batch_invariance.py", "--rounds", "0"], "must be at least 1"),
])
def test_user_mistake_is_one_clear_line(argv, says):
    r = bench(*argv)
    assert r.returncode != 0
    assert "Traceback" not in r.stderr, r.stderr
    assert says in r.stderr.strip().splitlines()[-1], r.stderr


@pytest.mark.skipif(_torch_has_cuda(), reason="this machine has a CUDA GPU")
def test_train_cuda_without_a_gpu_says_so_in_one_line():
    r = bench("benchmarks/train_cuda.py", "--steps", "2")
    assert r.returncode == 1
    assert "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip().splitlines() == [r.stderr.strip()]
    assert "sees no CUDA GPU" in r.stderr


def test_device_check_runs_without_a_gpu(tmp_path):
    """device_check.py is meant to be tried anywhere: without a GPU the GPU checks are skipped, with reasons."""
    if _torch_has_cuda():
        pytest.skip("this machine has a CUDA GPU")
    out = tmp_path / "dc.json"
    r = bench("benchmarks/device_check.py", "--out", str(out), timeout=120)
    assert "Traceback" not in r.stdout + r.stderr
    assert "train_bf16: skip" in r.stdout and out.is_file()
    if not shutil.which("nvidia-smi"):  # no GPU here: exit 0, but the last line says it is no pass
        assert r.returncode == 0, r.stdout + r.stderr
        assert r.stdout.strip().splitlines()[-1] == "[device_check] no GPU here: every GPU check skipped"


def test_device_check_exits_3_when_every_gpu_check_skipped_where_a_gpu_is_required(tmp_path):
    """A CPU-only torch on a GPU box skipped every GPU check and exited 0: a CI job reading the exit status took the
    device as passed. With --require-gpu (or where nvidia-smi is installed) that is exit 3, with one line why;
    exit 2 stays argparse's usage error (a mistyped flag ran nothing)."""
    if _torch_has_cuda():
        pytest.skip("this machine has a CUDA GPU")
    out = tmp_path / "x.json"
    r = bench("benchmarks/device_check.py", "--out", str(out), "--require-gpu", timeout=120)
    assert r.returncode == 3, r.stdout + r.stderr
    assert "Traceback" not in r.stdout + r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("[device_check] every GPU check skipped: torch "), r.stderr
    assert "sees no CUDA GPU" in r.stderr and json.loads(out.read_text())["exit"]["code"] == 3
    # the same checks where nvidia-smi reports a GPU (a CPU-only torch / onnxruntime on a GPU box): exit 3 too,
    # though `verify` passed on the CPU; a failed check stays exit 1
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from device_check import verdict
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    checks = json.loads(out.read_text())["checks"]
    assert checks["verify"]["status"] == "pass"
    assert verdict(checks, gpu_here=True, require_gpu=False)[0] == 3
    assert verdict(checks, gpu_here=False, require_gpu=False) == (0, "no GPU here: every GPU check skipped")
    assert verdict({**checks, "verify": {"status": "fail"}}, gpu_here=True, require_gpu=True) == (1, None)
    assert verdict({**checks, "cuda_buffers": {"status": "pass"}}, gpu_here=True, require_gpu=True) == (0, None)
    typo = bench("benchmarks/device_check.py", "--out", str(tmp_path / "y.json"), "--requre-gpu", timeout=60)
    assert typo.returncode == 2 and not (tmp_path / "y.json").exists()  # argparse's code: not "no GPU check passed"


def test_eager_comparison_says_slower_when_slower():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from int8_batch_invariance import _faster
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    assert _faster(10.0, 5.0) == "2.0x faster"
    assert _faster(10.0, 12.5) == "1.2x slower"
