"""`dsedge serve` answers what Triton's tools (perf_analyzer, model_analyzer) ask before and after a run: the model
configuration, the repository index and the inference statistics, over HTTP and gRPC with tritonclient's own calls.

One real server for the module serving the tiny MLP (x[batch, 64] FP32 → logits[batch, 4]) twice, as ``mlp`` (the
HTTP tests infer on it) and ``mlpg`` (the gRPC ones), so each protocol's statistics start from zero.
"""
from __future__ import annotations

import json
import types
import urllib.error
import urllib.request

import numpy as np
import pytest

from serve_process import ServeProcess, mlp_bundle

httpclient = pytest.importorskip("tritonclient.http")
grpcclient = pytest.importorskip("tritonclient.grpc")
from tritonclient.utils import InferenceServerException  # noqa: E402

N = 5


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve-triton-tools")
    bundle = mlp_bundle(tmp / "mlp-cpu.dse", tmp)
    proc = ServeProcess([f"mlp={bundle}", f"mlpg={bundle}"], ["--threads", "1"], tmp / "serve.log")
    yield proc
    if proc.proc.poll() is None:
        proc.terminate()


@pytest.fixture(scope="module")
def clients(server):
    """tritonclient's HTTP (``.http``) and gRPC (``.grpc``) clients of the module's server."""
    from types import SimpleNamespace

    return SimpleNamespace(http=httpclient.InferenceServerClient(server.http),
                           grpc=grpcclient.InferenceServerClient(server.grpc))


def _x(rows: int) -> np.ndarray:
    return np.random.default_rng(rows).random((rows, 64), dtype=np.float32)


def test_model_config_http(clients):
    for version in ("", "1"):
        cfg = clients.http.get_model_config("mlp", version)
        assert cfg["name"] == "mlp" and cfg["backend"] == "dsedge"
        assert cfg["max_batch_size"] == 32  # the bundle's batch range max
        assert cfg["input"] == [{"name": "x", "data_type": "TYPE_FP32", "dims": [64]}]
        assert cfg["output"] == [{"name": "logits", "data_type": "TYPE_FP32", "dims": [4]}]
        assert cfg["dynamic_batching"] == {}
        assert cfg["parameters"]["dsedge_budget_ms"]["string_value"] == "250"
    with pytest.raises(InferenceServerException, match="unknown model"):
        clients.http.get_model_config("nope")
    with pytest.raises(InferenceServerException, match="no version"):
        clients.http.get_model_config("mlp", "2")


def test_model_config_grpc(clients):
    cfg = clients.grpc.get_model_config("mlpg").config
    assert cfg.name == "mlpg" and cfg.backend == "dsedge" and cfg.max_batch_size == 32
    assert [(i.name, i.data_type, list(i.dims)) for i in cfg.input] == [("x", 11, [64])]  # 11: TYPE_FP32
    assert [(o.name, o.data_type, list(o.dims)) for o in cfg.output] == [("logits", 11, [4])]
    assert cfg.HasField("dynamic_batching")
    with pytest.raises(InferenceServerException, match="unknown model"):
        clients.grpc.get_model_config("nope")


def test_model_config_without_a_batch_axis():
    from dsedge.runtime.bundle import IOSpec
    from dsedge.serve.model_config import model_config

    s = types.SimpleNamespace(inputs=[IOSpec("ids", "int64", (1, "sequence"))],
                              outputs=[IOSpec("y", "float16", (1, "sequence", 8))],
                              manifest=types.SimpleNamespace(shape_ranges={}, target={}))
    cfg = model_config("m", s, "dsedge_onnxruntime", 50.0)
    assert cfg["max_batch_size"] == 0 and "dynamic_batching" not in cfg
    assert cfg["input"] == [{"name": "ids", "data_type": "TYPE_INT64", "dims": [1, -1]}]
    assert cfg["output"] == [{"name": "y", "data_type": "TYPE_FP16", "dims": [1, -1, 8]}]


def test_repository_index(server, clients):
    assert clients.http.get_model_repository_index() == [{"name": "mlp", "version": "1", "state": "READY"},
                                                   {"name": "mlpg", "version": "1", "state": "READY"}]
    index = clients.grpc.get_model_repository_index().models
    assert [(m.name, m.version, m.state) for m in index] == [("mlp", "1", "READY"), ("mlpg", "1", "READY")]

    def post(body: bytes) -> tuple[int, object]:
        req = urllib.request.Request(f"http://{server.http}/v2/repository/index", body, method="POST")
        try:
            with urllib.request.urlopen(req) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    code, ready = post(b'{"ready": true}')
    assert code == 200 and [m["name"] for m in ready] == ["mlp", "mlpg"]
    code, err = post(b'{"ready": "yes"}')
    assert code == 400 and "'ready' a boolean" in err["error"]


def _check(stats: dict, name: str, rows: int, requests: int, fails: int) -> None:
    (s,) = stats["model_stats"]
    assert s["name"] == name and s["version"] == "1"
    assert int(s["inference_count"]) == rows
    inf = s["inference_stats"]
    assert int(inf["success"]["count"]) == requests and int(inf["success"]["ns"]) > 0
    assert int(inf["compute_infer"]["count"]) == requests and int(inf["compute_infer"]["ns"]) > 0
    assert 0 < int(inf["compute_infer"]["ns"]) <= int(inf["success"]["ns"])
    assert int(inf["queue"]["count"]) == requests
    assert int(inf.get("fail", {}).get("count", 0)) == fails
    assert 1 <= int(s["execution_count"]) <= requests
    assert int(s["last_inference"]) > 1.7e12  # ms since the epoch


def test_statistics_http(server, clients):
    before = clients.http.get_inference_statistics("mlp")["model_stats"][0]
    assert before["inference_count"] == 0 and before["inference_stats"]["success"] == {"count": 0, "ns": 0}
    for i in range(N):
        x = _x(1)
        inp = httpclient.InferInput("x", list(x.shape), "FP32")
        inp.set_data_from_numpy(x)
        clients.http.infer("mlp", [inp])
    bad = httpclient.InferInput("x", [1, 3], "FP32")
    bad.set_data_from_numpy(np.zeros((1, 3), np.float32))
    with pytest.raises(InferenceServerException):
        clients.http.infer("mlp", [bad])
    _check(clients.http.get_inference_statistics("mlp"), "mlp", N, N, 1)
    _check(clients.http.get_inference_statistics("mlp", "1"), "mlp", N, N, 1)
    # every model, and the route is not taken for a model named "stats"
    with urllib.request.urlopen(f"http://{server.http}/v2/models/stats") as r:
        every = json.loads(r.read())
    assert [s["name"] for s in every["model_stats"]] == ["mlp", "mlpg"]
    with pytest.raises(InferenceServerException, match="unknown model"):
        clients.http.get_inference_statistics("nope")


def test_statistics_grpc(clients):
    assert clients.grpc.get_inference_statistics("mlpg").model_stats[0].inference_count == 0
    for rows in (1, 3):
        for _ in range(N):
            x = _x(rows)
            inp = grpcclient.InferInput("x", list(x.shape), "FP32")
            inp.set_data_from_numpy(x)
            clients.grpc.infer("mlpg", [inp])
    _check(clients.grpc.get_inference_statistics("mlpg", as_json=True), "mlpg", 4 * N, 2 * N, 0)
    every = clients.grpc.get_inference_statistics().model_stats
    assert [s.name for s in every] == ["mlp", "mlpg"]
    with pytest.raises(InferenceServerException, match="unknown model"):
        clients.grpc.get_inference_statistics("nope")
