"""Real Triton as the baseline: the same ONNX model on a real ``tritonserver`` (dynamic batcher) vs dsedge, driven
by the same open-loop bursty arrival schedule, at 0.5×, 1.5× and 3× the batch-1 capacity (``--capacity batched``:
the best batched rows/s), then a noisy-neighbour run (one CPU burner per core for 2 s at 0.5×).

    python benchmarks/triton_baseline.py --bundle out/all-minilm-l6-v2-cpu.dse --duration-s 8
    python benchmarks/triton_baseline.py --small        # a tiny text model built here

Servers:
  * ``triton-bM-D``: the bundle's ``dsedge export triton --platform python`` model on real Triton 2.51 (the
    nvidia-pytriton wheel's server, Python backend), dynamic batcher with max_batch_size M and preferred sizes the
    powers of two up to M, ragged batching (model.py pads like dsedge), max_queue_delay D (a few M and D tried: the
    best is the baseline), queue timeout REJECT at the budget (each request carries ``timeout`` = budget µs),
    max_queue_size = --max-queue. Every request also carries the budget as its gRPC deadline (``client_timeout``),
    as a client with a latency budget sets it: past it the client gives up, and that counts as a miss.
  * ``dsedge``: ``dsedge serve`` over the same tritonclient gRPC client and the same ``timeout`` parameter when the
    CLI has ``serve`` (--dsedge serve); else ``Session.submit`` in this process (--dsedge inprocess: no network or
    protocol cost, which favours dsedge — the table header says which ran).
  ``--worker-nice 0,5,0,5`` runs ``dsedge serve`` once per value, in that order (rows ``dsedge-niceN``): the
  batch workers' priority measured side by side in one run; ``--serve-flags '--standby;--no-standby'`` does the
  same for any flags (rows ``dsedge[FLAGS]``). ``--triton-max-batch ''`` runs no Triton window.
Instance layouts: ``dsedge serve`` runs on its own defaults, as a user meets it (on a 2-core CPU, two 1-thread
instances, the second paused while the front end is busy: ``--spare-pause-cores``); Triton tries one instance with
ORT's default threads (its own default), dsedge's layout (rows ``triton-x2t1-…``: two 1-thread instances) and one
1-thread instance with a core left to the front end (``triton-x1t1-…``, dsedge serve's ``--reserve-cores 1``), and
its best setting of all is the baseline. ``--threads``/``--instances`` give both
servers one layout instead. Reported per load: goodput (answers within budget per second of the
arrival window), in-budget share of admitted, rejections, the misses split into answered late and timed out
(refused at the deadline or past the gRPC deadline), p99 of answered (client-side), for dsedge serve how many of
its late answers were within budget by the server's own clock (the rest of their time went to the client and the
transport, which no server-side policy sees) and its own counts per level (``dsedge_requests_total`` scraped from
its metrics port before and after: in budget of admitted by the server's clock), and Triton's own
per-request overhead (an identity Python-backend model, serial round trips) beside the model's own b1 run time.
Every window starts cold, as a user first meets a server: Triton loads the model for it (new instances and
stubs, with the config's own ``model_warmup``) and ``dsedge serve`` is started for it (its load measures the
latency profile, dsedge's start); nothing is sent before the window's first arrival. Windows run load by load
(at each load every Triton setting, then ``dsedge serve``), so rows compared with each other are measured minutes
apart, not the whole run apart. Serial round-trip overheads are measured after a window. ``--dsedge inprocess``
is the exception: one session, warmed up.
The load generator (this process) runs each arrival window with its garbage collector off (``gc.collect()`` before,
``gc.enable()`` after): its full collections, over the window's futures and tritonclient's call objects, paused it
28-101 ms mid-window and answers of both servers then arrived late together (measured on a 2-core host at 3×).
Arrivals, request pool and capacity come from benchmarks/streaming.py. Each level's arrival rate is re-based on
the batch-1 p50 measured in process just before it (``--no-rebase`` keeps the start's), and each window's row
shows the p50 measured just before that window (``b1 now``). Timings on a shared machine are noisy:
compare ratios inside one run. A window that lost more than 5 % of its CPU to the hypervisor (steal) is run again
once (``--steal-reruns``; not the stall scenario's): the first stays in the table, marked, out of the comparison.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Sequence

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "tests")]

import dsedge  # noqa: E402
from dsedge.runtime.batching import BatchLayout  # noqa: E402
from dsedge.session import auto_instances  # noqa: E402
from streaming import (STEAL_RERUN_SHARE, arrivals, batch_latency_ms, host_b1_ms, make_requests,  # noqa: E402
                       open_loop, recovery_s, rerun_for_steal, steal_hit, steal_ms, steal_since)
from triton_server import TritonServer, build_stub_env, free_port  # noqa: E402

_clock = time.perf_counter
_V2 = {"int64": "INT64", "float32": "FP32", "int32": "INT32", "float16": "FP16", "bool": "BOOL"}


# --- the side-by-side driver (outcome, latency ms) shared by real Triton and dsedge serve -----------------
def capacity_rows_per_s(run, layout: BatchLayout, pool, max_batch: int, repeats: int = 7) -> tuple[float, int]:
    """Best rows/s of ``run`` over batch sizes 1, 2, 4, … max_batch on ``pool`` requests (median of ``repeats``
    timed runs per size, so a burst of noise from other processes does not set the load levels)."""
    sizes = sorted({min(1 << i, max_batch) for i in range(max_batch.bit_length() + 1)})
    ms = batch_latency_ms(run, layout, pool, sizes, repeats)
    best_b = max(ms, key=lambda b: b / ms[b])
    return 1e3 * best_b / ms[best_b], best_b


class DsedgeServer:
    def __init__(self, session: dsedge.Session) -> None:
        self.session = session

    def submit(self, feed, budget_ms: float) -> Future:
        out: Future = Future()
        inner = self.session.submit(feed, budget_ms=budget_ms)

        def done(f: Future) -> None:
            r = f.result()
            if isinstance(r, dsedge.Rejected):
                out.set_result(("timeout" if r.reason == "deadline" else "rejected", r.latency_ms))
            else:
                out.set_result(("answered" if r.ok else "error", r.latency_ms))
        inner.add_done_callback(done)
        return out

    def close(self) -> None:
        pass



def drive(server, schedule: np.ndarray, pool, budget_ms: float, stall: tuple[float, float] | None = None) -> dict:
    """Submit ``pool[i % len(pool)]`` at ``schedule[i]`` (open loop) and tally the outcomes. ``stall``: (start,
    length) s of one CPU burner process per core inside the window (a noisy neighbour); the row then says how long
    after its end answers were back in budget."""
    gc.collect()
    gc.disable()  # the generator's own pauses stay out of both servers' latencies (see the module doc)
    steal0 = steal_ms()
    try:
        futures = open_loop(schedule, lambda i: server.submit(pool[i % len(pool)], budget_ms), stall,
                            os.cpu_count() or 2)
        outcomes = [f.result(timeout=120) for f in futures]
    finally:
        gc.enable()
    steal = steal_since(steal0)
    window = max(float(schedule[-1]) if len(schedule) else 0.0, 1e-9)
    extra = {}
    if stall is not None:
        ok = np.array([o[0] == "answered" and o[1] <= budget_ms for o in outcomes])
        extra["stall_recovery_s"] = recovery_s(schedule, ok, stall[0] + stall[1], window)
    lat = np.array([o[1] for o in outcomes if o[0] == "answered"])
    # answered late at the client although the server's own clock had it within budget: time spent in the client
    # and the transport, which no server-side policy sees (dsedge serve reports its latency; Triton does not)
    late_outside = sum(1 for o in outcomes if o[0] == "answered" and o[1] > budget_ms and len(o) > 2
                       and o[2] is not None and o[2] <= budget_ms)
    n = len(outcomes)
    rejected = sum(o[0] == "rejected" for o in outcomes)
    admitted = n - rejected
    within = int((lat <= budget_ms).sum()) if lat.size else 0
    return {
        "submitted": n, "admitted": admitted, "answered": int(lat.size), "within_budget": within,
        "answered_late": int(lat.size) - within, "timed_out": sum(o[0] == "timeout" for o in outcomes),
        "late_in_budget_at_server": late_outside,
        "goodput_per_s": round(within / window, 2),
        "p50_ms": round(float(np.percentile(lat, 50)), 2) if lat.size else None,
        "p99_ms": round(float(np.percentile(lat, 99)), 2) if lat.size else None,
        "rejection_rate": round(rejected / n, 4) if n else 0.0,
        "miss_rate": round((admitted - within) / admitted, 4) if admitted else 0.0,
        "admitted_within_budget": round(within / admitted, 4) if admitted else None,
        "steal_ms": steal,  # CPU the hypervisor took from this VM during the window, ms (streaming.steal_ms)
        **extra,
    }



def outcome_of(error) -> str:
    """How a failed call counts: ``"timeout"`` (admitted, then missed) or ``"rejected"`` (refused at admission).

    Timeouts: the gRPC deadline passed (``DEADLINE_EXCEEDED``: the client stopped waiting), Triton's queue timeout
    (503 "Request timeout expired"), and dsedge's ``deadline`` refusals (its deadline passed in a queue, or was spent
    before the scheduler saw the call). Rejections: dsedge's ``overload`` / ``budget`` / ``queue_full`` and Triton's
    full queue. Read from the status code and dsedge's ``reason:`` prefix, never from words in the text: dsedge's
    overload message says "no batch meets its deadline", which is a refusal at admission.

    Args:
        error: a ``tritonclient.utils.InferenceServerException`` (``status()`` like "StatusCode.UNAVAILABLE").
    """
    status = str(error.status() or "") if hasattr(error, "status") else ""
    message = error.message() if hasattr(error, "message") else str(error)
    if status.endswith("DEADLINE_EXCEEDED"):
        return "timeout"
    reason = message.split(":", 1)[0].strip()
    if reason == "deadline":
        return "timeout"
    if reason in ("overload", "budget", "queue_full", "shutdown"):
        return "rejected"
    return "timeout" if "timeout" in message.lower() else "rejected"


class GrpcDriver:
    """Open-loop client over tritonclient.grpc: ``submit(feed, budget_ms) -> Future[(kind, ms)]`` with kind
    answered / rejected (refused at admission: queue full, overload, budget) / timeout (dropped after queueing)."""

    def __init__(self, url: str, model: str) -> None:
        import tritonclient.grpc as grpcclient

        self.grpc = grpcclient
        self.client = grpcclient.InferenceServerClient(url)
        self.model = model

    def submit(self, feed, budget_ms: float) -> Future:
        fut: Future = Future()
        inputs = []
        for name, arr in feed.items():
            i = self.grpc.InferInput(name, list(arr.shape), _V2[str(arr.dtype)])
            i.set_data_from_numpy(arr)
            inputs.append(i)
        t0 = _clock()

        def done(result, error) -> None:
            ms = (_clock() - t0) * 1e3
            if error is not None:
                fut.set_result((outcome_of(error), ms))
                return
            params = result.get_response().parameters  # dsedge serve says its own latency; Triton does not
            server_ms = params["latency_ms"].double_param if "latency_ms" in params else None
            fut.set_result(("answered", ms, server_ms))

        # the budget twice: Triton's ``timeout`` parameter (µs, counted from the server's receipt) and the gRPC
        # deadline (from the send; past it the client stops waiting, so a late answer is a timeout either way)
        self.client.async_infer(self.model, inputs, callback=done, timeout=int(budget_ms * 1000),
                                client_timeout=budget_ms / 1e3)
        return fut

    def serial_p50_ms(self, feed, n: int = 100) -> float:
        inputs = []
        for name, arr in feed.items():
            i = self.grpc.InferInput(name, list(arr.shape), _V2[str(arr.dtype)])
            i.set_data_from_numpy(arr)
            inputs.append(i)
        from tritonclient.utils import InferenceServerException

        times = []
        self.serial_errors: list[str] = []
        for k in range(n + 5):
            t0 = _clock()
            try:
                self.client.infer(self.model, inputs)
            except InferenceServerException as e:  # a queue timeout on a noisy machine: not a round-trip time
                self.serial_errors.append(str(e)[:120])
                continue
            if k >= 5:
                times.append((_clock() - t0) * 1e3)
        return float(np.median(times)) if times else float("nan")

    def close(self) -> None:
        self.client.close()


def restart_if_dead(server: TritonServer) -> None:
    """Start ``server`` again when its process has exited (Triton 2.51 segfaulted once mid-window here)."""
    if server.proc is None or server.proc.poll() is not None:
        server.stop()
        server.start(timeout_s=120)


def identity_model(repo: Path) -> None:
    d = repo / "identity" / "1"
    d.mkdir(parents=True)
    (repo / "identity" / "config.pbtxt").write_text(
        'backend: "python"\nmax_batch_size: 0\ninput { name: "x" data_type: TYPE_FP32 dims: [ 1 ] }\n'
        'output { name: "y" data_type: TYPE_FP32 dims: [ 1 ] }\ninstance_group { count: 1 kind: KIND_CPU }\n')
    (d / "model.py").write_text(
        "import triton_python_backend_utils as pb_utils\n\nclass TritonPythonModel:\n"
        "    def execute(self, requests):\n        return [pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("
        "'y', pb_utils.get_input_tensor_by_name(r, 'x').as_numpy())]) for r in requests]\n")


def _layout(instances: int, threads: int | None) -> str:
    """A Triton instance layout's label: ``x2t1`` = 2 instances of 1 intra-op thread (``t*``: ORT's default)."""
    return f"x{instances}t{threads or '*'}"


def set_batching(config_path: Path, delay_us: int, preferred: list[int], max_batch: int, max_queue: int,
                 timeout_us: int, instances: int = 1, threads: int | None = None) -> None:
    """Rewrite the exported config.pbtxt's dynamic batcher and instance layout (``instances`` in its instance
    group, each with ``threads`` ORT intra-op threads; None: ORT's default) — parsed and written back with
    tritonclient's proto."""
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2 as mc

    cfg = text_format.Parse(config_path.read_text(), mc.ModelConfig())
    cfg.max_batch_size = max_batch
    db = cfg.dynamic_batching
    del db.preferred_batch_size[:]
    db.preferred_batch_size.extend(preferred)
    db.max_queue_delay_microseconds = delay_us
    q = db.default_queue_policy
    q.timeout_action = mc.ModelQueuePolicy.REJECT
    q.default_timeout_microseconds = timeout_us
    q.allow_timeout_override = True
    q.max_queue_size = max_queue
    cfg.instance_group[0].count = int(instances)
    # the python platform's model.py reads "threads"; Triton's ORT backend its own session parameters
    keys = ("threads",) if cfg.backend == "python" else ("intra_op_thread_count", "inter_op_thread_count")
    for key in keys:
        if key in cfg.parameters:
            del cfg.parameters[key]
    if threads:
        for key, value in zip(keys, (str(threads), "1")):
            cfg.parameters[key].string_value = value
    del cfg.model_warmup[1:]  # batch-1 warm-up only: the larger one is sized for the exported preferred batch
    config_path.write_text(text_format.MessageToString(cfg))


def server_outcomes(metrics_url: str) -> dict[str, float]:
    """dsedge serve's own request counts so far, ``{"ok": n, "late": n, "rejected:<reason>": n, …}`` (its
    ``dsedge_requests_total`` series, judged by the server's clock: arrival at the handler → answer)."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name != "dsedge_requests":
            continue
        for sample in family.samples:
            if sample.name.endswith("_total"):
                o, r = sample.labels.get("outcome", ""), sample.labels.get("reason", "")
                key = f"{o}:{r}" if r else o
                out[key] = out.get(key, 0.0) + sample.value
    return out


def server_view(before: dict[str, float], after: dict[str, float]) -> dict:
    """One level's server-side counts (``after - before``) and its in-budget share of admitted by its own clock:
    ok / (ok + late + admitted then dropped or cancelled)."""
    d = {k: int(after.get(k, 0) - before.get(k, 0)) for k in after}
    d = {k: v for k, v in d.items() if v}
    missed = d.get("late", 0) + sum(v for k, v in d.items() if k in ("rejected:deadline", "rejected:cancelled"))
    ok = d.get("ok", 0)
    return {"server_counts": d, "server_admitted_within_budget": round(ok / (ok + missed), 4) if ok + missed else None}


def start_dsedge_serve(bundle, name: str, args, budget: float, log: Path,
                       extra: Sequence[str] = ()) -> tuple[subprocess.Popen, str, str]:
    grpc_port, metrics_port = free_port(), free_port()
    while metrics_port == grpc_port:
        metrics_port = free_port()
    cmd = [sys.executable, "-m", "dsedge", "serve", f"{name}={bundle}", "--host", "127.0.0.1", "--http-port", "off",
           "--grpc-port", str(grpc_port), "--metrics-port", str(metrics_port), "--budget-ms", f"{budget:g}",
           "--max-batch", str(args.max_batch), "--max-queue", str(args.max_queue)]
    if args.threads:  # else dsedge serve's own choice, as a user meets it
        cmd += ["--threads", str(args.threads)]
    if args.instances:
        cmd += ["--instances", str(args.instances)]
    cmd += list(extra)
    out = open(log, "w")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=out, text=True, start_new_session=True)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line and proc.poll() is not None:
            raise RuntimeError(f"dsedge serve exited {proc.returncode}: see {log}")
        if "ready" in line:
            return proc, f"127.0.0.1:{grpc_port}", f"http://127.0.0.1:{metrics_port}/metrics"
    proc.terminate()
    raise RuntimeError("dsedge serve did not get ready in 180 s")


def has_serve() -> bool:
    from dsedge.cli import COMMANDS

    return "serve" in COMMANDS


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--bundle")
    src.add_argument("--small", action="store_true")
    ap.add_argument("--variant", default=None)
    ap.add_argument("--budget-ms", type=float, default=None)
    ap.add_argument("--loads", default="0.5,1.5,3", help="multiples of the capacity (see --capacity)")
    ap.add_argument("--capacity", choices=("batch1", "batched"), default="batch1",
                    help="what the loads multiply: 1000 / batch-1 p50 (the reference a user meets first) or the "
                         "best batched rows/s")
    ap.add_argument("--stall-s", type=float, default=2.0, help="the noisy-neighbour run: one CPU burner per core "
                    "for this long (0: none)")
    ap.add_argument("--stall-at-s", type=float, default=4.0, help="when the burners start inside its window")
    ap.add_argument("--stall-load", type=float, default=0.5)
    ap.add_argument("--duration-s", type=float, default=8.0)
    ap.add_argument("--max-batch", type=int, default=32)
    ap.add_argument("--max-queue", type=int, default=256)
    ap.add_argument("--triton-delays-ms", default="1,auto",
                    help="max_queue_delay values to try, ms ('auto' = 10 %% of the budget)")
    ap.add_argument("--triton-max-batch", default="8,32",
                    help="Triton max_batch_size values to try (preferred sizes: powers of two up to it)")
    ap.add_argument("--min-seq", type=int, default=8)
    ap.add_argument("--max-seq", type=int, default=48)
    ap.add_argument("--threads", type=int, default=None,
                    help="ORT intra-op threads per instance, both servers (default: dsedge serve's own choice, and "
                         "Triton tries one instance of ORT's default threads and dsedge's layout)")
    ap.add_argument("--instances", type=int, default=None,
                    help="backends per model on both servers: Triton's instance_group count, dsedge serve --instances "
                         "(default: as --threads)")
    ap.add_argument("--dsedge", choices=("auto", "serve", "inprocess"), default="auto")
    ap.add_argument("--worker-nice", default="0",
                    help="dsedge serve --worker-nice values, comma-separated: one server run each, in this order "
                         "(e.g. 0,5,0,5 interleaves them; rows are labelled dsedge-niceN)")
    ap.add_argument("--serve-flags", default=None,
                    help="more `dsedge serve` flags, one server run per ';'-separated group, in this order (e.g. "
                         "'--standby;--no-standby;--standby;--no-standby' interleaves them; rows are labelled "
                         "dsedge[FLAGS]); instead of --worker-nice")
    ap.add_argument("--stub-env", default=os.path.expanduser("~/.cache/dsedge/triton-stub-env"),
                    help="the Python-backend stub's virtualenv (built here if missing)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-rebase", dest="rebase", action="store_false",
                    help="keep the batch-1 p50 measured at the start for every level's arrival rate (default: "
                         "measured again before each level)")
    ap.add_argument("--steal-reruns", type=int, default=1,
                    help="run a window again (up to this many times) when the hypervisor took more than "
                         f"{100 * STEAL_RERUN_SHARE:g} %% of its CPU (steal); 0: never")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    # this process is the load generator: its send loop and tritonclient's callback threads share one GIL, and at
    # the default 5 ms switch interval a finished answer's callback can wait that long for it, per hop. A shorter
    # interval keeps the client's own delay out of the latencies of both servers alike.
    sys.setswitchinterval(1e-4)

    work = Path(tempfile.mkdtemp(prefix="dsedge-triton-bench-"))
    if args.small:
        from streaming_models import text_bundle

        bundle = text_bundle(work, dim=512, variants={"fp32": 6}, name="toy-bench")
        vocab = 100
    else:
        bundle, vocab = Path(args.bundle), 30522
    stub = Path(args.stub_env)
    if not (stub / "bin" / "python").exists():
        print(f"# building the stub env at {stub} …", flush=True)
        build_stub_env(stub)

    session = dsedge.load(bundle, variant=args.variant, threads=args.threads, budget_ms=args.budget_ms,
                          max_batch=args.max_batch, max_queue=args.max_queue, instances=args.instances)
    budget = session.default_budget_ms()
    rng = np.random.default_rng(args.seed)
    seqs = np.linspace(args.min_seq, args.max_seq, 4).round().astype(int)
    pool = [r for seq in seqs for r in make_requests(session.inputs, 128, rng, vocab, int(seq))]
    rng.shuffle(pool)
    layout = BatchLayout.of(session.inputs, session.outputs)
    run = session._backend.run
    cap, cap_b = capacity_rows_per_s(run, layout, pool, args.max_batch)
    b1 = []
    for feed in pool[:30]:
        t0 = _clock()
        run(feed)
        b1.append((_clock() - t0) * 1e3)

    from dsedge.toolchain.triton import export_triton

    repo = work / "repo"
    export = export_triton(bundle, repo, platform="python")
    # Triton's instance layouts: the one given, else one instance with ORT's default threads (Triton's default),
    # dsedge's layout (on a 2-core CPU: two 1-thread instances) and dsedge serve's --reserve-cores 1 (a core left to
    # the front end: on 2 cores one 1-thread instance); the best setting of all is the baseline
    fixed = bool(args.threads or args.instances)
    if fixed:
        layouts = [(args.instances or 1, args.threads)]
    else:
        layouts = [(1, None)]
        for auto in (auto_instances(session._backend, None, None), auto_instances(session._backend, None, None, 1)):
            if auto not in layouts and auto != (1, None):
                layouts.append(auto)
    for m in export.models[1:]:  # only the served variant
        shutil.rmtree(repo / m.name)
    model = export.models[0].name
    if args.variant and args.variant != export.models[0].variant:
        raise SystemExit("--variant other than the default is not wired for the Triton side")
    identity_model(repo)
    mode = args.dsedge if args.dsedge != "auto" else ("serve" if has_serve() else "inprocess")

    from importlib.metadata import version

    import onnxruntime

    flags = ""
    try:
        flags = " ".join(sorted({f for f in re.findall(r"\b(avx512\w*|avx2|avx_vnni|amx\w*)\b",
                                                        Path("/proc/cpuinfo").read_text())}))
    except OSError:
        pass
    print(f"# triton baseline  {platform.node()}  {platform.processor() or platform.machine()}  cores "
          f"{os.cpu_count()}  cpu flags [{flags}]  python {platform.python_version()}  onnxruntime "
          f"{onnxruntime.__version__}  tritonclient {version('tritonclient')}  dsedge {dsedge.__version__}")
    ref = 1000.0 / float(np.median(b1)) if args.capacity == "batch1" else cap
    print(f"# bundle {Path(str(bundle)).name}  variant {session.variant.name}  budget {budget:g} ms  capacity "
          f"{cap:.0f} rows/s (batch {cap_b})  b1 p50 {np.median(b1):.2f} ms -> batch-1 capacity "
          f"{1000.0 / float(np.median(b1)):.0f} rows/s; loads are multiples of the {args.capacity} one "
          f"({ref:.0f} rows/s)  seq {args.min_seq}-{args.max_seq}  "
          f"window {args.duration_s:g} s  Triton layouts {', '.join(_layout(n, t) for n, t in layouts)}  dsedge "
          f"{'as ' + _layout(*layouts[0]) if fixed else 'on its defaults'} via "
          f"{'dsedge serve (same gRPC client)' if mode == 'serve' else 'Session.submit in-process (no network)'}")

    delays = [0.1 * budget if d.strip() == "auto" else float(d) for d in args.triton_delays_ms.split(",") if d.strip()]
    settings = [(lay, int(mb), d) for lay in layouts for mb in args.triton_max_batch.split(",") if mb.strip()
                for d in delays]
    server = TritonServer(repo, stub / "bin", work / "triton", extra_args=("--model-control-mode=explicit",
                                                                           "--load-model=identity"))
    # crashes: Triton settings whose server died mid-run (its 2.51 build segfaulted once at 3x here)
    results, overhead, crashes = [], {}, []
    serve_proc = None
    try:
        server.start(timeout_s=120)
        stall = (args.stall_at_s, args.stall_s) if args.stall_s > 0 else None
        levels = [(load, args.seed + int(load * 100), None) for load in [float(x) for x in args.loads.split(",")]]
        levels += [(args.stall_load, args.seed + 999, stall)] if stall is not None else []
        b1_start = float(np.median(b1))
        schedules: dict[float, np.ndarray] = {}
        import tritonclient.grpc as grpcclient

        admin = grpcclient.InferenceServerClient(server.grpc_url)
        crashed_settings: set[str] = set()

        def triton_window(setting, load, sched, stalled) -> dict | None:
            (n_inst, n_threads), mb, d = setting
            label = "triton-" + (f"{_layout(n_inst, n_threads)}-" if len(layouts) > 1 else "") + f"b{mb}-{d:g}ms"
            if label in crashed_settings:
                return None
            preferred = sorted({min(1 << i, mb) for i in range(mb.bit_length())})[-4:]
            set_batching(repo / model / "config.pbtxt", int(d * 1000), preferred, mb, args.max_queue,
                         int(budget * 1000), n_inst, n_threads)
            restart_if_dead(server)  # it crashed in the window before
            # every window starts cold: the model is loaded now (new instances and stubs, its config's own
            # model_warmup, which is Triton's start) and nothing is sent before the window's first arrival
            b1_now = host_b1_ms(run, pool)  # before the model loads: this host's speed now
            admin.load_model(model)
            drv = GrpcDriver(server.grpc_url, model)
            row = drive(drv, sched, pool, budget, stall=stalled)
            row["b1_now_ms"] = b1_now
            row.update(load=load, server=label, **({"scenario": "stall"} if stalled else {}))
            crashed = server.proc.poll() is not None
            if crashed:  # its row is not a baseline; the rest of this setting is skipped
                signal_line = next((ln for ln in server.log_tail(60).splitlines() if "Signal" in ln), "")
                row["server_crashed"] = f"exit {server.proc.returncode} {signal_line}".strip()
                crashes.append(f"{label} at {load:g}x{' (stall)' if stalled else ''}: {row['server_crashed']}")
                crashed_settings.add(label)
            elif "triton_model_b1_p50_ms" not in overhead:  # serial round trips: after the window, warm
                overhead["triton_model_b1_p50_ms"] = round(drv.serial_p50_ms(pool[0], 30), 3)
                if drv.serial_errors:
                    print(f"# triton serial errors: {len(drv.serial_errors)}, first: {drv.serial_errors[0]}")
            results.append(row)
            print(json.dumps(row), flush=True)
            drv.close()
            if not crashed:
                admin.unload_model(model)
                time.sleep(1.0)
            return None if crashed else row

        # one `dsedge serve` run per variant, in the order given (repeat one to interleave): (label, extra flags)
        if mode != "serve":
            variants = [("dsedge", [])]
        elif args.serve_flags is not None:
            groups = [g.split() for g in args.serve_flags.split(";")]
            variants = [("dsedge" if len(groups) == 1 else f"dsedge[{' '.join(g)}]", g) for g in groups]
        else:
            nices = [int(x) for x in args.worker_nice.split(",") if x.strip()]
            variants = [("dsedge" if len(nices) == 1 else f"dsedge-nice{n}", ["--worker-nice", str(n)])
                        for n in nices]
        variants = [(label + (f"-r{[v[0] for v in variants[:k]].count(label) + 1}"
                              if [v[0] for v in variants].count(label) > 1 else ""), flags)
                    for k, (label, flags) in enumerate(variants)]
        inprocess = None
        if mode != "serve":
            session.warmup()
            inprocess = DsedgeServer(session)

        def dsedge_window(k: int, load, sched, stalled) -> dict:
            nonlocal serve_proc
            label, flags = variants[k]
            ours, metrics_url = inprocess, None
            b1_now = host_b1_ms(run, pool)  # before the server starts: this host's speed now
            if mode == "serve":  # every window starts cold: a new server (its load is dsedge's start)
                serve_proc, url, metrics_url = start_dsedge_serve(bundle, model, args, budget, work / "serve.log",
                                                                  flags)
                ours = GrpcDriver(url, model)
            before = server_outcomes(metrics_url) if mode == "serve" else None
            row = drive(ours, sched, pool, budget, stall=stalled)
            if before is not None:
                time.sleep(0.2)  # the last answers' counters
                row.update(server_view(before, server_outcomes(metrics_url)))
            row.update(load=load, server=label, b1_now_ms=b1_now, **({"scenario": "stall"} if stalled else {}))
            results.append(row)
            print(json.dumps(row), flush=True)
            if mode == "serve":
                if "dsedge_serve_b1_p50_ms" not in overhead:  # serial round trips: after the window, warm
                    overhead["dsedge_serve_b1_p50_ms"] = round(ours.serial_p50_ms(pool[0], 30), 3)
                    if ours.serial_errors:
                        print(f"# dsedge serve serial errors: {len(ours.serial_errors)}, first: "
                              f"{ours.serial_errors[0]}")
                ours.close()
                serve_proc.terminate()
                serve_proc.wait(30)
                serve_proc = None
            return row

        # load by load, every server in turn: the rows compared with each other are measured minutes apart, not
        # the whole run apart (this host's speed drifts over minutes)
        for load, seed, stalled in levels:
            # the level's rate from this host's speed now (``--no-rebase``: the start's): a shared host drifts by
            # tens of % within minutes, and a load named 1.5x of a capacity measured at a fast moment is 2x of it at
            # a slow one
            b1_level = host_b1_ms(run, pool) if args.rebase else b1_start
            rate = ref * b1_start / b1_level
            sched = arrivals(load * rate, args.duration_s, np.random.default_rng(seed))
            if not stalled:
                schedules[load] = sched
            print(f"# level {load:g}x{' (stall)' if stalled else ''}: batch-1 p50 now {b1_level:.2f} ms against "
                  f"{b1_start:.2f} at the start: {load * rate:.0f} requests/s", flush=True)
            # not the stall scenario's windows: its CPU burners keep both vCPUs runnable, so any contention on the
            # host shows up as steal there
            reruns = 0 if stalled else args.steal_reruns
            for setting in settings:
                rerun_for_steal(lambda: triton_window(setting, load, sched, stalled), args.duration_s, reruns)
            for k in range(len(variants)):
                rerun_for_steal(lambda: dsedge_window(k, load, sched, stalled), args.duration_s, reruns)
        if inprocess is not None:
            inprocess.close()
        restart_if_dead(server)
        ident = GrpcDriver(server.grpc_url, "identity")
        overhead["identity_p50_ms"] = round(ident.serial_p50_ms({"x": np.zeros(1, np.float32)}, 200), 3)
        ident.close()
        admin.close()
        server.stop()
    finally:
        server.stop()
        if serve_proc is not None:
            serve_proc.terminate()
            serve_proc.wait(30)
        session.close()

    overhead["model_b1_p50_ms_inprocess"] = round(float(np.median(b1)), 3)
    print(f"# per-request overhead: Triton identity Python-backend round trip {overhead['identity_p50_ms']} ms; MiniLM "
          f"b1 serial via Triton {overhead.get('triton_model_b1_p50_ms')} ms vs in-process {np.median(b1):.2f} ms"
          + (f", via dsedge serve {overhead['dsedge_serve_b1_p50_ms']} ms" if "dsedge_serve_b1_p50_ms" in overhead
             else ""))
    print(f"{'load':>5} {'server':<18} {'sent':>6} {'goodput/s':>10} {'p99 ms':>8} {'reject %':>9} {'miss %':>7} "
          f"{'late':>5} {'t/o':>5} {'steal ms':>8} {'b1 now':>6} {'in-budget % of admitted':>24}  (late: of which in "
          f"budget by the server's clock; steal: CPU the hypervisor took from this VM in the window; b1 now: the "
          f"batch-1 p50 in ms measured in process just before the window, against {np.median(b1):.2f} at the start)")
    pct = (lambda x: f"{100 * x:.2f}" if x is not None else "-")
    for load in schedules:
        rows = [r for r in results if r["load"] == load and "scenario" not in r]
        for r in rows:
            print(f"{load:>5g} {r['server']:<18} {r['submitted']:>6} {r['goodput_per_s']:>10.1f} "
                  f"{r['p99_ms'] if r['p99_ms'] is not None else '-':>8} {pct(r['rejection_rate']):>9} "
                  f"{pct(r['miss_rate']):>7} {r['answered_late']:>5} {r['timed_out']:>5} "
                  f"{r['steal_ms'] if r.get('steal_ms') is not None else '-':>8} "
                  f"{r['b1_now_ms'] if r.get('b1_now_ms') is not None else '-':>6} "
                  f"{pct(r['admitted_within_budget']):>24}"
                  + ("  (Triton crashed in this run: not a baseline)" if r.get("server_crashed") else "")
                  + ("  (lost to steal, run again: not compared)" if r.get("superseded") else "")
                  + (f"  ({r['late_in_budget_at_server']} of {r['answered_late']}); by the server's clock "
                     f"{pct(r.get('server_admitted_within_budget'))} % of admitted in budget "
                     f"{r.get('server_counts')}" if r["server"].startswith("dsedge") and mode == "serve" else ""))
        tri = max((r for r in rows if r["server"].startswith("triton") and not r.get("server_crashed")
                   and not r.get("superseded")),
                  key=lambda r: r["goodput_per_s"], default=None)
        if tri is None:
            continue
        for ours_row in (r for r in rows if r["server"].startswith("dsedge") and not r.get("superseded")):
            ratio = ours_row["goodput_per_s"] / tri["goodput_per_s"] if tri["goodput_per_s"] else float("inf")
            print(f"{'':>5} {ours_row['server']} / best real Triton ({tri['server']}) goodput = {ratio:.2f}x")
    for c in crashes:
        print(f"# tritonserver crashed: {c}; restarted for the next setting")
    for r in (x for x in results if x.get("scenario") == "stall" and not x.get("server_crashed")):
        rec = r.get("stall_recovery_s")
        print(f"# stall ({os.cpu_count()} CPU burners {args.stall_s:g} s at {args.stall_load:g}x): {r['server']:<18} "
              f"goodput {r['goodput_per_s']:.1f}/s, in budget of admitted {pct(r['admitted_within_budget'])} %, "
              f"answers back in budget {rec if rec is not None else 'never'} s after the stall's end"
              + (f" (lost {r['steal_ms']} ms to steal, run again: not compared)" if r.get("superseded") else ""))
    if args.json:
        Path(args.json).write_text(json.dumps({"budget_ms": budget, "capacity_rows_per_s": cap,
                                               "reference_rows_per_s": ref, "capacity": args.capacity,
                                               "dsedge_via": mode,
                                               "overhead": overhead, "triton_crashes": crashes,
                                               "results": results}, indent=2) + "\n")
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
