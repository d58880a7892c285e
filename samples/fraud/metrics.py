"""Detection metrics (scikit-learn) with reweighting from the subsample's fraud rate to the real one.

The subsample keeps every fraud but only a sample of the legitimate rows, so its fraud rate (4.5 %; 5.2 % in the
test split) is far above the real 0.172 %. ROC-AUC and recall at a false-positive rate do not depend on the base
rate; precision and PR-AUC do. To report them at the real rate every legitimate row gets the weight
``w = (n_pos / n_neg) * (1 - pi) / pi`` (pi = real rate), which makes the weighted fraud rate exactly pi (importance
weighting for class-prior shift; Saerens et al., Neural Computation 2002), and ``sample_weight`` does the rest.
"""
from __future__ import annotations

import numpy as np
from sklearn.metrics import average_precision_score, precision_recall_curve, roc_auc_score, roc_curve

from .data import REAL_BASE_RATE

FPR_POINTS = (0.001, 0.01)


def base_rate_weights(y: np.ndarray, base_rate: float = REAL_BASE_RATE) -> np.ndarray:
    """float64 [n] weights: 1 for frauds, ``(n_pos/n_neg)(1-pi)/pi`` for legitimate rows. Raises ValueError if a class is absent."""
    y = np.asarray(y).astype(bool)
    n_pos, n_neg = int(y.sum()), int((~y).sum())
    if n_pos == 0 or n_neg == 0:
        raise ValueError(f"need both classes to reweight, got {n_pos} frauds and {n_neg} legitimate rows")
    return np.where(y, 1.0, (n_pos / n_neg) * (1.0 - base_rate) / base_rate)


def recall_at_fpr(y: np.ndarray, score: np.ndarray, fpr: float) -> float:
    """Highest recall (TPR) over thresholds whose false-positive rate is <= ``fpr`` (ROC operating point)."""
    f, t, _ = roc_curve(y, score)
    return float(t[f <= fpr + 1e-12].max())


def detection_metrics(y: np.ndarray, score: np.ndarray, base_rate: float = REAL_BASE_RATE) -> dict[str, float]:
    """ROC-AUC, PR-AUC (average precision) on the data as is and at ``base_rate``, recall at 0.1 % / 1 % FPR.

    Args:
        y: int [n] labels (1 = fraud); score: float [n], higher = more likely fraud.
    """
    y = np.asarray(y).astype(int)
    score = np.asarray(score, np.float64)
    out = {"roc_auc": float(roc_auc_score(y, score)),
           "pr_auc": float(average_precision_score(y, score)),
           "pr_auc_at_base_rate": float(average_precision_score(y, score, sample_weight=base_rate_weights(y, base_rate)))}
    for p in FPR_POINTS:
        out[f"recall_at_{p * 100:g}pct_fpr"] = recall_at_fpr(y, score, p)
    return out


def choose_threshold(y: np.ndarray, score: np.ndarray, base_rate: float = REAL_BASE_RATE) -> float:
    """The score threshold maximising F1 at the real base rate (reweighted precision); pick it on validation data."""
    p, r, t = precision_recall_curve(y, score, sample_weight=base_rate_weights(y, base_rate))
    f1 = 2 * p[:-1] * r[:-1] / np.maximum(p[:-1] + r[:-1], 1e-12)
    return float(t[int(np.argmax(f1))])


def threshold_metrics(y: np.ndarray, score: np.ndarray, threshold: float,
                      base_rate: float = REAL_BASE_RATE) -> dict[str, float]:
    """Operating point ``score >= threshold``: recall, FPR, precision here and at ``base_rate``, alerts per 10k rows."""
    y = np.asarray(y).astype(bool)
    flag = np.asarray(score) >= threshold
    tp, fp = int((flag & y).sum()), int((flag & ~y).sum())
    n_pos, n_neg = int(y.sum()), int((~y).sum())
    recall, fpr = tp / n_pos, fp / n_neg
    w = float(base_rate_weights(y, base_rate)[~y][0])
    prec_real = tp / (tp + w * fp) if tp + fp else 0.0
    return {"threshold": float(threshold), "recall": recall, "fpr": fpr,
            "precision": tp / (tp + fp) if tp + fp else 0.0, "precision_at_base_rate": prec_real,
            "alerts_per_10k_at_base_rate": 1e4 * (base_rate * recall + (1 - base_rate) * fpr)}
