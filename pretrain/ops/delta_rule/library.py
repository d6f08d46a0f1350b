"""``delta_rule`` as the custom op ``torch.ops.pretrain.delta_rule`` (``ops/custom_ops.py``): under
``torch.compile`` one opaque node whose body is the package's entry run eagerly, so the compiler never traces the
chunk loops or reads ``cu_seqlens``."""
import torch

from ..custom_ops import register
from ..linear_attention.library import documents


def delta_rule_op(q, k, v, beta, g, *, cu_seqlens, initial_state, output_final_state, chunk_size, impl):
    """``delta_rule`` with the same arguments and results, safe to call inside ``torch.compile``."""
    o, final = _forward(q, k, v, beta, g, initial_state, cu_seqlens, chunk_size, impl)
    return (o, final) if output_final_state else o


def _run(q, k, v, beta, g, initial_state, cu_seqlens, chunk_size, impl):
    from . import delta_rule  # the package's entry, which imports this module; eager here
    return list(delta_rule(q, k, v, beta, g, cu_seqlens=cu_seqlens, initial_state=initial_state,
                           output_final_state=True, chunk_size=chunk_size, impl=impl))


def output_fakes(q, v, cu_seqlens) -> list:
    """Fake outputs of a delta-rule family op: o in the input dtype, the final state ``[N, H, Dk, Dv]`` in fp32 (fp64
    for fp64 inputs); shared by ``ops/dplr``."""
    state = (documents(q, cu_seqlens), q.shape[2], q.shape[3], v.shape[3])
    return [v.new_empty(v.shape, dtype=q.dtype), q.new_empty(state, dtype=torch.promote_types(q.dtype, torch.float32))]


def _fake(q, k, v, beta, g, initial_state, cu_seqlens, chunk_size, impl):
    return output_fakes(q, v, cu_seqlens)


_forward = register("delta_rule", _run, _fake, tensors=("q", "k", "v", "beta", "g", "initial_state", "cu_seqlens"),
                    options="int chunk_size, str impl")
