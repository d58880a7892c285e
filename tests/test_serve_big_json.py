"""`dsedge serve`: an answer sent as JSON text (the v2 default, what curl and plain clients get) is encoded without
holding the server's event loop (a user's pass, 2026-12-06: one 32 × 256-token MiniLM answer of 64 MB froze it for
2-2.5 s, and accepted small requests came back up to 2.4 s late)."""
from __future__ import annotations

import http.client
import json
import threading
import time

import numpy as np
import pytest

import dsedge
from serve_process import ServeProcess
from streaming_models import text_bundle

from dsedge.serve.http import json_data


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bigjson")
    bundle = text_bundle(tmp / "toy-text-cpu.dse", dim=768, max_batch=32)
    proc = ServeProcess([bundle], ["--threads", "1"], tmp / "serve.log")
    proc.bundle = bundle
    yield proc
    code, _ = proc.terminate()
    assert code == 0


def _post(addr: str, path: str, body: dict, timeout: float = 60.0) -> tuple[int, bytes, float]:
    host, port = addr.rsplit(":", 1)
    c = http.client.HTTPConnection(host, int(port), timeout=timeout)
    t0 = time.perf_counter()
    c.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    r = c.getresponse()
    data = r.read()
    c.close()
    return r.status, data, time.perf_counter() - t0


def _get_ms(addr: str, path: str) -> float:
    host, port = addr.rsplit(":", 1)
    c = http.client.HTTPConnection(host, int(port), timeout=60)
    t0 = time.perf_counter()
    c.request("GET", path)
    c.getresponse().read()
    c.close()
    return (time.perf_counter() - t0) * 1e3


def test_json_data_round_trips_every_dtype_and_keeps_nan():
    for a in (np.random.default_rng(0).standard_normal((3, 5)).astype(np.float32), np.arange(7, dtype=np.int64),
              np.array([True, False]), np.array([1.5, np.nan, -np.inf], np.float32), np.zeros((0, 4), np.float32),
              np.array([1.25, -2.5], np.float16), np.array(3.5, np.float64), np.arange(5, dtype=np.uint8)):
        got = json.loads(json_data(a))
        assert np.array_equal(np.asarray(got, a.dtype), a.reshape(-1), equal_nan=a.dtype.kind == "f"), a
    assert json_data(np.array([np.nan, np.inf], np.float32)) == b"[NaN,Infinity]"  # as json.dumps wrote (not null)
    big = np.random.default_rng(1).standard_normal(200_000).astype(np.float32)  # several chunks
    assert np.array_equal(np.asarray(json.loads(json_data(big)), np.float32), big)


def test_a_large_json_answer_does_not_hold_the_event_loop(server):
    """While a 32 x 128-token request's 3.1 M-float JSON answer is computed and encoded, the server still answers
    /v2/health/live at once; the answer equals Session.run's."""
    rng = np.random.default_rng(0)
    ids = rng.integers(1, 100, size=(32, 128)).astype(np.int64)
    body = {"inputs": [{"name": "input_ids", "datatype": "INT64", "shape": [32, 128], "data": ids.ravel().tolist()},
                       {"name": "attention_mask", "datatype": "INT64", "shape": [32, 128],
                        "data": [1] * ids.size}],
            "parameters": {"budget_ms": 60_000}}
    name = "toy-text"
    got: dict = {}

    def big() -> None:
        got["status"], got["data"], got["s"] = _post(server.http, f"/v2/models/{name}/infer", body)

    _get_ms(server.http, "/v2/health/live")  # connected once
    worker = threading.Thread(target=big)
    worker.start()
    live = []
    while worker.is_alive():
        live.append(_get_ms(server.http, "/v2/health/live"))
        time.sleep(0.005)
    worker.join()
    assert got["status"] == 200, got["data"][:300]
    answer = json.loads(got["data"])
    out = {o["name"]: np.asarray(o["data"], np.float32).reshape(o["shape"]) for o in answer["outputs"]}
    assert out["last_hidden_state"].shape == (32, 128, 768)
    with dsedge.load(server.bundle) as s:
        ref = s.run({"input_ids": ids, "attention_mask": np.ones_like(ids)})
    np.testing.assert_allclose(out["last_hidden_state"], ref["last_hidden_state"], rtol=1e-5, atol=1e-5)
    # encoded on the loop, the whole answer's tolist + json.dumps (about 2 s here) held every other request
    print(f"big answer {got['s']:.2f} s; /v2/health/live during it: {len(live)} calls, max {max(live):.1f} ms")
    assert max(live) < max(0.4 * got["s"] * 1e3, 250.0), (max(live), got["s"])
