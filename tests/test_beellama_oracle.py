"""kvarn against BeeLlama's own CPU quantizers, without a BeeLlama build.

tests/fixtures/beellama/beellama_cpu.npz holds bytes that BeeLlama (provenance.json: commit,
build, command) wrote for deterministic inputs: KVarN records from its CPU KV-cache store
and blocks from its CPU `from_float` of every block type. kvarn must reproduce them, and
bench/oracles/beellama/quant_oracle.py's readers of BeeLlama's byte layouts are checked here too.
"""

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from kvarn.llamacpp_cpu import q8
from kvarn.formats import get_format
from kvarn.formats import kvarn_tiles, kvarn_type
from kvarn.formats.hadamard import hadamard

from bench.oracles.beellama import memory as bee_memory
from bench.oracles.beellama import quant_fields
from bench.oracles.beellama import quant_oracle as QO
from bench.oracles.beellama import table as bee_table

ROOT = Path(__file__).resolve().parents[1]
FIX = ROOT / "tests" / "fixtures" / "beellama"

DATA = np.load(FIX / "beellama_cpu.npz")


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def test_provenance_names_the_commit():
    prov = json.loads((FIX / "provenance.json").read_text())
    assert len(prov["commit"]) == 40 and prov["iters"] == kvarn_tiles.ITERS


@pytest.mark.parametrize("case", QO.FIXTURE_KVARN, ids=[c[0] for c in QO.FIXTURE_KVARN])
def test_kvarn_records_match_beellama_byte_for_byte(case):
    name, bits, role, t, h, d, seed = case
    x = QO.fixture_input(t, h, d, seed)
    bee = DATA[name]
    assert bee.shape == (t // 128, h * d // 128, kvarn_type.payload_nbytes(128, 128, bits) + 768)
    ours = quant_fields.kvarn_records(x, bits, role)
    for part, b, o in zip(("payload", "scale", "zero", "other"), quant_fields.record_fields(bee, bits), quant_fields.record_fields(ours, bits)):
        assert np.array_equal(b, o), f"{name}: {part} differs in {int((b != o).sum())} entries"


def test_record_fields_split_the_layout():
    """payload | scale[128] | zero[128] | other[128], fp16 little-endian: hand-made record."""
    bits = 3
    pb = kvarn_type.payload_nbytes(128, 128, bits)
    rec = np.zeros((1, 1, pb + 768), np.uint8)
    rec[0, 0, 5] = 7
    rec[0, 0, pb:pb + 2] = (0x00, 0x3C)  # scale[0] = 1.0
    rec[0, 0, pb + 256 + 2:pb + 256 + 4] = (0x00, 0xC0)  # zero[1] = -2.0
    rec[0, 0, pb + 512 + 254:] = (0x00, 0x38)  # other[127] = 0.5
    payload, scale, zero, other = quant_fields.record_fields(rec, bits)
    assert payload[0, 0, 5] == 7 and payload.shape[-1] == pb
    assert scale.view(np.float16)[0, 0, 0] == 1.0 and zero.view(np.float16)[0, 0, 1] == -2.0
    assert other.view(np.float16)[0, 0, 127] == 0.5 and other.view(np.float16)[0, 0, :127].sum() == 0
    with pytest.raises(ValueError, match="record is"):
        quant_fields.record_fields(rec[..., :-2], bits)


UPSTREAM_LAYOUT = ("q8_0", "q5_0", "q5_1", "q4_0", "q4_1")
SAME_ALGORITHM = ("q6_0", "q6_1", "q5_0", "q5_1", "q4_0", "q4_1", "q3_0", "q3_1", "q2_0", "q2_1")


@pytest.mark.parametrize("name", SAME_ALGORITHM)
def test_blocks_match_beellama(name):
    """d, m and every code of every block as BeeLlama's CPU cache writes them (rows 0-1 on
    exact rounding ties); for the upstream layouts the raw bytes too."""
    x = QO.fixture_block_input()
    raw = DATA[f"block_{name}"]
    bq, bd, bm = quant_fields.beellama_block_fields(name, raw)
    kq, kd, km = quant_fields.kvarn_block_fields(name, x)
    assert np.array_equal(bq, kq) and np.array_equal(bd, kd)
    assert (bm is None and km is None) or np.array_equal(bm, km)
    if name in UPSTREAM_LAYOUT:
        ours = get_format(name, role="k", rot=False).encode(torch.from_numpy(x)[None]).data.numpy().reshape(-1)
        assert np.array_equal(ours, raw)


def test_q8_0_beellama_cpu_rounds_ties_to_even():
    """BeeLlama's CPU q8_0 cache row is the x86 SIMD quantize_row_q8_0 (ties to even), as
    kvarn.llamacpp_cpu.compute's llamacpp-cpu emulation has it; kvarn's q8_0 format is ggml's reference
    (roundf: ties away from zero). They differ exactly on the tie blocks of the fixture."""
    x = QO.fixture_block_input()
    bq, bd, _ = quant_fields.beellama_block_fields("q8_0", DATA["block_q8_0"])
    q, d16, _ = q8.quantize_q8(torch.from_numpy(x), "q8_0")
    assert np.array_equal(bq, q.reshape(-1, 32).long().numpy())
    assert np.array_equal(bd, d16.reshape(-1).to(torch.float16).view(torch.int16).numpy().astype(np.uint16))
    kq, kd, _ = quant_fields.kvarn_block_fields("q8_0", x)
    xb = x.reshape(-1, 32).astype(np.float32)
    amax = np.abs(xb).max(1, keepdims=True)
    v = xb * (np.float32(127) / amax)
    tie = (np.abs(v - np.trunc(v)) == 0.5).any(1)
    assert tie.sum() > 0
    assert np.array_equal((bq != kq).any(1), tie)


def test_iq4_nl_differs_by_design_but_decodes_alike_here():
    """BeeLlama's CPU iq4_nl is ggml's quantize_row_iq4_nl_ref (scale search); kvarn follows
    the CUDA set_rows path (DESIGN §3). On the fixture's blocks they agree wherever no tie moved."""
    x = QO.fixture_block_input()
    bq, bd, _ = quant_fields.beellama_block_fields("iq4_nl", DATA["block_iq4_nl"])
    kq, kd, _ = quant_fields.kvarn_block_fields("iq4_nl", x)
    same = (bq == kq).all(1) & (bd == kd)
    assert same[2 * 4:].all()  # rows 2.. (no ties): identical


def _blocks_bytes(name, codes, d, m=None):
    """BeeLlama's block bytes written out by hand from its ggml-common.h structs."""
    out = [np.array([d], np.float16).view(np.uint8)]
    if m is not None:
        out.append(np.array([m], np.float16).view(np.uint8))
    q = np.asarray(codes)
    if name == "q6_0":
        qh = np.zeros(8, np.uint8)
        for j in range(16):
            qh[j % 8] |= ((q[j] >> 4) | ((q[j + 16] >> 4) << 2)) << (4 * (j // 8))
        qs = (q[:16] & 15) | ((q[16:] & 15) << 4)
        out += [qh, qs.astype(np.uint8)]
    elif name == "q3_0":
        qh = sum(int((q[j] >> 2) & 1) << j for j in range(32))
        qs = np.zeros(8, np.uint8)
        for j in range(32):
            qs[j % 8] |= (q[j] & 3) << (2 * (j // 8))
        out += [np.array([qh], "<u4").view(np.uint8), qs]
    elif name == "q2_1":
        qs = np.zeros(8, np.uint8)
        for j in range(32):
            qs[j % 8] |= q[j] << (2 * (j // 8))
        out += [qs]
    return np.concatenate(out)


@pytest.mark.parametrize("name,nlev,m", [("q6_0", 64, None), ("q3_0", 8, None), ("q2_1", 4, -1.5)])
def test_beellama_block_fields_reads_hand_made_blocks(name, nlev, m):
    codes = (np.arange(32) * 7 + 3) % nlev
    raw = _blocks_bytes(name, codes, -0.25, m)
    q, d, mm = quant_fields.beellama_block_fields(name, raw)
    f16 = lambda v: np.array([v], np.float16).view(np.uint16)[0]  # noqa: E731
    assert np.array_equal(q[0], codes) and d[0] == f16(-0.25)
    assert (mm is None) if m is None else mm[0] == f16(m)
    with pytest.raises(ValueError, match="BeeLlama blocks"):
        quant_fields.beellama_block_fields(name, raw[:-1])


# --- the arithmetic pieces, against independent scalar references ------------------------------
def _butterfly_c(v):
    """BeeLlama's in-place loop, scalar, in numpy float32."""
    v = v.astype(np.float32).copy()
    n, stride = len(v), 1
    while stride < n:
        for base in range(0, n, 2 * stride):
            for i in range(stride):
                a, b = v[base + i], v[base + stride + i]
                v[base + i], v[base + stride + i] = np.float32(a + b), np.float32(a - b)
        stride *= 2
    return v


@pytest.mark.parametrize("d", [128, 256, 512])
def test_rotate_is_beellamas_butterfly(d):
    x = QO.fixture_input(2, 1, d, 9).reshape(2, d)
    got = kvarn_tiles.rotate(torch.from_numpy(x)).numpy()
    s = d // 128
    for t in range(2):
        sl = np.stack([_butterfly_c(x[t, i * 128:(i + 1) * 128]) * np.float32(0.08838834764831845) for i in range(s)])
        if s > 1:
            scale = np.float32(0.7071067811865475 if s == 2 else 0.5)
            sl = np.stack([_butterfly_c(sl[:, c]) * scale for c in range(128)], 1)
        assert np.array_equal(got[t], sl.reshape(-1))
    # and it is H_D up to fp32 rounding
    ref = torch.from_numpy(x).double() @ hadamard(d, dtype=torch.float64)
    assert torch.allclose(torch.from_numpy(got).double(), ref, rtol=0, atol=1e-5 * float(np.abs(x).max()))


def test_sample_std_is_the_one_pass_float64_loop():
    y = torch.from_numpy(QO.fixture_input(4, 1, 128, 11).reshape(4, 128))
    got = kvarn_tiles.sample_std(y, -1)
    for r in range(4):
        s = ss = 0.0
        for v in y[r].tolist():
            s += v
            ss += v * v
        mean = s / 128
        want = np.float32(math.sqrt(max(0.0, (ss - 128 * mean * mean) / 127)))
        assert got[r].item() == want
    assert kvarn_tiles.sample_std(torch.full((1, 128), 0.3), -1).item() == 0.0  # clamped at 0, not NaN


def test_exp32_log32_are_float64_rounded():
    """KVarN's exp/log: the float64 result rounded to fp32 (nearest to glibc's expf/logf,
    which BeeLlama calls); torch's fp32 exp/log differ from it in the last bit on ~1-10 % of
    arguments, enough to move a tie between passes."""
    x = torch.from_numpy(QO.fixture_input(1, 1, 4096, 13).reshape(-1))
    want_exp = np.array([np.float32(math.exp(v)) for v in x.tolist()])
    pos = x.abs() + 1e-3
    want_log = np.array([np.float32(math.log(v)) for v in pos.tolist()])
    assert np.array_equal(kvarn_tiles.exp32(x).numpy(), want_exp)
    assert np.array_equal(kvarn_tiles.log32(pos).numpy(), want_log)


def test_q6_0_refit_sums_in_beellamas_order():
    """q6_0's refit d = Σ w·l·x / Σ w·l² with fp32 sums in quantize_row_q6_0_ref's order
    (pairs j, j + 16, added one after the other): a numpy float32 loop written from the C."""
    x = QO.fixture_input(64, 1, 4096, 17).reshape(-1, 32)
    f = np.float32
    d0 = np.array([b[np.argmax(np.abs(b))] for b in x], f) / f(-32)
    idv = np.where(d0 != 0, f(1) / np.where(d0 != 0, d0, f(1)), f(0)).astype(f)
    q = np.minimum(63, np.trunc(x * idv[:, None] + f(32.5))).astype(f) - f(32)
    sx = np.zeros(len(x), f)
    s2 = np.zeros(len(x), f)
    for j in range(16):
        x0, x1, v0, v1 = x[:, j], x[:, j + 16], q[:, j], q[:, j + 16]
        w0, w1 = x0 * x0, x1 * x1
        sx = sx + (w0 * v0 * x0 + w1 * v1 * x1)
        s2 = s2 + (w0 * v0 * v0 + w1 * v1 * v1)
    want = np.where(s2 > 0, sx / np.where(s2 > 0, s2, f(1)), d0).astype(np.float16).view(np.uint16)
    _, kd, _ = quant_fields.kvarn_block_fields("q6_0", x)
    assert np.array_equal(kd, want)


def test_table_row_reads_beellama_log_and_kvarn_summary(tmp_path):
    log = tmp_path / "bee.log"
    log.write_text("====== KL divergence statistics ======\nMean    KLD:   0.010000 ±   0.000200\n"
                   "Maximum KLD:   0.300000\n99.0%   KLD:   0.050000\nMedian  KLD:   0.004000\n"
                   "Same top p: 95.500 ± 0.400 %\n")
    cell = tmp_path / "cell"
    cell.mkdir()
    (cell / "summary.json").write_text(json.dumps({"kld_median": 0.005, "kld_mean": 0.009, "kld_p99": 0.04,
                                                   "same_top": 0.96}))
    r = bee_table.row("kvarn4", log, cell)  # a summary without `compute` is an exact one
    assert r == ["kvarn4", "exact", "0.004000", "0.005000", "1.25", "0.010000", "0.009000", "0.90", "0.0500", "0.0400",
                 "95.50", "96.00"]
    (cell / "summary.json").write_text(json.dumps({"kld_median": 0.005, "kld_mean": 0.009, "kld_p99": 0.04,
                                                   "same_top": 0.96, "compute": "llamacpp-cpu"}))
    assert bee_table.row("kvarn4", log, cell)[1] == "llamacpp-cpu"
    assert len(bee_table.HEADER) == len(r) and bee_table.HEADER[1] == "kvarn compute"



# A BeeLlama -v start as it prints it (lines from a real q4_0 --kv-tail-tokens 128 log, numbers
# changed): a fit probe that allocates nothing, then the real context with a full and a SWA cache.
BEE_START = """\
0.00.018.792 I cmn  common_init_: fitting params to device memory ...
0.02.077.274 I llama_context: constructing llama_context
0.02.094.272 I llama_kv_cache:        CPU KV buffer size =     0.00 MiB
0.02.094.416 I llama_kv_cache:        CPU KV tail buffer size =     0.00 MiB
0.02.095.747 I sched_reserve: reserving ...
0.02.966.000 I common_fit_params: fitting params to free memory took 8.63 seconds
0.03.077.274 I llama_context: constructing llama_context
0.03.094.272 I llama_kv_cache:        CPU KV buffer size =     3.38 MiB
0.03.094.416 I llama_kv_cache:        CPU KV tail buffer size =     0.38 MiB
0.03.094.448 I llama_kv_cache: standard KV tail plan: storage=compact_overlay requested=128 effective=128
0.03.094.491 I llama_kv_cache: tail type=bf16 requested=128 effective=128 slots=129 (arena=129 = 129*1, sink=0)
0.03.095.138 I llama_kv_cache:        CPU KV buffer size =     4.22 MiB
0.03.095.243 I llama_kv_cache:        CPU KV tail buffer size =     1.89 MiB
0.03.095.747 I sched_reserve: reserving ...
"""


def test_memory_log_sums_the_last_contexts_buffers():
    mem = bee_memory
    r = mem.parse_log(BEE_START)
    assert [b[2] for b in r["buffers"]] == [3.38, 0.38, 4.22, 1.89]  # the probe's 0.00 lines are not counted
    assert r["total_mib"] == 9.87 and r["reached"] and "error" not in r
    assert r["tail_plan"] == ["storage=compact_overlay requested=128 effective=128"]
    assert mem.rounding(r) == pytest.approx(0.02)  # four lines printed to 2 decimals
    assert mem.rounding({"buffers": [("a", "KV", 1.0), ("a", "KV tail", 0.0)]}) == pytest.approx(0.01)
    kvarn = ("0.01.000.000 I llama_context: constructing llama_context\n"
             "0.01.000.001 I KVarN cache: stage_groups=2 tail_groups=1 n_batch=2048 n_ubatch=512\n"
             "0.01.000.002 I llama_kv_cache_kvarn:        CPU KVarN buffer size =     1.25 MiB\n"
             "0.01.000.003 I llama_kv_cache_kvarn:        CPU KVarN tail buffer size =     0.50 MiB\n"
             "0.01.000.004 I sched_reserve: reserving ...\n")
    r = mem.parse_log(kvarn)
    assert [(b[1], b[2]) for b in r["buffers"]] == [("KVarN", 1.25), ("KVarN tail", 0.50)] and r["total_mib"] == 1.75
    assert r["kvarn_stage"] == ["stage_groups=2 tail_groups=1 n_batch=2048 n_ubatch=512"]


def test_memory_log_stopped_in_the_probes_has_no_sizes():
    mem = bee_memory
    probe = BEE_START.split("0.02.966.000")[0]  # ends with the probe's sched_reserve
    r = mem.parse_log(probe)
    assert not r["reached"] and r["buffers"] == [] and r["total_mib"] is None


def test_memory_log_names_a_refusal():
    mem = bee_memory
    r = mem.parse_log(  # SmolLM2 (head dim 64) with -ctk kvarn4, as BeeLlama v0.4.3 logs it
        "0.00.018.792 I cmn  common_init_: fitting params to device memory ...\n"
        "0.00.700.000 I llama_context: constructing llama_context\n"
        "0.00.719.310 E llama_init_from_model: cannot enable kvarn_k4v4_g128: KVarN requires 128-, 256-, or "
        "512-dimensional key/value heads\n"
        "0.00.838.792 E common_fit_params: encountered an error while trying to fit params to free device memory\n"
        "# done rc=1\n")
    assert not r["reached"] and r["total_mib"] is None
    assert r["error"] == ("llama_init_from_model: cannot enable kvarn_k4v4_g128: KVarN requires 128-, 256-, or "
                          "512-dimensional key/value heads")


def test_memory_grid_is_the_issues():
    mem = bee_memory
    gemma = [c.name for c in mem.grid("gemma3-270m")]
    assert len(gemma) == 6 * 2 + 6 * 2 + 4 and len(set(gemma)) == len(gemma)
    assert {"q4_0-t0", "q4_0-t128", "kvarn4-t0", "kvarn4-t512", "kvarn4-kvarn2-t0"} <= set(gemma)
    assert [c.name for c in mem.grid("smollm2-135m")][-1] == "kvarn4-t0" and len(mem.grid("smollm2-135m")) == 13
