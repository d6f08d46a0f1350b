"""TokenLoader: every token once per epoch across ranks × workers, document-aware positions, exact resume."""
import pickle
from collections import Counter
from itertools import islice

import numpy as np
import pytest
import torch

from pretrain.data import ShardError, TokenLoader, make_text_shards, read_documents


def take(loader, n):
    return list(islice(iter(loader), n))


def input_stream(batches) -> np.ndarray:
    """The token stream a list of batches covers: the rows' inputs in order (rows overlap by one token)."""
    return np.concatenate([b["input_ids"].reshape(-1).numpy() for b in batches])


def assert_rows_chain(batches):
    """labels are the next token: within a row, and the last label is the next row's first input."""
    rows_in = torch.cat([b["input_ids"] for b in batches])
    rows_lab = torch.cat([b["labels"] for b in batches])
    assert torch.equal(rows_lab[:, :-1], rows_in[:, 1:])
    assert torch.equal(rows_lab[:-1, -1], rows_in[1:, 0])


def test_text_to_batches_every_token_once_per_epoch_2_ranks_2_workers(corpus, tokenizer, tmp_path):
    paths, texts = corpus
    make_text_shards(paths, tokenizer.path, str(tmp_path / "shards"), docs_per_shard=40)
    all_docs = [tuple(d.tokens) for d in read_documents(str(tmp_path / "shards"))]
    seen = []
    for rank in range(2):
        loader = TokenLoader(str(tmp_path / "shards"), seq_len=64, batch_size=4, rank=rank, world_size=2,
                             num_workers=2, shuffle_buffer=50, seed=3, tokenizer_sha256=tokenizer.sha256)
        batches = []
        for batch in loader:
            assert batch["input_ids"].dtype == torch.long and batch["input_ids"].shape == (4, 64)
            batches.append(batch)
            if loader.epoch == 1:
                break
        assert_rows_chain(batches)
        stream = input_stream(batches)
        ends = np.flatnonzero(stream == tokenizer.eos_id)
        docs = [tuple(d) for d in np.split(stream, ends + 1)]
        rank_docs = sum(1 for url in loader.epoch_shards(0) for _ in read_documents(url))
        assert rank_docs > 0 and len(docs) > rank_docs  # the stream went past the end of epoch 0
        seen += docs[:rank_docs]
    assert Counter(seen) == Counter(all_docs)
    assert sorted(tokenizer.decode(d[:-1]) for d in seen) == sorted(texts)


def test_position_ids_restart_at_documents_and_rows(numbered_shards):
    directory, docs = numbered_shards
    starts = {int(d[0]) for d in docs}
    loader = TokenLoader(directory, seq_len=16, batch_size=4, shuffle_buffer=20)
    for batch in take(loader, 40):
        ids, pos = batch["input_ids"].numpy(), batch["position_ids"].numpy()
        is_start = np.isin(ids, list(starts))
        is_start[:, 0] = True
        assert np.array_equal(pos == 0, is_start)
        # inside a document, tokens are consecutive numbers and positions count up by one
        assert np.all(ids[:, 1:][pos[:, 1:] > 0] == ids[:, :-1][pos[:, 1:] > 0] + 1)
        assert np.all(pos[:, 1:][pos[:, 1:] > 0] == pos[:, :-1][pos[:, 1:] > 0] + 1)


def test_unshuffled_single_rank_stream_is_the_documents_in_order(numbered_shards):
    directory, docs = numbered_shards
    loader = TokenLoader(directory, seq_len=10, batch_size=3, shuffle=False, epochs=1)
    batches = list(loader)
    assert_rows_chain(batches)
    expected = np.concatenate(docs)
    stream = input_stream(batches)
    assert len(expected) - 30 < len(stream) <= len(expected) - 1  # only the tail that fills no batch is dropped
    assert np.array_equal(stream, expected[:len(stream)])
    assert loader.epoch == 1 and list(loader) == []


def test_shuffle_depends_on_seed_and_epoch_and_covers_every_document(numbered_shards):
    directory, docs = numbered_shards
    total = sum(len(d) for d in docs)

    def epoch_orders(seed):
        stream = input_stream(list(TokenLoader(directory, seq_len=8, batch_size=1, seed=seed, epochs=2)))
        return stream[:total - 8], stream[total:2 * total - 8]

    first, second = epoch_orders(0)
    assert not np.array_equal(first, second)
    assert not np.array_equal(first, epoch_orders(1)[0])
    assert not np.array_equal(first, np.concatenate(docs)[:total - 8])
    one_epoch = list(TokenLoader(directory, seq_len=1, batch_size=1, seed=0, epochs=1))
    tokens = np.append(input_stream(one_epoch), one_epoch[-1]["labels"][-1, -1])  # the last token is only a label
    assert np.array_equal(np.sort(tokens), np.arange(1, total + 1))


@pytest.mark.parametrize("workers_before,workers_after,stop", [(0, 2, 5), (2, 1, 17), (1, 0, 31), (2, 2, 44)])
def test_resume_continues_exactly_with_any_number_of_workers(numbered_shards, workers_before, workers_after, stop):
    directory, _ = numbered_shards
    settings = dict(seq_len=8, batch_size=3, rank=1, world_size=2, shuffle_buffer=20, seed=7)
    reference_loader = TokenLoader(directory, **settings)
    reference = take(reference_loader, 60)
    assert reference_loader.epoch >= 1  # the resumed stretch crosses an epoch boundary

    first = TokenLoader(directory, num_workers=workers_before, **settings)
    head = take(first, stop)
    state = pickle.loads(pickle.dumps(first.state_dict()))
    resumed = TokenLoader(directory, num_workers=workers_after, **settings)
    resumed.load_state_dict(state)
    tail = take(resumed, 60 - stop)
    for got, want in zip(head + tail, reference, strict=True):
        for key in ("input_ids", "labels", "position_ids"):
            assert torch.equal(got[key], want[key]), key
    assert resumed.state_dict() == reference_loader.state_dict()


def test_state_of_another_stream_is_refused(numbered_shards):
    directory, _ = numbered_shards
    state = TokenLoader(directory, seq_len=8, batch_size=2, rank=0, world_size=2).state_dict()
    with pytest.raises(ValueError, match="'world_size'"):
        TokenLoader(directory, seq_len=8, batch_size=2).load_state_dict(state)
    del state["seed"]
    with pytest.raises(ValueError, match="'seed'"):
        TokenLoader(directory, seq_len=8, batch_size=2, rank=0, world_size=2).load_state_dict(state)


def test_uneven_ranks_yield_forever_and_too_few_shards_are_refused(numbered_shards):
    directory, docs = numbered_shards
    rank_tokens = []
    for rank in range(4):  # 13 shards over 4 ranks: one rank has 4, the others 3
        loader = TokenLoader(directory, seq_len=8, batch_size=2, rank=rank, world_size=4, shuffle_buffer=5)
        batches = take(loader, 200)  # 3200 tokens, several epochs of each rank's share
        assert len(batches) == 200 and loader.epoch >= 2
        rank_tokens.append(sum(len(d.tokens) for url in loader.epoch_shards(0) for d in read_documents(url)))
    assert sum(rank_tokens) == sum(len(d) for d in docs)
    with pytest.raises(ShardError, match="fewer than world_size=14"):
        TokenLoader(directory, seq_len=8, batch_size=2, rank=0, world_size=14)


@pytest.mark.parametrize("key,value", [("seq_len", 0), ("batch_size", -1), ("rank", 2), ("epochs", 0)])
def test_bad_arguments_name_the_key(numbered_shards, key, value):
    directory, _ = numbered_shards
    args = dict(seq_len=8, batch_size=2, world_size=2) | {key: value}
    with pytest.raises(ValueError, match=key):
        TokenLoader(directory, **args)


def test_resume_of_a_finite_stream_ends_where_the_uninterrupted_one_does(numbered_shards):
    directory, _ = numbered_shards
    settings = dict(seq_len=16, batch_size=2, epochs=2, shuffle_buffer=10)
    whole = TokenLoader(directory, **settings)
    reference = list(whole)
    assert whole.epoch == 2
    first = TokenLoader(directory, num_workers=2, **settings)
    head = take(first, len(reference) // 2 + 3)
    assert first.epoch == 1  # the stop lies in the second epoch
    resumed = TokenLoader(directory, num_workers=1, **settings)
    resumed.load_state_dict(first.state_dict())
    got = head + list(resumed)
    assert len(got) == len(reference) and resumed.epoch == 2
    assert all(torch.equal(a["input_ids"], b["input_ids"]) for a, b in zip(got, reference))
