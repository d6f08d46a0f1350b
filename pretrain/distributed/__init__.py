"""DeepSpeed set-up applied from outside the model: process group, sequence-parallel groups, engine (ZeRO,
precision), activation checkpointing."""
from .activation_checkpointing import apply_activation_checkpointing
from .engine import build_engine, deepspeed_config
from .process_group import World, close_process_group, init_process_group
from .sequence_parallel import apply_sequence_parallel, split_sequences
