"""kvarn.weights.gguf_weights: the qwen35/gemma4 tensor names against the gguf package's tables, and a
gemma4 GGUF written in-test (llama.cpp's metadata keys and names, Q8_0 weights) reloaded at fp32.

The oracle for names and layouts is llama.cpp's own converter: bench/oracles/llamacpp/gguf_roundtrip.py runs it
(not in CI: it is not part of the repository); its figures are in bench/oracles/llamacpp/results/gguf_roundtrip.md.
"""

import gguf
import numpy as np
import pytest
import torch
from gguf.constants import MODEL_ARCH, MODEL_TENSORS, TENSOR_NAMES

from kvarn.weights import gguf_file, gguf_weights

from test_models import GEMMA_TEXT, QWEN_TEXT


def _causal(text: dict, model_type: str, device="meta"):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        return AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **text)).eval()


def _templates(arch) -> set[str]:
    return {TENSOR_NAMES[t] for t in MODEL_TENSORS[arch]}


def _template(name: str) -> str:
    parts = name.split(".")
    if parts[0] == "blk":
        parts[1] = "{bid}"
    return ".".join(p for p in parts if p not in ("weight", "bias"))


def test_gemma4_names_are_the_gguf_table():
    model = _causal(GEMMA_TEXT, "gemma4_text")
    names = gguf_weights.hf_to_gguf_names(model, "gemma4")
    assert set(names) == set(model.state_dict())
    assert len(set(names.values())) == len(names)  # one GGUF tensor per HF tensor
    assert {_template(n) for n in names.values()} <= _templates(MODEL_ARCH.GEMMA4)
    assert names["model.layers.0.layer_scalar"] == "blk.0.layer_output_scale.weight"
    assert "model.layers.3.self_attn.v_proj.weight" not in names  # K = V on the full layer


def test_qwen35_names_are_the_gguf_table():
    """transformers loads qwen35; its targets must be what the gguf table names (dt_bias is
    renamed dt_proj.bias by the converter before the table is consulted)."""
    model = _causal(QWEN_TEXT, "qwen3_5_text")
    names = gguf_weights.hf_to_gguf_names(model, "qwen35", strict=False)
    assert set(model.state_dict()) - set(names) == {f"model.layers.{i}.linear_attn.dt_bias" for i in range(3)}
    assert {_template(n) for n in names.values()} <= _templates(MODEL_ARCH.QWEN35)
    assert names["model.layers.0.linear_attn.A_log"] == "blk.0.ssm_a"


def _qdq(a: np.ndarray) -> np.ndarray:
    T = gguf.GGMLQuantizationType.Q8_0
    return np.asarray(gguf.quants.dequantize(gguf.quants.quantize(a, T), T)).reshape(a.shape)


def test_gemma4_gguf_written_in_test_reloads_exactly(tmp_path, monkeypatch):
    """Metadata as llama.cpp's converter writes it for Gemma 4 (per-layer KV heads, two head
    dims, sliding pattern, rope_freqs for proportional RoPE), 2-D weights in Q8_0."""
    model = _causal(GEMMA_TEXT, "gemma4_text", device="cpu")
    with torch.no_grad():  # norms and scalars off their init, so a wrong shift shows
        for n, p in model.named_parameters():
            if "norm" in n or "scalar" in n:
                p.add_(torch.randn_like(p) * 0.1)
    names = gguf_weights.hf_to_gguf_names(model, "gemma4")
    c = model.config
    path = tmp_path / "tiny-gemma4.gguf"
    w = gguf.GGUFWriter(str(path), "gemma4")
    a = "gemma4."
    w.add_uint32(a + "block_count", 4)
    w.add_uint32(a + "context_length", 4096)
    w.add_uint32(a + "embedding_length", 64)
    w.add_uint32(a + "feed_forward_length", 128)
    w.add_uint32(a + "attention.head_count", 4)
    w.add_array(a + "attention.head_count_kv", [2, 2, 2, 1])
    w.add_float32(a + "rope.freq_base", 1e6)
    w.add_float32(a + "rope.freq_base_swa", 1e4)
    w.add_float32(a + "attention.layer_norm_rms_epsilon", 1e-6)
    w.add_uint32(a + "attention.key_length", 32)
    w.add_uint32(a + "attention.value_length", 32)
    w.add_uint32(a + "attention.key_length_swa", 16)
    w.add_uint32(a + "attention.value_length_swa", 16)
    w.add_float32(a + "final_logit_softcapping", 30.0)
    w.add_uint32(a + "attention.sliding_window", 8)
    w.add_uint32(a + "attention.shared_kv_layers", 0)
    w.add_uint32(a + "embedding_length_per_layer_input", 0)
    w.add_array(a + "attention.sliding_window_pattern", [True, True, True, False])
    # proportional RoPE, partial factor 0.25 on head dim 32: 4 rotated of 16 frequency pairs
    w.add_tensor("rope_freqs.weight", np.array([1.0] * 4 + [1e30] * 12, dtype=np.float32))
    expected = {}
    for key, t in model.state_dict().items():
        if key == "lm_head.weight":  # tied: llama.cpp writes no output tensor
            continue
        arr = t.detach().float().numpy().copy()
        if arr.ndim == 2:
            arr = _qdq(arr)
            w.add_tensor(names[key], gguf.quants.quantize(arr, gguf.GGMLQuantizationType.Q8_0),
                         raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(names[key], arr)
        expected[key] = torch.from_numpy(arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    reader = gguf.GGUFReader(str(path))
    assert {t.tensor_type.name for t in reader.tensors} == {"Q8_0", "F32"}  # the dequantizing path is taken
    cfg = gguf_file.gemma4_config(reader)
    assert (cfg["num_key_value_heads"], cfg["num_global_key_value_heads"], cfg["head_dim"], cfg["global_head_dim"],
            cfg["attention_k_eq_v"], cfg["tie_word_embeddings"]) == (2, 1, 16, 32, True, True)
    assert cfg["rope_parameters"]["full_attention"]["partial_rotary_factor"] == 0.25
    loaded = gguf_weights.gemma4_model(path, reader, "cpu", torch.float32, "sdpa").eval()
    with torch.no_grad():
        model.load_state_dict(expected, strict=False)  # the reference holds the same Q8_0 values
        ids = torch.randint(0, 384, (1, 24), generator=torch.Generator().manual_seed(2))
        want, got = model(input_ids=ids).logits, loaded(input_ids=ids).logits
    assert torch.equal(want, got)
    # the entry point a model load takes (kvarn.weights.models) dispatches a gemma4 GGUF here too
    monkeypatch.setattr(gguf_weights, "tokenizer", lambda p: ("tokenizer of", p))  # the tiny file holds none
    via_load, tok = gguf_weights.load(path, "cpu", torch.float32)
    assert tok == ("tokenizer of", path)
    with torch.no_grad():
        assert torch.equal(via_load.eval()(input_ids=ids).logits, want)
    from kvarn.vocab.geometry import geometry_from_config

    assert geometry_from_config(loaded.config).describe() == (
        "3 sliding_attention (2 KV heads x 16, W 8); 1 full_attention (1 KV heads x 32, K=V)")


def test_gemma4_unsupported_gguf_is_refused(tmp_path):
    path = tmp_path / "moe.gguf"
    w = gguf.GGUFWriter(str(path), "gemma4")
    for k, v in (("block_count", 1), ("feed_forward_length", 8), ("expert_count", 4), ("attention.key_length", 8),
                 ("attention.key_length_swa", 8), ("attention.head_count_kv", 1)):
        w.add_uint32("gemma4." + k, v)
    w.add_array("gemma4.attention.sliding_window_pattern", [False])
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="experts"):
        gguf_file.gemma4_config(gguf.GGUFReader(str(path)))


def test_reader_parses_a_file_once_and_a_rewritten_file_again(tmp_path):
    def write(path, n):
        w = gguf.GGUFWriter(str(path), "llama")
        w.add_tensor("token_embd.weight", np.arange(4 * n, dtype=np.float32).reshape(4, n))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()

    path = tmp_path / "m.gguf"
    write(path, 8)
    first = gguf_file.reader(path)
    assert gguf_file.reader(tmp_path / "." / "m.gguf") is first  # the same file: parsed once
    assert gguf_file.architecture(path) == "llama" and gguf_file.reader(path) is first
    write(path, 16)  # rewritten in place: another size
    again = gguf_file.reader(path)
    assert again is not first and again.tensors[0].shape.tolist() == [16, 4]
