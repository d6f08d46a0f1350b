"""The training side: the loop, checkpoints, metrics, LR schedules, and the shared scoring of documents."""
from .loop import NonFiniteLossError, train
