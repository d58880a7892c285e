"""``dsedge serve BUNDLE...``: serve bundles over the Open Inference Protocol (KServe v2), HTTP and gRPC.

Prints ``dsedge serve ready http=HOST:PORT grpc=HOST:PORT metrics=HOST:PORT models=…`` on stdout once every model
is loaded and profiled (port 0 = any free port; the line says which). SIGTERM drains and exits 0.
"""
from __future__ import annotations

import click

from ..runtime.errors import DsedgeError
from ..runtime.params import FiniteFloat


def _port(ctx: click.Context, param: click.Parameter, value: str) -> int | None:
    if value.lower() == "off":
        return None
    try:
        port = int(value)
    except ValueError:
        raise click.BadParameter(f"{value!r} is not a port number (0 = any free port, 'off' = no listener)")
    if not 0 <= port <= 65535:
        raise click.BadParameter(f"port {port} is outside 0..65535")
    return port


@click.command(name="serve")
@click.argument("bundles", nargs=-1, required=True, metavar="BUNDLE... (or NAME=BUNDLE)")
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to bind; 0.0.0.0 exposes the server beyond this machine (use --auth-token-file, TLS).")
@click.option("--http-port", default="8000", show_default=True, callback=_port, help="HTTP/REST port, 0 = any, off.")
@click.option("--grpc-port", default="8001", show_default=True, callback=_port, help="gRPC port, 0 = any, off.")
@click.option("--metrics-port", default="8002", show_default=True, callback=_port,
              help="Prometheus /metrics port, 0 = any, off.")
@click.option("--variant", default=None, help="Variant each model serves (default: the bundle's default).")
@click.option("--cascade", is_flag=True, help="Let a cheaper variant serve requests the primary cannot meet in budget.")
@click.option("--budget-ms", type=FiniteFloat(min=0, min_open=True), default=None,
              help="Default latency budget, ms, for requests naming none (default: the manifest's, else the target's).")
@click.option("--max-batch", type=click.IntRange(min=1), default=None, help="Most rows per batch.")
@click.option("--threads", type=click.IntRange(min=1), default=None, help="ONNX Runtime intra-op threads per variant.")
@click.option("--instances", type=click.IntRange(min=1), default=None,
              help="Backends each model's variant runs on side by side (default on a CPU: 2, the cores split "
                   "between them; with --reserve-cores R, one 1-thread instance per remaining core when 3 or fewer "
                   "remain, else 2 splitting them; on a GPU: 1).")
@click.option("--reserve-cores", type=click.IntRange(min=0), default=0, show_default=True,
              help="CPU cores kept free of the batch workers for the server's event loop (parsing, admission, "
                   "answers): the default instance layout uses the rest (e.g. 2 cores with 1 reserved: one "
                   "1-thread instance). 0: every core, as dsedge.load does (docs/serve.md has both measured).")
@click.option("--spare-pause-cores", type=FiniteFloat(min=0), default=0.3, show_default=True,
              help="While the front end uses more CPU than this (cores), the spare lanes take no new requests: "
                   "every instance but the first, and the fallback lane too. 0: never pause them (docs/serve.md).")
@click.option("--pin-instances/--no-pin-instances", default=True, show_default=True,
              help="Pin each 1-thread instance's batch worker to a CPU core of its own (Linux; the front end's "
                   "threads stay free to run anywhere). Unpinned workers woken by the front end were often put on "
                   "one core together (runtime/thread_priority.py).")
@click.option("--standby/--no-standby", default=False, show_default=True,
              help="A request refused for overload only because of what runs ahead of it waits, unadmitted, for an "
                   "instance that frees in time (admitted then, else 429 once none could start it in time; at most "
                   "its budget). Off by default here: through this server on 2 cores it raised goodput but the "
                   "front end, with more answers to send, missed more budgets (docs/serve.md).")
@click.option("--worker-nice", type=click.IntRange(0, 19), default=0, show_default=True,
              help="Nice value added to the batch workers (Linux), so that admitting and answering requests preempts "
                   "running batches (measured worse side by side on a shared 2-core VM: docs/serve.md).")
@click.option("--max-inflight", type=click.IntRange(min=1), default=None,
              help="Requests per model inside its scheduler at once (default: 2 batches per variant); more wait in "
                   "the priority queue.")
@click.option("--max-queue", type=click.IntRange(min=0), default=1024, show_default=True,
              help="Requests per model waiting for a slot; one more gets 429 (0: none wait).")
@click.option("--max-body-bytes", type=click.IntRange(min=1024), default=64 * 1024 * 1024, show_default=True,
              help="Largest HTTP request body (compressed and inflated) and gRPC message.")
@click.option("--max-connections", type=click.IntRange(min=1), default=1024, show_default=True,
              help="Concurrent HTTP connections and gRPC calls; beyond that HTTP answers 503.")
@click.option("--max-connections-per-client", type=click.IntRange(min=1), default=None,
              help="HTTP connections one client address may hold open at once; one more is answered 503 and closed "
                   "(nginx's limit_conn). Default: off (behind a load balancer every client is one address).")
@click.option("--priority-levels", type=click.IntRange(min=1), default=3, show_default=True,
              help="Triton priority levels: 1 is the highest.")
@click.option("--default-priority", type=click.IntRange(min=1), default=2, show_default=True,
              help="Level of requests with priority 0 or none.")
@click.option("--drain-timeout", type=FiniteFloat(min=0), default=10.0, show_default=True,
              help="Seconds SIGTERM lets queued requests run before rejecting the rest.")
@click.option("--body-timeout", type=FiniteFloat(min=0, min_open=True), default=30.0, show_default=True,
              help="Seconds an HTTP request's head, and then its body, may each take to arrive; a stalled head closes "
                   "the connection, a stalled body gets 408 (a stalled client holds nothing).")
@click.option("--auth-token-file", type=click.Path(dir_okay=False), default=None,
              help="Require 'Authorization: Bearer <token in this file>' (HTTP and gRPC; health stays open).")
@click.option("--tls-cert", type=click.Path(dir_okay=False), default=None, help="PEM certificate (HTTP and gRPC).")
@click.option("--tls-key", type=click.Path(dir_okay=False), default=None, help="PEM private key.")
@click.option("--http-impl", type=click.Choice(["auto", "httptools", "h11"]), default="auto", show_default=True,
              help="HTTP/1.1 parser (uvicorn's): auto = httptools when installed, else h11.")
@click.option("--log-format", type=click.Choice(["text", "json"]), default="text", show_default=True)
@click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]), default="info",
              show_default=True)
def serve(bundles: tuple[str, ...], host: str, http_port: int | None, grpc_port: int | None,
          metrics_port: int | None, variant: str | None, cascade: bool, budget_ms: float | None,
          max_batch: int | None, threads: int | None, instances: int | None, reserve_cores: int, spare_pause_cores: float,
          pin_instances: bool, standby: bool, worker_nice: int,
          max_inflight: int | None, max_queue: int,
          max_body_bytes: int, max_connections: int, max_connections_per_client: int | None, priority_levels: int, default_priority: int,
          drain_timeout: float, body_timeout: float, auth_token_file: str | None, tls_cert: str | None, tls_key: str | None,
          http_impl: str, log_format: str, log_level: str) -> None:
    """Serve BUNDLE... over the Open Inference Protocol (KServe v2): HTTP/REST and gRPC, with latency budgets.

    Any v2 client works, e.g. tritonclient.http.InferenceServerClient("localhost:8000").infer(
    "all-minilm-l6-v2", inputs, parameters={"budget_ms": 15}, priority=1). See docs/serve.md.
    """
    try:
        from ..serve import ServeConfig, run
    except ModuleNotFoundError as e:
        raise DsedgeError(f"`dsedge serve` needs the Python package {e.name!r}, which is not installed",
                          "pip install 'dsedge[serve]'") from None
    cfg = ServeConfig(bundles=bundles, host=host, http_port=http_port, grpc_port=grpc_port,
                      metrics_port=metrics_port, variant=variant, cascade=cascade, budget_ms=budget_ms,
                      max_batch=max_batch, threads=threads, instances=instances, reserve_cores=reserve_cores,
                      spare_pause_cores=spare_pause_cores, pin_instances=pin_instances, standby=standby,
                      worker_nice=worker_nice,
                      max_inflight=max_inflight, max_queue=max_queue,
                      max_body_bytes=max_body_bytes, max_connections=max_connections,
                      max_connections_per_client=max_connections_per_client,
                      priority_levels=priority_levels, default_priority=default_priority,
                      drain_timeout_s=drain_timeout, body_timeout_s=body_timeout, auth_token_file=auth_token_file, tls_cert=tls_cert,
                      tls_key=tls_key, log_format=log_format, log_level=log_level,
                      http_impl=http_impl)
    code = run(cfg)
    if code:
        raise SystemExit(code)
