"""A sweep folder's study files: which exist, and a file-backed --storage that names none."""
import pytest

from kvtune.tuner.config import ConfigError
from kvtune.tuner.studies_files import journal_path, missing_storage_file, present_storages


def test_present_storages_lists_the_existing_default_files_db_first(tmp_path):
    assert present_storages(tmp_path) == []
    (tmp_path / "studies.journal").write_text("")
    assert present_storages(tmp_path) == [f"journal:{tmp_path / 'studies.journal'}"]
    (tmp_path / "studies.db").write_bytes(b"")
    assert present_storages(tmp_path) == [f"sqlite:///{tmp_path / 'studies.db'}",
                                          f"journal:{tmp_path / 'studies.journal'}"]


def test_a_file_storage_naming_no_file_is_reported_and_a_server_is_not(tmp_path):
    there = tmp_path / "s.db"
    there.write_bytes(b"")
    assert missing_storage_file(f"sqlite:///{there}") is None
    assert missing_storage_file(f"sqlite:///{tmp_path / 'typo.db'}") == tmp_path / "typo.db"
    assert missing_storage_file(f"journal:{tmp_path / 'j'}") == tmp_path / "j"
    assert missing_storage_file("postgresql://u@h/db") is None
    assert journal_path(f"journal:{tmp_path / 'j'}") == tmp_path / "j"
    assert journal_path(f"sqlite:///{there}") is None
    with pytest.raises(ConfigError, match="--storage journal:: no file after 'journal:'"):
        journal_path("journal:")
