"""``ShortConvolution`` against its definition written per token, and the properties the mixers rely on: it never
reads an earlier document, and a row cut into pieces (decoding, sequence slices) with each piece given the tail of
the one before equals the whole row."""
import pytest
import torch
import torch.nn.functional as F

from pretrain.attention.short_conv import ShortConvolution
from pretrain.ops.short_conv import short_conv

F64 = dict(dtype=torch.float64)


def reference(x, weight, bias, positions, before, activation):
    """``y[b, t, c] = act(bias[c] + Σ_{i<K, i ≤ position[b, t]} weight[c, i] · x[b, t − i, c])`` token by token,
    ``x`` at negative times read from ``before`` (rows with ``positions`` None are one document that began before
    ``before``)."""
    batch, seq_len, channels = x.shape
    reach = weight.shape[1] - 1
    inputs = torch.cat([before if before is not None else x.new_zeros(batch, reach, channels), x], dim=1)
    out = torch.zeros_like(x)
    for b in range(batch):
        for t in range(seq_len):
            for i in range(reach + 1):
                if positions is None or i <= int(positions[b, t]):
                    out[b, t] += weight[:, i] * inputs[b, reach + t - i]
    if bias is not None:
        out = out + bias
    return F.silu(out) if activation == "silu" else out


def random_conv(channels, kernel_size, **options):
    torch.manual_seed(0)
    conv = ShortConvolution(channels, kernel_size, **options).double()
    if conv.bias is not None:
        torch.nn.init.normal_(conv.bias)
    return conv


def packed_positions(lengths_per_row, *, first_began=0):
    """``[B, T]`` positions within documents for rows packed with documents of the given lengths, each row's first
    document having begun ``first_began`` tokens before the row (in the inputs handed as ``before``)."""
    return torch.stack([torch.cat([torch.arange(n) + (first_began if d == 0 else 0) for d, n in enumerate(lengths)])
                        for lengths in lengths_per_row])


@pytest.mark.parametrize("kernel_size", [1, 2, 4])
@pytest.mark.parametrize("activation,bias", [("silu", False), (None, True)])
@pytest.mark.parametrize("with_documents", [False, True])
@pytest.mark.parametrize("with_before", [False, True])
def test_equals_its_definition(kernel_size, activation, bias, with_documents, with_before):
    conv = random_conv(5, kernel_size, activation=activation, bias=bias)
    x = torch.randn(2, 9, 5, **F64)
    positions = None
    if with_documents:
        positions = packed_positions([[1, 3, 5], [4, 1, 1, 3]], first_began=2 if with_before else 0)
    before = torch.randn(2, kernel_size - 1, 5, **F64) if with_before else None
    expected = reference(x, conv.weight, conv.bias, positions, before, activation)
    torch.testing.assert_close(conv(x, position_ids=positions, before=before), expected, rtol=1e-10, atol=1e-10)


def test_equals_a_causally_padded_depthwise_conv1d():
    """Independent of our loop: torch's grouped conv1d, left-padded by K − 1, with the kernel in time order."""
    conv = random_conv(6, 4, activation=None, bias=True)
    x = torch.randn(3, 11, 6, **F64)
    kernel = conv.weight.flip(1)[:, None]  # conv1d weighs the oldest tap first
    expected = F.conv1d(F.pad(x.transpose(1, 2), (3, 0)), kernel, conv.bias, groups=6).transpose(1, 2)
    torch.testing.assert_close(conv(x), expected, rtol=1e-10, atol=1e-10)


def test_gradients_equal_the_definitions():
    conv = random_conv(3, 3, bias=True)
    x = torch.randn(2, 7, 3, **F64, requires_grad=True)
    before = torch.randn(2, 2, 3, **F64, requires_grad=True)
    positions = packed_positions([[2, 5], [1, 6]], first_began=1)
    weight = conv.weight.detach().clone().requires_grad_()
    bias = conv.bias.detach().clone().requires_grad_()
    upstream = torch.randn(2, 7, 3, **F64)
    fast = torch.autograd.grad((conv(x, position_ids=positions, before=before) * upstream).sum(),
                               [x, before, conv.weight, conv.bias])
    slow = torch.autograd.grad((reference(x, weight, bias, positions, before, "silu") * upstream).sum(),
                               [x, before, weight, bias])
    for got, want in zip(fast, slow):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


def test_never_reads_an_earlier_document():
    """Changing every token of a row's earlier documents (and the halo) leaves a later document's outputs alone."""
    conv = random_conv(4, 4)
    positions = packed_positions([[3, 2, 6]])
    x, before = torch.randn(1, 11, 4, **F64), torch.randn(1, 3, 4, **F64)
    changed, changed_before = x.clone(), torch.randn(1, 3, 4, **F64)
    changed[:, :5] = torch.randn(1, 5, 4, **F64)
    y = conv(x, position_ids=positions, before=before)
    y_changed = conv(changed, position_ids=positions, before=changed_before)
    torch.testing.assert_close(y_changed[:, 5:], y[:, 5:], rtol=0, atol=0)
    assert not torch.allclose(y_changed[:, 3:5], y[:, 3:5])  # the second document does see its own changed tokens


@pytest.mark.parametrize("cuts", [[1], [2, 3], [5], [1, 1, 1, 1, 1, 1, 1, 1, 1, 1]])
def test_pieces_handed_the_tail_equal_the_whole_row(cuts):
    """Decoding (prefill, then one token at a time) and pieces shorter than the reach all carry the tail on."""
    conv = random_conv(4, 4, bias=True)
    x = torch.randn(2, 10, 4, **F64)
    pieces, state, start = [], None, 0
    for length in [*cuts, 10 - sum(cuts)]:
        piece = x[:, start:start + length]
        pieces.append(conv(piece, before=state))
        state, start = conv.tail(piece, state), start + length
    torch.testing.assert_close(torch.cat(pieces, dim=1), conv(x), rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(state, x[:, -3:], rtol=0, atol=0)


def test_tail_of_a_short_piece_keeps_the_older_inputs():
    conv = ShortConvolution(2, 4)
    before, x = torch.arange(6.0).view(1, 3, 2), torch.full((1, 1, 2), 9.0)
    assert conv.tail(x, before).tolist() == [[[2.0, 3.0], [4.0, 5.0], [9.0, 9.0]]]
    assert conv.tail(x).tolist() == [[[0.0, 0.0], [0.0, 0.0], [9.0, 9.0]]]
    assert ShortConvolution(2, 1).tail(x).shape == (1, 0, 2)


def test_init_is_nn_conv1ds_default_bound():
    conv = ShortConvolution(512, 4, bias=True)
    assert conv.halo == 3 and conv.weight.shape == (512, 4)
    assert conv.weight.abs().max() <= 0.5 and conv.weight.abs().max() > 0.45
    assert conv.bias.abs().max() <= 0.5


def test_the_functional_form_is_the_module_without_activation():
    conv = random_conv(3, 2, activation=None)
    x = torch.randn(1, 5, 3, **F64)
    torch.testing.assert_close(short_conv(x, conv.weight, activation=None), conv(x), rtol=0, atol=0)


def test_bad_input_is_refused_by_shape():
    with pytest.raises(ValueError, match="kernel_size must be ≥ 1"):
        ShortConvolution(4, 0)
    with pytest.raises(ValueError, match="activation"):
        ShortConvolution(4, 3, activation="gelu")
    conv = ShortConvolution(4, 3)
    with pytest.raises(ValueError, match=r"x \[B, T, 4\]"):
        conv(torch.zeros(1, 5, 3))
    with pytest.raises(ValueError, match=r"before must be \[B, K − 1, C\] = \(1, 2, 4\)"):
        conv(torch.zeros(1, 5, 4), before=torch.zeros(1, 3, 4))


def test_the_op_refuses_bad_input_by_name():
    x = torch.zeros(2, 5, 4)
    with pytest.raises(ValueError, match=r"weight must be \[C, K\] with K ≥ 1; got \(4,\)"):
        short_conv(x, torch.zeros(4))
    with pytest.raises(ValueError, match=r"bias must be \[C\] = \(4,\); got \(3,\)"):
        short_conv(x, torch.zeros(4, 2), torch.zeros(3))
    with pytest.raises(ValueError, match=r"positions must be \[B, T\] = \(2, 5\); got \(1, 5\)"):
        short_conv(x, torch.zeros(4, 2), positions=torch.zeros(1, 5, dtype=torch.long))
    with pytest.raises(ValueError, match="impl must be one of"):
        short_conv(x, torch.zeros(4, 2), impl="cuda")
