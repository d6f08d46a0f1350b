"""metrics.jsonl on a relaunch: a last line cut short by a kill or a full disk mid-write is dropped with a one-line
warning naming the file, and the run appends after the rows it keeps; a bad line before the last is corruption,
refused naming the file and the line number (issue 28's audit)."""
import json

import pytest

from pretrain.train.metrics import MetricsFileError, MetricsWriter


def rows(steps) -> str:
    return "".join(json.dumps({"step": step, "train/loss": 5.0 - step / 10}) + "\n" for step in steps)


def logged_steps(path) -> list[int]:
    return [json.loads(line)["step"] for line in path.read_text().splitlines()]


@pytest.mark.parametrize("resume_step", [3, 0])  # a resume from step 3's checkpoint; a launch with none saved
def test_a_torn_last_line_is_dropped_with_a_warning_and_the_run_appends_after_the_kept_rows(tmp_path, capsys,
                                                                                          resume_step):
    path = tmp_path / "metrics.jsonl"
    path.write_text(rows(range(1, 5)) + '{"step": 5, "train/lo')  # killed while writing step 5's row
    writer = MetricsWriter(tmp_path, True, resume_step=resume_step)
    said = capsys.readouterr().err.strip().splitlines()
    assert len(said) == 1 and said[0].startswith(f"warning: dropped the last line of {path}, cut short"), said
    writer.scalars(resume_step + 1, {"train/loss": 1.0})
    writer.close()
    # without a checkpoint the launch starts over at step 1: the earlier launch's rows go, none is logged twice
    assert logged_steps(path) == list(range(1, resume_step + 2))


def test_a_last_row_without_its_newline_is_kept_and_the_next_row_starts_a_line(tmp_path, capsys):
    path = tmp_path / "metrics.jsonl"
    path.write_text(rows(range(1, 4)).rstrip("\n"))
    writer = MetricsWriter(tmp_path, True, resume_step=3)
    writer.scalars(4, {"train/loss": 1.0})
    writer.close()
    assert logged_steps(path) == [1, 2, 3, 4] and capsys.readouterr().err == ""


@pytest.mark.parametrize("bad", ['{"step": 2, "train/lo', "\x00\x00\x00", '{"loss": 1.0}'])
def test_a_bad_line_before_the_last_is_refused_naming_the_file_and_line(tmp_path, bad):
    path = tmp_path / "metrics.jsonl"
    text = rows([1]) + bad + "\n" + rows(range(2, 5))
    path.write_text(text)
    with pytest.raises(MetricsFileError, match=f"^{path}, line 2: not a logged step .* the file is corrupt"):
        MetricsWriter(tmp_path, True, resume_step=3)
    assert path.read_text() == text  # nothing dropped


def test_an_intact_file_is_left_as_it_is_when_nothing_is_dropped(tmp_path, capsys):
    path = tmp_path / "metrics.jsonl"
    path.write_text(rows(range(1, 4)))
    before = path.stat().st_mtime_ns
    MetricsWriter(tmp_path, True, resume_step=3).close()
    assert path.stat().st_mtime_ns == before and capsys.readouterr().err == ""
