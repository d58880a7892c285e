"""A bundle's default variant (e.g. INT4) vs its fp32 ONNX vs PyTorch eager on the real all-MiniLM-L6-v2, side by side in one run.

    python benchmarks/reference_latency.py [--bundle out/all-minilm-l6-v2-jetson-orin.dse] [--threads 2] [--runs 30]

Builds the jetson bundle into ``out/`` under the current directory first when --bundle is not given. Prints median
latency (ms) at batch 1 × seq 32 and batch 32 × seq 64, and each one's speed-up over PyTorch eager fp32: after 3
untimed calls each, every round calls eager, the fp32 ONNX and the bundle once, the order rotated
(``dsedge.runtime.latency.time_interleaved``).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bundle")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--runs", type=int, default=30)
    args = ap.parse_args(argv)
    if args.bundle and not Path(args.bundle).exists():
        sys.exit(f"reference_latency.py: bundle {args.bundle} does not exist (build it with `dsedge build`, or leave "
                 "--bundle out to build the jetson one here)")

    import torch

    import dsedge
    from dsedge.runtime.latency import time_interleaved
    from dsedge.toolchain import reference

    torch.set_num_threads(args.threads)
    if not args.bundle:
        from dsedge.toolchain.pipeline import BuildOptions, build

        t = time.perf_counter()
        args.bundle = str(build(BuildOptions(target="jetson", out_dir="out")).bundle)
        print(f"built {args.bundle} in {time.perf_counter() - t:.1f} s")
    d = reference.verified_model_dir()
    tok = reference.load_tokenizer(d)
    eager = reference.sentence_encoder(d)
    default = dsedge.load(args.bundle, threads=args.threads)
    name = default.variant.name
    sessions = {"fp32": dsedge.load(args.bundle, variant="fp32", threads=args.threads), name: default}
    from streaming import cpu_line  # benchmarks/streaming.py: CPU flags and load

    print(f"{args.bundle}: threads {args.threads}, median of {args.runs}; providers {default.providers}")
    print(cpu_line())
    print(f"{'shape':>10} | {'torch eager ms':>14} | {'fp32 ONNX ms':>12} {'×eager':>6} | {name + ' bundle ms':>14} "
          f"{'×eager':>6}")
    rng = np.random.default_rng(0)
    for batch, seq in ((1, 32), (32, 64)):
        ids = rng.integers(1000, 29000, (batch, seq)).astype(np.int64)
        ids[:, 0], ids[:, -1] = tok.cls_token_id, tok.sep_token_id
        feeds = {"input_ids": ids, "attention_mask": np.ones_like(ids), "token_type_ids": np.zeros_like(ids)}
        tt = [torch.from_numpy(v) for v in feeds.values()]
        with torch.inference_mode():  # every path once per round, the order rotated: side by side, not in turn
            got = time_interleaved({"eager": lambda: eager(*tt), "fp32": lambda: sessions["fp32"].run(feeds),
                                    name: lambda: sessions[name].run(feeds)}, rounds=args.runs)
        t_eager, t32, t4 = (statistics.median(got[k]) for k in ("eager", "fp32", name))
        print(f"{batch:>4}×{seq:<5} | {t_eager:14.2f} | {t32:12.2f} {t_eager / t32:5.2f}× | {t4:14.2f} {t_eager / t4:5.2f}×")


if __name__ == "__main__":
    main()
