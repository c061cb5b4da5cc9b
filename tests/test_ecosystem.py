"""transformers' QuantizedCache backends as body formats (kvarn.formats.ecosystem).

Oracles: the libraries themselves, called directly (optimum-quanto's MaxOptimizer and
quantize_weight, HQQ's Quantizer.quantize, as transformers' layers call them), and
transformers' own `QuantizedCache` forward on a tiny random Llama, in the setting where its
cadence and ours quantize the same groups once (see `test_forward_equals_quantized_cache`).
"""

from __future__ import annotations

import importlib.metadata
import sys
import tempfile
from pathlib import Path

import polars as pl
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.cache_utils import QuantizedCache

from kvarn.vocab.cell import CellSpec
import kvarn.kvcache.attention as kattn
from kvarn.vocab import facts
from kvarn import report as R
from kvarn.kvcache.cache import KVarnCache, KVarnLayer
from kvarn.formats import get_format
from kvarn.formats.ecosystem import use_quanto_python_unpack
from kvarn.vocab.geometry import Geometry
from kvarn.budget.memory import kv_bytes
from kvarn.report import compare
from kvarn.report import data as D

sys.path.insert(0, str(Path(__file__).parent))
import synthetic  # noqa: E402
from paths import REPO  # noqa: E402

NAMES = list(facts.ECOSYSTEM_TYPES)
G = facts.ECOSYSTEM_GROUP


def _x(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _library_quantize(name, role, t):
    """The library's own quantized object for t [1, 1, 128, D] (codes, scale, zero), called
    here directly with the arguments transformers' QuantizedLayer passes."""
    backend, bits, axis_k, axis_v, qg = facts.ECOSYSTEM_TYPES[name]
    axis = axis_k if role == "k" else axis_v
    if backend == "quanto":
        from optimum.quanto import MaxOptimizer, qint2, qint4, quantize_weight

        qtype = qint4 if bits == 4 else qint2
        scale, shift = MaxOptimizer()(t, qtype, axis, qg)
        q = quantize_weight(t, qtype, axis, scale, shift, qg)
        return q, q._data._data, q._scale, q._shift
    from hqq.core.quantize import Quantizer

    w_q, meta = Quantizer.quantize(t, axis=axis, device=t.device, compute_dtype=t.dtype, nbits=bits, group_size=qg)
    meta["compute_dtype"] = t.dtype
    Quantizer.cuda(w_q, meta=meta, device=t.device)
    return (w_q, meta), w_q, meta["scale"], meta["zero"]


def _library_dequantize(name, q):
    if facts.ECOSYSTEM_TYPES[name][0] == "quanto":
        return q.dequantize()
    from hqq.core.quantize import Quantizer

    return Quantizer.dequantize(*q)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("role", ["k", "v"])
@pytest.mark.parametrize("head_dim", [64, 256])
def test_bytes_and_values_are_the_librarys(name, role, head_dim, one_thread):
    """Each head's 128-token group: our packed bytes are the library's codes, scales and zeros
    (at bf16, the library's dtype in a bf16 model), and what attention reads back is the
    library's dequantization of them."""
    fmt = get_format(name, role=role)
    x = _x(2, 2 * G, head_dim) * 3 + 0.5  # two heads, two groups each
    packed = fmt.encode(x)
    back = fmt.roundtrip(x)
    assert torch.equal(fmt.decode(packed), back)
    per = packed.data.shape[-1] // 2
    f = facts.get(name)
    n_codes = G * head_dim * f.bits // 8
    n_meta = G * head_dim // f.q_group * 2
    assert per == n_codes + 2 * n_meta == f.nbytes(G, head_dim, role)
    for h in range(2):
        for g in range(2):
            t = x[h, g * G:(g + 1) * G].to(torch.bfloat16).reshape(1, 1, G, head_dim)
            q, codes, scale, zero = _library_quantize(name, role, t)
            buf = packed.data[h, g * per:(g + 1) * per]
            assert torch.equal(buf[:n_codes], codes.reshape(-1).view(torch.uint8))
            assert torch.equal(buf[n_codes:n_codes + n_meta], scale.reshape(-1).view(torch.uint8))
            assert torch.equal(buf[n_codes + n_meta:], zero.reshape(-1).view(torch.uint8))
            want = _library_dequantize(name, q).float().reshape(G, head_dim)
            assert torch.equal(back[h, g * G:(g + 1) * G], want)


def test_axes_are_kivis():
    """kivi: K per channel (one scale per 32 tokens of a channel), V per token (per 32
    channels); quanto / hqq: both per token. A constant channel of K is then exact under
    kivi's K and not under its V; a constant token is exact under V and quanto's K."""
    x = _x(G, 64)
    chan = x.clone()
    chan[:, 5] = 0.3  # one constant channel
    tok = x.clone()
    tok[7] = 0.3  # one constant token
    kk, kv, qk = (get_format(n, role=r) for n, r in (("kivi4", "k"), ("kivi4", "v"), ("quanto4", "k")))
    c = torch.tensor(0.3).to(torch.bfloat16).float()
    assert torch.all(kk.roundtrip(chan)[:, 5] == c) and not torch.all(kv.roundtrip(chan)[:, 5] == c)
    assert torch.all(kv.roundtrip(tok)[7] == c) and torch.all(qk.roundtrip(tok)[7] == c)
    assert not torch.all(kk.roundtrip(tok)[7] == c)


def test_facts_by_hand():
    # quanto4 at D 64: 4 bits + one bf16 scale and one bf16 shift per 64 values = 4.5 bits;
    # kivi2: 2 + 32/32 = 3 bits; hqq2 at D 256: 2.5 bits
    assert facts.get("quanto4").bits_per_value(64) == 4.5
    assert facts.get("kivi2").bits_per_value(64, "k") == 3.0 == facts.get("kivi2").bits_per_value(64, "v")
    assert facts.get("hqq2").bits_per_value(256) == 2.5
    assert facts.tail_label("quanto4", "quanto4", 0) == "128*" and facts.pair_family("hqq4", "kivi2") == "ecosystem"
    with pytest.raises(ValueError, match="'quanto4' and V type 'q4_0' mix a QuantizedCache backend type"):
        facts.pair_family("quanto4", "q4_0")
    with pytest.raises(ValueError, match="kivi4: head dim 48 not supported; accepted: multiples of 32"):
        facts.get("kivi4").nbytes(G, 48)


def test_memory_by_hand():
    """One full-attention layer, 2 KV heads of 64, n_ctx 300, quanto4 at tail 0 (-> 128*):
    body = whole groups (256 tokens) per head, K and V: 256*64*4/8 codes + 2 * 256 bf16
    scale/shift = 8192 + 1024 bytes, times 2 heads times K,V = 36864; overlay = 128 exact
    bf16 rows of K and V over 2 heads of 64 = 128 * 2 * 2 * 64 * 2 = 65536."""
    geom = Geometry.uniform(1, 2, 64, (None,))
    b = kv_bytes(geom, 300, CellSpec("quanto4", "quanto4", 0))
    assert (b.body, b.staging, b.overlay) == (36864, 0, 65536)
    # kivi2: 256*64*2/8 + 2 * 2 * 256*64/32 = 4096 + 2048 per head and role
    assert kv_bytes(geom, 300, CellSpec("kivi2", "kivi2", 0)).body == 4 * 6144


def test_library_version_is_pinned(monkeypatch):
    """Another installed library version is refused by name, never mixed with these results;
    a buffer written under another version is refused by decode."""
    fmt = get_format("hqq4")
    packed = fmt.encode(_x(1, G, 64))
    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda d: "9.9" if d == "hqq" else real(d))
    with pytest.raises(ValueError, match=r"pinned to hqq==0.2.8.post1 but hqq==9.9 is installed"):
        get_format("hqq4")
    packed.meta["library"] = "hqq==9.9"
    with pytest.raises(ValueError, match="refusing to decode a buffer written with .*library='hqq==9.9'"):
        fmt.decode(packed)


def test_bad_inputs():
    with pytest.raises(ValueError, match="quanto4: dtype must be one of bf16, f16, f32, got 'f64'"):
        get_format("quanto4", dtype="f64")
    with pytest.raises(ValueError, match="not a multiple of the group size 128"):
        get_format("quanto4").roundtrip(_x(1, 100, 64))
    with pytest.raises(ValueError, match="head dim 48 not supported; accepted: multiples of 64"):
        get_format("hqq2").roundtrip(_x(1, G, 48))


# --- the forward, against transformers' QuantizedCache ------------------------------------
def _one_layer_llama():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=64, max_position_embeddings=1024)
    return LlamaForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def llama():
    return _one_layer_llama()


STEPS = 2 * G  # a 128-token prompt, then 256 tokens one at a time


def _calls(ids):
    yield ids[:, :G]
    for p in range(G, ids.shape[1]):
        yield ids[:, p:p + 1]


@torch.no_grad()
def library_logits(model, ids, name, impl="sdpa"):
    backend, bits, axis_k, axis_v, qg = facts.ECOSYSTEM_TYPES[name]
    if backend == "quanto":
        use_quanto_python_unpack()  # as kvarn runs it, not a minute compiling the C++ unpack
    model.set_attn_implementation(impl)
    cache = QuantizedCache(backend, model.config, nbits=bits, axis_key=axis_k, axis_value=axis_v,
                           q_group_size=qg, residual_length=G)
    return torch.cat([model(c, cache=cache, use_cache=True).logits[0] for c in _calls(ids)])


@torch.no_grad()
def our_logits(model, ids, k, v):
    """Our cache model with the formats at fp32 (the tiny model's dtype, hence the library's)."""
    model.set_attn_implementation(kattn.ATTN_NAME)
    cache = KVarnCache(model.config, CellSpec(k, v, tail=G, tail_dtype="f32"))
    for layer in cache.layers:
        assert isinstance(layer, KVarnLayer) and layer.policy.tail == G
        if k != "f32":
            layer.k_fmt, layer.v_fmt = get_format(k, "k", dtype="f32"), get_format(v, "v", dtype="f32")
    return torch.cat([model(c, cache=cache, kvarn_cache=cache, use_cache=True).logits[0] for c in _calls(ids)])


@pytest.mark.parametrize("name", NAMES)
def test_forward_equals_quantized_cache(llama, name, one_thread):
    """Where the cadences coincide, our logits are transformers' QuantizedCache's.

    One layer (so every K/V comes from the embeddings, whatever earlier queries read), a
    128-token prompt (the library quantizes it whole, once: exactly our first sealed group),
    then one token at a time. The prompt's queries read everything exactly in both; the
    query at 255 reads [0, 128) quantized once and [128, 255] exactly in both (the library's
    residual has just filled; our tail is 128). Tolerance: how far the library's own forward
    moves between its two attention implementations (eager, sdpa) on the same cache."""
    ids = torch.randint(0, 128, (1, G + STEPS), generator=torch.Generator().manual_seed(3))
    lib = library_logits(llama, ids, name)
    noise = max((library_logits(llama, ids, name, "eager") - lib).abs().max().item(), 1e-6)
    ours = our_logits(llama, ids, name, name)
    exact = our_logits(llama, ids, "f32", "f32")
    same = list(range(G)) + [2 * G - 1]
    assert (ours[same] - lib[same]).abs().max().item() <= 4 * noise
    # the check has teeth: at 255 quantization moves the logits far beyond the tolerance
    assert (exact[2 * G - 1] - lib[2 * G - 1]).abs().max().item() > 100 * noise


def test_pins_agree_with_pyproject():
    """The library versions the formats accept are the ones the project installs."""
    import tomllib

    from paths import REPO

    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    for dist, version in facts.ECOSYSTEM_LIBRARIES.values():
        assert f"{dist}=={version}" in deps
    # the pin is the formats' numerics version: a new pin reruns the cells that use them
    newest = max(facts.ECOSYSTEM_PINS)
    for name in NAMES:
        backend = facts.ECOSYSTEM_TYPES[name][0]
        assert facts.get(name).version == newest == get_format(name).version
        assert facts.get(name).library == "==".join(facts.ECOSYSTEM_PINS[newest][backend])


# --- the rows in the figures ------------------------------------------------------------
def test_rows_in_same_width_and_pareto():
    """On the synthetic result set, quanto4 / kivi2 rows (family 'ecosystem', 128*) become
    same-width partners of kvarn4 / kvarn2 with KVarN's % change against them, a series of
    their own in the Pareto figure, and never part of the standard frontier or floor."""
    with tempfile.TemporaryDirectory() as tmp:
        prep = R.prepare(synthetic.make_results(tmp), "smollm2-135m")
    eco = []
    for name, like, median in (("quanto4", "q4_0", 0.5), ("kivi2", "q2_0", 0.25)):
        row = prep.filter((pl.col("pair") == f"{like}-{like}") & (pl.col("tail_requested") == 128))
        eco.append(row.with_columns(
            pl.lit(name).alias("k_type"), pl.lit(name).alias("v_type"), pl.lit(f"{name}-{name}").alias("pair"),
            pl.lit("ecosystem").alias("family"), pl.lit(0, dtype=row["tail_requested"].dtype).alias("tail_requested"),
            pl.lit("128*").alias("tail_label"), pl.lit(median).alias("kld_median"),
            pl.lit(D.series_of("ecosystem", 0, 128)).alias("series"), pl.lit(False).alias("is_floor")))
    both = pl.concat([prep, *eco], how="vertical_relaxed")
    sw = compare.same_width(both)
    assert compare.same_width_backends(sw) == ["kivi", "quanto"]
    w4, w2 = (sw.filter(pl.col("width") == w).row(0, named=True) for w in (4, 2))
    assert w4["pct_median_quanto"] == pytest.approx((w4["kld_median_kvarn"] / 0.5 - 1) * 100)
    assert w2["pct_median_kivi"] == pytest.approx((w2["kld_median_kvarn"] / 0.25 - 1) * 100)
    assert w4["pct_median_kivi"] is None and w2["pct_median_quanto"] is None
    spec = R.same_width(both).to_dict()
    bars = {row["bar"] for rows in spec["datasets"].values() for row in rows if "bar" in row}
    assert "vs quantoN t128* (QuantizedCache): median" in bars and "vs kiviN t128* (QuantizedCache): mean" in bars
    pareto = R.pareto(both).to_dict()
    series = {row["series"] for rows in pareto["datasets"].values() for row in rows if "series" in row}
    assert f"{D.SERIES_ECOSYSTEM}, tail 128*" in series
    assert not set(D.pareto_frontier(both)["pair"]) & {"quanto4-quanto4", "kivi2-kivi2"}
    assert D.standard_floor(both)["pair"] == D.standard_floor(prep)["pair"]


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("role", ["k", "v"])
def test_from_bytes_rebuilds_the_librarys_object(name, role):
    """`from_bytes` re-derives the library object `to_bytes` serialized: quanto's tensor with its qtype,
    axis, group size, shape and strides; HQQ's (W_q, meta) with every key of the library's meta."""
    fmt = get_format(name, role=role)
    t = _x(G, 64).to(torch.bfloat16).reshape(1, 1, G, 64)
    q = fmt.quantize(t)
    back = fmt.from_bytes(fmt.to_bytes(q), 64)
    if facts.ECOSYSTEM_TYPES[name][0] == "quanto":
        assert (back.qtype, back.axis, back._group_size, back.shape, back.stride()) == \
            (q.qtype, q.axis, q._group_size, q.shape, q.stride())
        return
    (w, meta), (w_back, meta_back) = q, back
    assert torch.equal(w_back, w) and set(meta_back) == set(meta)
    for key, value in meta.items():
        assert torch.equal(meta_back[key], value) if torch.is_tensor(value) else meta_back[key] == value, key


def test_a_buffer_carries_its_format_role_library_and_dtype():
    # the library as installed (its pin is checked by test_library_version_is_pinned)
    for name, role, dist in (("quanto4", "k", "optimum-quanto"), ("hqq2", "v", "hqq")):
        fmt = get_format(name, role=role)
        want = {"format": name, "role": role, "library": f"{dist}=={importlib.metadata.version(dist)}", "dtype": "bf16"}
        assert fmt.packed_meta() == want and fmt.encode(_x(1, G, 64)).meta == want
    with pytest.raises(ValueError, match=r"^quanto4: n_tokens 100 is not a multiple of the group size 128$"):
        get_format("quanto4").nbytes(100, 64)


@pytest.mark.slow
def test_only_a_quanto_format_routes_quanto_unpack_to_python():
    """quanto's C++ unpack is compiled (a minute) on first use: building a quanto format routes it to the
    Python kernel (the same integers), an HQQ format leaves it alone. In a fresh interpreter, where
    nothing has loaded it yet; the HQQ format is built here too (a mutation run selects a test by the
    calls it sees in this process)."""
    import subprocess

    get_format("hqq4")
    code = ("from optimum.quanto.library.extensions import get_extension\n"
            "from kvarn.formats import get_format\n"
            "ext = get_extension('quanto_cpp')\n"
            "get_format('hqq4')\n"
            "after_hqq = ext._lib is None\n"
            "get_format('quanto4')\n"
            "print(after_hqq, ext._lib is not None)\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert (out.returncode, out.stdout) == (0, "True True\n"), out.stderr
