"""``dsedge data check`` throughput and peak memory on a generated JSONL corpus, single process.

    python benchmarks/datacheck_throughput.py [--mib 1024] [--dir /tmp] [--keep] [--no-near] [--corpus FILE.jsonl]

Generates ``--mib`` MiB of JSON Lines (documents of 150-650 Zipf-distributed words over a 200k-word vocabulary,
1 % exact copies, 1 % near copies with one word changed), runs the check in a child process (so its peak RSS is the
check's alone, measured as ru_maxrss of the child) and prints documents/s, MiB/s, peak RSS and the dedup index's
bytes per document. The corpus is deleted afterwards unless ``--keep``. Timings on shared cores are noisy; the CPU
model and flags are printed first.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np


def cpu_line() -> str:
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    model = next((ln.split(":", 1)[1].strip() for ln in info.splitlines() if ln.startswith("model name")), "?")
    flags = next((ln.split(":", 1)[1].split() for ln in info.splitlines() if ln.startswith("flags")), [])
    keep = [f for f in flags if f in ("avx", "avx2", "avx512f", "avx512bw", "avx512_vnni", "avx_vnni", "fma", "sse4_2", "bmi2")]
    return f"{model}; {os.cpu_count()} logical CPUs; flags {' '.join(keep)}"


def generate(path: Path, mib: int, seed: int = 0) -> int:
    """Write the corpus, stopping at the document that reaches ``mib`` MiB (so it is over by less than one
    document), and return the number of documents."""
    rng = np.random.default_rng(seed)
    vocab = np.array([f"w{i}" for i in range(200_000)])
    target = mib << 20
    written, docs, recent = 0, 0, []
    with open(path, "w", encoding="utf-8") as f:
        while written < target:
            n_docs = 2000
            lens = rng.integers(150, 650, n_docs)
            ids = np.minimum(rng.zipf(1.1, int(lens.sum())) - 1, vocab.size - 1)
            words = vocab[ids]
            lines, pos = [], 0
            for n in lens:
                text = " ".join(words[pos:pos + n])
                pos += n
                u = rng.random()
                if recent and u < 0.01:
                    text = recent[int(rng.integers(len(recent)))]
                elif recent and u < 0.02:
                    text = recent[int(rng.integers(len(recent)))] + " extra"
                recent = (recent + [text])[-500:]
                lines.append(json.dumps({"id": docs, "text": text}) + "\n")  # ASCII: characters are bytes
                docs += 1
                written += len(lines[-1])
                if written >= target:  # the last block ends here, not after its 2,000 documents
                    break
            f.write("".join(lines))
    return docs


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=1024)
    ap.add_argument("--dir", default="/tmp")
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--no-near", action="store_true", help="exact duplicates only (no MinHash)")
    ap.add_argument("--corpus", help="check this existing corpus instead of generating one (kept)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.mib < 1:
        ap.error("--mib must be at least 1")
    if a.corpus and not Path(a.corpus).is_file():
        ap.error(f"--corpus {a.corpus}: no such file")
    if not a.corpus and not a.child and not Path(a.dir).is_dir():
        ap.error(f"--dir {a.dir}: no such directory")
    if a.child:
        import datasketch  # noqa: F401  (imported before the RSS baseline)
        import pandas  # noqa: F401

        from dsedge.toolchain.datacheck import DataCheckConfig, check_data

        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        c0 = time.process_time()
        r = check_data(a.child, DataCheckConfig(near=not a.no_near))
        cpu = time.process_time() - c0
        ru = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        print(json.dumps({"run": r["run"], "peak_rss_mib": ru, "import_rss_mib": base, "cpu_s": cpu,
                          "docs": r["duplicates"]["docs"],
                          "index_bytes_per_doc": r["duplicates"]["index_bytes_per_doc"],
                          "checks": {c["id"]: [c["status"], c["value"]] for c in r["checks"]}}))
        return
    print(f"cpu: {cpu_line()}")
    corpus = Path(a.corpus) if a.corpus else Path(a.dir) / f"datacheck-bench-{os.getpid()}.jsonl"
    try:
        if not a.corpus:
            t = time.perf_counter()
            docs = generate(corpus, a.mib)
            print(f"generated {docs} docs, {corpus.stat().st_size / 2**20:.2f} MiB in {time.perf_counter() - t:.0f} s")
        size = corpus.stat().st_size
        cmd = [sys.executable, __file__, "--child", str(corpus)] + (["--no-near"] if a.no_near else [])
        t = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"datacheck_throughput.py: the check failed (exit {proc.returncode}):\n"
                             f"{proc.stderr.strip()[-2000:]}")
        out = proc.stdout
        wall = time.perf_counter() - t
        res = json.loads(out.strip().splitlines()[-1])
        run = res["run"]
        print(f"check: {run['wall_s']:.1f} s wall ({wall:.1f} s with imports), {run['docs_per_s']:.0f} docs/s, "
              f"{size / 2**20 / run['wall_s']:.2f} MiB/s; CPU {res['cpu_s']:.1f} s = "
              f"{res['docs'] / res['cpu_s']:.0f} docs per CPU-second; peak RSS {res['peak_rss_mib']:.0f} MiB "
              f"(after imports {res['import_rss_mib']:.0f} MiB); dedup index {res['index_bytes_per_doc']} B/doc "
              f"x {res['docs']} docs = {res['index_bytes_per_doc'] * res['docs'] / 2**20:.2f} MiB")
        print(json.dumps(res["checks"]))
    finally:
        if not (a.keep or a.corpus) and corpus.exists():
            corpus.unlink()


if __name__ == "__main__":
    main()
