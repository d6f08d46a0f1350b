"""Our config → DeepSpeed JSON, and the run directory's refusal of a relaunch that changes the run."""
import pytest
from omegaconf import OmegaConf

from pretrain.config import Config, ConfigError
from pretrain.distributed import deepspeed_config
from pretrain.train.run_dir import changed_keys, prepare_run_dir


def config(**dotted):
    cfg = OmegaConf.structured(Config)
    for key, value in dotted.items():
        OmegaConf.update(cfg, key.replace("__", "."), value)
    return cfg


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_deepspeed_json_follows_our_keys(stage, precision):
    cfg = config(deepspeed__zero_stage=stage, deepspeed__precision=precision, train__micro_batch_size=3,
                 train__grad_accum_steps=5, train__grad_clip=0.5)
    ds = deepspeed_config(cfg, world_size=4)
    assert ds["zero_optimization"]["stage"] == stage
    assert ds["bf16"]["enabled"] == (precision == "bf16") and ds["fp16"]["enabled"] == (precision == "fp16")
    sizes = ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"], ds["train_batch_size"]
    assert sizes == (3, 5, 60)
    assert ds["gradient_clipping"] == 0.5
    assert "offload_optimizer" not in ds["zero_optimization"] and "offload_param" not in ds["zero_optimization"]


def test_offload_and_extra_keys_merge_deeply():
    cfg = config(deepspeed__zero_stage=3, deepspeed__offload_optimizer=True, deepspeed__offload_params=True,
                 deepspeed__extra={"zero_optimization": {"stage3_prefetch_bucket_size": 7},
                                   "wall_clock_breakdown": True})
    zero = deepspeed_config(cfg, world_size=1)["zero_optimization"]
    assert zero["offload_optimizer"]["device"] == "cpu" and zero["offload_param"]["device"] == "cpu"
    assert zero["stage"] == 3 and zero["stage3_prefetch_bucket_size"] == 7
    assert deepspeed_config(cfg, world_size=1)["wall_clock_breakdown"] is True


def test_relaunch_may_change_only_the_keys_of_the_resuming_table():
    saved = config(train__max_steps=100)
    assert changed_keys(saved, config(train__max_steps=500, log__every=3, checkpoint__keep_last=9)) == []
    assert changed_keys(saved, config(train__grad_accum_steps=4, train__micro_batch_size=2, data__skip_corrupt=True,
                                      parallel__sequence_parallel=2, data__train_shards="/moved/shard-*.tar")) == []
    assert changed_keys(saved, config(train__max_steps=100, model__dim=512, optim__lr=1.0)) == ["model.dim", "optim.lr"]
    assert changed_keys(saved, config(train__max_steps=100, model__mixer_options={"linear": {"eps": 1.0}})) == [
        "model.mixer_options.linear.eps"]


def test_prepare_run_dir_refuses_to_change_a_run_with_checkpoints(tmp_path):
    def run(**dotted):
        return config(**{"run__dir": str(tmp_path / "run"), "data__tokenizer": "t.model",
                         "data__train_shards": "s.tar", **dotted})

    prepare_run_dir(run(), is_main=True)
    prepare_run_dir(run(train__seq_len=64), is_main=True)  # nothing saved to resume yet: the new config wins
    assert "seq_len: 64" in (tmp_path / "run" / "config.yaml").read_text()

    (tmp_path / "run" / "checkpoints").mkdir()
    (tmp_path / "run" / "checkpoints" / "latest").write_text("step00000010")
    prepare_run_dir(run(train__seq_len=64, train__max_steps=7), is_main=True)
    saved = (tmp_path / "run" / "config.yaml").read_text()
    assert "max_steps: 7" in saved
    with pytest.raises(ConfigError, match="data.tokenizer") as error:
        prepare_run_dir(run(train__seq_len=64, train__max_steps=7, data__tokenizer="other.model"), is_main=True)
    assert error.value.key == "data.tokenizer"
    assert (tmp_path / "run" / "config.yaml").read_text() == saved


def test_torch_extensions_are_built_per_virtual_environment_unless_the_user_says_where(tmp_path, monkeypatch):
    """Environments sharing ~/.cache/torch_extensions rebuilt DeepSpeed's comm op for each other."""
    import os
    import sys

    from pretrain.distributed.process_group import use_extensions_dir

    monkeypatch.setattr(sys, "prefix", str(tmp_path / "venv"))
    monkeypatch.setattr(sys, "base_prefix", "/usr")
    (tmp_path / "venv").mkdir()
    # a copy, as use_extensions_dir sets the variable itself: left set in os.environ, it sent every later test's
    # ranks to this empty folder, where the first built DeepSpeed's comm op again (a minute)
    monkeypatch.setattr(os, "environ", {k: v for k, v in os.environ.items() if k != "TORCH_EXTENSIONS_DIR"})
    assert use_extensions_dir() == str(tmp_path / "venv" / "torch_extensions")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "mine"))
    assert use_extensions_dir() == str(tmp_path / "mine")


def test_the_comm_op_built_by_one_way_of_starting_python_is_not_rebuilt_by_the_other(tmp_path, monkeypatch):
    """A venv activated (its bin/ first on PATH: pip's ninja 1.13) or not (the system's ninja 1.11) ran different
    ninjas, whose build logs differ, so each rebuilt DeepSpeed's comm op the other had built (85-110 s a time). What
    differs between the two ways is PATH alone: a stand-in op (one copy rule, as quick to build) is built by torch's
    own ninja call under one PATH and asked about under the other: nothing to rebuild, both orders; a changed source
    is a rebuild, said."""
    import os
    import sys

    from torch.utils.cpp_extension import _run_ninja_build  # how torch builds an extension: `ninja` found on PATH

    from pretrain.distributed.process_group import COMM_OP, comm_op_note, environment_ninja

    venv_bin = os.path.dirname(sys.executable)
    system_path = os.pathsep.join(p for p in os.environ["PATH"].split(os.pathsep) if p != venv_bin) or "/usr/bin:/bin"
    paths = {"plain": system_path, "activated": os.pathsep.join([venv_bin, system_path])}

    def build(way: str, directory) -> None:
        monkeypatch.setenv("PATH", paths[way])
        with environment_ninja():
            _run_ninja_build(str(directory), verbose=False, error_prefix="build failed")

    def note(way: str, extensions) -> str | None:
        monkeypatch.setenv("PATH", paths[way])
        return comm_op_note(str(extensions))

    for first, then in [("plain", "activated"), ("activated", "plain")]:
        directory = tmp_path / first / COMM_OP
        directory.mkdir(parents=True)
        (directory / "op.cpp").write_text("// the op\n")
        (directory / "build.ninja").write_text(f"rule copy\n  command = cp $in $out\nbuild {COMM_OP}.so: copy op.cpp\n")
        build(first, directory)
        assert (directory / f"{COMM_OP}.so").exists()
        assert note(then, directory.parent) is None, f"built {first}, rebuilt {then}"
        assert note(first, directory.parent) is None
        later = (directory / f"{COMM_OP}.so").stat().st_mtime + 10  # op.cpp + 10 s may not be (loaded)
        os.utime(directory / "op.cpp", (later, later))
        assert "DeepSpeed rebuilds its CPU comm op" in note(then, directory.parent)
