"""bench/oracles/beellama/bos_draw.py without a model: the perturbation, its patch of the cache
layer, the argument checks, the run plan and the summary."""

import statistics

import pytest
import torch

from bench.oracles.beellama import bos_draw as B
from kvarn.kvcache.cache import KVarnLayer, make_format
from kvarn.vocab.policy import layer_policy


def _x(n=6, seed=0):
    return torch.randn(1, 2, n, 32, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("offset, position", [(0, 0), (0, 3), (512, 515)])
def test_only_the_chosen_rows_move_each_value_by_exactly_eps(offset, position):
    x = _x()
    p = B.Perturbation(position, 1e-3, 7)
    y = B.perturb_rows(x, offset, p, layer=5, role="k")
    i = position - offset
    others = [j for j in range(x.shape[-2]) if j != i]
    assert torch.equal(y[..., others, :], x[..., others, :])
    rel = (y[..., i, :] - x[..., i, :]) / x[..., i, :]
    # every value of the row moves by eps relative, up or down (to fp32 rounding), never more
    assert torch.allclose(rel.abs(), torch.full_like(rel, 1e-3), rtol=1e-3, atol=0)
    assert (rel > 0).any() and (rel < 0).any()
    assert torch.equal(x, _x())  # the input is not modified


def test_a_position_outside_the_ubatch_leaves_it_unchanged():
    x = _x()
    for offset in (1, 512):
        assert torch.equal(B.perturb_rows(x, offset, B.Perturbation(0, 1e-3, 0), 0, "v"), x)
    assert torch.equal(B.perturb_rows(x, 0, B.Perturbation(6, 1e-3, 0), 0, "v"), x)


def test_signs_are_one_draw_per_seed_layer_and_role():
    a = B.signs((2, 256), 3, 5, "k")
    assert set(a.unique().tolist()) == {-1.0, 1.0}
    assert torch.equal(a, B.signs((2, 256), 3, 5, "k"))
    for other in (B.signs((2, 256), 4, 5, "k"), B.signs((2, 256), 3, 6, "k"), B.signs((2, 256), 3, 5, "v")):
        assert not torch.equal(a, other)
    with pytest.raises(ValueError, match="role 'q'"):
        B.signs((2,), 0, 0, "q")


def _layer():
    f = make_format("f32", "k", False, 0), make_format("f32", "v", False, 0)
    return KVarnLayer(*f, layer_policy(*f, 0), torch.float32, layer_idx=2)


def test_patched_stores_the_perturbed_rows_and_restores_the_method():
    original = KVarnLayer.update
    k, v = _x(4, 1), _x(4, 2)
    p = B.Perturbation(5, 1e-3, 1)
    with B.patched(p):
        layer = _layer()
        layer.update(k, v)  # positions 0..3: untouched
        layer.update(k, v)  # positions 4..7: position 5 is row 1
    assert KVarnLayer.update is original
    keys, values = layer.keys, layer.values  # f32 body at tail 0: what was stored, as is
    assert torch.equal(keys[..., :5, :], torch.cat([k, k[..., :1, :]], dim=-2))
    assert torch.equal(keys[..., 5, :], B.perturb_rows(k, 4, p, 2, "k")[..., 1, :])
    assert torch.equal(values[..., 5, :], B.perturb_rows(v, 4, p, 2, "v")[..., 1, :])
    assert not torch.equal(keys[..., 5, :], k[..., 1, :])
    with B.patched(None):
        assert KVarnLayer.update is original


@pytest.mark.parametrize("seeds, eps, position, control, says", [
    (0, 1e-3, 0, 1, "--seeds 0"), (8, 0.0, 0, 1, "--eps 0.0"), (8, 0.5, 0, 1, "--eps 0.5"),
    (8, float("nan"), 0, 1, "--eps nan"), (8, 1e-3, 4096, 1, "--position 4096"), (8, 1e-3, 0, -1, "--control -1"),
    (8, 1e-3, 3, 3, "--control 3: must differ")])
def test_bad_arguments_are_refused_naming_them(seeds, eps, position, control, says):
    with pytest.raises(ValueError, match=says):
        B.check_args(seeds, eps, position, control, 4096)
    B.check_args(8, 1e-3, 0, 1, 4096)


def test_main_refuses_a_bad_eps_before_any_work(capsys, tmp_path):
    with pytest.raises(SystemExit) as e:
        B.main(["--baseline", "x", "--out", str(tmp_path / "o"), "--eps", "1"])
    assert e.value.code == 2 and "--eps 1.0" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_plan_interleaves_position_and_control_after_the_unperturbed_run():
    runs = B.plan(2, 1e-3, 0, 9)
    assert runs[0] is None
    assert [(r.position, r.seed) for r in runs[1:]] == [(0, 0), (9, 0), (0, 1), (9, 1)]


def test_spread_and_the_summary_on_a_hand_worked_case():
    s = B.spread([1.0, 2.0, 4.0])
    assert (s["min"], s["max"], s["mean"], s["median"]) == (1.0, 4.0, 7 / 3, 2.0)
    assert s["sd"] == pytest.approx(((1 - 7 / 3) ** 2 + (2 - 7 / 3) ** 2 + (4 - 7 / 3) ** 2) ** 0.5 / 2 ** 0.5)
    assert B.spread([3.0])["sd"] is None
    with pytest.raises(ValueError):
        B.spread([])

    def rec(label, pos, seed, med, mean):
        return {"label": label, "position": pos, "eps": None if pos is None else 1e-3, "seed": seed,
                "kld_median": med, "kld_mean": mean, "kld_p99": 0.1, "same_top": 0.9, "ppl_q": 15.0, "cpu_s": 100.0}

    recs = [rec("none", None, None, 0.016, 0.025), rec("p0-s0", 0, 0, 0.014, 0.022), rec("p1-s0", 1, 0, 0.0161, 0.0251),
            rec("p0-s1", 0, 1, 0.018, 0.027), rec("p1-s1", 1, 1, 0.0159, 0.0249)]
    text = B.report(recs, {"kld_median": 0.0148, "kld_mean": 0.0236})
    row = {tuple(c.strip() for c in line.split("|")[1:4]): line for line in text.splitlines()}
    # position 0: medians 0.014..0.018 hold BeeLlama's 0.0148; position 1: 0.0159..0.0161 does not
    assert row[("0", "2", "median")].split("|")[4:7] == [" 0.016000 ", " 0.014000 ", " 0.018000 "]
    assert row[("0", "2", "median")].rstrip(" |").endswith("yes")
    assert row[("1", "2", "median")].rstrip(" |").endswith("no")  # below the seeds' min
    above = B.report(recs, {"kld_median": 0.0185, "kld_mean": 0.0236})
    assert [line.rstrip(" |")[-3:] for line in above.splitlines() if line.startswith("| 0 | 2 | median")] == [" no"]
    assert row[("0", "2", "mean")].split("|")[8].strip() == f"{statistics.stdev([0.022, 0.027]):.6f}"
    assert row[("0", "2", "mean")].split("|")[9].strip() == f"{0.027 / 0.022:.3f}"


def test_a_replacement_sets_the_chosen_rows_to_the_other_programs_and_nothing_else():
    x = _x(6, 3)  # [1, heads 2, 6 positions, dim 32]
    k5 = torch.arange(64, dtype=torch.float32).tolist()  # ggml's order: head 0's 32 values, then head 1's
    r = B.Replacement(515, {"Kcur-5": k5, "Vcur-5": [-v for v in k5]})
    assert r.label == "p515-beellama" and r.eps is None and r.seed is None
    y = B.replace_rows(x, 512, r, layer=5, role="k")
    assert torch.equal(y[0, 0, 3], torch.arange(32.0)) and torch.equal(y[0, 1, 3], torch.arange(32.0, 64.0))
    assert torch.equal(y[..., [0, 1, 2, 4, 5], :], x[..., [0, 1, 2, 4, 5], :]) and torch.equal(x, _x(6, 3))
    assert torch.equal(B.replace_rows(x, 512, r, 5, "v")[0, 1, 3], -torch.arange(32.0, 64.0))
    assert torch.equal(B.replace_rows(x, 0, r, 5, "k"), x)  # position 515 not in this ubatch
    with pytest.raises(KeyError):
        B.replace_rows(x, 512, r, 6, "k")  # no row of layer 6: never silently left as it was
    original = KVarnLayer.update
    with B.patched(B.Replacement(1, {"Kcur-2": k5, "Vcur-2": k5})):
        layer = _layer()
        layer.update(_x(4, 1), _x(4, 2))
    assert KVarnLayer.update is original
    assert torch.equal(layer.keys[0, :, 1].reshape(-1), torch.arange(64.0))
    assert torch.equal(layer.keys[..., [0, 2, 3], :], _x(4, 1)[..., [0, 2, 3], :])


def test_an_injected_run_is_listed_not_counted_in_the_spread():
    def rec(label, pos, eps, med):
        return {"label": label, "position": pos, "eps": eps, "seed": None if eps is None else 0, "kld_median": med,
                "kld_mean": med, "kld_p99": 0.1, "same_top": 0.9, "ppl_q": 15.0, "cpu_s": 1.0}

    text = B.report([rec("none", None, None, 0.016), rec("p0-beellama", 0, None, 0.001), rec("p0-s0", 0, 1e-3, 0.014)])
    assert "| p0-beellama | 0 | — | — | 0.001000 |" in text
    spread = [line for line in text.splitlines() if line.startswith("| 0 | ")]
    assert len(spread) == 2 and all(line.startswith("| 0 | 1 |") for line in spread)  # one seed, not two runs
    assert "0.001000" not in "".join(spread)


def test_injection_refuses_a_type_the_harness_does_not_run(capsys, tmp_path):
    with pytest.raises(SystemExit) as e:
        B.main(["--baseline", "x", "--out", str(tmp_path / "o"), "--inject-beellama", "-ctk", "q8_0", "-ctv", "q8_0"])
    assert e.value.code == 2 and "--inject-beellama: -ctk/-ctv must be one of f16, bf16, q4_0" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


# bench/oracles/beellama/bos_rows.py: its pure parts


def test_bos_rows_parse_keeps_each_names_last_node_and_checks_counts():
    from bench.oracles.beellama import bos_rows as R

    got = R.parse_rows("Kcur-0 2 1 2\nVcur-0 1 5\nKcur-0 2 3 4.5\n")
    assert got == {"Kcur-0": [3.0, 4.5], "Vcur-0": [5.0]}
    with pytest.raises(ValueError, match="node Kcur-1: 3 values announced, 2 found"):
        R.parse_rows("Kcur-1 3 1 2\n")


def test_bos_rows_compare_counts_the_blocks_and_codes_a_change_moves():
    from bench.oracles.beellama import bos_rows as R

    fmt = make_format("q4_0", "k", False, 0)
    a = torch.tensor([[float(i % 16 - 8) for i in range(64)]])  # exact q4_0 codes, d = 1 in both blocks
    same = R.compare(a, a.clone(), fmt)
    assert (same["rel_l2"], same["blocks"], same["codes"], same["n_blocks"], same["n_codes"]) == (0.0, 0, 0, 2, 64)
    b = a.clone()
    b[0, 40] += 0.75  # one value of block 1 rounds to the next code; d (set by -8) unchanged
    c = R.compare(a, b, fmt)
    assert (c["blocks"], c["codes"], c["max_abs"], c["deq_max_abs"]) == (1, 1, 0.75, 1.0)
    assert c["rel_l2"] == pytest.approx(0.75 / float(b.norm()))
    b[0, 41] += 0.75  # a second code of block 1 (another byte of it)
    b[0, :32] *= 1.5  # block 0: d 1.5, the same codes
    c = R.compare(a, b, fmt)
    assert (c["blocks"], c["codes"], c["max_abs"], c["deq_max_abs"]) == (2, 2, 4.0, 4.0)


def test_bos_rows_q8_flips_finds_a_changed_code_not_a_changed_step():
    from bench.oracles.beellama import bos_rows as R

    x = torch.tensor([254.0, 0.998, -6.4] + [2.0] * 29)  # q8_0: d = 254/127 = 2
    ours = (x / 2).round() * 2  # the same codes (0.998 / 2 = 0.499 -> 0)
    assert R.q8_flips(x, ours * (1 + 1e-6), "q8_0") == []  # another d by fp32 noise: no flip
    ours[1] = 2.0  # the other side of the tie
    assert R.q8_flips(x, ours, "q8_0") == [(1, pytest.approx(0.499))]
    with pytest.raises(ValueError, match="'f16'"):
        R.q8_flips(x, ours, "f16")
