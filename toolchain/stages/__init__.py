"""The stages of ``dsedge build``, one module each, each a function from artifact(s) to an artifact.

``plan_build`` (../config.py) → ``resolve`` (source.py) → ``export`` (export.py) → ``read_inputs`` (inputs.py) →
``finetune`` (finetune.py: ``--prune`` / ``--qat-steps``) → ``compress`` (compress.py, with auto.py for
``--precision auto``) → ``fit`` (fit.py) → ``validate`` (validate.py) → ``measure`` (measure.py) →
``engine_recipe`` (engine_recipe.py) → ``assemble_report`` (report.py) → ``write`` (write.py).
The recipe that calls them in order is ``dsedge.toolchain.pipeline.build``; ``runner.StageRunner`` times each stage
and shows it on the terminal.
"""
