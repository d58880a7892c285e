"""The KServe v2 REST API on Starlette (served by uvicorn), with Triton's binary-tensor extension.

Routes: ``GET /v2/health/live``, ``GET /v2/health/ready``, ``GET /v2``, ``GET /v2/models/{m}[/versions/{v}]``, ``GET
…/ready``, ``POST …/infer``; Triton's ``GET …/config``, ``GET /v2/models[/{m}[/versions/{v}]]/stats`` and ``POST
/v2/repository/index`` (sdk/serve/model_config.py). Errors are ``{"error": message, "reason": …}`` with the status
of ``protocol.ServeError``.

Binary tensors (Triton's ``binary_tensor_data`` extension): a request whose JSON header is followed by raw data says
so with ``Inference-Header-Content-Length: <json bytes>``; each binary input carries ``parameters.binary_data_size``
and the buffers follow the header in input order, little-endian, row-major. An output is returned binary when its
request entry has ``parameters.binary_data: true``, or, for outputs without that key, when the request has
``parameters.binary_data_output: true``; the response then has the same header and the buffers in output order.
Request bodies compressed with ``Content-Encoding: gzip``/``deflate`` are accepted; the size cap applies to the
compressed and the inflated body both.
"""
from __future__ import annotations

import asyncio
import json
import logging
import zlib
from typing import Any, Callable

import numpy as np
import orjson
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from .auth import TokenCheck
from .model_config import repository_index as index_of
from .models import VERSION, Repository
from .protocol import ServeError, check_no_shared_memory, from_list, from_raw, invalid, not_found, rejection, \
    v2_datatype

log = logging.getLogger("dsedge.serve")
_HEADER_LEN = "inference-header-content-length"
BODY_TIMEOUT_S = 30.0  # a request body must be complete this long after its handler starts, s


def _error(e: ServeError) -> JSONResponse:
    return JSONResponse({"error": e.message, "reason": e.reason}, status_code=e.status)


def _too_big(cap: int) -> ServeError:
    return ServeError(413, "RESOURCE_EXHAUSTED", f"request body over the {cap}-byte limit (--max-body-bytes)",
                      "too_large")


async def _read_body(request: Request, cap: int, timeout_s: float = BODY_TIMEOUT_S,
                     stopping: asyncio.Future | None = None) -> bytes:
    """The request body, inflated. ServeError: over ``cap`` (413), not complete within ``timeout_s`` (408), the
    client gone (499), the server stopping (``stopping`` set: 503 ``shutdown``, so a half-sent body does not hold
    the shutdown), not valid gzip/deflate (400)."""
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > cap:
        raise _too_big(cap)
    chunks: list[bytes] = []

    async def receive() -> None:
        size = 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > cap:
                raise _too_big(cap)
            chunks.append(chunk)

    reading = asyncio.ensure_future(receive())
    try:  # ``stopping`` is the server's one shared future: waited on, never cancelled here
        done, _ = await asyncio.wait({reading} if stopping is None else {reading, stopping}, timeout=timeout_s,
                                     return_when=asyncio.FIRST_COMPLETED)
    finally:
        reading.cancel()
    if reading not in done:  # a stalled or trickling client: its connection holds neither a slot nor the shutdown
        if stopping is not None and stopping.done():
            raise rejection("shutdown", "the server is shutting down")
        raise ServeError(408, "DEADLINE_EXCEEDED", f"request body not complete within {timeout_s:g} s",
                         "body_timeout")
    try:
        reading.result()
    except ClientDisconnect:
        raise ServeError(499, "CANCELLED", "the client closed the connection before the body was complete",
                         "cancelled") from None
    body = b"".join(chunks)
    encoding = request.headers.get("content-encoding", "identity").lower()
    if encoding in ("gzip", "deflate"):
        d = zlib.decompressobj(wbits=31 if encoding == "gzip" else 15)
        try:
            body = d.decompress(body, cap + 1)
        except zlib.error as e:
            raise invalid(f"request body is not valid {encoding} ({e})") from None
        if len(body) > cap or d.unconsumed_tail:
            raise _too_big(cap)
    elif encoding != "identity":
        raise invalid(f"Content-Encoding {encoding!r} is not supported (use gzip or deflate)")
    return body


async def _unless_the_client_leaves(request: Request, work: Any) -> Any:
    """``await work`` (a coroutine), or, if the client closes its connection first, cancel it and return None:
    ``ServedModel.infer`` counts a call cancelled while it waits as ``cancelled``, as gRPC's are. The body has been
    read, so the connection's next ASGI message is ``http.disconnect``; before this, a client that sent its whole
    body and left was answered into a closed socket and counted ``ok``, its batch run for nobody. (About 13 µs a
    call: a task watching the connection.)"""
    task = asyncio.ensure_future(work)
    left: list[bool] = []

    async def gone() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
        left.append(True)
        task.cancel()

    watch = asyncio.ensure_future(gone())
    try:
        return await task
    except asyncio.CancelledError:
        if left and not _cancelling():
            return None
        raise
    finally:
        watch.cancel()


def _cancelling() -> int:
    """How many cancellations of the running task are pending (the handler's own, e.g. at shutdown)."""
    t = asyncio.current_task()
    return t.cancelling() if t is not None else 0


def parse_infer_body(body: bytes, header_len: str | None) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """A v2 infer request body → (the JSON header, numpy inputs). Raises ServeError(400)."""
    if header_len is not None:
        if not (header_len.isascii() and header_len.isdigit()) or int(header_len) > len(body):
            raise invalid(f"Inference-Header-Content-Length {header_len!r} does not fit a {len(body)}-byte body")
        n = int(header_len)
        head, rest = body[:n], memoryview(body)[n:]
    else:
        head, rest = body, memoryview(b"")
    try:
        req = json.loads(head)
    except (ValueError, UnicodeDecodeError) as e:
        raise invalid(f"request body is not valid JSON ({e})") from None
    except RecursionError:
        raise invalid("request body nests JSON deeper than the parser allows") from None
    if not isinstance(req, dict) or not isinstance(req.get("inputs"), list) or not req["inputs"]:
        raise invalid("request must be a JSON object with a non-empty 'inputs' list")
    inputs: dict[str, np.ndarray] = {}
    offset = 0
    for t in req["inputs"]:
        if not isinstance(t, dict) or not isinstance(t.get("name"), str):
            raise invalid("each input must be an object with 'name', 'datatype', 'shape' and 'data'")
        name = t["name"]
        if name in inputs:
            raise invalid(f"input {name!r} is given twice")
        params = t.get("parameters") or {}
        if not isinstance(params, dict):
            raise invalid(f"input {name!r}: 'parameters' must be an object")
        check_no_shared_memory(f"input {name!r}", params)
        size = params.get("binary_data_size")
        if size is not None and "data" in t:  # as gRPC's contents + raw_input_contents: which one is meant?
            raise invalid(f"input {name!r} has both 'data' and parameters.binary_data_size: send it one way")
        if size is not None:
            if isinstance(size, bool) or not isinstance(size, int) or size < 0:
                raise invalid(f"input {name!r}: binary_data_size must be a byte count (an integer >= 0), "
                              f"got {size!r}")
            if offset + size > len(rest):
                raise invalid(f"input {name!r}: binary_data_size {size!r} runs past the end of the body")
            inputs[name] = from_raw(name, t.get("datatype", ""), t.get("shape"), bytes(rest[offset:offset + size]))
            offset += size
        elif "data" in t:
            inputs[name] = from_list(name, t.get("datatype", ""), t.get("shape"), t["data"])
        else:
            raise invalid(f"input {name!r} has neither 'data' nor parameters.binary_data_size")
    if offset != len(rest):
        raise invalid(f"{len(rest) - offset} bytes of binary data after the last binary input")
    return req, inputs


def _flag(params: dict[str, Any], key: str, where: str, default: bool = False) -> bool:
    """A boolean parameter: JSON true/false only (the string "false" is not false; Triton refuses it too)."""
    v = params.get(key, default)
    if not isinstance(v, bool):
        raise invalid(f"{where}: parameter {key!r} must be true or false, got {v!r:.40}")
    return v


def requested_outputs(req: dict[str, Any]) -> tuple[list[str] | None, dict[str, bool]]:
    """The ``outputs`` list (names, each once, or None for all) and which are asked for binary."""
    params = req.get("parameters") or {}
    default_binary = _flag(params, "binary_data_output", "the request") if isinstance(params, dict) else False
    outs = req.get("outputs")
    if outs is None:
        return None, {"*": default_binary}
    if not isinstance(outs, list):
        raise invalid("'outputs' must be a list of {\"name\": …} objects")
    names, binary = [], {"*": default_binary}
    for o in outs:
        if not isinstance(o, dict) or not isinstance(o.get("name"), str):
            raise invalid("each requested output must be an object with a 'name'")
        p = o.get("parameters") or {}
        if not isinstance(p, dict):
            raise invalid(f"output {o['name']!r}: 'parameters' must be an object")
        check_no_shared_memory(f"output {o['name']!r}", p)
        if p.get("classification"):
            raise invalid("the classification extension is not supported")
        flag = _flag(p, "binary_data", f"output {o['name']!r}", default_binary)
        if o["name"] in names:  # as Triton: a name asked for twice is answered once, as its first entry asks
            continue
        names.append(o["name"])
        binary[o["name"]] = flag
    return names, binary


# elements of JSON tensor data encoded per orjson call: each holds the interpreter lock about 2 ms here, so the
# event loop is not held by one long answer when it is encoded on a worker thread (``OFF_LOOP_ELEMENTS``)
_JSON_CHUNK = 1 << 16
# an answer with more JSON tensor elements than this is encoded on a worker thread, not on the event loop
OFF_LOOP_ELEMENTS = 1 << 16


def json_data(arr: np.ndarray) -> bytes:
    """The JSON array of ``arr``'s elements in row-major order, as the v2 protocol's ``data`` holds them.

    orjson writes numeric and bool arrays straight from their buffers, in chunks of ``_JSON_CHUNK`` elements, float32
    in its shortest round-trip form (a 32 × 256 × 384 float32 answer: 0.105 s and 34 MB, against 1.97 s and 62 MB
    through ``tolist`` and ``json.dumps``, which held the server's event loop for seconds: a user's pass,
    2026-12-06). Dtypes orjson does not take (float16) and arrays holding NaN or ±inf (orjson would write null) go
    through ``json.dumps``, which writes ``NaN``/``Infinity`` as before.
    """
    flat = np.ascontiguousarray(arr).reshape(-1)
    if flat.dtype.kind in "iub" or flat.dtype in (np.float32, np.float64):
        if flat.dtype.kind != "f" or bool(np.isfinite(flat).all()):
            try:
                parts = [orjson.dumps(flat[i:i + _JSON_CHUNK], option=orjson.OPT_SERIALIZE_NUMPY)[1:-1]
                         for i in range(0, flat.size, _JSON_CHUNK)]
                return b"[" + b",".join(parts) + b"]"
            except TypeError:  # a dtype this orjson does not serialize
                pass
    return json.dumps(flat.tolist(), separators=(",", ":")).encode()


def json_elements(outputs: dict[str, np.ndarray], binary: dict[str, bool]) -> int:
    """Elements ``encode_response`` writes as JSON text (the rest go as binary tensor data)."""
    return sum(int(a.size) for n, a in outputs.items() if not binary.get(n, binary["*"]))


def encode_response(model: str, req: dict[str, Any], outputs: dict[str, np.ndarray], parameters: dict[str, Any],
                    binary: dict[str, bool]) -> Response:
    """The v2 inference response: JSON, with each output's ``data`` (``json_data``) or, where ``binary`` asks, its
    bytes after the JSON head (the binary tensor data extension)."""
    blobs: list[bytes] = []
    entries = []
    for name, arr in outputs.items():
        e: dict[str, Any] = {"name": name, "datatype": v2_datatype(arr.dtype.name), "shape": list(arr.shape)}
        if binary.get(name, binary["*"]):
            raw = np.ascontiguousarray(arr, dtype=arr.dtype.newbyteorder("<")).tobytes()
            e["parameters"] = {"binary_data_size": len(raw)}
            blobs.append(raw)
            entries.append(json.dumps(e, separators=(",", ":")).encode())
        else:
            entries.append(json.dumps(e, separators=(",", ":")).encode()[:-1] + b',"data":' + json_data(arr) + b"}")
    rest: dict[str, Any] = {"parameters": parameters}
    if "id" in req:
        rest["id"] = req["id"]
    head = (b'{"model_name":' + json.dumps(model).encode() + b',"model_version":' + json.dumps(VERSION).encode()
            + b',"outputs":[' + b",".join(entries) + b"]," + json.dumps(rest, separators=(",", ":")).encode()[1:])
    if not blobs:
        return Response(head, media_type="application/json")
    return Response(head + b"".join(blobs), media_type="application/octet-stream",
                    headers={"Inference-Header-Content-Length": str(len(head))})


def build_app(repo: Repository, state: Any, *, max_body: int, auth: TokenCheck | None,
              server_metadata: Callable[[], dict[str, Any]], body_timeout_s: float = BODY_TIMEOUT_S) -> Any:
    """The ASGI app. ``state`` has ``draining`` (bool), ``stopping`` (a future done at SIGTERM, or None) and
    ``track()`` (a context manager counting live infers).
    A request body not complete within ``body_timeout_s`` is refused with 408 (``body_timeout``)."""

    async def live(request: Request) -> Response:
        return JSONResponse({"live": True})

    async def ready(request: Request) -> Response:
        ok = repo.ready and not state.draining
        return JSONResponse({"ready": ok}, status_code=200 if ok else 503)

    async def metadata(request: Request) -> Response:
        return JSONResponse(server_metadata())

    def model_view(view: Callable[[Any], dict]) -> Callable[[Request], Any]:
        """A GET handler answering ``view(model)`` as JSON for /v2/models/{model}[/versions/{version}][/…]."""
        async def handler(request: Request) -> Response:
            try:
                m = repo.get(request.path_params["model"], request.path_params.get("version"))
            except ServeError as e:
                return _error(e)
            return JSONResponse(view(m))
        return handler

    model_metadata = model_view(lambda m: m.metadata())
    model_config = model_view(lambda m: m.config())  # Triton's model configuration extension

    async def model_ready(request: Request) -> Response:
        try:
            m = repo.get(request.path_params["model"], request.path_params.get("version"))
        except ServeError as e:
            return _error(e)
        ok = m.ready and not state.draining
        return JSONResponse({"name": m.name, "ready": ok}, status_code=200 if ok else 503)


    async def repository_index(request: Request) -> Response:
        try:  # an optional body {"ready": bool}: only the models ready to infer
            body = await _read_body(request, 65536, body_timeout_s, state.stopping)
            req = json.loads(body) if body.strip() else {}
            if not isinstance(req, dict) or not isinstance(req.get("ready", False), bool):
                raise invalid("the repository index request must be an object, with 'ready' a boolean")
        except ServeError as e:
            return _error(e)
        except ValueError as e:
            return _error(invalid(f"the repository index request is not JSON: {e}"))
        return JSONResponse(index_of(repo, VERSION, state.draining, req.get("ready", False)))

    async def model_stats(request: Request) -> Response:
        name = request.path_params.get("model")
        try:
            ms = [repo.get(name, request.path_params.get("version"))] if name else list(repo.models.values())
        except ServeError as e:
            return _error(e)
        return JSONResponse({"model_stats": [m.stats.json(m.name, VERSION) for m in ms]})

    async def infer(request: Request) -> Response:
        name = request.path_params["model"]
        m = None  # once known, every refusal is counted against it (infer() counts only answers and cancels)
        with state.track():
            try:
                if state.draining:
                    raise rejection("shutdown", "the server is shutting down")
                m = repo.get(name)
                m.check_version(request.path_params.get("version"))  # counted against the model, once known
                body = await _read_body(request, max_body, body_timeout_s, state.stopping)
                req, inputs = parse_infer_body(body, request.headers.get(_HEADER_LEN))
                params = req.get("parameters") or {}
                if not isinstance(params, dict):
                    raise invalid("'parameters' must be an object")
                names, binary = requested_outputs(req)
                answer = await _unless_the_client_leaves(request, m.infer(inputs, params, names, "http"))
                if answer is None:  # counted by infer(); the connection is closed, so nothing is sent
                    return Response(status_code=499)
            except ServeError as e:
                (m if m is not None else repo).count_failure("http", e)
                log.debug("infer refused", extra={"fields": {"model": name, "status": e.status, "reason": e.reason,
                                                             "error": e.message}})
                return _error(e)
            if json_elements(answer.outputs, binary) > OFF_LOOP_ELEMENTS:  # not on the loop: others wait there
                return await asyncio.to_thread(encode_response, m.name, req, answer.outputs, answer.parameters,
                                               binary)
            return encode_response(m.name, req, answer.outputs, answer.parameters, binary)

    routes = [
        Route("/v2/health/live", live), Route("/v2/health/ready", ready), Route("/v2", metadata),
        Route("/v2/models/stats", model_stats),  # before /v2/models/{model}, which it would match
        Route("/v2/models/{model}", model_metadata), Route("/v2/models/{model}/versions/{version}", model_metadata),
        Route("/v2/models/{model}/ready", model_ready),
        Route("/v2/models/{model}/stats", model_stats),
        Route("/v2/models/{model}/versions/{version}/stats", model_stats),
        Route("/v2/models/{model}/config", model_config),
        Route("/v2/models/{model}/versions/{version}/config", model_config),
        Route("/v2/repository/index", repository_index, methods=["POST"]),
        Route("/v2/models/{model}/versions/{version}/ready", model_ready),
        Route("/v2/models/{model}/infer", infer, methods=["POST"]),
        Route("/v2/models/{model}/versions/{version}/infer", infer, methods=["POST"]),
    ]

    async def no_route(request: Request, exc: Exception) -> Response:
        # as every other error of this API: a JSON body (tritonclient parses it), not Starlette's plain text
        if getattr(exc, "status_code", 404) == 405:
            allowed = getattr(exc, "headers", None) or {}
            return _error(ServeError(405, "UNIMPLEMENTED", f"{request.method} is not allowed on {request.url.path}"
                                     + (f" (allowed: {allowed['Allow']})" if "Allow" in allowed else ""),
                                     "method_not_allowed"))
        return _error(not_found(f"no such endpoint {request.url.path!r}: dsedge serve implements health, "
                                "metadata, ready and infer of the KServe v2 protocol and Triton's model config, "
                                "repository index and statistics (docs/serve.md)"))

    app = Starlette(routes=routes, exception_handlers={404: no_route, 405: no_route})
    return app if auth is None else auth.asgi(app, open_paths=("/v2/health/",))
