"""``softmax_attention`` as the custom op ``torch.ops.pretrain.softmax_attention`` (``ops/custom_ops.py``): under
``torch.compile`` one opaque node whose body is the entry run eagerly, so the compiler never traces the packed
documents' per-document path (it reads ``cu_seqlens`` on the host), a library kernel or its first-use check."""
from ..custom_ops import register


def _run(q, k, v, cu_seqlens, causal, max_seqlen, impl):
    from . import softmax_attention  # the package's entry, which imports this module; eager here
    return [softmax_attention(q, k, v, causal=causal, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, impl=impl)]


def _fake(q, k, v, cu_seqlens, causal, max_seqlen, impl):
    return [v.new_empty(v.shape)]


_forward = register("softmax_attention", _run, _fake, tensors=("q", "k", "v", "cu_seqlens"),
                    options="bool causal, SymInt? max_seqlen, str impl")


def softmax_attention_op(q, k, v, *, causal, cu_seqlens, max_seqlen, impl):
    """``softmax_attention`` with the same arguments and result, safe to call inside ``torch.compile``."""
    return _forward(q, k, v, cu_seqlens, causal, max_seqlen, impl)[0]
