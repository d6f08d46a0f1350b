"""tools/eval_recall.py's reading of the trained gates: each decaying layer's mean log-decay per token, by name,
equal to what its gate gives; no reading where no state decays."""
import math
from pathlib import Path

import torch
import torch.nn.functional as F

from pretrain.tasks import build_model
from pretrain.tasks.config_checks import load_run_config

REPO = Path(__file__).resolve().parents[2]
TINY = ["model.dim=16", "recall.vocab_size=64", "train.seq_len=32", "train.micro_batch_size=4",
        "recall.mixture=[{seq_len: 32, num_pairs: 4}]"]


def tiny_recall_model(config: str):
    cfg = load_run_config(REPO / "configs" / "recall_zoology" / f"{config}.yaml", TINY)
    torch.manual_seed(0)
    return build_model(cfg).eval(), cfg


def test_each_gated_layer_reads_the_decay_its_gate_gives(load_tool):
    eval_recall = load_tool("eval_recall")
    model, cfg = tiny_recall_model("gdn_hybrid")
    expected = {}
    with torch.no_grad():
        for index, layer in enumerate(model.layers[:3]):  # the softmax layer, the fourth, has no state to decay
            gate = layer.mixer
            gate.decay_proj.weight.zero_()  # a constant gate: g = −exp(A_log)·softplus(dt_bias) at every token
            gate.A_log.fill_(math.log(index + 1.0))
            gate.dt_bias.fill_(-2.0 - index)
            expected[f"layers.{index}.mixer"] = -(index + 1.0) * F.softplus(torch.tensor(-2.0 - index)).item()
    result = eval_recall.score(model, cfg, seq_len=32, num_pairs=4, rows=8, batch_size=4, seed=0)
    assert result["log_decay"].keys() == expected.keys()
    for name, value in expected.items():
        assert math.isclose(result["log_decay"][name], value, rel_tol=1e-6), (name, result["log_decay"][name], value)


def test_no_reading_where_no_state_decays(load_tool):
    model, cfg = tiny_recall_model("linear_short_conv")
    result = load_tool("eval_recall").score(model, cfg, seq_len=32, num_pairs=4, rows=8, batch_size=4, seed=0)
    assert "accuracy" in result and "log_decay" not in result
