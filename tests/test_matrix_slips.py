"""kvarn.plan.matrix: the slips its own tests let through (the mutation group `matrix`'s survivors),
each a case where a plausible mistake changes what the user gets: a key misspelt in a parsed
directory, a sampled decode's seed or directory lost, an off-by-one on the decode's length, a
refusal that names the wrong field or no model, a summary field that leaks into the table."""

import copy

import pytest

from kvarn.plan import matrix as kvm
from kvarn.plan import paths as kvp
from kvarn.plan import rows as kvr

MODEL = {"name": "smollm2-135m", "source": "embedded:smollm2-135m", "n_ctx": [512], "chunks": 2}
PROGRAM_MODEL = {**MODEL, "engine": {"name": "llama.cpp", "build": "upstream"}}


def config(model=MODEL, cells=({"types": ["q4_0"], "tail": 0},), **extra):
    return {"models": [copy.deepcopy(model)], "cells": [dict(c) for c in cells], **extra}


def test_a_run_directory_reads_back_its_context_under_the_key_n_ctx():
    assert kvp.parse_run_dir("results/smollm2-135m/ctx2048-c3") == {"model": "smollm2-135m", "n_ctx": 2048, "chunks": 3}
    assert kvp.parse_run_dir("x/results/m/ctx512-call")["n_ctx"] == 512


def test_a_sampled_decode_directory_carries_its_temperature_and_seed():
    greedy = kvp.decode_dir("m", 512, 4, 16, "q4_0-q4_0-t0")
    sampled = kvp.decode_dir("m", 512, 4, 16, "q4_0-q4_0-t0", sampling="-T0.7-s3")
    assert greedy == "results/m/decode-ctx512-p4-g16/q4_0-q4_0-t0"
    assert sampled == "results/m/decode-ctx512-p4-g16-T0.7-s3/q4_0-q4_0-t0"


def test_a_repeated_context_is_refused_with_the_list_as_given():
    with pytest.raises(kvm.MatrixError, match=r"models\[0\]\.n_ctx: \[512, 512\] must be a non-empty list"):
        kvm.expand(config({**MODEL, "n_ctx": [512, 512]}))


def test_a_sampled_decode_keeps_its_seed():
    m = kvm.expand(config({**MODEL, "decode": {"prompts": 2, "tokens": 8, "temperature": 0.7, "seed": 3}}))
    d = m.models["smollm2-135m"].decode
    assert (d.temperature, d.seed) == (0.7, 3)
    assert d.sampling == "-T0.7-s3"


def test_a_decode_may_generate_up_to_n_ctx_minus_2_tokens():
    # n_ctx 512: the prompt is the first n_ctx - tokens tokens, scored from 2 on, so 510 is the most
    d = kvm.expand(config({**MODEL, "decode": {"prompts": 1, "tokens": 510}})).models["smollm2-135m"].decode
    assert d.tokens == 510
    with pytest.raises(kvm.MatrixError, match=r"decode\.tokens: 511 leaves no prompt in n_ctx 512; at most n_ctx - 2 = 510"):
        kvm.expand(config({**MODEL, "decode": {"prompts": 1, "tokens": 511}}))


def test_a_decode_without_cells_decodes_every_cell_and_a_list_becomes_a_tuple():
    every = kvm.expand(config({**MODEL, "decode": {"prompts": 1, "tokens": 8}})).models["smollm2-135m"].decode
    assert every.cells is None
    some = kvm.expand(config({**MODEL, "decode": {"prompts": 1, "tokens": 8, "cells": ["q4_0-q4_0-t0"]}}))
    assert some.models["smollm2-135m"].decode.cells == ("q4_0-q4_0-t0",)


def test_a_bad_allocation_is_refused_under_its_own_name():
    cfg = config(cells=[{"alloc": ["mixed"], "tail": 0}], allocations={"mixed": {"k": "q4_0", "v": "q9_9"}})
    with pytest.raises(kvm.MatrixError, match=r"^allocations\.mixed"):
        kvm.expand(cfg)


def test_an_option_the_program_has_not_is_refused_naming_the_model():
    cfg = config(PROGRAM_MODEL, cells=[{"types": ["q4_0"], "tail": 0, "sink": 64}])
    with pytest.raises(kvm.MatrixError, match=r"cells\[0\]\.sink: 64 for model 'smollm2-135m', which runs engine llama.cpp"):
        kvm.expand(cfg)


def test_kvarn_iterations_are_refused_on_the_program():
    cfg = config(PROGRAM_MODEL, cells=[{"types": ["kvarn4"], "tail": 0, "iters": 3}])
    with pytest.raises(kvm.MatrixError, match=r"cells\[0\]\.iters: 3 for model 'smollm2-135m', which runs engine "
                                              r"llama.cpp: the program takes its own iters"):
        kvm.expand(cfg)


SUMMARY = {"k_type": "q4_0", "v_type": "q4_0", "tail": 0, "n_ctx": 512, "kld_mean": 0.01,
           "self_check": {"passed": True, "threads": [1, 2]}, "engine_identity": {"build": "x"}}


def test_a_summary_without_an_accounting_is_read_as_packed():
    row = kvr.summary_row(dict(SUMMARY), {"cell": "q4_0-q4_0-t0"})
    assert row["memory_accounting"] == "packed"


def test_nested_summary_records_stay_out_of_the_table_row():
    row = kvr.summary_row(dict(SUMMARY), {"cell": "q4_0-q4_0-t0", "memory_accounting": "packed"})
    assert "self_check" not in row and "engine_identity" not in row
    assert row["kld_mean"] == 0.01 and row["cell"] == "q4_0-q4_0-t0"
