"""samples/fraud on the real ULB transactions: split rule, hashed features, metrics vs scikit-learn on known inputs,
the baseline, a real bundle scored by the streaming scorer, malformed rows, the report."""
from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np
import pytest
from sklearn.metrics import average_precision_score, roc_auc_score

import dsedge
from samples.fraud.data import REAL_BASE_RATE, load_transactions, split_by_time, vector_key
from samples.fraud.features import Preprocessor, SparseEncoder, categorical_fields, splitmix64
from samples.fraud.metrics import (base_rate_weights, choose_threshold, detection_metrics, recall_at_fpr,
                                   threshold_metrics)
from samples.fraud.report import check_goals, plot, write_json
from samples.fraud.scorer import StreamScorer, batched_throughput, latency_summary, parse_row

CSV = "creditcard-fraud-ulb/creditcard_fraud_subsample.csv"


@pytest.fixture(scope="module")
def frame(shared_data):
    return load_transactions(shared_data / CSV)


@pytest.fixture(scope="module")
def split(frame):
    return split_by_time(frame)


@pytest.fixture(scope="module")
def pre(split):
    return Preprocessor(SparseEncoder(128, 1000, "sum")).fit(split["train"])


# ---------------------------------------------------------------- data and split
def test_split_is_by_time_with_the_stream_held_out(frame, split):
    assert len(frame) == 10_894 and int(frame["Class"].sum()) == 492
    s = split["stream"]
    assert len(s) == 4002 and int(s["Class"].sum()) == 2 and s["Time"].max() <= 3641
    assert split["train"]["Time"].min() > 3641
    assert split["train"]["Time"].max() < split["val"]["Time"].min() <= split["val"]["Time"].max() < split["test"]["Time"].min()
    summary = split.summary()["splits"]
    assert {k: v["frauds"] for k, v in summary.items()} == {"stream": 2, "train": 267, "val": 115, "test": 108}
    assert sum(v["rows"] for v in summary.values()) + sum(split.dropped_repeats.values()) == len(frame)


def test_no_repeated_vector_crosses_splits(frame, split):
    keys = {name: set(vector_key(split[name])) for name in ("stream", "train", "val", "test")}
    names = list(keys)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            assert not keys[a] & keys[b], (a, b)
    # the rule dropped real repeats (the data has 152 duplicated vectors, most inside one split)
    assert sum(split.dropped_repeats.values()) == 14
    assert vector_key(frame).duplicated().sum() == 152


# ---------------------------------------------------------------- features
def test_sparse_encoder_is_deterministic_and_in_range():
    enc = SparseEncoder(dim=128, hash_buckets=10_000, combiner="sum")
    vals = np.array([[0, 0, 0, 0], [23, 12, 99, 311], [5, 3, 0, 68]])
    ids = enc.transform(vals)
    assert ids.dtype == np.int64 and ids.shape == (3, 4)
    assert ((ids >= 0) & (ids < 10_000)).all()
    # fixed values: the device must reproduce training's ids bit for bit
    assert splitmix64(np.array([0], np.uint64))[0] == np.uint64(0xE220A8397B1DCDAF)
    assert ids.tolist() == enc.transform(vals.copy()).tolist()
    # the same value in two fields hashes to different ids (field salt)
    assert len(set(enc.transform(np.array([[7, 7, 7, 7]]))[0].tolist())) == 4
    with pytest.raises(ValueError, match="combiner"):
        SparseEncoder(combiner="max")


def test_categorical_fields_from_time_and_amount():
    cat = categorical_fields(np.array([0.0, 3600 * 25 + 5, 86399.0]), np.array([0.0, 1.0, 99.99]))
    assert cat[:, 0].tolist() == [0, 1, 23]               # hour of day
    assert cat[:, 1].tolist() == [0, 2, 7]                # amount bucket (edges 0.005, 1, 2, 5, 10, 20, 50, 100)
    assert cat[:, 2].tolist() == [0, 0, 99]               # cents
    assert cat[:, 3].tolist() == [0, 13 + 2, 23 * 13 + 7]  # hour x bucket


def test_preprocessor_json_roundtrip(pre, split, tmp_path):
    x = pre.transform(split["test"].iloc[:50])
    assert x["dense"].shape == (50, 29) and x["dense"].dtype == np.float32
    assert x["sparse_ids"].shape == (50, 4) and x["sparse_ids"].dtype == np.int64
    pre.to_json(tmp_path / "p.json")
    y = Preprocessor.from_json(tmp_path / "p.json").transform(split["test"].iloc[:50])
    np.testing.assert_array_equal(x["dense"], y["dense"])
    np.testing.assert_array_equal(x["sparse_ids"], y["sparse_ids"])
    # log1p(Amount) is standardised on the train split
    z = pre.transform(split["train"])["dense"][:, -1]
    assert abs(float(z.mean())) < 1e-4 and abs(float(z.std()) - 1) < 1e-3


# ---------------------------------------------------------------- metrics
def test_metrics_match_sklearn_on_known_inputs():
    y = np.array([0, 0, 1, 1])
    s = np.array([0.1, 0.4, 0.35, 0.8])
    m = detection_metrics(y, s)
    assert m["roc_auc"] == pytest.approx(0.75) == roc_auc_score(y, s)
    assert m["pr_auc"] == pytest.approx(0.8333333333)
    # one negative of two above 0.35: FPR 0.5 gives recall 1; FPR 0 gives recall 0.5
    assert recall_at_fpr(y, s, 0.0) == 0.5 and recall_at_fpr(y, s, 0.5) == 1.0
    assert m["recall_at_0.1pct_fpr"] == 0.5 and m["recall_at_1pct_fpr"] == 0.5


def test_reweighting_equals_replicating_negatives():
    rng = np.random.default_rng(1)
    y = (rng.random(400) < 0.2).astype(int)
    s = rng.normal(size=400) + 1.5 * y
    n_pos, n_neg = y.sum(), (1 - y).sum()
    pi = n_pos / (n_pos + 3 * n_neg)  # the base rate at which every negative weighs exactly 3
    w = base_rate_weights(y, pi)
    assert np.allclose(w[y == 0], 3.0) and np.allclose(w[y == 1], 1.0)
    assert (w * y).sum() / w.sum() == pytest.approx(pi)
    rep_y = np.concatenate([y, np.zeros(2 * n_neg, int)])
    rep_s = np.concatenate([s, np.tile(s[y == 0], 2)])
    assert detection_metrics(y, s, pi)["pr_auc_at_base_rate"] == pytest.approx(average_precision_score(rep_y, rep_s))
    with pytest.raises(ValueError, match="both classes"):
        base_rate_weights(np.zeros(5))


def test_threshold_metrics_known_values():
    y = np.array([0] * 8 + [1] * 2)
    s = np.array([0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.9, 0.7, 0.95])
    op = threshold_metrics(y, s, 0.7, base_rate=0.2)
    assert op["recall"] == 1.0 and op["fpr"] == 1 / 8 and op["precision"] == 2 / 3
    # at pi = 0.2 negatives weigh (2/8)(0.8/0.2) = 1: precision unchanged
    assert op["precision_at_base_rate"] == pytest.approx(2 / 3)
    assert op["alerts_per_10k_at_base_rate"] == pytest.approx(1e4 * (0.2 + 0.8 / 8))
    # F1 at pi: threshold 0.95 → P 1, R .5 (F1 .667); 0.9 → P .5, R .5; 0.7 → P 2/3, R 1 (F1 .8, the best)
    assert choose_threshold(y, s, base_rate=0.2) == pytest.approx(0.7)


def test_baseline_beats_chance_on_the_time_split(split):
    from samples.fraud.baseline import baseline_scores, fit_baseline

    clf = fit_baseline(split["train"], max_iter=60)
    m = detection_metrics(split["test"]["Class"], baseline_scores(clf, split["test"]))
    assert 0.93 < m["roc_auc"] < 1.0
    assert m["pr_auc_at_base_rate"] < m["pr_auc"]  # precision falls at the real base rate
