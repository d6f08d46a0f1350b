"""The causal language model task: packed token rows from text shards, next-token loss, validation over documents.

Validation scores the validation shards' documents (round-robin over ranks) exactly as ``tools/eval_ppl.py`` does
(``pretrain.tasks.lm_scoring``), so the logged ``val/loss`` and eval_ppl's ``nll`` agree.
"""
import math

from omegaconf import DictConfig

from pretrain.config import ConfigError, train_shard_sources
from pretrain.data import MixtureLoader, Tokenizer, TokenLoader
from pretrain.data.shards import expand_shards
from pretrain.data.text_shards import check_tokenizer, read_shard_documents

from . import TokenRowsTask, verify_training_shards
from .lm_scoring import IGNORE, batch_nll, score_documents


class LMTask(TokenRowsTask):
    def __init__(self, cfg: DictConfig, world):
        self.cfg, self.world, t = cfg, world, cfg.train
        try:
            self.tokenizer = Tokenizer(cfg.data.tokenizer)
        except (OSError, ValueError) as err:
            raise ConfigError("data.tokenizer", str(err)) from None
        sources = train_shard_sources(cfg.data.train_shards)
        self.source_names = []
        if isinstance(sources, list):
            self.loader = MixtureLoader([(self._open(f"data.train_shards[{i}].shards", pattern), weight)
                                         for i, (pattern, weight, _) in enumerate(sources)],
                                        num_workers=cfg.data.num_workers, by=cfg.data.mix_by)
            self.source_names = [name for *_, name in sources]
        else:
            self.loader = self._open("data.train_shards", sources)
        if cfg.data.verify_shards:
            verify_training_shards(self.loader.shard_urls, world)
        try:
            self.val_urls = (expand_shards(cfg.data.val_shards, allow_pipe=cfg.data.allow_pipe)
                             if cfg.data.val_shards else [])
            check_tokenizer(self.val_urls, self.tokenizer.sha256)  # at the start, not at the first validation
        except (OSError, ValueError) as err:
            raise ConfigError("data.val_shards", str(err)) from None
        self.sequence = world.sequence  # under sequence parallelism, the ranks of a group share rows
        share = 1 if self.sequence is None else self.sequence.size
        self.units_per_micro_batch = t.micro_batch_size * t.seq_len // share  # this rank's tokens

    def _open(self, key: str, pattern: str) -> TokenLoader:
        """This rank's stream of one shard pattern; a missing, foreign or too small set of shards is a
        ``ConfigError`` naming ``key`` (ShardError is a ValueError)."""
        cfg, t = self.cfg, self.cfg.train
        try:
            return TokenLoader(pattern, seq_len=t.seq_len, batch_size=t.micro_batch_size, rank=self.world.data_rank,
                               world_size=self.world.data_size, seed=cfg.run.seed, num_workers=cfg.data.num_workers,
                               lanes=cfg.data.lanes, allow_pipe=cfg.data.allow_pipe,
                               skip_corrupt=cfg.data.skip_corrupt, tokenizer_sha256=self.tokenizer.sha256)
        except (OSError, ValueError) as err:
            raise ConfigError(key, str(err)) from None

    def train_metrics(self) -> dict[str, float]:
        """Corrupt shards left out so far (``data.skip_corrupt``) and a mixture's rows and tokens per source, by the
        sources' names, over all replicas (they follow from the rows consumed, the same on every rank at a step's
        end)."""
        skipped = {"train/skipped_shards": float(self.loader.skipped_shards)}
        if not isinstance(self.loader, MixtureLoader):
            return skipped
        counts = self.loader.source_counts()
        return skipped | {f"train/{name}_{what}": float(value) for name, row in zip(self.source_names, counts)
                          for what, value in zip(("rows", "tokens"), row)}

    @property
    def has_validation(self) -> bool:
        return bool(self.val_urls)

    def loss(self, model, batch, device):
        """On a sequence slice: this slice's NLL, and the whole rows' scored tokens / N as its count. DeepSpeed
        averages gradients over every rank, the N of a row included, so each rank's loss is scaled to its share
        of the rows' mean: the mean over ranks is then the mean over data-parallel replicas, at every ZeRO stage."""
        if self.sequence is None:
            return batch_nll(model, batch, device)
        nll, _ = batch_nll(model, batch, device, sequence=self.sequence)
        return nll, int((batch["labels"] != IGNORE).sum()) / self.sequence.size

    def validate(self, model, device) -> dict[str, float]:
        """Mean NLL per token over the validation documents (at most ``log.val_batches`` batches per rank)."""
        world, t = self.world, self.cfg.train
        documents = (doc.tokens for i, doc in enumerate(read_shard_documents(self.val_urls, self.tokenizer.sha256))
                     if i % world.data_size == world.data_rank)
        scores = score_documents(model, documents, seq_len=t.seq_len, stride=t.seq_len,
                                 batch_size=t.micro_batch_size, eos_id=self.tokenizer.eos_id, device=device,
                                 max_batches=self.cfg.log.val_batches, sequence=self.sequence)
        mean = scores.nll / scores.tokens
        return {"val/loss": mean, "val/ppl": math.exp(mean), "val/tokens": scores.tokens}
