"""Each replica reads its own share of the shards in a real 4-rank run (issue 46): the shards every rank opened,
recorded by the loader's own diagnostic (``PRETRAIN_SHARD_READ_LOG``), are those ``TokenLoader.planned_shards``
(what tools/bench_data.py counts) names for that rank, and the ranks' shares barely overlap."""
import pytest

from pretrain.data import TokenLoader

from launching import launch, tiny_overrides

pytestmark = pytest.mark.dist
STEPS, RANKS, LANES = 3, 4, 4


def test_four_ranks_read_the_shards_bench_data_predicts(lm_data, tmp_path, monkeypatch):
    reads = tmp_path / "reads"
    reads.mkdir()
    monkeypatch.setenv("PRETRAIN_SHARD_READ_LOG", str(reads))
    launch(tiny_overrides(lm_data, tmp_path / "run", data__num_workers=1, data__lanes=LANES, train__max_steps=STEPS,
                          schedule__warmup_steps=1, checkpoint__every=STEPS, log__val_every=100), ranks=RANKS)
    shares = []
    for rank in range(RANKS):
        opened = {line for path in reads.glob(f"shard_reads.rank{rank}.*") for line in path.read_text().split()}
        loader = TokenLoader(lm_data["train_shards"], seq_len=64, batch_size=4, rank=rank, world_size=RANKS,
                             lanes=LANES)
        # the steps' batches, and at most the two the worker prefetched beyond them
        assert loader.planned_shards(STEPS) <= opened <= loader.planned_shards(STEPS + 2), rank
        shares.append(opened)
    shards = len(loader.shard_urls)
    assert all(len(share) <= shards / RANKS + 2 for share in shares), [len(share) for share in shares]
    assert len(set().union(*shares)) >= sum(map(len, shares)) - RANKS  # only a lane's boundary shards are shared
