"""Distributed sweeps on the CPU (Triton under its interpreter): worker processes share the
studies through PostgreSQL (a real server on loopback) or Optuna's journal file; one worker
is killed (SIGKILL) while it holds a trial. The sweep still completes: the killed trial is
failed by heartbeat and retried by another worker, every finished trial is in the storage
and in the trials table exactly once, and the export is valid."""
from __future__ import annotations

import csv
import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pandas as pd
import pytest
import yaml
from export_oracle import check_export  # the export's choice worked out from the trials table by brute force

from kvtune.kernels.tuned import load_tuned
from kvtune.tuner.export import export_deployment
from kvtune.tuner.table import read_trials

REPO = Path(__file__).resolve().parents[1]
HEARTBEAT, GRACE = 1, 4
SPACE = {"NSPLIT": [1, 2, 4], "BLOCK_N": [32, 64], "HEADS_PER_BLOCK": [1, 2], "NUM_WARPS": [4], "STAGES": [1, 2]}


def _deployment(tmp_path, name):
    doc = {"name": name, "model": {"name": "tiny-mla", "num_heads": 8, "draft_tokens": 4, "tree": "random"},
           "device": "cpu", "tp": [4], "contexts": [64, 128], "batches": [1], "backends": ["triton"],
           "trials": 5, "timing": "eager"}
    p = tmp_path / f"{name}.yaml"
    p.write_text(yaml.safe_dump(doc))
    d = tmp_path / "spaces"
    d.mkdir(exist_ok=True)
    (d / "triton.yaml").write_text(yaml.safe_dump({
        "backend": "triton", "params": SPACE,
        "constraints": [{"name": "heads", "expr": "HEADS_PER_BLOCK <= H"}]}))
    return p, d


def _cli(*args):
    return [sys.executable, "-m", "kvtune.tuner.cli", *map(str, args)]


def _storage(url):
    """The sweep's Optuna storage opened here with Optuna's own API, as any reader of the
    studies would: `journal:PATH` or a PostgreSQL URL (psycopg2 is in the test extra)."""
    import optuna
    if url.startswith("journal:"):
        from optuna.storages.journal import JournalFileBackend
        return optuna.storages.JournalStorage(JournalFileBackend(url[len("journal:"):]))
    return optuna.storages.RDBStorage(url.replace("postgresql://", "postgresql+psycopg2://", 1))


def _study(storage, name):
    import optuna
    return optuna.load_study(study_name=name, storage=storage)


def _all_trials(storage):
    import optuna
    return {name: _study(storage, name).get_trials(deepcopy=False) for name in optuna.get_all_study_names(storage)}


def _kill_one_inside_a_trial(storage, procs, pids_to_spare, lock_path=None, timeout=240):
    """SIGSTOP a worker that holds a RUNNING trial with its whole config (a worker holds a trial
    a moment before it asks the config, and asks it one parameter at a time: a worker killed
    between two leaves a trial whose retry draws the rest afresh), check (it can change nothing
    now) that the trial is still running and held by it, then SIGKILL it. Returns (pid, study,
    trial number)."""
    import optuna
    RUNNING, COMPLETE = optuna.trial.TrialState.RUNNING, optuna.trial.TrialState.COMPLETE
    deadline = time.time() + timeout
    while time.time() < deadline:
        for p in procs:
            assert p.poll() is None, f"{p.args[3]} ended before a worker could be killed (rc {p.returncode})"
        trials = _all_trials(storage)
        done = sum(1 for ts in trials.values() for t in ts if t.state == COMPLETE)
        if done >= 3:   # mid-sweep
            for name, ts in trials.items():
                for t in ts:
                    who = t.user_attrs.get("worker")
                    if t.state != RUNNING or not who or set(t.params) != set(SPACE):
                        continue
                    pid = int(who.rsplit(":", 1)[1])
                    if pid in pids_to_spare:
                        continue
                    os.kill(pid, signal.SIGSTOP)
                    time.sleep(0.3)
                    now = next(x for x in _study(storage, name).get_trials(deepcopy=False) if x.number == t.number)
                    holds_lock = lock_path is not None and os.path.lexists(lock_path)
                    if now.state == RUNNING and now.user_attrs.get("worker") == who and set(now.params) == set(SPACE) \
                            and not holds_lock:
                        os.kill(pid, signal.SIGKILL)
                        return pid, name, t.number
                    os.kill(pid, signal.SIGCONT)
        time.sleep(0.1)
    raise AssertionError("no worker was seen inside a trial")


def _final_retries(ts, number):
    """The retries of trial `number` that were not themselves retried: a retry whose worker's
    heartbeats stalled past the grace on a loaded machine is failed as stale and retried in
    turn (its retry_history then names both), and only the last one stands for the config."""
    retried = {n for t in ts for n in t.system_attrs.get("retry_history", ())}
    return [t for t in ts if number in t.system_attrs.get("retry_history", ()) and t.number not in retried]


def _check(storage, out, name, victim=None):
    """Every finished trial once in the storage and the table; the killed one failed and retried."""
    import optuna
    TS = optuna.trial.TrialState
    trials = _all_trials(storage)
    assert len(trials) == 2
    counted = {}
    for study, ts in trials.items():
        retried = {n: t for t in ts for n in t.system_attrs.get("retry_history", ())}
        for t in ts:
            assert t.state != TS.RUNNING, f"{study} trial {t.number} left running"
            if t.state.is_finished() and "outcome" in t.user_attrs and "duplicate_of" not in t.user_attrs \
                    and t.number not in retried:
                counted[(study, t.number)] = t
        n = sum(1 for (s, _), t in counted.items() if s == study and t.user_attrs.get("role") != "cross"
                and not t.user_attrs.get("constraint"))
        assert n >= 5, f"{study}: {n} trials counted, budget 5"
        base = [t for (s, _), t in counted.items() if s == study and t.user_attrs.get("role") == "baseline"]
        assert len(base) == 1, f"{study}: the default measured {len(base)} times"
    # the trials table: one row per counted trial, none for the killed one, none twice
    df = read_trials(out / name / "trials.csv")
    s = df[df["phase"] == "search"]
    rows = list(zip(s["study"], s["trial"].astype(int)))
    assert len(rows) == len(set(rows)), "a trial has two rows"
    assert set(rows) == set(counted), (sorted(set(rows) ^ set(counted)))
    for (study, number), t in counted.items():
        r = s[(s["study"] == study) & (s["trial"] == number)].iloc[0]
        assert r["outcome"] == t.user_attrs["outcome"] and json.dumps(r["params"], sort_keys=True) == \
            json.dumps(t.params, sort_keys=True)
    assert len(set(s["device"].astype(str))) == 1
    assert (df["phase"] == "remeasure").any(), "the phases after the search ran"
    assert not (df["phase"] == "serve").any(), "the sweep only measures: the serving check is the export's"
    if victim is None:
        return trials, counted
    _, vstudy, vnumber = victim
    # the killed trial: failed by heartbeat, not counted, retried with its params and finished
    killed = next(t for t in trials[vstudy] if t.number == vnumber)
    assert killed.state == TS.FAIL and (vstudy, vnumber) not in counted
    retries = _final_retries(trials[vstudy], vnumber)
    assert len(retries) == 1, f"trial {vnumber} retried {len(retries)} times"
    assert retries[0].params == killed.params and retries[0].state.is_finished()
    retry = retries[0]
    if (vstudy, retry.number) not in counted:   # the config was measured meanwhile by another trial
        src = retry.user_attrs.get("duplicate_of")
        assert src is not None and (vstudy, src) in counted, "the retry was neither counted nor a duplicate"
        assert counted[(vstudy, src)].params == killed.params
    assert retries[0].user_attrs["worker"] != killed.user_attrs["worker"], "the retry ran on the killed worker"
    return trials, counted


def _check_export(out, dep_path, name):
    import random
    tuned = export_deployment(str(dep_path), out=str(out), quiet=True, check=True)
    assert (read_trials(out / name / "trials.csv")["phase"] == "serve").any(), "export ran the serving check"
    again = load_tuned(out / name / f"{name}.yaml")
    assert again.entries == tuned.entries
    # the same trials in another order (as other workers could have interleaved them): same export
    with (out / name / "trials.csv").open(newline="") as f:
        header, *body = list(csv.reader(f))
    random.Random(0).shuffle(body)
    shuffled = out / name / "shuffled.csv"
    with shuffled.open("w", newline="") as f:
        csv.writer(f).writerows([header, *body])
    other = export_deployment(str(dep_path), out=str(out), trials_csv=str(shuffled), path=str(out / "other.yaml"),
                              quiet=True)
    assert other.entries == tuned.entries
    (e,) = tuned.entries
    assert e.tp == 4 and e.heads_per_rank == 2 and e.backend == "triton"
    assert [b.max_context for b in e.buckets] == [64, 128]
    check_export(yaml.safe_load((out / name / f"{name}.yaml").read_text()), pd.read_csv(out / name / "trials.csv"))


def _finish(procs, timeout=300):
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=timeout)[0])
        except subprocess.TimeoutExpired:
            p.kill()
            outs.append(p.communicate()[0])
    return outs


def _interrupt_when(cmd, cwd, ready, what, timeout=240):
    """Start `cmd`, send it SIGINT once `ready()` holds (it must still be running then), and
    return (the process, its output)."""
    sweep = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=cwd)
    try:
        deadline = time.time() + timeout
        while time.time() < deadline and sweep.poll() is None:
            if ready():
                break
            time.sleep(0.2)
        assert sweep.poll() is None, f"the sweep ended before {what} could be interrupted"
        sweep.send_signal(signal.SIGINT)
    finally:
        (log,) = _finish([sweep])
    return sweep, log


def _ragged_deployment(tmp_path, name):
    """`_deployment` at a batch bucket of 2 (so the sweep has a ragged phase), 3 trials a study."""
    dep, spaces = _deployment(tmp_path, name)
    doc = yaml.safe_load(dep.read_text())
    doc.update(batches=[2], trials=3, ragged_spread=4)
    dep.write_text(yaml.safe_dump(doc))
    return dep, spaces


def _check_ragged_once(df):
    """Every context bucket has ragged rows, all ok, none measured twice."""
    rag = df[df["phase"] == "ragged"]
    assert set(rag["ctx"]) == {64, 128} and (rag["outcome"] == "ok").all()
    keys = list(zip(rag["study"], rag["trial"], rag["round"].astype(str)))
    assert len(keys) == len(set(keys)), "a ragged row measured twice"
    return rag


def test_journal_workers_survive_a_killed_worker(tmp_path):
    """`kvtune sweep --workers 2` on the default journal storage; SIGKILL one worker mid-trial."""
    name = "jw"
    dep, spaces = _deployment(tmp_path, name)
    out = tmp_path / "results"
    journal = out / name / "studies.journal"
    sweep = subprocess.Popen(_cli("sweep", dep, "--device", "cpu", "--workers", 2, "--out", out, "--space-dir",
                                  spaces, "--rounds", 1, "--remeasure-top", 1, "--heartbeat", HEARTBEAT,
                                  "--grace", GRACE), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             cwd=tmp_path)
    try:
        deadline = time.time() + 120
        while not journal.exists() and time.time() < deadline and sweep.poll() is None:
            time.sleep(0.1)
        storage = _storage(f"journal:{journal}")
        victim = _kill_one_inside_a_trial(storage, [sweep], {sweep.pid}, lock_path=str(journal) + ".lock")
    finally:
        (log,) = _finish([sweep])
    assert sweep.returncode == 0, log
    assert f"pid {victim[0]}" in log and "exited with -9" in log, log
    _check(_storage(f"journal:{journal}"), out, name, victim)
    _check_export(out, dep, name)
    run = json.loads((out / name / "runs.jsonl").read_text().splitlines()[-1])
    assert run["workers"] == 2 and run["status"] == "complete"


# --------------------------------------------------------------------------- PostgreSQL
@pytest.fixture(scope="module")
def postgres_server():
    """A PostgreSQL server URL: $KVTUNE_TEST_POSTGRES (CI starts one with scripts/ci_postgres.sh),
    else a throwaway server started here with that script (skipped when PostgreSQL is missing
    and cannot be installed)."""
    url = os.environ.get("KVTUNE_TEST_POSTGRES")
    if url:   # CI started a server: the test must run
        import psycopg2  # noqa: F401 - in the test extra
        yield url
        return
    pytest.importorskip("psycopg2", reason="psycopg2 missing (pip install 'kvtune[test]')")
    r = subprocess.run(["bash", str(REPO / "scripts" / "ci_postgres.sh")], capture_output=True, text=True,
                       timeout=900)
    if r.returncode == 3:
        pytest.skip(f"PostgreSQL is not available here (no server binary, and apt-get could not install it): "
                    f"{r.stderr.strip()[-300:]}")
    assert r.returncode == 0, r.stderr
    env = dict(line.split(" ", 1)[1].split("=", 1) for line in r.stdout.splitlines() if line.startswith("export "))
    yield env["KVTUNE_TEST_POSTGRES"]
    stop = [f"{env['KVTUNE_TEST_POSTGRES_BIN']}/pg_ctl", "-D", f"{env['KVTUNE_TEST_POSTGRES_DIR']}/data", "-m",
            "immediate", "stop"]
    if os.geteuid() == 0:
        owner = Path(env["KVTUNE_TEST_POSTGRES_DIR"]).owner()
        stop = ["runuser", "-u", owner, "--"] + stop
    subprocess.run(stop, capture_output=True, timeout=120)
    shutil.rmtree(env["KVTUNE_TEST_POSTGRES_DIR"], ignore_errors=True)


@pytest.fixture
def postgres_db(postgres_server):
    """A fresh database on the server for one test."""
    import sqlalchemy as sa
    db = f"kvtune_{uuid.uuid4().hex[:10]}"
    engine = sa.create_engine(postgres_server.replace("postgresql://", "postgresql+psycopg2://", 1),
                              isolation_level="AUTOCOMMIT")
    with engine.connect() as c:
        c.execute(sa.text(f"CREATE DATABASE {db}"))
    yield postgres_server.rsplit("/", 1)[0] + f"/{db}"
    with engine.connect() as c:
        c.execute(sa.text(f"DROP DATABASE IF EXISTS {db} WITH (FORCE)"))
    engine.dispose()


def test_postgres_workers_survive_a_killed_worker(tmp_path, postgres_db):
    """`kvtune sweep --workers 1` and a `kvtune worker` joining it (as from another host) on
    PostgreSQL; SIGKILL whichever first holds a trial. The URL carries a password (the test
    server's trust authentication ignores it): no output and no run record shows it."""
    name = "pgw"
    dep, spaces = _deployment(tmp_path, name)
    out = tmp_path / "results"
    # a URL that has a password already keeps it (and is then checked for it instead)
    with_password = re.sub(r"://([^:@/]+)@", r"://\1:s3cr3t-pw@", postgres_db, count=1)
    secret = "s3cr3t-pw" if "s3cr3t-pw" in with_password else re.search(r"://[^:@/]+:([^@/]+)@", postgres_db)[1]
    common = ["--device", "cpu", "--out", out, "--space-dir", spaces, "--storage", with_password, "--heartbeat",
              HEARTBEAT, "--grace", GRACE]
    sweep = subprocess.Popen(_cli("sweep", dep, "--workers", 1, "--rounds", 1, "--remeasure-top", 1, *common),
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path)
    joiner = None
    try:
        storage = _storage(postgres_db)
        deadline = time.time() + 120
        while not storage.get_all_studies() and time.time() < deadline and sweep.poll() is None:
            time.sleep(0.2)
        # the joiner keeps its own trials table, as on another host: its rows reach the sweep's from the storage
        joiner = subprocess.Popen(_cli("worker", dep, *common, "--out", tmp_path / "other-host"),
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path)
        victim = _kill_one_inside_a_trial(storage, [sweep, joiner], {sweep.pid})
    finally:
        logs = _finish([p for p in (sweep, joiner) if p is not None])
    assert sweep.returncode == 0, logs[0]
    if victim[0] == joiner.pid:
        assert joiner.returncode == -9
    else:
        assert joiner.returncode == 0, logs[1]
        assert "exited with -9" in logs[0], logs[0]
    assert not [log for log in logs if secret in log]
    assert secret not in (out / name / "runs.jsonl").read_text()
    storage = _storage(postgres_db)
    trials, _ = _check(storage, out, name, victim)
    workers = {t.user_attrs.get("worker") for ts in trials.values() for t in ts}
    assert len(workers - {None}) >= 2, "both workers measured trials"
    _check_export(out, dep, name)
    storage.engine.dispose()


def test_postgres_one_sweep_per_deployment_and_no_worker_without_one(tmp_path, postgres_db, capsys):
    """Two sweeps of one deployment on one PostgreSQL storage (from two hosts) would each run the
    phases after the search and export over the other: the second is refused while the first
    holds the storage's lock, and runs once it is gone. A worker pointed at a database with no
    sweep of its deployment (a mistyped URL) waits --wait seconds, then is refused instead of
    starting a sweep of its own there."""
    from kvtune.tuner.cli import main
    from kvtune.tuner.runlock import StorageLock
    name = "pgl"
    dep, spaces = _deployment(tmp_path, name)
    common = ["--device", "cpu", "--space-dir", str(spaces), "--storage", postgres_db, "--no-progress",
              "--heartbeat", "1", "--grace", "2"]
    rc = main(["worker", str(dep), "--out", str(tmp_path / "w"), "--wait", "2", *common])
    assert rc == 2 and f"no sweep of {name} there after 2 s" in capsys.readouterr().err
    storage = _storage(postgres_db)
    assert not storage.get_all_studies(), "the worker created studies"
    first = StorageLock(storage, postgres_db, name)   # the first sweep, as it holds the lock
    first.acquire()
    try:
        rc = main(["sweep", str(dep), "--out", str(tmp_path / "b"), "--trials", "1", "--rounds", "0", *common])
        assert rc == 2 and f"another kvtune sweep of {name} is running on this storage" in capsys.readouterr().err
        assert not storage.get_all_studies() and not (tmp_path / "b" / name / "trials.csv").exists()
    finally:
        first.release()
    rc = main(["sweep", str(dep), "--out", str(tmp_path / "b"), "--trials", "1", "--rounds", "0",
               "--remeasure-top", "0", *common])
    assert rc == 0, capsys.readouterr().err
    assert storage.get_all_studies()
    storage.engine.dispose()


def test_ctrl_c_of_workers_resumes(tmp_path):
    """SIGINT to `kvtune sweep --workers 2` mid-sweep: it exits 130, the trials its workers held
    are failed as interrupted (none left running) and queued again; the re-run completes with
    every finished trial counted once and each interrupted trial retried once."""
    name = "cw"
    dep, spaces = _deployment(tmp_path, name)
    out = tmp_path / "results"
    journal = out / name / "studies.journal"
    cmd = _cli("sweep", dep, "--device", "cpu", "--workers", 2, "--out", out, "--space-dir", spaces, "--rounds", 1,
               "--remeasure-top", 1, "--heartbeat", HEARTBEAT, "--grace", GRACE)

    def three_finished():
        if not journal.exists():
            return False
        trials = _all_trials(_storage(f"journal:{journal}")).values()
        return sum(t.state.is_finished() for ts in trials for t in ts) >= 3

    sweep, log = _interrupt_when(cmd, tmp_path, three_finished, "it")
    assert sweep.returncode == 130, log
    import optuna
    TS = optuna.trial.TrialState
    storage = _storage(f"journal:{journal}")
    for ts in _all_trials(storage).values():
        assert not [t.number for t in ts if t.state == TS.RUNNING], "a trial was left running"
    again = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, timeout=600)
    assert again.returncode == 0, again.stdout + again.stderr
    storage = _storage(f"journal:{journal}")
    trials, counted = _check(storage, out, name)
    for study, ts in trials.items():
        for t in ts:
            if t.user_attrs.get("interrupted"):
                assert (study, t.number) not in counted
                assert len(_final_retries(ts, t.number)) == 1, t.number
    _check_export(out, dep, name)


def test_ctrl_c_after_the_workers_stops_the_phases_after_the_search(tmp_path):
    """SIGINT to `kvtune sweep --workers 2 --export` once its workers are done and the main
    process runs the phases after the search (re-measurement, ragged): the sweep stops there as
    interrupted (exit 130) and exports nothing; the re-run finishes those phases and exports."""
    name = "pw"
    dep, spaces = _ragged_deployment(tmp_path, name)
    out = tmp_path / "results"
    table, export = out / name / "trials.csv", out / name / f"{name}.yaml"
    cmd = _cli("sweep", dep, "--device", "cpu", "--workers", 2, "--out", out, "--space-dir", spaces, "--rounds", 1,
               "--remeasure-top", 1, "--heartbeat", HEARTBEAT, "--grace", GRACE, "--export")
    sweep, log = _interrupt_when(cmd, tmp_path,
                                 lambda: table.exists() and not read_trials(table)["phase"].eq("search").all(),
                                 "its phases after the search", timeout=400)
    assert sweep.returncode == 130, log
    assert "status interrupted" in log and not export.exists(), log
    stopped = read_trials(table)
    again = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, timeout=900)
    assert again.returncode == 0, again.stdout + again.stderr
    df = read_trials(table)
    assert len(df[df["phase"] != "search"]) > len(stopped[stopped["phase"] != "search"])
    _check_ragged_once(df)
    assert load_tuned(export).entries


# --------------------------------------------------------------------------- search strategy
@pytest.mark.parametrize("workers", [2, None])
def test_tpe_steps_to_neighbours_of_the_best(tmp_path, workers):
    """A space larger than the budget (64 configs, budget 8): TPE's random start, then every
    second config an untried one-step neighbour of the best so far (`tuner/strategy.py`),
    under `--workers 2` as in the single-process sweep: each study measures exactly its budget
    on the device, no config twice, and its neighbour steps (user attr via=local, set by both
    paths) are neighbours of what was measured before they were asked, at least one of the
    best so far then."""
    import optuna

    from kvtune.tuner.strategy import DEFAULT, neighbours, params_key
    TS = optuna.trial.TrialState
    name, budget = "nb", 8
    doc = {"name": name, "model": {"name": "tiny-mla", "num_heads": 8, "draft_tokens": 4, "tree": "random"},
           "device": "cpu", "tp": [4], "contexts": [64, 128], "batches": [1], "backends": ["triton"],
           "trials": budget, "timing": "eager"}
    dep = tmp_path / f"{name}.yaml"
    dep.write_text(yaml.safe_dump(doc))
    spaces = tmp_path / "spaces"
    spaces.mkdir()
    (spaces / "triton.yaml").write_text(yaml.safe_dump({
        "backend": "triton", "params": {"NSPLIT": [1, 2, 4], "BLOCK_N": [32, 64], "HEADS_PER_BLOCK": [1, 2],
                                        "NUM_WARPS": [4, 8], "STAGES": [1, 2]}, "constraints": []}))
    out = tmp_path / "results"
    journal = out / name / "studies.journal"
    cmd = _cli("sweep", dep, "--device", "cpu", "--out", out, "--space-dir", spaces, "--storage", f"journal:{journal}",
               "--rounds", 0, "--remeasure-top", 0, "--no-progress")
    if workers:
        cmd += list(map(str, ["--workers", workers, "--heartbeat", HEARTBEAT, "--grace", 60]))
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    storage = _storage(f"journal:{journal}")
    trials = _all_trials(storage)
    assert len(trials) == 2
    n_local = 0
    for study, ts in trials.items():
        dists = _study(storage, study).user_attrs["dists"]
        assert len(list(itertools.product(*dists.values()))) > budget, "the space must not be swept as a grid"
        retried = {n for t in ts for n in t.system_attrs.get("retry_history", ())}
        measured = [t for t in ts if t.state.is_finished() and "outcome" in t.user_attrs
                    and "duplicate_of" not in t.user_attrs and t.number not in retried]
        search = [t for t in measured if t.user_attrs.get("role") != "cross" and not t.user_attrs.get("constraint")]
        on_device = [t for t in search if DEFAULT.counts(t.user_attrs)]
        assert len(on_device) == budget, f"{study}: {len(on_device)} configs measured on the device, budget {budget}"
        keys = [params_key(t.params) for t in measured]
        assert len(keys) == len(set(keys)), f"{study}: a config was measured twice"
        local = [t for t in search if t.user_attrs.get("via") == "local"]
        assert local, f"{study}: no neighbour step after TPE's random start"
        at_best = 0
        for t in local:
            before = [s for s in measured if s.state == TS.COMPLETE and s.datetime_complete is not None
                      and s.datetime_complete <= t.datetime_start]
            near = [s for s in before if t.params in neighbours(s.params, dists)]
            assert near, f"{study} trial {t.number}: a neighbour step next to nothing measured before it"
            best = min(before, key=lambda s: s.value)
            at_best += t.params in neighbours(best.params, dists)
        assert at_best, f"{study}: no neighbour step is next to the best config measured before it"
        n_local += len(local)
    assert n_local >= 2


def test_workers_run_the_ragged_phase_once(tmp_path):
    """`--workers 2` at a batch bucket of 2: the phases after the search (cross-bucket,
    re-measurement, ragged) run once in the main process: every context bucket has ragged
    rows, none twice, each naming a correct trial of its study, and the export is the oracle's."""
    from export_oracle import check_export
    name = "rw"
    dep, spaces = _ragged_deployment(tmp_path, name)
    out = tmp_path / "results"
    cmd = _cli("sweep", dep, "--device", "cpu", "--workers", 2, "--out", out, "--space-dir", spaces, "--rounds", 1,
               "--remeasure-top", 1, "--heartbeat", HEARTBEAT, "--grace", GRACE, "--export")
    run = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, timeout=900)
    assert run.returncode == 0, run.stdout + run.stderr
    df = read_trials(out / name / "trials.csv")
    rag = _check_ragged_once(df)
    for study, trial in zip(rag["study"], rag["trial"]):
        twin = df[(df["study"] == study) & (df["phase"] == "search") & (df["trial"] == trial)]
        assert len(twin) == 1 and twin["outcome"].iloc[0] == "ok", (study, trial)
    check_export(yaml.safe_load((out / name / f"{name}.yaml").read_text()), df, "x4")
