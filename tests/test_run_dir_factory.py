"""A run directory's model.json names the factory that rebuilds its model; loading the run (``dsedge build --model
RUN``, a distillation teacher) must not call whatever function a tampered model.json names (a user's pass,
2026-12-06: ``"factory": "os:system"`` ran a shell command). Real torch, real safetensors, the real CLI."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from cli_helpers import run_main
from dsedge.runtime.errors import SourceError
from dsedge.toolchain.train.export_source import TRUST_ENV, load_trained


def _run_dir(root, factory: str, kwargs: dict, state: dict | None = None):
    final = root / "final"
    final.mkdir(parents=True)
    save_file(state if state is not None else torch.nn.Linear(4, 2).state_dict(), str(final / "model.safetensors"))
    (final / "model.json").write_text(json.dumps({
        "factory": factory, "kwargs": kwargs, "input_names": ["x"],
        "example_inputs": {"x": {"shape": [1, 4], "dtype": "float32"}}}))
    return root


def test_a_tampered_factory_is_refused_before_it_is_called(tmp_path, capsys):
    marker = tmp_path / "PWNED"
    run = _run_dir(tmp_path / "evil", "os:system", {"command": f"touch {marker}"})
    with pytest.raises(SourceError, match="names factory 'os:system'.*not a model factory this environment vouches"):
        load_trained(run)
    code, out, err = run_main(["build", "--model", run, "--target", "cpu", "--precision", "fp32", "--out",
                               tmp_path / "out"], capsys)
    assert code == 2 and "not a model factory this environment vouches for" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) <= 3, err
    assert not marker.exists()


def test_module_classes_and_local_factories_load_and_a_factory_must_build_a_module(tmp_path, monkeypatch):
    linear = torch.nn.Linear(4, 2)
    model, examples = load_trained(_run_dir(tmp_path / "lin", "torch.nn:Linear",
                                            {"in_features": 4, "out_features": 2}, linear.state_dict()))
    assert torch.equal(model.weight, linear.weight) and examples["x"].shape == (1, 4)
    # a function of your own code (tests/train_models.py, as a training config names it): trusted,
    # but what it returns must be a torch.nn.Module
    with pytest.raises(SourceError, match="returned tuple, not a torch.nn.Module"):
        load_trained(_run_dir(tmp_path / "data", "train_models:make_data", {"n": 4}))
    # a module outside those, trusted by the user: loaded (here json.loads, which builds no module)
    run = _run_dir(tmp_path / "json", "json:loads", {"s": "1"})
    with pytest.raises(SourceError, match="not a model factory"):
        load_trained(run)
    monkeypatch.setenv(TRUST_ENV, "numpy, json")
    with pytest.raises(SourceError, match="returned int, not a torch.nn.Module"):
        load_trained(run)
