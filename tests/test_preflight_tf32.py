"""kvarn.budget.preflight under compute tf32-attn, by hand: the body stays fp32 (only bf16-attn
narrows it), and the operands are fp32 rounded by kvarn.kvcache.rounding, whose temporaries, not the
bf16 operands of bf16-attn, set the attention's peak."""

from __future__ import annotations

from pathlib import Path

from kvarn.budget import preflight
from kvarn.vocab.options import BF16_ATTN, TF32_ATTN
from kvarn.weights.sources import ModelSpec

REPO = Path(__file__).resolve().parents[1]
GIB = 2**30


def test_tf32_rounding_temporaries_by_hand():
    # kvarn.kvcache.rounding._tf32 on an fp32 tensor of N elements: (word & 0x7FFFFFFF) int32 (4N)
    # then its `< 0x7F800000` bool (1N), the int32 freed; word + half (4N) and its & ~0x1FFF (4N)
    # beside the bool: 9N at the peak; the first freed, `where` writes the fp32 result (4N) beside
    # the masked word and the bool: 9N again. Beyond the input: 9 bytes per element.
    assert preflight.TF32_ROUNDING_BYTES == 9


def test_qwen_64k_tf32_attn_cell_by_hand():
    """Qwen 3.6 at 65,536 (16 full-attention layers of 4 KV heads of 256; 24 query heads; ubatch 512)."""
    spec = ModelSpec("q", f"random:{REPO}/config/models/qwen3.6-27b.json")
    u, n, H, kv, d = 512, 65536, 24, 4, 256
    masks = 4 * u * n  # 134,217,728: four bool [u, n] masks
    io = H * u * d * 4 * 2  # 25,165,824: the fp32 query and (tf32) its rounded copy
    # flex: [body ; exact] = 2n rows; K has kv x 2n x d = 134,217,728 elements, V as many.
    e = kv * 2 * n * d
    assert e == 134_217_728
    # Rounding Q, K and V in turn, V last: K before and after (4 + 4 B), V (4 B) and its 9 B of
    # temporaries: 21 B per element of K, i.e. 10.5 B per element of [K ; V] (bf16-attn: 2):
    rounding_peak = e * 21  # 2,818,572,288 B = 2.625 GiB
    # then the BlockMask's grid, u x 2n (query, row) pairs of two int64 and two bool (18 B), beside
    # the rounded K and V (8 B per element of K): 1,207,959,552 + 1,073,741,824 = 2,281,701,376 B
    grid_phase = u * 2 * n * 18 + e * 8
    assert rounding_peak > grid_phase
    flex = masks + io + rounding_peak
    assert flex == 2_977_955_840  # 2.773 GiB
    # ref: one 128-query block's K and V (kv x n x d = 67,108,864 elements each) and its scores
    # (H x 128 x n = 201,326,592 elements). Rounding P: scores and numerators (4 + 4 B) and P's 9 B
    # of temporaries per score, K and V (8 B per K element): 3,422,552,064 + 536,870,912;
    # rounding V later: scores, numerators and rounded P (12 B) per score, K, V and V's 9 B:
    # 2,415,919,104 + 1,140,850,688. The first is larger.
    kb, sc = kv * n * d, H * 128 * n
    ref = masks + io + max(kb * 8 + sc * 17, kb * 17 + sc * 12)
    assert ref == masks + io + 3_959_422_976
    for path, want in (("flex", flex), ("ref", ref)):
        est = preflight.preflight(spec, n, u, "cuda", "bfloat16", "unused", baseline=False, dry_run=True,
                                  attention=path, compute=TF32_ATTN)
        assert est.device_parts["attention temporaries"] == want, path
        # the fp32 body and the 16-bit exact copy, K and V: 12 B per row and channel, as the exact path
        # (16 layers x 4 heads x 65,536 rows x 256 x 12 = 12 GiB; bf16-attn's bf16 body: 8 GiB)
        assert est.device_parts["cache copies"] == 16 * 4 * n * 256 * 12 == 12 * GIB
    # The whole cell on the GPU's path (flex): weights 50.10 GiB, cache 12, Gated DeltaNet state 0.15,
    # attention 2.77, activations 0.08, logits 0.59 = 65.69 GiB, with 10 % headroom 72.26 GiB (bf16-attn
    # 66.76, counting tf32 as it: the 8-byte rows and 2-byte operands). It fits an 80 GB H100.
    tf32 = preflight.preflight(spec, n, u, "cuda", "bfloat16", "unused", baseline=False, dry_run=True,
                               compute=TF32_ATTN)
    bf16 = preflight.preflight(spec, n, u, "cuda", "bfloat16", "unused", baseline=False, dry_run=True,
                               compute=BF16_ATTN)
    assert tf32.device_parts["attention temporaries"] == flex  # "auto" is flex on CUDA
    assert round(tf32.device_bytes / GIB, 2) == 72.26 and round(bf16.device_bytes / GIB, 2) == 66.76
    assert tf32.device_bytes < 79 * GIB  # an H100's 80 GB (79.6 GiB) less its CUDA context: ~6 GiB to spare
    # the tf32-attn baseline keeps its bf16 body (4 B per row and channel), as every baseline
    base = preflight.preflight(spec, n, u, "cuda", "bfloat16", "unused", baseline=True, dry_run=True,
                               compute=TF32_ATTN)
    assert base.device_parts["cache copies"] == 16 * 4 * n * 256 * 4


def test_the_other_computes_are_unchanged():
    # exact and bf16-attn as before (tests/test_attention_rounding.py works them out): flex's operands
    # and grid summed, 4 and 2 B per element
    u, n, H, kv, d = 512, 65536, 24, 4, 256
    masks, io, rows = 4 * u * n, H * u * d * 8, 2 * n
    for rounding, b in ((None, 4), ("bfloat16", 2)):
        assert preflight.attention_temporaries("flex", rounding, u, n, H, kv, d) == \
            masks + 2 * kv * rows * d * b + u * rows * 18 + io
