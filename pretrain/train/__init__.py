"""The training side: the loop, checkpoints, metrics, LR schedules, and the shared scoring of documents."""
from .checkpoint import CheckpointError
from .loop import NonFiniteLossError, RankLostError, train
