"""DeepSpeed set-up applied from outside the model: process group, engine (ZeRO, precision), checkpointing."""
from .activation_checkpointing import apply_activation_checkpointing
from .engine import build_engine, deepspeed_config
from .process_group import World, close_process_group, init_process_group
