"""A FAKE CUDA runtime (the cuda-python ``cudart`` module's calls dsedge makes) for tests: no GPU exists here.

"Device" and "pinned" memory are host buffers (ctypes) at real addresses, so copies are real ``memmove``s and an
engine can read its inputs back. Streams execute work as it is enqueued, except while capturing: then work is
recorded into a "graph", and ``cudaGraphLaunch`` replays it. Every call is counted in ``cudart.calls`` so a test
can assert how often buffers were allocated, copies made and streams synchronized.
"""
from __future__ import annotations

import ctypes
import enum
import types
from collections import Counter


def make_fake_cudart() -> types.ModuleType:
    rt = types.ModuleType("cudart")
    rt.__doc__ = "FAKE cudart (tests only)"
    rt.calls = Counter()
    rt.live = {}          # address → ctypes buffer (device or pinned)
    rt.kinds = {}         # address → "device" | "pinned"
    rt.capturing = {}     # stream handle → list of recorded ops, while capturing

    class cudaError_t(enum.IntEnum):
        cudaSuccess = 0
        cudaErrorMemoryAllocation = 2
        cudaErrorStreamCaptureUnsupported = 900

    class cudaMemcpyKind(enum.IntEnum):
        cudaMemcpyHostToDevice = 1
        cudaMemcpyDeviceToHost = 2

    class cudaStreamCaptureMode(enum.IntEnum):
        cudaStreamCaptureModeGlobal = 0

    class cudaStream_t:
        _next = 1

        def __init__(self):
            self.handle = cudaStream_t._next
            cudaStream_t._next += 1

        def __int__(self):
            return self.handle

    def _alloc(kind, size):
        buf = (ctypes.c_byte * int(size))()
        addr = ctypes.addressof(buf)
        rt.live[addr], rt.kinds[addr] = buf, kind
        return addr

    def cudaMalloc(size):
        rt.calls["cudaMalloc"] += 1
        return cudaError_t.cudaSuccess, _alloc("device", size)

    def cudaMallocHost(size):
        rt.calls["cudaMallocHost"] += 1
        return cudaError_t.cudaSuccess, _alloc("pinned", size)

    def _free(ptr, kind):
        rt.calls[f"cudaFree{'Host' if kind == 'pinned' else ''}"] += 1
        assert rt.kinds.get(int(ptr)) == kind, f"freeing {kind} memory that was not allocated as such"
        rt.live.pop(int(ptr)), rt.kinds.pop(int(ptr))
        return (cudaError_t.cudaSuccess,)

    rt.cudaFree = lambda ptr: _free(ptr, "device")
    rt.cudaFreeHost = lambda ptr: _free(ptr, "pinned")

    def enqueue(stream, op):
        """Run ``op`` now, or record it when ``stream`` is capturing (what the fake engine calls too)."""
        h = int(stream)
        if h in rt.capturing:
            rt.capturing[h].append(op)
        else:
            op()

    def cudaMemcpyAsync(dst, src, count, kind, stream):
        rt.calls["cudaMemcpyAsync"] += 1
        rt.calls[f"copy {cudaMemcpyKind(kind).name}"] += 1
        pinned = int(src) if kind == cudaMemcpyKind.cudaMemcpyHostToDevice else int(dst)
        assert rt.kinds.get(pinned) == "pinned", "async copies stage through pinned host memory"
        enqueue(stream, lambda: ctypes.memmove(int(dst), int(src), int(count)))
        return (cudaError_t.cudaSuccess,)

    def cudaStreamCreate():
        rt.calls["cudaStreamCreate"] += 1
        return cudaError_t.cudaSuccess, cudaStream_t()

    def cudaStreamDestroy(stream):
        rt.calls["cudaStreamDestroy"] += 1
        return (cudaError_t.cudaSuccess,)

    def cudaStreamSynchronize(stream):
        rt.calls["cudaStreamSynchronize"] += 1
        return (cudaError_t.cudaSuccess,)

    def cudaStreamBeginCapture(stream, mode):
        rt.calls["cudaStreamBeginCapture"] += 1
        if rt.refuse_capture:
            return (cudaError_t.cudaErrorStreamCaptureUnsupported,)
        rt.capturing[int(stream)] = []
        return (cudaError_t.cudaSuccess,)

    def cudaStreamEndCapture(stream):
        rt.calls["cudaStreamEndCapture"] += 1
        return cudaError_t.cudaSuccess, {"ops": rt.capturing.pop(int(stream), [])}

    def cudaGraphInstantiate(graph, flags):
        rt.calls["cudaGraphInstantiate"] += 1
        return cudaError_t.cudaSuccess, {"exec": graph["ops"]}

    def cudaGraphLaunch(graph_exec, stream):
        rt.calls["cudaGraphLaunch"] += 1
        for op in graph_exec["exec"]:
            enqueue(stream, op)
        return (cudaError_t.cudaSuccess,)

    def cudaGraphDestroy(graph):
        rt.calls["cudaGraphDestroy"] += 1
        return (cudaError_t.cudaSuccess,)

    def cudaGraphExecDestroy(graph_exec):
        rt.calls["cudaGraphExecDestroy"] += 1
        return (cudaError_t.cudaSuccess,)

    rt.refuse_capture = False
    for f in (cudaError_t, cudaMemcpyKind, cudaStreamCaptureMode, cudaStream_t, cudaMalloc, cudaMallocHost,
              cudaMemcpyAsync, cudaStreamCreate, cudaStreamDestroy, cudaStreamSynchronize, cudaStreamBeginCapture,
              cudaStreamEndCapture, cudaGraphInstantiate, cudaGraphLaunch, cudaGraphDestroy, cudaGraphExecDestroy,
              enqueue):
        setattr(rt, f.__name__, f)
    return rt
