"""Accuracy metrics of sentence embeddings: cosine, top-1 neighbour agreement and the reference's margins at flips."""
from __future__ import annotations

import numpy as np

from dsedge.toolchain.evaluate import sentence_embedding_metrics, top1_flip_margins


def test_top1_flips_report_the_reference_margin():
    # rows 0 and 1 are a near-tie for row 2's neighbour under the reference (cos 0.800 vs 0.799)
    ref = np.array([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.8, 0.799, 0.0], [0.0, 0.0, 1.0]])
    ref[2] /= np.linalg.norm(ref[2])
    test = ref.copy()
    test[2] = [0.79, 0.81, 0.0]                                  # a small perturbation flips row 2's neighbour
    m = sentence_embedding_metrics(ref, test)
    assert m["top1_agreement"] == 0.75 and m["n"] == 4
    assert len(m["top1_flip_margins"]) == 1 and 0 < m["top1_flip_margins"][0] < 0.002
    assert top1_flip_margins(ref, ref) == [] and m["cosine_mean"] > 0.99
