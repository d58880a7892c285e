"""Load the ULB card-fraud transactions and split them by time without leakage (pandas).

The split rule (also stated in README.md):

1. ``stream``: the contiguous stretch ``Time <= 3641`` s (the original's first 4,002 rows, true fraud rate). It is
   held out of training and evaluation and replayed by the streaming scorer.
2. The remaining rows, in time order, are cut at the 50 % and 70 % quantiles of ``Time``: ``train`` (earliest),
   ``val`` (threshold choice), ``test`` (latest; every reported metric).
3. Repeated vectors: the original repeats some (V1..V28, Amount) vectors at different times (recurring payments, 19
   duplicated frauds). A vector belongs to the split of its first occurrence in time; later copies that fall into a
   different split are dropped, so no vector is seen in training and again in validation, test or the stream.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from dsedge import InputError

from .. import data_path

V_COLUMNS = [f"V{i}" for i in range(1, 29)]
FEATURE_COLUMNS = ["Time", *V_COLUMNS, "Amount"]
COLUMNS = [*FEATURE_COLUMNS, "Class"]
# the data's licence and citation (../shared/data/creditcard-fraud-ulb/PROVENANCE.md): ODbL asks for attribution
# wherever the data, or what is made from it, is shown; written into report.json and on report.png
LICENCE = "Open Database License (ODbL 1.0): attribution and share-alike"
CITATION = ("Dal Pozzolo et al., \"Calibrating Probability with Undersampling for Unbalanced Classification\", "
            "IEEE CIDM 2015 (ULB credit card fraud data)")
ATTRIBUTION = f"Data: ULB credit card transactions, ODbL 1.0. Cite: {CITATION}."
DEFAULT_CSV = Path("../shared/data/creditcard-fraud-ulb/creditcard_fraud_subsample.csv")
STREAM_END_S = 3641.0          # last Time (s) of the contiguous stretch at the true fraud rate
REAL_BASE_RATE = 492 / 284_807  # 0.172 %: fraud rate of the full ULB data set
SPLITS = ("stream", "train", "val", "test")


class TransactionsError(InputError, ValueError):
    """The transactions CSV is missing or unusable (one line naming the file and what is wrong, plus a hint)."""


def load_transactions(csv: str | os.PathLike = DEFAULT_CSV) -> pd.DataFrame:
    """Read the ULB CSV (``Time, V1..V28, Amount, Class``), checked and sorted stably by ``Time``.

    Returns:
        DataFrame with float64 features and an int64 ``Class`` (1 = fraud).
    Raises:
        FileNotFoundError: no file at ``csv``.
        TransactionsError (a ``dsedge.InputError`` and a ``ValueError``): ``csv`` is a directory, no rows, a column is
            missing, a value is non-numeric / empty / NaN / inf, a negative ``Time``/``Amount``, a ``Class`` other
            than 0 or 1 (the first bad data row is named).
    """
    hint = ("point samples.fraud.run's --csv, or a training config's [data] kwargs.csv, at the ULB file (Time, "
            "V1..V28, Amount, Class; see samples/fraud/README.md)")
    csv = data_path(csv)  # the default, ../shared/data/…, under $DSEDGE_DATA when that is set
    if Path(csv).is_dir():  # a missing file stays the OSError every caller already turns into its own line
        raise TransactionsError(f"{csv}: a directory, not a CSV file", hint)
    try:
        df = pd.read_csv(csv)
    except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError) as e:
        raise TransactionsError(f"{csv}: not a readable CSV ({str(e).strip().splitlines()[0][:120]})", hint) from None
    missing = [c for c in COLUMNS if c not in df.columns]
    if missing:
        raise TransactionsError(f"{csv}: missing column(s) {missing}", hint)
    if df.empty:
        raise TransactionsError(f"{csv}: no transactions (only a header)", hint)
    df = df[COLUMNS].apply(pd.to_numeric, errors="coerce")
    values = df.to_numpy(np.float64)
    checks = [(COLUMNS, ~np.isfinite(values), "non-numeric or empty values in column(s) {} (NaN and inf count)"),
              (["Time", "Amount"], np.stack([df["Time"] < 0, df["Amount"] < 0], axis=1),
               "negative values in column(s) {}"),
              (["Class"], ~df[["Class"]].isin([0, 1]).to_numpy(), "values other than 0 or 1 in column(s) {}")]
    for cols, bad, what in checks:
        rows = bad.any(axis=1)
        if rows.any():
            named = [c for c, b in zip(cols, bad.any(axis=0)) if b]
            raise TransactionsError(f"{csv}: {what.format(named)}: {int(rows.sum())} row(s), the first is data row "
                                    f"{int(np.flatnonzero(rows)[0]) + 1}", "fix or drop those rows")
    df["Class"] = df["Class"].astype(np.int64)
    return df.sort_values("Time", kind="stable").reset_index(drop=True)


def vector_key(df: pd.DataFrame) -> pd.Series:
    """One hashable key per row: (V1..V28, Amount) rounded to 8 decimals (the provenance's duplicate rule)."""
    return pd.util.hash_pandas_object(df[[*V_COLUMNS, "Amount"]].round(8), index=False)


@dataclass
class TimeSplit:
    """The four splits (DataFrames in time order) and how the rule was applied."""

    frames: dict[str, pd.DataFrame]
    boundaries_s: dict[str, float]
    dropped_repeats: dict[str, int] = field(default_factory=dict)

    def __getitem__(self, name: str) -> pd.DataFrame:
        return self.frames[name]

    def summary(self) -> dict:
        """JSON-able: rows, frauds and fraud rate per split, boundaries (s) and dropped repeats."""
        out = {"rule": "stream = Time <= 3641 s; rest cut at Time quantiles 0.5/0.7 into train/val/test; "
                       "a repeated (V1..V28, Amount) vector stays in the split of its first occurrence",
               "boundaries_s": self.boundaries_s, "dropped_repeats": self.dropped_repeats, "splits": {}}
        for name, f in self.frames.items():
            n, pos = len(f), int(f["Class"].sum())
            out["splits"][name] = {"rows": n, "frauds": pos, "fraud_rate": pos / n if n else 0.0}
        return out


def split_by_time(df: pd.DataFrame, stream_end_s: float = STREAM_END_S,
                  quantiles: tuple[float, float] = (0.5, 0.7)) -> TimeSplit:
    """Split transactions by time with the repeated-vector rule (module docstring).

    Args:
        df: rows as returned by ``load_transactions`` (sorted by ``Time``).
        stream_end_s: rows with ``Time <= stream_end_s`` form the ``stream`` split.
        quantiles: ``Time`` quantiles of the non-stream rows where ``train``|``val`` and ``val``|``test`` are cut.
    Returns:
        A ``TimeSplit`` whose frames keep the input's columns and index.
    Raises:
        TransactionsError: fewer than 3 rows after ``stream_end_s`` (train, val and test would not all get rows), or
            a train, val or test split with only one class.
    """
    df = df.sort_values("Time", kind="stable")
    rest = df["Time"] > stream_end_s
    if int(rest.sum()) < 3:
        raise TransactionsError(f"only {int(rest.sum())} transaction(s) after Time {stream_end_s:g} s: train, val "
                                "and test are cut from those", "use the whole ULB CSV (samples/fraud/README.md)")
    t_val, t_test = (float(df.loc[rest, "Time"].quantile(q)) for q in quantiles)
    label = np.select([~rest, df["Time"] < t_val, df["Time"] < t_test], ["stream", "train", "val"], "test")
    label = pd.Series(label, index=df.index)
    first = label.groupby(vector_key(df).to_numpy()).transform("first")  # split of each vector's first occurrence
    keep = label == first
    dropped = {s: int(((label == s) & ~keep).sum()) for s in SPLITS}
    frames = {s: df[(label == s) & keep] for s in SPLITS}
    one_class = [s for s in ("train", "val", "test") if frames[s]["Class"].nunique() < 2]
    if one_class:  # training reweights by class and the evaluation ranks frauds: both need each class in each split
        raise TransactionsError(f"the {', '.join(one_class)} split(s) hold only one class (Class 0 or 1 throughout): "
                                "the scorer trains and is judged on frauds and legitimate rows alike",
                                "use a CSV with frauds spread over time, e.g. the whole ULB CSV "
                                "(samples/fraud/README.md)")
    return TimeSplit(frames, {"stream_end": stream_end_s, "val_start": t_val, "test_start": t_test}, dropped)
