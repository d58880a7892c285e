"""Open-loop load on a real `dsedge serve` over loopback through tritonclient's asyncio HTTP client, at 0.5×, 1.5×
and 3× the capacity measured first: every request ends in an answer or a 429/503, the server's own counters agree
with the client's, and its memory stays bounded. Bounded in time (~8 s); figures are noisy on a shared machine."""
from __future__ import annotations

import asyncio
import time
import urllib.request

import numpy as np
import pytest

from serve_process import ServeProcess, mlp_bundle

httpclient = pytest.importorskip("tritonclient.http")
import tritonclient.http.aio as httpaio  # noqa: E402
from tritonclient.utils import InferenceServerException  # noqa: E402

BUDGET_MS = 50.0


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve-load")
    proc = ServeProcess([mlp_bundle(tmp / "mlp-cpu.dse", tmp)], ["--threads", "1", "--max-queue", "256"],
                        tmp / "serve.log")
    yield proc
    assert proc.terminate()[0] == 0


def _input() -> "httpclient.InferInput":
    i = httpclient.InferInput("x", [1, 64], "FP32")
    i.set_data_from_numpy(np.ones((1, 64), np.float32), binary_data=True)
    return i


async def _one(c, outcomes: list) -> None:
    t0 = time.perf_counter()
    try:
        await c.infer("mlp", [_input()], parameters={"budget_ms": BUDGET_MS})
        outcomes.append("ok" if (time.perf_counter() - t0) * 1e3 <= BUDGET_MS else "late")
    except InferenceServerException as e:
        outcomes.append(e.status())


async def _capacity(url: str, seconds: float = 1.0, concurrency: int = 8) -> float:
    c = httpaio.InferenceServerClient(url)
    n, t_end = 0, time.perf_counter() + seconds

    async def worker() -> None:
        nonlocal n
        while time.perf_counter() < t_end:
            await c.infer("mlp", [_input()], parameters={"budget_ms": 10_000})
            n += 1

    try:
        await asyncio.gather(*(worker() for _ in range(concurrency)))
    finally:
        await c.close()
    return n / seconds


async def _open_loop(url: str, rate: float, seconds: float, seed: int) -> list:
    """Poisson arrivals at ``rate``/s for ``seconds``; each request fired on schedule, never waiting for others."""
    c = httpaio.InferenceServerClient(url, conn_limit=256)
    rng = np.random.default_rng(seed)
    outcomes: list = []
    tasks = []
    t, t0 = 0.0, time.perf_counter()
    try:
        while t < seconds:
            t += rng.exponential(1.0 / rate)
            delay = t0 + t - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.ensure_future(_one(c, outcomes)))
        await asyncio.wait_for(asyncio.gather(*tasks), 60)
    finally:
        await c.close()
    assert len(outcomes) == len(tasks)
    return outcomes


def _server_total(server) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"http://{server.metrics}/metrics", timeout=10).read().decode()
    return sum(s.value for f in text_string_to_metric_families(text) if f.name == "dsedge_requests"
               for s in f.samples if s.name == "dsedge_requests_total")


def test_open_loop_every_request_answered_or_rejected(server):
    cap = asyncio.run(_capacity(server.http))
    assert cap > 10, cap
    rss0, total0 = server.rss_mb(), _server_total(server)
    sent = 0
    report = {}
    for i, mult in enumerate((0.5, 1.5, 3.0)):
        outcomes = asyncio.run(_open_loop(server.http, mult * cap, 1.5, seed=i))
        sent += len(outcomes)
        kinds = {o: outcomes.count(o) for o in set(outcomes)}
        report[mult] = kinds
        assert set(kinds) <= {"ok", "late", "429", "503"}, kinds  # nothing else: no lost or failed request
    total = _server_total(server) - total0
    assert total == sent, (total, sent, report)  # the server ended each request exactly once, as the client saw
    assert server.rss_mb() - rss0 < 100, (rss0, server.rss_mb())
    assert httpclient.InferenceServerClient(server.http).is_server_ready()
    print(f"capacity {cap:.0f}/s; outcomes by load multiple: {report}")
