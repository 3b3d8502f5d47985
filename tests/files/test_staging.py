"""Staged output folders: what may be replaced, atomic publication, and stale temporaries."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from deinfer_megatron.files import staging
from deinfer_megatron.files.staging import claim_output, is_temporary, remove_stale, staged_folder, temp_name
from deinfer_megatron.files.text import read_text


def ours(path: Path) -> bool:
    return (path / "OURS").is_file()


def test_claim_output_refusals(tmp_path: Path) -> None:
    claim_output(tmp_path / "new", overwrite=False, is_ours=ours)  # absent: fine
    (tmp_path / "empty").mkdir()
    claim_output(tmp_path / "empty", overwrite=False, is_ours=ours)  # empty: fine
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="exists and is not a folder"):
        claim_output(tmp_path / "file", overwrite=True, is_ours=ours)
    user = tmp_path / "user"
    user.mkdir()
    (user / "notes").write_text("mine")
    with pytest.raises(ValueError, match="exists and is not empty.*--overwrite"):
        claim_output(user, overwrite=False, is_ours=ours)
    with pytest.raises(ValueError, match="is not a model folder made by deinfer-megatron"):
        claim_output(user, overwrite=True, is_ours=ours)
    (user / "OURS").write_text("")
    claim_output(user, overwrite=True, is_ours=ours)
    model = user / "model"
    model.mkdir()
    for out in (model, user):  # the input, or a folder that holds it
        with pytest.raises(ValueError, match="is \\(or contains\\) the input"):
            claim_output(out, overwrite=True, is_ours=lambda p: True, inputs=(model,))
    link = tmp_path / "link"
    link.symlink_to(user)
    with pytest.raises(ValueError, match="not a folder"):
        claim_output(link, overwrite=True, is_ours=lambda p: True)


def test_staged_folder_publishes_whole_or_not_at_all(tmp_path: Path) -> None:
    out = tmp_path / "out"
    with pytest.raises(RuntimeError, match="boom"):
        with staged_folder(out) as tmp:
            (tmp / "half").write_text("written")
            raise RuntimeError("boom")
    assert list(tmp_path.iterdir()) == []
    with staged_folder(out) as tmp:
        (tmp / "a").write_text("1")
    assert (out / "a").read_text() == "1" and list(tmp_path.iterdir()) == [out]


@pytest.mark.parametrize("exchange_works", [True, False])
def test_replacing_a_folder(tmp_path: Path, monkeypatch, exchange_works: bool) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "old").write_text("old")
    if not exchange_works:  # a file system without renameat2: two renames instead
        monkeypatch.setattr(staging, "_exchange", lambda a, b: False)
    with staged_folder(out) as tmp:
        (tmp / "new").write_text("new")
    assert sorted(p.name for p in out.iterdir()) == ["new"] and list(tmp_path.iterdir()) == [out]


def test_something_appearing_meanwhile_is_not_replaced(tmp_path: Path) -> None:
    out = tmp_path / "out"
    claim = lambda: claim_output(out, overwrite=False, is_ours=ours)  # noqa: E731
    with pytest.raises(ValueError, match="not empty"):
        with staged_folder(out, before_publish=claim) as tmp:
            (tmp / "new").write_text("new")
            out.mkdir()
            (out / "theirs").write_text("theirs")
    assert [p.name for p in out.iterdir()] == ["theirs"] and list(tmp_path.iterdir()) == [out]


def test_only_temporaries_of_dead_runs_here_are_removed(tmp_path: Path) -> None:
    out = tmp_path / "model"
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    host = staging._host()
    stale = tmp_path / f".model.tmp-{host}-{dead}-0123abcd"
    live = temp_name(out)  # this process: still running
    elsewhere = tmp_path / f".model.tmp-otherhost-{dead}-0123abcd"
    other_name = tmp_path / f".other.tmp-{host}-{dead}-0123abcd"
    user = tmp_path / ".model.tmp-mine"  # does not follow the pattern: a user's folder
    for p in (stale, live, elsewhere, other_name, user):
        p.mkdir()
        (p / "f").write_text("x")
    assert all(is_temporary(p) for p in (stale, live, elsewhere, other_name)) and not is_temporary(user)
    assert remove_stale(out) == [stale]
    assert not stale.exists() and all(p.exists() for p in (live, elsewhere, other_name, user))


def test_read_text(tmp_path: Path) -> None:
    good = tmp_path / "good.txt"
    good.write_text("héllo wörld " * 10, encoding="utf-8")
    assert read_text(good, "text") == "héllo wörld " * 10
    assert read_text(good, "text", max_chars=7) == "héllo w"
    assert read_text(good, "text", max_chars=2) == "hé"  # a multi-byte character cut by the limit
    binary = tmp_path / "b.bin"
    binary.write_bytes(b"abc\x00def")
    with pytest.raises(ValueError, match="is a binary file, not text"):
        read_text(binary, "text")
    latin = tmp_path / "l.txt"
    latin.write_bytes("caf\xe9 au lait".encode("latin-1"))
    with pytest.raises(ValueError, match="is not UTF-8 text \\(invalid byte at offset 3\\)"):
        read_text(latin, "text")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        read_text(tmp_path / "none", "text")
    with pytest.raises(ValueError, match="is not a file"):
        read_text(tmp_path, "text")
    assert os.path.exists(good)


@pytest.mark.parametrize("umask", [0o022, 0o077, 0o002])
def test_write_atomic_gives_the_mode_open_gives(tmp_path: Path, umask: int) -> None:
    """A new file gets the mode a plain ``open`` gives a file under the same umask (not
    ``mkstemp``'s 0600, which left the demo's cached text unreadable to the group); a replaced
    file keeps its mode; no temporary is left."""
    from deinfer_megatron.files.staging import write_atomic

    old = os.umask(umask)
    try:
        with open(tmp_path / "reference", "w") as f:
            f.write("x")
        write_atomic(tmp_path / "new.txt", "text")
        (tmp_path / "kept.txt").write_text("before")
        os.chmod(tmp_path / "kept.txt", 0o640)
        write_atomic(tmp_path / "kept.txt", b"after")
    finally:
        os.umask(old)
    assert (tmp_path / "new.txt").stat().st_mode & 0o777 == (tmp_path / "reference").stat().st_mode & 0o777
    assert (tmp_path / "kept.txt").stat().st_mode & 0o777 == 0o640
    assert (tmp_path / "new.txt").read_text() == "text" and (tmp_path / "kept.txt").read_text() == "after"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kept.txt", "new.txt", "reference"]
