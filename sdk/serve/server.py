"""One process, one asyncio loop: uvicorn (HTTP, and /metrics on its own port) and grpc.aio share it; each model's
``Session`` runs its batches on its own worker threads, so the loop only parses, admits and encodes.

Lifecycle:
  1. bind every port (live from here; ``/v2/health/ready`` says 503),
  2. load and profile every bundle off the loop, move the heap built so far out of the garbage collector's view
     (``freeze_startup_heap``), then print the ready line on stdout::

         dsedge serve ready http=127.0.0.1:8000 grpc=127.0.0.1:8001 metrics=127.0.0.1:8002 models=a,b

  3. on SIGTERM/SIGINT: stop admitting (new requests and those waiting for a slot get 503/UNAVAILABLE
     "shutdown"), let each session answer what it has queued, rejecting what is left after ``drain_timeout_s``,
     wait for every in-flight response to be written, close the listeners and exit 0.
"""
from __future__ import annotations

import asyncio
import contextlib
import contextvars
import errno
import gc
import json
import logging
import math
import signal
import socket
import ssl
import sys
import time
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

from ..runtime.errors import ConfigError, DsedgeError
from ..runtime.instances import MAX_THREADS_PER_CORE, host_cores
from .client_cap import with_client_cap
from .head_timeout import protocol_base, with_head_timeout
from ..runtime.io import is_integer, is_real

log = logging.getLogger("dsedge.serve")


@dataclass
class ServeConfig:
    """Everything ``dsedge serve`` takes (see ``dsedge serve --help`` for each option)."""

    bundles: Sequence[str]
    host: str = "127.0.0.1"
    http_port: int | None = 8000
    grpc_port: int | None = 8001
    metrics_port: int | None = 8002
    variant: str | None = None
    cascade: bool = False
    budget_ms: float | None = None
    max_batch: int | None = None
    threads: int | None = None
    instances: int | None = None
    reserve_cores: int = 0  # cores the default instance layout leaves to the event loop (dsedge.load's reserve_cores)
    spare_pause_cores: float = 0.3  # pause the spare instances while the front end uses more CPU than this (0: never)
    pin_instances: bool = True  # pin each 1-thread instance's worker to a core of its own (dsedge.load's)
    # a request refused for overload waits for an instance that frees in time (dsedge.load's; off here: docs/serve.md)
    standby: bool = False
    worker_nice: int = 0  # added to the batch workers' nice value (runtime/thread_priority.py); opt-in, see docs/serve.md
    max_inflight: int | None = None
    max_queue: int = 1024
    max_body_bytes: int = 64 * 1024 * 1024
    max_connections: int = 1024
    max_connections_per_client: int | None = None  # HTTP, per peer address (sdk/serve/client_cap.py); off
    priority_levels: int = 3
    default_priority: int = 2
    drain_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    auth_token_file: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    log_format: str = "text"
    log_level: str = "info"
    http_impl: str = "auto"  # uvicorn's HTTP/1.1 parser: "auto" (httptools when installed), "h11", "httptools"

    def __post_init__(self) -> None:
        """Refuse a bad number before anything starts. Raises ConfigError (option, value and the range)."""
        def bad(option: str, value: Any, wanted: str, example: str) -> ConfigError:
            return ConfigError(f"{option} {value!r} is not {wanted}", f"e.g. {option} {example}")

        if self.budget_ms is not None and not (_finite(self.budget_ms) and self.budget_ms > 0):
            raise bad("--budget-ms", self.budget_ms, "a finite number of milliseconds > 0", "15")
        if not (_finite(self.drain_timeout_s) and self.drain_timeout_s >= 0):
            raise bad("--drain-timeout", self.drain_timeout_s, "a finite number of seconds >= 0", "10")
        if not (_finite(self.spare_pause_cores) and self.spare_pause_cores >= 0):
            raise bad("--spare-pause-cores", self.spare_pause_cores, "a finite number of cores >= 0", "0.3")
        if not (_finite(self.body_timeout_s) and self.body_timeout_s > 0):
            raise bad("--body-timeout", self.body_timeout_s, "a finite number of seconds > 0", "30")
        for option, value, least in (("--max-batch", self.max_batch, 1), ("--threads", self.threads, 1),
                                     ("--instances", self.instances, 1),
                                     ("--reserve-cores", self.reserve_cores, 0),
                                     ("--worker-nice", self.worker_nice, 0),
                                     ("--max-inflight", self.max_inflight, 1), ("--max-queue", self.max_queue, 0),
                                     ("--max-body-bytes", self.max_body_bytes, 1024),
                                     ("--max-connections", self.max_connections, 1),
                                     ("--max-connections-per-client", self.max_connections_per_client, 1),
                                     ("--priority-levels", self.priority_levels, 1),
                                     ("--default-priority", self.default_priority, 1)):
            if value is not None and not (is_integer(value) and value >= least):
                raise bad(option, value, f"an integer >= {least}", str(max(least, 2)))
        if not (is_integer(self.worker_nice) and self.worker_nice <= 19):
            raise bad("--worker-nice", self.worker_nice, "an integer in 0..19", "5")
        most = MAX_THREADS_PER_CORE * host_cores()  # each is an OS thread per variant (threads=100000 ran out of pids)
        if self.threads is not None and self.threads > most:
            raise bad("--threads", self.threads, f"an integer in 1..{most} ({MAX_THREADS_PER_CORE} per core here)",
                      "2")
        for flag, value in (("pin-instances", self.pin_instances), ("standby", self.standby)):
            if not isinstance(value, bool):
                raise ConfigError(f"--{flag} {value!r} is not True or False", f"pass --{flag} or --no-{flag}")
        taken: dict[int, str] = {}
        for option, port in (("--http-port", self.http_port), ("--grpc-port", self.grpc_port),
                             ("--metrics-port", self.metrics_port)):
            if port is not None and not (is_integer(port) and 0 <= port <= 65535):
                raise bad(option, port, "a port in 0..65535 (0 = any free port) or None (off)", "0")
            if port and port in taken:
                raise ConfigError(f"{taken[port]} and {option} are both {port}: each listener needs its own port",
                                  "give them different ports, or 0 for any free one")
            if port:
                taken[port] = option
        if self.http_port is None and self.grpc_port is None:
            raise ConfigError("--http-port and --grpc-port are both off: the server would take no requests",
                              "leave one on, e.g. --grpc-port 8001")


def _finite(x: Any) -> bool:
    return is_real(x) and math.isfinite(x)


@dataclass
class ServerState:
    """Shared by the front ends: ``draining`` after SIGTERM, ``active`` infer calls, and ``lag_ms``, the event
    loop's scheduling delay (time a request waits before its handler runs, which no budget check can see; exported
    as ``dsedge_event_loop_lag_seconds``: when it nears the budgets, the process is CPU-bound before admission)."""

    draining: bool = False
    active: int = 0
    lag_ms: float = 0.0
    stopping: asyncio.Future | None = None  # done with ``draining`` (one future for all: cuts body reads short)

    def drain(self) -> None:
        self.draining = True
        if self.stopping is not None and not self.stopping.done():
            self.stopping.set_result(None)

    async def watch_loop(self, interval_s: float = 0.02) -> None:
        """Track ``lag_ms``: how late a ``sleep(interval_s)`` wakes up; rises at once, decays over ~10 ticks."""
        while True:
            t0 = time.perf_counter()
            await asyncio.sleep(interval_s)
            lag = max(0.0, (time.perf_counter() - t0 - interval_s) * 1e3)
            self.lag_ms = lag if lag > self.lag_ms else self.lag_ms + 0.1 * (lag - self.lag_ms)

    @contextlib.contextmanager
    def track(self) -> Iterator[None]:
        self.active += 1
        try:
            yield
        finally:
            self.active -= 1


class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        d = {"ts": round(record.created, 3), "level": record.levelname.lower(), "logger": record.name,
             "msg": record.getMessage()}
        d.update(getattr(record, "fields", {}) or {})
        if record.exc_info:
            d["exc"] = self.formatException(record.exc_info)
        return json.dumps(d, default=str)


class _TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        base = super().format(record)
        fields = getattr(record, "fields", None)
        return base + ("".join(f" {k}={v}" for k, v in fields.items()) if fields else "")


# which uvicorn server (HTTP, or /metrics on its own port) a task serves: uvicorn logs both to "uvicorn.error"
_listener: contextvars.ContextVar[str | None] = contextvars.ContextVar("dsedge_serve_listener", default=None)
_PROCESS_LINES = ("Started server process", "Finished server process")   # about the process, not one listener


class _OneLinePerProcess(logging.Filter):
    """Each uvicorn server logs "Started/Finished server process [pid]": keep those of the first listener only,
    and name the listener (``listener=metrics``) on its other lines ("Shutting down", errors)."""

    def __init__(self) -> None:
        super().__init__()
        self.first: str | None = None

    def filter(self, record: logging.LogRecord) -> bool:
        kind = _listener.get()
        if kind is None or not record.name.startswith("uvicorn"):
            return True
        if str(record.msg).startswith(_PROCESS_LINES):
            self.first = self.first or kind
            return kind == self.first
        fields = getattr(record, "fields", None) or {}
        record.fields = {**fields, "listener": kind}
        return True


def setup_logging(fmt: str, level: str) -> None:
    """One stderr handler (text or JSON lines) for the ``dsedge`` and uvicorn loggers; nothing propagates to the
    root logger, so each line is printed once."""
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(_OneLinePerProcess())
    handler.setFormatter(_JsonFormatter() if fmt == "json" else
                         _TextFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    for name in ("dsedge", "uvicorn", "uvicorn.error"):
        lg = logging.getLogger(name)
        lg.handlers[:] = [handler]
        lg.propagate = False
        lg.setLevel(level.upper())
    logging.getLogger("uvicorn.access").disabled = True


def _socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY on accepted sockets only then (else Nagle + delayed ACK: +40 ms)
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        hint = ("pick another port, or 0 for any free one" if e.errno in (errno.EADDRINUSE, errno.EACCES) else
                "--host must be an address of this machine, e.g. 127.0.0.1, 0.0.0.0 or ::1 (no brackets)")
        raise ConfigError(f"cannot bind {host}:{port}: {e.strerror}", hint) from None
    sock.set_inheritable(True)
    return sock


def _fmt(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def freeze_startup_heap() -> int:
    """Collect once, then move every object alive after loading (modules, ONNX Runtime wrappers, the bundles'
    manifests, the web frameworks' tables: about 60,000 objects) into the permanent generation with
    ``gc.freeze()`` (Python docs, ``gc`` module: "freeze all the objects tracked by the garbage collector; move them
    to a permanent generation and ignore them in all the future collections"). Returns how many were frozen.

    Why: without it, the first full (generation-2) collection under traffic walks that whole heap while holding the
    GIL. Measured on the 2-core development VM through ``dsedge serve`` at 3x the batch-1 rate: one such
    collection per 8 s window, 31-56 ms wall each, i.e. a whole 50 ms budget for every request in flight; with the
    heap frozen the same collections took about 1 ms. Objects created later are collected as usual. Frozen objects
    are never freed: fine here, because the server loads its models once and never unloads one (a model control
    API that did would have to ``gc.unfreeze()`` first)."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


async def serve(cfg: ServeConfig) -> int:
    """Run the server until SIGTERM/SIGINT; returns the exit code. Raises DsedgeError for a bad configuration."""
    import uvicorn

    from .. import __version__
    from .auth import TokenCheck
    from .grpc_service import build_server
    from .http import build_app
    from .metrics import ServeMetrics
    from .models import Repository
    from .priority import PriorityLevels

    if (cfg.tls_cert is None) != (cfg.tls_key is None):
        raise ConfigError("--tls-cert and --tls-key go together", "pass both, or neither")
    try:
        levels = PriorityLevels(cfg.priority_levels, cfg.default_priority)
    except ValueError as e:
        raise ConfigError(str(e), "e.g. --priority-levels 3 --default-priority 2") from None
    auth = TokenCheck.from_file(cfg.auth_token_file) if cfg.auth_token_file else None
    tls = None
    if cfg.tls_cert:
        try:
            tls = (open(cfg.tls_key, "rb").read(), open(cfg.tls_cert, "rb").read())
        except OSError as e:
            raise ConfigError(f"cannot read TLS file {e.filename}: {e.strerror}", "pass PEM files") from None
        try:  # what both listeners will load: a bad pair is refused here, not as a bind error of gRPC's
            ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(cfg.tls_cert, cfg.tls_key)
        except ssl.SSLError as e:
            raise ConfigError(f"--tls-cert {cfg.tls_cert} and --tls-key {cfg.tls_key} are not a PEM certificate and "
                              f"its private key ({e.reason or e})", "pass the PEM files of one certificate") from None

    metrics = ServeMetrics()
    if auth is not None:
        auth.on_denied = lambda protocol: metrics.failed("", protocol, "invalid", "unauthenticated")
    repo = Repository(cfg.bundles, metrics, variant=cfg.variant, cascade=cfg.cascade, budget_ms=cfg.budget_ms,
                      max_batch=cfg.max_batch, threads=cfg.threads, instances=cfg.instances, max_inflight=cfg.max_inflight,
                      max_queue=cfg.max_queue, levels=levels, worker_nice=cfg.worker_nice,
                      reserve_cores=cfg.reserve_cores, pin_instances=cfg.pin_instances, standby=cfg.standby)
    repo.check()  # before any port is bound: a bad --variant or --max-batch is one line, not a failed start
    state = ServerState(stopping=asyncio.get_running_loop().create_future())
    extensions = ["binary_tensor_data", "model_configuration", "statistics"]  # Triton's extension names

    def server_metadata() -> dict[str, Any]:
        return {"name": "dsedge", "version": __version__, "extensions": extensions}

    class _Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:  # the loop's own handlers below drain first
            yield

    metrics.loop_lag.set_function(lambda: state.lag_ms / 1e3)
    watcher = asyncio.ensure_future(state.watch_loop())
    governor = None
    if cfg.spare_pause_cores > 0:
        from .spares import SpareGovernor

        governor = asyncio.ensure_future(SpareGovernor(lambda: [m.session for m in repo.models.values()],
                                                       cfg.spare_pause_cores, cfg.spare_pause_cores / 2).run())
    servers: list[tuple[Any, asyncio.Task]] = []
    listening: dict[str, str] = {}  # kind → host:port, for the ready line
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    def http_server(app: Any, port: int, kind: str) -> None:
        sock = _socket(cfg.host, port)
        # a request head not complete within --body-timeout closes its connection (slowloris: sdk/serve/head_timeout.py)
        protocol = with_head_timeout(protocol_base(cfg.http_impl), cfg.body_timeout_s)
        if cfg.max_connections_per_client is not None and kind == "http":  # one client cannot take every slot
            protocol = with_client_cap(protocol, cfg.max_connections_per_client, on_refuse=lambda: metrics.failed(
                "", "http", "rejected", "too_many_connections"))
        conf = uvicorn.Config(app, log_config=None, access_log=False, lifespan="off", loop="asyncio", http=protocol,
                              # uvicorn counts the connection being served: N + 1 lets N in, not N - 1
                              limit_concurrency=cfg.max_connections + 1, timeout_keep_alive=5,
                              # after the drain: a connection still open (a half-sent body) is closed 2 s on
                              timeout_graceful_shutdown=2.0,
                              ssl_certfile=cfg.tls_cert if kind == "http" else None,
                              ssl_keyfile=cfg.tls_key if kind == "http" else None)
        srv = _Server(conf)
        token = _listener.set(kind)   # the task copies the context: its uvicorn log lines know their listener
        try:
            servers.append((srv, asyncio.ensure_future(srv.serve(sockets=[sock]))))
        finally:
            _listener.reset(token)
        listening[kind] = _fmt(cfg.host, sock.getsockname()[1])

    if cfg.http_port is not None:
        http_server(build_app(repo, state, max_body=cfg.max_body_bytes, auth=auth, server_metadata=server_metadata,
                              body_timeout_s=cfg.body_timeout_s), cfg.http_port, "http")
    if cfg.metrics_port is not None:
        http_server(metrics.asgi_app(), cfg.metrics_port, "metrics")
    for srv, task in servers:
        while not srv.started and not task.done():
            await asyncio.sleep(0.01)
        if task.done():
            task.result()
            raise ConfigError("an HTTP listener failed to start", "see the log above")
    # gRPC last: every refusal above comes before a grpc.aio server exists (one left behind on an error logs a
    # traceback from its __del__ once the loop is closed)
    grpc_server = None
    if cfg.grpc_port is not None:
        addr = _fmt(cfg.host, cfg.grpc_port)
        if cfg.grpc_port:  # a taken port is refused here, before gRPC core logs a raw error line of its own
            _socket(cfg.host, cfg.grpc_port).close()
        grpc_server = build_server(repo, state, max_message=cfg.max_body_bytes, max_rpcs=cfg.max_connections,
                                   interceptors=[auth.grpc_interceptor()] if auth else [],
                                   server_metadata=server_metadata)
        try:
            port = (grpc_server.add_secure_port(addr, __import__("grpc").ssl_server_credentials([tls])) if tls
                    else grpc_server.add_insecure_port(addr))
        except RuntimeError as e:
            await grpc_server.stop(None)
            raise ConfigError(f"cannot bind gRPC {addr}: {e}", "pick another --grpc-port, or 0") from None
        await grpc_server.start()
        listening["grpc"] = _fmt(cfg.host, port)

    code = 0
    t0 = time.perf_counter()
    load = asyncio.ensure_future(asyncio.to_thread(repo.load))
    waiter = asyncio.ensure_future(stop.wait())
    await asyncio.wait({load, waiter}, return_when=asyncio.FIRST_COMPLETED)
    if load.done() and load.exception() is None:
        parts = " ".join(f"{k}={listening[k]}" for k in ("http", "grpc", "metrics") if k in listening)
        line = f"dsedge serve ready {parts} models={','.join(repo.names)}"
        frozen = freeze_startup_heap()
        log.info("ready", extra={"fields": {"load_s": round(time.perf_counter() - t0, 3), "tls": tls is not None,
                                            "auth": auth is not None, "gc_frozen": frozen}})
        print(line, flush=True)
        await waiter
    elif load.done():
        err = load.exception()
        log.error("loading failed: %s", err)
        code = 2
        waiter.cancel()
        if isinstance(err, DsedgeError):
            from ..cli import report_error

            report_error(err)
    else:
        await asyncio.wait({load})  # a bundle still loading: let it finish before the sessions close
    # -- drain ------------------------------------------------------------------------------------------------
    t_drain = time.perf_counter()
    state.drain()
    repo.stop_admitting()
    log.info("draining", extra={"fields": {"active": state.active, "timeout_s": cfg.drain_timeout_s}})
    await asyncio.to_thread(repo.close, cfg.drain_timeout_s)
    t_end = time.perf_counter() + 2.0
    while state.active and time.perf_counter() < t_end:  # every answer or rejection written back
        await asyncio.sleep(0.01)
    for srv, _ in servers:
        srv.should_exit = True
    if grpc_server is not None:
        await grpc_server.stop(grace=1.0)
    await asyncio.gather(*(t for _, t in servers), return_exceptions=True)
    watcher.cancel()
    if governor is not None:
        governor.cancel()
    log.info("stopped", extra={"fields": {"drain_s": round(time.perf_counter() - t_drain, 3),
                                          "unanswered": state.active}})
    return code


def run(cfg: ServeConfig) -> int:
    setup_logging(cfg.log_format, cfg.log_level)
    return asyncio.run(serve(cfg))
