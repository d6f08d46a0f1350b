"""The data tools as a user runs them: text → tokenizer → shards → batches, images → shards, clear failures."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from pretrain.data import Tokenizer, TokenLoader

pytestmark = pytest.mark.dist  # each test runs a tool in its own process

REPO = Path(__file__).resolve().parents[2]


def run_tool(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *argv], cwd=REPO, capture_output=True, text=True, timeout=300)


def test_text_pipeline_from_the_command_line(corpus, tmp_path):
    paths, texts = corpus
    trained = run_tool("tools/train_tokenizer.py", "--input", *paths, "--vocab-size", "350",
                       "--out", str(tmp_path / "tok" / "corpus"))
    assert trained.returncode == 0, trained.stderr
    assert "pad=0 bos=2 eos=3" in trained.stdout
    sharded = run_tool("tools/make_shards.py", "text", "--input", str(Path(paths[0]).parent / "*"),
                       "--tokenizer", str(tmp_path / "tok" / "corpus.model"), "--out", str(tmp_path / "shards"),
                       "--docs-per-shard", "100", "--workers", "2")
    assert sharded.returncode == 0, sharded.stderr
    manifest = json.loads((tmp_path / "shards" / "manifest.json").read_text())
    assert manifest["shards"] == 3 and manifest["documents"] == len(texts)
    tok = Tokenizer(str(tmp_path / "tok" / "corpus.model"))
    batch = next(iter(TokenLoader(str(tmp_path / "shards"), seq_len=64, batch_size=2,
                                  tokenizer_sha256=tok.sha256)))
    assert batch["input_ids"].shape == (2, 64)

    again = run_tool("tools/make_shards.py", "text", "--input", paths[0], "--tokenizer",
                     str(tmp_path / "tok" / "corpus.model"), "--out", str(tmp_path / "shards"))
    assert again.returncode == 1 and "not empty" in again.stderr and "Traceback" not in again.stderr
    missing = run_tool("tools/train_tokenizer.py", "--input", str(tmp_path / "nothing*.txt"), "--vocab-size", "300",
                       "--out", str(tmp_path / "x"))
    assert missing.returncode == 1 and "nothing*.txt" in missing.stderr and "Traceback" not in missing.stderr


@pytest.mark.parametrize("tool", ["tools/train_tokenizer.py", "tools/make_shards.py", "tools/bench_data.py"])
def test_help_explains_the_tool(tool):
    result = run_tool(tool, "--help")
    assert result.returncode == 0 and "Example" in result.stdout


def test_cifar10_tar_to_image_shards(shared_data, tmp_path):
    result = run_tool("tools/make_shards.py", "images", "--input", str(shared_data / "images" / "cifar10_jpg.tar.gz"),
                      "--split", "test", "--out", str(tmp_path / "cifar"), "--images-per-shard", "4000")
    assert result.returncode == 0, result.stderr
    manifest = json.loads((tmp_path / "cifar" / "manifest.json").read_text())
    assert manifest["images"] == 10_000 and manifest["shards"] == 3 and len(manifest["classes"]) == 10
    assert set(manifest["class_counts"].values()) == {1000} and manifest["classes"][0] == "airplane"
