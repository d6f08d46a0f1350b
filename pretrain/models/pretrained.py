"""An exported model directory (written by ``tools/export.py``) → the model, with no DeepSpeed and no run directory.

    DIR/model.safetensors   the weights, fp32 or bf16 (a tied LM head is stored once, as safetensors' save_model does)
    DIR/config.json         the run's resolved config; its ``task``, ``model`` and ``vision`` sections build the model
    DIR/tokenizer.model     the run's sentencepiece model (tasks that have one)

Plain JSON and dataclasses, so loading needs neither OmegaConf nor the training stack.
"""
import json
import os
from dataclasses import fields
from pathlib import Path

from torch import nn

from ..config import ModelConfig, VisionConfig
from ..data.tokenizer import EOS_ID, PAD_ID
from .lm import build_lm
from .vision import build_vision_model

WEIGHTS, CONFIG, TOKENIZER = "model.safetensors", "config.json", "tokenizer.model"

# What also makes the directory a transformers model (``pretrain.hf``): config.json's model type, and a module
# transformers imports with trust_remote_code=True when ``pretrain`` was not imported first (``lm_eval`` on the
# command line): it only imports the installed package's classes.
TRANSFORMERS_MODULE = "pretrain_hf.py"
TRANSFORMERS_MODULE_SOURCE = (
    '"""This directory\'s transformers classes, from the installed pretrain package (its hf extra)."""\n'
    "from pretrain.hf import PretrainConfig, PretrainForCausalLM, PretrainTokenizer\n"
)
TRANSFORMERS_KEYS = {
    "model_type": "pretrain",
    # what transformers' generation config reads: generate stops at eos as tools/generate.py does, pads finished
    # rows with pad, and a text begins after eos as a packed document does (pretrain.data.tokenizer's fixed ids)
    "bos_token_id": EOS_ID, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID,
    "architectures": ["PretrainForCausalLM"],
    "auto_map": {"AutoConfig": "pretrain_hf.PretrainConfig", "AutoModelForCausalLM": "pretrain_hf.PretrainForCausalLM",
                 "AutoTokenizer": ["pretrain_hf.PretrainTokenizer", None]},
}


def is_export(path: str | os.PathLike) -> bool:
    """Whether ``path`` looks like an exported model directory (rather than a run directory)."""
    return (Path(path) / WEIGHTS).is_file() or (Path(path) / CONFIG).is_file()


def read_export_config(path: str | os.PathLike) -> dict:
    """``DIR/config.json`` as a dict; a missing directory or file, or one that is not JSON, is an error naming it."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"{path}: no such directory (an exported model directory holds {WEIGHTS} and "
                                f"{CONFIG}; tools/export.py writes one)")
    file = path / CONFIG
    if not file.is_file():
        raise FileNotFoundError(f"{file} is missing: {path} is not an exported model directory (tools/export.py "
                                "writes one)")
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{file}: not valid JSON ({err}); export the run again") from None
    if not isinstance(config, dict):
        raise ValueError(f"{file}: not a JSON object of config sections; export the run again")
    return config


def _section(cls, config: dict, name: str, file: Path):
    """``config[name]`` as the dataclass ``cls``, refusing a key it does not have (a config of another version)."""
    values = config.get(name)
    if not isinstance(values, dict):
        raise ValueError(f"{file}: has no {name!r} section; export the run again")
    unknown = sorted(set(values) - {f.name for f in fields(cls)})
    if unknown:
        raise ValueError(f"{file}: {name}.{unknown[0]} is not a key of this version's {cls.__name__}; export the run "
                         "with this version")
    return cls(**values)


def causal_lm_config(config: dict, file: str | os.PathLike = CONFIG) -> ModelConfig:
    """The ``ModelConfig`` of the causal LM an exported ``config.json`` (``config``) describes; vision is refused."""
    if config.get("task") == "vision":
        raise ValueError(f"{file}: a vision model (task: vision) is not a causal LM")
    return _section(ModelConfig, config, "model", Path(file))


def _build_model(config: dict, file: Path) -> nn.Module:
    """The model ``config`` (an exported ``config.json``) describes, with freshly initialised weights."""
    model = _section(ModelConfig, config, "model", file)
    if config.get("task") == "vision":
        return build_vision_model(_section(VisionConfig, config, "vision", file), model)
    return build_lm(model)  # task lm and task recall: a causal LM


def load_pretrained(path: str | os.PathLike) -> nn.Module:
    """The model of an exported directory with its weights: fp32 on CPU, in eval mode."""
    from safetensors import SafetensorError
    from safetensors.torch import load_model

    path = Path(path)
    config = read_export_config(path)
    model = _build_model(config, path / CONFIG)
    weights = path / WEIGHTS
    if not weights.is_file():
        raise FileNotFoundError(f"{weights} is missing: export the run again (tools/export.py --run RUN --out {path})")
    try:
        load_model(model, weights, strict=True)
    except (SafetensorError, RuntimeError) as err:  # a truncated file; names or shapes other than config.json's
        lines = [line.strip() for line in str(err).splitlines() if line.strip()] or [type(err).__name__]
        cause = lines[1] if len(lines) > 1 and lines[0].endswith(":") else lines[0]  # past torch's header line
        raise ValueError(f"{weights} does not hold the model {path / CONFIG} describes: {cause}") from None
    return model.eval()
