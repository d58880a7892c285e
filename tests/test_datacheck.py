"""``dsedge data check``: real data (committed sentences, the fraud CSV), crafted bad inputs where each check fails,
exact shard merges and the Dask engine on a real 2-worker local cluster."""
from __future__ import annotations

import base64
import json
import math
import os
import random
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("datasketch", reason="dsedge data check needs the `data` extra")

from dsedge.cli import main  # noqa: E402
from dsedge.toolchain.datacheck import DataCheckConfig, check_data, load_config  # noqa: E402
from dsedge.toolchain.datacheck.exact import ExactSum  # noqa: E402
from dsedge.toolchain.datacheck.tokens import zipf_fit  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SENTENCES = REPO / "toolchain" / "data"


def fraud_csv(shared_data: Path) -> Path:
    return shared_data / "creditcard-fraud-ulb" / "creditcard_fraud_subsample.csv"


def status(report: dict) -> dict[str, str]:
    return {c["id"]: c["status"] for c in report["checks"]}


def check(report: dict, cid: str) -> dict:
    return next(c for c in report["checks"] if c["id"] == cid)


def without_run(report: dict) -> dict:
    return {k: v for k, v in report.items() if k != "run"}


def run_cli(args: list[str], capsys) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as e:
        main(args)
    out = capsys.readouterr()
    return e.value.code, out.out, out.err


# ---------------------------------------------------------------- crafted bad inputs
WORDS = [f"w{i}" for i in range(50)]


def write_bad_jsonl(path: Path) -> dict:
    """A JSONL corpus where every text check fails; returns the lines of each defect."""
    rng = random.Random(0)
    lines, where = [], {"unreadable": [], "mismatch": [], "empty": []}
    base_docs = []
    for i in range(120):
        doc = " ".join(rng.choice(WORDS) for _ in range(60))       # uniform words: Zipf s ~ 0; 60 words > max 50
        base_docs.append(doc)
        lines.append({"text": doc, "score": i})
    for i in range(20):                                              # exact copies
        lines.append({"text": base_docs[i], "score": 1})
    for i in range(30):                                              # one word changed: Jaccard ~0.97
        lines.append({"text": base_docs[40 + i] + " changed", "score": 2})
    for _ in range(30):                                              # empty text
        lines.append({"text": "  ", "score": 3})
    for _ in range(20):                                              # a string in a number field
        lines.append({"text": "short alpha beta", "score": "n/a"})
    rng.shuffle(lines)
    out = []
    for row in lines:
        out.append(json.dumps(row))
    for k in (3, 50, 77, 150, 201):                                  # broken lines (1-based positions)
        out.insert(k - 1, '{"text": "unterminated')
    for n, s in enumerate(out, 1):
        if s.startswith('{"text": "unterminated'):
            where["unreadable"].append(n)
        elif '"n/a"' in s:
            where["mismatch"].append(n)
        elif '"text": "  "' in s:
            where["empty"].append(n)
    path.write_text("\n".join(out) + "\n")
    return where


def write_bad_csv(path: Path) -> None:
    """2000 rows: 1 positive (class balance), 2 constant columns, a leaking feature, out-of-range and inf amounts,
    a short row at line 6 and a non-UTF-8 line at line 9."""
    rng = np.random.default_rng(0)
    label = np.zeros(2000, dtype=int)
    label[1234] = 1
    lines = ["id,const_a,const_b,leak,amount,label"]
    for i in range(2000):
        amount = "inf" if i == 500 else f"{rng.uniform(0, 120):.2f}"
        leak = label[i] * 10 + rng.normal(0, 0.1)
        lines.append(f"{i},7,x,{leak:.5f},{amount},{label[i]}")
    raw = "\n".join(lines).encode() + b"\n"
    rows = raw.split(b"\n")
    rows[5] = b"5,7,x"                                                # line 6: 3 fields
    rows[8] = b"8,7,x,0.1,\xff\xfe,0"                               # line 9: not UTF-8
    path.write_bytes(b"\n".join(rows))


@pytest.fixture(scope="module")
def bad_text(tmp_path_factory) -> tuple[Path, dict, Path, Path]:
    d = tmp_path_factory.mktemp("bad-text")
    where = write_bad_jsonl(d / "corpus.jsonl")
    (d / "entities.txt").write_text("# places\nw1\nw2 w3\nParis\nNew York\nLyon\nw4\nBerlin\nRome\nOslo\nw5\n")
    (d / "checks.toml").write_text("[text]\nmax_tokens = 50\n")
    return d / "corpus.jsonl", where, d / "entities.txt", d / "checks.toml"


@pytest.fixture(scope="module")
def bad_text_report(bad_text) -> dict:
    corpus, _, entities, cfg = bad_text
    return check_data(str(corpus), load_config(cfg), entities_file=str(entities))


@pytest.fixture(scope="module")
def bad_csv(tmp_path_factory) -> tuple[Path, Path]:
    d = tmp_path_factory.mktemp("bad-csv")
    write_bad_csv(d / "table.csv")
    (d / "checks.toml").write_text("[tabular]\nranges = { amount = [0, 100] }\n")
    return d / "table.csv", d / "checks.toml"


def test_bad_text_every_text_check_fails(bad_text, bad_text_report):
    corpus, where, _, _ = bad_text
    r = bad_text_report
    st = status(r)
    for cid in ("format.unreadable", "schema.missing", "schema.types", "dedup.exact", "dedup.near",
                "tokens.over_max", "zipf", "entities.coverage"):
        assert st[cid] == "fail", (cid, check(r, cid))
    assert r["status"] == "fail"
    assert r["unreadable_rows"] == 5
    assert [u["loc"] for u in r["unreadable_examples"]] == [f"line {n}" for n in where["unreadable"]]
    assert r["fields"]["text"]["empty"] == 30
    assert r["fields"]["text"]["missing_examples"] == [f"line {n}" for n in where["empty"][:5]]
    assert r["fields"]["score"] == {**r["fields"]["score"], "type": "number", "type_mismatches": 20,
                                    "mismatch_kinds": {"string": 20}}
    assert r["fields"]["score"]["mismatch_examples"] == [f"line {n}" for n in where["mismatch"][:5]]
    # 20 exact copies + 19 more "short alpha beta" rows repeating the first one
    assert r["duplicates"]["exact_duplicates"] == 20 + 19
    assert r["duplicates"]["near_duplicates"] == 30
    assert all(e["jaccard"] >= 0.9 for e in r["duplicates"]["near_examples"])
    assert r["text"]["lengths"]["over_max"] == 120 + 20 + 30      # every 60/61-word document
    assert abs(r["text"]["zipf"]["s"]) < 0.3                          # uniform frequencies, not Zipfian
    en = r["text"]["entities"]
    assert (en["entities"], en["found"], en["coverage"]) == (10, 4, 0.4)     # w1, "w2 w3", w4, w5
    assert set(en["missing_examples"]) == {"Paris", "New York", "Lyon", "Berlin", "Rome", "Oslo"}


def test_entity_phrases_match_consecutive_words(bad_text_report):
    docs = bad_text_report["text"]["entities"]["docs_per_entity"]
    assert docs["w2 w3"] > 0 and docs["w1"] > docs["w2 w3"]
    assert docs["Paris"] == 0


def test_bad_csv_every_tabular_check_fails(bad_csv):
    table, cfg = bad_csv
    r = check_data(str(table), load_config(cfg))
    st = status(r)
    for cid in ("tabular.class_balance", "tabular.constant", "tabular.leakage", "tabular.ranges"):
        assert st[cid] == "fail", (cid, check(r, cid))
    assert st["format.unreadable"] == "warn"                          # 2 of 2000 rows: over 0, under 1 %
    assert [u["loc"] for u in r["unreadable_examples"]] == ["line 6", "line 9"]
    assert "3 fields" in r["unreadable_examples"][0]["reason"] and "UTF-8" in r["unreadable_examples"][1]["reason"]
    tab = r["tabular"]
    assert tab["label"] == "label" and tab["classes"] == {"0": 1997, "1": 1}
    assert tab["constant_columns"] == ["const_a", "const_b"]
    assert tab["auc"]["leak"]["auc"] == 1.0 and tab["auc"]["id"]["auc"] < 0.9
    amt = tab["columns"]["amount"]
    assert amt["nonfinite"] == 1
    vals = np.random.default_rng(0)  # recompute the generator's amounts to check the out-of-range count exactly
    expected = []
    for i in range(2000):
        a = None if i == 500 else round(vals.uniform(0, 120), 2)
        vals.normal(0, 0.1)
        if i not in (4, 7) and a is not None:             # lines 6 and 9 are broken
            expected.append(a)
    assert amt["out_of_range"] == sum(a > 100 for a in expected)
    assert amt["max"] == max(expected) and amt["min"] == min(expected)


def test_unknown_token_rate_fails_with_a_small_vocabulary(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers, processors

    vocab = {"[UNK]": 0, "[CLS]": 1, "[SEP]": 2, "the": 3, "cat": 4, "sat": 5}
    tk = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tk.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 1),
                                                                                               ("[SEP]", 2)])
    tk.enable_padding(length=16)                                      # saved settings must not change the counts
    tk.enable_truncation(max_length=6)
    (tmp_path / "tok").mkdir()
    tk.save(str(tmp_path / "tok" / "tokenizer.json"))
    (tmp_path / "tok" / "tokenizer_config.json").write_text('{"unk_token": "[UNK]", "model_max_length": 8}')
    (tmp_path / "c.txt").write_text("the cat sat\nthe dog sat on the mat today again and again\nthe cat\n")
    r = check_data(str(tmp_path / "c.txt"), tokenizer=str(tmp_path / "tok"))
    # 15 tokens without [CLS]/[SEP]; dog on mat today again and again: 7 unknown
    assert (r["text"]["tokens"], r["text"]["unknown_tokens"]) == (15, 7)
    assert status(r)["tokens.unknown"] == "fail"
    lengths = r["text"]["lengths"]                                    # with [CLS]/[SEP]: 5, 12, 4
    assert (lengths["max_tokens"], lengths["max"], lengths["min"], lengths["over_max"]) == (8, 12, 4, 1)


# ---------------------------------------------------------------- real data
def test_committed_sentences_pass(capsys):
    code, out, _ = run_cli(["data", "check", str(SENTENCES), "--json"], capsys)
    r = json.loads(out)
    assert code == 0 and r["status"] == "pass"
    assert r["rows"] == 120 and r["files"] == 2
    assert r["duplicates"]["exact_duplicates"] == 0 and r["duplicates"]["near_duplicates"] == 0
    texts = [s for f in ("calibration.txt", "heldout.txt") for s in (SENTENCES / f).read_text().splitlines()]
    n_words = [len(__import__("re").findall(r"\w+", t.lower())) for t in texts]
    assert r["text"]["lengths"]["max"] == max(n_words) and r["text"]["tokens"] == sum(n_words)
    assert 0.8 <= r["text"]["zipf"]["s"] <= 1.2
    assert status(r)["tokens.unknown"] == "skip" and status(r)["tabular.leakage"] == "skip"
    fig = r["figures"]
    assert sum(fig["length_histogram"]["counts"]) == 120
    assert fig["rank_frequency"]["s"] == r["text"]["zipf"]["s"] and fig["rank_frequency"]["fit_line"]["rank"][0] == 1
    assert fig["rank_frequency"]["freq"][0] == max(__import__("collections").Counter(
        w for t in texts for w in __import__("re").findall(r"\w+", t.lower())).values())


def test_jsonl_csv_and_parquet_of_one_table_agree(tmp_path):
    import pandas as pd

    texts = [s for s in (SENTENCES / "calibration.txt").read_text().splitlines() if s.strip()]
    df = pd.DataFrame({"id": range(len(texts)), "text": texts, "label": [i % 3 for i in range(len(texts))]})
    df.to_csv(tmp_path / "t.csv", index=False)
    df.to_parquet(tmp_path / "t.parquet")
    df.to_json(tmp_path / "t.jsonl", orient="records", lines=True)
    reports = [check_data(str(tmp_path / f"t.{ext}")) for ext in ("csv", "parquet", "jsonl")]
    for r in reports:
        assert r["rows"] == 60 and r["text"]["field"] == "text" and r["tabular"]["label"] == "label"
        for key in ("text", "tabular", "duplicates", "checks"):
            assert r[key] == reports[0][key], key


def test_fraud_csv(shared_data, capsys, tmp_path):
    import pandas as pd
    from sklearn.metrics import roc_auc_score

    csv = fraud_csv(shared_data)
    html = tmp_path / "fraud.html"
    code, out, _ = run_cli(["data", "check", str(csv), "--json", "--html", str(html)], capsys)
    r = json.loads(out)
    assert code == 0 and r["status"] == "warn"                        # 4.5 % frauds, repeated rows
    df = pd.read_csv(csv)
    assert r["rows"] == len(df) == 10894
    assert r["tabular"]["classes"] == {"0": 10402, "1": 492}
    assert r["duplicates"]["exact_duplicates"] == int(df.duplicated().sum())
    for col in ("V14", "Amount", "Time"):
        auc = roc_auc_score(df["Class"], df[col])
        assert r["tabular"]["auc"][col]["auc"] == pytest.approx(max(auc, 1 - auc), abs=1e-12)
    top = max(r["tabular"]["auc"].values(), key=lambda a: a["auc"])["auc"]
    assert check(r, "tabular.leakage")["value"] == top < 0.99
    amount = r["tabular"]["columns"]["Amount"]
    assert amount["mean"] == float(sum(map(Fraction, df["Amount"])) / len(df))         # exactly rounded
    assert amount["std"] == pytest.approx(float(df["Amount"].std(ddof=0)), rel=1e-12)
    assert (amount["min"], amount["max"]) == (0.0, 7712.43)
    assert status(r)["tabular.constant"] == "pass" and status(r)["schema.types"] == "pass"
    # HTML with the figures, and the same figures' data as JSON beside it
    page = html.read_text()
    assert page.count("<img") == len(r["figures"]) == 3          # missing per field, class balance, AUC
    side = json.loads(html.with_suffix(".json").read_text())
    assert side["figures"] == r["figures"]
    png = page.split("base64,")[1].split("'")[0]
    assert base64.b64decode(png)[:4] == b"\x89PNG"


def test_fraud_csv_as_parquet_row_groups(shared_data, tmp_path):
    import pandas as pd
    import pyarrow as pa
    import pyarrow.parquet as pq

    df = pd.read_csv(fraud_csv(shared_data)).iloc[:3000]
    pq.write_table(pa.Table.from_pandas(df, preserve_index=False), tmp_path / "f.parquet", row_group_size=700)
    one = check_data(str(tmp_path / "f.parquet"))
    sharded = check_data(str(tmp_path / "f.parquet"), shard_bytes=1)   # one shard per row group
    assert sharded["run"]["shards"] == 5 and without_run(sharded) == without_run(one)
    assert one["tabular"]["classes"] == {str(k): int(v) for k, v in df["Class"].value_counts().items()}
    assert one["duplicates"]["exact_duplicates"] == int(df.duplicated().sum())


# ---------------------------------------------------------------- merges, config, CLI
def test_sharded_run_equals_single_pass(bad_text, bad_text_report, bad_csv):
    corpus, _, entities, cfg = bad_text
    sharded = check_data(str(corpus), load_config(cfg), entities_file=str(entities), shard_bytes=4096)
    assert sharded["run"]["shards"] > 5
    assert without_run(sharded) == without_run(bad_text_report)
    table, tcfg = bad_csv
    a = check_data(str(table), load_config(tcfg))
    b = check_data(str(table), load_config(tcfg), shard_bytes=2048, batch_rows=100)
    assert b["run"]["shards"] > 10 and without_run(a) == without_run(b)


def test_exact_sum_is_split_invariant():
    rng = np.random.default_rng(1)
    x = rng.normal(0, 1, 5000) * 10.0 ** rng.integers(-300, 300, 5000)
    whole = ExactSum()
    whole.add(x)
    parts = ExactSum()
    for chunk in np.array_split(x[::-1], 7):
        p = ExactSum()
        p.add(chunk)
        parts.merge(p)
    assert (parts.total, parts.squares) == (whole.total, whole.squares)
    assert whole.value() == math.fsum(x)


@pytest.mark.parametrize("s", [1.0, 1.5])
def test_zipf_fit_recovers_the_exponent(s):
    r = np.arange(1, 5001)
    fit = zipf_fit(np.round(1e7 * r ** -s).astype(np.int64))
    assert fit["s"] == pytest.approx(s, abs=0.02) and fit["r2"] > 0.999


def test_config_errors_exit_2_without_traceback(tmp_path, capsys):
    cfg = tmp_path / "c.toml"
    cfg.write_text('[checks."dedup.exactly"]\nwarn = 0\n')
    code, _, err = run_cli(["data", "check", str(SENTENCES), "--config", str(cfg)], capsys)
    assert code == 2 and "unknown check 'dedup.exactly'" in err and "Traceback" not in err
    cfg.write_text('[checks.zipf]\npass = [1.2, 0.8]\n')
    code, _, err = run_cli(["data", "check", str(SENTENCES), "--config", str(cfg)], capsys)
    assert code == 2 and "low 1.2 is above high 0.8" in err
    code, _, err = run_cli(["data", "check", str(SENTENCES), "--engine", "ray"], capsys)
    assert code == 2 and "use --engine dask" in err
    (tmp_path / "t.csv").write_text("a,b\n1,2\n")
    cfg.write_text("[tabular]\nranges = { c = [0, 1] }\n")
    code, _, err = run_cli(["data", "check", str(tmp_path / "t.csv"), "--config", str(cfg)], capsys)
    assert code == 2 and "names column(s) ['c']" in err


def test_an_empty_data_set_fails(tmp_path, capsys):
    (tmp_path / "e.jsonl").write_text("\n")
    code, out, _ = run_cli(["data", "check", str(tmp_path / "e.jsonl"), "--json"], capsys)
    r = json.loads(out)
    assert code == 1 and check(r, "format.unreadable")["detail"] == "the data set has no rows"


@pytest.mark.parametrize("name", ["e.csv", "e.tsv", "e.jsonl", "e.txt", "blank.csv"])
def test_an_empty_file_of_any_format_fails_the_same_way(tmp_path, capsys, name):
    (tmp_path / name).write_bytes(b"\n \n" if name.startswith("blank") else b"")
    code, out, err = run_cli(["data", "check", str(tmp_path / name), "--json"], capsys)
    assert code == 1, err
    assert check(json.loads(out), "format.unreadable")["detail"] == "the data set has no rows"


def test_a_csv_with_a_blank_first_line_and_rows_is_still_a_usage_error(tmp_path, capsys):
    (tmp_path / "b.csv").write_text("\na,b\n1,2\n")
    code, _, err = run_cli(["data", "check", str(tmp_path / "b.csv")], capsys)
    assert code == 2 and "the CSV has no header row" in err and "Traceback" not in err


@pytest.mark.parametrize("as_json", [False, True])
def test_random_bytes_parquet_is_a_one_line_usage_error(tmp_path, capsys, as_json):
    p = tmp_path / "rand.parquet"
    p.write_bytes(np.random.default_rng(0).bytes(2000))
    code, out, err = run_cli(["data", "check", str(p)] + (["--json"] if as_json else []), capsys)
    assert code == 2 and out == "" and "Traceback" not in err
    assert "not a readable Parquet file (Parquet magic bytes not found in footer)" in err and "hint:" in err


def test_truncated_parquet_is_a_one_line_usage_error(tmp_path, capsys):
    import pyarrow as pa
    import pyarrow.parquet as pq
    good = tmp_path / "good.parquet"
    pq.write_table(pa.table({"text": [f"document number {i}" for i in range(1000)]}), good)
    bad = tmp_path / "cut.parquet"
    bad.write_bytes(good.read_bytes()[:-100])
    code, _, err = run_cli(["data", "check", str(bad)], capsys)
    assert code == 2 and "not a readable Parquet file" in err and "Traceback" not in err


def test_thresholds_from_toml_turn_a_pass_into_a_fail(tmp_path, capsys):
    cfg = tmp_path / "c.toml"
    cfg.write_text('[checks.zipf]\npass = [1.5, 2.0]\nwarn = false\n')
    code, out, err = run_cli(["data", "check", str(SENTENCES), "--config", str(cfg)], capsys)
    assert code == 1 and "failed: zipf" in err and "fail" in out


# ---------------------------------------------------------------- Dask engine
@pytest.mark.timeout(180)
def test_dask_two_workers_match_single_process(bad_text, bad_text_report, shared_data, capsys):
    pytest.importorskip("distributed")
    from dsedge.toolchain.datacheck.engine import dask_client

    corpus, _, entities, cfg = bad_text
    fraud_single = check_data(str(fraud_csv(shared_data)))
    with dask_client(workers=2) as client:                             # the local 2-worker cluster --engine dask starts
        pids = set(client.run(os.getpid).values())
        addr = client.scheduler.address
        code, out, _ = run_cli(["data", "check", str(corpus), "--config", str(cfg), "--entities", str(entities),
                                "--engine", "dask", "--scheduler", addr, "--shard-mb", "0.008", "--json"], capsys)
        fraud = check_data(str(fraud_csv(shared_data)), engine="dask", shard_bytes=1 << 20, scheduler=addr)
    text = json.loads(out)
    assert code == 1 and len(pids) == 2 and os.getpid() not in pids
    assert text["run"]["shards"] > 3 and fraud["run"]["shards"] == 6
    assert without_run(text) == json.loads(json.dumps(without_run(bad_text_report)))
    assert without_run(fraud) == without_run(fraud_single)
    for pid in pids:                                                   # the cluster's worker processes are gone
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_default_config_is_the_documented_one():
    assert load_config(None) == DataCheckConfig()


def test_signatures_equal_datasketch_minhash():
    from datasketch import MinHash

    from dsedge.toolchain.datacheck.dedup import minhash_signatures, shingles

    rng = np.random.default_rng(3)
    lens = np.array([0, 1, 2, 3, 40, 7, 0, 500])
    words = rng.integers(0, 2**32, int(lens.sum()), dtype=np.uint64).astype(np.uint32)
    sh, counts = shingles(words, lens)
    sig = minhash_signatures(sh, counts, 128, chunk=100)               # several chunks
    ends = np.cumsum(counts)
    for d in range(lens.size):
        m = MinHash(num_perm=128, seed=1, scheme="affine32", hashfunc=int)
        m.update_batch(sh[ends[d] - counts[d]:ends[d]].tolist())
        assert np.array_equal(sig[d], m.hashvalues), d
    assert counts.tolist() == [0, 1, 1, 1, 38, 5, 0, 498]
