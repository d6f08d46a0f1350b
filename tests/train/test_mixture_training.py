"""A data mixture in a real run: per-source counts (rows, tokens) in the metrics under the sources' names, tokens
shared out by weight, and a relaunch resumes the mixture exactly."""
import json
import shutil

import pytest

from pretrain.train import checkpoint

from launching import launch, read_metrics, tiny_overrides

pytestmark = pytest.mark.dist
STEPS = 12


def test_a_mixture_run_logs_counts_per_source_and_resumes_exactly(lm_data, tmp_path):
    shards = lm_data["train_shards"].rsplit("/", 1)[0]
    mix = (f"[{{shards: '{shards}/shard-{{000000..000005}}.tar', weight: 3, name: web}}, "
           f"{{shards: '{shards}/shard-{{000006..000011}}.tar', weight: 1}}]")
    run = tmp_path / "mixed"
    overrides = tiny_overrides(lm_data, run, data__train_shards=mix, train__max_steps=STEPS, checkpoint__every=6,
                               checkpoint__keep_last=2, log__val_every=STEPS)
    launch(overrides, ranks=2)
    reference = read_metrics(run)
    tokens = [reference[STEPS][f"train/{name}_tokens"] for name in ("web", "source1")]  # the second is unnamed
    assert sum(tokens) == reference[STEPS]["train/tokens_seen"]  # every token from one source, counted once
    assert abs(tokens[1] / sum(tokens) - 0.25) < 0.03  # weight 1 of 4, of the tokens (data.mix_by's default)

    resumed = tmp_path / "resumed"
    shutil.copytree(run, resumed)
    shutil.rmtree(resumed / "checkpoints" / checkpoint.tag_for(STEPS))
    (resumed / "checkpoints" / "latest").write_text(checkpoint.tag_for(6))
    launch([*overrides, f"run.dir={resumed}"], ranks=2)
    logged = [json.loads(line)["step"] for line in (resumed / "metrics.jsonl").read_text().splitlines()]
    assert logged.count(6) == logged.count(7) == 1 and logged == sorted(logged), logged  # on from step 7, once
    again = read_metrics(resumed)
    for step in range(7, STEPS + 1):
        for key in ("train/loss", "train/web_tokens", "train/source1_rows"):
            assert again[step][key] == reference[step][key], (step, key)
