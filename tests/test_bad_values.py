"""Values a cache cannot hold get named errors (issue 12 item 7).

* A block type's fp16 scale (and min) overflow: refused just above the limit each type's
  layout implies, accepted (finite) just below it, the message naming head and token.
* Through the cache: any value that cannot be stored or reads back non-finite names the
  layer, K or V, the copy, the head and the absolute token position.
* A packed buffer decoded by another format, width, role or rotation is refused by name.
"""

from __future__ import annotations

import pytest
import torch

from kvarn.vocab.cell import CellSpec
from kvarn.kvcache.cache import KVarnLayer, make_format
from kvarn.formats import get_format
from kvarn.formats.blocks import QK, SPECS
from kvarn.vocab.policy import layer_policy

F16_MAX = 65504.0


def _limit(name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(a block just below, a block just above) the largest value `name` can scale into fp16.

    Unrotated, one block: the fp16 scale is d = |vmax|/top (q8_0: amax/127; symmetric
    types: vmax/-2^(b-1); iq4_nl: vmax/-127, refit to the same d for a single non-zero
    value); the `_1` types store m = min, which overflows first."""
    spec = SPECS[name]
    top = {"q8": 127, "iq4nl": 127, "sym": 1 << (spec.bits - 1)}.get(spec.kind)
    out = []
    for f in (0.99, 1.01):
        x = torch.zeros(QK)
        if spec.kind == "asym":
            x[:] = -F16_MAX * f  # a constant block: d = 0, m = min
        else:
            x[5] = -top * F16_MAX * f
        out.append(x)
    return out[0], out[1]


@pytest.mark.parametrize("name", sorted(SPECS))
def test_block_scale_overflow_is_named(name):
    below, above = _limit(name)
    fmt = get_format(name, role="k", rot=False)
    x = torch.randn(2, 3, 4, 64) * 0.1  # [batch, head, token, dim]
    x[1, 2, 3, :QK] = below
    y = fmt.roundtrip(x)
    assert torch.isfinite(y).all()  # just below the limit: stored and read back
    x[1, 2, 3, QK:] = above  # block 1 of head 2, token 3
    for path in (fmt.roundtrip, fmt.encode):
        with pytest.raises(ValueError, match=r"head 2, token 3: fp16 scale overflow in block 1 \(channels 32\.\.63\)"):
            path(x)


def _layer(k, v, tail, tail_dtype=torch.bfloat16, idx=3):
    kf, vf = make_format(k, "k", True, CellSpec.iters), make_format(v, "v", True, CellSpec.iters)
    return KVarnLayer(kf, vf, layer_policy(kf, vf, tail), tail_dtype, idx)


def test_cache_names_layer_head_and_absolute_token():
    layer = _layer("q4_0", "q4_0", 0)
    k = torch.randn(1, 2, 5, 64)
    layer.update(k, k.clone())
    bad = torch.randn(1, 2, 4, 64)
    bad[0, 1, 2, 7] = 3e7  # 7th token of the sequence, head 1: q4_0's d overflows after rotation
    with pytest.raises(ValueError, match=r"^layer 3, K \(body, q4_0\) head 1, token 7: fp16 scale overflow"):
        layer.update(bad, torch.randn(1, 2, 4, 64))


def test_cache_names_non_finite_exact_copy_and_input():
    layer = _layer("q8_0", "q8_0", 4, tail_dtype=torch.float16, idx=1)
    v = torch.randn(1, 2, 6, 64)
    v[0, 0, 4, 9] = 1e5  # above fp16's 65504: the F16 exact copy reads back inf
    with pytest.raises(ValueError, match=r"^layer 1, V \(exact, float16\) head 0, token 4: the value is inf at channel 9"):
        layer.update(torch.randn(1, 2, 6, 64), v)
    layer = _layer("f16", "f16", 0, idx=0)
    with pytest.raises(ValueError, match=r"^layer 0, K \(body, f16\) head 1, token 0: the value is -inf"):
        k = torch.randn(1, 2, 1, 64)
        k[0, 1, 0, 0] = -1e6
        layer.update(k, torch.randn(1, 2, 1, 64))
    k = torch.randn(1, 2, 3, 64)
    k[0, 0, 2, 3] = float("nan")
    with pytest.raises(ValueError, match=r"^layer 0, K \(from the model\) head 0, token 2: the value is nan"):
        _layer("q4_0", "q4_0", 0, idx=0).update(k, torch.randn(1, 2, 3, 64))


def test_kvarn_overflow_names_group_tokens():
    layer = _layer("kvarn4", "kvarn4", 0, tail_dtype=torch.float32, idx=2)
    k = torch.randn(1, 2, 256, 64)
    k[0, 1, 128:, :] = 1e10  # the K tiles of group 1 (tokens 128..255), head 1: fp16 metadata overflows
    with pytest.raises(ValueError, match=r"^layer 2, K \(body, kvarn4\) head 1, tokens 128\.\.255: a tile's fp16 metadata"):
        layer.update(k, torch.randn(1, 2, 256, 64))


@pytest.mark.parametrize("writer,reader,needle", [
    (("kvarn4", "k"), ("kvarn4", "v"), "role='k'"),
    (("kvarn4", "k"), ("kvarn3", "k"), "format='kvarn4'"),
    (("kvarn6", "v"), ("kvarn5", "k"), "format='kvarn6', role='v', bits=6"),
    (("q4_0", "k"), ("q4_0", "v"), "role='k'"),
    (("q8_0", "v"), ("q4_0", "v"), "format='q8_0'"),
    (("f16", "k"), ("bf16", "k"), "format='f16'"),
])
def test_decode_refuses_other_format_role_or_width(writer, reader, needle):
    x = torch.randn(2, 128, 64)
    packed = get_format(writer[0], role=writer[1]).encode(x)
    with pytest.raises(ValueError, match="refusing to decode") as e:
        get_format(reader[0], role=reader[1]).decode(packed)
    assert needle in str(e.value) and f"get_format('{writer[0]}', role='{writer[1]}')" in str(e.value)
    # the writer itself still decodes it (and equals the roundtrip)
    assert torch.equal(get_format(*writer[:1], role=writer[1]).decode(packed),
                       get_format(*writer[:1], role=writer[1]).roundtrip(x))


def test_decode_refuses_other_rotation():
    packed = get_format("q4_0", role="k", rot=True).encode(torch.randn(1, 4, 64))
    with pytest.raises(ValueError, match="rot=True"):
        get_format("q4_0", role="k", rot=False).decode(packed)
