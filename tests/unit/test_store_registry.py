"""Opening a store by path or URL: engines by scheme, unknown schemes refused."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from spoolfs.core.errors import StoreFailure
from spoolfs.store.registry import UnknownEngine, open_maintenance, open_store, split


def test_a_plain_path_opens_the_embedded_engine(tmp_path: Path) -> None:
    store = open_store(str(tmp_path / "s"))
    try:
        assert store.reader().get(1) is not None
    finally:
        store.close()
    assert (tmp_path / "s" / "meta.db").is_file()


@pytest.mark.parametrize("url", ["mysql://db.example/spool", "redis://h:6379/1", "tikv:x"])
def test_an_unknown_scheme_is_refused_in_one_line(url: str, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UnknownEngine) as exc:
        open_store(url)
    text = str(exc.value)
    assert "\n" not in text and split(url)[0] in text
    assert os.listdir(tmp_path) == []  # never a local directory named after the scheme


def test_a_database_url_is_never_a_directory(tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(StoreFailure) as exc:
        open_store("postgresql://nobody@127.0.0.1:9/spool")
    assert "\n" not in str(exc.value) and "database unavailable" in str(exc.value)
    assert os.listdir(tmp_path) == []


def test_maintenance_never_creates_a_store(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        open_maintenance(str(tmp_path / "none"))
    assert not (tmp_path / "none").exists()
