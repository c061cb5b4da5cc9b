"""kvarn.memory against real packed buffers and hand-computed totals."""

import pytest
import torch

from kvarn.formats import get_format
from kvarn.geometry import Geometry
from kvarn.memory import KVBytes, bytes_table, kv_bytes, tail_label

TINY = Geometry.uniform(n_layers=2, n_kv_heads=2, head_dim=64, windows=(None, None))


pytestmark = pytest.mark.usefixtures("one_thread")


def _real_body(geom, n_ctx, k_type, v_type):
    """Sum of the sizes of actually encoded K and V buffers, layer by layer."""
    total = 0
    for w in geom.windows:
        stored = n_ctx if w is None else min(n_ctx, w)
        for role, name in (("k", k_type), ("v", v_type)):
            fmt = get_format(name, role=role)
            n = stored - stored % fmt.group
            if n == 0:
                continue
            x = torch.randn(geom.layers[0].n_kv_heads, n, geom.layers[0].head_dim, generator=torch.Generator().manual_seed(n))
            packed = fmt.encode(x)
            assert packed.data.dtype == torch.uint8
            total += packed.data.shape[0] * packed.data.shape[-1]
    return total


@pytest.mark.parametrize("pair", [("q4_0", "q4_0"), ("q8_0", "q5_1"), ("kvarn4", "kvarn4"), ("kvarn6", "kvarn3"), ("f16", "bf16")])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_body_matches_real_buffers(pair, head_dim):
    geom = Geometry.uniform(3, 2, head_dim, (None, 200, None))
    got = kv_bytes(geom, 300, *pair, tail=0)
    assert got.body == _real_body(geom, 300, *pair)


def test_q4_0_by_hand():
    # 300 tokens x 64/32 blocks x 18 bytes, K and V, 2 layers x 2 heads
    assert kv_bytes(TINY, 300, "q4_0", "q4_0", 0) == KVBytes(86400, 0, 86400)
    # + 128 bf16 rows x 64 x 2 bytes, K and V, 2 layers x 2 heads
    assert kv_bytes(TINY, 300, "q4_0", "q4_0", 128) == KVBytes(86400, 131072, 217472)
    # f32 tail doubles the overlay
    assert kv_bytes(TINY, 300, "q4_0", "q4_0", 128, tail_dtype="f32").overlay == 262144


def test_kvarn4_by_hand():
    # 300 tokens -> 2 whole groups in the body (44 tokens wait in the exact tail).
    # Per group at D=64: K tile 64x128 -> 1024*4 + 2*(2*64 + 128) = 4608,
    #                    V tile 128x64 -> 1024*4 + 2*(2*128 + 64) = 4736.
    body = 2 * 2 * 2 * (4608 + 4736)
    # sink 128 + tail 128* rows at f16, K and V, 2 layers x 2 heads
    overlay = 2 * 2 * 2 * (128 + 128) * 64 * 2
    assert kv_bytes(TINY, 300, "kvarn4", "kvarn4", 0) == KVBytes(body, overlay, body + overlay)
    # tail 128* is KVarN's own baseline: asking for 0 or 128 gives the same bytes
    assert kv_bytes(TINY, 300, "kvarn4", "kvarn4", 128) == kv_bytes(TINY, 300, "kvarn4", "kvarn4", 0)
    # tail 129 rounds up to 256
    assert kv_bytes(TINY, 300, "kvarn4", "kvarn4", 129).overlay == 2 * 2 * 2 * (128 + 256) * 64 * 2


def test_sliding_layers_capped():
    geom = Geometry.uniform(2, 2, 64, (None, 200))
    # q4_0: layer 0 keeps 300 tokens, the sliding layer 200
    assert kv_bytes(geom, 300, "q4_0", "q4_0", 0).body == 2 * 2 * 36 * (300 + 200)
    # kvarn4: sliding layer: 1 whole group, no sink, tail 128
    got = kv_bytes(geom, 300, "kvarn4", "kvarn4", 0)
    assert got.body == 2 * (2 + 1) * (4608 + 4736)
    assert got.overlay == 2 * 2 * (256 + 128) * 64 * 2
    # window smaller than the requested tail: the tail is capped at the window
    geom = Geometry.uniform(1, 1, 64, (100,))
    assert kv_bytes(geom, 300, "q8_0", "q8_0", 512).overlay == 2 * 100 * 64 * 2
    got = kv_bytes(geom, 300, "kvarn4", "kvarn4", 0)
    assert got.body == 0 and got.overlay == 2 * 100 * 64 * 2


def test_tail_longer_than_context():
    assert kv_bytes(TINY, 300, "q4_0", "q4_0", 1000).overlay == 2 * 2 * 2 * 300 * 64 * 2
    # KVarN at 100 tokens: nothing in the body, sink and tail capped at 100 rows each
    assert kv_bytes(TINY, 100, "kvarn4", "kvarn4", 0) == KVBytes(0, 2 * 2 * 2 * 200 * 64 * 2, 2 * 2 * 2 * 200 * 64 * 2)


def test_bad_inputs():
    with pytest.raises(ValueError, match="unknown KV cache type 'q9_0'"):
        kv_bytes(TINY, 300, "q9_0", "q4_0", 0)
    with pytest.raises(ValueError, match="mix KVarN"):
        kv_bytes(TINY, 300, "kvarn4", "q4_0", 0)
    with pytest.raises(ValueError, match="tail_dtype"):
        kv_bytes(TINY, 300, "q4_0", "q4_0", 0, tail_dtype="q8_0")
    with pytest.raises(ValueError, match="tail must be"):
        kv_bytes(TINY, 300, "q4_0", "q4_0", -1)
    with pytest.raises(ValueError, match="n_ctx"):
        kv_bytes(TINY, 0, "q4_0", "q4_0", 0)
    with pytest.raises(ValueError, match="head dim 96"):
        kv_bytes(Geometry.uniform(1, 1, 96, (None,)), 256, "kvarn4", "kvarn4", 0)
    with pytest.raises(ValueError, match="3 entries for 2 layers"):
        Geometry.uniform(2, 1, 64, (None, None, None))


def test_table_and_labels():
    rows = bytes_table(TINY, 300, [("q4_0", "q4_0"), ("kvarn4", "kvarn4")], tails=(0, 128))
    assert [r["tail_label"] for r in rows] == ["0", "128", "128*", "128"]
    assert rows[1]["delta_tail0_mib"] == 131072 / 2**20
    assert rows[2]["delta_tail0_mib"] == 0 and rows[3]["delta_tail0_mib"] == 0
    assert tail_label("kvarn4", "kvarn4", 200) == "256*"


def test_study_geometry_anchor():
    """SPEC §7 at 64k: a Qwen-3.6-27B-like cache (16 full-attention layers x 4 KV heads x
    D=256, an assumed geometry) gives q4_0 body 1152 MiB, q8_0 + bf16 tail 128 2184 MiB,
    kvarn4 body + overlay (sink + tail 128*) 1136 MiB, as the study reports."""
    geom = Geometry.uniform(16, 4, 256, (None,) * 16)
    mib = 2**20
    assert kv_bytes(geom, 65536, "q4_0", "q4_0", 128).body == 1152 * mib
    assert kv_bytes(geom, 65536, "q8_0", "q8_0", 128).total == 2184 * mib
    assert kv_bytes(geom, 65536, "kvarn4", "kvarn4", 128).total == 1136 * mib
