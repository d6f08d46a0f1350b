"""``dplr_delta_rule`` and ``kda_delta_rule`` as the custom ops ``torch.ops.pretrain.dplr_delta_rule`` and
``kda_delta_rule`` (``ops/custom_ops.py``): under ``torch.compile`` each is one opaque node whose body is the entry
run eagerly, so the compiler never traces the chunk loops or reads ``cu_seqlens``."""
from ..custom_ops import register
from ..delta_rule.library import output_fakes


def _dplr(q, k, v, a, b, g, initial_state, cu_seqlens, chunk_size, impl):
    from . import dplr_delta_rule  # the package's entry, which imports this module; eager here
    return list(dplr_delta_rule(q, k, v, a, b, g, cu_seqlens=cu_seqlens, initial_state=initial_state,
                                output_final_state=True, chunk_size=chunk_size, impl=impl))


def _kda(q, k, v, beta, g, initial_state, cu_seqlens, chunk_size, impl):
    from . import kda_delta_rule
    return list(kda_delta_rule(q, k, v, beta, g, cu_seqlens=cu_seqlens, initial_state=initial_state,
                               output_final_state=True, chunk_size=chunk_size, impl=impl))


def _fake(q, k, v, *rest):
    return output_fakes(q, v, rest[-3])  # rest ends with cu_seqlens, chunk_size, impl


_dplr_op = register("dplr_delta_rule", _dplr, _fake, tensors=("q", "k", "v", "a", "b", "g", "initial_state",
                                                                "cu_seqlens"), options="int chunk_size, str impl")
_kda_op = register("kda_delta_rule", _kda, _fake, tensors=("q", "k", "v", "beta", "g", "initial_state", "cu_seqlens"),
                   options="int chunk_size, str impl")


def dplr_delta_rule_op(q, k, v, a, b, g, *, cu_seqlens, initial_state, output_final_state, chunk_size, impl):
    """``dplr_delta_rule`` with the same arguments and results, safe to call inside ``torch.compile``."""
    o, final = _dplr_op(q, k, v, a, b, g, initial_state, cu_seqlens, chunk_size, impl)
    return (o, final) if output_final_state else o


def kda_delta_rule_op(q, k, v, beta, g, *, cu_seqlens, initial_state, output_final_state, chunk_size, impl):
    """``kda_delta_rule`` with the same arguments and results, safe to call inside ``torch.compile``."""
    o, final = _kda_op(q, k, v, beta, g, initial_state, cu_seqlens, chunk_size, impl)
    return (o, final) if output_final_state else o
