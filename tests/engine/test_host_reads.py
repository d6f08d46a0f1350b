"""No layer reads a tensor's values on the host during a training step on our Triton paths.

On a GPU each such read (``.tolist()``, ``.item()``, ``bool``/``int`` of a tensor) waits for the stream, so the host
cannot run ahead of the device: one per layer made the H200's eager step host-bound (benchmarks/gpu_h200_round4.md).
Reads a step makes once (the offsets, first-use checks) are allowed; reads that grow with the number of layers are
not. The kernels run under Triton's interpreter; activation checkpointing (DeepSpeed's, as the trainer applies it)
hands each block detached copies of its inputs in backward, which is where per-object memos failed.
"""
import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from pretrain.config import ModelConfig
from pretrain.distributed import apply_activation_checkpointing
from pretrain.tasks import build_lm

VOCAB = 50
READS = ("tolist", "item", "__bool__", "__int__", "__float__", "__index__")


def host_reads_of_a_step(mixer: str, layers: int, monkeypatch) -> int:
    cfg = ModelConfig(vocab_size=VOCAB, dim=32, n_heads=2, n_layers=layers, mixer=mixer, multiple_of=16,
                      mixer_options={mixer: {"impl": "triton", "chunk_size": 16}})
    torch.manual_seed(0)
    model = build_lm(cfg)
    apply_activation_checkpointing(model)
    ids = torch.randint(0, VOCAB, (1, 41))  # inputs and labels: 40 tokens each
    positions = torch.cat([torch.arange(n) for n in (7, 1, 32)])[None]  # three packed documents, 40 tokens
    count = [0]
    for name in READS:
        original = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda self, *a, _f=original, **k: count.__setitem__(0, count[0] + 1)
                            or _f(self, *a, **k))
    logits = model(ids[:, :-1], position_ids=positions)
    F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten()).backward()
    monkeypatch.undo()
    return count[0]


@pytest.mark.parametrize("mixer", ["linear", "retnet", "gated_deltanet"])
def test_no_layer_reads_the_host(mixer, monkeypatch):
    host_reads_of_a_step(mixer, 1, monkeypatch)  # first-use checks and the like, once per process
    assert host_reads_of_a_step(mixer, 2, monkeypatch) == host_reads_of_a_step(mixer, 1, monkeypatch)
