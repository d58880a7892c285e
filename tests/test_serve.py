"""`dsedge serve` over the wire with the real tritonclient (HTTP and gRPC): metadata, infer, binary tensors,
budget/timeout/priority parameters, rejections, malformed requests, auth, Prometheus metrics, JSON logs.

One real server for the module: two bundles of the same tiny model (targets cpu and t4, so served as ``mlp-cpu``
and ``mlp-t4``), a bearer token, ``--log-format json`` and a 64 KiB body cap.
"""
from __future__ import annotations

import http.client
import json
import re
import sys
import time

import grpc
import numpy as np
import pytest

import dsedge
from serve_process import ServeProcess, mlp_bundle

httpclient = pytest.importorskip("tritonclient.http")
grpcclient = pytest.importorskip("tritonclient.grpc")
from tritonclient.utils import InferenceServerException  # noqa: E402

TOKEN = "s3cret-token_for-tests"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
GRPC_AUTH = {"authorization": f"Bearer {TOKEN}"}
CAP = 64 * 1024


def auth() -> dict:
    return dict(AUTH)  # a fresh dict per call: tritonclient's infer() adds its own headers to the one it is given


def gauth() -> dict:
    return dict(GRPC_AUTH)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve")
    cpu = mlp_bundle(tmp / "mlp-cpu.dse", tmp, "cpu")
    t4 = mlp_bundle(tmp / "mlp-t4.dse", tmp, "t4")
    (tmp / "token").write_text(TOKEN + "\n")
    proc = ServeProcess([cpu, t4], ["--auth-token-file", str(tmp / "token"), "--log-format", "json",
                                    "--max-body-bytes", str(CAP), "--threads", "1", "--worker-nice", "5"],
                       tmp / "serve.log")
    proc.bundle = cpu
    yield proc
    code, _ = proc.terminate()
    assert code == 0


@pytest.fixture(scope="module")
def client(server):
    return httpclient.InferenceServerClient(server.http)


@pytest.fixture(scope="module")
def gclient(server):
    return grpcclient.InferenceServerClient(server.grpc)


@pytest.fixture(scope="module")
def reference(server):
    s = dsedge.load(server.bundle)
    yield s
    s.close()


def _x(rows: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((rows, 64)).astype(np.float32)


def _http_input(x: np.ndarray, binary: bool = True, datatype: str = "FP32") -> "httpclient.InferInput":
    i = httpclient.InferInput("x", list(x.shape), datatype)
    i.set_data_from_numpy(x, binary_data=binary)
    return i


def _grpc_input(x: np.ndarray) -> "grpcclient.InferInput":
    i = grpcclient.InferInput("x", list(x.shape), "FP32")
    i.set_data_from_numpy(x)
    return i


def _raw_post(server, path: str, body: bytes, headers: dict | None = None) -> tuple[int, dict]:
    host, port = server.http.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    conn.request("POST", path, body=body, headers={**AUTH, "Content-Type": "application/json", **(headers or {})})
    r = conn.getresponse()
    data = r.read()
    conn.close()
    return r.status, json.loads(data)


def _requests_total(server, **labels: str) -> float:
    """``dsedge_requests_total`` summed over the series whose labels include ``labels``."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"http://{server.metrics}/metrics", timeout=10).read().decode()
    return sum(s.value for f in text_string_to_metric_families(text) if f.name == "dsedge_requests"
               for s in f.samples if s.name == "dsedge_requests_total"
               and all(s.labels.get(k) == v for k, v in labels.items()))


def test_health_is_open_everything_else_needs_the_token(server, client, gclient):
    assert server.http.startswith("127.0.0.1:") and server.grpc.startswith("127.0.0.1:")  # loopback by default
    before = _requests_total(server)
    assert client.is_server_live() and client.is_server_ready()
    assert gclient.is_server_live() and gclient.is_server_ready()
    with pytest.raises(InferenceServerException) as e:
        client.get_server_metadata()
    assert e.value.status() == "401" and "bearer token" in e.value.message()
    with pytest.raises(InferenceServerException) as e:
        client.infer("mlp-cpu", [_http_input(_x(1))], headers={"Authorization": "Bearer wrong"})
    assert e.value.status() == "401"
    with pytest.raises(InferenceServerException) as e:
        gclient.get_model_metadata("mlp-cpu")
    assert e.value.status() == "StatusCode.UNAUTHENTICATED"
    with pytest.raises(InferenceServerException) as e:
        gclient.infer("mlp-cpu", [_grpc_input(_x(1))], headers={"authorization": "Bearer " + TOKEN[:-1] + "X"})
    assert e.value.status() == "StatusCode.UNAUTHENTICATED"
    # the two inference calls are counted, with no model (refused before one was chosen); metadata calls are not
    assert _requests_total(server) == before + 2
    denied = dict(model="", outcome="invalid", reason="unauthenticated")
    assert _requests_total(server, protocol="http", **denied) >= 1
    assert _requests_total(server, protocol="grpc", **denied) >= 1


def test_server_and_model_metadata(client, gclient):
    md = client.get_server_metadata(headers=auth())
    assert md["name"] == "dsedge" and md["extensions"] == ["binary_tensor_data", "model_configuration", "statistics"]
    for name in ("mlp-cpu", "mlp-t4"):  # same model, two targets: distinct names
        m = client.get_model_metadata(name, headers=auth())
        assert m["versions"] == ["1"]
        assert m["inputs"] == [{"name": "x", "datatype": "FP32", "shape": [-1, 64]}]
        assert m["outputs"] == [{"name": "logits", "datatype": "FP32", "shape": [-1, 4]}]
        assert client.is_model_ready(name, headers=auth())
        g = gclient.get_model_metadata(name, headers=gauth(), as_json=True)
        assert g["inputs"] == [{"name": "x", "datatype": "FP32", "shape": ["-1", "64"]}]
        assert gclient.is_model_ready(name, headers=gauth())
    assert not client.is_model_ready("mlp-cpu", "2", headers=auth())
    assert gclient.get_server_metadata(headers=gauth(), as_json=True)["extensions"] == ["binary_tensor_data", "model_configuration", "statistics"]


@pytest.mark.parametrize("binary_in, binary_out", [(True, True), (False, False), (True, False)])
def test_http_infer_equals_session_run(client, reference, binary_in, binary_out):
    x = _x(5, seed=3)  # several rows in one request
    want = reference.run({"x": x})["logits"]
    r = client.infer("mlp-cpu", [_http_input(x, binary_in)], request_id="req-42", headers=auth(),
                     outputs=[httpclient.InferRequestedOutput("logits", binary_data=binary_out)])
    np.testing.assert_allclose(r.as_numpy("logits"), want, rtol=1e-5, atol=1e-6)
    resp = r.get_response()
    assert resp["id"] == "req-42" and resp["model_name"] == "mlp-cpu"
    out = resp["outputs"][0]
    assert ("binary_data_size" in out.get("parameters", {})) == binary_out and ("data" in out) != binary_out
    p = resp["parameters"]
    assert p["variant"] == "fp32" and p["batch_size"] >= 5
    assert 0 <= p["queue_ms"] <= p["latency_ms"]


def test_grpc_infer_sync_and_asyncio_equal_session_run(server, gclient, reference):
    import asyncio

    import tritonclient.grpc.aio as grpcaio

    x = _x(3, seed=4)
    want = reference.run({"x": x})["logits"]
    r = gclient.infer("mlp-t4", [_grpc_input(x)], request_id="g1", headers=gauth())
    np.testing.assert_allclose(r.as_numpy("logits"), want, rtol=1e-5, atol=1e-6)
    resp = r.get_response(as_json=True)
    assert resp["id"] == "g1" and resp["parameters"]["variant"]["string_param"] == "fp32"

    async def many() -> list[np.ndarray]:
        c = grpcaio.InferenceServerClient(server.grpc)
        try:
            rs = await asyncio.gather(*(c.infer("mlp-cpu", [_grpc_input(x[i:i + 1])], headers=gauth())
                                        for i in range(3)))
        finally:
            await c.close()
        return [r.as_numpy("logits") for r in rs]

    got = np.concatenate(asyncio.run(many()))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_budget_timeout_and_priority_parameters(client, gclient):
    x = [_http_input(_x(1))]
    p = client.infer("mlp-cpu", x, headers=auth()).get_response()["parameters"]
    assert (p["budget_ms"], p["budget_source"], p["priority_level"]) == (250.0, "default", 2)  # manifest's budget
    p = client.infer("mlp-cpu", x, headers=auth(), parameters={"budget_ms": 400}, priority=1).get_response()["parameters"]
    assert (p["budget_ms"], p["budget_source"], p["priority_level"]) == (400.0, "budget_ms", 1)
    # Triton's timeout is in µs; the tighter of the two applies
    p = client.infer("mlp-cpu", x, headers=auth(), parameters={"budget_ms": 400}, timeout=300_000).get_response()
    assert (p["parameters"]["budget_ms"], p["parameters"]["budget_source"]) == (300.0, "timeout")
    p = client.infer("mlp-cpu", x, headers=auth(), parameters={"budget_ms": 250}, timeout=300_000).get_response()
    assert (p["parameters"]["budget_ms"], p["parameters"]["budget_source"]) == (250.0, "budget_ms")
    g = gclient.infer("mlp-cpu", [_grpc_input(_x(1))], headers=gauth(), priority=3, timeout=350_000)
    gp = g.get_response(as_json=True)["parameters"]
    assert gp["budget_source"]["string_param"] == "timeout" and gp["budget_ms"]["double_param"] == 350.0
    assert gp["priority_level"]["int64_param"] == "3"
    with pytest.raises(InferenceServerException, match="priority") as e:
        client.infer("mlp-cpu", x, headers=auth(), priority=9)
    assert e.value.status() == "400"


def test_grpc_deadline_caps_the_budget(gclient):
    # the client's gRPC deadline counts from its send, so it is the bound that includes time queued inside gRPC
    g = gclient.infer("mlp-cpu", [_grpc_input(_x(1))], headers=gauth(), timeout=350_000, client_timeout=0.2)
    gp = g.get_response(as_json=True)["parameters"]
    assert gp["budget_source"]["string_param"] == "grpc_deadline"
    # at most the deadline (gRPC's timeout header carries it in whole units of its own, so a hair over 200 ms)
    assert 100.0 < gp["budget_ms"]["double_param"] <= 201.0
    g = gclient.infer("mlp-cpu", [_grpc_input(_x(1))], headers=gauth(), timeout=350_000, client_timeout=30.0)
    gp = g.get_response(as_json=True)["parameters"]
    assert (gp["budget_source"]["string_param"], gp["budget_ms"]["double_param"]) == ("timeout", 350.0)


def test_way_back_reserve_is_the_recent_p99_and_a_burst_ages_out():
    from dsedge.serve.models import WayBack

    w = WayBack(window=100, every=10, initial_ms=1.0, min_samples=10, horizon_s=2.0)
    for _ in range(9):
        w.add(50.0, now=0.0)
    assert w.at(0.0) == 1.0  # fewer than min_samples: the initial reserve
    w.add(50.0, now=0.0)
    assert w.at(0.1) == 50.0
    for i in range(100):  # the window forgets the old answers
        w.add(float(i % 10), now=1.0)
    assert w.at(1.0) == pytest.approx(9.0)  # numpy's linear p99 of ten each of 0…9
    # a burst's slow way back, then nothing answered (every tight budget refused): the reserve it left must not
    # keep refusing them; two seconds on it is the initial one again
    for _ in range(32):
        w.add(26.0, now=5.0)
    assert w.at(5.0) == pytest.approx(26.0)
    assert w.at(7.5) == 1.0
    p90 = WayBack(window=100, every=10, quantile=90.0)
    for i in range(100):
        p90.add(float(i % 10), now=0.0)
    assert p90.at(0.0) == pytest.approx(8.1)


def test_one_large_answers_way_back_does_not_refuse_the_small_ones():
    """A 12.6 MB answer's 80 ms way back set the reserve of every call for 2 s, so calls of a few tokens with 50 ms
    budgets were refused (a user's pass): a sample counts for calls expecting an answer of its size class or more."""
    from dsedge.serve.models import WayBack

    w = WayBack(window=256, every=32, min_samples=8)
    assert [w.size_class(n) for n in (0, 65536, 65537, 262144, 262145, 16 * 512 * 384 * 4)] == [0, 0, 1, 1, 2, 4]
    for i in range(50):
        w.add(0.5 + 0.01 * i, now=0.0, nbytes=4 * 384 * 4)
    w.add(80.0, now=0.0, nbytes=16 * 512 * 384 * 4)  # one big answer, slow on its way back
    assert w.at(0.1, 4 * 384 * 4) < 1.0  # a small call: the small answers' p99
    assert w.at(0.1, 16 * 512 * 384 * 4) == 80.0  # a big call: not lost among the 50 small ones
    for _ in range(8):
        w.add(75.0, now=0.1, nbytes=16 * 512 * 384 * 4)
    assert w.at(0.1, 16 * 512 * 384 * 4) > 70.0  # a call expecting a big answer reserves the big ones' way back
    assert w.at(0.1, 4 * 384 * 4) < 1.0


def test_unmeetable_budget_is_503_and_unavailable(client, gclient):
    with pytest.raises(InferenceServerException) as e:
        client.infer("mlp-cpu", [_http_input(_x(1))], headers=auth(), parameters={"budget_ms": 0.001})
    assert e.value.status() == "503" and e.value.message().startswith("budget:"), e.value.message()
    with pytest.raises(InferenceServerException) as e:
        gclient.infer("mlp-cpu", [_grpc_input(_x(1))], headers=gauth(), timeout=1)  # 1 µs
    assert e.value.status() == "StatusCode.UNAVAILABLE" and e.value.message().startswith("budget:")


def test_a_spent_budget_is_refused_before_the_inputs_are_decoded(server):
    # under overload most refusals are calls whose budget was spent in gRPC's queue: refused before decoding and
    # validation (the costliest part of a refusal); with budget left, the same malformed call is invalid
    from tritonclient.grpc import service_pb2 as pb
    from tritonclient.grpc import service_pb2_grpc as pb_grpc

    def call(timeout_us: int) -> grpc.RpcError:
        req = pb.ModelInferRequest(model_name="mlp-cpu")
        req.inputs.add(name="x", datatype="FP32", shape=[1, 64])
        req.raw_input_contents.append(b"\0" * 12)  # 12 bytes for a [1, 64] FP32 input
        req.parameters["timeout"].int64_param = timeout_us
        with grpc.insecure_channel(server.grpc) as ch:
            with pytest.raises(grpc.RpcError) as e:
                pb_grpc.GRPCInferenceServiceStub(ch).ModelInfer(req, metadata=tuple(GRPC_AUTH.items()), timeout=30)
        return e.value

    spent = call(1)  # 1 µs
    assert spent.code() == grpc.StatusCode.UNAVAILABLE and spent.details().startswith("budget:"), spent.details()
    bad = call(30_000_000)
    assert bad.code() == grpc.StatusCode.INVALID_ARGUMENT and "12 bytes of data" in bad.details(), bad.details()


def test_submit_validated_answers_as_submit_without_copying_or_checking_again(reference):
    from dsedge.runtime.errors import InputError
    from dsedge.runtime.io import validate_inputs

    x = _x(2, seed=3)
    checked = validate_inputs(reference.inputs, {"x": x}, reference.manifest.shape_ranges)
    assert checked["x"] is x  # validation takes the caller's array as it is
    got = reference.submit_validated(checked, 5_000.0).result(timeout=30)
    want = reference.submit({"x": x}, budget_ms=5_000.0).result(timeout=30)
    assert got.ok and want.ok
    np.testing.assert_array_equal(got.outputs["logits"], want.outputs["logits"])
    np.testing.assert_allclose(got.outputs["logits"], reference.run({"x": x})["logits"], rtol=1e-5, atol=1e-6)
    most = reference._core().scheduler.lanes[0].max_batch
    with pytest.raises(InputError, match=f"batches at most {most}"):
        reference.submit_validated({"x": _x(most + 1)}, 5_000.0)


def _header(obj: dict) -> bytes:
    return json.dumps(obj).encode()


@pytest.mark.parametrize("body, headers, status, message", [
    (b"{not json", {}, 400, "not valid JSON"),
    (_header({"inputs": []}), {}, 400, "non-empty 'inputs'"),
    (_header({"inputs": [{"name": "x", "datatype": "INT64", "shape": [1, 64], "data": [0] * 64}]}), {}, 400,
     "dtype int64, expected float32"),
    (_header({"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 63], "data": [0.5] * 63}]}), {}, 400,
     "dim 1 is 63, expected 64"),
    (_header({"inputs": [{"name": "x", "datatype": "FP32", "shape": [2, 64], "data": [0.5] * 64}]}), {}, 400,
     "64 values for shape [2, 64]"),
    (_header({"inputs": [{"name": "y", "datatype": "FP32", "shape": [1, 64], "data": [0.5] * 64}]}), {}, 400,
     "unknown input 'y'"),
    (_header({"inputs": [{"name": "x", "datatype": "BYTES", "shape": [1], "data": ["a"]}]}), {}, 400,
     "datatype 'BYTES' is not supported"),
    (_header({"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 64], "data": ["a"] * 64}]}), {}, 400,
     "not a list of FP32"),
    (_header({"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 64], "data": [0.5] * 64}],
              "outputs": [{"name": "probs"}]}), {}, 400, "no output 'probs'"),
    (_header({"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 64],
                          "parameters": {"binary_data_size": 256}}]}) + b"\0" * 100,
     {"Inference-Header-Content-Length": str(len(_header({"inputs": [{"name": "x", "datatype": "FP32",
                                                                        "shape": [1, 64], "parameters":
                                                                            {"binary_data_size": 256}}]})))},
     400, "runs past the end"),
    (_header({"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 64],
                          "parameters": {"binary_data_size": -8}}]}), {}, 400,
     "binary_data_size must be a byte count (an integer >= 0), got -8"),
    (_header({"inputs": [{"name": "x", "datatype": "FP32", "shape": [10 ** 11, 10 ** 11],
                          "parameters": {"binary_data_size": 0}}]}), {}, 400,
     "(expected 40000000000000000000000)"),
    (b"[" * 20000 + b"]" * 20000, {}, 400, "nests JSON deeper than the parser allows"),
    (b"{" + b" " * (CAP + 10) + b"}", {}, 413, "65536-byte limit"),
    (_header({"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 64], "data": [0.5] * 64}],
              "parameters": {"budget_ms": 10 ** 400}}), {}, 400, "'budget_ms' must be a positive number, got 1000"),
    (_header({"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 64], "data": [0.5] * 64}],
              "parameters": {"timeout": 10 ** 400}}), {}, 400, "'timeout' must be a positive number"),
    (_header({"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 64], "data": [0.5] * 64}],
              "outputs": [{"name": "y", "parameters": 5}]}), {}, 400, "output 'y': 'parameters' must be an object"),
    (_header({"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 64], "data": [0.5] * 64}],
              "outputs": [{"name": "y", "parameters": {"binary_data": "false"}}]}), {}, 400,
     "parameter 'binary_data' must be true or false, got 'false'"),
    (_header({"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 64], "data": [0.5] * 64}],
              "parameters": {"binary_data_output": "false"}}), {}, 400,
     "parameter 'binary_data_output' must be true or false"),
    (_header({"inputs": []}), {"Inference-Header-Content-Length": "\u00b2"}, 400,
     "Inference-Header-Content-Length '\u00b2' does not fit"),
    # a user's pass: the JSON data was silently ignored for the binary buffer (gRPC refuses both: docs/serve.md)
    (_header({"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 64], "data": [0.5] * 64,
                          "parameters": {"binary_data_size": 256}}]}) + b"\0" * 256,
     {"Inference-Header-Content-Length": str(len(_header({"inputs": [{"name": "x", "datatype": "FP32",
                                                                        "shape": [1, 64], "data": [0.5] * 64,
                                                                        "parameters":
                                                                            {"binary_data_size": 256}}]})))},
     400, "has both 'data' and parameters.binary_data_size"),
], ids=["garbage-json", "no-inputs", "wrong-datatype", "wrong-shape", "too-few-values", "unknown-input", "bytes",
        "strings-for-floats", "unknown-output", "short-binary", "negative-binary-size", "huge-shape", "deep-json",
        "oversized", "huge-int-budget", "huge-int-timeout", "output-parameters-not-an-object",
        "binary-flag-as-string", "request-binary-flag-as-string", "non-ascii-digit-header", "data-and-binary"])
def test_malformed_requests_get_4xx_with_a_message(server, body, headers, status, message):
    code, err = _raw_post(server, "/v2/models/mlp-cpu/infer", body, headers)
    assert code == status and message in err["error"], err


def test_unknown_endpoints_and_methods_get_a_json_error(server, client):
    from tritonclient.utils import InferenceServerException

    code, err = _raw_post(server, "/v2/repository/models/mlp-cpu/load", b"{}")
    assert code == 404 and err["reason"] == "not_found" and \
        "no such endpoint '/v2/repository/models/mlp-cpu/load'" in err["error"]
    code, err = _raw_post(server, "/v2/health/live", b"{}")
    assert code == 405 and err["reason"] == "method_not_allowed" and "POST is not allowed" in err["error"], err
    with pytest.raises(InferenceServerException) as e:  # tritonclient reads the error body (it was plain text)
        client.unload_model("mlp-cpu", headers=AUTH)
    assert "no such endpoint" in e.value.message() and "Parse error" not in e.value.message()


def test_unknown_model_version_and_server_keeps_serving(server, client, gclient, reference):
    unknown = dict(model="", outcome="invalid", reason="not_found")
    before_http, before_grpc = (_requests_total(server, protocol=p, **unknown) for p in ("http", "grpc"))
    code, err = _raw_post(server, "/v2/models/nope/infer", b"{}")
    assert code == 404 and "unknown model 'nope'" in err["error"] and "mlp-cpu" in err["error"]
    code, err = _raw_post(server, "/v2/models/mlp-cpu/versions/7/infer", b"{}")
    assert code == 404 and "no version '7'" in err["error"]
    with pytest.raises(InferenceServerException) as e:
        gclient.infer("nope", [_grpc_input(_x(1))], headers=gauth())
    assert e.value.status() == "StatusCode.NOT_FOUND"
    assert _requests_total(server, protocol="http", **unknown) == before_http + 1  # counted, with no model
    assert _requests_total(server, protocol="grpc", **unknown) == before_grpc + 1
    with pytest.raises(InferenceServerException) as e:  # gRPC's message cap is the HTTP body cap
        gclient.infer("mlp-cpu", [_grpc_input(_x(300))], headers=gauth())
    assert e.value.status() == "StatusCode.RESOURCE_EXHAUSTED"
    bad = grpcclient.InferInput("x", [1, 64], "INT64")
    bad.set_data_from_numpy(np.zeros((1, 64), np.int64))
    with pytest.raises(InferenceServerException, match="dtype int64, expected float32") as e:
        gclient.infer("mlp-cpu", [bad], headers=gauth())
    assert e.value.status() == "StatusCode.INVALID_ARGUMENT"
    x = _x(2, seed=9)  # still serving, same answers
    r = client.infer("mlp-cpu", [_http_input(x)], headers=auth())
    np.testing.assert_allclose(r.as_numpy("logits"), reference.run({"x": x})["logits"], rtol=1e-5, atol=1e-6)
    assert client.is_server_ready()


def test_metrics_are_histograms_per_model_and_variant(server, client):
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    for name in ("mlp-cpu", "mlp-t4"):
        client.infer(name, [_http_input(_x(1))], headers=auth())
    text = urllib.request.urlopen(f"http://{server.metrics}/metrics", timeout=10).read().decode()
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    for fam in ("dsedge_request_duration_seconds", "dsedge_request_queue_seconds", "dsedge_batch_size"):
        assert fams[fam].type == "histogram"
        counts = {s.labels["model"]: s.value for s in fams[fam].samples if s.name.endswith("_count")}
        assert counts["mlp-cpu"] >= 1 and counts["mlp-t4"] >= 1
        assert all(s.labels["variant"] == "fp32" for s in fams[fam].samples)
    reqs = [(s.labels["model"], s.labels["protocol"], s.labels["outcome"], s.labels["reason"], s.value)
            for s in fams["dsedge_requests"].samples if s.name == "dsedge_requests_total"]
    assert any(m == "mlp-t4" and o in ("ok", "late") and v >= 1 for m, _, o, _, v in reqs)
    assert not any(m == "mlp-t4" and o == "rejected" for m, _, o, _, v in reqs)
    ready = {s.labels["model"]: s.value for s in fams["dsedge_model_ready"].samples}
    assert ready == {"mlp-cpu": 1.0, "mlp-t4": 1.0}


def test_rejections_and_invalid_requests_are_counted(server, client):
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    def count(outcome: str, reason: str) -> float:
        text = urllib.request.urlopen(f"http://{server.metrics}/metrics", timeout=10).read().decode()
        return sum(s.value for f in text_string_to_metric_families(text) if f.name == "dsedge_requests"
                   for s in f.samples if s.name == "dsedge_requests_total" and s.labels["model"] == "mlp-t4"
                   and s.labels["outcome"] == outcome and s.labels["reason"] == reason)

    before_budget, before_invalid = count("rejected", "budget"), count("invalid", "invalid")
    with pytest.raises(InferenceServerException):
        client.infer("mlp-t4", [_http_input(_x(1))], headers=auth(), parameters={"budget_ms": 0.001})
    _raw_post(server, "/v2/models/mlp-t4/infer",
              _header({"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 3], "data": [1, 2, 3]}]}))
    assert count("rejected", "budget") == before_budget + 1
    assert count("invalid", "invalid") == before_invalid + 1
    # refused before the model's infer() (the body does not parse): counted all the same
    before_too_large = count("invalid", "too_large")
    _raw_post(server, "/v2/models/mlp-t4/infer", b"{not json")
    _raw_post(server, "/v2/models/mlp-t4/infer", b"{" + b" " * (CAP + 10) + b"}")
    assert count("invalid", "invalid") == before_invalid + 2
    assert count("invalid", "too_large") == before_too_large + 1


def test_logs_are_json_lines(server):
    records = [json.loads(line) for line in server.log().splitlines() if line.strip()]
    ready = [r for r in records if r["msg"] == "model ready"]
    assert sorted(r["model"] for r in ready) == ["mlp-cpu", "mlp-t4"]
    assert all({"ts", "level", "logger"} <= set(r) for r in records)


def test_startup_heap_is_frozen_before_ready(server):
    # the loaded heap (modules, ORT sessions, web frameworks) leaves the collector's view before traffic: a full
    # collection under load then walks only what requests created (sdk/serve/server.py freeze_startup_heap)
    records = [json.loads(line) for line in server.log().splitlines() if line.strip()]
    ready = [r for r in records if r["msg"] == "ready"]
    assert len(ready) == 1 and ready[0]["gc_frozen"] > 20_000, ready


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice values are Linux's")
def test_batch_workers_run_at_a_higher_nice_value_than_the_front_end(server, client):
    import os
    from pathlib import Path

    def nice(tid: int) -> int:  # field 19 of /proc/PID/task/TID/stat
        return int(Path(f"/proc/{server.pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()[16])

    client.infer("mlp-cpu", [_http_input(_x(1))], headers=auth())  # the lanes run
    tids = [int(t) for t in os.listdir(f"/proc/{server.pid}/task")]
    loop = nice(server.pid)  # the main thread runs the event loop (HTTP and gRPC front ends)
    assert sorted(nice(t) - loop for t in tids).count(5) >= 2  # the fixture's --worker-nice 5: a lane per model
    ready = [json.loads(line) for line in server.log().splitlines() if '"model ready"' in line]
    assert {r["worker_nice"] for r in ready} == {5}


def test_each_log_line_is_printed_once(server):
    records = [json.loads(line) for line in server.log().splitlines() if line.strip()]
    started = [r for r in records if r["msg"].startswith("Started server process")]
    assert len(started) == 1 and started[0]["logger"] == "uvicorn.error"   # two uvicorn servers, one process
    lines = [tuple(sorted((k, str(v)) for k, v in r.items() if k != "ts")) for r in records]
    assert len(lines) == len(set(lines))


def test_gzip_request_and_typed_grpc_contents(server, client, reference):
    from tritonclient.grpc import service_pb2 as pb
    from tritonclient.grpc import service_pb2_grpc as pb_grpc

    x = _x(2, seed=11)
    want = reference.run({"x": x})["logits"]
    r = client.infer("mlp-cpu", [_http_input(x)], headers=auth(), request_compression_algorithm="gzip")
    np.testing.assert_allclose(r.as_numpy("logits"), want, rtol=1e-5, atol=1e-6)
    req = pb.ModelInferRequest(model_name="mlp-cpu", id="typed")
    t = req.inputs.add(name="x", datatype="FP32", shape=[2, 64])
    t.contents.fp32_contents.extend(x.reshape(-1).tolist())
    with grpc.insecure_channel(server.grpc) as ch:
        resp = pb_grpc.GRPCInferenceServiceStub(ch).ModelInfer(req, metadata=(("authorization", AUTH["Authorization"]),))
    assert resp.id == "typed" and list(resp.outputs[0].shape) == [2, 4]
    got = np.frombuffer(resp.raw_output_contents[0], "<f4").reshape(2, 4)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    req.raw_input_contents.append(np.zeros((2, 64), "<f4").tobytes())  # both forms at once: refused, as Triton does
    with grpc.insecure_channel(server.grpc) as ch, pytest.raises(grpc.RpcError) as e:
        pb_grpc.GRPCInferenceServiceStub(ch).ModelInfer(req, metadata=(("authorization", AUTH["Authorization"]),))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "send one or the other" in e.value.details()


def test_bundle_names_and_cli_errors(tmp_path):
    import subprocess
    import sys

    from dsedge.runtime.errors import DsedgeError
    from dsedge.serve.models import _name_bundles

    a, b = mlp_bundle(tmp_path / "a.dse", tmp_path, "cpu"), mlp_bundle(tmp_path / "b.dse", tmp_path, "t4")
    assert _name_bundles([str(a)]) == [("mlp", str(a))]
    assert _name_bundles([str(a), str(b)]) == [("mlp-cpu", str(a)), ("mlp-t4", str(b))]
    assert _name_bundles([f"fast={a}", str(b)]) == [("fast", str(a)), ("mlp", str(b))]
    with pytest.raises(DsedgeError, match="both be served as 'mlp-cpu'"):
        _name_bundles([str(a), str(a)])
    with pytest.raises(DsedgeError, match="^'fast=': no bundle path after 'fast='$"):  # was: "'.' is a folder…"
        _name_bundles(["fast=", str(b)])
    for args, message in ((["serve", str(tmp_path / "missing.dse")], "missing.dse' does not exist"),
                          (["serve", str(a), "--tls-cert", str(a / "manifest.json")], "--tls-cert and --tls-key go together"),
                          (["serve", str(a), "--auth-token-file", str(tmp_path / "none")], "cannot read --auth-token-file"),
                          (["serve", str(a), "--tls-cert", str(a / "manifest.json"), "--tls-key", str(a / "manifest.json")],
                           "are not a PEM certificate and its private key"),
                          # refused before any listener starts (it was after: the error twice among log lines)
                          (["serve", str(a), "--variant", "nope"], "bundle has no variant 'nope'"),
                          (["serve", str(a), "--max-batch", "1000"], "--max-batch 1000 is above the bundle's batch")):
        p = subprocess.run([sys.executable, "-m", "dsedge", *args, "--http-port", "0", "--grpc-port", "0",
                            "--metrics-port", "0"], capture_output=True, text=True, timeout=120)
        assert p.returncode != 0 and message in p.stderr and "Traceback" not in p.stderr, p.stderr
        assert "Task exception" not in p.stderr and len(p.stderr.strip().splitlines()) == 2, p.stderr  # error, hint


def test_a_taken_port_is_a_one_line_error(tmp_path):
    import socket
    import subprocess
    import sys

    a = mlp_bundle(tmp_path / "a.dse", tmp_path, "cpu")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        for flag in ("--grpc-port", "--http-port", "--metrics-port"):
            ports = {"--http-port": "0", "--grpc-port": "0", "--metrics-port": "off", flag: str(port)}
            p = subprocess.run([sys.executable, "-m", "dsedge", "serve", str(a), "--host", "127.0.0.1",
                                *[x for kv in ports.items() for x in kv]], capture_output=True, text=True, timeout=120)
            assert p.returncode == 2, (flag, p.stderr)
            assert f"error: cannot bind 127.0.0.1:{port}: Address already in use" in p.stderr.splitlines(), p.stderr
            assert "add_port" not in p.stderr and "Traceback" not in p.stderr and "Exception" not in p.stderr, p.stderr
            assert "hint: pick another port" in p.stderr, p.stderr
    for host in ("nosuchhost.invalid", "192.0.2.1"):  # not an address of this machine: the hint says so, not "port"
        p = subprocess.run([sys.executable, "-m", "dsedge", "serve", str(a), "--host", host, "--http-port", "0",
                            "--grpc-port", "0", "--metrics-port", "off"], capture_output=True, text=True, timeout=120)
        assert p.returncode == 2 and f"error: cannot bind {host}:0: " in p.stderr, p.stderr
        assert "--host must be an address of this machine" in p.stderr and "Traceback" not in p.stderr, p.stderr


def test_bad_numbers_are_refused_before_the_server_starts(tmp_path, capsys):
    from dsedge.cli import main
    from dsedge.runtime.errors import ConfigError
    from dsedge.serve import ServeConfig

    for args, message in ((["--budget-ms", "nan"], "Invalid value for '--budget-ms': 'nan' is not a finite number"),
                          (["--budget-ms", "inf"], "Invalid value for '--budget-ms': 'inf' is not a finite number"),
                          (["--drain-timeout", "nan"], "Invalid value for '--drain-timeout': 'nan' is not a finite"),
                          (["--worker-nice", "20"], "Invalid value for '--worker-nice': 20 is not in the range")):
        with pytest.raises(SystemExit) as e:
            main(["serve", str(tmp_path / "never-opened.dse"), "--http-port", "0", "--grpc-port", "0",
                  "--metrics-port", "0", *args])
        err = capsys.readouterr().err
        assert e.value.code == 2 and message in err and "not a dsedge bundle" not in err, err
    for kwargs, message in ((dict(budget_ms=float("nan")), "--budget-ms nan is not a finite number of milliseconds > 0"),
                            (dict(budget_ms=-5.0), "--budget-ms -5.0 is not a finite number of milliseconds > 0"),
                            (dict(drain_timeout_s=float("inf")), "--drain-timeout inf is not a finite number"),
                            (dict(max_batch=0), "--max-batch 0 is not an integer >= 1"),
                            (dict(max_queue=1.5), "--max-queue 1.5 is not an integer >= 0"),
                            (dict(http_port=70000), "--http-port 70000 is not a port in 0..65535"),
                            (dict(http_port=None, grpc_port=None), "both off: the server would take no requests"),
                            (dict(http_port=18300, grpc_port=18300), "--http-port and --grpc-port are both 18300"),
                            (dict(body_timeout_s=0.0), "--body-timeout 0.0 is not a finite number of seconds > 0"),
                            (dict(worker_nice=20), "--worker-nice 20 is not an integer in 0..19"),
                            (dict(worker_nice=-1), "--worker-nice -1 is not an integer >= 0"),
                            (dict(reserve_cores=-1), "--reserve-cores -1 is not an integer >= 0"),
                            (dict(pin_instances="no"), "--pin-instances 'no' is not True or False"),
                            (dict(standby=1), "--standby 1 is not True or False"),
                            (dict(spare_pause_cores=float("nan")), "--spare-pause-cores nan is not a finite number")):
        with pytest.raises(ConfigError, match=re.escape(message)):
            ServeConfig(bundles=["never-opened.dse"], **kwargs)
    assert ServeConfig(bundles=["b.dse"], budget_ms=15, http_port=None).budget_ms == 15
    assert ServeConfig(bundles=["b.dse"]).reserve_cores == 0 and ServeConfig(bundles=["b.dse"]).spare_pause_cores == 0.3
    assert ServeConfig(bundles=["b.dse"]).pin_instances is True and ServeConfig(bundles=["b.dse"]).standby is False
    assert ServeConfig(bundles=["b.dse"], http_port=0, grpc_port=0, metrics_port=0).http_port == 0  # 0: any port


def test_served_names_timeout_zero_and_the_bearer_scheme(tmp_path):
    from dsedge.runtime.errors import DsedgeError
    from dsedge.serve.auth import TokenCheck
    from dsedge.serve.models import _name_bundles
    from dsedge.serve.protocol import Deadline, deadline

    a = mlp_bundle(tmp_path / "a.dse", tmp_path, "cpu")
    for bad in ("x/y", "with space", "q?x"):  # a model name is a URL path segment: /v2/models/NAME/infer
        with pytest.raises(DsedgeError, match="cannot be a served model name"):
            _name_bundles([f"{bad}={a}"])
    assert _name_bundles([f"mini.lm_2-b={a}"]) == [("mini.lm_2-b", str(a))]
    # Triton's timeout 0 is "no timeout of its own": the budget or the model's default holds
    assert deadline({"timeout": 0}, 50.0) == Deadline(50.0, "default")
    assert deadline({"timeout": 0, "budget_ms": 20}, 50.0) == Deadline(20.0, "budget_ms")
    with pytest.raises(Exception, match="must be a positive number"):
        deadline({"timeout": -1}, 50.0)
    t = TokenCheck("tok3n")
    assert t.ok("Bearer tok3n") and t.ok("bearer tok3n") and t.ok("BEARER  tok3n")  # the scheme in any case
    assert not t.ok("Bearer tok3m") and not t.ok("Basic tok3n") and not t.ok("tok3n") and not t.ok(None)


def test_priority_gate_orders_bounds_and_times_out():
    import asyncio

    from dsedge.serve.priority import PriorityGate, PriorityLevels
    from dsedge.serve.protocol import ServeError

    levels = PriorityLevels(3, 2)
    assert [levels.level(p) for p in (None, 0, 1, 2, 3)] == [2, 2, 1, 2, 3]
    assert [levels.dsedge_priority(l) for l in (1, 2, 3)] == [2, 1, 0]

    async def go() -> None:
        gate = PriorityGate(max_inflight=1, max_queue=3)
        assert await gate.enter(2, 1.0) is False  # a free slot: no wait
        order: list[int] = []

        async def waiter(level: int) -> None:
            await gate.enter(level, 5.0)
            order.append(level)
            gate.leave()

        tasks = [asyncio.ensure_future(waiter(l)) for l in (3, 2, 1)]
        await asyncio.sleep(0.01)
        assert gate.waiting == 3
        with pytest.raises(ServeError) as e:  # queue full
            await gate.enter(1, 1.0)
        assert (e.value.status, e.value.reason) == (429, "overload")
        gate.leave()
        await asyncio.gather(*tasks)
        assert order == [1, 2, 3] and gate.waiting == 0 and gate.inflight == 0
        await gate.enter(2, 1.0)
        with pytest.raises(ServeError) as e:  # budget runs out while waiting
            await gate.enter(1, 0.02)
        assert (e.value.status, e.value.reason) == (503, "deadline") and gate.waiting == 0
        late = asyncio.ensure_future(gate.enter(3, 5.0))
        await asyncio.sleep(0.01)
        gate.close()
        with pytest.raises(ServeError) as e:
            await late
        assert e.value.reason == "shutdown" and gate.waiting == 0

    asyncio.run(go())


def test_unimplemented_methods_and_out_of_range_budgets_get_clean_errors(server, gclient):
    with pytest.raises(InferenceServerException) as e:
        gclient.unload_model("mlp-cpu", headers=gauth())
    assert e.value.status() == "StatusCode.UNIMPLEMENTED" and "ModelStatistics only" in e.value.message()
    # Triton's timeout may be anything: past an hour it is capped, not refused
    g = gclient.infer("mlp-cpu", [_grpc_input(_x(1))], headers=gauth(), timeout=2**62)
    gp = g.get_response(as_json=True)["parameters"]
    assert (gp["budget_source"]["string_param"], gp["budget_ms"]["double_param"]) == ("timeout", 3_600_000.0)
    with pytest.raises(InferenceServerException) as e:  # dsedge's own budget_ms: over an hour is a unit mistake
        gclient.infer("mlp-cpu", [_grpc_input(_x(1))], headers=gauth(), parameters={"budget_ms": 1e9})
    assert e.value.status() == "StatusCode.INVALID_ARGUMENT" and "at most 3600000 ms" in e.value.message()
    with pytest.raises(InferenceServerException) as e:  # a budget under the way-back reserve says so
        gclient.infer("mlp-cpu", [_grpc_input(_x(1))], headers=gauth(), parameters={"budget_ms": 0.5})
    # (timing decides which of the three `budget` refusals it is: parsing may take the whole 0.5 ms on a loaded
    # machine, and a fast way back may leave enough for the scheduler, which then refuses it alone)
    msg = e.value.message()
    assert msg.startswith("budget:") and any(w in msg for w in ("to get back", "spent before the request reached",
                                                                "alone on")), msg
    time.sleep(0.2)
    assert "Traceback" not in server.log() and "NotImplementedError" not in server.log()


def test_the_clients_side_of_the_way_back_is_reserved_and_a_call_left_only_the_servers_side_is_refused(tmp_path):
    """The budget left for the scheduler excludes the way back on both sides of the call (this side measured, the
    client's taken as ``client_share`` times it); a call with time for this side's half only is refused ``budget``,
    not dropped as a miss."""
    import asyncio

    from dsedge.serve.metrics import ServeMetrics
    from dsedge.serve.models import Repository, ServeError

    repo = Repository([mlp_bundle(tmp_path / "mlp-cpu.dse", tmp_path, "cpu")], ServeMetrics(), threads=1)
    repo.load()
    model = repo.get("mlp")
    model.way_back.at = lambda now, nbytes=0: 20.0  # this side's recent p99: 20 ms

    async def call(budget_ms: float):
        return await model.infer({"x": _x(1)}, {"budget_ms": budget_ms}, None, "grpc")

    try:
        with pytest.raises(ServeError) as e:  # 30 ms: ~10 left after this side's 20, none after the client's 20
            asyncio.run(call(30.0))
        assert e.value.reason == "budget" and "40 ms the answer needs to get back" in e.value.message, e.value.message
        with pytest.raises(ServeError) as e:  # 15 ms: under this side's way back alone
            asyncio.run(call(15.0))
        assert e.value.reason == "budget" and "20 ms the answer needs to get back" in e.value.message
        answer = asyncio.run(call(80.0))  # 40 ms left for the scheduler: the MLP answers at once
        assert answer.parameters["budget_ms"] == 80.0 and answer.outputs
        model.way_back.client_share = 0.0  # the old reserve: this side only
        assert asyncio.run(call(30.0)).outputs
    finally:
        repo.close(5.0)


def test_a_call_cancelled_while_it_waits_is_counted(tmp_path):
    """A gRPC deadline (or a client leaving) cancels the handler while it waits for a slot: the call still counts."""
    import asyncio

    from dsedge.serve.metrics import ServeMetrics
    from dsedge.serve.models import Repository

    metrics = ServeMetrics()
    repo = Repository([mlp_bundle(tmp_path / "mlp-cpu.dse", tmp_path, "cpu")], metrics, threads=1,
                      max_inflight=1)
    repo.load()
    model = repo.get("mlp")

    async def main() -> None:
        model.gate.inflight = model.gate.max_inflight  # every slot taken: the call waits in the gate
        task = asyncio.ensure_future(model.infer({"x": _x(1)}, {}, None, "grpc",
                                                 transport_deadline=time.perf_counter() + 60.0))
        await asyncio.sleep(0.05)
        task.cancel()  # the client went away (a gRPC deadline cancels the same way, reason "deadline")
        with pytest.raises(asyncio.CancelledError):
            await task

    try:
        asyncio.run(main())
    finally:
        repo.close(5.0)
    count = lambda reason: metrics.registry.get_sample_value(  # noqa: E731
        "dsedge_requests_total", {"model": "mlp", "protocol": "grpc", "outcome": "rejected", "reason": reason})
    assert count("cancelled") == 1.0


def test_a_client_that_leaves_mid_body_counts_as_cancelled_like_one_that_leaves_while_queued(server):
    """Both are the client going away: one outcome (``rejected``, reason ``cancelled``); mid-body was ``invalid``."""
    import socket

    labels = dict(model="mlp-cpu", protocol="http", reason="cancelled")
    before = _requests_total(server, outcome="rejected", **labels)
    host, port = server.http.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(f"POST /v2/models/mlp-cpu/infer HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                     f"Authorization: {AUTH['Authorization']}\r\nContent-Length: 10000\r\n\r\n{{\"inputs\"".encode())
        time.sleep(0.3)
    deadline = time.monotonic() + 10
    while _requests_total(server, outcome="rejected", **labels) == before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _requests_total(server, outcome="rejected", **labels) == before + 1
    assert _requests_total(server, outcome="invalid", **labels) == 0


def test_grpc_way_back_is_timed_to_the_end_of_the_call(tmp_path):
    """Over gRPC the way-back reserve is timed from the backend's answer to the call's end (gRPC's done callback,
    after the response and status went to the transport), once per answered call, not to the handler resuming."""
    import asyncio

    from tritonclient.grpc import service_pb2 as pb
    from tritonclient.grpc import service_pb2_grpc as pb_grpc

    from dsedge.serve.grpc_service import build_server
    from dsedge.serve.metrics import ServeMetrics
    from dsedge.serve.models import Repository
    from dsedge.serve.server import ServerState

    metrics = ServeMetrics()
    repo = Repository([mlp_bundle(tmp_path / "mlp-cpu.dse", tmp_path, "cpu")], metrics, threads=1)
    repo.load()
    model = repo.get("mlp")
    resumed: list[float] = []
    real_infer = model.infer

    answered_at: list[float | None] = []

    async def infer(*a, **k):  # when the handler has its answer back (the old end of the way back)
        out = await real_infer(*a, **k)
        resumed.append(time.perf_counter())
        answered_at.append(out.answered_at)
        return out

    model.infer = infer
    state = ServerState()
    x = _x(2)

    async def main() -> list[float]:
        server = build_server(repo, state, max_message=1 << 24, max_rpcs=None, interceptors=[],
                              server_metadata=lambda: {})
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                stub = pb_grpc.GRPCInferenceServiceStub(ch)
                req = pb.ModelInferRequest(model_name="mlp", inputs=[pb.ModelInferRequest.InferInputTensor(
                    name="x", datatype="FP32", shape=list(x.shape))], raw_input_contents=[x.tobytes()])
                for _ in range(4):
                    resp = await stub.ModelInfer(req, timeout=30)
                    assert resp.outputs and resp.raw_output_contents
                    await asyncio.sleep(0.05)  # the done callback runs on the server's loop after the call
        finally:
            await server.stop(None)
        return resumed

    before = len(model.way_back._times)
    try:
        asyncio.run(main())
    finally:
        repo.close(5.0)
    samples = list(model.way_back._times)[before:]
    by_backend = [(t, r) for t, r in zip(answered_at, resumed) if t is not None]
    assert len(resumed) == 4 and by_backend
    # one sample per call the backend answered, each taken after that call's handler had its answer back (the
    # call's end comes later) and covering at least answer -> resume
    assert len(samples) == len(by_backend)
    for (t_added, ms, _), (t_answer, t_resumed) in zip(samples, by_backend):
        assert t_added >= t_resumed
        assert ms >= (t_resumed - t_answer) * 1e3


def test_shared_memory_tensors_are_refused_not_answered_inline(server, client, gclient):
    """A shared-memory output answered inline left the client reading a region nobody wrote (zeros), with no
    error; a shared-memory input was refused as "2 raw_input_contents for 1 inputs"-style noise."""
    import tritonclient.utils.shared_memory as shm

    x = _x(1)
    region = shm.create_shared_memory_region("dsedge-test-out", "/dsedge_test_shm_out", 40)
    try:
        for mod, c, inp, headers in ((httpclient, client, _http_input(x), auth),
                                     (grpcclient, gclient, _grpc_input(x), gauth)):
            out = mod.InferRequestedOutput("logits")
            out.set_shared_memory("dsedge-test-out", 40)
            with pytest.raises(InferenceServerException, match="shared memory .* is not supported") as e:
                c.infer("mlp-cpu", [inp], outputs=[out], headers=headers())
            assert e.value.status() in ("400", "StatusCode.INVALID_ARGUMENT")
            i = mod.InferInput("x", [1, 64], "FP32")
            i.set_shared_memory("dsedge-test-in", 256)
            with pytest.raises(InferenceServerException, match="input 'x': shared memory .* is not supported") as e:
                c.infer("mlp-cpu", [i], headers=headers())
            assert e.value.status() in ("400", "StatusCode.INVALID_ARGUMENT")
    finally:
        shm.destroy_shared_memory_region(region)
    assert client.is_server_ready(headers=auth())


def test_model_ready_with_a_version_answers_as_triton(server, client, gclient):
    """tritonserver 2.51 (nvidia-pytriton's), asked about a model whose one version is 1: "1" and "01" ready over
    both protocols; an unknown version ("2", "0") or model not ready, gRPC status OK with ready false (HTTP 400);
    "abc" or "-1" INVALID_ARGUMENT over gRPC. gRPC's ModelReady answered NOT_FOUND for an unknown version or model,
    which tritonclient's is_model_ready raised where Triton's returns False, and "01" was unknown."""
    from tritonclient.grpc import service_pb2 as pb
    from tritonclient.grpc import service_pb2_grpc as pb_grpc

    for version in ("", "1", "01"):
        assert client.is_model_ready("mlp-cpu", version, headers=auth()), version
        assert gclient.is_model_ready("mlp-cpu", version, headers=gauth()), version
    for name, version in (("mlp-cpu", "2"), ("mlp-cpu", "0"), ("nope", ""), ("nope", "1")):
        assert not client.is_model_ready(name, version, headers=auth()), (name, version)
        assert gclient.is_model_ready(name, version, headers=gauth()) is False, (name, version)
    host, port = server.http.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    conn.request("GET", "/v2/models/mlp-cpu/versions/2/ready", headers=AUTH)
    r = conn.getresponse()
    assert r.status == 404 and "has no version '2' (versions: 1)" in json.loads(r.read())["error"]
    conn.close()
    for version in ("abc", "-1"):
        with pytest.raises(InferenceServerException, match="model version must be an integer") as e:
            gclient.is_model_ready("mlp-cpu", version, headers=gauth())
        assert e.value.status() == "StatusCode.INVALID_ARGUMENT"
    with grpc.insecure_channel(server.grpc) as ch:  # not ready, and why, in the trailing metadata
        resp, call = pb_grpc.GRPCInferenceServiceStub(ch).ModelReady.with_call(
            pb.ModelReadyRequest(name="mlp-cpu", version="2"), metadata=tuple(GRPC_AUTH.items()))
    assert resp.ready is False and call.code() == grpc.StatusCode.OK
    assert ("dsedge-reason", "not_found") in tuple(call.trailing_metadata())
    x = _x(1)  # infer and metadata take "01" as version 1 too
    r = client.infer("mlp-cpu", [_http_input(x)], model_version="01", headers=auth())
    assert r.get_response()["model_version"] == "1"
    assert client.get_model_metadata("mlp-cpu", "01", headers=auth())["versions"] == ["1"]


def test_an_output_asked_for_twice_is_answered_once_as_its_first_entry_asks(client, gclient, reference):
    """tritonserver 2.51 answers an output named twice in ``outputs`` once, with no error, over HTTP and gRPC, binary
    or JSON as the first entry asks (its core keeps requested outputs in a set). dsedge answered it once too, but
    as the last entry asked."""
    x = _x(1, seed=4)
    want = reference.run({"x": x})["logits"]
    for first, second in ((True, False), (False, True)):
        outs = [httpclient.InferRequestedOutput("logits", binary_data=first),
                httpclient.InferRequestedOutput("logits", binary_data=second)]
        r = client.infer("mlp-cpu", [_http_input(x)], outputs=outs, headers=auth())
        entries = r.get_response()["outputs"]
        assert [e["name"] for e in entries] == ["logits"]
        assert ("data" not in entries[0]) is first, entries[0]
        np.testing.assert_allclose(r.as_numpy("logits"), want, rtol=1e-5, atol=1e-6)
    outs = [grpcclient.InferRequestedOutput("logits"), grpcclient.InferRequestedOutput("logits")]
    r = gclient.infer("mlp-cpu", [_grpc_input(x)], outputs=outs, headers=gauth())
    assert [o.name for o in r.get_response().outputs] == ["logits"]
    np.testing.assert_allclose(r.as_numpy("logits"), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("datatype, fill, message", [
    ("FP32", lambda c: c.int_contents.extend([0] * 64),
     "input 'x' (FP32): data in int_contents, expected fp32_contents (the contents field of FP32)"),
    ("FP32", lambda c: c.fp64_contents.extend([0.0] * 64), "data in fp64_contents, expected fp32_contents"),
    ("FP32", lambda c: (c.fp32_contents.extend([0.0] * 64), c.int_contents.append(1)),
     "input 'x' (FP32): data in int_contents and fp32_contents, expected fp32_contents"),
    ("INT32", lambda c: c.fp32_contents.extend([0.0] * 64),
     "input 'x' (INT32): data in fp32_contents, expected int_contents"),
    ("FP32", lambda c: None, "input 'x' (FP32) has no data: send its 64 values in fp32_contents or raw_input_contents"),
    ("FP32", lambda c: c.fp32_contents.extend([0.0] * 10),
     "input 'x' (FP32): 10 values in fp32_contents for shape [1, 64] (expected 64)"),
    ("FP32", lambda c: c.fp32_contents.extend([0.0] * 65),
     "65 values in fp32_contents for shape [1, 64] (expected 64)"),
    ("FP16", lambda c: c.fp32_contents.extend([0.0] * 64),
     "input 'x' (FP16): FP16 has no typed contents field, send it in raw_input_contents"),
])
def test_typed_contents_in_the_wrong_field_name_the_input_datatype_and_field(server, datatype, fill, message):
    """tritonserver names the tensor, the datatype the contents imply and the one expected ("unexpected explicit
    tensor data for input tensor 'x' … of type 'INT32', expected datatype 'FP32'"). dsedge said "0 values for shape
    [1, 64]" for data in the wrong field, and answered data in two fields from the right one, ignoring the other."""
    from tritonclient.grpc import service_pb2 as pb
    from tritonclient.grpc import service_pb2_grpc as pb_grpc

    req = pb.ModelInferRequest(model_name="mlp-cpu")
    fill(req.inputs.add(name="x", datatype=datatype, shape=[1, 64]).contents)
    with grpc.insecure_channel(server.grpc) as ch, pytest.raises(grpc.RpcError) as e:
        pb_grpc.GRPCInferenceServiceStub(ch).ModelInfer(req, metadata=tuple(GRPC_AUTH.items()))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in e.value.details(), e.value.details()


def test_max_connections_lets_that_many_in_and_max_queue_0_serves(tmp_path):
    """``--max-connections 1`` answered every HTTP request 503 (uvicorn counts the connection being served, so N let
    N - 1 in), and ``--max-queue 0`` (no waiting: the help's lower bound) failed after the listeners bound, with a
    hint naming a Python argument (a user's pass)."""
    proc = ServeProcess([mlp_bundle(tmp_path / "mlp-cpu.dse", tmp_path, "cpu")],
                        ["--max-connections", "2", "--max-queue", "0", "--threads", "1"], tmp_path / "serve.log")
    try:
        host, port = proc.http.rsplit(":", 1)

        def connect() -> http.client.HTTPConnection:
            return http.client.HTTPConnection(host, int(port), timeout=10)

        def status(c: http.client.HTTPConnection, method: str = "GET", path: str = "/v2/health/ready",
                   body: bytes | None = None) -> int:
            c.request(method, path, body=body, headers={"Content-Type": "application/json"} if body else {})
            r = c.getresponse()
            r.read()
            return r.status

        a, b, c = connect(), connect(), connect()
        assert status(a) == 200 and status(b) == 200  # two kept-alive connections: both in
        assert status(c) == 503  # a third: over the limit
        a.close()
        time.sleep(0.2)
        d = connect()
        body = json.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 64],
                                       "data": _x(1).ravel().tolist()}]}).encode()
        assert status(d, "POST", "/v2/models/mlp/infer", body) == 200  # --max-queue 0 serves what it admits
        for conn in (b, c, d):
            conn.close()
    finally:
        log = proc.log()
        code, _ = proc.terminate()
    assert code == 0, log[-2000:]



def test_a_client_that_sent_its_body_and_left_while_it_waited_counts_as_cancelled(tmp_path):
    """An HTTP client that sent its whole request and closed the connection while the call waited was answered
    into the closed socket and counted ``ok`` (a user's pass): the wait is cancelled, its place in the queue freed,
    and it is counted ``cancelled``, as a gRPC call is."""
    import asyncio
    import socket

    import uvicorn

    from dsedge.serve.http import build_app
    from dsedge.serve.metrics import ServeMetrics
    from dsedge.serve.models import Repository
    from dsedge.serve.server import ServerState

    metrics = ServeMetrics()
    repo = Repository([mlp_bundle(tmp_path / "mlp-cpu.dse", tmp_path, "cpu")], metrics, threads=1, max_inflight=1)
    repo.load()
    model = repo.get("mlp")
    body = json.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 64], "data": _x(1).ravel().tolist()}],
                       "parameters": {"budget_ms": 60000}}).encode()
    count = lambda outcome, reason="": metrics.registry.get_sample_value(  # noqa: E731
        "dsedge_requests_total", {"model": "mlp", "protocol": "http", "outcome": outcome, "reason": reason}) or 0.0

    async def main() -> tuple[int, int]:
        model.gate.inflight = model.gate.max_inflight  # every slot taken: the call waits in the gate
        app = build_app(repo, ServerState(), max_body=1 << 20, auth=None, server_metadata=lambda: {})
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        server = uvicorn.Server(uvicorn.Config(app, log_config=None, lifespan="off", access_log=False))
        serving = asyncio.ensure_future(server.serve(sockets=[sock]))
        while not server.started:
            await asyncio.sleep(0.01)
        host, port = sock.getsockname()
        _, writer = await asyncio.open_connection(host, port)
        writer.write(f"POST /v2/models/mlp/infer HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        await writer.drain()
        t0 = time.monotonic()
        while model.gate.waiting == 0 and time.monotonic() - t0 < 5:  # the whole body is in; the call waits
            await asyncio.sleep(0.01)
        waiting = model.gate.waiting
        writer.close()
        while count("rejected", "cancelled") == 0 and time.monotonic() - t0 < 5:
            await asyncio.sleep(0.01)
        server.should_exit = True
        await serving
        return waiting, model.gate.waiting

    try:
        waiting, after = asyncio.run(main())
    finally:
        repo.close(5.0)
    assert waiting == 1 and after == 0
    assert count("rejected", "cancelled") == 1.0 and count("ok") == 0.0


def test_a_call_to_a_model_still_loading_is_a_refusal_not_a_server_error():
    """Clients polling a starting server were counted ``error`` (as a backend failure) per call: ``not_ready`` is
    ``rejected``, like ``shutdown``; a backend failure stays ``error``."""
    from dsedge.serve.models import failure_outcome
    from dsedge.serve.protocol import ServeError

    assert failure_outcome(ServeError(503, "UNAVAILABLE", "model 'm' is still loading", "not_ready")) == "rejected"
    assert failure_outcome(ServeError(500, "INTERNAL", "the backend failed", "backend_error")) == "error"


@pytest.mark.parametrize("datatype, data, says", [
    ("INT64", [True, False], "true/false among the values of INT64"),  # was taken as 1, 0
    ("INT64", [101, True, 2001, 102], "true/false among"),             # one among numbers, too
    ("FP32", [True], "true/false among the values of FP32"),
    ("BOOL", [0, 1, 2], "numbers for BOOL"),                           # 2 was read as true
    ("INT64", [10 ** 30, 1], "an integer out of INT64's range"),       # was "not numbers"
    ("INT64", [2 ** 63, -1], "an integer out of INT64's range"),       # was "non-integer values"
    ("UINT64", [2 ** 63, -1], "an integer out of UINT64's range"),
    ("INT32", [2 ** 40], "out of INT32's range [-2147483648, 2147483647]"),  # was wrapped to 0, silently
    ("UINT8", [-1], "out of UINT8's range [0, 255]"),                  # was 255
    ("INT8", [300], "out of INT8's range"),                            # gRPC's int_contents for INT8 come here too
    ("FP16", [70000.0], "a value out of FP16's range (±65504)"),      # was inf, silently
    ("FP32", [1e300], "a value out of FP32's range"),
    ("FP32", [[0.1, 0.2], [0.1]], "nested lists of unequal lengths (ragged)"),  # was numpy's "setting an array…"
])
def test_json_and_typed_values_a_datatype_cannot_hold_are_refused_not_converted(datatype, data, says):
    from dsedge.serve.protocol import ServeError, from_list

    with pytest.raises(ServeError) as e:
        from_list("ids", datatype, [len(data)], data)
    assert e.value.status == 400 and says in e.value.message, e.value.message
    assert from_list("ids", "BOOL", [2], [True, False]).tolist() == [True, False]
    assert from_list("ids", "INT64", [2], [2 ** 62, -1]).tolist() == [2 ** 62, -1]
    assert from_list("ids", "FP32", [1], [10 ** 30]).tolist() == [pytest.approx(1e30, rel=1e-6)]  # FP32 holds it
    assert from_list("ids", "UINT64", [1], [2 ** 64 - 1]).tolist() == [2 ** 64 - 1]


def test_a_flat_list_of_the_wrong_count_is_refused_before_any_value_is_read(monkeypatch):
    """A user's pass: a 60 MB body of 31 M values for shape [1, 4] held the event loop (and /v2/health/live) for
    3.3 s, 2 s of it reading values a count alone refuses."""
    from dsedge.serve import protocol

    def never(data):
        raise AssertionError("values were read")

    monkeypatch.setattr(protocol, "_value_types", never)
    with pytest.raises(protocol.ServeError, match=r"1000000 values for shape \[1, 4\] \(expected 4\)"):
        protocol.from_list("input_ids", "INT64", [1, 4], [1] * 1_000_000)
