"""Atomic writes: the file is the old one or the new one, never a half-written one, and no temporary is left."""
import os

import pytest

from pretrain.atomic import atomic_path


def test_a_finished_write_replaces_the_file_and_leaves_no_temporary(tmp_path):
    target = tmp_path / "config.yaml"
    target.write_text("old")
    with atomic_path(target) as tmp:
        tmp.write_text("new")
        assert target.read_text() == "old"  # untouched until the block ends
    assert target.read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.yaml"]


def test_a_failed_write_keeps_the_old_file_and_removes_the_temporary(tmp_path):
    target = tmp_path / "latest"
    target.write_text("step00000010")
    with pytest.raises(OSError), atomic_path(target) as tmp:
        tmp.write_text("step000")
        raise OSError("disk full")
    assert target.read_text() == "step00000010"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest"]


def test_the_file_gets_a_new_files_mode_whatever_the_writer_made(tmp_path):
    """safetensors creates its file 0600; an exported model.safetensors must be readable as any other file."""
    mask = os.umask(0o022)
    try:
        with atomic_path(tmp_path / "model.safetensors") as tmp:
            os.close(os.open(tmp, os.O_CREAT | os.O_WRONLY, 0o600))
    finally:
        os.umask(mask)
    assert (tmp_path / "model.safetensors").stat().st_mode & 0o777 == 0o644
