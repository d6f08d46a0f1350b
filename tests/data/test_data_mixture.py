"""MixtureLoader: rows of several sources shared out by weight through the lanes, by tokens or by documents,
deterministic per seed, shared by the replicas, resumed exactly."""
import pickle
from itertools import islice

import numpy as np
import pytest
import torch

from pretrain.data import MixtureLoader, TokenLoader
from pretrain.data.shards import ShardWriter, write_manifest

OFFSET = 100_000  # source 1's tokens are source 0's ids plus this, so every token tells its source


@pytest.fixture
def sources(numbered_shards, tmp_path):
    """(numbered_shards' directory, a small second source of 14 documents in 2 shards), so it cycles often."""
    directory, docs = numbered_shards
    small = tmp_path / "small"
    small.mkdir()
    writer = ShardWriter(str(small), samples_per_shard=7)
    for i, tokens in enumerate(docs[:14]):
        members = {"tokens.u32": (tokens + OFFSET).astype("<u4").tobytes(), "json": b'{"num_bytes":1}'}
        writer.add(f"{i:010d}", members, tokens=len(tokens), bytes=len(tokens))
    files = writer.close()
    write_manifest(str(small), {"tokenizer_sha256": "0" * 64, "files": files, "shards": len(files)})
    return directory, str(small)


def mixture(sources, weights=(3.0, 1.0), num_workers=0, by="tokens", **settings):
    settings = dict(dict(seq_len=8, batch_size=3, rank=1, world_size=2, seed=7), **settings)
    return MixtureLoader([(TokenLoader(pattern, **settings), w) for pattern, w in zip(sources, weights)],
                         num_workers=num_workers, by=by)


def shards_of(directory, docs):
    directory.mkdir()
    writer = ShardWriter(str(directory), samples_per_shard=20)
    for i, tokens in enumerate(docs):
        members = {"tokens.u32": tokens.astype("<u4").tobytes(), "json": b'{"num_bytes":1}'}
        writer.add(f"{i:010d}", members, tokens=len(tokens), bytes=len(tokens))
    files = writer.close()
    write_manifest(str(directory), {"tokenizer_sha256": "0" * 64, "files": files, "shards": len(files)})
    return str(directory)


@pytest.fixture
def short_and_long(tmp_path):
    """Two sources whose documents' lengths differ twentyfold: 5–15 tokens (ids < OFFSET) and 150–250 (>= OFFSET)."""
    rng = np.random.default_rng(3)
    short = [rng.integers(4, 1000, size=rng.integers(5, 16)) for _ in range(200)]
    long = [OFFSET + rng.integers(4, 1000, size=rng.integers(150, 251)) for _ in range(40)]
    return shards_of(tmp_path / "short", short), shards_of(tmp_path / "long", long)


def test_a_3_to_1_mixture_by_tokens_gives_75_percent_of_the_tokens_whatever_the_documents_lengths(short_and_long):
    """The heavy source has documents twenty times shorter: by tokens it still gets 3/4 of the tokens (48 of the 64
    lanes); by documents (the option) its weight times its mean document length of the rows, so 3/4 of the
    documents and a fraction of the tokens."""
    settings = dict(seq_len=64, batch_size=4, world_size=1, rank=0)
    by_tokens = mixture(short_and_long, **settings)
    tokens = tokens_of(islice(by_tokens, 40))
    (rows0, tokens0), (rows1, tokens1) = by_tokens.source_counts()
    assert tokens0 + tokens1 == len(tokens) and tokens1 == int((tokens >= OFFSET).sum())
    assert rows0 + rows1 == 160 and abs(tokens0 / len(tokens) - 0.75) < 0.02, tokens0 / len(tokens)

    by_documents = mixture(short_and_long, by="documents", **settings)
    tokens = tokens_of(islice(by_documents, 40))
    (_, tokens0), (_, tokens1) = by_documents.source_counts()
    assert tokens1 == int((tokens >= OFFSET).sum())
    documents0, documents1 = tokens0 / 10, tokens1 / 200  # the sources' mean lengths: 10 and 200 tokens
    assert abs(documents0 / (documents0 + documents1) - 0.75) < 0.05 and tokens0 / (tokens0 + tokens1) < 0.25


def tokens_of(batches) -> np.ndarray:
    return np.concatenate([b["input_ids"].reshape(-1).numpy() for b in batches])


@pytest.mark.parametrize("by", ["tokens", "documents"])
@pytest.mark.parametrize("workers_before,workers_after,stop", [(0, 2, 5), (2, 1, 17), (1, 0, 31)])
def test_mixture_resumes_exactly_with_any_number_of_workers(sources, workers_before, workers_after, stop, by):
    reference_loader = mixture(sources, by=by)
    reference = list(islice(reference_loader, 60))
    small_rows = sum((len(d) - 1) // 8 for d in [np.concatenate(pair) for pair in _pairs(sources)])
    assert reference_loader.source_counts()[1][0] > small_rows  # the resumed stretch crosses its epoch boundary
    first = mixture(sources, num_workers=workers_before, by=by)
    head = list(islice(first, stop))
    state = pickle.loads(pickle.dumps(first.state_dict()))
    resumed = mixture(sources, num_workers=workers_after, by=by)
    resumed.load_state_dict(state)
    tail = list(islice(resumed, 60 - stop))
    for got, want in zip(head + tail, reference, strict=True):
        for key in ("input_ids", "labels", "position_ids"):
            assert torch.equal(got[key], want[key]), key
    assert resumed.state_dict() == reference_loader.state_dict()
    assert resumed.source_counts() == reference_loader.source_counts()


def _pairs(sources):
    """The small source's two shards' documents."""
    from pretrain.data import read_documents

    docs = [d.tokens for d in read_documents(sources[1])]
    return [docs[:7], docs[7:]]


def test_draws_depend_on_the_seed_only_and_replicas_share_them(sources):
    def first_tokens(**settings):
        return tokens_of(islice(mixture(sources, **settings), 10))

    same = first_tokens()
    assert np.array_equal(same, first_tokens(num_workers=2))
    alone = tokens_of(islice(mixture(sources, rank=0, world_size=1), 20)).reshape(-1, 8)
    mine = same.reshape(-1, 8)
    for k, row in enumerate(mine):  # replica 1 of 2: the odd rows of each round of 6
        assert np.array_equal(row, alone[k // 3 * 6 + 1 + k % 3 * 2])
    assert not np.array_equal(same, first_tokens(seed=8))
    assert not np.array_equal(same, first_tokens(weights=(1.0, 3.0)))


def test_bad_sources_and_foreign_states_are_refused(sources):
    with pytest.raises(ValueError, match=r"sources\[1\] weight=0: expected a number > 0"):
        mixture(sources, weights=(1.0, 0))
    with pytest.raises(ValueError, match=r"sources\[1\] seed=8, but sources\[0\] has 7"):
        MixtureLoader([(TokenLoader(sources[0], seq_len=8, batch_size=3, seed=7), 1.0),
                       (TokenLoader(sources[1], seq_len=8, batch_size=3, seed=8), 1.0)])
    with pytest.raises(ValueError, match=r"source 1's share 0.000999 gets none of the lanes; raise lanes to at "
                                         r"least 1001"):
        mixture(sources, weights=(1000.0, 1.0))
    state = mixture(sources).state_dict()
    with pytest.raises(ValueError, match="'weights'"):
        mixture(sources, weights=(1.0, 1.0)).load_state_dict(state)
    with pytest.raises(ValueError, match="'by' is 'documents'"):
        mixture(sources).load_state_dict(mixture(sources, by="documents").state_dict())
    with pytest.raises(ValueError, match=r"by='weight': expected one of tokens, documents"):
        mixture(sources, by="weight")
