"""Shards over http(s)://, through webdataset's gopen, from a real HTTP server on 127.0.0.1 that the test starts."""
import functools
import threading
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from pretrain.data import ShardError, TokenLoader, read_documents


class _QuietHandler(SimpleHTTPRequestHandler):
    def log_message(self, *args):  # keep the test output to the test's own
        pass


@pytest.fixture
def served(numbered_shards):
    """(the shards' local directory, its http:// URL, documents), served for the test's duration."""
    directory, docs = numbered_shards
    root = Path(directory).parent
    server = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_QuietHandler, directory=str(root)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield directory, f"http://127.0.0.1:{server.server_address[1]}/{Path(directory).name}", docs
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


SHARDS = "shard-{000000..000012}.tar"  # the 13 shards of numbered_shards


def test_remote_shards_give_the_local_documents_and_batches(served):
    directory, url, docs = served
    remote = list(read_documents(f"{url}/{SHARDS}"))
    assert [d.tokens.tolist() for d in remote] == [d.tolist() for d in docs]
    assert remote[0].key.startswith(f"{url}/shard-000000.tar#")
    settings = dict(seq_len=16, batch_size=2, rank=1, world_size=2, seed=3)
    local = TokenLoader(f"{directory}/{SHARDS}", **settings)
    streamed = TokenLoader(f"{url}/{SHARDS}", num_workers=1, **settings)
    for mine, theirs, _ in zip(local, streamed, range(12)):
        assert all((mine[k] == theirs[k]).all() for k in mine)
    unknown = {"shards_sha256": None}  # streamed shards have no manifest sha256 on record
    assert streamed.state_dict() == {**local.state_dict(), **unknown}
    streamed.load_state_dict(local.state_dict())  # the same shards, streamed: the position carries over


def test_a_missing_remote_shard_is_an_error_naming_its_url(served):
    _, url, _ = served
    with pytest.raises(ShardError, match=rf"cannot fetch shard {url}/shard-000013\.tar: .*404"):
        list(read_documents(f"{url}/shard-{{000011..000013}}.tar"))


def test_a_truncated_remote_shard_is_an_error_naming_its_url(served):
    directory, url, _ = served
    whole = Path(directory, "shard-000003.tar").read_bytes()
    Path(directory, "cut.tar").write_bytes(whole[:len(whole) // 2 + 100])
    with pytest.raises(ShardError, match=rf"shard {url}/cut\.tar is truncated"):
        list(read_documents(f"{url}/cut.tar"))
