"""Publishing a folder atomically: readers see no folder or a complete one, never a mix."""

from __future__ import annotations

import pytest

from pipeline.io import open_counted_stream, staged_folder


def test_staged_folder_publishes_complete_and_replaces_older(tmp_path):
    dest = tmp_path / "final"
    dest.mkdir()
    (dest / "old.bin").write_bytes(b"old")
    with staged_folder(dest) as staging:
        (staging / "weights.bin").write_bytes(b"new")
        (staging / "nested").mkdir()
        (staging / "nested" / "part").write_bytes(b"x")
        assert not (dest / "weights.bin").exists()  # nothing visible before the end
    assert sorted(p.name for p in dest.rglob("*")) == ["nested", "part", "weights.bin"]
    assert [p.name for p in tmp_path.iterdir()] == ["final"]  # no staging left behind


def test_a_failed_write_publishes_nothing(tmp_path):
    dest = tmp_path / "final"
    with pytest.raises(RuntimeError), staged_folder(dest) as staging:
        (staging / "half.bin").write_bytes(b"half")
        raise RuntimeError("crash mid-write")
    assert list(tmp_path.iterdir()) == []


def test_zstd_and_plain_streams_read_the_same(tmp_path):
    import zstandard

    data = b"line one\nline two\n" * 1000
    (tmp_path / "a.txt").write_bytes(data)
    (tmp_path / "a.txt.zst").write_bytes(zstandard.ZstdCompressor().compress(data))
    for name in ("a.txt", "a.txt.zst"):
        with open_counted_stream(tmp_path / name) as (raw, stream):
            assert stream.read() == data
            assert raw.tell() == (tmp_path / name).stat().st_size  # progress reaches the end


def test_an_atomic_write_onto_a_folder_names_the_folder_not_its_temporary(tmp_path):
    from pipeline.io import atomic_write_text

    folder = tmp_path / "page.html"
    folder.mkdir()
    with pytest.raises(IsADirectoryError) as raised:
        atomic_write_text(folder, "x")
    assert raised.value.filename == str(folder)
    assert list(tmp_path.iterdir()) == [folder] and list(folder.iterdir()) == []
