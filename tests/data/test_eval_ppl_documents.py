"""eval_ppl cuts a text file into the documents make_shards writes for it (issue 18, item 11): scoring a .txt and
scoring the shards made from it see the same documents, tokens and bytes, so their perplexities agree."""
import numpy as np
import pytest

from pretrain.data import make_text_shards


@pytest.fixture(scope="module")
def eval_ppl(load_tool):
    return load_tool("eval_ppl")


@pytest.mark.parametrize("txt_docs", ["paragraphs", "file"])
def test_a_txt_file_and_its_shards_give_eval_ppl_the_same_documents(corpus, tokenizer, tmp_path, txt_docs, eval_ppl):
    txt, documents = corpus[0][0], corpus[1][:150]  # a.txt: 150 documents, one paragraph each
    make_text_shards([txt], tokenizer.path, str(tmp_path / "shards"), docs_per_shard=40, txt_docs=txt_docs)
    from_text = list(eval_ppl.documents([txt], tokenizer, allow_pipe=False, txt_docs=txt_docs))
    from_shards = list(eval_ppl.documents([str(tmp_path / "shards")], tokenizer, allow_pipe=False))
    assert len(from_text) == len(from_shards) == (len(documents) if txt_docs == "paragraphs" else 1)
    if txt_docs == "paragraphs":
        assert [num_bytes for _, num_bytes, _ in from_text] == [len(doc.encode("utf-8")) for doc in documents]
    for (tokens, num_bytes, words), (shard_tokens, shard_bytes, shard_words) in zip(from_text, from_shards):
        assert np.array_equal(tokens, shard_tokens)
        assert (num_bytes, words) == (shard_bytes, shard_words)


@pytest.fixture(scope="module")
def other_tokenizer(corpus, tmp_path_factory):
    from pretrain.data import train_tokenizer

    return train_tokenizer(corpus[0], 350, str(tmp_path_factory.mktemp("other_tok") / "tok"))


@pytest.mark.parametrize("streamed", [False, True])
def test_eval_ppl_refuses_shards_of_another_tokenizer_naming_the_shard_and_both_hashes(
        corpus, tokenizer, other_tokenizer, tmp_path, eval_ppl, streamed):
    """As training refuses them: the ids of another vocabulary scored by the run's model would end in an IndexError
    (ids past the embedding) or, worse, in a perplexity of the wrong text. Local shards are checked by their
    manifest before any is read, streamed ones (``pipe:``) by their first sample."""
    from pretrain.data.shards import ShardError

    make_text_shards([corpus[0][1]], other_tokenizer.path, str(tmp_path / "shards"), docs_per_shard=40)
    shard = tmp_path / "shards" / "shard-000000.tar"
    data = f"pipe:cat {shard}" if streamed else str(tmp_path / "shards")
    with pytest.raises(ShardError) as refused:
        list(eval_ppl.documents([data], tokenizer, allow_pipe=True))
    said = str(refused.value)
    assert said.startswith(f"shard {data if streamed else shard} was written with tokenizer sha256 "
                           f"{other_tokenizer.sha256}"), said
    assert said.endswith(f"but this run's tokenizer is {tokenizer.sha256}") and "\n" not in said, said
    assert len(list(eval_ppl.documents([data], other_tokenizer, allow_pipe=True))) == (40 if streamed else 150)
