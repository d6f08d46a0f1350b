"""One voice across the command lines: the same flag names for the same things, and --help showing defaults."""
import subprocess

import pytest

from launching import PYTHON, REPO

# (tool and subcommand, flags it must have, an option's help that must show its default)
TOOLS = [
    (["tools/eval_ppl.py"], ["--run", "--tag", "--data", "--json"], "windows per forward (default: 8)"),
    (["tools/eval_cls.py"], ["--run", "--tag", "--data", "--json"], "(default: cpu)"),
    (["tools/generate.py"], ["--run", "--tag"], "most tokens to generate (default: 100)"),
    (["tools/export.py"], ["--run", "--tag", "--out"], "dtype of the stored weights (default: fp32)"),
    (["tools/reshard.py"], ["--run", "--tag", "--json"], "(default: 4)"),
    (["tools/make_shards.py", "text"], ["--input", "--out"], "(default: 10000)"),
    (["tools/make_shards.py", "verify"], ["--data"], None),
    (["tools/demo.py"], ["--run"], "(default: runs/demo)"),
    (["tools/bench_data.py"], ["--data"], "(default: 20000000)"),
    (["tools/bench_images.py"], ["--data"], None),
    (["tools/compare_mixers.py"], ["--configs", "--out", "--json"], None),
    (["tools/context_position.py"], ["--run", "--tag", "--data", "--json"], "(default: 16384)"),
]


@pytest.mark.parametrize("argv,flags,default", TOOLS, ids=[" ".join(t[0]) for t in TOOLS])
def test_flags_are_named_alike_and_help_shows_defaults(argv, flags, default):
    result = subprocess.run([PYTHON, *argv, "--help"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    text = " ".join(result.stdout.split())  # argparse wraps help lines
    for flag in flags:
        assert f"{flag} " in text or f"{flag}," in text, (flag, result.stdout)
    if default:
        assert default in text, result.stdout
    assert "(default: None)" not in text and "(default: False)" not in text


def test_train_tokenizer_keeps_sentencepiece_quiet_unless_asked(lm_data, tmp_path):
    argv = [PYTHON, "tools/train_tokenizer.py", "--input", f"{lm_data['root']}/train.jsonl", "--vocab-size", "300",
            "--out", str(tmp_path / "tok")]
    quiet = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert quiet.returncode == 0, quiet.stderr[-3000:]
    assert quiet.stderr.splitlines() == ["training a 300-piece bpe tokenizer on 1 file with sentencepiece"]
    assert quiet.stdout.startswith(f"wrote {tmp_path / 'tok'}.model")
    verbose = subprocess.run(argv + ["--verbose"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert verbose.returncode == 0 and "trainer_interface" in verbose.stderr, verbose.stderr[-3000:]
