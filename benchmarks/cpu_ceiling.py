"""What INT8 can buy on this CPU: the reference model's 36 linear layers alone, fp32 vs dynamic INT8 on ORT, beside
PyTorch eager and the cpu bundle's default variant, side by side in one run.

    python benchmarks/cpu_ceiling.py [--bundle out/all-minilm-l6-v2-cpu.dse] [--threads 2] [--runs 30]

The linear-layer chain has all-MiniLM-L6-v2's GEMM shapes (per encoder layer: four 384×384, one 384×1536, one
1536×384; six layers) and nothing else, so its INT8 time is a floor for any INT8 model of the same size on this
host: attention, LayerNorm, GELU and the embedding lookup come on top. ``eager / int8 linears`` is therefore the
best speed-up INT8 could reach over PyTorch eager here; the issue's goals (6× at batch 1 × seq 32, 4.5× at
batch 32 × seq 64) are printed beside it. The CPU's SIMD flags are printed too: without AVX-512 VNNI / AVX-VNNI,
ORT's u8s8 kernels (vpmaddubsw) reach about 2× the fp32 FMA rate at most.
"""
from __future__ import annotations

import argparse
import logging
import sys
import tempfile
from pathlib import Path

import numpy as np

HIDDEN, FFN, LAYERS = 384, 1536, 6
GOALS = {(1, 32): 6.0, (32, 64): 4.5}


def linear_chain(path: Path) -> Path:
    """ONNX of x[tokens, 384] through the reference model's 36 MatMul weights in order (random weights)."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    nodes, inits, x = [], [], "x"
    for layer in range(LAYERS):
        for j, (k, n) in enumerate([(HIDDEN, HIDDEN)] * 4 + [(HIDDEN, FFN), (FFN, HIDDEN)]):
            w = f"w{layer}_{j}"
            inits.append(numpy_helper.from_array((rng.standard_normal((k, n)) / np.sqrt(k)).astype(np.float32), w))
            nodes.append(helper.make_node("MatMul", [x, w], [f"y{layer}_{j}"], name=f"mm{layer}_{j}"))
            x = f"y{layer}_{j}"
    graph = helper.make_graph(nodes, "linears", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["t", HIDDEN])],
                              [helper.make_tensor_value_info(x, TensorProto.FLOAT, ["t", HIDDEN])], inits)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return path


def simd_flags() -> str:
    try:
        flags = next(line for line in open("/proc/cpuinfo") if line.startswith("flags")).split()
    except (OSError, StopIteration):
        return "unknown"
    want = ["avx2", "fma", "avx512f", "avx512_vnni", "avx_vnni", "amx_int8"]
    return " ".join(f"{f}{'+' if f in flags else '-'}" for f in want)


def quiet_quantize_dynamic_advice() -> None:
    """onnxruntime.quantization logs this advice (to the root logger) on every quantize_dynamic: noise here."""
    logging.getLogger().addFilter(
        lambda r: not r.getMessage().startswith("Please consider to run pre-processing before quantization"))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])  # the first paragraph, not half a sentence
    ap.add_argument("--bundle", help="a cpu bundle; its default variant is timed beside the floor")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--runs", type=int, default=30)
    args = ap.parse_args(argv)
    if args.bundle and not Path(args.bundle).exists():
        sys.exit(f"cpu_ceiling.py: bundle {args.bundle} does not exist (build it with `dsedge build`, or leave "
                 "--bundle out)")
    quiet_quantize_dynamic_advice()

    import onnxruntime as ort
    import torch
    from onnxruntime.quantization import QuantType, quantize_dynamic

    import dsedge
    from dsedge.runtime.latency import time_calls
    from dsedge.toolchain import reference

    torch.set_num_threads(args.threads)
    so = ort.SessionOptions()
    so.intra_op_num_threads, so.inter_op_num_threads = args.threads, 1
    with tempfile.TemporaryDirectory(prefix="dsedge-ceiling-") as tmp:
        fp32 = linear_chain(Path(tmp) / "linears.onnx")
        int8 = Path(tmp) / "linears-int8.onnx"
        quantize_dynamic(str(fp32), str(int8), per_channel=True, weight_type=QuantType.QInt8)
        chains = {k: ort.InferenceSession(str(p), so, providers=["CPUExecutionProvider"])
                  for k, p in (("fp32", fp32), ("int8", int8))}
        d = reference.verified_model_dir()
        eager = reference.sentence_encoder(d)
        bundle = dsedge.load(args.bundle, threads=args.threads) if args.bundle else None
        print(f"CPU SIMD: {simd_flags()}; threads {args.threads}; median of {args.runs} (batch 32: of "
              f"{max(args.runs // 3, 5)}); all in this process")
        print(f"{'shape':>8} | {'eager ms':>8} | {'fp32 linears':>12} | {'int8 linears':>12} {'fp32/int8':>9} | "
              f"{'floor ×eager':>12} {'goal':>5}" + (f" | {'bundle ' + bundle.variant.name:>12} {'×eager':>7}"
                                                        if bundle else ""))
        rng = np.random.default_rng(0)
        for (batch, seq), goal in GOALS.items():
            runs = args.runs if batch == 1 else max(args.runs // 3, 5)
            ids = rng.integers(1000, 29000, (batch, seq)).astype(np.int64)
            feeds = {"input_ids": ids, "attention_mask": np.ones_like(ids), "token_type_ids": np.zeros_like(ids)}
            tt = [torch.from_numpy(v) for v in feeds.values()]
            with torch.inference_mode():
                t_eager = time_calls(lambda: eager(*tt), iterations=runs, warmup=3)["p50"]
            x = {"x": rng.standard_normal((batch * seq, HIDDEN)).astype(np.float32)}
            t = {k: time_calls(lambda s=s: s.run(None, x), iterations=runs, warmup=3)["p50"] for k, s in chains.items()}
            line = (f"{batch:>3}×{seq:<4} | {t_eager:8.2f} | {t['fp32']:12.2f} | {t['int8']:12.2f} "
                    f"{t['fp32'] / t['int8']:8.2f}× | {t_eager / t['int8']:11.2f}× {goal:4.1f}×")
            if bundle:
                tb = time_calls(lambda: bundle.run(feeds), iterations=runs, warmup=3)["p50"]
                line += f" | {tb:12.2f} {t_eager / tb:6.2f}×"
            print(line, flush=True)


if __name__ == "__main__":
    main()
