"""The tokenizer pinned to its run: a file written over the run's tokenizer is refused by the resume, eval_ppl,
generate, export and train.init_from, each naming both hashes (issue 28, item 4); so are shards written with another
tokenizer, by eval_ppl as by training."""
import json
import shutil

import pytest

from pretrain.data import Tokenizer, make_text_shards, train_tokenizer

from launching import launch, tiny_overrides

pytestmark = pytest.mark.dist


def test_a_swapped_tokenizer_is_refused_by_the_resume_and_every_tool(lm_data, tmp_path, load_tool, capsys):
    tokenizer = tmp_path / "tok.model"
    shutil.copyfile(lm_data["tokenizer"], tokenizer)
    run = tmp_path / "run"
    overrides = tiny_overrides(lm_data, run, data__tokenizer=tokenizer, train__max_steps=2, checkpoint__every=2,
                               schedule__warmup_steps=1, log__val_every=100)
    launch(overrides)
    pinned = json.loads((run / "tokenizer_pin.json").read_text())
    assert pinned["sha256"] == Tokenizer(str(tokenizer)).sha256 and pinned["vocab_size"] == 320
    export = tmp_path / "export"
    assert load_tool("export").main(["--run", str(run), "--out", str(export)]) == 0
    assert json.loads((export / "tokenizer_pin.json").read_text())["sha256"] == pinned["sha256"]

    other = train_tokenizer([f"{lm_data['root']}/train.jsonl"], 300, str(tmp_path / "retrained"))
    foreign = tmp_path / "foreign"  # shards written with another tokenizer: refused in one line, as training does
    make_text_shards([f"{lm_data['root']}/val.jsonl"], other.path, str(foreign), docs_per_shard=50)
    capsys.readouterr()
    assert load_tool("eval_ppl").main(["--run", str(run), "--data", str(foreign)]) == 1
    said = capsys.readouterr().err.strip().splitlines()
    assert len(said) == 1 and said[0] == (f"error: shard {foreign / 'shard-000000.tar'} was written with tokenizer "
                                          f"sha256 {other.sha256} ({foreign / 'manifest.json'}), but this run's "
                                          f"tokenizer is {pinned['sha256']}"), said
    shutil.copyfile(other.path, tokenizer)
    shutil.copyfile(other.path, export / "tokenizer.model")

    def refused(said: str, where) -> None:
        assert f"{other.sha256}, 300 pieces) is not the tokenizer {where} was trained with (sha256 " \
               f"{pinned['sha256']}, 320 pieces" in said, said[-3000:]

    resumed = launch([*overrides, "train.max_steps=4"], check=False)
    assert resumed.returncode == 2 and "Traceback" not in resumed.stderr, resumed.stderr[-3000:]
    refused(resumed.stderr, run)
    initialised = launch(tiny_overrides(lm_data, tmp_path / "new", train__max_steps=2, schedule__warmup_steps=1,
                                        train__init_from=run), check=False)  # its own tokenizer is the original
    assert initialised.returncode == 2 and "config error: train.init_from: cannot load" in initialised.stderr
    refused(initialised.stderr, run)

    capsys.readouterr()
    for name, argv in [("eval_ppl", ["--data", lm_data["held_out"]]), ("generate", ["--prompt", "the cat"]),
                       ("export", ["--out", str(tmp_path / "again")])]:
        assert load_tool(name).main(["--run", str(run), *argv]) == 1, name
        refused(capsys.readouterr().err, run)
    assert load_tool("eval_ppl").main(["--run", str(export), "--data", lm_data["held_out"]]) == 1
    refused(capsys.readouterr().err, export)
