"""microgpt/atomic.py: a file is replaced whole or not at all, and no temp file is left behind."""
import json
import os
import subprocess
import sys

import pytest

from microgpt.atomic import atomic_open, write_bytes_atomic, write_files_atomic, write_json_atomic


def test_writes_replace_the_file(tmp_path):
    path = tmp_path / "a.json"
    write_json_atomic(path, {"x": 1})
    write_json_atomic(path, {"x": 2})
    assert json.loads(path.read_text()) == {"x": 2} and path.read_text().endswith("}\n")
    write_bytes_atomic(path, b"raw")
    assert path.read_bytes() == b"raw"
    assert os.listdir(tmp_path) == ["a.json"]


def test_failure_mid_write_keeps_the_old_file_and_leaves_no_temp(tmp_path):
    path = tmp_path / "a.bin"
    path.write_bytes(b"old contents")
    with pytest.raises(RuntimeError, match="disk full"):
        with atomic_open(path, "wb") as f:
            f.write(b"new, but only half")
            f.flush()
            raise RuntimeError("disk full")
    assert path.read_bytes() == b"old contents"
    assert os.listdir(tmp_path) == ["a.bin"]


def test_unserialisable_json_keeps_the_old_file(tmp_path):
    path = tmp_path / "a.json"
    write_json_atomic(path, [1])
    with pytest.raises(TypeError):  # json.dump fails part way, after "{" is written
        write_json_atomic(path, {"ok": 1, "bad": object()})
    assert json.loads(path.read_text()) == [1] and os.listdir(tmp_path) == ["a.json"]


def test_several_files_change_together_or_not_at_all(tmp_path, monkeypatch):
    """An export of several files that failed on its last one (a full disk) left the earlier ones
    new and the rest old: write_files_atomic replaces none until every file is written."""
    (tmp_path / "a.bin").write_bytes(b"old a")
    (tmp_path / "b.bin").write_bytes(b"old b")
    (tmp_path / "other").write_bytes(b"not ours")
    real_fsync, synced = os.fsync, []

    def full_disk_on_the_second(fd):
        synced.append(fd)
        if len(synced) == 2:
            raise OSError(28, "No space left on device")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", full_disk_on_the_second)
    with pytest.raises(OSError, match="No space"):
        write_files_atomic(tmp_path, {"a.bin": b"new a", "b.bin": b"new b"})
    monkeypatch.undo()
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == \
        {"a.bin": b"old a", "b.bin": b"old b", "other": b"not ours"}
    write_files_atomic(tmp_path, {"a.bin": b"new a", "b.bin": b"new b"})
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == \
        {"a.bin": b"new a", "b.bin": b"new b", "other": b"not ours"}


def test_a_directory_in_the_way_changes_no_file(tmp_path):
    """A directory where the second file belongs: os.replace cannot put a file there, and the
    first file had already been replaced, so the set was half new, half old."""
    (tmp_path / "a.bin").write_bytes(b"old a")
    (tmp_path / "b.bin").mkdir()
    with pytest.raises(IsADirectoryError) as e:
        write_files_atomic(tmp_path, {"a.bin": b"new a", "b.bin": b"new b"})
    assert e.value.filename == str(tmp_path / "b.bin")
    assert (tmp_path / "a.bin").read_bytes() == b"old a" and sorted(os.listdir(tmp_path)) == ["a.bin", "b.bin"]


def test_a_link_planted_at_the_temp_name_is_not_written_through(tmp_path):
    """The temp name is predictable (name.tmpPID): a symbolic link put there beforehand by anyone
    who may write to the directory made the write truncate and fill the file it points to, outside."""
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    out = tmp_path / "out"
    out.mkdir()
    for name, write in (("a.bin", lambda: write_bytes_atomic(out / "a.bin", b"new a")),
                        ("b.bin", lambda: write_files_atomic(out, {"b.bin": b"new b"}))):
        os.symlink(victim, out / f"{name}.tmp{os.getpid()}")
        write()
        assert victim.read_bytes() == b"precious" and (out / name).read_bytes() == b"new " + name[:1].encode()
    assert sorted(os.listdir(out)) == ["a.bin", "b.bin"]



def test_the_temp_files_of_a_killed_writer_are_removed_and_a_live_ones_kept(tmp_path):
    """An export killed mid-write (kill -9) left its model-sized temp files (NAME.tmpPID) in the
    folder for good: the next export's own cleanup knew only its own pid. Those of a process that is
    gone are now removed before the write; a live process's, and other files, are left alone."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    live = os.getppid()
    names = [f"model.bin.tmp{dead.pid}", f"config.json.tmp{dead.pid}", f"model.bin.tmp{live}",
             f"other.bin.tmp{dead.pid}", f"model.bin.tmp0{dead.pid}", "model.bin.tmpx"]
    for name in names:
        (tmp_path / name).write_bytes(b"left")
    write_files_atomic(tmp_path, {"model.bin": b"new", "config.json": b"{}"}, last="config.json")
    assert sorted(os.listdir(tmp_path)) == sorted(["model.bin", "config.json", f"model.bin.tmp{live}",
                                                   f"other.bin.tmp{dead.pid}", f"model.bin.tmp0{dead.pid}",
                                                   "model.bin.tmpx"])
