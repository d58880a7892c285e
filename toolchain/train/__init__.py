"""Training and distillation: recipes (``train.py``, ``distill.py``) wired from small components.

- ``components.py``  model/data factories, domain mixture, batch sampler; ``run_files.py`` config.toml, final/
- ``evaluation.py``  (per-domain) validation, moving the mixture / augmentation; ``reductions.py`` grad norm, loss
- ``config.py``      the TOML/YAML contract (docs/train.md), ConfigError on unknown keys and impossible meshes
- ``parallel.py``    DeviceMesh (pp, dp, tp): DDP (+ fp16/bf16/PowerSGD comm hooks), FSDP2, DTensor TP, pipelining
- ``precision.py``   autocast bf16/fp16 with fp32 norm layers, GradScaler for fp16, FSDP2 MixedPrecisionPolicy
- ``optim.py``       LAMB (DTensor-aware) + AdamW hybrid, warmup-cosine schedule (torch lr_scheduler)
- ``checkpoint.py``  atomic torch.distributed.checkpoint saves, resume from the latest intact one;
                     ``checkpoint_reader.py`` reads them without running code from the files
- ``sampler.py``     dp-sharded global batches (resumable), token-budget batches for variable-length sequences
- ``losses.py``      config losses and the KD loss; ``metrics.py`` JSONL log, progress bar, TensorBoard
- ``export_source.py`` ``load_trained(run_dir)`` for ``dsedge build --model RUN_DIR``

Run: ``dsedge train CONFIG`` (one process), ``dsedge train CONFIG --nproc-per-node 2 [--max-restarts 1]`` or
``torchrun --nproc-per-node N -m dsedge.cli train CONFIG`` (set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 with
--max-restarts). Torch is imported only inside these modules, never by ``dsedge --help``.
"""
