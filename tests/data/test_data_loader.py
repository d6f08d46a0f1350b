"""TokenLoader: each shard packed whole into rows, the same rows however many replicas and workers share them, each
replica (and worker) reading only its lanes' shards, document-aware positions, exact resume without replay (also on
another number of replicas)."""
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


def rows_of(batches, key="input_ids") -> list[np.ndarray]:
    """The rows of a list of batches, in order."""
    return [row.numpy() for b in batches for row in b[key]]


def full_rows(batches) -> list[np.ndarray]:
    """Each row's seq_len + 1 tokens: its inputs and its last label."""
    return [np.append(inputs, labels[-1]) for inputs, labels in zip(rows_of(batches), rows_of(batches, "labels"))]


def shard_streams(loader, rows) -> dict[str, np.ndarray]:
    """Per shard whose rows are all among ``rows``, the tokens they cover, chained in row order (consecutive rows of
    a shard overlap by one)."""
    by_shard: dict[str, dict[int, np.ndarray]] = {}
    for g, row in enumerate(rows):
        url, i = loader.place_of_row(g)
        assert i not in by_shard.setdefault(url, {}), (url, i)
        by_shard[url][i] = row
    streams = {}
    for url, pieces in by_shard.items():
        if sorted(pieces) != list(range(len(pieces))) or loader.place_of_row(len(rows))[0] == url:
            continue  # a shard the last round, dropped, cuts
        ordered = [pieces[i] for i in range(len(pieces))]
        assert all(a[-1] == b[0] for a, b in zip(ordered, ordered[1:])), url
        streams[url] = np.concatenate([ordered[0]] + [r[1:] for r in ordered[1:]])
    return streams


def test_text_to_batches_every_shard_packed_whole_2_ranks_2_workers(corpus, tokenizer, tmp_path):
    """An epoch's rows, shared by 2 replicas × 2 workers, are the rows of one replica; per shard they chain into its
    documents, each whole, in a shuffled order, cut only at the shard's last < seq_len tokens."""
    paths, texts = corpus
    make_text_shards(paths, tokenizer.path, str(tmp_path / "shards"), docs_per_shard=40)
    settings = dict(seq_len=64, batch_size=4, seed=3, lanes=4, tokenizer_sha256=tokenizer.sha256)
    alone = TokenLoader(str(tmp_path / "shards"), epochs=1, **settings)
    rows = full_rows(list(alone))
    shares = [list(TokenLoader(str(tmp_path / "shards"), rank=rank, world_size=2, num_workers=2, epochs=1,
                               **settings)) for rank in range(2)]
    for rank, share in enumerate(shares):
        assert all(b["input_ids"].dtype == torch.long and b["input_ids"].shape == (4, 64) for b in share)
        mine = full_rows(share)
        assert len(mine) == len(rows) // 8 * 4  # whole rounds of 2 × 4 rows
        for k, row in enumerate(mine):  # round n's rows ≡ rank (mod 2)
            assert np.array_equal(row, rows[k // 4 * 8 + rank + k % 4 * 2])
    streams = shard_streams(alone, rows)
    manifest = json.loads((tmp_path / "shards" / "manifest.json").read_text())
    assert len(rows) == sum((f["tokens"] - 1) // 64 for f in manifest["files"]) // 8 * 8  # but the last round's
    documents = {}
    for d in read_documents(str(tmp_path / "shards")):
        documents.setdefault(d.key.split("#")[0], []).append(tuple(d.tokens))
    assert len(streams) >= len(documents) - 4 and set(streams) <= set(documents)  # 4 lanes: one cut shard each
    for url, stream in streams.items():
        whole = sum(len(d) for d in documents[url])
        assert whole - 64 <= len(stream) <= whole  # the last < seq_len tokens unread
        pieces = np.split(stream, np.flatnonzero(stream == tokenizer.eos_id) + 1)
        read = [tuple(p) for p in pieces if len(p) and p[-1] == tokenizer.eos_id]
        assert Counter(read) <= Counter(documents[url])  # documents whole, each once
        assert sum(map(len, read)) > len(stream) - max(map(len, documents[url]))  # but the one cut at the end
        assert read != documents[url][:len(read)]  # shuffled
        assert {tokenizer.decode(list(d[:-1])) for d in read} <= set(texts)


def test_position_ids_restart_at_documents_and_rows(numbered_shards):
    directory, docs = numbered_shards
    starts = {int(d[0]) for d in docs}
    loader = TokenLoader(directory, seq_len=16, batch_size=4)
    for batch in take(loader, 40):
        ids, pos = batch["input_ids"].numpy(), batch["position_ids"].numpy()
        is_start = np.isin(ids, list(starts))
        is_start[:, 0] = True
        assert np.array_equal(pos == 0, is_start)
        # inside a document, tokens are consecutive numbers and positions count up by one
        assert np.all(ids[:, 1:][pos[:, 1:] > 0] == ids[:, :-1][pos[:, 1:] > 0] + 1)
        assert np.all(pos[:, 1:][pos[:, 1:] > 0] == pos[:, :-1][pos[:, 1:] > 0] + 1)


def test_unshuffled_single_lane_stream_is_the_documents_in_order(numbered_shards):
    """One lane, no shuffle: the shards in order, each cut into rows on its own (its last < seq_len tokens unread)."""
    directory, docs = numbered_shards
    loader = TokenLoader(directory, seq_len=10, batch_size=3, shuffle=False, lanes=1, epochs=1)
    batches = list(loader)
    rows = full_rows(batches)
    shards = [np.concatenate(docs[i:i + 7]) for i in range(0, len(docs), 7)]
    expected = [shard[i * 10:i * 10 + 11] for shard in shards for i in range((len(shard) - 1) // 10)]
    assert len(expected) - 3 < len(rows) <= len(expected)  # only the rows that fill no batch are dropped
    assert all(np.array_equal(got, want) for got, want in zip(rows, expected))
    assert loader.epoch == 1 and list(loader) == []


def test_shuffle_depends_on_seed_and_epoch_and_reads_every_token_once(numbered_shards):
    directory, docs = numbered_shards
    settings = dict(seq_len=1, batch_size=1, lanes=8)

    def epoch_inputs(seed, epochs=1):
        loader = TokenLoader(directory, seed=seed, epochs=epochs, **settings)
        inputs = np.concatenate(rows_of(list(loader)))
        return np.split(inputs, epochs)

    first, second = epoch_inputs(0, epochs=2)
    assert not np.array_equal(first, second)
    assert not np.array_equal(first, epoch_inputs(1)[0])
    total = sum(len(d) for d in docs)
    for inputs in (first, second):  # every token an input once, but each shard's last
        assert len(np.unique(inputs)) == len(inputs) == total - 13
        assert set(inputs) <= set(range(1, total + 1))


@pytest.mark.parametrize("workers_before,workers_after,stop", [(0, 2, 5), (2, 1, 17), (1, 0, 31), (2, 2, 44)])
def test_resume_continues_exactly_with_any_number_of_workers(numbered_shards, workers_before, workers_after, stop):
    directory, _ = numbered_shards
    settings = dict(seq_len=8, batch_size=3, rank=1, world_size=2, seed=7)
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
    with pytest.raises(ValueError, match="'seq_len' is 8"):
        TokenLoader(directory, seq_len=16, batch_size=2, seed=1).load_state_dict(state)
    with pytest.raises(ValueError, match="'lanes' is 64"):
        TokenLoader(directory, seq_len=8, batch_size=2, seed=1, lanes=32).load_state_dict(state)
    TokenLoader(directory, seq_len=8, batch_size=5, seed=1).load_state_dict(state)  # another batch size resumes
    written_before = {"epoch": 0, "shard": 3, "doc": 1, "token": 0, "seed": 1, "shuffle": True}  # data order 1
    with pytest.raises(ValueError, match="written before the replicas read their own shares"):
        TokenLoader(directory, seq_len=8, batch_size=2, seed=1).load_state_dict(written_before)


def test_replicas_take_their_rows_of_each_round(numbered_shards):
    """Replica r of R takes the rows ≡ r (mod R) of each round of R × batch_size rows: a global step's rows do not
    depend on R. 14: more replicas than the 13 shards."""
    directory, _ = numbered_shards
    settings = dict(seq_len=8, batch_size=2, seed=2, lanes=16)
    alone = full_rows(take(TokenLoader(directory, **settings), 6 * 14))
    for replicas in (2, 3, 14):
        for rank in range(replicas):
            mine = full_rows(take(TokenLoader(directory, rank=rank, world_size=replicas, num_workers=rank % 2,
                                              **settings), 6))
            for k, row in enumerate(mine):
                assert np.array_equal(row, alone[k // 2 * 2 * replicas + rank + k % 2 * replicas]), (rank, k)


def test_workers_build_their_lanes_rows_of_every_batch_even_with_fewer_rows_than_workers(numbered_shards):
    directory, _ = numbered_shards
    for batch_size in (1, 5):
        settings = dict(seq_len=8, batch_size=batch_size, seed=5, lanes=6, rank=1, world_size=2)
        alone = take(TokenLoader(directory, **settings), 7)
        for got, want in zip(take(TokenLoader(directory, num_workers=2, **settings), 7), alone, strict=True):
            assert all(torch.equal(got[key], want[key]) for key in want)


def test_a_replica_reads_only_the_shards_of_its_lanes(numbered_shards, tmp_path, monkeypatch):
    """4 replicas and 16 lanes: each replica reads the shards of 4 lanes, which its planned_shards names before any
    read; with 2 workers, each worker those of 2."""
    directory, _ = numbered_shards
    monkeypatch.setenv("PRETRAIN_SHARD_READ_LOG", str(tmp_path))
    settings = dict(seq_len=8, batch_size=2, seed=4, lanes=16, world_size=4, epochs=1)
    planned = []
    for rank in range(4):
        monkeypatch.setenv("RANK", str(rank))
        loader = TokenLoader(directory, rank=rank, num_workers=2, **settings)
        planned.append(loader.planned_shards(1000))
        workers = [loader.planned_shards(1000, worker=w, num_workers=2) for w in range(2)]
        assert workers[0] | workers[1] == planned[-1] and len(workers[0] & workers[1]) <= 2
        list(loader)
        read = {line for path in tmp_path.glob(f"shard_reads.rank{rank}.*") for line in path.read_text().split()}
        assert read == planned[-1], rank
    assert sum(map(len, planned)) <= 13 + 16  # about a quarter each: a lane's boundary shards are shared


def test_a_resume_reads_only_the_shards_of_its_first_batch(numbered_shards, tmp_path, monkeypatch):
    """No replay: resumed epochs in, the first batch reads its own shards and no others."""
    directory, _ = numbered_shards
    settings = dict(seq_len=8, seed=4, lanes=8)
    far = TokenLoader(directory, batch_size=600, **settings)  # a state saved epochs in (the batch size may change)
    take(far, 3)
    assert far.epoch >= 5
    resumed = TokenLoader(directory, batch_size=2, **settings)
    resumed.load_state_dict(far.state_dict())
    planned = resumed.planned_shards(1)
    monkeypatch.setenv("PRETRAIN_SHARD_READ_LOG", str(tmp_path))
    take(resumed, 1)
    assert {line for path in tmp_path.glob("shard_reads.*") for line in path.read_text().split()} == planned
    assert len(planned) <= 2


@pytest.mark.parametrize("before,after,stop", [(2, 1, 7), (1, 3, 12), (4, 2, 5)])
def test_resume_on_another_number_of_replicas_continues_the_stream(numbered_shards, before, after, stop):
    """Stopped after ``stop`` rounds of ``before`` replicas, resumed on ``after``: the rounds go on from the row
    where they stopped, with the rows of an uninterrupted single replica."""
    directory, _ = numbered_shards
    settings = dict(seq_len=8, batch_size=2, seed=2)
    alone = full_rows(take(TokenLoader(directory, **settings), stop * before + 4 * after))
    states = []
    for rank in range(before):
        loader = TokenLoader(directory, rank=rank, world_size=before, **settings)
        take(loader, stop)
        states.append(loader.state_dict())
    assert all(state == states[0] for state in states)  # at a round's end every replica holds the same state
    start = stop * before * 2
    for rank in range(after):
        resumed = TokenLoader(directory, rank=rank, world_size=after, num_workers=1, **settings)
        resumed.load_state_dict(states[0])
        for k, row in enumerate(full_rows(take(resumed, 4))):
            assert np.array_equal(row, alone[start + k // 2 * 2 * after + rank + k % 2 * after]), (rank, k)


@pytest.mark.parametrize("key,value", [("seq_len", 0), ("batch_size", -1), ("rank", 2), ("epochs", 0)])
def test_bad_arguments_name_the_key(numbered_shards, key, value):
    directory, _ = numbered_shards
    args = dict(seq_len=8, batch_size=2, world_size=2) | {key: value}
    with pytest.raises(ValueError, match=key):
        TokenLoader(directory, **args)


def test_resume_of_a_finite_stream_ends_where_the_uninterrupted_one_does(numbered_shards):
    directory, _ = numbered_shards
    settings = dict(seq_len=16, batch_size=2, epochs=2)
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
