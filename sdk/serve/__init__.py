"""``dsedge serve``: bundles behind the Open Inference Protocol (KServe v2) over HTTP/REST and gRPC.

Any v2 client (``tritonclient``, KServe's, Seldon's) works unchanged; dsedge's budget-aware scheduler sits behind
it. Per-request ``parameters.budget_ms`` (dsedge) and Triton's ``priority``/``timeout`` are honoured; every request
ends in an answer or an explicit rejection (429/503, RESOURCE_EXHAUSTED/UNAVAILABLE). Needs the ``serve`` extra
(starlette, uvicorn, grpcio, tritonclient's generated v2 stubs, prometheus-client). See docs/serve.md.
"""
from __future__ import annotations

from .server import ServeConfig, run, serve

__all__ = ["ServeConfig", "run", "serve"]
