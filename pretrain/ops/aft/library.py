"""The causal-capable AFT forms as custom ops ``torch.ops.pretrain.aft_full``, ``aft_local`` and ``aft_simple``
(``ops/custom_ops.py``): under ``torch.compile`` each is one opaque node whose body is the form run eagerly, so the
compiler never traces the block loops or reads ``cu_seqlens``. Each returns ``[B, T, C]`` in v's dtype."""
from ..custom_ops import register


def _full(q, k, v, w, cu_seqlens, causal, chunk_size):
    from .parallel import aft_full  # which imports this module; eager here
    return [aft_full(q, k, v, w, causal=causal, cu_seqlens=cu_seqlens, chunk_size=chunk_size)]


def _local(q, k, v, w_rel, cu_seqlens, window, causal, chunk_size):
    from .parallel import aft_local
    return [aft_local(q, k, v, w_rel, window=window, causal=causal, cu_seqlens=cu_seqlens, chunk_size=chunk_size)]


def _simple(q, k, v, cu_seqlens, causal, chunk_size):
    from .parallel import aft_simple
    return [aft_simple(q, k, v, causal=causal, cu_seqlens=cu_seqlens, chunk_size=chunk_size)]


def _like_v(q, k, v, *rest):
    return [v.new_empty(v.shape)]


_full_op = register("aft_full", _full, _like_v, tensors=("q", "k", "v", "w", "cu_seqlens"),
                    options="bool causal, int chunk_size")
_local_op = register("aft_local", _local, _like_v, tensors=("q", "k", "v", "w_rel", "cu_seqlens"),
                     options="int window, bool causal, int chunk_size")
_simple_op = register("aft_simple", _simple, _like_v, tensors=("q", "k", "v", "cu_seqlens"),
                      options="bool causal, int chunk_size")


def aft_full_op(q, k, v, w, *, causal, cu_seqlens, chunk_size):
    return _full_op(q, k, v, w, cu_seqlens, causal, chunk_size)[0]


def aft_local_op(q, k, v, w_rel, *, window, causal, cu_seqlens, chunk_size):
    return _local_op(q, k, v, w_rel, cu_seqlens, window, causal, chunk_size)[0]


def aft_simple_op(q, k, v, *, causal, cu_seqlens, chunk_size):
    return _simple_op(q, k, v, cu_seqlens, causal, chunk_size)[0]
