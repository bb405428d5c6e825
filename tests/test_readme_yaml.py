"""The README's YAML schema example is the packaged file, abridged, and loads; its snippet of a
bucket on another backend loads beside it with every hash the runtime would check present and
current (a README that shows a file the runtime refuses is a defect)."""
import re
from pathlib import Path

from kvtune.kernels import get_backend
from kvtune.kernels.runtime import packaged_defaults_dir
from kvtune.kernels.tuned import parse_tuned, yaml_load

README = Path(__file__).resolve().parents[1] / "README.md"


def _schema_blocks() -> list[str]:
    text = README.read_text()
    section = text[text.index("## The exported YAML"):]
    section = section[:section.index("\n## ", 1)]
    return re.findall(r"```yaml\n(.*?)```", section, re.S)


def test_schema_example_is_the_packaged_file_abridged():
    example = parse_tuned(yaml_load(_schema_blocks()[0]), "README example")
    packaged = parse_tuned(yaml_load((packaged_defaults_dir() / f"{example.deployment}.yaml").read_text()))
    assert example.model == packaged.model and example.provenance == packaged.provenance
    for e in example.entries:
        (p,) = [q for q in packaged.entries if (q.tp, q.max_batch) == (e.tp, e.max_batch)]
        assert (e.heads_per_rank, e.backend, e.params) == (p.heads_per_rank, p.backend, p.params), (e.tp, e.max_batch)
        for b in e.buckets:
            (pb,) = [c for c in p.buckets if c.max_context == b.max_context]
            shown = {k: v for k, v in vars(b).items() if v is not None}
            assert shown == {k: getattr(pb, k) for k in shown}, (e.tp, e.max_batch, b.max_context)


def test_other_backend_snippet_loads_with_current_hashes():
    full, snippet = _schema_blocks()[:2]
    provenance_line, bucket_line = snippet.split("\n  ...\n")
    hashes = yaml_load(provenance_line)["kernel_hash"]
    data = yaml_load(full)
    data["provenance"]["kernel_hash"] = hashes
    bucket = yaml_load(bucket_line.strip())[0]
    data["entries"][-1]["buckets"][-1] = bucket   # in place of the 128k bucket, as the README says
    tuned = parse_tuned(data, "README snippet")
    launched = {be for e in tuned.entries for be in e.backends()}
    assert bucket["backend"] in launched
    for name in launched:
        assert hashes.get(name) == get_backend(name).kernel_hash(), name
