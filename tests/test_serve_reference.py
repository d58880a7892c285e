"""`dsedge serve` on the real reference bundle (all-MiniLM-L6-v2 for Jetson, run on this CPU): v2 metadata from the
manifest, and answers over HTTP (binary and JSON) and gRPC (asyncio) equal to ``Session.run`` on the same input."""
from __future__ import annotations

import asyncio

import numpy as np
import pytest

import dsedge
from serve_process import ServeProcess

httpclient = pytest.importorskip("tritonclient.http")
grpcclient = pytest.importorskip("tritonclient.grpc")
import tritonclient.grpc.aio as grpcaio  # noqa: E402

NAMES = ("input_ids", "attention_mask", "token_type_ids")


@pytest.fixture(scope="module")
def bundle(reference_build):
    return reference_build.bundle


@pytest.fixture(scope="module")
def server(bundle, tmp_path_factory):
    proc = ServeProcess([bundle], ["--threads", "1"], tmp_path_factory.mktemp("serve-ref") / "serve.log")
    yield proc
    assert proc.terminate()[0] == 0


@pytest.fixture(scope="module")
def reference(bundle):
    s = dsedge.load(bundle, threads=1)
    yield s
    s.close()


def _feed(rows: int, seq: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    ids = rng.integers(1000, 30000, (rows, seq), dtype=np.int64)
    ids[:, 0], ids[:, -1] = 101, 102  # [CLS] … [SEP]
    return {"input_ids": ids, "attention_mask": np.ones((rows, seq), np.int64),
            "token_type_ids": np.zeros((rows, seq), np.int64)}


def test_metadata_comes_from_the_manifest(server, reference):
    c = httpclient.InferenceServerClient(server.http)
    name = reference.manifest.name
    assert server.addrs["models"] == name
    m = c.get_model_metadata(name)
    assert m["inputs"] == [{"name": n, "datatype": "INT64", "shape": [-1, -1]} for n in NAMES]
    assert m["outputs"] == [{"name": "last_hidden_state", "datatype": "FP32", "shape": [-1, -1, 384]},
                            {"name": "sentence_embedding", "datatype": "FP32", "shape": [-1, 384]}]


@pytest.mark.parametrize("binary", [True, False])
def test_http_answers_equal_session_run(server, reference, binary):
    c = httpclient.InferenceServerClient(server.http, network_timeout=120)
    feed = _feed(2, 12, seed=1)
    want = reference.run(feed)
    inputs = []
    for n in NAMES:
        i = httpclient.InferInput(n, list(feed[n].shape), "INT64")
        i.set_data_from_numpy(feed[n], binary_data=binary)
        inputs.append(i)
    r = c.infer(reference.manifest.name, inputs, parameters={"budget_ms": 60_000},
                outputs=[httpclient.InferRequestedOutput("sentence_embedding", binary_data=binary)])
    resp = r.get_response()
    assert [o["name"] for o in resp["outputs"]] == ["sentence_embedding"]  # the subset asked for
    assert resp["parameters"]["variant"] == reference.variant.name
    np.testing.assert_allclose(r.as_numpy("sentence_embedding"), want["sentence_embedding"], rtol=1e-4, atol=1e-5)


def test_grpc_asyncio_answers_equal_session_run(server, reference):
    feed = _feed(1, 20, seed=2)
    want = reference.run(feed)

    async def go():
        c = grpcaio.InferenceServerClient(server.grpc)
        try:
            inputs = []
            for n in NAMES:
                i = grpcclient.InferInput(n, list(feed[n].shape), "INT64")
                i.set_data_from_numpy(feed[n])
                inputs.append(i)
            return await c.infer(reference.manifest.name, inputs, parameters={"budget_ms": 60_000})
        finally:
            await c.close()

    r = asyncio.run(go())
    for out in ("last_hidden_state", "sentence_embedding"):
        np.testing.assert_allclose(r.as_numpy(out), want[out], rtol=1e-4, atol=1e-5)
    assert r.get_response(as_json=True)["parameters"]["budget_source"]["string_param"] == "budget_ms"
