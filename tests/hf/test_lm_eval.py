"""Issue 27, item 4: lm-evaluation-harness scores an exported directory offline, through its own ``hf`` model and the
``lm_eval`` command, on a local multiple-choice task; its log-likelihood of every choice is our own scoring's."""
import json
import os
import random
import subprocess
import sys

import pytest
import torch

from pretrain.data import Tokenizer
from pretrain.data.tokenizer import EOS_ID
from pretrain.models import load_pretrained
from pretrain.tasks.lm_scoring import IGNORE, batch_nll

from tiny_lms import PATTERNS

pytest.importorskip("lm_eval", reason="the hf extra is not installed: pip install -e '.[hf]'")
pytestmark = pytest.mark.dist

WORDS = ["the", "a", "river", "stone", "light", "über", "日本", "😀", "42"]
TASK = """task: local_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {items}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""


def write_task(directory, items: int = 30) -> None:
    """``items`` questions of 2–4 choices, as JSON lines, and the task YAML that reads them."""
    rng = random.Random(0)
    phrase = lambda low, high: " ".join(rng.choice(WORDS) for _ in range(rng.randint(low, high)))
    with open(directory / "items.jsonl", "w", encoding="utf-8") as f:
        for i in range(items):
            choices = [phrase(1, 5) for _ in range(rng.randint(2, 4))]
            f.write(json.dumps({"question": f"Q{i}: {phrase(2, 9)}?", "choices": choices,
                                "answer": rng.randrange(len(choices))}) + "\n")
    (directory / "local_mc.yaml").write_text(TASK.format(items=directory / "items.jsonl"), encoding="utf-8")


def our_loglikelihood(model, tokenizer: Tokenizer, context: str, continuation: str) -> float:
    """log p(continuation | eos, context), scored as ``pretrain.tasks.lm_scoring`` scores documents."""
    stream = [EOS_ID] + tokenizer.encode(context + continuation)
    scored_from = 1 + len(tokenizer.encode(context))
    assert stream[:scored_from] == [EOS_ID] + tokenizer.encode(context)  # the context ends on a token boundary
    labels = torch.tensor([stream[1:]])
    labels[0, :scored_from - 1] = IGNORE
    batch = {"input_ids": torch.tensor([stream[:-1]]), "position_ids": torch.arange(len(stream) - 1)[None],
             "labels": labels}
    with torch.no_grad():
        nll, _ = batch_nll(model, batch, torch.device("cpu"))
    return -nll.item()


def test_lm_eval_loglikelihoods_equal_our_scoring(export, tmp_path):
    """In fp64 (``dtype=float64``), so the comparison sees the scoring, not fp32's rounding of two summation
    orders (lm-eval pads batches of different lengths). ``add_bos_token=True`` puts the eos a document follows in
    front, as training and our scoring do; ``trust_remote_code`` lets lm_eval, which never imports pretrain, load
    the directory's classes."""
    directory = export(PATTERNS[-1])
    write_task(tmp_path)
    env = dict(os.environ, HF_HOME=str(tmp_path / "hf_home"), HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1",
               OMP_NUM_THREADS="1")
    result = subprocess.run(
        [sys.executable, "-m", "lm_eval", "--model", "hf", "--model_args",
         f"pretrained={directory},trust_remote_code=True,add_bos_token=True,dtype=float64", "--tasks", "local_mc",
         "--include_path", str(tmp_path), "--device", "cpu", "--batch_size", "4", "--log_samples",
         "--output_path", str(tmp_path / "out")], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    # each metric without its aggregation and direction was a warning (README's task yaml gave four)
    assert "is defined, but" not in result.stderr, result.stderr[-3000:]
    [samples] = (tmp_path / "out").glob("*/samples_local_mc_*.jsonl")
    [results] = (tmp_path / "out").glob("*/results_*.json")

    model, tokenizer = load_pretrained(directory).double(), Tokenizer(str(directory / "tokenizer.model"))
    docs = [json.loads(line) for line in samples.read_text(encoding="utf-8").splitlines()]
    assert len(docs) == 30
    correct = 0
    for doc in docs:
        theirs = [float(response[0][0]) for response in doc["resps"]]
        ours = [our_loglikelihood(model, tokenizer, args["arg_0"], args["arg_1"]) for args in doc["arguments"].values()]
        assert [args["arg_1"] for args in doc["arguments"].values()] == [" " + c for c in doc["doc"]["choices"]]
        assert ours == pytest.approx(theirs, rel=0, abs=1e-5)
        correct += max(range(len(ours)), key=ours.__getitem__) == doc["doc"]["answer"]
    accuracy = json.loads(results.read_text())["results"]["local_mc"]["acc,none"]
    assert accuracy == pytest.approx(correct / len(docs))


GENERATIVE_TASK = """task: local_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {items}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["😀"]
  max_gen_toks: 6
  do_sample: false
metric_list:
  - metric: exact_match
"""


def test_lm_eval_generates_batched_as_one_at_a_time(export, tmp_path):
    """A generative task (generate_until) at --batch_size 4: lm-eval pads the prompts of a batch, of different
    lengths, on the left, and each response is the one --batch_size 1 gives (fp64: the pads are what could differ,
    not the rounding of another batch size)."""
    rng = random.Random(1)
    with open(tmp_path / "gen.jsonl", "w", encoding="utf-8") as f:
        for i in range(8):
            f.write(json.dumps({"question": f"Q{i}: " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 12))),
                                "answer": rng.choice(WORDS)}) + "\n")
    (tmp_path / "local_gen.yaml").write_text(GENERATIVE_TASK.format(items=tmp_path / "gen.jsonl"), encoding="utf-8")
    responses = {}
    for batch_size in (1, 4):
        out = tmp_path / f"out{batch_size}"
        env = dict(os.environ, HF_HOME=str(tmp_path / "hf_home"), HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1",
                   OMP_NUM_THREADS="1")
        result = subprocess.run(
            [sys.executable, "-m", "lm_eval", "--model", "hf", "--model_args",
             f"pretrained={export(PATTERNS[-1])},trust_remote_code=True,add_bos_token=True,dtype=float64",
             "--tasks", "local_gen", "--include_path", str(tmp_path), "--device", "cpu", "--batch_size",
             str(batch_size), "--log_samples", "--output_path", str(out)], env=env, capture_output=True, text=True,
            timeout=600)
        assert result.returncode == 0, result.stderr[-3000:]
        [samples] = out.glob("*/samples_local_gen_*.jsonl")
        docs = [json.loads(line) for line in samples.read_text(encoding="utf-8").splitlines()]
        responses[batch_size] = {doc["doc_id"]: doc["resps"][0][0] for doc in docs}
    assert len(responses[4]) == 8 and responses[4] == responses[1]
    assert len(set(responses[4].values())) > 1  # the prompts' own continuations, not one string for all
