"""External tensor data of an ONNX model: every file a model reads must be inside its bundle and hash-listed.

ONNX lets any tensor (an initializer, a sparse initializer, a ``Constant``'s value, one in a subgraph or a local
function) keep its bytes in another file named by ``external_data.location``, relative to the model's folder.
ONNX Runtime happens to refuse locations outside that folder, but nothing else here does; this module checks the
references explicitly and reads only the protobuf (no tensor data is loaded, nothing is executed).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Iterator, Mapping

from .errors import BundleIntegrityError


def _tensors_of_graph(graph: Any) -> Iterator[Any]:
    yield from graph.initializer
    for sp in graph.sparse_initializer:
        yield sp.values
        yield sp.indices
    for node in graph.node:
        yield from _tensors_of_node(node)


def _tensors_of_node(node: Any) -> Iterator[Any]:
    for attr in node.attribute:
        if attr.HasField("t"):
            yield attr.t
        yield from attr.tensors
        if attr.HasField("sparse_tensor"):
            yield attr.sparse_tensor.values
            yield attr.sparse_tensor.indices
        for sp in attr.sparse_tensors:
            yield sp.values
            yield sp.indices
        if attr.HasField("g"):
            yield from _tensors_of_graph(attr.g)
        for g in attr.graphs:
            yield from _tensors_of_graph(g)


def external_locations(model: Any) -> list[str]:
    """``external_data.location`` of every tensor stored outside ``model`` (an ``onnx.ModelProto``), in graph order.

    A tensor that claims external storage without a location is reported as ``""``.
    """
    from onnx import TensorProto

    tensors = list(_tensors_of_graph(model.graph))
    for fn in model.functions:
        for node in fn.node:
            tensors.extend(_tensors_of_node(node))
    out = []
    for t in tensors:
        if t.data_location == TensorProto.EXTERNAL or len(t.external_data):
            out.append(next((e.value for e in t.external_data if e.key == "location"), ""))
    return out


def check_external_data(model_path: str | os.PathLike, root: str | os.PathLike, files: Mapping[str, str]) -> list[str]:
    """Check that every external-data file of the model at ``model_path`` lies inside ``root`` and is listed in
    ``files`` (the manifest's hashes, relative POSIX paths). Returns the files it reads (relative to ``root``).

    Raises:
        BundleIntegrityError: a location that is absolute, escapes ``root`` (``..``, a link), is missing, or has no
            hash in the manifest; or the model file is not ONNX.
    """
    import onnx

    model_path = Path(model_path)
    try:
        model = onnx.load(os.fspath(model_path), load_external_data=False)
    except Exception as e:  # DecodeError and friends: a file that is not ONNX protobuf
        raise BundleIntegrityError(f"{model_path.name} is not a readable ONNX model ({type(e).__name__})",
                                   "rebuild the bundle with `dsedge build`") from None
    base = Path(root).resolve()
    used = []
    for loc in external_locations(model):
        what = f"{model_path.name} reads external data from {loc!r}"
        if not loc or os.path.isabs(loc) or "\\" in loc or loc.startswith("~"):
            raise BundleIntegrityError(f"{what}, which is not a path inside the bundle",
                                       "a bundle's models may read only files inside the bundle")
        p = (model_path.parent / loc).resolve()
        if base not in p.parents:
            raise BundleIntegrityError(f"{what}, outside the bundle",
                                       "a bundle's models may read only files inside the bundle: rebuild it")
        rel = p.relative_to(base).as_posix()
        if rel not in files:
            raise BundleIntegrityError(f"{what}, which the manifest's hashes do not cover",
                                       "rebuild the bundle so every file a model reads is hash-listed")
        if not p.is_file():
            raise BundleIntegrityError(f"{what}, which is missing", "copy the whole .dse directory, or rebuild it")
        used.append(rel)
    return used
