"""bench/gpu/projection.py: the article's GPU-hours before the device. Hand-worked FLOPs of a tiny
made-up geometry, the roofline's two sides, the article's cell counts against config/article.yaml's
own lists, measured rows in place of modelled ones, the total as the sum of its rows, the
torch-free import and the command."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import yaml

from bench.gpu import projection as pj
from bench.gpu import traffic

ROOT = pj.REPO

# One full-attention layer: hidden 8, MLP 16, 2 query heads and 1 KV head of dim 4, vocabulary 10.
TINY = {"model_type": "llama", "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 1,
        "layer_types": ["full_attention"], "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 4,
        "vocab_size": 10}


@pytest.fixture
def tiny(tmp_path, monkeypatch):
    (tmp_path / "tiny.json").write_text(json.dumps(TINY))
    monkeypatch.setattr(traffic, "MODELS", tmp_path)
    return "tiny"


def test_tiny_geometry_flops_by_hand(tiny):
    # GEMM weights: MLP 3*8*16 = 384; q 8*(2*4) = 64; k and v 8*(1*4) each = 64; o (2*4)*8 = 64 -> 576,
    # so 2*576 = 1152 FLOPs per token.
    # Attention at n_ctx 8: a query reads (8 + 1)/2 = 4.5 keys on average, plus one diagonal edge of
    # half a 128-key tile (64) in flex's tiles = 68.5 keys; QK and PV: 4 * d 4 * 2 heads * 68.5 = 2192.
    # lm head: 2 * 8 * 10 = 160 per scored token; 3 of the 8 tokens are scored (positions 4..6): 60.
    parts = traffic.per_token(tiny, 8, "baseline", ubatch=4)
    assert traffic.gemm_params(TINY, traffic.geometry(TINY)) == 576
    assert parts["weights' GEMMs"]["flops"] == 1152
    assert parts["full attention"]["flops"] == pytest.approx(2192)
    assert parts["lm head"]["flops"] == pytest.approx(60)
    # the baseline writes the dump and reads none; a cell reads it and computes the KLD
    assert "dump: encode on the host" in parts and "KLD against the baseline" not in parts
    cell = traffic.per_token(tiny, 8, "standard tail", ("q4_0", "q4_0", 2), ubatch=4)
    assert "KLD against the baseline" in cell and "dump: encode on the host" not in cell
    # tail 2 on a full layer: the exact copy's band edge in both halves, two more edges of 64 keys
    assert cell["full attention"]["flops"] == pytest.approx(4 * 4 * 2 * (4.5 + 3 * 64))


def test_roofline_takes_the_slower_side():
    dev = traffic.DEVICES["h200"]
    f = dev["fraction"]
    # memory-bound: 1 FLOP against 1 GB
    mem = {"flops": 1.0, "bytes": 1e9, "unit": "gemm", "rate_s": 0.0}
    assert traffic.part_seconds(mem, "h200") == pytest.approx(1e9 / (dev["hbm_Bps"] * f["hbm"]))
    # compute-bound: 1 PFLOP against 1 byte
    comp = {"flops": 1e15, "bytes": 1.0, "unit": "attention", "rate_s": 0.0}
    assert traffic.part_seconds(comp, "h200") == pytest.approx(1e15 / (dev["peak_flops"] * f["attention"]))
    # a part at a stated rate is its seconds, whatever the device
    rated = {"flops": 0.0, "bytes": 0.0, "unit": "rate", "rate_s": 2.5}
    assert traffic.part_seconds(rated, "h100") == 2.5


def _count_from_yaml(article):
    """The article's cells per model and kind, counted from its own lists (not kvarn.plan.matrix)."""
    t0 = tail = kv = 0
    for group in article["cells"]:
        tails = group["tail"] if isinstance(group["tail"], list) else [group["tail"]]
        if "k" in group:
            pairs = [(k, v) for k in group["k"] for v in group["v"]]
        elif "types" in group:
            pairs = [(t, t) for t in group["types"]]
        else:
            pairs = [tuple(p.split("/")) for p in group["pairs"]]
        for t in tails:
            for k, v in pairs:
                if k.startswith("kvarn") or v.startswith("kvarn"):
                    kv += 1
                elif t == 0:
                    t0 += 1
                else:
                    tail += 1
    return {"baseline": 1, "standard t0": t0, "standard tail": tail, "kvarn": kv}


def test_plan_counts_match_the_article_config():
    article = yaml.safe_load((ROOT / "config" / "article.yaml").read_text())
    want = _count_from_yaml(article)
    got = pj.plan()
    assert set(got) == {m["name"] for m in article["models"]}
    for m in article["models"]:
        chunks = pj.STUDY_CHUNKS[m["name"]]
        for kind in traffic.KINDS:
            row = got[m["name"]][kind]
            assert row["cells"] == want[kind], (m["name"], kind)
            assert row["n_ctx"] == m["n_ctx"][0] and row["chunks"] == chunks
            assert row["tokens"] == want[kind] * chunks * m["n_ctx"][0]
    # other chunk counts pass through
    assert pj.plan(study_chunks={"qwen3.6-27b": 1, "gemma4-31b": 2})["gemma4-31b"]["kvarn"]["chunks"] == 2


def test_measured_rows_replace_modelled_ones_and_the_total_sums_the_rows():
    base = pj.project("h200")
    assert {r["source"] for r in base["rows"]} == {"model"}
    proj = pj.project("h200", measured={"gemma4-31b": {"kvarn": 100.0}})
    row = next(r for r in proj["rows"] if (r["model"], r["kind"]) == ("gemma4-31b", "kvarn"))
    assert row["source"] == "measured" and row["s_per_chunk"] == 100.0
    assert row["gpu_hours"] == pytest.approx(row["cells"] * (row["chunks"] * 100.0 + traffic.CELL_FIXED_S) / 3600)
    others = [(r["model"], r["kind"], r["gpu_hours"]) for r in proj["rows"] if r is not row]
    assert others == [(r["model"], r["kind"], r["gpu_hours"]) for r in base["rows"]
                      if (r["model"], r["kind"]) != ("gemma4-31b", "kvarn")]
    for p in (base, proj):
        assert p["total_hours"] == pytest.approx(sum(r["gpu_hours"] for r in p["rows"]))
        assert sum(p["by_part"].values()) == pytest.approx(p["total_hours"])
        top = max(p["part_hours"], key=lambda x: x["gpu_hours"])
        assert p["dominant"] == top
        assert sum(x["gpu_hours"] for x in p["part_hours"]) == pytest.approx(p["total_hours"])
    # a modelled row's seconds are modelled()'s
    q = next(r for r in base["rows"] if (r["model"], r["kind"]) == ("qwen3.6-27b", "standard t0"))
    assert q["s_per_chunk"] == pytest.approx(pj.modelled("qwen3.6-27b", "standard t0", "h200"))


def test_the_slower_memory_costs_more_on_the_h100():
    assert pj.project("h100")["total_hours"] > pj.project("h200")["total_hours"]


def test_geometry_and_weights_agree_with_transformers():
    """The torch-free reading of the study configs is kvarn.vocab.geometry's through transformers'
    config class; the counted weights plus embeddings are transformers' parameter count on meta to
    0.1 % (norms, the conv and the gates' biases are what is left)."""
    from kvarn.budget.preflight import param_count
    from kvarn.vocab.geometry import config_object, geometry_from_config

    for model in ("qwen3.6-27b", "gemma4-31b"):
        cfg = traffic.config(model)
        assert traffic.geometry(cfg) == geometry_from_config(cfg)
        emb = cfg["vocab_size"] * cfg["hidden_size"] * (1 if cfg.get("tie_word_embeddings") else 2)
        total = param_count(config_object(cfg))
        assert abs(traffic.gemm_params(cfg, traffic.geometry(cfg)) + emb - total) < 1e-3 * total, model


def test_torch_free_and_the_command_writes_markdown(tmp_path):
    block = textwrap.dedent('''
        import sys
        class NoTorch:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in ("torch", "transformers", "triton"):
                    raise ModuleNotFoundError(name)
        sys.meta_path.insert(0, NoTorch())
    ''')
    (tmp_path / "sitecustomize.py").write_text(block)
    out = tmp_path / "p.md"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), str(ROOT)]))
    p = subprocess.run([sys.executable, "-m", "bench.gpu.projection", "--device", "h100", "--out", str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=120, env=env)
    assert p.returncode == 0, p.stderr
    md = out.read_text()
    assert md == p.stdout
    total = pj.project("h100")["total_hours"]
    assert f"**Total: {total:.2f} GPU-hours" in md and "H100" in md
    for needle in ("Dominant:", "Assumptions", "study chunk counts", "| gemma4-31b | kvarn |"):
        assert needle in md


def test_the_block_mask_is_built_once_per_layer_kind_and_ubatch(monkeypatch):
    # kvarn.kvcache.flex builds a ubatch's BlockMask once per layer kind: Qwen 3.6's baseline at
    # 65,536 in ubatches of 512 (16 full-attention layers, one kind, no exact copy) pays the dense
    # mask_mod once per call of one layer: 512 x 512 x (1 + 2 + ... + 128) pairs / 65,536 tokens
    # = 33,024 pairs per token, x 48 B, whatever the 16 layers.
    def staging():
        return traffic.per_token("qwen3.6-27b", 65536, "baseline")["flex mask and K/V staging"]["bytes"]

    with_build = staging()
    monkeypatch.setattr(traffic, "MASK_BUILD_BYTES", 0)
    assert with_build - staging() == pytest.approx(512 * 512 * (128 * 129 // 2) / 65536 * 48)


def test_tf32_attention_runs_at_half_the_tensor_core_rate_on_4_byte_tiles():
    bf16 = traffic.per_token("qwen3.6-27b", 65536, "standard t0")
    tf32 = traffic.per_token("qwen3.6-27b", 65536, "standard t0", compute="tf32-attn")
    a, b = bf16["full attention"], tf32["full attention"]
    assert (a["unit"], b["unit"]) == ("attention", "attention_tf32")
    assert b["flops"] == a["flops"] and b["bytes"] == 2 * a["bytes"]
    for d in traffic.DEVICES.values():  # TF32's dense peak is half bf16's, at the same kernel efficiency
        assert d["fraction"]["attention_tf32"] == d["fraction"]["attention"] / 2
        assert d["fraction"]["attention_d512_tf32"] == d["fraction"]["attention_d512"] / 2
    # the rest is the same work but the fp32 operands' staging and TF32 rounding (test_tf32_operand_rounding_by_hand)
    tf32_only = ("attention", "flex mask and K/V staging", "TF32 operand rounding")
    assert {k: v for k, v in tf32.items() if not any(t in k for t in tf32_only)} == \
        {k: v for k, v in bf16.items() if not any(t in k for t in tf32_only)}
    assert "TF32 operand rounding" not in bf16
    assert pj.project(compute="tf32-attn")["total_hours"] > pj.project(compute="bf16-attn")["total_hours"]
    with pytest.raises(ValueError, match="compute 'exact'"):
        traffic.per_token("qwen3.6-27b", 65536, compute="exact")


def test_tf32_operand_rounding_by_hand(tiny):
    # TINY at n_ctx 8 in ubatches of 4: calls of (4 queries, 4 rows) and (4, 8): 12 / 8 = 1.5 body rows
    # and (16 + 32) / 8 = 6 (query, key) pairs per token; 1 KV head of 4, 2 query heads of 4.
    # q4_0 at tail 2 keeps an exact copy: [body ; exact] = 3 rows per token, K and V each.
    cell = ("q4_0", "q4_0", 2)
    tf32 = traffic.per_token(tiny, 8, "standard tail", cell, ubatch=4, compute="tf32-attn")
    bf16 = traffic.per_token(tiny, 8, "standard tail", cell, ubatch=4, compute="bf16-attn")
    # kvarn.kvcache.rounding.round_operand per fp32 element: |word| 4 + 4, its finite test 4 + 1, word + half
    # 4 + 4, masked 4 + 4, the result where finite 1 + 4 + 4 + 4: 42 B
    assert traffic.TF32_ROUND_BYTES == 8 + 5 + 8 + 8 + 13 == 42
    # K and V over 3 rows x 1 head x 4 channels, 42 B each: 1008; Q, 2 heads x 4, widened from bf16
    # (2 + 4) and rounded (42): 384
    assert tf32["TF32 operand rounding"]["bytes"] == pytest.approx(3 * 4 * 2 * 42 + 2 * 4 * (6 + 42)) == 1392
    # staging: the mask check (50) and the build (48 per half, 2 halves, one layer kind) over 6 pairs, 876;
    # then per body row element (1.5 x 4 x 2 = 12): bf16 14 B (cast and concatenate), fp32 22 B (the
    # 16-bit exact copy widened, 2 + 4, and both concatenated, 4 + 4 read, 8 written)
    assert bf16["flex mask and K/V staging"]["bytes"] == pytest.approx(876 + 12 * 14)
    assert tf32["flex mask and K/V staging"]["bytes"] == pytest.approx(876 + 12 * 22)
    # the baseline (a bf16 body, no exact copy): its rows widened to fp32 (2 + 4) and rounded, 1.5 rows
    base = traffic.per_token(tiny, 8, "baseline", ubatch=4, compute="tf32-attn")
    assert base["TF32 operand rounding"]["bytes"] == pytest.approx(1.5 * 4 * 2 * 42 + 2 * 4 * 48)
    assert base["flex mask and K/V staging"]["bytes"] == pytest.approx(6 * (50 + 48) + 1.5 * 4 * 2 * 6)
    assert tf32["TF32 operand rounding"]["unit"] == "hbm"  # bandwidth-bound, eager elementwise kernels


def test_the_projection_runs_the_articles_compute(tmp_path):
    # config/article.yaml's cells name their compute; the projection models that one unless told
    # another. One it does not model (exact: fp32 attention off the tensor cores) is projected under
    # FALLBACK_COMPUTE, and the result and its Markdown say so.
    article = yaml.safe_load((ROOT / "config" / "article.yaml").read_text())
    computes = {g.get("compute", "exact") for g in article["cells"]}
    assert len(computes) == 1 and pj.article_compute() == computes.pop()

    def with_compute(name, compute):
        for g in article["cells"]:
            g["compute"] = compute
        path = tmp_path / name
        path.write_text(yaml.safe_dump(article))
        return path

    exact, bf16 = with_compute("exact.yaml", "exact"), with_compute("bf16.yaml", "bf16-attn")
    p = pj.project(article=exact)
    assert p["compute"] == pj.FALLBACK_COMPUTE == "tf32-attn" and "runs compute 'exact'" in p["note"]
    assert "Note: exact.yaml runs compute 'exact', which this does not model" in pj.markdown(p)
    assert p["total_hours"] == pj.project(article=exact, compute="tf32-attn")["total_hours"]
    assert pj.project(article=exact, compute="bf16-attn")["note"] is None
    q = pj.project(article=bf16)
    assert q["compute"] == "bf16-attn" and q["note"] is None and "Note:" not in pj.markdown(q)
    assert pj.modelled("qwen3.6-27b", "kvarn", article=bf16) == pytest.approx(
        pj.modelled("qwen3.6-27b", "kvarn", article=exact, compute="bf16-attn"))
    article["cells"][0]["compute"] = "tf32-attn"
    mixed = tmp_path / "mixed.yaml"
    mixed.write_text(yaml.safe_dump(article))
    with pytest.raises(ValueError, match="the projection takes one"):
        pj.project(article=mixed)
