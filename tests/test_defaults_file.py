"""The exported YAML as a file: an export cut short, a note after its end marker, a key given
twice. Each is refused naming the file (CPU; no kernel runs)."""
from __future__ import annotations

import pytest
import yaml

from kvtune.kernels.tuned import EXPORT_HEADER, EXPORT_TRAILER, SchemaError, dump_tuned, load_tuned, parse_tuned
from test_runtime import tuned_dict


def test_an_export_cut_short_is_refused(tmp_path, device):
    """dump_tuned ends the file with a marker line: a copy cut anywhere before it is refused,
    naming the file, even where the YAML left would parse (a list cut between entries, a
    number between its digits). A file written by hand (no header line) is not asked for it."""
    path = dump_tuned(parse_tuned(tuned_dict(device), "mem"), tmp_path / "tiny-test.yaml")
    text = path.read_text()
    assert text.splitlines()[0] == EXPORT_HEADER and text.splitlines()[-1] == EXPORT_TRAILER
    cut = tmp_path / "cut.yaml"
    parsed = 0
    for n in range(len(EXPORT_HEADER) + 1, len(text) - 1, 7):
        cut.write_text(text[:n])
        try:
            yaml.safe_load(text[:n])
            parsed += 1
        except yaml.YAMLError:
            pass
        with pytest.raises(SchemaError, match="cut.yaml: "):
            load_tuned(cut)
    assert parsed > 0   # some cuts are valid YAML: only the marker tells
    cut.write_text(text[:text.rindex(EXPORT_TRAILER)])
    with pytest.raises(SchemaError, match="cut.yaml: cut short"):
        load_tuned(cut)
    # a note added below the marker is not a cut: the message says where the file ends
    cut.write_text(text + "# reviewed\n")
    with pytest.raises(SchemaError, match=r"cut.yaml: line \d+ is the end marker .* but text follows it"):
        load_tuned(cut)
    cut.write_text(text.replace(EXPORT_HEADER + "\n", "").replace(EXPORT_TRAILER + "\n", ""))
    assert load_tuned(cut).to_dict() == load_tuned(path).to_dict()
    # saved again by an editor that adds a byte-order mark: still read, and still checked
    cut.write_bytes(b"\xef\xbb\xbf" + text.encode())
    assert load_tuned(cut).to_dict() == load_tuned(path).to_dict()
    cut.write_bytes(b"\xef\xbb\xbf" + text[:text.rindex(EXPORT_TRAILER)].encode())
    with pytest.raises(SchemaError, match="cut.yaml: cut short"):
        load_tuned(cut)


def test_a_key_given_twice_is_refused(tmp_path, device):
    """PyYAML keeps the last of two equal keys: a hand edit that adds a key without removing the
    old one would silently pick one. The loader refuses it, naming file and line."""
    text = yaml.safe_dump(tuned_dict(device), sort_keys=False)
    bad = tmp_path / "twice.yaml"
    bad.write_text(text.replace("schema_version: 1\n", "schema_version: 1\nschema_version: 1\n"))
    with pytest.raises(SchemaError, match=r"twice.yaml: not valid YAML: key 'schema_version' given twice"):
        load_tuned(bad)



@pytest.mark.parametrize("text", ["", "\n", "# kvtune tuned defaults, cut in its first comment\n"])
def test_an_empty_file_says_it_is_empty(tmp_path, text):
    """A file with no YAML in it (empty, or cut inside its first line) is named as empty, not
    as 'expected a mapping, got NoneType'."""
    empty = tmp_path / "empty.yaml"
    empty.write_text(text)
    with pytest.raises(SchemaError, match=r"empty.yaml: empty, or cut before its first key"):
        load_tuned(empty)
