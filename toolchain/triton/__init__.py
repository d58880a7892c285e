"""Export a dsedge bundle as a Triton Inference Server model repository (``dsedge export triton``).

``export_triton(bundle, out, platform, instances)`` writes one model per variant with a ``config.pbtxt`` derived from
the bundle (IO, batch range, dynamic batching and queue policy for its latency budget, warm-up, instance groups);
see repository.py (files per platform) and policy.py (how the batching settings are chosen). docs/triton.md says
what Triton cannot express of dsedge's scheduling.
"""
from .policy import BatchingPolicy, derive_policy
from .repository import PLATFORMS, TritonExport, TritonModel, default_platform, export_triton

__all__ = ["export_triton", "default_platform", "derive_policy", "BatchingPolicy", "TritonExport", "TritonModel",
           "PLATFORMS"]
