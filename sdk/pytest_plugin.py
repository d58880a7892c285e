"""On-device latency tests as a pytest plugin (registered through the ``pytest11`` entry point ``dsedge``).

On the device::

    pytest --dsedge-bundle out/all-minilm-l6-v2-jetson-orin.dse [--dsedge-target jetson-orin] --junitxml=latency.xml

adds one test per (bundle, variant, batch size) read from the manifest — the batch sizes measured at build
(``variant.latency_ms`` keys, at the sequence length the build used), else the bundle's batch shape range
(min/opt/max) — each asserting that the latency at
``--dsedge-percentile`` (default p99) is within the budget (``--dsedge-budget-ms``, else the manifest's, else the
target profile's). Measured figures go into the JUnit XML as ``<property>`` elements (p50_ms, p99_ms, budget_ms,
providers, device).

A test module (the samples ship one each) can ask for the ``dsedge_latency`` fixture instead; it is parametrized the
same way from the bundles named by ``@pytest.mark.dsedge_bundle("path.dse", …)`` (relative paths are looked up from
the invocation directory, the rootdir, then the test file's directory) or, without that mark, by ``--dsedge-bundle``::

    @pytest.mark.dsedge_bundle("out/fraud-cpu.dse", "out/fraud-jetson-orin.dse")
    def test_latency(dsedge_latency):
        dsedge_latency.check()

Without a bundle, with a bundle for another target than ``--dsedge-target``, or with a GPU bundle on a machine whose
ONNX Runtime has no CUDA/TensorRT provider, the tests are skipped with that reason — never passed. A corrupt bundle
fails. The module imports only pytest and the standard library at import time (it is loaded by every pytest run).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

import pytest

GPU_PROVIDERS = ("TensorrtExecutionProvider", "CUDAExecutionProvider")


def pytest_addoption(parser: pytest.Parser) -> None:
    g = parser.getgroup("dsedge", "dsedge on-device latency tests")
    g.addoption("--dsedge-bundle", action="append", default=[], metavar="BUNDLE",
                help="A .dse bundle to test (repeatable): adds latency tests per variant and batch size.")
    g.addoption("--dsedge-target", default=None, metavar="TARGET",
                help="Only test bundles built for this target (name, alias or profile file); its profile gives the "
                     "default budget.")
    g.addoption("--dsedge-budget-ms", type=float, default=None, help="Latency budget in ms (default: the manifest's).")
    g.addoption("--dsedge-percentile", default="p99", help="Percentile judged against the budget (default p99).")
    g.addoption("--dsedge-batch", default=None, help="Comma-separated batch sizes (default: the manifest's).")
    g.addoption("--dsedge-seq-len", type=int, default=None, help="Tokens per sequence for text models.")
    g.addoption("--dsedge-iterations", type=int, default=200, help="Timed runs per test (default 200).")
    g.addoption("--dsedge-warmup", type=int, default=10, help="Untimed runs first (default 10).")
    g.addoption("--dsedge-threads", type=int, default=None, help="CPU intra-op threads.")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "dsedge_bundle(*paths): bundles whose latency the dsedge_latency fixture tests")
    config.stash[_SESSIONS] = {}
    _check_options(config)


def _check_options(config: pytest.Config) -> None:
    """Bad --dsedge-* values stop the run at once as usage errors (exit 4), before any test is collected."""
    opt = config.getoption
    try:
        if opt("--dsedge-target"):
            from .targets import get_target

            get_target(opt("--dsedge-target"))
        if opt("--dsedge-percentile") != "p99":
            from .runtime.bench import normalize_percentile

            normalize_percentile(opt("--dsedge-percentile"))
    except Exception as e:  # DsedgeError, imported lazily (this module loads in every pytest run)
        hint = getattr(e, "hint", "")
        raise pytest.UsageError(f"dsedge: {e}" + (f" ({hint})" if hint else "")) from None
    batch = opt("--dsedge-batch")
    if batch and not all(x.strip().isdigit() and int(x) > 0 for x in batch.split(",")):
        raise pytest.UsageError(f"--dsedge-batch {batch!r}: use positive integers, e.g. 1,8,32")
    for name in ("--dsedge-iterations", "--dsedge-warmup"):
        if opt(name) < (1 if name == "--dsedge-iterations" else 0):
            raise pytest.UsageError(f"{name} {opt(name)} is out of range")


def pytest_unconfigure(config: pytest.Config) -> None:
    for s in config.stash.get(_SESSIONS, {}).values():
        s.close()


_SESSIONS = pytest.StashKey[dict]()


# ------------------------------------------------------------------------------------------------ the cases
@dataclass
class LatencyCase:
    """One latency test: a bundle variant at one batch size, its budget, or why it cannot run here."""

    bundle: Path
    variant: str | None = None
    batch: int = 1
    budget_ms: float | None = None
    budget_source: str = "none"
    target: str = "?"
    seq_len: int | None = None
    skip_reason: str | None = None
    error: Exception | None = field(default=None, repr=False)

    @property
    def id(self) -> str:
        stem = self.bundle.name[:-4] if self.bundle.name.endswith(".dse") else self.bundle.name
        return f"{stem}/{self.variant or '-'}/b{self.batch}"


class LatencyBudgetExceeded(AssertionError):
    """The measured latency at the chosen percentile is above the budget."""


def _find_bundle(path: str | os.PathLike, bases: Iterable[Path]) -> Path:
    p = Path(path).expanduser()
    if p.is_absolute():
        return p
    for base in bases:
        if (base / p).exists():
            return base / p
    return Path(path)


def _batch_sizes(manifest: Any, variant: Any, option: str | None) -> list[int]:
    if option:
        return [int(x) for x in option.split(",") if x.strip()]
    first = manifest.inputs[0].shape[0] if manifest.inputs and manifest.inputs[0].shape else "batch"
    if isinstance(first, int):
        return [first]
    rng = manifest.shape_ranges.get(first, {})
    lo, hi = rng.get("min", 1), rng.get("max", 10**9)
    built = sorted({int(k) for k in variant.latency_ms if str(k).isdigit() and lo <= int(k) <= hi})
    if built:
        return built
    return sorted({int(rng[k]) for k in ("min", "opt", "max") if k in rng}) or [1]


def _recorded_seq_len(manifest: Any, variant: Any, batch: int) -> int | None:
    """The token-axis length the build measured this batch size at (``latency_ms[b]["shape"]``), if any; None for
    a figure given as a plain number of ms (the manifest allows both)."""
    from .runtime.bench import is_sequence_dim

    figure = variant.latency_ms.get(str(batch))
    shapes = figure.get("shape") if isinstance(figure, dict) else None
    shapes = shapes if isinstance(shapes, dict) else {}
    for spec in manifest.inputs:
        dims = shapes.get(spec.name)
        if dims and len(dims) == len(spec.shape):
            for sym, size in zip(spec.shape[1:], dims[1:]):
                if isinstance(sym, str) and is_sequence_dim(sym):
                    return int(size)
    return None


def _gpu_reachable() -> bool:
    """ORT has a TensorRT/CUDA provider, or TensorRT is installed and a GPU is found."""
    import importlib.util

    from .runtime.backends.ort import available_providers
    from .runtime.gpu_info import detect_gpu

    if any(p in available_providers() for p in GPU_PROVIDERS):
        return True
    return importlib.util.find_spec("tensorrt") is not None and detect_gpu() is not None


def latency_cases(config: pytest.Config, bundles: Iterable[str | os.PathLike], bases: Iterable[Path] = ()) -> list[LatencyCase]:
    """Expand bundles into cases: every variant × batch size, each with its budget or a skip reason.

    Reads only the manifests (hashes are checked when a case runs). A missing bundle, another target than
    ``--dsedge-target``, a GPU target without a GPU provider, or no budget anywhere → a case with ``skip_reason``;
    a malformed manifest → a case with ``error`` (it fails when run).
    """
    from .runtime.backends.ort import available_providers
    from .runtime.bench import resolve_budget
    from .runtime.errors import DsedgeError
    from .runtime.bundle import read_manifest
    from .targets import get_target

    opt = config.getoption
    want = get_target(opt("--dsedge-target")) if opt("--dsedge-target") else None
    bases = [Path(config.invocation_params.dir), Path(config.rootpath), *bases]
    cases: list[LatencyCase] = []
    for raw in bundles:
        path = _find_bundle(raw, bases)
        if not path.exists():
            cases.append(LatencyCase(path, skip_reason=f"bundle {str(raw)!r} not found (build it with `dsedge build`)"))
            continue
        try:
            manifest = read_manifest(path)
        except DsedgeError as e:
            cases.append(LatencyCase(path, error=e))
            continue
        tname = str(manifest.target.get("name", "?"))
        try:
            target = get_target(tname)
        except DsedgeError:
            target = None
        if want is not None and (target is None or target.name != want.name):
            cases.append(LatencyCase(path, target=tname,
                                     skip_reason=f"bundle is for target {tname!r}, not --dsedge-target {want.name!r}"))
            continue
        profile = want or target
        needs_gpu = profile is not None and (profile.backend == "tensorrt" or profile.compute_capability is not None)
        skip = None
        if needs_gpu and not _gpu_reachable():
            skip = (f"bundle for {tname!r} needs a GPU (TensorRT/CUDA); none is reachable here (no TensorRT with a GPU, "
                    f"and ONNX Runtime offers only {', '.join(available_providers())})")
        budget, source = resolve_budget(opt("--dsedge-budget-ms"), manifest, profile.default_budget_ms if profile else None)
        if budget is None and skip is None:
            skip = "no latency budget in the manifest or target profile; pass --dsedge-budget-ms"
        for v in manifest.variants:
            for b in _batch_sizes(manifest, v, opt("--dsedge-batch")):
                seq = opt("--dsedge-seq-len") or _recorded_seq_len(manifest, v, b)
                cases.append(LatencyCase(path, variant=v.name, batch=b, budget_ms=budget, budget_source=source,
                                         target=tname, skip_reason=skip, seq_len=seq))
    return cases


class LatencyCheck:
    """What a latency test does with its case: ``measure()`` → ``BatchResult``; ``check()`` measures and asserts.

    Measured figures are recorded on ``node.user_properties`` so ``--junitxml`` carries them.
    """

    def __init__(self, case: LatencyCase, config: pytest.Config, node: pytest.Item) -> None:
        self.case, self.config, self.node = case, config, node

    def session(self) -> Any:
        from .session import load

        if self.case.skip_reason:
            pytest.skip(self.case.skip_reason)
        if self.case.error is not None:
            raise self.case.error
        threads = self.config.getoption("--dsedge-threads")
        key = (str(self.case.bundle), self.case.variant, threads)
        cache = self.config.stash[_SESSIONS]
        if key not in cache:
            cache[key] = load(self.case.bundle, variant=self.case.variant, threads=threads, instances=1)
        return cache[key]

    def measure(self) -> Any:
        from .runtime.bench import BenchSettings, bench_session, device_info

        session = self.session()
        opt = self.config.getoption
        settings = BenchSettings(warmup=opt("--dsedge-warmup"), iterations=opt("--dsedge-iterations"),
                                 percentile=opt("--dsedge-percentile"))
        (result,) = bench_session(session, [self.case.batch], self.case.seq_len, settings, self.case.budget_ms)
        dev = device_info(session)
        props = self.node.user_properties
        props += [(f"{k}_ms", round(result.latency_ms[k], 4)) for k in ("mean", "p50", "p90", "p99", "max")]
        props += [("shape", ";".join(f"{k}={'x'.join(map(str, v))}" for k, v in result.shapes.items())),
                  ("budget_ms", self.case.budget_ms), ("budget_source", self.case.budget_source),
                  ("percentile", result.percentile), ("iterations", result.iterations),
                  ("inferences_per_s", round(result.inferences_per_s, 2)), ("target", self.case.target),
                  ("providers", ",".join(dev["providers"])), ("device", dev["gpu"] or dev["cpu"])]
        return result

    def check(self) -> Any:
        """Measure and raise ``LatencyBudgetExceeded`` if the percentile is over budget. Returns the BatchResult."""
        r = self.measure()
        got = r.latency_ms[r.percentile]
        if r.passed is False:
            raise LatencyBudgetExceeded(
                f"{self.case.id}: {r.percentile} {got:.3f} ms > budget {r.budget_ms:g} ms ({self.case.budget_source}); "
                f"p50 {r.latency_ms['p50']:.3f} ms, max {r.latency_ms['max']:.3f} ms over {r.iterations} runs")
        return r


# ---------------------------------------------------------------------------- tests from --dsedge-bundle
class LatencyItem(pytest.Item):
    """A latency test made from a manifest (no Python test file needed)."""

    def __init__(self, *, case: LatencyCase, **kw: Any) -> None:
        super().__init__(**kw)
        self.case = case
        if case.skip_reason:  # as a mark, so the skip is reported at the bundle, not inside this plugin
            self.add_marker(pytest.mark.skip(reason=case.skip_reason))

    def runtest(self) -> None:
        LatencyCheck(self.case, self.config, self).check()

    def repr_failure(self, excinfo: pytest.ExceptionInfo[BaseException], style: Any = None) -> str:
        from .runtime.errors import DsedgeError

        if isinstance(excinfo.value, (LatencyBudgetExceeded, DsedgeError)):
            hint = getattr(excinfo.value, "hint", "")
            return f"{excinfo.value}" + (f"\n  hint: {hint}" if hint else "")
        return super().repr_failure(excinfo)

    def reportinfo(self) -> tuple[Path, int, str]:
        return self.case.bundle, 0, f"latency {self.case.id}"


class BundleLatencyTests(pytest.Collector):
    """The latency tests of one bundle passed with ``--dsedge-bundle`` (node id ``dsedge/NAME.dse``)."""

    def __init__(self, *, bundle: str, **kw: Any) -> None:
        super().__init__(**kw)
        self.bundle = bundle

    def collect(self) -> list[pytest.Item]:
        cases = latency_cases(self.config, [self.bundle])
        return [LatencyItem.from_parent(self, name=f"latency[{c.variant or '-'}-b{c.batch}]", case=c) for c in cases]


@pytest.hookimpl(tryfirst=True)  # before -k/-m deselection, so those filter these tests too
def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    for bundle in config.getoption("--dsedge-bundle"):
        name = Path(bundle).name
        col = BundleLatencyTests.from_parent(session, name=name, nodeid=f"dsedge/{name}", bundle=bundle)
        # through the public collect hooks, so the terminal counts these items and a collect error is reported
        rep = col.ihook.pytest_make_collect_report(collector=col)
        col.ihook.pytest_collectreport(report=rep)
        if rep.passed:
            items.extend(x for x in rep.result if isinstance(x, pytest.Item))


# -------------------------------------------------------------------------- the dsedge_latency fixture
def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "dsedge_latency" not in metafunc.fixturenames:
        return
    marker = metafunc.definition.get_closest_marker("dsedge_bundle")
    bundles = list(marker.args) if marker else metafunc.config.getoption("--dsedge-bundle")
    if not bundles:
        cases = [LatencyCase(Path("-"), skip_reason="no bundle: pass --dsedge-bundle or mark the test "
                                                    "@pytest.mark.dsedge_bundle(path)")]
    else:
        cases = latency_cases(metafunc.config, bundles, [Path(metafunc.definition.path).parent])
    metafunc.parametrize("dsedge_latency", cases, ids=[c.id for c in cases], indirect=True)


@pytest.fixture
def dsedge_latency(request: pytest.FixtureRequest) -> LatencyCheck:
    """A ``LatencyCheck`` for one (bundle, variant, batch) case; skips with the reason when it cannot run here."""
    case: LatencyCase = request.param
    if case.skip_reason:
        pytest.skip(case.skip_reason)
    return LatencyCheck(case, request.config, request.node)
