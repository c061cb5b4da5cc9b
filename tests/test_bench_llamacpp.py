"""bench/oracles/llamacpp/runs.py reads llama-perplexity's log: its summary and each chunk's own mean KLD."""

import pytest

from bench.oracles.llamacpp import runs

# llama-perplexity --kl-divergence, Gemma 3 270M q5_1 (rot), 4 chunks of n_ctx 4096 (llama-cpp-python 0.3.36)
LOG = """\
0.01.360.765 I kl_divergence: computing over 4 chunks, n_ctx=4096, batch_size=2048, n_seq=1

chunk             PPL               ln(PPL(Q)/PPL(base))          KL Divergence              Δp RMS            Same top p
   1      17.7390 ±    1.1646       0.02177 ±    0.00586       0.02619 ±    0.00139     4.296 ±  0.374 %    91.207 ±  0.626 %
   2      18.7283 ±    0.9011       0.02907 ±    0.00435       0.02760 ±    0.00084     4.323 ±  0.226 %    91.109 ±  0.445 %
   3      15.2795 ±    0.5789       0.02311 ±    0.00371       0.02911 ±    0.00072     4.569 ±  0.165 %    91.028 ±  0.365 %
   4      15.0734 ±    0.4955       0.02446 ±    0.00324       0.02945 ±    0.00062     4.540 ±  0.136 %    91.011 ±  0.316 %

====== KL divergence statistics ======
Mean    KLD:   0.029452 ±   0.000617
Median  KLD:   0.017571
"""



def test_each_chunks_mean_from_the_running_means(tmp_path):
    log = tmp_path / "q5_1-rot.log"
    log.write_text(LOG)
    got = runs.parse_llama(log)
    assert got["kld_mean"] == 0.029452 and got["kld_median"] == 0.017571
    # by hand: 0.02619; 2·0.02760 − 0.02619; 3·0.02911 − 2·0.02760; 4·0.02945 − 3·0.02911
    assert got["kld_chunk_means"] == pytest.approx([0.02619, 0.02901, 0.03213, 0.03047], abs=1e-12)
    assert sum(got["kld_chunk_means"]) / 4 == pytest.approx(0.02945, abs=1e-12)  # back to the last running mean


def test_a_baseline_log_has_no_chunk_means(tmp_path):
    log = tmp_path / "base.log"
    log.write_text("[1]17.4107,[2]18.2456,[3]14.9605,[4]14.7335,\nFinal estimate: PPL = 14.7335 +/- 0.48290\n")
    got = runs.parse_llama(log)
    assert got == {"ppl_base": 14.7335}
