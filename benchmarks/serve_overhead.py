"""Protocol overhead of ``dsedge serve`` vs ``Session.submit`` in-process, and goodput within budget at 1.5× load over
the network, side by side in one run.

1. Round trip of one small request (batch 1), closed loop, one at a time: in-process ``Session.submit(...).result()``,
   tritonclient HTTP (binary tensors) and tritonclient gRPC against a real ``dsedge serve`` subprocess on loopback.
   The three paths alternate in short blocks so machine noise hits them alike; p50/p99 per path and the overhead.
2. Open-loop Poisson arrivals at 1.5× capacity for ``--seconds`` on each path: goodput = answers whose client-side
   round trip is within the budget, per second, and the share of requests that got one. Capacity (``--capacity``):
   the model's batch-1 capacity in-process (1000 / mean round trip of part 1), so every path gets the same offered
   load (default); or each path's closed-loop answers within budget per second.

Client and server share this machine's cores: on a small CPU the client's own work is part of the figure.

    python benchmarks/serve_overhead.py --bundle out/all-minilm-l6-v2-cpu.dse --seq-len 16 --threads 1 --budget-ms 50
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import subprocess
import sys
import threading
import time

import numpy as np


def simd_flags() -> str:
    try:
        flags = next(line for line in open("/proc/cpuinfo") if line.startswith("flags")).split()
    except (OSError, StopIteration):
        return "unknown"
    return " ".join(f"{f}{'+' if f in flags else '-'}" for f in ["avx2", "fma", "avx512f", "avx512_vnni", "avx_vnni"])


def start_server(bundle: str, threads: int | None, extra: list[str]) -> tuple[subprocess.Popen, dict[str, str]]:
    cmd = [sys.executable, "-m", "dsedge", "serve", bundle, "--http-port", "0", "--grpc-port", "0",
           "--metrics-port", "off", "--log-level", "warning", "--max-queue", "4096"]
    if threads:
        cmd += ["--threads", str(threads)]
    cmd += extra
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    for raw in proc.stdout:  # type: ignore[union-attr]
        m = re.search(r"dsedge serve ready (.*)", raw.decode())
        if m:
            threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()  # type: ignore
            return proc, dict(kv.split("=", 1) for kv in m.group(1).split())
    raise SystemExit(f"dsedge serve exited with {proc.wait()} before it was ready")


def pct(a: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(a), q)) if a else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bundle", required=True)
    ap.add_argument("--seq-len", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1, help="ORT intra-op threads (server and in-process alike)")
    ap.add_argument("--budget-ms", type=float, default=50.0)
    ap.add_argument("--rounds", type=int, default=20, help="alternating blocks per path")
    ap.add_argument("--block", type=int, default=10, help="requests per block")
    ap.add_argument("--concurrency", type=int, default=16, help="in flight while measuring capacity")
    ap.add_argument("--seconds", type=float, default=5.0, help="length of each open-loop run")
    ap.add_argument("--server-args", default="", help="extra `dsedge serve` options, e.g. '--http-impl h11'")
    ap.add_argument("--load-paths", default="in-process,HTTP,gRPC", help="which paths to load in part 2")
    ap.add_argument("--capacity", choices=["batch1", "closed-loop"], default="batch1",
                    help="what 1× load is: the model's batch-1 capacity in-process (same rate on every path), or "
                         "each path's closed-loop answers within budget per second")
    ap.add_argument("--fresh", action="store_true",
                    help="a new session / server before each path of part 2 (no state carried over between paths)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    proc, addrs = start_server(args.bundle, args.threads, args.server_args.split())
    box = {"proc": proc}
    try:
        run(args, box, addrs)
    finally:
        if box["proc"].poll() is None:
            box["proc"].terminate()
            box["proc"].wait(30)


def run(args, box, addrs) -> None:
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient

    import dsedge
    from dsedge.runtime.bench import manifest_vocab_size, synthetic_inputs
    from dsedge.serve.protocol import v2_datatype

    sess = dsedge.load(args.bundle, threads=args.threads)
    sess.warmup()
    name = addrs["models"]
    feed = synthetic_inputs(sess.inputs, sess.manifest.shape_ranges, 1, args.seq_len,
                            manifest_vocab_size(sess.manifest))
    outs = [o.name for o in sess.outputs][-1:]  # one output, as a client usually asks for
    big = 60_000.0

    def h_inputs(mod):
        xs = []
        for k, v in feed.items():
            i = mod.InferInput(k, list(v.shape), v2_datatype(v.dtype.name))
            if mod is httpclient:
                i.set_data_from_numpy(v, binary_data=True)
            else:
                i.set_data_from_numpy(v)
            xs.append(i)
        return xs

    hc = httpclient.InferenceServerClient(addrs["http"])
    gc = grpcclient.InferenceServerClient(addrs["grpc"])
    h_out = [httpclient.InferRequestedOutput(o, binary_data=True) for o in outs]
    g_out = [grpcclient.InferRequestedOutput(o) for o in outs]
    paths = {
        "in-process submit": lambda: sess.submit(feed, budget_ms=big).result(),
        "HTTP (tritonclient)": lambda: hc.infer(name, h_inputs(httpclient), outputs=h_out,
                                                parameters={"budget_ms": big}),
        "gRPC (tritonclient)": lambda: gc.infer(name, h_inputs(grpcclient), outputs=g_out,
                                                parameters={"budget_ms": big}),
    }
    print(f"server options: {args.server_args or '(defaults)'}")
    print(f"bundle {args.bundle} ({name}, variant {sess.variant.name}); batch 1 × seq {args.seq_len}; threads "
          f"{args.threads}; CPU {os.cpu_count()} cores, SIMD {simd_flags()}; load average {os.getloadavg()[0]:.2f}")
    lat: dict[str, list[float]] = {k: [] for k in paths}
    for f in paths.values():  # warm-up: connections, ORT arenas
        for _ in range(5):
            f()
    for _ in range(args.rounds):
        for k, f in paths.items():
            for _ in range(args.block):
                t0 = time.perf_counter()
                f()
                lat[k].append((time.perf_counter() - t0) * 1e3)
    base = pct(lat["in-process submit"], 50)
    print(f"\n1. round trip of one request, closed loop, {args.rounds}×{args.block} per path (alternating blocks)")
    print(f"{'path':<22} {'p50 ms':>8} {'p99 ms':>8} {'p50 overhead ms':>16}")
    results: dict = {"round_trip": {}}
    for k, v in lat.items():
        print(f"{k:<22} {pct(v, 50):8.3f} {pct(v, 99):8.3f} {pct(v, 50) - base:16.3f}")
        results["round_trip"][k] = {"p50_ms": round(pct(v, 50), 3), "p99_ms": round(pct(v, 99), 3)}

    # -- capacity and open-loop goodput ---------------------------------------------------------------------
    # Lean load generators, so that the client is not the bottleneck on a small machine: prebuilt HTTP bytes over
    # raw keep-alive sockets, a prebuilt ModelInferRequest on grpc.aio, a plain thread calling submit in-process.
    from tritonclient.grpc import service_pb2 as pb
    from tritonclient.grpc import service_pb2_grpc as pb_grpc

    import grpc

    def http_bytes(budget: float) -> bytes:
        head = json.dumps({"inputs": [{"name": k, "datatype": v2_datatype(v.dtype.name), "shape": list(v.shape),
                                       "parameters": {"binary_data_size": v.nbytes}} for k, v in feed.items()],
                           "outputs": [{"name": o, "parameters": {"binary_data": True}} for o in outs],
                           "parameters": {"budget_ms": budget}}).encode()
        body = head + b"".join(np.ascontiguousarray(v).tobytes() for v in feed.values())
        host = addrs["http"]
        return (f"POST /v2/models/{name}/infer HTTP/1.1\r\nHost: {host}\r\nContent-Length: {len(body)}\r\n"
                f"Inference-Header-Content-Length: {len(head)}\r\n\r\n").encode() + body

    def grpc_request(budget: float):
        req = pb.ModelInferRequest(model_name=name)
        req.parameters["budget_ms"].double_param = budget
        for k, v in feed.items():
            req.inputs.add(name=k, datatype=v2_datatype(v.dtype.name), shape=list(v.shape))
            req.raw_input_contents.append(np.ascontiguousarray(v).tobytes())
        for o in outs:
            req.outputs.add(name=o)
        return req

    rejections: dict[str, bytes] = {}

    class HttpPool:
        def __init__(self, size: int = 128) -> None:
            self.free: list = []
            self.slots = asyncio.Semaphore(size)  # a bounded pool, like aiohttp's conn_limit
            host, port = addrs["http"].rsplit(":", 1)
            self.host, self.port = host, int(port)

        async def call(self, data: bytes) -> str:
            async with self.slots:
                return await self._call(data)

        async def _call(self, data: bytes) -> str:
            conn = self.free.pop() if self.free else await asyncio.open_connection(self.host, self.port)
            r, w = conn
            w.write(data)
            status = (await r.readline()).split()[1].decode()
            length = 0
            while True:
                line = await r.readline()
                if line in (b"\r\n", b""):
                    break
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":")[1])
            body = await r.readexactly(length)
            if status != "200":
                rejections.setdefault(status, body[:300])  # the first body per status, printed at the end
            self.free.append(conn)
            return status

        async def close(self) -> None:
            for _, w in self.free:
                w.close()

    def make(kind: str, budget: float):
        if kind == "HTTP":
            pool, data = HttpPool(), http_bytes(budget)

            async def call() -> str:
                st = await pool.call(data)
                return "answer" if st == "200" else st
            return pool.close, call
        if kind == "gRPC":
            ch = grpc.aio.insecure_channel(addrs["grpc"])
            stub, req = pb_grpc.GRPCInferenceServiceStub(ch), grpc_request(budget)

            async def call() -> str:
                try:
                    await stub.ModelInfer(req)
                    return "answer"
                except grpc.aio.AioRpcError as e:
                    return e.code().name
            return ch.close, call

        async def call() -> str:
            r = await asyncio.wrap_future(sess.submit(feed, budget_ms=budget))
            return "answer" if r.ok else f"rejected:{r.reason}"

        async def nothing() -> None:
            return None
        return nothing, call

    async def capacity(kind: str, seconds: float = 2.0) -> float:
        """Answers within the budget per second, closed loop (rejections and late answers not counted)."""
        close, call = make(kind, args.budget_ms)
        n, t_end = 0, time.perf_counter() + seconds

        async def worker() -> None:
            nonlocal n
            while time.perf_counter() < t_end:
                t0 = time.perf_counter()
                if await call() == "answer" and (time.perf_counter() - t0) * 1e3 <= args.budget_ms:
                    n += 1
                else:
                    await asyncio.sleep(0.001)  # a rejection comes back at once: do not spin on it

        await asyncio.gather(*(worker() for _ in range(args.concurrency)))
        await close()
        return n / seconds

    async def open_loop(kind: str, rate: float) -> dict:
        close, call = make(kind, args.budget_ms)
        rng = np.random.default_rng(0)
        got: list[tuple[str, float]] = []

        async def timed() -> None:
            t0 = time.perf_counter()
            k = await call()
            ms = (time.perf_counter() - t0) * 1e3
            got.append(((("ok" if ms <= args.budget_ms else "late") if k == "answer" else k), ms))

        tasks, t, t0 = [], 0.0, time.perf_counter()
        while t < args.seconds:
            t += rng.exponential(1.0 / rate)
            d = t0 + t - time.perf_counter()
            if d > 0:
                await asyncio.sleep(d)
            tasks.append(asyncio.ensure_future(timed()))
        await asyncio.gather(*tasks)
        wall = time.perf_counter() - t0
        await close()
        kinds = [k for k, _ in got]
        ok_ms = [ms for k, ms in got if k in ("ok", "late")]
        return {"offered_per_s": round(len(got) / args.seconds, 1), "requests": len(got),
                "goodput_per_s": round(kinds.count("ok") / wall, 1),
                "within_budget_share": round(kinds.count("ok") / len(got), 3),
                "answered_p50_ms": round(pct(ok_ms, 50), 2), "answered_p99_ms": round(pct(ok_ms, 99), 2),
                "outcomes": {k: kinds.count(k) for k in sorted(set(kinds))}}

    batch1 = 1e3 / float(np.mean(lat["in-process submit"]))
    basis = (f"batch-1 capacity of the model in-process = 1000 / mean round trip above = {batch1:.1f}/s, the same "
             f"offered load on every path" if args.capacity == "batch1" else
             f"answers within budget per s, closed loop, {args.concurrency} in flight, per path")
    print(f"\n2. open loop (Poisson) at 1.5× capacity for {args.seconds:g} s, budget {args.budget_ms:g} ms; capacity: "
          f"{basis}; lean load generators")
    results["load"] = {}
    for kind in [k for k in args.load_paths.split(",") if k]:
        if args.fresh and kind == "in-process":
            sess.close()
            sess = dsedge.load(args.bundle, threads=args.threads)
            sess.warmup()
        elif args.fresh:  # a new server, so that one path's overload does not carry over into the next
            box["proc"].terminate()
            box["proc"].wait(30)
            box["proc"], new = start_server(args.bundle, args.threads, args.server_args.split())
            addrs.update(new)
        cap = batch1 if args.capacity == "batch1" else asyncio.run(capacity(kind))
        r = asyncio.run(open_loop(kind, max(1.5 * cap, 1.0)))
        r["capacity_per_s"] = round(cap, 1)
        results["load"][kind] = r
        print(f"{kind:<11} capacity {cap:7.1f}/s  offered {r['offered_per_s']:7.1f}/s  goodput {r['goodput_per_s']:7.1f}/s"
              f"  within budget {100 * r['within_budget_share']:5.1f}%  answered p50 {r['answered_p50_ms']:.2f} ms"
              f" p99 {r['answered_p99_ms']:.2f} ms  {r['outcomes']}")
    if rejections:
        print("first HTTP rejection body per status:", rejections)
    sess.close()
    if args.json:
        print(json.dumps(results))


if __name__ == "__main__":
    main()
