"""benchmarks/*.py as a user first runs them: a missing prerequisite or a wrong option ends in one clear line
(no traceback), before anything slow starts."""
from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def bench(*args: str, timeout: float = 60, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env=None if env is None else {**os.environ, **env})


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
    (["benchmarks/busy_caller.py", "--bundle", "/no/such/bundle.dse"], "does not exist"),
    (["benchmarks/serving_tax.py", "--bundle", "/no/such/bundle.dse"], "does not exist"),
    (["benchmarks/serving_tax.py", "--bundle", "x", "--loads", "half"], "comma-separated numbers"),
    (["benchmarks/busy_caller.py", "--bundle", "x", "--loads", "half"], "comma-separated numbers"),
    (["benchmarks/reference_latency.py", "--bundle", "/no/such/bundle.dse"], "does not exist"),
    (["benchmarks/ct_int8_latency.py", "--bundles", "/no/such/dir"], "python -m samples.ct build"),
    (["benchmarks/ct_sliding_window.py", "--bundle", "/no/such/dir"], "python -m samples.ct build"),
    (["benchmarks/datacheck_throughput.py", "--mib", "1", "--dir", "/no/such/dir"], "no such directory"),
    (["benchmarks/datacheck_throughput.py", "--corpus", "/no/such/corpus.jsonl"], "no such file"),
    (["benchmarks/decode_window.py", "--rounds", "0"], "--rounds must be at least 1"),
    (["benchmarks/qat_prune.py", "--qat-steps", "two hundred"], "expected comma-separated step counts"),
    (["benchmarks/qat_prune.py", "--prune", "30"], "between 0 and 1"),
    (["benchmarks/int8_batch_invariance.py", "--rounds", "0"], "must be at least 1"),
    (["benchmarks/schedule_bound.py"], "run python benchmarks/streaming.py"),  # a module: it printed nothing, exit 0
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
    out, tmp = tmp_path / "dc.json", tmp_path / "tmp"
    tmp.mkdir()
    r = bench("benchmarks/device_check.py", "--out", str(out), timeout=120, env={"TMPDIR": str(tmp)})
    assert "Traceback" not in r.stdout + r.stderr
    assert "train_bf16: skip" in r.stdout and out.is_file()
    assert "verify: pass" in r.stdout, r.stdout + r.stderr  # it built a bundle in its work directory ...
    assert [p.name for p in tmp.iterdir() if p.name.startswith("dsedge")] == []  # ... and removed it (each run
    # left one behind in /tmp; onnxruntime's own `.ses` file there is not ours)
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


def test_compression_only_matching_no_variant_is_one_clear_line():
    """`--only int3` matched nothing and ran fp32 alone, printing a table as if asked for; now it names the value
    and the valid choices, before anything slow starts."""
    r = bench("benchmarks/compression.py", "--only", "rtn,int3")
    assert r.returncode == 2, r.stdout + r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert "int3" in last and "int4 gptq" in last and "fp16 + fp32 islands" in last, r.stderr
    assert "rtn" not in last.split("choose from")[0], r.stderr  # only the value that matched nothing is named
    assert not r.stdout


def test_compression_times_eager_side_by_side(tmp_path):
    """PyTorch eager was timed in a block of its own, so its ×eager ratio moved with the host between blocks; now
    every path is called once per round (rotating the order) and the output says so."""
    r = bench("benchmarks/compression.py", "--only", "fp32", "--runs", "3", "--out", str(tmp_path), timeout=240)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    hdr = next(i for i, ln in enumerate(lines) if ln.startswith("variant") and "×eager" in ln)
    table = [ln for ln in lines[hdr + 2:] if "|" in ln]
    assert table and table[0].startswith("fp32 ")
    for ln in table:
        ratios = [float(x) for x in re.findall(r"([0-9.]+)×", ln)]
        assert len(ratios) == 2 and all(math.isfinite(x) and x > 0 for x in ratios), ln
    assert "interleaved" in r.stdout
    rows = json.loads((tmp_path / "compression.json").read_text())
    assert {row["latency_timing"] for row in rows} == {"interleaved"}
    assert all(row["b1_speedup_vs_eager"] > 0 and row["b32_speedup_vs_eager"] > 0 for row in rows)
    # --extra NAME=PATH is measured at PATH even with --reuse: a file of that name left in --out by an earlier run
    # (here a stale one that is no model at all) was measured instead, as the figures of a rebuilt bundle
    (tmp_path / "again.onnx").write_bytes(b"stale")
    r = bench("benchmarks/compression.py", "--only", "fp32", "--runs", "1", "--out", str(tmp_path), "--reuse",
              "--extra", f"again={tmp_path / 'fp32.onnx'}", timeout=240)
    assert r.returncode == 0, r.stdout + r.stderr
    again = next(row for row in json.loads((tmp_path / "compression.json").read_text()) if row["variant"] == "again")
    assert again["file"] == str(tmp_path / "fp32.onnx") and again["size_ratio"] == 1.0
    assert f"from {tmp_path / 'fp32.onnx'}" in r.stdout


def test_datacheck_corpus_is_the_size_asked_for(tmp_path):
    """The corpus was written in blocks of 2,000 documents (about 4 MiB each), so `--mib 1` built 4 MiB."""
    r = bench("benchmarks/datacheck_throughput.py", "--mib", "1", "--dir", str(tmp_path), timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    m = re.search(r"generated (\d+) docs, ([0-9.]+) MiB", r.stdout)
    assert m, r.stdout
    assert abs(float(m[2]) - 1) <= 0.05, r.stdout
    assert not list(tmp_path.iterdir())  # deleted afterwards (no --keep)


def test_time_interleaved_rotates_the_order_each_round_after_the_warmup():
    from dsedge.runtime.latency import time_interleaved

    calls = []
    samples = time_interleaved({k: (lambda k=k: calls.append(k)) for k in "abc"}, rounds=3, warmup=2)
    assert calls[:6] == list("aabbcc")  # warm-up: each path's own untimed calls
    assert calls[6:] == list("abc") + list("bca") + list("cab")  # one call per path per round, rotated
    assert {k: len(v) for k, v in samples.items()} == {"a": 3, "b": 3, "c": 3}
    assert all(ms >= 0.0 for v in samples.values() for ms in v)
