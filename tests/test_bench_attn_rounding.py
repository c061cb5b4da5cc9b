"""bench/perf/attn_rounding.py: its table and verdict lines from hand-made rows."""

from bench.perf import attn_rounding as A


def test_the_table_and_the_verdicts_by_hand():
    rows = [
        {"model": "m", "format": "bf16 (the baseline)", "format_kld": 0.0, "path_kld": 1e-5, "measured_kld": 0.0},
        {"model": "m", "format": "q8_0", "format_kld": 2e-5, "path_kld": 7e-5, "measured_kld": 3e-5},
        {"model": "m", "format": "q4_0", "format_kld": 1e-2, "path_kld": 9e-3, "measured_kld": 0.0099},
        {"model": "n", "format": "bf16 (the baseline)", "format_kld": 0.0, "path_kld": 4e-5, "measured_kld": 0.0},
        {"model": "n", "format": "kvarn8", "format_kld": 2e-5, "path_kld": 1e-5, "measured_kld": 2e-5},
    ]
    md = A.markdown(rows, "python -m bench.perf.attn_rounding", 60.0, {"m": 1023, "n": 1023})
    lines = md.splitlines()
    # path / format is the baseline's own KLD over the format's: 1e-5 / 2e-5, 1e-5 / 1e-2, 4e-5 / 2e-5
    assert "| m | q8_0 | 2e-05 | 0.5000 | 3e-05 | +50.0 % | 7e-05 |" in lines
    assert "| m | q4_0 | 0.01 | 0.0010 | 0.0099 | -1.0 % | 0.009 |" in lines
    assert "| n | kvarn8 | 2e-05 | 2.0000 | 2e-05 | +0.0 % | 1e-05 |" in lines
    assert "| m | bf16 (the baseline) | 0 | path's own KLD 1e-05 | – | – | – |" in lines
    assert lines[-2] == ("- m: the path's own KLD (1e-05) is below the format's effect for 2 of 2 formats; the tightest "
                         "is q8_0 (0.5000 of it). Measured medians move by at most 50.0 % (q8_0).")
    assert lines[-1] == ("- n: the path's own KLD (4e-05) is below the format's effect for 0 of 1 formats; the tightest "
                         "is kvarn8 (2.0000 of it). Measured medians move by at most 0.0 % (kvarn8).")
