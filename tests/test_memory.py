"""kvarn.budget.memory against real packed buffers, hand-computed totals and every MiB figure of the study."""

import json
import re
from pathlib import Path

import pytest
import torch

from kvarn import cli
from kvarn.formats import get_format
from kvarn.vocab.cell import CellSpec
from kvarn.vocab.geometry import Geometry, geometry_from_config
from kvarn.vocab import facts
from kvarn.budget.memory import (ACCOUNTINGS, DEFAULT_ACCOUNTING, MIB, KVBytes, bits_per_value, int_at_least, at_tail0, check_accounting,
                                 kv_bytes, resummarize, summary_fields)


# What a user's table of a pair's tails shows, built from kv_bytes as every table is (test-only: no production
# caller needs it, the tables come from the summary).
def bytes_table(geom: Geometry, n_ctx: int, pairs, tails=(0, 128), tail_dtype: str | None = None,
                rot: bool = True, ubatch: int = 512, accounting: str = DEFAULT_ACCOUNTING) -> list[dict]:
    """One row per (K type, V type, tail): body/staging/overlay/total MiB and the Δ vs tail 0."""
    out = []
    for k_type, v_type in pairs:
        base = kv_bytes(geom, n_ctx, CellSpec(k_type, v_type, 0, rot=rot, tail_dtype=tail_dtype), ubatch, accounting)
        for tail in tails:
            b = kv_bytes(geom, n_ctx, CellSpec(k_type, v_type, tail, rot=rot, tail_dtype=tail_dtype), ubatch,
                         accounting)
            out.append({
                "k_type": k_type, "v_type": v_type, "tail": tail,
                "tail_label": facts.tail_label(k_type, v_type, tail), "accounting": accounting,
                **b.mib(), "delta_tail0_mib": (b.total - base.total) / MIB,
            })
    return out


TINY = Geometry.uniform(n_layers=2, n_kv_heads=2, head_dim=64, windows=(None, None))
MODELS = Path(__file__).resolve().parents[1] / "config" / "models"


def _study(name):
    with open(MODELS / f"{name}.json") as f:
        return geometry_from_config(json.load(f))


QWEN = _study("qwen3.6-27b")  # 16 attention layers x 4 KV heads x 256 (+ 48 Gated DeltaNet)
GEMMA = _study("gemma4-31b")  # 50 sliding (W 1024, 16 x 256) + 10 full (4 x 512)


def _real_body(geom, n_ctx, k_type, v_type, ubatch):
    """Sum of the sizes of actually encoded K and V buffers, layer by layer (the `packed` body)."""
    total = 0
    for layer in geom.layers:
        w = layer.window
        stored = n_ctx if w is None else min(n_ctx, w + ubatch)
        for role, name in (("k", k_type), ("v", v_type)):
            fmt = get_format(name, role=role)
            n = stored - stored % fmt.group
            if n == 0:
                continue
            x = torch.randn(layer.n_kv_heads, n, layer.head_dim, generator=torch.Generator().manual_seed(n))
            packed = fmt.encode(x)
            assert packed.data.dtype == torch.uint8
            total += packed.data.shape[0] * packed.data.shape[-1]
    return total


@pytest.mark.parametrize("pair", [("q4_0", "q4_0"), ("q8_0", "q5_1"), ("kvarn4", "kvarn4"), ("kvarn6", "kvarn3"), ("f16", "bf16")])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_body_matches_real_buffers(pair, head_dim, one_thread):
    # a sliding layer of W 200 holds W + ubatch = 264 of the 300 tokens
    geom = Geometry.uniform(3, 2, head_dim, (None, 200, None))
    got = kv_bytes(geom, 300, CellSpec(*pair, 0), ubatch=64)
    assert got.body == _real_body(geom, 300, *pair, ubatch=64) and got.staging == 0


def test_q4_0_by_hand():
    # 300 tokens x 64/32 blocks x 18 bytes, K and V, 2 layers x 2 heads
    assert kv_bytes(TINY, 300, CellSpec("q4_0", "q4_0", 0)) == KVBytes(86400, 0, 0, 86400)
    # + 128 bf16 rows x 64 x 2 bytes, K and V, 2 layers x 2 heads
    assert kv_bytes(TINY, 300, CellSpec("q4_0", "q4_0", 128)) == KVBytes(86400, 0, 131072, 217472)
    # f32 tail doubles the overlay
    assert kv_bytes(TINY, 300, CellSpec("q4_0", "q4_0", 128, tail_dtype="f32")).overlay == 262144


def test_kvarn4_by_hand():
    # 300 tokens -> 2 whole groups in the body (44 tokens wait in the exact tail).
    # Per group at D=64: K tile 64x128 -> 1024*4 + 2*(2*64 + 128) = 4608,
    #                    V tile 128x64 -> 1024*4 + 2*(2*128 + 64) = 4736.
    body = 2 * 2 * 2 * (4608 + 4736)
    # sink 128 + tail 128* rows at f16, K and V, 2 layers x 2 heads; the incomplete group
    # lies inside the tail, so `packed` has no staging
    overlay = 2 * 2 * 2 * (128 + 128) * 64 * 2
    assert kv_bytes(TINY, 300, CellSpec("kvarn4", "kvarn4", 0)) == KVBytes(body, 0, overlay, body + overlay)
    # tail 128* is KVarN's own baseline: asking for 0 or 128 gives the same bytes
    assert kv_bytes(TINY, 300, CellSpec("kvarn4", "kvarn4", 128)) == kv_bytes(TINY, 300, CellSpec("kvarn4", "kvarn4", 0))
    # tail 129 rounds up to 256
    assert kv_bytes(TINY, 300, CellSpec("kvarn4", "kvarn4", 129)).overlay == 2 * 2 * 2 * (128 + 256) * 64 * 2


def test_kvarn4_beellama_by_hand():
    # BeeLlama: ceil(300/128) = 3 groups of records, 256 F16 staging rows over both layers,
    # overlay roundup256(128 + ubatch 64) = 256 rows (Qwen version) or 128 + 1 (Gemma version)
    body = 2 * 2 * 3 * (4608 + 4736)
    staging = 256 * 2 * 2 * 64 * 2 * 2
    row = 2 * 2 * 64 * 2 * 2  # one token's K and V over both layers at f16
    q = kv_bytes(TINY, 300, CellSpec("kvarn4", "kvarn4", 0), ubatch=64, accounting="beellama-qwen")
    assert q == KVBytes(body, staging, 256 * row, body + staging + 256 * row, "beellama-qwen")
    g = kv_bytes(TINY, 300, CellSpec("kvarn4", "kvarn4", 0), ubatch=64, accounting="beellama-gemma")
    assert (g.body, g.staging, g.overlay) == (body, staging, 129 * row)
    # standard types: no staging; overlay N (Qwen version), N + 1 (Gemma), nothing at tail 0
    assert kv_bytes(TINY, 300, CellSpec("q4_0", "q4_0", 100), accounting="beellama-qwen").overlay == 100 * row
    assert kv_bytes(TINY, 300, CellSpec("q4_0", "q4_0", 100), accounting="beellama-gemma").overlay == 101 * row
    assert kv_bytes(TINY, 300, CellSpec("q4_0", "q4_0", 0), accounting="beellama-gemma").overlay == 0


def test_beellama_v043_by_hand():
    # BeeLlama v0.4.3 (CPU, one sequence): a full layer and a sliding one of W 200, n 300, ubatch 64
    geom = Geometry.uniform(2, 2, 64, (None, 200))
    row = 2 * 64 * 2 * 2  # one token's K and V over one layer's 2 heads at f16 / bf16
    tiles = 2 * (4608 + 4736)  # one 128-token group of kvarn4 records over 2 heads (test_kvarn4_by_hand)
    # kvarn4, tail 0 (128*): full layer 3 groups + 3 stage groups (sink + 2), sliding a ring of
    # ceil(264/128) = 3 groups + 2 stage groups; overlay 128 + 1 rows on each
    got = kv_bytes(geom, 300, CellSpec("kvarn4", "kvarn4", 0), ubatch=64, accounting="beellama-v043")
    assert got == KVBytes(2 * 3 * tiles, (3 + 2) * 128 * row, 2 * 129 * row,
                          2 * 3 * tiles + 5 * 128 * row + 2 * 129 * row, "beellama-v043")
    # tail 256: the sliding layer's tail is its window (200): no body, no stage, 201 rows;
    # the full layer keeps its records and stage, 257 rows
    got = kv_bytes(geom, 300, CellSpec("kvarn4", "kvarn4", 256), ubatch=64, accounting="beellama-v043")
    assert (got.body, got.staging, got.overlay) == (3 * tiles, 3 * 128 * row, (257 + 201) * row)
    # standard types: no stage; tail 0 nothing exact; a tail covering the window drops that body
    q4 = 2 * 36  # one token of q4_0 over 2 heads at D 64
    assert kv_bytes(geom, 300, CellSpec("q4_0", "q4_0", 0), ubatch=64, accounting="beellama-v043") == \
        KVBytes(2 * q4 * (300 + 264), 0, 0, 2 * q4 * (300 + 264), "beellama-v043")
    got = kv_bytes(geom, 300, CellSpec("q4_0", "q4_0", 128), ubatch=64, accounting="beellama-v043")
    assert (got.body, got.overlay) == (2 * q4 * (300 + 264), 2 * 129 * row)
    got = kv_bytes(geom, 300, CellSpec("q4_0", "q4_0", 200), ubatch=64, accounting="beellama-v043")
    assert (got.body, got.overlay) == (2 * q4 * 300, 2 * 201 * row)


def test_sliding_layers_hold_window_plus_ubatch():
    geom = Geometry.uniform(2, 2, 64, (None, 200))
    # q4_0: layer 0 keeps 300 tokens, the sliding layer W + ubatch = 264
    assert kv_bytes(geom, 300, CellSpec("q4_0", "q4_0", 0), ubatch=64).body == 2 * 2 * 36 * (300 + 264)
    # ... or every token when n_ctx <= W + ubatch
    assert kv_bytes(geom, 300, CellSpec("q4_0", "q4_0", 0), ubatch=512).body == 2 * 2 * 36 * (300 + 300)
    # kvarn4: the sliding layer keeps 2 whole groups of its 264 rows, no sink, tail 128
    got = kv_bytes(geom, 300, CellSpec("kvarn4", "kvarn4", 0), ubatch=64)
    assert got.body == 2 * (2 + 2) * (4608 + 4736)
    assert got.overlay == 2 * 2 * (256 + 128) * 64 * 2
    # beellama: a ring of ceil((200 + 64)/128) = 3 groups
    assert kv_bytes(geom, 300, CellSpec("kvarn4", "kvarn4", 0), ubatch=64, accounting="beellama-qwen").body == \
        2 * (3 + 3) * (4608 + 4736)
    # window smaller than the requested tail: the tail is capped at the window
    geom = Geometry.uniform(1, 1, 64, (100,))
    assert kv_bytes(geom, 300, CellSpec("q8_0", "q8_0", 512), ubatch=16).overlay == 2 * 100 * 64 * 2
    got = kv_bytes(geom, 300, CellSpec("kvarn4", "kvarn4", 0), ubatch=16)
    assert got.body == 0 and got.overlay == 2 * 100 * 64 * 2


def test_tail_longer_than_context():
    assert kv_bytes(TINY, 300, CellSpec("q4_0", "q4_0", 1000)).overlay == 2 * 2 * 2 * 300 * 64 * 2
    # KVarN at 100 tokens: nothing in the body, sink and tail capped at 100 rows each
    assert kv_bytes(TINY, 100, CellSpec("kvarn4", "kvarn4", 0)) == KVBytes(0, 0, 2 * 2 * 2 * 200 * 64 * 2, 2 * 2 * 2 * 200 * 64 * 2)


def test_state_layers_count_nothing():
    # Qwen's 48 Gated DeltaNet layers have no KV cache: same bytes as 16 attention layers alone
    alone = Geometry.uniform(16, 4, 256)
    for acc in ACCOUNTINGS:
        assert kv_bytes(QWEN, 4096, CellSpec("kvarn4", "kvarn4", 0), accounting=acc) == \
            kv_bytes(alone, 4096, CellSpec("kvarn4", "kvarn4", 0), accounting=acc)


def test_bad_inputs():
    # the cell's own options are refused by CellSpec (tests/test_cell_spec.py); a cell is all kv_bytes takes
    with pytest.raises(TypeError, match="CellSpec"):
        kv_bytes(TINY, 300, ("q4_0", "q4_0", 0))
    with pytest.raises(ValueError, match="n_ctx"):
        kv_bytes(TINY, 0, CellSpec("q4_0", "q4_0", 0))
    with pytest.raises(ValueError, match="ubatch"):
        kv_bytes(TINY, 10, CellSpec("q4_0", "q4_0", 0), ubatch=0)
    with pytest.raises(ValueError, match="head dim 96"):
        kv_bytes(Geometry.uniform(1, 1, 96, (None,)), 256, CellSpec("kvarn4", "kvarn4", 0))
    with pytest.raises(ValueError, match="unknown memory accounting 'beellama'.*packed, beellama-qwen, beellama-gemma, beellama-v043"):
        kv_bytes(TINY, 300, CellSpec("q4_0", "q4_0", 0), accounting="beellama")
    with pytest.raises(ValueError, match="3 entries for 2 layers"):
        Geometry.uniform(2, 1, 64, (None, None, None))


def test_table():
    rows = bytes_table(TINY, 300, [("q4_0", "q4_0"), ("kvarn4", "kvarn4")], tails=(0, 128))
    assert [r["tail_label"] for r in rows] == ["0", "128", "128*", "128"]
    assert rows[1]["delta_tail0_mib"] == 131072 / 2**20
    assert rows[2]["delta_tail0_mib"] == 0 and rows[3]["delta_tail0_mib"] == 0
    assert {r["accounting"] for r in rows} == {"packed"}


# ------------------------------------------------------------------------- the study's figures
# KV cache MiB of one sequence as the study printed them: Qwen 3.6 27B at n_ctx 65,536 and
# Gemma 4 31B at 16,384, ubatch 512. The study's "body" of a KVarN row is records + staging.

QWEN_FIGURES = [  # (K, V, tail, total, body as printed or None)
    ("q4_0", "q4_0", 0, 1152.00, None), ("q4_0", "q4_0", 128, 1160.00, None),
    ("q5_0", "q5_0", 128, 1416.00, None), ("q8_0", "q8_0", 128, 2184.00, None),
    ("kvarn4", "kvarn4", 0, 1184.00, 1136.00), ("kvarn5", "kvarn5", 0, 1440.00, None),
    ("kvarn5", "kvarn4", 0, 1312.00, None), ("kvarn3", "kvarn3", 0, 928.00, None),
    ("kvarn4", "kvarn2", 0, 928.00, None), ("kvarn6", "kvarn5", 0, 1568.00, None),
    ("kvarn6", "kvarn6", 0, 1696.00, None), ("kvarn3", "kvarn2", 0, 800.00, None),
]
GEMMA_FIGURES = [  # (K, V, tail, total, body as printed or None, overlay as printed or None)
    ("q4_0", "q4_0", 128, 808.36, 697.50, 110.86), ("q8_0", "q8_0", 128, 1428.36, None, None),
    ("q2_0", "q2_0", 128, 498.36, None, None), ("kvarn4", "kvarn4", 0, 1008.98, 898.12, 110.86),
    ("kvarn6", "kvarn6", 0, 1318.98, None, None), ("kvarn2", "kvarn2", 0, 698.98, None, None),
]


@pytest.mark.parametrize("k, v, tail, total, body", QWEN_FIGURES)
def test_study_qwen_figures_beellama(k, v, tail, total, body):
    b = kv_bytes(QWEN, 65536, CellSpec(k, v, tail), ubatch=512, accounting="beellama-qwen")
    assert b.total / MIB == pytest.approx(total, abs=0.005)
    if body is not None:
        assert (b.body + b.staging) / MIB == pytest.approx(body, abs=0.005)


@pytest.mark.parametrize("k, v, tail, total, body, overlay", GEMMA_FIGURES)
def test_study_gemma_figures_beellama(k, v, tail, total, body, overlay):
    b = kv_bytes(GEMMA, 16384, CellSpec(k, v, tail), ubatch=512, accounting="beellama-gemma")
    assert b.total / MIB == pytest.approx(total, abs=0.005)
    if body is not None:
        assert (b.body + b.staging) / MIB == pytest.approx(body, abs=0.005)
        assert b.overlay / MIB == pytest.approx(overlay, abs=0.005)


def test_study_premiums_and_packed_reconciliation():
    """KVarN's premium over q4_0 + tail 128 (the study's section 7) under each accounting:
    the accounting decides its sign, which is why tables and figures name it."""
    def mib(geom, n, k, tail, acc):
        return kv_bytes(geom, n, CellSpec(k, k, tail), accounting=acc).total / MIB

    assert mib(QWEN, 65536, "kvarn4", 0, "beellama-qwen") - mib(QWEN, 65536, "q4_0", 128, "beellama-qwen") == 24
    assert mib(GEMMA, 16384, "kvarn4", 0, "beellama-gemma") - mib(GEMMA, 16384, "q4_0", 128, "beellama-gemma") \
        == pytest.approx(200.62, abs=0.005)
    # packed: no staging, sink + tail exact rows instead of BeeLlama's arenas (docs/notes/memory.md)
    q = kv_bytes(QWEN, 65536, CellSpec("kvarn4", "kvarn4", 0))
    assert (q.body, q.staging, q.overlay) == (1120 * MIB, 0, 16 * MIB)  # records + 128 sink + 128 tail rows
    assert q.total == 1136 * MIB  # equals the study's *body* figure by coincidence only (16 MiB each)
    assert mib(QWEN, 65536, "kvarn4", 0, "packed") - mib(QWEN, 65536, "q4_0", 128, "packed") == -24
    g = kv_bytes(GEMMA, 16384, CellSpec("kvarn4", "kvarn4", 0))
    assert g.total / MIB == pytest.approx(798.12, abs=0.005)
    assert kv_bytes(GEMMA, 16384, CellSpec("q4_0", "q4_0", 128)).total / MIB == 807.5


@pytest.mark.parametrize("k", ["q2_0", "q3_0", "q6_0", "q6_1", "q2_1", "q4_0"])
def test_summary_fields_of_a_llamacpp_cpu_cell_with_a_tail(k):
    """A llamacpp-cpu cell's bytes are its exact twin's (the compute path stores nothing else);
    its Δ against tail 0 is the tail's bytes, whichever route each of the two takes."""
    cell = CellSpec(k, k, 128, compute="llamacpp-cpu")
    got = summary_fields(GEMMA, 4096, cell)
    assert got == summary_fields(GEMMA, 4096, CellSpec(k, k, 128))
    at0 = kv_bytes(GEMMA, 4096, CellSpec(k, k, 0, compute="llamacpp-cpu")).total
    assert got["kv_total_bytes_tail0"] == at0 == kv_bytes(GEMMA, 4096, CellSpec(k, k, 0)).total < got["kv_total_bytes"]


def test_summary_fields_and_recompute():
    s = {"n_ctx": 65536, "k_type": "kvarn4", "v_type": "kvarn4", "tail": 0, "tail_dtype": "f16", "rot": True,
         "ubatch": 512, **summary_fields(QWEN, 65536, CellSpec("kvarn4", "kvarn4", 0))}
    assert s["memory_accounting"] == "packed" and s["kv_total_bytes"] == 1136 * MIB
    assert Geometry.from_list(json.loads(json.dumps(s["kv_geometry"]))) == QWEN  # survives summary.json
    other = resummarize(s, "beellama-qwen")
    assert other["memory_accounting"] == "beellama-qwen" and other["kv_total_bytes"] == 1184 * MIB
    assert other["kv_staging_bytes"] == 16 * MIB
    old = {k: v for k, v in s.items() if k not in ("kv_geometry", "memory_accounting")}
    assert resummarize(old, "packed") == {"memory_accounting": "packed"}  # as recorded
    with pytest.raises(ValueError, match="without kv_geometry.*rerun the cell"):
        resummarize(old, "beellama-qwen", where="cells/x/summary.json")
    with pytest.raises(ValueError, match="cells/x/summary.json: memory_accounting: unknown memory accounting 'nope'"):
        resummarize(s, "nope", where="cells/x/summary.json")


# ------------------------------------------------------------------------- kvarn memory


def test_cli_memory_text_and_json(capsys):
    assert cli.main(["memory", "-m", str(MODELS / "qwen3.6-27b.json"), "-c", "65536", "-ctk", "kvarn4",
                     "-ctv", "kvarn4", "--tail", "0", "--accounting", "beellama-qwen"]) == 0
    out = capsys.readouterr().out
    assert "16 full_attention (4 KV heads x 256)" in out and "tail 128*" in out and "accounting beellama-qwen" in out
    assert [ln.split()[1] for ln in out.splitlines()[2:6]] == ["1120.00", "16.00", "48.00", "1184.00"]
    # a study model by name, a config dir, JSON out
    assert cli.main(["memory", "-m", "gemma4-31b", "-c", "16384", "-ctk", "q4_0", "-ctv", "q4_0", "--tail", "128",
                     "-ub", "512", "--accounting", "beellama-gemma", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["accounting"] == "beellama-gemma" and d["tail_label"] == "128"
    assert round(d["body_mib"], 2) == 697.50 and round(d["overlay_mib"], 2) == 110.86
    assert round(d["total_mib"], 2) == 808.36 and d["total_bytes"] == d["body_bytes"] + d["overlay_bytes"]
    assert cli.main(["memory", "-m", str(MODELS.parent.parent / "config" / "models" / "gemma4-31b.json"), "-c",
                     "16384", "-ctk", "kvarn4", "-ctv", "kvarn4", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["accounting"] == "packed" and round(d["total_mib"], 2) == 798.12


def test_cli_memory_config_dir(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "llama", "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "hidden_size": 256, "intermediate_size": 512, "vocab_size": 100}))
    assert cli.main(["memory", "-m", str(tmp_path), "-c", "300", "-ctk", "q4_0", "-ctv", "q4_0", "--json"]) == 0
    # 2 layers x 2 KV heads x head dim 256/4 = 64: the TINY geometry
    assert json.loads(capsys.readouterr().out)["total_bytes"] == 86400
    # a random-weight source is its config file: the same bytes
    assert cli.main(["memory", "-m", f"random:{tmp_path / 'config.json'}", "-c", "300", "-ctk", "q4_0", "-ctv", "q4_0",
                     "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["total_bytes"] == 86400


@pytest.mark.parametrize("argv, needle", [
    (["-m", "no-such-model"], "--model 'no-such-model' is neither a config.json"),
    (["-m", "qwen3.6-27b", "-c", "0"], "--ctx must be a positive integer, got '0'"),
    (["-m", "qwen3.6-27b", "-ctk", "q9_0"], "--k q9_0: K type: unknown KV cache type 'q9_0'"),
    (["-m", "qwen3.6-27b", "-ctv", "kvarn4"], "mix KVarN with a standard type"),
    (["-m", "qwen3.6-27b", "--tail", "-1"], "--tail -1: tail must be an integer >= 0, got -1"),
    (["-m", "qwen3.6-27b", "-ub", "0"], "--ubatch must be a positive integer, got '0'"),
    (["-m", "qwen3.6-27b", "--accounting", "beellama"], "invalid choice: 'beellama'"),
    (["-m", "qwen3.6-27b", "-ctk", "kvarn4", "-ctv", "kvarn4", "--tail-dtype", "q8_0"], "--tail-dtype q8_0: tail_dtype 'q8_0' is not accepted"),
])
def test_cli_memory_bad_values_exit_2(argv, needle, capsys, tmp_path):
    base = {"-m": "qwen3.6-27b", "-c": "4096", "-ctk": "q4_0", "-ctv": "q4_0"}
    args = ["memory"] + [x for kv in base.items() if kv[0] not in argv for x in kv] + argv
    with pytest.raises(SystemExit) as e:
        cli.main(args)
    assert e.value.code == 2 and needle in capsys.readouterr().err


def test_cli_memory_bad_config(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(SystemExit) as e:
        cli.main(["memory", "-m", str(bad), "-c", "64", "-ctk", "q4_0", "-ctv", "q4_0"])
    assert e.value.code == 2 and "is not valid JSON" in capsys.readouterr().err
    d96 = tmp_path / "d96.json"
    d96.write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 1, "num_attention_heads": 2,
                               "num_key_value_heads": 1, "hidden_size": 192, "head_dim": 96}))
    with pytest.raises(SystemExit) as e:
        cli.main(["memory", "-m", str(d96), "-c", "256", "-ctk", "kvarn4", "-ctv", "kvarn4"])
    assert e.value.code == 2 and "head dim 96" in capsys.readouterr().err


def test_standard_sink_by_hand():
    # q4_0 with KVarN's exact tokens (sink 128, tail 128, f16): overlay = (128 + 128) rows x
    # 2 layers x 2 heads x 64 x 2 B x (K, V); a sliding layer keeps no sink.
    b = kv_bytes(TINY, 300, CellSpec("q4_0", "q4_0", 128, tail_dtype="f16", sink=128))
    assert b.overlay == (128 + 128) * 2 * 2 * 64 * 2 * 2 and b.body == 86400
    assert b.overlay == kv_bytes(TINY, 300, CellSpec("kvarn4", "kvarn4", 0)).overlay  # the same exact rows as KVarN's
    slid = Geometry.uniform(n_layers=2, n_kv_heads=2, head_dim=64, windows=(None, 200))
    assert kv_bytes(slid, 300, CellSpec("q4_0", "q4_0", 128, sink=128)).overlay == (256 + 128) * 2 * 64 * 2 * 2
    with pytest.raises(ValueError, match="KVarN's sink is fixed"):
        CellSpec("kvarn4", "kvarn4", 0, sink=0)


# ------------------------------------------------------------------------- edges and bad inputs

ALL_ACCOUNTINGS = "packed, beellama-qwen, beellama-gemma, beellama-v043"
D96 = Geometry.uniform(1, 1, 96, (None,))  # a head dim the block types take only without rotation


def test_int_at_least_names_the_value_and_what_is_accepted():
    assert int_at_least("n_ctx", 1, 1) == 1 and int_at_least("tail", 0, 0) == 0  # the bounds are accepted
    for bad in (0, -3, True, 2.0, "3", None):
        with pytest.raises(ValueError, match=re.escape(f"n_ctx must be a positive integer, got {bad!r}")):
            int_at_least("n_ctx", bad, 1)
    with pytest.raises(ValueError, match=re.escape("tail must be an integer >= 0, got -1")):
        int_at_least("tail", -1, 0)
    with pytest.raises(ValueError, match=re.escape("groups must be an integer >= 2, got 1")):
        int_at_least("groups", 1, 2)
    # through kv_bytes, under the argument's own name
    with pytest.raises(ValueError, match=re.escape("n_ctx must be a positive integer, got True")):
        kv_bytes(TINY, True, CellSpec("q4_0", "q4_0", 0))
    with pytest.raises(ValueError, match=re.escape("ubatch must be a positive integer, got 0")):
        kv_bytes(TINY, 10, CellSpec("q4_0", "q4_0", 0), ubatch=0)


def test_one_token_and_ubatch_one_by_hand():
    # one token of q4_0 at D 64: 2 blocks x 18 bytes, K and V, 2 layers x 2 heads
    assert kv_bytes(TINY, 1, CellSpec("q4_0", "q4_0", 0)) == KVBytes(2 * 2 * 2 * 36, 0, 0, 2 * 2 * 2 * 36)
    # ubatch 1: a sliding layer of W 10 holds 10 + 1 of 300 tokens
    geom = Geometry.uniform(1, 1, 64, (10,))
    assert kv_bytes(geom, 300, CellSpec("q4_0", "q4_0", 0), ubatch=1) == KVBytes(11 * 2 * 36, 0, 0, 11 * 2 * 36)


def test_check_accounting():
    for name in ACCOUNTINGS:
        assert check_accounting(name) == name
    for bad in ("nope", "Packed", None, 1):
        with pytest.raises(ValueError, match=re.escape(
                f"accounting: unknown memory accounting {bad!r}; accepted: {ALL_ACCOUNTINGS}")):
            check_accounting(bad)
    with pytest.raises(ValueError, match=re.escape("--accounting: unknown memory accounting 'x'")):
        check_accounting("x", where="--accounting")


def test_rotation_decides_the_block_types_head_dims():
    # q4_0 at D 96: 3 blocks x 18 bytes a token; accepted without rotation (multiples of 32) only
    assert kv_bytes(D96, 100, CellSpec("q4_0", "q4_0", 0, rot=False)) == KVBytes(100 * 2 * 54, 0, 0, 100 * 2 * 54)
    # K and V each checked at the cell's rotation: q4_0 (54 B) with f16 (96 x 2 B) either way round
    for k, v in (("q4_0", "f16"), ("f16", "q4_0")):
        assert kv_bytes(D96, 100, CellSpec(k, v, 0, rot=False)).body == 100 * (54 + 192)
        with pytest.raises(ValueError, match=re.escape(
                "q4_0: head dim 96 not supported; accepted: multiples of 64 (Hadamard pre-rotation)")):
            kv_bytes(D96, 100, CellSpec(k, v, 0))


# ------------------------------------------------------------------------- bytes_table


def test_table_rows_by_hand():
    # q4_0 K (36 B a token at D 64) and q8_0 V (2 x 34 = 68 B), 300 tokens, 2 layers x 2 heads;
    # tail 128 adds 128 bf16 rows x 64 x 2 B, K and V, 2 layers x 2 heads
    body, overlay = 300 * (36 + 68) * 2 * 2, 128 * 2 * 64 * 2 * 2 * 2
    rows = bytes_table(TINY, 300, [("q4_0", "q8_0")], tails=(0, 128))
    common = {"k_type": "q4_0", "v_type": "q8_0", "accounting": "packed", "body_mib": body / MIB, "staging_mib": 0.0}
    assert rows == [
        {**common, "tail": 0, "tail_label": "0", "overlay_mib": 0.0, "total_mib": body / MIB, "delta_tail0_mib": 0.0},
        {**common, "tail": 128, "tail_label": "128", "overlay_mib": overlay / MIB, "total_mib": (body + overlay) / MIB,
         "delta_tail0_mib": overlay / MIB},
    ]


def test_table_defaults_rotation_and_ubatch():
    # rotation on by default: q4_0 refuses D 96 unless rot=False (54 B a token, K and V)
    with pytest.raises(ValueError, match="q4_0: head dim 96 not supported"):
        bytes_table(D96, 100, [("q4_0", "q4_0")])
    rows = bytes_table(D96, 100, [("q4_0", "q4_0")], tails=(0, 32), rot=False)
    assert [r["body_mib"] for r in rows] == [100 * 2 * 54 / MIB] * 2
    # ubatch 512 by default: a sliding layer of W 100 holds 612 of 1000 tokens (72 B each)
    rows = bytes_table(Geometry.uniform(1, 1, 64, (100,)), 1000, [("q4_0", "q4_0")], tails=(0,))
    assert rows[0]["body_mib"] == 612 * 72 / MIB


def test_table_tail_dtype_and_accounting_reach_both_cells():
    # kvarn4 with an f32 exact copy: a row is 2 x 64 x 4 B x 2 heads x 2 layers = 2048 B;
    # tail 0 holds sink 128 + tail 128 rows, tail 256 sink 128 + 256: the delta is 128 rows
    row = 2 * 64 * 4 * 2 * 2
    rows = bytes_table(TINY, 300, [("kvarn4", "kvarn4")], tails=(0, 256), tail_dtype="f32")
    assert [r["overlay_mib"] for r in rows] == [256 * row / MIB, 384 * row / MIB]
    assert [r["delta_tail0_mib"] for r in rows] == [0.0, 128 * row / MIB]
    # q4_0 tail 128 at f32: twice the bf16 overlay of test_table_rows_by_hand
    assert bytes_table(TINY, 300, [("q4_0", "q4_0")], tails=(128,), tail_dtype="f32")[0]["overlay_mib"] == \
        128 * row / MIB
    # beellama-gemma (test_kvarn4_beellama_by_hand): 3 groups of records, 256 staging rows,
    # overlay N + 1 rows at f16 (1024 B over both layers): the delta of tail 256 is 257 - 129 rows
    body, staging, f16_row = 2 * 2 * 3 * (4608 + 4736), 256 * 2 * 2 * 64 * 2 * 2, 2 * 2 * 64 * 2 * 2
    rows = bytes_table(TINY, 300, [("kvarn4", "kvarn4")], tails=(0, 256), ubatch=64, accounting="beellama-gemma")
    assert [(r["accounting"], r["body_mib"], r["staging_mib"], r["overlay_mib"]) for r in rows] == [
        ("beellama-gemma", body / MIB, staging / MIB, 129 * f16_row / MIB),
        ("beellama-gemma", body / MIB, staging / MIB, 257 * f16_row / MIB)]
    assert [r["delta_tail0_mib"] for r in rows] == [0.0, 128 * f16_row / MIB]


# ------------------------------------------------------------------------- summary fields, recompute


def test_at_tail0_is_the_pair_at_tail_0_on_the_default_compute():
    cell = CellSpec("q4_0", "q4_0", 128, rot=False, tail_dtype="f32", compute="llamacpp-cpu")
    assert at_tail0(cell) == CellSpec("q4_0", "q4_0", 0, rot=False, tail_dtype="f32", compute="exact")


def test_summary_fields_by_hand_under_beellama():
    # as test_table_tail_dtype_and_accounting_reach_both_cells: kvarn4, 300 tokens, ubatch 64, beellama-gemma
    body, staging, f16_row = 2 * 2 * 3 * (4608 + 4736), 256 * 2 * 2 * 64 * 2 * 2, 2 * 2 * 64 * 2 * 2
    got = summary_fields(TINY, 300, CellSpec("kvarn4", "kvarn4", 256), ubatch=64, accounting="beellama-gemma")
    assert got == {
        "memory_accounting": "beellama-gemma", "kv_body_bytes": body, "kv_staging_bytes": staging,
        "kv_overlay_bytes": 257 * f16_row, "kv_total_bytes": body + staging + 257 * f16_row,
        "kv_total_bytes_tail0": body + staging + 129 * f16_row,
        "kv_bf16_bytes": 2 * 2 * 64 * 300 * 2 * 2,  # layers x heads x dim x tokens x (K, V) x 2 B
        "kv_geometry": [["full_attention", 2, 64, None, False]] * 2,
    }


def test_bits_per_value_by_hand():
    # blocks of 32 values with an f16 scale: q8_0 34 B, q4_0 18 B per 32 values -> 8.5 and 4.5 bits
    for t, bits in (("q8_0", 8.5), ("q4_0", 4.5), ("bf16", 16.0)):
        f = summary_fields(TINY, 256, CellSpec(t, t, 0))
        assert bits_per_value(f["kv_total_bytes"], f["kv_bf16_bytes"]) == bits
    # the BF16 reference holds what the cache holds: a sliding layer of W 100 stores W + ubatch tokens
    f = summary_fields(FULL_SLIDING, 1000, CellSpec("q4_0", "q4_0", 0), ubatch=64)
    assert f["kv_bf16_bytes"] == (1000 + 164) * 64 * 2 * 2
    with pytest.raises(ValueError, match="kv_bf16_bytes must be a positive byte count, got 0"):
        bits_per_value(100, 0)


# a full layer and a sliding one of W 100, one KV head of 64 each; q4_0 is 72 B a token, K and V
FULL_SLIDING = Geometry.uniform(2, 1, 64, (None, 100))


def _recorded(**kw):
    return {"n_ctx": 1000, "k_type": "q4_0", "v_type": "q4_0", "tail": 128, "memory_accounting": "packed",
            "kv_geometry": [["full_attention", 1, 64, None, False], ["sliding_attention", 1, 64, 100, False]], **kw}


def test_resummarize_reads_every_recorded_option():
    # ubatch 64, f32 rows (512 B), sink 64. Full layer: 1000 tokens, 128 tail + 64 sink rows;
    # sliding layer: 100 + 64 = 164 tokens, tail capped at its window (100 rows), no sink
    got = resummarize(_recorded(ubatch=64, tail_dtype="f32", sink_requested=64, rot=True), "packed")
    body, overlay = (1000 + 164) * 72, (128 + 64 + 100) * 512
    assert got == {"memory_accounting": "packed", "kv_body_bytes": body, "kv_staging_bytes": 0,
                   "kv_overlay_bytes": overlay, "kv_total_bytes": body + overlay,
                   "kv_total_bytes_tail0": body + 64 * 512, "kv_bf16_bytes": (1000 + 164) * 256,
                   "kv_geometry": _recorded()["kv_geometry"]}
    # nothing recorded: ubatch 512 (the sliding layer holds 612 tokens), bf16 rows (256 B), no sink
    got = resummarize(_recorded(), "packed")
    assert (got["kv_body_bytes"], got["kv_overlay_bytes"]) == ((1000 + 612) * 72, (128 + 100) * 256)


def test_resummarize_reads_the_rotation():
    rec = {"n_ctx": 100, "k_type": "q4_0", "v_type": "q4_0", "tail": 0, "kv_geometry": D96.to_list()}
    assert resummarize({**rec, "rot": False}, "packed")["kv_body_bytes"] == 100 * 2 * 54
    for rot in ({"rot": True}, {}):  # rotated, or not recorded (rotation is the default): D 96 is refused
        with pytest.raises(ValueError, match="q4_0: head dim 96 not supported"):
            resummarize({**rec, **rot}, "packed")


def test_resummarize_without_geometry_keeps_its_recorded_accounting():
    old = {"n_ctx": 1000, "k_type": "q4_0", "v_type": "q4_0", "tail": 128, "memory_accounting": "beellama-qwen"}
    assert resummarize(old, "beellama-qwen") == {"memory_accounting": "beellama-qwen"}
    with pytest.raises(ValueError, match=re.escape(
            "summary.json: written under memory accounting 'beellama-qwen' without kv_geometry, so it cannot be "
            "recomputed under 'packed'; rerun the cell")):
        resummarize(old, "packed")
    with pytest.raises(ValueError, match=re.escape(
            f"summary.json: memory_accounting: unknown memory accounting 'nope'; accepted: {ALL_ACCOUNTINGS}")):
        resummarize(old, "nope")
