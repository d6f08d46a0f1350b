"""A checkpoint of a run → a self-contained model directory that ``pretrain.models.load_pretrained`` reads.

The weights are the checkpoint's fp32 ones (DeepSpeed's ``zero_to_fp32`` reassembles them from any ZeRO stage,
``checkpoint.load_model_weights``), saved with safetensors' ``save_model``, which stores a tied LM head once
(``save_file``, and so DeepSpeed's own ``convert_zero_checkpoint_to_fp32_state_dict(safe_serialization=True)``,
refuse tensors that share memory). Beside them: the run's resolved config as JSON and a copy of its tokenizer.
"""
import json
import shutil
from pathlib import Path

import torch
from omegaconf import OmegaConf

from ..atomic import atomic_path
from ..models.pretrained import CONFIG, TOKENIZER, WEIGHTS
from .checkpoint import load_trained_model
from .run_tokenizer import record_tokenizer

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def export_run(run: Path, out: Path, *, tag: str = "latest", dtype: str = "fp32") -> Path:
    """Write ``out/model.safetensors``, ``out/config.json`` and ``out/tokenizer.model`` (tasks with a tokenizer)
    from checkpoint ``tag`` of the run directory ``run``; return the checkpoint exported."""
    from safetensors.torch import save_model

    run, out = Path(run), Path(out)
    if dtype not in DTYPES:
        raise ValueError(f"--dtype {dtype}: expected one of {', '.join(DTYPES)}")
    if (out / "config.yaml").exists() or (out / "checkpoints").exists():
        raise ValueError(f"--out {out} is a run directory; export to a directory of its own")
    model, cfg, source = load_trained_model(run, tag)
    out.mkdir(parents=True, exist_ok=True)
    with atomic_path(out / WEIGHTS) as tmp:
        save_model(model.to(DTYPES[dtype]), str(tmp), metadata={"format": "pt", "source": str(source)})
    config = OmegaConf.to_container(cfg, resolve=True)
    if cfg.data.tokenizer:  # the copy beside the weights; load_trained_model points data.tokenizer at it
        with atomic_path(out / TOKENIZER) as tmp:
            shutil.copyfile(cfg.data.tokenizer, tmp)
        record_tokenizer(out, str(out / TOKENIZER))  # the copy, pinned as the run's was
        config["data"]["tokenizer"] = TOKENIZER
    with atomic_path(out / CONFIG) as tmp:
        tmp.write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    return source
