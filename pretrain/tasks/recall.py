"""The associative-recall task: a causal LM trained and scored on MQAR rows (``pretrain.data.mqar``).

Its own task rather than a data source of ``task: lm`` because nothing of the LM's data side applies (no tokenizer,
shards, documents or perplexity) while everything else is the LM's: the model, the fused loss (``batch_nll``, which
scores only the answers since every other label is −100), the launcher, engine, checkpoints and tensorboard.
Validation reports what the task is for, ``val/recall_accuracy``: the share of answers the model's argmax gets
right, on a fixed set of rows no training batch draws (the ``val`` stream of the run's seed).
"""
import torch
import torch.distributed as dist
from omegaconf import DictConfig

from pretrain.config import ConfigError
from pretrain.data.mqar import IGNORE, MQARLoader, MQARSettingError, check_mixture, check_mqar

from . import TokenRowsTask
from .lm_scoring import batch_nll

SETTING_KEYS = {"vocab_size": "recall.vocab_size", "seq_len": "train.seq_len", "num_pairs": "recall.num_pairs",
                "query_power": "recall.query_power"}


def mixture_of(cfg: DictConfig) -> list[tuple[int, int]] | None:
    """``recall.mixture`` as ``(seq_len, num_pairs)`` pairs, or None for the single setting; an entry of another
    form is a ``ConfigError`` naming it."""
    entries = cfg.recall.mixture
    if not entries:
        return None
    settings = []
    for i, entry in enumerate(entries):
        if not isinstance(entry, DictConfig) or set(entry.keys()) != {"seq_len", "num_pairs"}:
            raise ConfigError(f"recall.mixture[{i}]", f"expected {{seq_len: T, num_pairs: N}}; got {entry!r}")
        settings.append((entry.seq_len, entry.num_pairs))
    return settings


def check_recall_config(cfg: DictConfig) -> None:
    """The MQAR setting is possible (error naming the key); ``model.vocab_size: 0`` becomes ``recall.vocab_size``."""
    r, mixture = cfg.recall, mixture_of(cfg)
    try:
        if mixture is None:
            check_mqar(vocab_size=r.vocab_size, seq_len=cfg.train.seq_len, num_pairs=r.num_pairs,
                       query_power=r.query_power)
        else:
            check_mixture(vocab_size=r.vocab_size, seq_len=cfg.train.seq_len, mixture=mixture,
                          query_power=r.query_power)
    except MQARSettingError as err:
        key = SETTING_KEYS.get(err.arg, f"recall.{err.arg}")
        raise ConfigError(key, str(err).split(": ", 1)[1]) from None
    except ValueError as err:  # check_at_least: a non-positive count
        raise ConfigError("recall.num_pairs", str(err)) from None
    if cfg.model.vocab_size == 0:
        cfg.model.vocab_size = r.vocab_size
    if cfg.model.vocab_size < r.vocab_size:
        raise ConfigError("model.vocab_size", f"{cfg.model.vocab_size} is smaller than recall.vocab_size "
                                              f"{r.vocab_size}: some tokens would have no embedding")


@torch.no_grad()
def recall_scores(model, batches, device) -> torch.Tensor:
    """``[correct answers, answers, summed NLL]`` (float64, on ``device``) over ``batches``: an answer is correct
    when the argmax of the logits at its query is the value. Under a process group, every rank passes as many
    batches and gets the sums over all ranks."""
    totals = torch.zeros(3, dtype=torch.float64, device=device)
    for batch in batches:
        labels = batch["labels"].to(device)
        logits = model(batch["input_ids"].to(device), position_ids=batch["position_ids"].to(device))
        scored = labels != IGNORE
        answers, logits = labels[scored], logits[scored].float()
        nll = torch.nn.functional.cross_entropy(logits, answers, reduction="sum")
        totals += torch.stack([(logits.argmax(-1) == answers).sum().double(), scored.sum().double(), nll.double()])
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(totals)
    return totals


class RecallTask(TokenRowsTask):
    has_validation = True

    def __init__(self, cfg: DictConfig, world):
        check_recall_config(cfg)
        self.cfg, self.world, t = cfg, world, cfg.train  # whole rows: the config refuses sequence parallelism
        self.loader = self.stream("train", cfg.run.seed, rank=world.data_rank, world_size=world.data_size)
        self.units_per_micro_batch = t.micro_batch_size * t.seq_len

    def stream(self, split: str, seed: int, *, rank: int, world_size: int, setting: tuple[int, int] | None = None
               ) -> MQARLoader:
        """The training rows (a mixture's, when the config has one), or rows of one ``(seq_len, num_pairs)``."""
        r, t = self.cfg.recall, self.cfg.train
        common = dict(vocab_size=r.vocab_size, batch_size=t.micro_batch_size, query_power=r.query_power, rank=rank,
                      world_size=world_size, seed=seed, split=split)
        if setting is not None:
            return MQARLoader(seq_len=setting[0], num_pairs=setting[1], **common)
        mixture = mixture_of(self.cfg)
        if mixture is None:
            return MQARLoader(seq_len=t.seq_len, num_pairs=r.num_pairs, **common)
        return MQARLoader(seq_len=t.seq_len, mixture=mixture, **common)

    def loss(self, model, batch, device):
        return batch_nll(model, batch, device)

    def validate(self, model, device) -> dict[str, float]:
        """Accuracy and mean NLL over ``log.val_batches`` batches per rank of the validation rows; under a mixture,
        each setting's rows apart (``val/recall_accuracy/T64_N4``) and the answers of all of them together."""
        mixture = mixture_of(self.cfg)
        settings = [None] if mixture is None else mixture
        totals, metrics = torch.zeros(3, dtype=torch.float64, device=device), {}
        for setting in settings:
            rows = self.stream("val", self.cfg.run.seed, rank=self.world.data_rank, world_size=self.world.data_size,
                               setting=setting)
            scores = recall_scores(model, map(rows.batch, range(self.cfg.log.val_batches)), device)
            totals += scores
            if setting is not None:
                metrics[f"val/recall_accuracy/T{setting[0]}_N{setting[1]}"] = (scores[0] / scores[1]).item()
        correct, answers, nll = totals.tolist()
        return {"val/recall_accuracy": correct / answers, "val/loss": nll / answers, "val/answers": answers, **metrics}
