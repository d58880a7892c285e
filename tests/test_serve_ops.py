"""`dsedge serve` operations: TLS with a self-signed certificate made here, Triton priority on a queued backlog,
429/RESOURCE_EXHAUSTED on a full queue, 503 for a timeout that runs out while queued, and SIGTERM drain.

One real server for the module, without auth, with TLS, ``--max-inflight 1 --max-queue 6``: one request inside each
model's scheduler at a time, so a backlog forms behind a slow request (the ``slow`` model, ~15 ms per row).
"""
from __future__ import annotations

import asyncio
import datetime
import ipaddress
import socket
import ssl
import time

import numpy as np
import pytest

from serve_process import ServeProcess, mlp_bundle, slow_bundle

httpclient = pytest.importorskip("tritonclient.http")
grpcclient = pytest.importorskip("tritonclient.grpc")
import tritonclient.grpc.aio as grpcaio  # noqa: E402
import tritonclient.http.aio as httpaio  # noqa: E402
from tritonclient.utils import InferenceServerException  # noqa: E402

QUEUE = 6
DIM = 384


def _self_signed(tmp) -> tuple[str, str]:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                        x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), True)
            .sign(key, hashes.SHA256()))
    cert_path, key_path = tmp / "cert.pem", tmp / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return str(cert_path), str(key_path)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve-ops")
    cert, key = _self_signed(tmp)
    proc = ServeProcess([mlp_bundle(tmp / "mlp-cpu.dse", tmp), slow_bundle(tmp / "slow-cpu.dse", tmp, DIM, 10)],
                        ["--tls-cert", cert, "--tls-key", key, "--max-inflight", "1", "--max-queue", str(QUEUE),
                         "--drain-timeout", "10", "--threads", "1"], tmp / "serve.log")
    proc.cert = cert
    yield proc
    if proc.proc.poll() is None:
        proc.terminate()


def _ctx(server) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=server.cert)


def _x(rows: int, dim: int = DIM) -> np.ndarray:
    return np.random.default_rng(rows).random((rows, dim), dtype=np.float32)


def _ginput(x: np.ndarray) -> "grpcclient.InferInput":
    i = grpcclient.InferInput("x", list(x.shape), "FP32")
    i.set_data_from_numpy(x)
    return i


def _hinput(x: np.ndarray) -> "httpclient.InferInput":
    i = httpclient.InferInput("x", list(x.shape), "FP32")
    i.set_data_from_numpy(x, binary_data=True)
    return i


def test_tls_on_http_and_grpc(server):
    import gevent.ssl

    c = httpclient.InferenceServerClient(
        server.http, ssl=True, ssl_context_factory=lambda *a, **k: gevent.ssl.create_default_context(cafile=server.cert))
    x = _x(2, 64)
    r = c.infer("mlp", [_hinput(x)])
    assert r.as_numpy("logits").shape == (2, 4)
    g = grpcclient.InferenceServerClient(server.grpc, ssl=True, root_certificates=server.cert)
    assert g.is_server_ready()
    np.testing.assert_allclose(g.infer("mlp", [_ginput(x)]).as_numpy("logits"), r.as_numpy("logits"), rtol=1e-6)
    with pytest.raises(Exception):  # plain HTTP to the TLS port
        httpclient.InferenceServerClient(server.http, connection_timeout=5, network_timeout=5).is_server_live()


async def _blocker(client, model: str = "slow") -> asyncio.Task:
    """A 16-row request on ``model`` (~0.1–0.3 s here) that holds its only slot; returns once it is running."""
    task = asyncio.ensure_future(client.infer(model, [_ginput(_x(16))], parameters={"budget_ms": 60_000}))
    await asyncio.sleep(0.05)
    return task


def test_triton_priority_orders_a_queued_backlog(server):
    async def go() -> list[int]:
        c = grpcaio.InferenceServerClient(server.grpc, ssl=True, root_certificates=server.cert)
        done: list[int] = []

        async def one(priority: int) -> None:
            await c.infer("slow", [_ginput(_x(1))], priority=priority, parameters={"budget_ms": 60_000})
            done.append(priority)

        try:
            blocker = await _blocker(c)
            tasks = []
            for p in (3, 3, 0, 0, 1, 1):  # arrival order: low, default, high
                tasks.append(asyncio.ensure_future(one(p)))
                await asyncio.sleep(0.002)
            await asyncio.gather(blocker, *tasks)
        finally:
            await c.close()
        return done

    # Triton: 1 is the highest level, 0 the default (here level 2), 3 the lowest
    assert asyncio.run(go()) == [1, 1, 0, 0, 3, 3]


def test_full_queue_is_429_and_resource_exhausted(server):
    async def go() -> tuple[list, list]:
        h = httpaio.InferenceServerClient(server.http, ssl=True, ssl_context=_ctx(server))
        g = grpcaio.InferenceServerClient(server.grpc, ssl=True, root_certificates=server.cert)
        try:
            outcomes = []
            for client in (h, g):
                blocker = await _blocker(g)
                results = await asyncio.gather(*(client.infer("slow", [(_hinput if client is h else _ginput)(_x(1))],
                                                              parameters={"budget_ms": 60_000})
                                                 for _ in range(QUEUE + 4)), return_exceptions=True)
                await blocker
                outcomes.append([r.status() if isinstance(r, InferenceServerException) else "ok" for r in results])
                assert all(r.message().startswith("overload:") for r in results
                           if isinstance(r, InferenceServerException))
        finally:
            await h.close()
            await g.close()
        return outcomes

    http_out, grpc_out = asyncio.run(go())
    assert set(http_out) == {"ok", "429"} and http_out.count("ok") >= QUEUE
    assert set(grpc_out) == {"ok", "StatusCode.RESOURCE_EXHAUSTED"} and grpc_out.count("ok") >= QUEUE


def test_timeout_running_out_in_the_queue_is_503(server):
    async def go() -> InferenceServerException:
        g = grpcaio.InferenceServerClient(server.grpc, ssl=True, root_certificates=server.cert)
        h = httpaio.InferenceServerClient(server.http, ssl=True, ssl_context=_ctx(server))
        try:
            blocker = await _blocker(g)
            with pytest.raises(InferenceServerException) as e:
                await h.infer("slow", [_hinput(_x(1))], timeout=20_000)  # 20 ms, behind a ≥ 100 ms request
            await blocker
        finally:
            await g.close()
            await h.close()
        return e.value

    err = asyncio.run(go())
    assert err.status() == "503" and err.message().startswith("deadline:")


def test_sigterm_drains_every_request_exactly_once(server):
    async def go() -> list[str]:
        g = grpcaio.InferenceServerClient(server.grpc, ssl=True, root_certificates=server.cert)
        h = httpaio.InferenceServerClient(server.http, ssl=True, ssl_context=_ctx(server))

        async def one(client, model: str, rows: int) -> str:
            make = _ginput if client is g else _hinput
            try:
                await client.infer(model, [make(_x(rows, DIM if model == "slow" else 64))],
                                   parameters={"budget_ms": 60_000})
                return "ok"
            except InferenceServerException as e:
                return f"{e.status()} {e.message().split(':')[0]}"

        try:
            tasks = [asyncio.ensure_future(one(g, "slow", 16))]
            await asyncio.sleep(0.05)
            tasks += [asyncio.ensure_future(one(c, "slow", rows)) for c, rows in ((h, 16), (g, 1), (h, 1), (g, 1))]
            tasks += [asyncio.ensure_future(one(c, "mlp", 4)) for c in (g, h)]
            await asyncio.sleep(0.02)
            server.proc.send_signal(15)
            return await asyncio.wait_for(asyncio.gather(*tasks), 30)
        finally:
            await g.close()
            await h.close()

    t0 = time.perf_counter()
    outcomes = asyncio.run(go())
    code = server.proc.wait(30)
    assert code == 0 and time.perf_counter() - t0 < 20
    assert outcomes[0] == "ok"  # running when SIGTERM came: answered; those queued behind it: rejected
    allowed = {"ok", "503 shutdown", "StatusCode.UNAVAILABLE shutdown"}
    assert set(outcomes) <= allowed, outcomes
    assert "503 shutdown" in outcomes[1:5] or "StatusCode.UNAVAILABLE shutdown" in outcomes[1:5], outcomes
    assert "unanswered=0" in server.log()


def _stalled_body(addr: str) -> socket.socket:
    """An HTTP infer request that announces 100 000 bytes and sends 11, then waits."""
    host, port = addr.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=30)
    sock.sendall(b"POST /v2/models/mlp/infer HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 100000\r\n\r\n{\"inputs\":")
    return sock


def test_a_stalled_body_times_out_and_does_not_hold_shutdown(tmp_path):
    bundle = mlp_bundle(tmp_path / "mlp.dse", tmp_path)
    proc = ServeProcess([bundle], ["--body-timeout", "0.5", "--threads", "1"], tmp_path / "serve.log")
    try:
        sock = _stalled_body(proc.http)
        t0 = time.monotonic()
        reply = b""
        while b"}" not in reply:  # headers and the JSON body may come in separate packets
            chunk = sock.recv(4096)
            if not chunk:
                break
            reply += chunk
        reply = reply.decode(errors="replace")
        assert reply.startswith("HTTP/1.1 408") and "request body not complete within 0.5 s" in reply, reply
        assert time.monotonic() - t0 < 10
        sock.close()
    finally:
        proc.terminate()
    proc = ServeProcess([bundle], ["--threads", "1"], tmp_path / "serve2.log")  # the default 30 s body timeout
    sock = _stalled_body(proc.http)
    try:
        time.sleep(0.5)
        code, took = proc.terminate()
        log = proc.log_path.read_text()
        assert code == 0 and took < 15, log[-2000:]  # not held until the client leaves
    finally:
        sock.close()
    assert "Traceback" not in log and "ClientDisconnect" not in log, log[-2000:]


def test_a_stalled_request_head_closes_its_connection_and_frees_its_slot(tmp_path):
    """A user's pass (slowloris): 20 sockets that sent half a request head and stopped kept a --max-connections 20
    server answering every real request 503 for as long as they stayed open; uvicorn times only the idle gap after
    a response. The head now has --body-timeout too, from the connection's opening (sdk/serve/head_timeout.py)."""
    import json
    import urllib.error
    import urllib.request

    bundle = mlp_bundle(tmp_path / "mlp.dse", tmp_path)
    proc = ServeProcess([bundle], ["--max-connections", "3", "--body-timeout", "1", "--threads", "1"],
                        tmp_path / "serve.log")
    body = json.dumps({"inputs": [{"name": "x", "shape": [1, 64], "datatype": "FP32", "data": [0.5] * 64}]}).encode()

    def infer() -> int:
        req = urllib.request.Request(f"http://{proc.http}/v2/models/mlp/infer", data=body,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=10) as r:
                return r.status
        except urllib.error.HTTPError as e:
            return e.code

    try:
        host, port = proc.http.rsplit(":", 1)
        stalled = []
        for i in range(3):
            sock = socket.create_connection((host, int(port)), timeout=30)
            if i:  # one sends nothing at all; two send half a head
                sock.sendall(b"POST /v2/models/mlp/infer HTTP/1.1\r\nHost: x\r\n")
            stalled.append(sock)
        time.sleep(0.3)
        assert infer() == 503  # every slot is held
        t0 = time.monotonic()
        for sock in stalled:
            assert sock.recv(100) == b""  # closed by the server
        assert 0.5 < time.monotonic() - t0 < 8
        assert infer() == 200
    finally:
        for sock in stalled:
            sock.close()
        proc.terminate()


def test_one_client_cannot_take_every_connection_slot(tmp_path):
    """--max-connections-per-client 2: a third connection from 127.0.0.1 is answered 503 (readable, not a reset)
    while a client at 127.0.0.2 is served, and the count falls when one of the first two closes."""
    import http.client
    import json

    bundle = mlp_bundle(tmp_path / "mlp.dse", tmp_path)
    proc = ServeProcess([bundle], ["--max-connections-per-client", "2", "--max-connections", "10", "--threads", "1"],
                        tmp_path / "serve.log")
    host, port = proc.http.rsplit(":", 1)
    body = json.dumps({"inputs": [{"name": "x", "shape": [1, 64], "datatype": "FP32", "data": [0.5] * 64}]})

    def infer(source: str) -> tuple[int, str, str]:
        conn = http.client.HTTPConnection(host, int(port), timeout=10, source_address=(source, 0))
        try:
            conn.request("POST", "/v2/models/mlp/infer", body=body, headers={"Content-Type": "application/json"})
            r = conn.getresponse()
            return r.status, r.read().decode(), r.getheader("connection") or ""
        finally:
            conn.close()

    held = [socket.create_connection((host, int(port)), timeout=10, source_address=("127.0.0.1", 0))
            for _ in range(2)]
    try:
        time.sleep(0.2)
        status, text, connection = infer("127.0.0.1")
        assert (status, connection) == (503, "close")
        assert json.loads(text) == {"reason": "too_many_connections", "error": "too_many_connections: this client "
                                    "address already holds 2 open connections (--max-connections-per-client 2)"}
        client = httpclient.InferenceServerClient(proc.http)  # what tritonclient users see: the error text
        with pytest.raises(InferenceServerException, match="too_many_connections: this client address"):
            client.infer("mlp", [httpclient.InferInput("x", [1, 64], "FP32").set_data_from_numpy(
                np.full((1, 64), 0.5, np.float32))])
        client.close()
        status, text, _ = infer("127.0.0.2")  # another address is served
        assert status == 200 and json.loads(text)["outputs"][0]["shape"] == [1, 4]
        held.pop().close()
        time.sleep(0.2)
        assert infer("127.0.0.1")[0] == 200  # one slot of 127.0.0.1's is free again
        import re
        import urllib.request

        with urllib.request.urlopen(f"http://{proc.metrics}/metrics", timeout=10) as r:
            text = r.read().decode()
        counted = [ln for ln in text.splitlines() if ln.startswith("dsedge_requests_total{")
                   and 'reason="too_many_connections"' in ln]
        assert len(counted) == 1 and 'outcome="rejected"' in counted[0] and 'protocol="http"' in counted[0]
        assert re.search(r"} 2\.0$", counted[0]), counted  # both refusals above: http.client's and tritonclient's
    finally:
        for sock in held:
            sock.close()
        proc.terminate()
    log = proc.log_path.read_text()
    assert log.count("refused a connection from 127.0.0.1") == 1 and "Traceback" not in log, log[-2000:]
