"""``dsedge data check``: a data-quality board for text corpora and tabular data sets.

``check_data(path, config)`` streams the data once (per shard, mergeable) and returns a JSON-able report of graded
checks: format/schema, exact and near duplicates (MinHash-LSH), token lengths and unknown-token rate, the Zipf
coefficient, entity coverage, and for tabular data class balance, constant columns, leakage suspects and value ranges.
See docs/datacheck.md.
"""
from __future__ import annotations

from .config import DEFAULT_CHECKS, Check, DataCheckConfig, load_config
from .engine import ENGINES, check_data

__all__ = ["Check", "DataCheckConfig", "DEFAULT_CHECKS", "ENGINES", "check_data", "load_config"]
