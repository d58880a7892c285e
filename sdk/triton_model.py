"""Triton Python-backend model that serves a dsedge bundle (copied to ``REPO/<model>/1/model.py`` by
``dsedge export triton --platform python``; it runs inside Triton's Python stub, never imported by dsedge).

Triton's dynamic batcher hands ``execute`` the requests it grouped; each is checked on its own (a bad request gets
its own error, the rest still run), the good ones are stacked into one batch the way dsedge batches (right-padded
on the sequence axis when the model takes an attention mask), run with ``Session.run`` and split back per request.

Needs, in the Python environment the stub runs in: numpy < 2 (the stub's tensors come back empty with numpy 2),
onnxruntime, onnx and dsedge (no extras). In production name a packed environment with the ``EXECUTION_ENV_PATH``
parameter of ``config.pbtxt``.
"""
import json
import os

import numpy as np
import triton_python_backend_utils as pb_utils


def _error(message, invalid):
    """A response error: INVALID_ARG for a request the model cannot take (HTTP 400, as Triton's own backends answer a
    bad input), INTERNAL for a failure running it; a stub without error codes (before Triton 23.04) has INTERNAL."""
    code = getattr(pb_utils.TritonError, "INVALID_ARG" if invalid else "INTERNAL", None)
    return pb_utils.TritonError(message, code) if code is not None else pb_utils.TritonError(message)


class TritonPythonModel:
    def initialize(self, args):
        import dsedge
        from dsedge.runtime.batching import BatchLayout

        config = json.loads(args["model_config"])
        params = {k: v.get("string_value", "") for k, v in config.get("parameters", {}).items()}
        version_dir = os.path.join(args["model_repository"], args["model_version"])
        bundle = os.path.join(version_dir, params.get("bundle", "bundle.dse"))
        threads = int(params["threads"]) if params.get("threads") else None
        self.session = dsedge.load(bundle, variant=params.get("variant") or None, threads=threads, instances=1)
        self.layout = BatchLayout.of(self.session.inputs, self.session.outputs)
        self.output_names = [o.name for o in self.session.outputs]

    def execute(self, requests):
        from dsedge.runtime.errors import DsedgeError, InputError
        from dsedge.runtime.io import validate_inputs

        responses = [None] * len(requests)
        feeds, slots = [], []
        for i, request in enumerate(requests):
            try:
                feed = {}
                for spec in self.session.inputs:
                    tensor = pb_utils.get_input_tensor_by_name(request, spec.name)
                    if tensor is None:
                        raise DsedgeError(f"missing input {spec.name!r}")
                    feed[spec.name] = tensor.as_numpy()
                feeds.append(validate_inputs(self.session.inputs, feed, self.session.manifest.shape_ranges))
                slots.append(i)
            except DsedgeError as e:
                responses[i] = pb_utils.InferenceResponse(error=_error(str(e), invalid=True))
        if feeds:
            groups = {}
            for feed, slot in zip(feeds, slots):  # only requests that can share a batch are stacked together
                groups.setdefault(self.layout.group_key(feed), []).append((feed, slot))
            for members in groups.values():
                group_feeds = [f for f, _ in members]
                try:
                    batch, _ = self.layout.stack(group_feeds)
                    parts = self.layout.split(self.session.run(batch), group_feeds)
                except DsedgeError as e:
                    invalid = isinstance(e, InputError)
                    for _, slot in members:
                        responses[slot] = pb_utils.InferenceResponse(error=_error(str(e), invalid))
                    continue
                for (_, slot), part in zip(members, parts):
                    responses[slot] = pb_utils.InferenceResponse(
                        output_tensors=[pb_utils.Tensor(n, np.ascontiguousarray(part[n])) for n in self.output_names])
        return responses

    def finalize(self):
        self.session.close(drain=False)
