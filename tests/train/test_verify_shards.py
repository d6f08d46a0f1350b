"""data.verify_shards: every training shard's sha256 against its manifest before step 1 (make_shards verify's code)."""
import shutil
from pathlib import Path

import pytest

from pretrain.data.shards import ShardError, expand_shards, verify_shards

from launching import launch, tiny_overrides


def flip_a_bit(shard: Path) -> None:
    raw = bytearray(shard.read_bytes())
    raw[700] ^= 1  # inside a member: the tar still reads, only the sha256 tells
    shard.write_bytes(bytes(raw))


def test_progress_lines_and_a_corrupt_shard_named(lm_data, tmp_path):
    data = tmp_path / "shards"
    shutil.copytree(Path(lm_data["train_shards"]).parent, data)
    lines = []
    assert verify_shards(expand_shards(str(data)), report=lines.append, every=0) == "12 shards match their " \
        "manifest's sha256"
    assert lines[0] == "verified 1/12 shards (0.00 GB)" and len(lines) == 12
    flip_a_bit(data / "shard-000007.tar")
    with pytest.raises(ShardError, match=r"^1 of 12 shards fail verification: .*shard-000007\.tar \(sha256 differs"):
        verify_shards(expand_shards(str(data)))


@pytest.mark.dist
def test_a_run_with_verify_shards_stops_before_step_1_naming_the_corrupt_shard(lm_data, tmp_path):
    data = tmp_path / "shards"
    shutil.copytree(Path(lm_data["train_shards"]).parent, data)
    flip_a_bit(data / "shard-000004.tar")
    run = tmp_path / "run"
    result = launch(tiny_overrides(lm_data, run, data__train_shards=str(data), data__verify_shards="true",
                                   data__num_workers=1), check=False, timeout=300)
    assert result.returncode == 1, result.stderr[-3000:]
    assert "verifying the sha256 of 12 training shards" in result.stdout
    errors = [line for line in result.stderr.splitlines() if line.startswith("error")]
    assert len(errors) == 1 and "shard-000004.tar (sha256 differs from its manifest's)" in errors[0], result.stderr
    assert "Traceback" not in result.stderr
    assert not (run / "metrics.jsonl").exists() or "train/loss" not in (run / "metrics.jsonl").read_text()
