"""The cpu default INT8 (per-row dynamic, batch-invariant) vs the per-tensor dynamic INT8 it replaces, vs the other
batch-invariant ORT CPU forms of the same model and PyTorch eager, side by side in one run.

    python benchmarks/int8_batch_invariance.py                 # the reference model (all-MiniLM-L6-v2), ~3 min
    python benchmarks/int8_batch_invariance.py --rounds 4      # shorter

Forms (all from the reference model's TorchScript export, fused by ORT's transformer optimizer like the cpu build):
``int8-rowwise`` (the cpu target's INT8: toolchain/quantize/int8_rowwise.py, 7-bit weights, attention fused as
MultiHeadAttention so its Q, K and V projections are quantized), ``int8-rowwise-attn`` (the same over a fused
``Attention``, whose QKV projection stays float: the cpu target's INT8 until 2026-12-06), ``int8-rowwise-uint8``
(its UINT8-weight option, the default before), ``int8-per-tensor`` (``quantize_dynamic``,
the former default), ``fp32-fused``, ``int8-nbits-acc4`` (MatMulNBits 8-bit weights, int8 compute, per-block
activation scales), ``int8-static`` (static activation scales: the toolchain's calibrated W8A8 Q/DQ,
toolchain/quantize/int8.py, the TensorRT targets' INT8, here on 16 batches of random 32-token sentences, which is
enough to time it; on the fused graph ORT's quantizer cannot type the contrib ops' outputs and quantizes no
activation, so it is quantized before fusion and fused after), ``fp32`` (the dynamo export the bundle ships) and
``torch-eager``.
Per form: p50 ms at batch 1 × 32 tokens and batch 32 × 64 tokens (blocks of runs alternate between forms so machine
noise hits all alike), and batch invariance: max |alone − batched| / max |alone| for a 20-token sentence batched with
sentences of 7, 33 and 64 tokens (padded as the scheduler pads). Timings on a shared machine are noisy.
"""
from __future__ import annotations

import argparse
import logging
import shutil
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np


def _faster(eager_ms: float, ms: float) -> str:
    return f"{eager_ms / ms:.1f}x faster" if ms <= eager_ms else f"{ms / eager_ms:.1f}x slower"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=8, help="alternating blocks per form and shape")
    ap.add_argument("--block", type=int, default=3, help="runs per block")
    ap.add_argument("--threads", type=int, default=None, help="ORT intra-op threads (torch: the same)")
    ap.add_argument("--no-torch", action="store_true")
    args = ap.parse_args(argv)
    if args.rounds < 1 or args.block < 1:
        ap.error("--rounds and --block must be at least 1")
    # the TorchScript export's note on transformers' constant mask tensor (the same for every input): harmless
    import torch

    warnings.filterwarnings("ignore", message="torch.tensor results are registered as constants in the trace",
                            category=torch.jit.TracerWarning)

    import onnx
    import onnxruntime as ort

    from dsedge.toolchain.export import export_onnx
    from dsedge.toolchain.stages.compressors import fusable_export
    from dsedge.toolchain.quantize.int8 import _save, fuse_transformer, quantize_int8_dynamic, quantize_int8_static
    from dsedge.toolchain.quantize.int8_rowwise import quantize_int8_rowwise
    from dsedge.toolchain.sources import resolve_source

    from streaming import cpu_line  # benchmarks/streaming.py: CPU flags and load

    work = Path(tempfile.mkdtemp(prefix="dsedge-int8-bench-"))
    source = resolve_source(None)
    exported = export_onnx(source, work / "fp32.onnx")
    fusable = fusable_export(exported, source, work)
    if fusable is None:
        raise SystemExit("the reference model did not give a fusable TorchScript export")
    fused, _ = fuse_transformer(onnx.load(str(fusable)), model_type="bert")
    # the cpu target's INT8 is quantized from this form: attention fused as MultiHeadAttention, its Q, K and V
    # projections MatMuls the per-row quantizer reaches (toolchain/stages/compressors.py, compress_int8)
    fused_mha, _ = fuse_transformer(onnx.load(str(fusable)), model_type="bert", attention="MultiHeadAttention")
    forms = {"fp32": work / "fp32.onnx"}
    rng = np.random.default_rng(0)
    cal = [{"input_ids": rng.integers(1000, 30000, size=(1, 32)).astype(np.int64),
            "attention_mask": np.ones((1, 32), np.int64), "token_type_ids": np.zeros((1, 32), np.int64)}
           for _ in range(16)]
    logging.getLogger().setLevel(logging.ERROR)  # ORT's quantizer logs each tensor of the fused export it skips
    static, _ = quantize_int8_static(onnx.load(str(fusable)), cal)
    static, _ = fuse_transformer(static, model_type="bert")
    for name, model in (("int8-rowwise", quantize_int8_rowwise(fused_mha, fuse=None)[0]),
                        ("int8-rowwise-attn", quantize_int8_rowwise(fused, fuse=None)[0]),
                        ("int8-rowwise-uint8", quantize_int8_rowwise(fused_mha, fuse=None, weight_type="uint8")[0]),
                        ("int8-per-tensor", quantize_int8_dynamic(fused, fuse=None)[0]), ("fp32-fused", fused),
                        ("int8-static", static)):
        forms[name] = work / f"{name}.onnx"
        _save(model, forms[name])
    try:
        from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

        q = MatMulNBitsQuantizer(onnx.load(str(forms["fp32-fused"])), bits=8, block_size=32, is_symmetric=True,
                                 accuracy_level=4)
        q.process()
        forms["int8-nbits-acc4"] = work / "nbits.onnx"
        _save(q.model.model, forms["int8-nbits-acc4"])
    except Exception as e:  # not every onnxruntime has 8-bit MatMulNBits on CPU
        print(f"# int8-nbits-acc4 skipped: {type(e).__name__}: {e}")
    order = ["int8-rowwise", "int8-rowwise-attn", "int8-rowwise-uint8", "int8-per-tensor", "fp32-fused",
             "int8-nbits-acc4", "int8-static", "fp32"]
    opts = ort.SessionOptions()
    if args.threads:
        opts.intra_op_num_threads = args.threads
        opts.inter_op_num_threads = 1
    opts.log_severity_level = 3
    # no spin-waiting between runs, as dsedge's runtime opens its sessions: the forms share one process, and an idle
    # session's spinning pool took the cores from the one timed next (fp32-fused measured 10.9 against 6.0 ms at b1)
    opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    sessions = {n: ort.InferenceSession(str(forms[n]), opts, providers=["CPUExecutionProvider"])
                for n in order if n in forms}
    rng = np.random.default_rng(0)

    def feed(b: int, s: int, lens=None) -> dict[str, np.ndarray]:
        ids = rng.integers(1000, 30000, size=(b, s)).astype(np.int64)
        mask = np.ones((b, s), np.int64)
        for i, n in enumerate(lens or []):
            ids[i, n:] = 0
            mask[i, n:] = 0
        return {"input_ids": ids, "attention_mask": mask, "token_type_ids": np.zeros((b, s), np.int64)}

    runs = {n: (lambda f, s=s: s.run(None, f)) for n, s in sessions.items()}
    if not args.no_torch:
        import torch

        if args.threads:
            torch.set_num_threads(args.threads)
        module = source.module.eval()
        tnames = [n for n in ("input_ids", "attention_mask", "token_type_ids") if n in source.example_inputs]

        def torch_run(f):
            with torch.inference_mode():
                return module(*[torch.from_numpy(f[n]) for n in tnames])
        runs["torch-eager"] = torch_run
    invariance = {}
    for name, s in sessions.items():
        worst = 0.0
        for _ in range(2):
            f = feed(4, 64, [20, 7, 33, 64])
            alone = s.run(None, {k: v[:1, :20] for k, v in f.items()})
            batched = s.run(None, f)
            for a, b in zip(alone, batched):
                b = b[:1, :20] if b.ndim == 3 else b[:1]
                worst = max(worst, float(np.max(np.abs(a - b)) / np.max(np.abs(a))))
        invariance[name] = worst
    shapes = [(1, 32), (32, 64)]
    p50: dict[str, dict[str, float]] = {n: {} for n in runs}
    for b, s in shapes:
        f = feed(b, s)
        for fn in runs.values():
            fn(f)
        samples: dict[str, list[float]] = {n: [] for n in runs}
        for r in range(args.rounds):
            names = list(runs) if r % 2 == 0 else list(runs)[::-1]
            for n in names:
                for _ in range(args.block if b == 1 else 1):
                    t0 = time.perf_counter()
                    runs[n](f)
                    samples[n].append((time.perf_counter() - t0) * 1e3)
        for n in runs:
            p50[n][f"{b}x{s}"] = float(np.median(samples[n]))
    print(f"# int8 batch invariance  onnxruntime {ort.__version__}  threads {args.threads or 'default'}  "
          f"rounds {args.rounds}")
    print(cpu_line())
    print(f"{'form':<18} {'b1x32 p50 ms':>13} {'b32x64 p50 ms':>14} {'alone vs batched':>17}  batch-invariant")
    for n in runs:
        inv = invariance.get(n)
        print(f"{n:<18} {p50[n]['1x32']:>13.2f} {p50[n]['32x64']:>14.1f} "
              f"{(f'{inv:.1e}' if inv is not None else '-'):>17}  "
              f"{'-' if inv is None else ('yes' if inv <= 1e-5 else 'NO')}")
    r, t = p50["int8-rowwise"], p50["int8-per-tensor"]
    fastest_inv = min((n for n in sessions if invariance[n] <= 1e-5 and n != "int8-rowwise"),
                      key=lambda n: p50[n]["1x32"] + p50[n]["32x64"] / 32)
    print(f"# int8-rowwise (the cpu target's INT8) vs per-tensor: b1x32 {r['1x32'] / t['1x32']:.2f}x, b32x64 "
          f"{r['32x64'] / t['32x64']:.2f}x the time; vs the fastest other batch-invariant form ({fastest_inv}): b1x32 "
          f"{r['1x32'] / p50[fastest_inv]['1x32']:.2f}x, b32x64 {r['32x64'] / p50[fastest_inv]['32x64']:.2f}x the time")
    if "torch-eager" in p50:
        e = p50["torch-eager"]
        for n in ("int8-rowwise", "fp32-fused"):  # what the cpu build's auto picks from (toolchain/stages/auto.py)
            print(f"# {n} vs PyTorch eager: b1x32 {_faster(e['1x32'], p50[n]['1x32'])}, b32x64 "
                  f"{_faster(e['32x64'], p50[n]['32x64'])}")
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
