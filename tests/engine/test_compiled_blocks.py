"""Compiled blocks (``train.compile``, pretrain/models/compile.py) over our ops as custom ops
(pretrain/ops/custom_ops.py): each op's registration passes PyTorch's opcheck; an LM with one layer of every causal
mixer, compiled per block, gives eager mode's logits and gradients on packed documents, each block one graph that
holds our op, compiled once per kind of block across steps and packings; inductor agrees on one block; and under a
DeepSpeed engine with activation checkpointing, training steps equal eager ones (dist)."""
import pytest
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch._dynamo.testing import CompileCounterWithBackend

from pretrain.attention import REGISTRY
from pretrain.config import ConfigError, ModelConfig, load_config
from pretrain.models import build_lm
from pretrain.models.compile import compile_blocks

CAUSAL = sorted(name for name, cls in REGISTRY.items() if cls.supports_causal)
# three steps' packings of two rows of 24 tokens: a one-token document, documents straddling chunks, a whole row;
# 4, 5 and 2 documents, so a graph specialized to one count would compile again
PACKINGS = ([[9, 1, 14], [24]], [[4, 20], [2, 10, 12]], [[24], [24]])
VOCAB = 53


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test counts its own compiles: no graphs cached by an earlier test."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def packed_inputs(heads=2, dim=8, length=23, *, seed=0):
    """q, k (positive, as after a feature map), v ``[1, T, H, D]`` requiring grad, and two documents' offsets."""
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.rand(1, length, heads, dim, generator=gen, requires_grad=True) for _ in range(2))
    v = torch.randn(1, length, heads, dim, generator=gen, requires_grad=True)
    return q, k, v, torch.tensor([0, 9, length], dtype=torch.int32), gen


def op_cases():
    """(registered forward op, its arguments) for every op the causal mixers reach besides linear_attention
    (tests/ops/test_linear_attention_compile.py checks that one)."""
    from pretrain.ops.aft.library import _full_op, _local_op, _simple_op
    from pretrain.ops.decayed_linear_attention.library import _forward as decayed
    from pretrain.ops.delta_rule.library import _forward as delta
    from pretrain.ops.dplr.library import _dplr_op, _kda_op
    from pretrain.ops.efficient.library import _forward as efficient
    from pretrain.ops.softmax.library import _forward as softmax

    q, k, v, cu, gen = packed_inputs()
    log_decay = -torch.rand(1, 23, 2, generator=gen)
    state = torch.rand(2, 2, 8, 8, generator=gen)
    beta = torch.rand(1, 23, 2, generator=gen).requires_grad_()
    unit_k = F.normalize(k.detach(), dim=-1).requires_grad_()
    flat = [t.detach().flatten(2).requires_grad_() for t in (q, k, v)]  # AFT's [B, T, C]
    return {
        "decayed_linear_attention": (decayed, (q, k, v, log_decay.requires_grad_(), state.requires_grad_(),
                                               torch.rand(2, 2, 8, generator=gen).requires_grad_(), cu,
                                               "divisive", 1e-6, 8, "chunk")),
        "delta_rule": (delta, (q, unit_k, v, beta, log_decay, state, cu, 8, "chunk")),
        "dplr_delta_rule": (_dplr_op, (q, unit_k, v, (-0.5 * unit_k.detach()).requires_grad_(), unit_k,
                                       -torch.rand(1, 23, 2, 8, generator=gen), state, cu, 8, "chunk")),
        "kda_delta_rule": (_kda_op, (q, unit_k, v, beta, -torch.rand(1, 23, 2, 8, generator=gen), state, cu, 8,
                                     "chunk")),
        "efficient_attention": (efficient, (q, k, v, None, None, cu, True, False, 8, "auto")),
        "aft_full": (_full_op, (*flat, torch.randn(30, 30, generator=gen).requires_grad_(), cu, True, 8)),
        "aft_local": (_local_op, (*flat, torch.randn(4, generator=gen).requires_grad_(), cu, 4, True, 8)),
        "aft_simple": (_simple_op, (*flat, cu, True, 8)),
        "softmax_attention": (softmax, (q, k, v, cu, True, None, "auto")),
    }


@pytest.mark.parametrize("name", ["decayed_linear_attention", "delta_rule", "dplr_delta_rule", "kda_delta_rule",
                                  "efficient_attention", "aft_full", "aft_local", "aft_simple", "softmax_attention"])
def test_registration_passes_opcheck(name):
    """Schema, fake implementation, autograd registration and AOT dispatch, checked by PyTorch itself."""
    op, args = op_cases()[name]
    torch.library.opcheck(op, args)


def lm(pattern, dtype):
    """A tiny LM with a layer of each mixer in ``pattern``, its weights away from init (AFT-full's bias too)."""
    cfg = ModelConfig(vocab_size=VOCAB, dim=16, n_heads=2, n_layers=len(pattern), layer_pattern=pattern,
                      multiple_of=16, mixer_options={"linear": {"chunk_size": 8}, "inline": {"chunk_size": 8},
                                                     "aft_full": {"max_seq_len": 24}})
    torch.manual_seed(0)
    model = build_lm(cfg).to(dtype)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
    return model


def batch(documents, seed):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (len(documents), 25), generator=gen)
    positions = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in documents])
    return ids[:, :-1], ids[:, 1:], positions


def logits_and_gradients(model, inputs):
    ids, labels, positions = inputs
    model.zero_grad()
    logits = model(ids, position_ids=positions)
    F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten()).backward()
    return logits.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


def assert_same(compiled, eager, *, rtol):
    """Logits and every gradient within ``rtol`` of the largest entry of eager's (a gradient near 0 has no
    relative digits to compare)."""
    (logits_c, grads_c), (logits, grads) = compiled, eager
    torch.testing.assert_close(logits_c, logits, rtol=rtol, atol=rtol * float(logits.abs().max()))
    assert grads_c.keys() == grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grads_c[name], grad, rtol=rtol, atol=rtol * float(grad.abs().max()), msg=name)


def test_every_causal_mixer_compiles_to_one_graph_per_block_with_eager_results():
    """fp64, so anything beyond round-off stands out; ``aot_eager`` runs the traced ATen graphs (forward and
    backward, through the ops' fake implementations). Three steps of different packings: each kind of block compiles
    once (the number of documents is a symbolic size), and every block's graph holds its custom op."""
    eager, compiled = lm(CAUSAL, torch.float64), lm(CAUSAL, torch.float64)
    counter = CompileCounterWithBackend("aot_eager")
    compile_blocks(compiled, backend=counter)  # fullgraph: a graph break is an error
    for step, documents in enumerate(PACKINGS):
        inputs = batch(documents, step)
        assert_same(logits_and_gradients(compiled, inputs), logits_and_gradients(eager, inputs), rtol=1e-10)
        assert counter.frame_count == len(CAUSAL), step
    ops = {str(node.target) for graph in counter.graphs for node in graph.graph.nodes if node.op == "call_function"}
    ours = {"linear_attention", "decayed_linear_attention", "delta_rule", "dplr_delta_rule", "kda_delta_rule",
            "efficient_attention", "aft_full", "aft_local", "aft_simple", "softmax_attention"}
    assert {f"pretrain.{name}.default" for name in ours} <= ops, sorted(op for op in ops if "pretrain" in op)


def test_inductor_block_equals_eager():
    """Inductor's own kernels around the delta rule's op, fp32: the same logits and gradients up to fp32
    round-off (its fused sums add in another order). One compile worker: a pool costs more than it saves here."""
    eager, compiled = lm(["gated_deltanet"], torch.float32), lm(["gated_deltanet"], torch.float32)
    with torch._inductor.config.patch(compile_threads=1):
        compile_blocks(compiled)
        for step, documents in enumerate(PACKINGS):
            inputs = batch(documents, step)
            assert_same(logits_and_gradients(compiled, inputs), logits_and_gradients(eager, inputs), rtol=2e-5)


@pytest.mark.parametrize("key, value, other", [("parallel.sequence_parallel", 2, "parallel.sequence_parallel"),
                                               ("deepspeed.zero_stage", 3, "deepspeed.zero_stage 3")])
def test_combinations_that_cannot_compile_are_refused(key, value, other):
    overrides = ["data.tokenizer=x", "data.train_shards=x", "train.compile=true", f"{key}={value}"]
    with pytest.raises(ConfigError, match=other) as err:
        load_config(None, overrides)
    assert err.value.key == "train.compile"


HYBRID = ["gated_deltanet", "softmax"]


def _deepspeed_steps(out) -> None:
    """Three training steps of a hybrid LM on a one-rank DeepSpeed engine (ZeRO-2), eagerly and compiled with
    activation checkpointing: (losses, weights, compiles) of each."""
    from pretrain.distributed import (
        apply_activation_checkpointing,
        build_engine,
        close_process_group,
        init_process_group,
    )

    init_process_group()
    try:
        results = []
        for compiled in (False, True):
            cfg = load_config(None, ["data.tokenizer=x", "data.train_shards=x", "deepspeed.zero_stage=2",
                                     f"deepspeed.activation_checkpointing={compiled}", f"train.compile={compiled}",
                                     "train.micro_batch_size=2", "schedule.warmup_steps=0"])
            model = lm(HYBRID * 2, torch.float32)
            counter = CompileCounterWithBackend("aot_eager")
            if compiled:  # in the training loop's order: compile, then checkpoint the compiled forward
                compile_blocks(model, backend=counter)
                apply_activation_checkpointing(model)
            engine = build_engine(cfg, model, 1, lambda step: 1e-2)
            losses = []
            for step, documents in enumerate(PACKINGS):
                ids, labels, positions = batch(documents, step)
                loss = engine(ids, position_ids=positions, labels=labels) / labels.numel()
                engine.backward(loss)
                engine.step()
                losses.append(loss.item())
            weights = {name: p.detach().numpy().copy() for name, p in model.named_parameters()}  # plain pickles
            results.append((losses, weights, counter.frame_count))
        out.put(results)
    finally:
        close_process_group()


@pytest.mark.dist
def test_deepspeed_with_activation_checkpointing_trains_as_eager():
    """The compiled blocks run inside DeepSpeed's checkpoint: without autograd in forward, with it in backward's
    recomputation, so each kind of block compiles twice, and the steps match eager mode's. The recomputation gets
    detached copies of the block's inputs, which carry no dynamic-size mark: until the mark moved next to the
    compiled forward, each new number of documents compiled again there (on an H200, every step at 16k)."""
    context = mp.get_context("spawn")
    out = context.Queue()
    process = context.Process(target=_deepspeed_steps, args=(out,))
    process.start()
    (losses, weights, _), (losses_c, weights_c, compiles) = out.get(timeout=600)
    process.join(timeout=60)
    assert process.exitcode == 0
    assert compiles == 2 * len(HYBRID)
    assert losses_c == pytest.approx(losses, rel=1e-6)
    for name, weight in weights.items():
        torch.testing.assert_close(torch.from_numpy(weights_c[name]), torch.from_numpy(weight), rtol=1e-6,
                                   atol=1e-6 * float(abs(weight).max()), msg=name)


def test_starting_a_profiler_compiles_nothing_again():
    """tools/profile_step.py profiles compiled steps: the blocks' named scopes must not make the profiler's state a
    guard of their graphs, or the profiled steps time compiling."""
    model = lm(HYBRID, torch.float32)
    counter = CompileCounterWithBackend("eager")
    compile_blocks(model, backend=counter)
    logits_and_gradients(model, batch(PACKINGS[0], 0))
    compiled = counter.frame_count
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        logits_and_gradients(model, batch(PACKINGS[1], 1))
    assert counter.frame_count == compiled == len(HYBRID)


def test_compiling_keeps_parameter_names():
    """Checkpoints load either way: compiling replaces each block's bound forward, not the block (a wrapping module
    would prefix every name with ``_orig_mod``)."""
    model = lm(HYBRID, torch.float32)
    names = list(model.state_dict())
    compile_blocks(model, backend="eager")
    assert list(model.state_dict()) == names
