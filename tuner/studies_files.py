"""Where a sweep folder keeps its Optuna studies, declared once for the sweep, its workers,
`kvtune forget` and the review: `studies.db` (SQLite) for a single-process sweep,
`studies.journal` (Optuna's journal file) for a `--workers` sweep. No Optuna import: the
review reads these names without opening a study."""
from __future__ import annotations

from pathlib import Path

from .config import ConfigError

STUDIES_DB = "studies.db"
STUDIES_JOURNAL = "studies.journal"
_SQLITE, _JOURNAL = "sqlite:///", "journal:"


def folder_storages(folder: Path) -> tuple[Path, Path]:
    """(studies.db, studies.journal) of a sweep folder, present or not."""
    return folder / STUDIES_DB, folder / STUDIES_JOURNAL


def sqlite_url(path: Path) -> str:
    return f"{_SQLITE}{path}"


def journal_url(path: Path) -> str:
    return f"{_JOURNAL}{path}"


def journal_path(storage: str) -> Path | None:
    """The file of a `journal:PATH` storage, else None; `journal:` with no path is an error
    naming --storage (Path("") is the current folder, which no journal can be)."""
    if not storage.startswith(_JOURNAL):
        return None
    if not storage[len(_JOURNAL):].strip():
        raise ConfigError(f"--storage {storage}: no file after 'journal:'; expected journal:PATH")
    return Path(storage[len(_JOURNAL):])


def present_storages(folder: Path) -> list[str]:
    """The URLs of the folder's default storages that exist, studies.db first."""
    db, journal = folder_storages(folder)
    return [url for url, f in ((sqlite_url(db), db), (journal_url(journal), journal)) if f.is_file()]


def missing_storage_file(storage: str) -> Path | None:
    """The file a `sqlite:///PATH` or `journal:PATH` storage names when it does not exist (opening
    it would create an empty one), else None; other URLs (PostgreSQL) are not checked here."""
    for prefix in (_SQLITE, _JOURNAL):
        if storage.startswith(prefix):
            path = Path(storage[len(prefix):])
            return None if path.is_file() else path
    return None
