"""Stage 3 of ``dsedge build``: compare a compressed model with its fp32 ONNX on held-out inputs (ORT CPU)."""
from __future__ import annotations

import os
from typing import Any

import numpy as np


def host_backend(path: str | os.PathLike, threads: int | None = None) -> Any:
    """An ``OrtBackend`` on ORT's CPU provider for ``path``, or for a BF16 model its FP32 emulation (ORT CPU has no
    BF16 kernels: toolchain/quantize/bf16_host.py)."""
    from ..runtime.backends.ort import OrtBackend
    from .quantize.bf16_host import host_model_file

    with host_model_file(path) as runnable:
        return OrtBackend(runnable, providers=["CPUExecutionProvider"], threads=threads)


def _session(path: str | os.PathLike) -> Any:
    return host_backend(path)


def _run_batches(backend: Any, feeds: dict[str, np.ndarray], batch: int = 16) -> dict[str, np.ndarray]:
    from ..runtime.golden import run_rows

    return run_rows(backend.run, feeds, (1, batch))


def model_outputs(onnx_path: str | os.PathLike, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Every output of ``onnx_path`` on ``feeds`` (batch axis 0), run in batches of 16 on ORT's CPU provider; a
    rank-0 input goes unchanged with every batch, a rank-0 output is the first batch's (``golden.run_rows``)."""
    return _run_batches(_session(onnx_path), feeds)


def _cos_rows(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a = a.reshape(len(a), -1).astype(np.float64)
    b = b.reshape(len(b), -1).astype(np.float64)
    return (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1) + 1e-12)


def _neighbour_sims(e: np.ndarray) -> np.ndarray:
    """Cosine similarity of every row of ``e`` [N, D] with every other row, float64 [N, N], -inf on the diagonal."""
    e = e.astype(np.float64)
    e = e / (np.linalg.norm(e, axis=1, keepdims=True) + 1e-12)
    s = e @ e.T
    np.fill_diagonal(s, -np.inf)
    return s


def top1_neighbour_agreement(ref: np.ndarray, test: np.ndarray) -> float:
    """Fraction of rows whose nearest other row (cosine) is the same under ``ref`` and ``test`` embeddings [N, D]."""
    return float(np.mean(_neighbour_sims(ref).argmax(1) == _neighbour_sims(test).argmax(1)))


def top1_flip_margins(ref: np.ndarray, test: np.ndarray) -> list[float]:
    """For each row whose nearest other row differs between ``ref`` and ``test`` [N, D]: the reference's own margin,
    cosine(first neighbour) - cosine(second neighbour) under ``ref``. A flip at a margin of 0.002 is a near-tie
    that the reference itself barely decides; a flip at 0.1 is a real retrieval change."""
    r = _neighbour_sims(ref)
    top2 = np.sort(r, axis=1)[:, -2:]
    flipped = np.nonzero(r.argmax(1) != _neighbour_sims(test).argmax(1))[0]
    return [round(float(top2[i, 1] - top2[i, 0]), 5) for i in flipped]


def sentence_embedding_metrics(ref: np.ndarray, test: np.ndarray) -> dict[str, Any]:
    """Mean-pooled embeddings [N, D]: cosine mean/min per row, top-1 neighbour agreement, and the reference's
    margins (cosine units) at the rows whose top-1 neighbour flipped (see :func:`top1_flip_margins`)."""
    cos = _cos_rows(ref, test)
    return {"cosine_mean": round(float(cos.mean()), 5), "cosine_min": round(float(cos.min()), 5),
            "top1_agreement": round(top1_neighbour_agreement(ref, test), 4),
            "top1_flip_margins": sorted(top1_flip_margins(ref, test)), "n": int(len(ref))}


def check_gate_output(gate_output: str | None, outputs: list[str], model: str) -> None:
    """``--gate-output`` names one of ``outputs`` (the output names of ``model``, a name for the message).

    Raises:
        ConfigError: it names none of them (the hint lists them).
    """
    if gate_output is not None and gate_output not in outputs:
        from ..runtime.errors import ConfigError

        raise ConfigError(f"--gate-output {gate_output!r} is not an output of {model}",
                          f"outputs: {', '.join(outputs)}")


def judged_output(ranks: dict[str, int], output: str | None, model: str) -> str:
    """The output accuracy is judged on, from ``ranks`` (output name → rank, in the model's order): ``output`` when
    given (``--gate-output``), else the first batched output. A rank-0 output (a loss, a count: one value per call)
    has no samples to compare: cosine per sample, argmax and neighbour agreement need rows, and the cosine of one
    value is only its sign (any same-sign value passes cosine:0.99), so it is never the default and never judged.

    Raises:
        ConfigError: ``output`` is not an output of ``model``, or is rank-0; or every output is rank-0.
    """
    from ..runtime.errors import ConfigError

    check_gate_output(output, list(ranks), model)
    batched = [n for n, r in ranks.items() if r]
    if output is not None and ranks[output]:
        return output
    if output is None and batched:
        return batched[0]
    what = (f"--gate-output {output!r} is a rank-0 output" if output is not None
            else f"every output of {model} is rank-0 ({', '.join(ranks)})")
    raise ConfigError(f"{what}: one value per call, no samples to judge accuracy on (cosine per sample, top1)",
                      f"gate on a batched output such as {batched[0]!r}" if batched else
                      "export the model with a batched output (e.g. the values before the reduction)")


def token_mask(feeds: dict[str, np.ndarray], output: np.ndarray) -> np.ndarray | None:
    """Boolean [N, T] of the real (not padding) positions of a per-token ``output`` [N, T, ...] (3-D or more):
    ``feeds["attention_mask"] != 0`` when the feeds hold an ``attention_mask`` of shape [N, T] equal to the output's
    first two dims and at least one real position; else None (judge every position)."""
    mask = feeds.get("attention_mask")
    if mask is None or output.ndim < 3 or np.ndim(mask) != 2 or tuple(np.shape(mask)) != output.shape[:2]:
        return None
    mask = np.asarray(mask) != 0
    return mask if mask.any() else None


def compare_models(reference_onnx: str | os.PathLike, test_onnx: str | os.PathLike, feeds: dict[str, np.ndarray],
                   task: str = "generic", embedding_output: str = "sentence_embedding",
                   output: str | None = None) -> dict[str, Any]:
    """Accuracy of ``test_onnx`` against ``reference_onnx`` on ``feeds`` (numpy arrays, batch axis 0).

    The output judged is ``output`` (``dsedge build --gate-output``) when given, else ``embedding_output`` for
    ``task="sentence-embedding"`` when the model has it, else the first batched output (a rank-0 output, one value
    per call, is skipped: ``judged_output``).

    ``task="sentence-embedding"`` judging ``embedding_output`` or another rank-2 output [N, D] (an embedding): cosine
    mean/min, top-1 neighbour agreement (``top1_agreement``, no argmax: a sentence embedding's largest dim is no class).
    Otherwise (record ``output``: the name judged): per-sample cosine, Pearson correlation of all its values, max abs
    diff, and argmax agreement when its last dim is > 1 (classifier logits); for two-class logits (last dim 2, e.g.
    per-cell lesion logits ``[N, cells, 2]``) also ``two_class_metrics``. A per-token output [N, T, ...] with an
    ``attention_mask`` [N, T] among ``feeds`` is judged on the real tokens only (mask != 0; padding can differ
    freely, and nothing reads it): each sample's cosine over its real tokens, the other metrics over every real
    token; the record then says ``masked_by: "attention_mask"``, ``tokens`` (real positions judged) and
    ``token_cosine_mean`` / ``token_cosine_min``: the cosine of each real token's vector alone (``cosine_min``, what
    the gates read, is the worst sample's cosine over all its real tokens, which can hide one bad token).

    Raises:
        ConfigError: ``output`` is not an output of the model (the hint lists its outputs), or is rank-0; every
            output is rank-0 (``judged_output``).
    """
    ref, test = model_outputs(reference_onnx, feeds), model_outputs(test_onnx, feeds)
    if output is None and task == "sentence-embedding" and embedding_output in ref:
        output = embedding_output
    name = judged_output({k: v.ndim for k, v in ref.items()}, output, os.path.basename(reference_onnx))
    if task == "sentence-embedding" and ref[name].ndim == 2:  # an encoder's [N, D] embedding: top-1 = neighbour
        return {"output": name, **sentence_embedding_metrics(ref[name], test[name])}
    r, t = ref[name], test[name]
    mask = token_mask(feeds, r)
    if mask is not None:  # zeroed padding adds nothing to a sample's dot product or norms: cosine over real tokens
        keep = mask.reshape(mask.shape + (1,) * (r.ndim - 2))
        cos = _cos_rows(np.where(keep, r, 0), np.where(keep, t, 0))[mask.any(1)]
        r, t = r[mask], t[mask]  # [real tokens, ...]
    else:
        cos = _cos_rows(r, t)
    out = {"output": name, "cosine_mean": round(float(cos.mean()), 5), "cosine_min": round(float(cos.min()), 5),
           "max_abs_diff": float(np.max(np.abs(r - t))), "n": int(len(ref[name]))}
    if mask is not None:  # a sample's cosine averages its tokens: the worst single real token, beside it
        tok = _cos_rows(r, t)
        out.update(masked_by="attention_mask", tokens=int(mask.sum()),
                   token_cosine_mean=round(float(tok.mean()), 5), token_cosine_min=round(float(tok.min()), 5))
    out["pearson"] = round(float(np.corrcoef(r.reshape(-1).astype(np.float64),
                                             t.reshape(-1).astype(np.float64))[0, 1]), 5) if r.size > 1 else 1.0
    if r.ndim >= 2 and r.shape[-1] > 1:
        out["argmax_agreement"] = round(float(np.mean(r.argmax(-1) == t.argmax(-1))), 4)
    if r.ndim >= 2 and r.shape[-1] == 2:
        out.update(two_class_metrics(r, t))
    return out


def two_class_metrics(ref: np.ndarray, test: np.ndarray, threshold: float = 0.5) -> dict[str, Any]:
    """Agreement of two-class logits ``[..., 2]`` (class 1 = positive) as probabilities p = softmax(·)[..., 1].

    Returns ``prob_max_abs_diff`` and ``prob_mean_abs_diff`` over every position, ``dice_at_0.5``: Dice of the masks
    ``p >= threshold`` (2|A∩B| / (|A| + |B|); 1.0 when both are empty), and ``positives_ref`` / ``positives_test``
    (positions over the threshold).
    """
    def prob(x: np.ndarray) -> np.ndarray:
        x = x.astype(np.float64)
        return 1.0 / (1.0 + np.exp(x[..., 0] - x[..., 1]))

    pr, pt = prob(ref), prob(test)
    a, b = pr >= threshold, pt >= threshold
    denom = int(a.sum()) + int(b.sum())
    dice = 1.0 if denom == 0 else 2.0 * float(np.logical_and(a, b).sum()) / denom
    return {"prob_max_abs_diff": round(float(np.max(np.abs(pr - pt))), 6),
            "prob_mean_abs_diff": round(float(np.mean(np.abs(pr - pt))), 7),
            f"dice_at_{threshold}": round(dice, 5), "positives_ref": int(a.sum()), "positives_test": int(b.sum())}
