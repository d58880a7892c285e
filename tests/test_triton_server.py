"""A real tritonserver (nvidia-pytriton's binary, Python backend) serves the `python`-platform export of the reference
cpu bundle on loopback ports; tritonclient's answers are compared with Session.run; queue timeouts come back as 503.
The server is always stopped and its shared memory removed, even after a failed start."""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import dsedge
from triton_server import TritonServer, build_stub_env, retarget_bundle, serving, wheel_dir

pytestmark = pytest.mark.slow
SENTENCES = ["The train was late again.", "Our flight was delayed by the storm.", "She baked bread."]
STUB_ENV_BUDGET_S = 90


@pytest.fixture(scope="session")
def stub_bin(tmp_path_factory) -> Path:
    """The Python-backend stub's virtualenv (numpy<2, dsedge[cpu]), built once; fails, never skips."""
    wheel_dir()  # nvidia-pytriton==0.7.0 --no-deps is part of the test install: its absence is a failure
    t0 = time.monotonic()
    try:
        path = build_stub_env(tmp_path_factory.mktemp("stub-env") / "env")
    except Exception as e:  # pip's own errors (no network, no wheel for this Python) end the run here
        detail = getattr(e, "stderr", b"") or b""
        pytest.fail(f"cannot build the Triton stub environment: {e}\n{detail.decode(errors='replace')[-2000:]}",
                    pytrace=False)
    took = time.monotonic() - t0
    print(f"stub env built in {took:.1f} s (budget {STUB_ENV_BUDGET_S} s)")
    return path


@pytest.fixture(scope="module")
def cpu_bundle(reference_build, tmp_path_factory) -> Path:
    return retarget_bundle(reference_build.bundle, tmp_path_factory.mktemp("cpu") / "all-minilm-l6-v2-cpu.dse", "cpu")


@pytest.fixture(scope="module")
def server(cpu_bundle, stub_bin, tmp_path_factory):
    from dsedge.toolchain.triton import export_triton

    repo = tmp_path_factory.mktemp("repo") / "triton"
    t0 = time.monotonic()
    export_triton(cpu_bundle, repo, platform="python", threads=1)
    t1 = time.monotonic()
    with serving(repo, stub_bin, tmp_path_factory.mktemp("server")) as s:
        print(f"export {t1 - t0:.1f} s, tritonserver ready in {time.monotonic() - t1:.1f} s")
        yield s
    assert s.proc is None and not s.shm_regions()


@pytest.fixture(scope="module")
def feeds():
    from dsedge.toolchain import reference

    tok = reference.load_tokenizer(reference.verified_model_dir())
    return [reference.tokenize(tok, [s]) for s in SENTENCES], reference.tokenize(tok, SENTENCES)


def _infer_inputs(http, feed):
    out = []
    for name, arr in feed.items():
        i = http.InferInput(name, list(arr.shape), "INT64")
        i.set_data_from_numpy(np.ascontiguousarray(arr))
        out.append(i)
    return out


def test_outputs_equal_session_run(server, cpu_bundle, feeds):
    import tritonclient.http as http

    singles, batch = feeds
    client = http.InferenceServerClient(server.http_url)
    try:
        for variant in ("int4", "fp32"):
            session = dsedge.load(cpu_bundle, variant=variant)
            for feed in [*singles, batch]:
                r = client.infer(f"all-minilm-l6-v2_{variant}", _infer_inputs(http, feed))
                want = session.run(feed)
                for name in ("sentence_embedding", "last_hidden_state"):
                    got = r.as_numpy(name)
                    assert got.shape == want[name].shape and got.size > 0
                    np.testing.assert_allclose(got, want[name], rtol=1e-5, atol=1e-5)
    finally:
        client.close()


def test_one_microsecond_timeouts_come_back_as_503(server, feeds):
    import tritonclient.http as http
    from tritonclient.utils import InferenceServerException

    singles, _ = feeds
    client = http.InferenceServerClient(server.http_url, concurrency=16)
    try:
        pending = [client.async_infer("all-minilm-l6-v2_fp32", _infer_inputs(http, singles[i % 3]), timeout=1)
                   for i in range(16)]
        answered, rejected = 0, []
        for p in pending:
            try:
                r = p.get_result()
                assert r.as_numpy("sentence_embedding").shape == (1, 384)
                answered += 1
            except InferenceServerException as e:
                rejected.append((e.status(), e.message()))
        assert answered + len(rejected) == 16
        assert rejected and all(str(status) == "503" for status, _ in rejected), rejected
        # the server is still healthy afterwards
        ok = client.infer("all-minilm-l6-v2_fp32", _infer_inputs(http, singles[0]))
        assert ok.as_numpy("sentence_embedding").shape == (1, 384)
    finally:
        client.close()


def test_a_bad_request_gets_its_own_error(server, feeds):
    import tritonclient.http as http
    from tritonclient.utils import InferenceServerException

    singles, _ = feeds
    bad = {k: v.copy() for k, v in singles[0].items()}
    bad["input_ids"][0, 1] = 10 ** 6  # outside the vocabulary
    client = http.InferenceServerClient(server.http_url)
    try:
        with pytest.raises(InferenceServerException, match="outside the model's range") as e:
            client.infer("all-minilm-l6-v2_int4", _infer_inputs(http, bad))
        assert e.value.status() == "400"  # INVALID_ARG, as Triton's own backends answer a bad input (was 500)
    finally:
        client.close()


def _python_model(repo, name: str, model_py: str) -> None:
    """A Python-backend model ``x`` (FP32 [1]) -> ``y`` in ``repo/name`` whose model.py is ``model_py``."""
    model = repo / name
    (model / "1").mkdir(parents=True)
    (model / "config.pbtxt").write_text('backend: "python"\nmax_batch_size: 0\n'
                                        'input { name: "x" data_type: TYPE_FP32 dims: [ 1 ] }\n'
                                        'output { name: "y" data_type: TYPE_FP32 dims: [ 1 ] }\n')
    (model / "1" / "model.py").write_text(model_py)


def test_a_failed_start_is_stopped_and_its_shared_memory_removed(stub_bin, tmp_path):
    _python_model(tmp_path / "repo", "broken", "class TritonPythonModel:\n    def initialize(self, args):\n"
                  "        raise RuntimeError('broken on purpose')\n")
    server = TritonServer(tmp_path / "repo", stub_bin, tmp_path / "work")
    with pytest.raises(RuntimeError, match="tritonserver") as e:
        server.start(timeout_s=60)
    assert "broken on purpose" in str(e.value)
    assert server.proc is None and not server.shm_regions()
    assert not server.ready()
    with pytest.raises(OSError):
        os.kill(int(_pid_from_log(server.log)), 0)  # the server process is gone


def test_a_killed_server_leaves_no_shared_memory_behind(stub_bin, tmp_path):
    _python_model(
        tmp_path / "repo", "identity", "import triton_python_backend_utils as pb_utils\n\nclass TritonPythonModel:\n"
        "    def execute(self, requests):\n        return [pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("
        "'y', pb_utils.get_input_tensor_by_name(r, 'x').as_numpy())]) for r in requests]\n")
    server = TritonServer(tmp_path / "repo", stub_bin, tmp_path / "work")
    try:
        server.start(timeout_s=60)
        assert server.shm_regions()  # the Python backend's regions, under this server's own prefix
        os.kill(server.proc.pid, 9)  # no chance to clean up after itself
        server.proc.wait(10)
        assert server.shm_regions()
    finally:
        server.stop()
    assert server.removed_shm and not server.shm_regions()


def _pid_from_log(log: Path) -> int:
    # Triton's log lines read "E1201 08:24:37.840809 17141 file.cc:NN] ..." : the third field is the pid
    for line in log.read_text(errors="replace").splitlines():
        parts = line.split()
        if len(parts) > 3 and parts[0][:1] in "IWE" and parts[0][1:].isdigit() and parts[2].isdigit():
            return int(parts[2])
    raise AssertionError("no pid in the server log")


def _baseline_module():
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "triton_baseline.py"
    spec = importlib.util.spec_from_file_location("triton_baseline_under_test", path)
    bench = importlib.util.module_from_spec(spec)
    saved = list(sys.path)
    try:
        spec.loader.exec_module(bench)  # it puts benchmarks/ and tests/ first on sys.path: undone here
    finally:
        sys.path[:] = saved
    return bench


def test_the_baseline_counts_refusals_by_status_and_reason_not_by_words():
    """benchmarks/triton_baseline.py splits failed calls into refused at admission and admitted-then-missed. dsedge's
    overload refusal says "no batch meets its deadline": a refusal, not a timeout."""

    from tritonclient.utils import InferenceServerException

    from dsedge.serve.protocol import rejection

    bench = _baseline_module()

    def grpc_error(e):  # as tritonclient.grpc raises a server's status: details() as message, code as status
        return InferenceServerException(msg=e.message, status=f"StatusCode.{e.code}")

    overload = rejection("overload", "no batch meets its deadline and those queued before it")
    assert bench.outcome_of(grpc_error(overload)) == "rejected"
    budget = rejection("budget", "predicted 12 ms alone on int8 > budget 5 ms")
    assert bench.outcome_of(grpc_error(budget)) == "rejected"
    assert bench.outcome_of(grpc_error(rejection("deadline", "deadline in 3 ms < expected 12 ms"))) == "timeout"
    assert bench.outcome_of(InferenceServerException("Deadline Exceeded", "StatusCode.DEADLINE_EXCEEDED")) == "timeout"
    assert bench.outcome_of(InferenceServerException("Request timeout expired", "StatusCode.UNAVAILABLE")) == "timeout"
    assert bench.outcome_of(InferenceServerException("Exceeds maximum queue size", "StatusCode.UNAVAILABLE")) == \
        "rejected"


def test_the_baseline_sets_tritons_instance_layout_and_reruns_windows_lost_to_steal(cpu_bundle, tmp_path):
    """The baseline gives Triton dsedge serve's own layout too (two 1-thread instances on 2 cores): the rewritten
    config parses field by field, holds that instance count and the ``threads`` parameter the exported model.py
    reads, and drops it for ORT's default. A window counts as lost to steal above 5 % of its CPU."""
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2 as mc

    from dsedge.toolchain.triton import export_triton

    bench = _baseline_module()
    export = export_triton(cpu_bundle, tmp_path / "repo", platform="python", threads=2)
    path = tmp_path / "repo" / export.models[0].name / "config.pbtxt"

    bench.set_batching(path, 1000, [1, 2, 4, 8], 8, 64, 50_000, instances=2, threads=1)
    cfg = text_format.Parse(path.read_text(), mc.ModelConfig())  # raises on any unknown field
    assert [g.count for g in cfg.instance_group] == [2]
    assert cfg.parameters["threads"].string_value == "1"
    assert cfg.max_batch_size == 8 and list(cfg.dynamic_batching.preferred_batch_size) == [1, 2, 4, 8]
    assert cfg.dynamic_batching.default_queue_policy.default_timeout_microseconds == 50_000

    bench.set_batching(path, 1000, [1, 2, 4, 8], 8, 64, 50_000, instances=1, threads=None)
    cfg = text_format.Parse(path.read_text(), mc.ModelConfig())
    assert [g.count for g in cfg.instance_group] == [1] and "threads" not in cfg.parameters
    assert cfg.parameters["bundle"].string_value  # the model's other parameters stay

    assert bench._layout(2, 1) == "x2t1" and bench._layout(1, None) == "x1t*"
    # 2 cores x 8 s = 16 s of CPU: 5 % is 800 ms
    assert bench.steal_hit({"steal_ms": 801}, 8.0, cores=2) and not bench.steal_hit({"steal_ms": 800}, 8.0, cores=2)
    assert not bench.steal_hit({"steal_ms": None}, 8.0, cores=2)
