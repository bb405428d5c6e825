"""Test set-up: without a CUDA GPU the Triton kernel runs under its interpreter, and tests
marked `gpu` are skipped (never faked)."""
import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    # must be set before triton is first imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

DEVICE = "cuda" if HAS_CUDA else "cpu"


GPU_SKIP_REASON = "needs a CUDA GPU (none on this machine)"


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason=GPU_SKIP_REASON)
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """One line saying what the skipped tests are, so a newcomer does not wonder; on a GPU
    machine, why CPU tests fail when they ran without Triton's interpreter."""
    if HAS_CUDA:
        failed = terminalreporter.stats.get("failed", [])
        cpu_failed = [r for r in failed if "gpu" not in getattr(r, "keywords", {})]
        if cpu_failed and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
            terminalreporter.write_line(
                f"{len(cpu_failed)} failed test(s) not marked gpu ran on this GPU machine without Triton's "
                "interpreter, which the CPU sweeps' tests need (Triton reads TRITON_INTERPRET once, at import): "
                "run them with the GPU hidden, as `bash scripts/test.sh` does: "
                "`CUDA_VISIBLE_DEVICES= python -m pytest -m 'not gpu'`, then `python -m pytest -m gpu`")
        return
    skipped = terminalreporter.stats.get("skipped", [])
    # by the marker, not the reason: a gpu test whose own skipif (e.g. "needs sm_90") is met first
    # reports that reason, and is still a GPU test
    n = sum(1 for r in skipped if "gpu" in getattr(r, "keywords", {}))
    if n:
        terminalreporter.write_line(
            f"{n} skipped: the GPU tests (marked `gpu`), which need a CUDA GPU and are never faked on the CPU; "
            "on a machine with one, `bash scripts/test.sh` runs them (or `python -m pytest -m gpu`)")
    if len(skipped) > n:
        terminalreporter.write_line(
            f"{len(skipped) - n} skipped for other reasons (cases this machine cannot set up, e.g. a second "
            "device type); `pytest -rs` lists each with its reason")


@pytest.fixture
def device():
    return DEVICE


@pytest.fixture
def replace_backend(tmp_path, monkeypatch):
    """`replace_backend(name, factory, source=None)`: `get_backend(name)` gives `factory`'s backend
    (a constructor, or "module:Class") until the test ends, then the one registered before. With
    `source` (the module's text), the module is written where this process and the trial worker
    processes it spawns both import it."""
    from kvtune.kernels import backends
    saved = {}

    def replace(name, factory, source=None):
        saved.setdefault(name, (backends._REGISTRY.get(name), backends._INSTANCES.get(name)))
        if source is not None:
            mods = tmp_path / "mods"
            mods.mkdir(exist_ok=True)
            (mods / f"{factory.split(':')[0]}.py").write_text(source)
            monkeypatch.syspath_prepend(str(mods))
        backends.register_backend(name, factory)

    yield replace
    for name, (factory, instance) in saved.items():
        backends.unregister_backend(name)
        if factory is not None:
            backends._REGISTRY[name] = factory
        if instance is not None:
            backends._INSTANCES[name] = instance
