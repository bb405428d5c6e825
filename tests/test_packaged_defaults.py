"""Packaged tuned defaults must load and must have been measured on the kernel source that
ships beside them: a kernel change without a new sweep fails here, not in production."""
import pytest

from kvtune.kernels import get_backend
from kvtune.kernels.runtime import packaged_defaults_dir
from kvtune.kernels.tuned import load_tuned

FILES = sorted(packaged_defaults_dir().glob("*.yaml"))


def test_there_are_packaged_defaults():
    assert FILES, f"no packaged defaults in {packaged_defaults_dir()}"


@pytest.mark.parametrize("path", FILES, ids=[p.name for p in FILES])
def test_packaged_default_is_valid_and_current(path):
    tuned = load_tuned(path)
    assert path.stem == tuned.deployment
    for name in {n for e in tuned.entries for n in e.backends()}:   # per-bucket backends too, as the runtime checks
        assert tuned.provenance["kernel_hash"].get(name) == get_backend(name).kernel_hash(), (
            f"{path.name}: tuned on another {name} kernel source; re-sweep and re-export it")
    assert tuned.provenance["arch"].startswith("sm_")


def test_version_matches_pyproject():
    """Exported provenance records kvtune.kernels.__version__ (also when run uninstalled)."""
    import tomllib
    from pathlib import Path

    import kvtune.kernels
    pyproject = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    assert kvtune.kernels.__version__ == pyproject["project"]["version"]


@pytest.mark.parametrize("deployment", ["kimi-k2-h200", "kimi-k2-h100"])
def test_packaged_kimi_defaults_are_the_export_of_the_committed_sweep(deployment):
    """Each shipped Kimi-K2 YAML is, entry by entry, the brute-force choice
    (tests/export_oracle.py) on the trials table of the GPU sweep it was exported from
    (results/<deployment>/trials.csv): the NSPLIT margin, the ragged rule and the default's
    group included, on real H200 / H100 timings rather than a CPU sweep's."""
    from pathlib import Path

    import yaml
    from export_oracle import check_export

    from kvtune.tuner.config import load_deployment
    from kvtune.tuner.ragged import ragged_round
    from kvtune.tuner.table import read_trials

    root = Path(__file__).parents[1]
    packaged = packaged_defaults_dir() / f"{deployment}.yaml"
    committed = root / "results" / deployment / f"{deployment}.yaml"
    assert yaml.safe_load(packaged.read_text()) == yaml.safe_load(committed.read_text())
    dep = load_deployment(root / "configs" / "deployments" / f"{deployment}.yaml")
    trials = read_trials(root / "results" / deployment / "trials.csv")
    assert set(trials["device"]) == {dep.device.device_name}, "swept on the GPU its device profile names"
    check_export(yaml.safe_load(packaged.read_text()), trials, ragged_round(dep.ragged_spread))


def test_dispatch_chain_export_is_the_oracle_choice_on_its_trials(tmp_path):
    """The export across backends with the dispatch chain (results/serving/dispatch-chain/export/,
    not packaged) is the brute-force choice on the trials it was exported from: the table shipped
    then (export/trials-wgmma.csv) joined with the rows that sweep and its serving checks added
    (scripts/merge_trials.py), so its per-context dispatches across wgmma and wgmma_km follow the
    README's rule on H200 timings."""
    import subprocess
    import sys
    from pathlib import Path

    import yaml
    from export_oracle import check_export

    from kvtune.tuner.config import load_deployment
    from kvtune.tuner.ragged import ragged_round
    from kvtune.tuner.table import read_trials

    root = Path(__file__).parents[1]
    here = root / "results" / "serving" / "dispatch-chain" / "export"
    joined = tmp_path / "trials.csv"
    subprocess.run([sys.executable, str(root / "scripts" / "merge_trials.py"),
                    str(here / "trials-wgmma.csv"), str(here / "trials-wgmma_km.csv"),
                    "--out", str(joined)], check=True, capture_output=True)
    exported = yaml.safe_load((here / "kimi-k2-h200.yaml").read_text())
    assert any(b.get("backend") for e in exported["entries"] for b in e["buckets"]), \
        "the export holds a dispatch across backends"
    dep = load_deployment(root / "configs" / "deployments" / "kimi-k2-h200.yaml")
    check_export(exported, read_trials(joined), ragged_round(dep.ragged_spread))
