"""The trials table and runs.jsonl after a crash: a row torn mid-write is set aside with a
warning naming the file and line (never misread, never glued to the next row), and a short
write (a full disk) leaves no partial row behind (issue 14, case 1)."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from kvtune.tuner.export import export_deployment
from kvtune.tuner.table import (
    TrialsTable,
    append_jsonl,
    append_line,
    read_jsonl,
    read_trials,
)

REPO = Path(__file__).resolve().parents[1]
COMMITTED = REPO / "results" / "cpu-tiny" / "trials.csv"   # a real table: 88 rows of a CPU sweep


def _table(tmp_path, cut=None):
    """The committed cpu-tiny table under tmp_path/out/cpu-tiny; `cut(last_row) -> kept part`
    tears its last row. Returns (path, the intact text without its last row, that row's line)."""
    text = COMMITTED.read_bytes()
    assert text.endswith(b"\r\n")
    start = text[:-2].rfind(b"\n") + 1            # the last row has no embedded newline
    head, last = text[:start], text[start:]
    line = head.count(b"\n") + 1
    d = tmp_path / "out" / "cpu-tiny"
    d.mkdir(parents=True)
    p = d / "trials.csv"
    p.write_bytes(head + (cut(last) if cut else last))
    return p, head, line


def _cut_inside_params(last: bytes) -> bytes:
    i = last.index(b'"{')                       # the params JSON, quoted
    return last[: i + 12]


def _cut_after_params(last: bytes) -> bytes:
    i = last.index(b'}"')
    return last[: i + 3]


@pytest.mark.parametrize("cut", [_cut_inside_params, _cut_after_params], ids=["inside-params", "after-params"])
def test_reader_skips_a_torn_last_row_naming_file_and_line(tmp_path, capsys, cut):
    p, head, line = _table(tmp_path, cut)
    df = read_trials(p)
    err = capsys.readouterr().err
    assert f"{p}: line {line}: torn row" in err
    intact = tmp_path / "intact.csv"
    intact.write_bytes(head)
    want = read_trials(intact)
    assert len(df) == len(want) == 87
    assert df.equals(want)
    assert p.read_bytes() == head + cut(COMMITTED.read_bytes()[len(head):]), "a reader changes nothing"


@pytest.mark.parametrize("column,value", [("median_us", "abc"), ("tp", "8x")])
def test_a_row_with_a_word_for_a_number_is_skipped_naming_file_line_and_column(tmp_path, capsys, column, value):
    """A hand edit that puts a word where a number goes: the readers skip that row with a
    warning naming file, line and column (export failed with a bare float() error)."""
    import csv
    import io
    p, head, line = _table(tmp_path)
    rows = list(csv.DictReader(io.StringIO(p.read_text(), newline="")))
    cols = list(rows[0])
    rows[-1][column] = value
    with p.open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=cols, lineterminator="\r\n")
        w.writeheader()
        w.writerows(rows)
    df = read_trials(p)
    assert f"{p}: line {line}: malformed row ({column} {value!r} is not a number)" in capsys.readouterr().err
    assert len(df) == 87


@pytest.mark.parametrize("cut", [_cut_inside_params, _cut_after_params], ids=["inside-params", "after-params"])
def test_export_of_a_torn_table_is_the_export_without_that_row(tmp_path, cut):
    p, head, _ = _table(tmp_path, cut)
    torn = export_deployment("cpu-tiny", out=str(tmp_path / "out"), path=str(tmp_path / "torn.yaml"), quiet=True)
    (tmp_path / "intact.csv").write_bytes(head)
    intact = export_deployment("cpu-tiny", out=str(tmp_path / "out"), trials_csv=str(tmp_path / "intact.csv"),
                               path=str(tmp_path / "intact.yaml"), quiet=True)
    assert torn.entries == intact.entries and len(torn.entries) == 2


@pytest.mark.parametrize("cut", [_cut_inside_params, _cut_after_params], ids=["inside-params", "after-params"])
def test_writer_sets_a_torn_row_aside_and_appends_whole_rows(tmp_path, capsys, cut):
    p, head, line = _table(tmp_path, cut)
    torn_text = p.read_bytes()[len(head):]
    want = read_trials(COMMITTED)
    header = head.split(b"\r\n")[0].decode().split(",")
    names = header[header.index("role") + 1: header.index("params")]   # as written (older names)
    table = TrialsTable(p, names)
    err = capsys.readouterr().err
    assert f"{p}: line {line}: torn row" in err and "set aside" in err
    assert p.read_bytes() == head
    aside = Path(str(p) + ".torn").read_bytes()
    assert torn_text in aside and f"line {line}".encode() in aside, "the torn bytes are kept, not destroyed"
    # the row a resumed sweep writes back lands on a line of its own
    import csv
    import io
    last = next(csv.DictReader(io.StringIO(COMMITTED.read_text().splitlines()[0] + "\n" +
                                           COMMITTED.read_text().splitlines()[-1])))
    row = {k: v for k, v in last.items() if k not in names}
    row["params"] = json.loads(last["params"])   # the writer spreads it over the parameter columns again
    table.append(row)
    df = read_trials(p)
    assert capsys.readouterr().err == ""
    assert len(df) == 88
    assert df.iloc[-1]["params"] == want.iloc[-1]["params"]
    assert df.iloc[-1]["median_us"] == want.iloc[-1]["median_us"]


def test_a_row_glued_to_a_torn_one_is_set_aside(tmp_path, capsys):
    """An older version appended the next row onto a torn line (a 65-field row in the middle)."""
    text = COMMITTED.read_bytes()
    lines = text.split(b"\r\n")
    glued = lines[:10] + [lines[10][:40] + lines[11]] + lines[12:]
    p = tmp_path / "trials.csv"
    p.write_bytes(b"\r\n".join(glued))
    df = read_trials(p)
    err = capsys.readouterr().err
    assert f"{p}: line 11: malformed row" in err
    assert len(df) == 86


def test_short_write_leaves_no_partial_row(tmp_path, monkeypatch):
    p = tmp_path / "t.csv"
    p.write_bytes(b"a,b\r\n1,2\r\n")
    real = os.write

    def half(fd, data):   # what a full disk does: part of the buffer
        return real(fd, bytes(data)[: len(data) // 2])
    monkeypatch.setattr(os, "write", half)
    with pytest.raises(OSError, match="short write"):
        append_line(p, b"3,4444444444\r\n")
    monkeypatch.undo()
    assert p.read_bytes() == b"a,b\r\n1,2\r\n"


def test_runs_jsonl_torn_tail(tmp_path, capsys):
    """runs.jsonl cut mid-line by a crash: the reader and `kvtune export` (which says when the
    last sweep did not complete) skip the torn line, naming it; the next run record is appended
    on a line of its own and the torn bytes are kept aside."""
    _table(tmp_path)
    d = tmp_path / "out" / "cpu-tiny"
    p = d / "runs.jsonl"
    p.write_text(json.dumps({"status": "complete"}) + "\n" + '{"command": "kvtune sweep x", "sta')

    def export_err():
        export_deployment("cpu-tiny", out=str(tmp_path / "out"), path=str(tmp_path / "x.yaml"))
        return capsys.readouterr().err

    err = export_err()
    assert f"{p}: line 2: torn line" in err and "last sweep" not in err
    append_jsonl(p, {"status": "stopped (time limit of 1 min)"})
    assert f"{p}: line 2: torn line" in capsys.readouterr().err
    assert [r["status"] for r in read_jsonl(p)] == ["complete", "stopped (time limit of 1 min)"]
    assert capsys.readouterr().err == ""
    assert '{"command": "kvtune sweep x", "sta' in Path(str(p) + ".torn").read_text()
    err = export_err()
    assert "torn line" not in err and "ended 'stopped (time limit of 1 min)'" in err


def test_committed_tables_read_without_warnings(capsys):
    """Every committed table is whole (a check of the evidence, and of the reader)."""
    tables = sorted((REPO / "results").rglob("trials.csv"))
    assert tables
    for t in tables:
        read_trials(t)
    assert "warning" not in capsys.readouterr().err


def test_export_names_every_missing_bucket(tmp_path, capsys):
    """An interrupted sweep: all of tp 8 and tp 4's 300-token bucket missing (issue 14, case 6)."""
    import pandas as pd
    full = pd.read_csv(COMMITTED)
    keep = full[(full["tp"] == 4) & (full["ctx"] == 64)]
    d = tmp_path / "out" / "cpu-tiny"
    d.mkdir(parents=True)
    keep.to_csv(d / "trials.csv", index=False)
    tuned = export_deployment("cpu-tiny", out=str(tmp_path / "out"))
    err = capsys.readouterr().err
    assert [e.tp for e in tuned.entries] == [4]
    assert "3 (backend, tp, batch, context) bucket(s) of cpu-tiny have no trials" in err
    for tp, ctx in ((4, 300), (8, 64), (8, 300)):
        assert f"triton (tp={tp}, bs=1, ctx={ctx})" in err
    assert "triton (tp=4, bs=1, ctx=64)" not in err


def test_a_quote_left_open_names_every_line_it_took(tmp_path, capsys):
    """A row cut inside its quoted params, with rows after it: the unclosed quote reads on to the
    next quote, so the next row goes with it; the warning names both lines, not only the first."""
    lines = COMMITTED.read_bytes().split(b"\r\n")
    cut = lines[10][:lines[10].index(b'"{') + 11]   # inside the quoted JSON: the quote stays open
    p = tmp_path / "trials.csv"
    p.write_bytes(b"\r\n".join(lines[:10] + [cut] + lines[11:]))
    df = read_trials(p)
    err = capsys.readouterr().err
    assert f"{p}: lines 11-12: " in err, err
    assert len(df) == 86   # 88 rows less the cut one and the one it took in
