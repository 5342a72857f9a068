"""The tokenizer side of a GGUF file: a ``tokenizers`` Tokenizer and ``tokenizer_config.json`` from its metadata.

``build_tokenizer`` follows transformers' GGUF converters: "gpt2" files become byte-level BPE, "llama" files
sentencepiece-style BPE; control / user-defined tokens become special added tokens; BOS/EOS are added by a
post-processor as the file's ``add_bos_token`` / ``add_eos_token`` say.
"""

from __future__ import annotations

from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

# llama.cpp token types (llama_token_type)
_CONTROL, _USER_DEFINED = 3, 4

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN35_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# `tokenizer.ggml.pre` -> split regex, as transformers' GGUF converter has it. Any other value (SmolLM2's
# "smollm" included) keeps the GPT-2 byte-level regex, again as transformers does. llama.cpp's "smollm"
# splits digits first, so the two differ on spaces before a digit ("a  1": transformers Ġ Ġ 1; llama.cpp ĠĠ 1)
_PRE_TOKENIZER_SPLITS = {
    **dict.fromkeys(
        ["llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
         "jina-v5-nano", "dbrx", "smaug-bpe"], _LLAMA3_SPLIT),
    **dict.fromkeys(["qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez"], _QWEN2_SPLIT),
    "qwen35": _QWEN35_SPLIT,
    "tekken": _TEKKEN_SPLIT,
    **dict.fromkeys(["gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"], _GPT4O_SPLIT),
}


def _add_bos_eos(meta: dict[str, Any]) -> tuple[bool, bool]:
    # Sentencepiece files without the flag get BOS, as llama.cpp and transformers both do.
    add_bos_default = meta.get("tokenizer.ggml.model") == "llama"
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", add_bos_default))
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))
    return add_bos, add_eos


def _special_token(meta: dict[str, Any], gguf_key: str) -> str | None:
    token_id = meta.get(f"tokenizer.ggml.{gguf_key}")
    return None if token_id is None else meta["tokenizer.ggml.tokens"][token_id]


def tokenizer_config(meta: dict[str, Any]) -> dict[str, Any]:
    add_bos, add_eos = _add_bos_eos(meta)
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        "clean_up_tokenization_spaces": False,
    }
    for name, gguf_key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"),
                           ("unk_token", "unknown_token_id"), ("pad_token", "padding_token_id")):
        if (token := _special_token(meta, gguf_key)) is not None:
            config[name] = token
    arch_name = meta["general.architecture"]
    if (context_length := meta.get(f"{arch_name}.context_length")) is not None:
        config["model_max_length"] = context_length
    if (chat_template := meta.get("tokenizer.chat_template")) is not None:
        config["chat_template"] = chat_template
    return config


def build_tokenizer(meta: dict[str, Any]) -> Tokenizer:
    """The ``tokenizers`` Tokenizer that GGUF metadata describes (``tokenizer.ggml.*``)."""
    kind = meta.get("tokenizer.ggml.model")
    if kind == "gpt2":
        tokenizer, vocab = _byte_level_bpe(meta)
    elif kind == "llama":
        tokenizer, vocab = _sentencepiece_bpe(meta)
    else:
        raise ValueError(f"GGUF tokenizer.ggml.model is {kind!r}; supported: ['gpt2', 'llama']")
    _add_gguf_added_tokens(tokenizer, meta, vocab)
    tokenizer.post_processor = _bos_eos_template(meta)
    return tokenizer


def _merges(meta: dict[str, Any], vocab: dict[str, int]) -> list[tuple[str, str]]:
    if "tokenizer.ggml.merges" in meta:
        return [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    scores = dict(zip(meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.scores"]))
    return _merges_from_scores(vocab, scores)


def _merges_from_scores(vocab: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
    """BPE merges implied by a sentencepiece vocabulary: every split of a token into two tokens, best first.

    The order of ties matters for the result; it is transformers' ``generate_merges``: within a token by the
    ids of the two halves, overall by (score, left length, right length), descending, stable.
    """
    merges = []
    for token, score in scores.items():
        splits = [(token[:i], token[i:], score) for i in range(1, len(token))
                  if token[:i] in vocab and token[i:] in vocab]
        merges.extend(sorted(splits, key=lambda m: (vocab[m[0]], vocab[m[1]])))
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in merges]


def _byte_level_bpe(meta: dict[str, Any]) -> tuple[Tokenizer, dict[str, int]]:
    # llama.cpp stores a few tokens as raw text: spell them in the merges' byte alphabet, as transformers does
    spelling = _bytes_to_unicode()
    alphabet = set(spelling.values())
    vocab = {
        token if set(token) <= alphabet else "".join(spelling[b] for b in token.encode()): index
        for index, token in enumerate(meta["tokenizer.ggml.tokens"])
    }
    bpe = models.BPE(vocab=vocab, merges=_merges(meta, vocab), dropout=None, continuing_subword_prefix="",
                     end_of_word_suffix="", fuse_unk=False)
    tokenizer = Tokenizer(bpe)
    split = _PRE_TOKENIZER_SPLITS.get(meta.get("tokenizer.ggml.pre"))
    if split is None:
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer, vocab


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (the alphabet of every byte-level BPE vocabulary)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    extra = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + i) for i, b in enumerate(extra)}}


def _sentencepiece_bpe(meta: dict[str, Any]) -> tuple[Tokenizer, dict[str, int]]:
    """Sentencepiece-style BPE with byte fallback (transformers' LlamaTokenizer layout)."""
    vocab = {token: index for index, token in enumerate(meta["tokenizer.ggml.tokens"])}
    merges = _merges(meta, vocab)
    bpe = models.BPE(vocab=vocab, merges=merges, fuse_unk=True, byte_fallback=True, dropout=None)
    tokenizer = Tokenizer(bpe)
    add_prefix_space = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme="first" if add_prefix_space else "never", split=False
    )
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_prefix_space:
        steps.append(decoders.Strip(content=" ", left=1))
    tokenizer.decoder = decoders.Sequence(steps)
    return tokenizer, vocab


def _add_gguf_added_tokens(tokenizer: Tokenizer, meta: dict[str, Any], vocab: dict[str, int]) -> None:
    """Control tokens and the bos/eos/unk/pad tokens become special; user-defined ones plain added tokens.

    Both are matched whole in the text instead of being cut into pieces, as llama.cpp does. Only tokens
    spelled as in the vocabulary are added: anything else would get a new id past the embedding rows.
    """
    tokens = meta["tokenizer.ggml.tokens"]
    token_types = meta.get("tokenizer.ggml.token_type") or [0] * len(tokens)
    named = {_special_token(meta, k) for k in ("bos_token_id", "eos_token_id", "unknown_token_id",
                                                 "padding_token_id")}
    special = [t for t, kind in zip(tokens, token_types) if (kind == _CONTROL or t in named) and t in vocab]
    user_defined = [t for t, kind in zip(tokens, token_types)
                    if kind == _USER_DEFINED and t not in named and t in vocab]
    tokenizer.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in special])
    tokenizer.add_tokens([AddedToken(t, normalized=False, special=False) for t in user_defined])


def _bos_eos_template(meta: dict[str, Any]) -> processors.TemplateProcessing:
    add_bos, add_eos = _add_bos_eos(meta)
    bos, eos = _special_token(meta, "bos_token_id"), _special_token(meta, "eos_token_id")
    add_bos, add_eos = add_bos and bos is not None, add_eos and eos is not None
    single = f"{f'{bos}:0 ' if add_bos else ''}$A:0{f' {eos}:0' if add_eos else ''}"
    pair = f"{single}{f' {bos}:1' if add_bos else ''} $B:1{f' {eos}:1' if add_eos else ''}"
    special = [(bos, meta["tokenizer.ggml.bos_token_id"])] if add_bos else []
    special += [(eos, meta["tokenizer.ggml.eos_token_id"])] if add_eos else []
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=special)


# ------------------------------------------------------------------------------------------------------------
# weights
