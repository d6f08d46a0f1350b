"""Export (tools/export.py → pretrain.models.load_pretrained) and train.init_from (issue 18, items 1 and 2), on real
DeepSpeed runs: one short 2-rank run per ZeRO stage, shared by the tests of this module."""
import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from pretrain.models import load_pretrained
from pretrain.train import checkpoint

from launching import PYTHON, REPO, launch, read_metrics, tiny_overrides

pytestmark = pytest.mark.dist
STEPS = 4
TAG = checkpoint.tag_for(STEPS)


def tool(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([PYTHON, *argv], cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True,
                          text=True, timeout=300)


@pytest.fixture(scope="module")
def run(lm_data, tmp_path_factory):
    """``run(stage)``: a finished 2-rank run under that ZeRO stage (launched once), validated and saved at STEPS."""
    root, done = tmp_path_factory.mktemp("export_runs"), {}

    def get(stage: int) -> Path:
        if stage not in done:
            launch(tiny_overrides(lm_data, root / f"zero{stage}", deepspeed__zero_stage=stage, train__max_steps=STEPS,
                                  schedule__warmup_steps=2, checkpoint__every=STEPS, log__val_every=STEPS), ranks=2)
            done[stage] = root / f"zero{stage}"
        return done[stage]

    return get


@pytest.fixture(scope="module")
def exported(run, tmp_path_factory):
    """``exported(stage, dtype)``: the directory tools/export.py wrote from that stage's run (exported once)."""
    root, done = tmp_path_factory.mktemp("exports"), {}

    def get(stage: int, dtype: str = "fp32") -> Path:
        if (stage, dtype) not in done:
            out = root / f"zero{stage}_{dtype}"
            result = tool("tools/export.py", "--run", str(run(stage)), "--out", str(out), "--dtype", dtype)
            assert result.returncode == 0, result.stderr[-3000:]
            assert result.stdout.strip() == f"exported {run(stage) / 'checkpoints' / TAG} to {out} ({dtype})"
            done[stage, dtype] = out
        return done[stage, dtype]

    return get


def deepspeed_fp32_weights(run_dir: Path, stage: int, tmp_path: Path) -> dict[str, torch.Tensor]:
    """The checkpoint's fp32 weights as DeepSpeed itself writes them out: the module states without ZeRO, else
    ``convert_zero_checkpoint_to_fp32_state_dict``'s pytorch_model.bin (one file: no huggingface_hub here)."""
    ckpt = run_dir / "checkpoints"
    if stage == 0:
        return torch.load(ckpt / TAG / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)["module"]
    from deepspeed.utils.zero_to_fp32 import convert_zero_checkpoint_to_fp32_state_dict

    convert_zero_checkpoint_to_fp32_state_dict(str(ckpt), str(tmp_path), tag=TAG, max_shard_size=None)
    return torch.load(tmp_path / "pytorch_model.bin", map_location="cpu", weights_only=True)


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_exported_weights_equal_the_checkpoints_fp32_weights(run, exported, lm_data, stage, tmp_path):
    reference = deepspeed_fp32_weights(run(stage), stage, tmp_path)
    stored = load_file(exported(stage) / "model.safetensors")
    # the tied LM head is stored once, under one of its two names
    assert set(reference) - set(stored) in ({"lm_head.weight"}, {"embed.weight"}) and set(stored) <= set(reference)
    for name, tensor in stored.items():
        assert tensor.dtype == torch.float32 and torch.equal(tensor, reference[name]), name
    loaded = load_pretrained(exported(stage)).state_dict()
    assert set(loaded) == set(reference)
    for name, tensor in loaded.items():
        assert torch.equal(tensor, reference[name]), name
    saved = json.loads((exported(stage) / "config.json").read_text())
    assert saved["model"]["dim"] == 64 and saved["deepspeed"]["zero_stage"] == stage
    assert saved["data"]["tokenizer"] == "tokenizer.model"
    assert (exported(stage) / "tokenizer.model").read_bytes() == Path(lm_data["tokenizer"]).read_bytes()


def test_bf16_export_holds_the_rounded_weights_and_loads_in_fp32(exported):
    fp32, bf16 = load_file(exported(0) / "model.safetensors"), load_file(exported(0, "bf16") / "model.safetensors")
    assert set(bf16) == set(fp32) and {t.dtype for t in bf16.values()} == {torch.bfloat16}
    for name, tensor in bf16.items():
        assert torch.equal(tensor, fp32[name].bfloat16()), name
    model = load_pretrained(exported(0, "bf16"))
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert torch.equal(model.embed.weight, fp32["embed.weight"].bfloat16().float())


def test_loaded_model_gives_the_trainers_logits_and_validation_loss(run, exported, lm_data):
    """The exported ZeRO-3 model: logits equal to the run's checkpoint model's, bit for bit, and eval_ppl on the
    exported directory scores the validation shards as the trainer's validation did at that step."""
    model, _, _ = checkpoint.load_trained_model(run(3))
    ids = torch.randint(0, 320, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(load_pretrained(exported(3))(ids), model(ids))
    result = tool("tools/eval_ppl.py", "--run", str(exported(3)), "--data", lm_data["val_shards"], "--json")
    assert result.returncode == 0, result.stderr[-3000:]
    scores = json.loads(result.stdout.strip().splitlines()[-1])
    logged = read_metrics(run(3))[STEPS]
    assert scores["checkpoint"] == str(exported(3)) and scores["tokens"] == logged["val/tokens"]
    assert scores["nll"] == pytest.approx(logged["val/loss"], rel=1e-5)


def test_generate_from_the_exported_directory_equals_generate_from_the_run(run, exported):
    texts = []
    for source in (run(0), exported(0)):
        result = tool("tools/generate.py", "--run", str(source), "--prompt", "the cat", "--max-new-tokens", "8",
                      "--temperature", "0")
        assert result.returncode == 0, result.stderr[-3000:]
        texts.append(result.stdout)
    assert texts[0] == texts[1] and texts[0].startswith("the cat")


def test_the_exported_directory_is_a_transformers_model(run, exported):
    """What tools/export.py writes loads through transformers' Auto classes (pretrain.hf, issue 27): the model's
    logits are load_pretrained's, and the tokenizer's ids the run's."""
    transformers = pytest.importorskip("transformers", reason="the hf extra is not installed: pip install -e '.[hf]'")
    from pretrain.data import Tokenizer

    model = transformers.AutoModelForCausalLM.from_pretrained(exported(0))
    ids = torch.randint(0, 320, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, load_pretrained(exported(0))(ids))
    tokenizer = transformers.AutoTokenizer.from_pretrained(exported(0))
    assert tokenizer("the cat sat").input_ids == Tokenizer(str(exported(0) / "tokenizer.model")).encode("the cat sat")


def test_a_bad_or_missing_directory_is_one_line_naming_the_file(exported, tmp_path):
    missing = tmp_path / "absent"
    with pytest.raises(FileNotFoundError, match=f"{missing}: no such directory"):
        load_pretrained(missing)
    no_weights, no_config, truncated = tmp_path / "no_weights", tmp_path / "no_config", tmp_path / "truncated"
    for path in (no_weights, no_config, truncated):
        path.mkdir()
    (no_weights / "config.json").write_bytes((exported(0) / "config.json").read_bytes())
    (no_config / "model.safetensors").write_bytes((exported(0) / "model.safetensors").read_bytes())
    for name in ("config.json", "tokenizer.model"):
        (truncated / name).write_bytes((exported(0) / name).read_bytes())
    (truncated / "model.safetensors").write_bytes((exported(0) / "model.safetensors").read_bytes()[:5000])
    with pytest.raises(FileNotFoundError, match=f"{no_weights / 'model.safetensors'} is missing"):
        load_pretrained(no_weights)
    with pytest.raises(FileNotFoundError, match=f"{no_config / 'config.json'} is missing"):
        load_pretrained(no_config)
    with pytest.raises(ValueError, match=f"{truncated / 'model.safetensors'} does not hold the model"):
        load_pretrained(truncated)
    (truncated / "model.safetensors").write_bytes((exported(0) / "model.safetensors").read_bytes())
    config = json.loads((exported(0) / "config.json").read_text())
    (truncated / "config.json").write_text(json.dumps({**config, "model": {**config["model"], "dim": 96}}))
    with pytest.raises(ValueError, match=r"does not hold the model .* size mismatch"):  # weights of another shape
        load_pretrained(truncated)
    (truncated / "config.json").write_text(json.dumps({**config, "model": {**config["model"], "depth": 2}}))
    with pytest.raises(ValueError, match=r"config.json: model.depth is not a key of this version's ModelConfig"):
        load_pretrained(truncated)
    (truncated / "model.safetensors").write_bytes((exported(0) / "model.safetensors").read_bytes()[:5000])
    (truncated / "config.json").write_bytes((exported(0) / "config.json").read_bytes())
    for path, named in ((missing, missing / "config.yaml"), (no_config, no_config / "config.json"),
                        (truncated, truncated / "model.safetensors")):
        result = tool("tools/eval_ppl.py", "--run", str(path), "--data", "unused.txt")
        assert result.returncode == 1 and len(result.stderr.strip().splitlines()) == 1, result.stderr
        assert str(named) in result.stderr, result.stderr


def init_overrides(lm_data, run_dir, source, **extra):
    """A new run from ``source``'s weights that changes seq_len, seed and schedule; lr 1e-12 makes its first
    update smaller than every weight's fp32 spacing but the tiniest, so its step-1 checkpoint shows its start."""
    values = dict(train__init_from=source, train__max_steps=1, train__seq_len=32, run__seed=7, optim__lr=1e-12,
                  optim__min_lr=0.0, schedule__warmup_steps=0, checkpoint__every=1, log__val_every=100)
    return tiny_overrides(lm_data, run_dir, **{**values, **extra})


def test_init_from_starts_from_the_source_weights_and_a_relaunch_resumes(exported, lm_data, tmp_path):
    """Initialised from an exported directory under ZeRO-3 on 2 ranks; then the source is gone, and a relaunch
    resumes from the run's own checkpoint without reading it."""
    source = tmp_path / "source"
    source.mkdir()
    for name in ("model.safetensors", "config.json", "tokenizer.model"):
        (source / name).write_bytes((exported(0) / name).read_bytes())
    run_dir = tmp_path / "init"
    first = launch(init_overrides(lm_data, run_dir, source, deepspeed__zero_stage=3), ranks=2)
    assert f"initialised the weights from {source} (train.init_from" in first.stdout, first.stdout[-3000:]
    start = checkpoint.load_model_weights(run_dir / "checkpoints", checkpoint.tag_for(1), zero_stage=3)
    expected = load_pretrained(source).state_dict()
    assert set(start) == set(expected)
    for name, tensor in start.items():
        assert torch.allclose(tensor, expected[name], rtol=0, atol=1e-10), name

    for path in source.iterdir():
        path.unlink()
    source.rmdir()
    again = launch(init_overrides(lm_data, run_dir, source, deepspeed__zero_stage=3, train__max_steps=2), ranks=2)
    assert f"resumed from {run_dir / 'checkpoints' / checkpoint.tag_for(1)}" in again.stdout, again.stdout[-3000:]
    assert f"train.init_from {source} is not applied" in again.stdout
    assert checkpoint.latest_tag(run_dir / "checkpoints") == checkpoint.tag_for(2)


def test_init_from_another_architecture_is_refused_naming_the_parameter_and_both_shapes(run, lm_data, tmp_path):
    result = launch(init_overrides(lm_data, tmp_path / "wider", run(0), model__dim=96), check=False)
    assert result.returncode == 2, result.stderr[-3000:]
    message = result.stderr.strip().splitlines()[-1]
    assert message.startswith("config error: train.init_from: parameter embed.weight has shape [320, 64] in "
                              f"{run(0) / 'checkpoints' / TAG} but shape [320, 96] in this run's model"), message
    assert not (tmp_path / "wider" / "checkpoints" / "latest").exists()


def test_init_from_a_deeper_model_names_the_parameter_the_source_lacks(run, lm_data, tmp_path):
    result = launch(init_overrides(lm_data, tmp_path / "deeper", run(0), model__n_layers=3), check=False)
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.strip().splitlines()[-1].startswith(
        f"config error: train.init_from: parameter layers.2.mixer_norm.weight is absent in "
        f"{run(0) / 'checkpoints' / TAG} but has shape [64] in this run's model"), result.stderr[-3000:]


def test_init_from_a_missing_directory_is_one_line_naming_it(lm_data, tmp_path):
    result = launch(init_overrides(lm_data, tmp_path / "run", tmp_path / "absent"), check=False)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == (
        f"config error: train.init_from: cannot load {tmp_path / 'absent'}: {tmp_path / 'absent'} is neither a run "
        f"directory (no {tmp_path / 'absent' / 'config.yaml'}) nor an exported model (no "
        f"{tmp_path / 'absent' / 'model.safetensors'})")
