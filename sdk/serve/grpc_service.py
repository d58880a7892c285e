"""The KServe v2 gRPC service (``inference.GRPCInferenceService``) on ``grpc.aio``.

Implemented: ServerLive, ServerReady, ServerMetadata, ModelReady, ModelMetadata, ModelInfer, and for Triton's tools
ModelConfig, RepositoryIndex and ModelStatistics (the dicts of model_config.py parsed into the messages). Every
other method of the service (ModelStreamInfer, model load/unload, shared memory, trace, logging, …) answers
UNIMPLEMENTED. The message classes and the servicer base are the stubs generated from the v2 ``grpc_service.proto``
that ``tritonclient[grpc]`` ships.

ModelInfer takes ``raw_input_contents`` (what tritonclient sends) or the typed ``contents`` fields, and answers
with ``raw_output_contents`` (little-endian, row-major), as Triton does. Errors end the call with the status code
of ``protocol.ServeError``, its message as the details and the reason in the trailing metadata key
``dsedge-reason`` (set on the context and returned, not raised: ``context.abort`` costs a quarter more CPU per
call, which counts when an overloaded server refuses most calls).

A call's gRPC deadline (the client's ``timeout``/``client_timeout``) caps its budget: the server learns from it how
long the call waited in gRPC's own queue before this handler ran, which no server-side clock sees (see
``ServedModel.infer``). The way-back reserve is timed from the backend's answer to the call's end (the RPC's done
callback), so it includes sending the response.
"""
from __future__ import annotations

import logging
import math
import time
from typing import Any, Callable

import grpc
import numpy as np
from google.protobuf import json_format
from tritonclient.grpc import model_config_pb2
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc as pb_grpc

from .model_config import repository_index
from .models import VERSION, Repository
from .protocol import NUMPY_OF_V2, ServeError, check_no_shared_memory, check_shape, from_list, from_raw, invalid, \
    rejection, v2_datatype

log = logging.getLogger("dsedge.serve")

# typed ``contents`` field per v2 datatype (FP16 has none: raw only)
_CONTENTS = {"BOOL": "bool_contents", "INT8": "int_contents", "INT16": "int_contents", "INT32": "int_contents",
             "INT64": "int64_contents", "UINT8": "uint_contents", "UINT16": "uint_contents",
             "UINT32": "uint_contents", "UINT64": "uint64_contents", "FP32": "fp32_contents",
             "FP64": "fp64_contents"}


def _param_value(p: Any) -> Any:
    kind = p.WhichOneof("parameter_choice")
    return None if kind is None else getattr(p, kind)


def _set_param(p: Any, value: Any) -> None:
    if isinstance(value, bool):
        p.bool_param = value
    elif isinstance(value, int):
        p.int64_param = value
    elif isinstance(value, float):
        p.double_param = value
    else:
        p.string_param = str(value)


def _from_contents(t: Any) -> np.ndarray:
    """An input's typed ``contents`` → ndarray. Raises ServeError(400) naming the tensor, its datatype and the
    contents field it needs when the data is in another field (or in several), or missing, or the wrong size: as
    Triton, which reads only the datatype's own field and refuses data anywhere else."""
    datatype = t.datatype.upper()
    field = _CONTENTS.get(datatype)
    if field is None:
        if datatype not in NUMPY_OF_V2:
            from_raw(t.name, t.datatype, list(t.shape), b"")  # raises the datatype error
        raise invalid(f"input {t.name!r} ({datatype}): {datatype} has no typed contents field, send it in "
                      "raw_input_contents")
    shape = check_shape(t.name, list(t.shape))
    given = [f.name for f, _ in t.contents.ListFields()]  # the non-empty fields, in declaration order
    if any(g != field for g in given):
        where = " and ".join(given)
        raise invalid(f"input {t.name!r} ({datatype}): data in {where}, expected {field} (the contents field of "
                      f"{datatype}) or raw_input_contents")
    values = list(getattr(t.contents, field))
    size = math.prod(shape)
    if len(values) != size:
        if not values:
            raise invalid(f"input {t.name!r} ({datatype}) has no data: send its {size} values in {field} or "
                          "raw_input_contents")
        raise invalid(f"input {t.name!r} ({datatype}): {len(values)} values in {field} for shape {list(shape)} "
                      f"(expected {size})")
    return from_list(t.name, t.datatype, list(shape), values)


def decode_inputs(request: Any) -> dict[str, np.ndarray]:
    inputs: dict[str, np.ndarray] = {}
    raw = list(request.raw_input_contents)
    for t in request.inputs:  # before the count check: a region's input has no raw contents of its own
        check_no_shared_memory(f"input {t.name!r}", t.parameters)
    if raw and len(raw) != len(request.inputs):
        raise invalid(f"{len(raw)} raw_input_contents for {len(request.inputs)} inputs")
    for i, t in enumerate(request.inputs):
        if t.name in inputs:
            raise invalid(f"input {t.name!r} is given twice")
        if raw:
            if t.HasField("contents"):  # as Triton: one or the other, never both (which one would be meant?)
                raise invalid(f"input {t.name!r} has typed contents and the request has raw_input_contents: "
                              "send one or the other")
            inputs[t.name] = from_raw(t.name, t.datatype, list(t.shape), raw[i])
            continue
        inputs[t.name] = _from_contents(t)
    if not inputs:
        raise invalid("the request has no inputs")
    return inputs


class InferenceServicer(pb_grpc.GRPCInferenceServiceServicer):
    def __init__(self, repo: Repository, state: Any, server_metadata: Callable[[], dict[str, Any]]) -> None:
        self.repo = repo
        self.state = state
        self.server_metadata = server_metadata

    async def _abort(self, context: Any, e: ServeError) -> None:
        await context.abort(grpc.StatusCode[e.code], e.message, (("dsedge-reason", e.reason),))

    @staticmethod
    def _refuse(context: Any, e: ServeError) -> Any:
        context.set_code(grpc.StatusCode[e.code])
        context.set_details(e.message)
        context.set_trailing_metadata((("dsedge-reason", e.reason),))
        return pb.ModelInferResponse()

    async def ServerLive(self, request: Any, context: Any) -> Any:
        return pb.ServerLiveResponse(live=True)

    async def ServerReady(self, request: Any, context: Any) -> Any:
        return pb.ServerReadyResponse(ready=self.repo.ready and not self.state.draining)

    async def ServerMetadata(self, request: Any, context: Any) -> Any:
        md = self.server_metadata()
        return pb.ServerMetadataResponse(name=md["name"], version=md["version"], extensions=md["extensions"])

    async def ModelReady(self, request: Any, context: Any) -> Any:
        # as Triton: a version that is not an integer is INVALID_ARGUMENT; an unknown model or version, like one
        # still loading, is an answer (ready: false, the reason in the trailing metadata), not an error, so a
        # client polling is_model_ready gets False where Triton's would
        if request.version and not (request.version.isascii() and request.version.isdigit()):
            await self._abort(context, invalid(f"model version must be an integer (versions of {request.name!r}: "
                                               f"{VERSION}), got {request.version!r:.40}"))
        try:
            m = self.repo.get(request.name, request.version)
        except ServeError as e:
            context.set_trailing_metadata((("dsedge-reason", e.reason),))
            return pb.ModelReadyResponse(ready=False)
        return pb.ModelReadyResponse(ready=m.ready and not self.state.draining)

    async def ModelMetadata(self, request: Any, context: Any) -> Any:
        try:
            md = self.repo.get(request.name, request.version).metadata()
        except ServeError as e:
            await self._abort(context, e)
        tensors = lambda ts: [pb.ModelMetadataResponse.TensorMetadata(**t) for t in ts]  # noqa: E731
        return pb.ModelMetadataResponse(name=md["name"], versions=md["versions"], platform=md["platform"],
                                        inputs=tensors(md["inputs"]), outputs=tensors(md["outputs"]))

    async def ModelConfig(self, request: Any, context: Any) -> Any:
        try:
            cfg = self.repo.get(request.name, request.version).config()
        except ServeError as e:
            await self._abort(context, e)
        return pb.ModelConfigResponse(config=json_format.ParseDict(cfg, model_config_pb2.ModelConfig()))

    async def RepositoryIndex(self, request: Any, context: Any) -> Any:
        index = repository_index(self.repo, VERSION, self.state.draining, request.ready)
        return pb.RepositoryIndexResponse(models=[pb.RepositoryIndexResponse.ModelIndex(**m) for m in index])

    async def ModelStatistics(self, request: Any, context: Any) -> Any:
        try:
            ms = [self.repo.get(request.name, request.version)] if request.name else list(self.repo.models.values())
        except ServeError as e:
            await self._abort(context, e)
        stats = {"model_stats": [m.stats.json(m.name, VERSION) for m in ms]}
        return json_format.ParseDict(stats, pb.ModelStatisticsResponse())

    async def ModelInfer(self, request: Any, context: Any) -> Any:
        received = time.perf_counter()
        remaining = context.time_remaining()  # None without a gRPC deadline
        m = None  # once known, every refusal is counted against it (infer() counts only answers and cancels)
        with self.state.track():
            try:
                if self.state.draining:
                    raise rejection("shutdown", "the server is shutting down")
                m = self.repo.get(request.model_name)
                m.check_version(request.model_version)  # counted against the model, once known
                params = {k: _param_value(v) for k, v in request.parameters.items()}
                for o in request.outputs:
                    check_no_shared_memory(f"output {o.name!r}", o.parameters)
                    if _param_value(o.parameters["classification"]) if "classification" in o.parameters else False:
                        raise invalid("the classification extension is not supported")
                names = [o.name for o in request.outputs] or None
                answer = await m.infer(lambda: decode_inputs(request), params, names, "grpc", received=received,
                                       transport_deadline=None if remaining is None else received + remaining,
                                       way_back_sent=True)
            except ServeError as e:
                (m if m is not None else self.repo).count_failure("grpc", e)
                if log.isEnabledFor(logging.DEBUG):
                    log.debug("infer refused", extra={"fields": {"model": request.model_name, "code": e.code,
                                                                 "reason": e.reason, "error": e.message}})
                return self._refuse(context, e)
        if answer.answered_at is not None:
            # the answer's way back, to the call's end (response and status handed to the transport), for the
            # reserve taken out of later budgets
            t_answer, way_back = answer.answered_at, m.way_back
            nbytes = sum(a.nbytes for a in answer.outputs.values())
            context.add_done_callback(lambda _: way_back.add((time.perf_counter() - t_answer) * 1e3, nbytes=nbytes))
        resp = pb.ModelInferResponse(model_name=m.name, model_version=VERSION, id=request.id)
        for k, v in answer.parameters.items():
            _set_param(resp.parameters[k], v)
        for name, arr in answer.outputs.items():
            resp.outputs.add(name=name, datatype=v2_datatype(arr.dtype.name), shape=list(arr.shape))
            resp.raw_output_contents.append(np.ascontiguousarray(arr, dtype=arr.dtype.newbyteorder("<")).tobytes())
        return resp


async def _unimplemented(self: Any, request: Any, context: Any) -> None:
    await context.abort(grpc.StatusCode.UNIMPLEMENTED, "dsedge serve implements ServerLive, ServerReady, "
                        "ServerMetadata, ModelReady, ModelMetadata, ModelInfer, ModelConfig, RepositoryIndex and "
                        "ModelStatistics only",
                        (("dsedge-reason", "unimplemented"),))


# every other method of the service: a plain UNIMPLEMENTED, not the generated base's NotImplementedError (which
# grpc logs with a traceback per call)
for _name, _fn in vars(pb_grpc.GRPCInferenceServiceServicer).items():
    if callable(_fn) and not _name.startswith("_") and _name not in vars(InferenceServicer):
        setattr(InferenceServicer, _name, _unimplemented)


def build_server(repo: Repository, state: Any, *, max_message: int, max_rpcs: int, interceptors: list,
                 server_metadata: Callable[[], dict[str, Any]]) -> Any:
    server = grpc.aio.server(
        interceptors=interceptors, maximum_concurrent_rpcs=max_rpcs,
        # requests are capped as HTTP bodies are; responses are not (HTTP's are not either): a capped response
        # failed the call after the model had run, and the server had counted it "ok"
        options=[("grpc.max_receive_message_length", max_message), ("grpc.max_send_message_length", -1),
                 ("grpc.so_reuseport", 0)])
    pb_grpc.add_GRPCInferenceServiceServicer_to_server(InferenceServicer(repo, state, server_metadata), server)
    return server
