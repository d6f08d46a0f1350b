"""TokenLoader: every token once per epoch across replicas × workers, one stream of rows however many replicas
share it, document-aware positions, exact resume (also on another number of replicas)."""
import json
import pickle
import shutil
from collections import Counter
from itertools import islice

import numpy as np
import pytest
import torch

from pretrain.data import TokenLoader, make_text_shards, read_documents


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
    shares = []
    for rank in range(2):
        loader = TokenLoader(str(tmp_path / "shards"), seq_len=64, batch_size=4, rank=rank, world_size=2,
                             num_workers=2, shuffle_buffer=50, seed=3, tokenizer_sha256=tokenizer.sha256)
        batches = []
        for batch in loader:
            assert batch["input_ids"].dtype == torch.long and batch["input_ids"].shape == (4, 64)
            batches.append(batch)
            if loader.epoch == 1:
                break
        shares.append(batches)
    assert len(shares[0]) == len(shares[1])  # the replicas roll over in the same round
    batches = [batch for pair in zip(*shares) for batch in pair]  # the rounds, in stream order
    assert_rows_chain(batches)
    stream = input_stream(batches)
    ends = np.flatnonzero(stream == tokenizer.eos_id)
    seen = [tuple(d) for d in np.split(stream, ends + 1)]
    assert len(seen) > len(all_docs)  # the stream went past the end of epoch 0
    seen = seen[:len(all_docs)]
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
    state = TokenLoader(directory, seq_len=8, batch_size=2, seed=1).state_dict()
    with pytest.raises(ValueError, match="'seed' is 1"):
        TokenLoader(directory, seq_len=8, batch_size=2).load_state_dict(state)
    written_before = {**TokenLoader(directory, seq_len=8, batch_size=2).state_dict(), "rank": 1, "world_size": 2}
    with pytest.raises(ValueError, match="rank 1's of 2, written before the ranks shared one stream"):
        TokenLoader(directory, seq_len=8, batch_size=2).load_state_dict(written_before)
    TokenLoader(directory, seq_len=8, batch_size=2).load_state_dict({**written_before, "rank": 0, "world_size": 1})


@pytest.mark.parametrize("replicas", [2, 3, 14])  # 14: more replicas than the 13 shards
def test_replicas_share_one_stream_of_batches(numbered_shards, replicas):
    """Replica r's k-th batch is one replica's batch k·R + r: a global step's rows do not depend on R."""
    directory, _ = numbered_shards
    settings = dict(seq_len=8, batch_size=2, shuffle_buffer=5, seed=2)
    alone = take(TokenLoader(directory, **settings), 6 * replicas)
    for rank in range(replicas):
        share = take(TokenLoader(directory, rank=rank, world_size=replicas, num_workers=rank % 2, **settings), 6)
        for k, batch in enumerate(share):
            assert torch.equal(batch["input_ids"], alone[k * replicas + rank]["input_ids"]), (rank, k)


@pytest.mark.parametrize("before,after,stop", [(2, 1, 7), (1, 3, 12), (4, 2, 5)])
def test_resume_on_another_number_of_replicas_continues_the_stream(numbered_shards, before, after, stop):
    """Stopped after ``stop`` rounds of ``before`` replicas, resumed on ``after``: the rounds go on from the token
    where they stopped, with the same batches as an uninterrupted single replica (the round sizes divide)."""
    directory, _ = numbered_shards
    settings = dict(seq_len=8, batch_size=2, shuffle_buffer=5, seed=2)
    alone = take(TokenLoader(directory, **settings), stop * before + 4 * after)
    states = []
    for rank in range(before):
        loader = TokenLoader(directory, rank=rank, world_size=before, **settings)
        take(loader, stop)
        states.append(loader.state_dict())
    assert all(state == states[0] for state in states)  # at a round's end every replica holds the same state
    for rank in range(after):
        resumed = TokenLoader(directory, rank=rank, world_size=after, num_workers=1, **settings)
        resumed.load_state_dict(states[0])
        for k, batch in enumerate(take(resumed, 4)):
            assert torch.equal(batch["input_ids"], alone[stop * before + k * after + rank]["input_ids"]), (rank, k)


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


def test_moved_shards_resume_and_other_contents_are_refused(numbered_shards, tmp_path):
    """The state names the shards by their names and their manifests' sha256, not their directory."""
    directory, _ = numbered_shards
    state = TokenLoader(directory, seq_len=8, batch_size=2).state_dict()
    moved = tmp_path / "moved"
    shutil.copytree(directory, moved)
    TokenLoader(str(moved), seq_len=8, batch_size=2).load_state_dict(state)
    manifest = json.loads((moved / "manifest.json").read_text())
    manifest["files"][3]["sha256"] = "0" * 64
    (moved / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match="'shards_sha256'"):
        TokenLoader(str(moved), seq_len=8, batch_size=2).load_state_dict(state)
