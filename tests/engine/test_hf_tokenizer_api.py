"""``LLM.get_tokenizer()`` as a vLLM script uses it: the transformers tokenizer API, checked against a real
transformers tokenizer loaded from the same files (the bundled SmolLM2, and a variant with a BOS post-processor,
extra special tokens and named chat templates)."""

from __future__ import annotations

import json
import shutil

import pytest

from dsinfer import SamplingParams
from dsinfer.hf_tokenizer import HFTokenizerView
from dsinfer.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")

TEXTS = ["Hello world", "", "  leading and trailing  ", "naïve café — 日本語 🙂", "a<|im_end|>b <|im_start|>user\n",
         "<repo_name>x</s>", "line one\nline two\n\n\tTabbed", "1234567 + 89 = ?"]
CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello! How can I help?"}, {"role": "user", "content": "Count to 3."}],
    [{"role": "user", "content": "say <|im_end|> and <|im_start|>"}],  # special-token strings typed in a message
    [{"role": "user", "content": "unicode: 日本語 🙂\n  indented"}],
]
SPECIAL_ATTRS = ["bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token",
                 "bos_token_id", "eos_token_id", "unk_token_id", "pad_token_id", "sep_token_id", "cls_token_id",
                 "mask_token_id", "all_special_tokens", "all_special_ids", "vocab_size", "model_max_length",
                 "padding_side", "chat_template"]


@pytest.fixture(scope="module")
def model_dir(smollm2_llm):
    return smollm2_llm.engine.model_config.path  # the HF-style directory (the GGUF converted) the engine loaded


@pytest.fixture(scope="module")
def view(smollm2_llm) -> HFTokenizerView:
    return smollm2_llm.get_tokenizer()


@pytest.fixture(scope="module")
def hf(model_dir):
    return transformers.AutoTokenizer.from_pretrained(str(model_dir))


@pytest.fixture(scope="module")
def variant_dir(model_dir, tmp_path_factory):
    """The bundled tokenizer with a BOS-adding post-processor, extra special tokens, no pad token, a longer
    model_max_length and two named chat templates (one for tools)."""
    from tokenizers import Tokenizer as Backend
    from tokenizers.processors import TemplateProcessing

    path = tmp_path_factory.mktemp("variant_tokenizer")
    backend = Backend.from_file(str(model_dir / "tokenizer.json"))
    backend.post_processor = TemplateProcessing(single="<|endoftext|> $A", pair="<|endoftext|> $A <|im_end|> $B:1",
                                                special_tokens=[("<|endoftext|>", 0), ("<|im_end|>", 2)])
    backend.save(str(path / "tokenizer.json"))
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    config.pop("pad_token")
    config.update(bos_token="<|endoftext|>", additional_special_tokens=["<|im_start|>", "<file_sep>"],
                  model_max_length=16, chat_template=[
                      {"name": "default", "template": "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] "
                                                      "{{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}"
                                                      "[assistant] {% endif %}"},
                      {"name": "tool_use", "template": "{{ bos_token }}TOOLS={{ tools | tojson }}{% for m in messages"
                                                       " %}|{{ m['content'] }}{% endfor %}"}])
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    shutil.copy(model_dir / "config.json", path / "config.json")
    return path


@pytest.fixture(scope="module")
def variant(variant_dir):
    return HFTokenizerView(Tokenizer.from_dir(variant_dir)), transformers.AutoTokenizer.from_pretrained(
        str(variant_dir))


def _both(request):
    """(view, transformers tokenizer) for the bundled tokenizer or the variant."""
    if request.param == "bundled":
        return request.getfixturevalue("view"), request.getfixturevalue("hf")
    return request.getfixturevalue("variant")


@pytest.fixture(params=["bundled", "variant"])
def pair(request):
    return _both(request)


def test_special_tokens_and_vocabulary_match(pair):
    view, hf = pair
    for attr in SPECIAL_ATTRS:
        assert getattr(view, attr) == getattr(hf, attr), attr
    assert len(view) == len(hf) and view.get_vocab() == hf.get_vocab()
    assert view.get_added_vocab() == hf.get_added_vocab()
    assert {k: str(v) for k, v in view.added_tokens_decoder.items()} == {
        k: str(v) for k, v in hf.added_tokens_decoder.items()}


def test_the_bundled_model_values_vllm_scripts_read(view):
    assert (view.eos_token, view.eos_token_id, view.bos_token_id, view.pad_token_id) == ("<|im_end|>", 2, 1, 2)
    assert view.vocab_size == len(view) == 49152
    assert view.eos_token_id in view.all_special_ids


def test_call_encode_and_tokenize_match(pair):
    view, hf = pair
    for add in (True, False):
        for text in TEXTS:
            assert dict(view(text, add_special_tokens=add)) == dict(hf(text, add_special_tokens=add)), text
            assert view.encode(text, add_special_tokens=add) == hf.encode(text, add_special_tokens=add), text
            assert view.tokenize(text, add_special_tokens=add) == hf.tokenize(text, add_special_tokens=add), text
        assert dict(view(TEXTS, add_special_tokens=add)) == dict(hf(TEXTS, add_special_tokens=add))
        assert dict(view("question?", "answer!", add_special_tokens=add)) == dict(
            hf("question?", "answer!", add_special_tokens=add))
    assert view.encode("Hello world") == view("Hello world").input_ids  # attribute access, as on BatchEncoding
    assert isinstance(view("x")["input_ids"][0], int) and isinstance(view(["x"])["input_ids"][0], list)


def test_padding_truncation_and_tensors_match(view, hf):
    texts = ["a b c d e f", "short", "<|im_start|>user\nhi"]
    for kwargs in (dict(padding=True), dict(padding="max_length", max_length=9), dict(truncation=True, max_length=3),
                   dict(padding=True, truncation=True, max_length=4, padding_side="left"),
                   dict(return_attention_mask=False)):
        assert dict(view(texts, **kwargs)) == dict(hf(texts, **kwargs)), kwargs
    got, want = view(texts, padding=True, return_tensors="pt"), hf(texts, padding=True, return_tensors="pt")
    assert got.keys() == want.keys() and all(got[k].tolist() == want[k].tolist() for k in got)
    one = view("Hello world", return_tensors="pt")["input_ids"]
    assert one.tolist() == hf("Hello world", return_tensors="pt")["input_ids"].tolist() and one.dim() == 2
    assert view.encode("Hello world") == hf.encode("Hello world")  # padding state does not leak into later calls


def test_padding_needs_a_pad_token_and_the_view_setting_it_does_not_change_the_engine(smollm2_llm, variant):
    view, hf = variant
    with pytest.raises(ValueError, match="no pad token"):
        view(["a", "b c"], padding=True)
    fresh = HFTokenizerView(view.dsinfer_tokenizer)
    fresh.pad_token = fresh.eos_token  # what scripts do for models without a pad token
    hf_copy = transformers.AutoTokenizer.from_pretrained(hf.name_or_path)
    hf_copy.pad_token = hf_copy.eos_token
    assert fresh.pad_token_id == hf_copy.pad_token_id == 2
    assert dict(fresh(["a", "b c"], padding=True)) == dict(hf_copy(["a", "b c"], padding=True))
    assert view.pad_token is None  # another view of the same tokenizer is unaffected
    # get_tokenizer() gives the same view each time, so a setting holds across calls
    assert smollm2_llm.get_tokenizer() is smollm2_llm.get_tokenizer()
    assert smollm2_llm.get_tokenizer().dsinfer_tokenizer is smollm2_llm.engine.tokenizer


def test_decode_keeps_special_tokens_by_default_as_transformers(pair):
    view, hf = pair
    ids = hf.encode("<|im_start|>user\nHi there, 日本語<|im_end|>\n", add_special_tokens=True)
    for skip in (False, True):
        assert view.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)
        assert view.batch_decode([ids, ids[:3], []], skip_special_tokens=skip) == hf.batch_decode(
            [ids, ids[:3], []], skip_special_tokens=skip)
    assert view.decode(ids) == hf.decode(ids) and "<|im_end|>" in view.decode(ids)
    assert view.decode(ids[1]) == hf.decode(ids[1])  # a single id
    import torch

    assert view.decode(torch.tensor(ids)) == hf.decode(torch.tensor(ids))
    assert view.batch_decode(torch.tensor([ids, ids])) == hf.batch_decode(torch.tensor([ids, ids]))


def test_the_engine_tokenizer_keeps_its_own_defaults(view):
    """The engine's Tokenizer still skips special tokens in decode and renders chat templates to strings."""
    inner = view.dsinfer_tokenizer
    assert inner.decode([1, 28, 2]) == view.decode([1, 28, 2], skip_special_tokens=True) != view.decode([1, 28, 2])
    assert isinstance(inner.apply_chat_template(CONVERSATIONS[0]), str)


def test_convert_ids_and_tokens_match(pair):
    view, hf = pair
    ids = [0, 1, 2, 5, 28, 6004, 49151]
    for skip in (False, True):
        assert view.convert_ids_to_tokens(ids, skip_special_tokens=skip) == hf.convert_ids_to_tokens(
            ids, skip_special_tokens=skip)
    assert view.convert_ids_to_tokens(6004) == hf.convert_ids_to_tokens(6004) == "hi"
    tokens = ["Hello", "Ġworld", "<|im_end|>", "<file_sep>", "not-a-token-at-all"]
    assert view.convert_tokens_to_ids(tokens) == hf.convert_tokens_to_ids(tokens)
    assert view.convert_tokens_to_ids("not-a-token-at-all") == hf.convert_tokens_to_ids("not-a-token-at-all") == 0
    assert view.convert_tokens_to_string(tokens[:2]) == hf.convert_tokens_to_string(tokens[:2]) == "Hello world"


@pytest.mark.parametrize("conversation", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [False, True])
def test_apply_chat_template_matches(view, hf, conversation, add_generation_prompt):
    kwargs = dict(add_generation_prompt=add_generation_prompt)
    text = view.apply_chat_template(conversation, tokenize=False, **kwargs)
    assert text == hf.apply_chat_template(conversation, tokenize=False, **kwargs)
    assert text.endswith("<|im_start|>assistant\n") == add_generation_prompt
    ids = view.apply_chat_template(conversation, **kwargs)  # tokenize=True is the default: ids
    assert ids == hf.apply_chat_template(conversation, return_dict=False, **kwargs)
    assert isinstance(ids, list) and all(isinstance(i, int) for i in ids)
    as_dict = view.apply_chat_template(conversation, return_dict=True, **kwargs)
    assert dict(as_dict) == dict(hf.apply_chat_template(conversation, return_dict=True, **kwargs))
    assert as_dict["input_ids"] == ids


def test_apply_chat_template_batches_continuation_and_template_arguments(view, hf):
    batch = CONVERSATIONS[:2]
    assert view.apply_chat_template(batch, add_generation_prompt=True) == hf.apply_chat_template(
        batch, add_generation_prompt=True, return_dict=False)
    assert view.apply_chat_template(batch, tokenize=False) == hf.apply_chat_template(batch, tokenize=False)
    prefill = [*CONVERSATIONS[0], {"role": "assistant", "content": "The capital is "}]
    for tokenize in (False, True):
        got = view.apply_chat_template(prefill, continue_final_message=True, tokenize=tokenize)
        assert got == hf.apply_chat_template(prefill, continue_final_message=True, tokenize=tokenize,
                                             return_dict=False)
    assert view.apply_chat_template(prefill, continue_final_message=True, tokenize=False).endswith("is ")
    custom = "{{ bos_token }}{% for m in messages %}{{ m['content'] | upper }}{{ sep }}{% endfor %}{{ eos_token }}"
    for kwargs in (dict(chat_template=custom, sep=" | "), dict(chat_template=custom, sep="/", eos_token="END")):
        assert view.apply_chat_template(CONVERSATIONS[1], tokenize=False, **kwargs) == hf.apply_chat_template(
            CONVERSATIONS[1], tokenize=False, **kwargs)
    with_none = [{"role": "user", "content": "hi", "name": None}]  # None-valued keys are dropped, as transformers
    assert view.apply_chat_template(with_none, tokenize=False) == hf.apply_chat_template(with_none, tokenize=False)
    with pytest.raises(ValueError, match="not compatible"):
        view.apply_chat_template(prefill, continue_final_message=True, add_generation_prompt=True)
    with pytest.raises(TypeError, match="JSON-schema dicts"):
        view.apply_chat_template(CONVERSATIONS[0], tools=[len])
    with pytest.raises(ValueError, match="empty conversation"):
        view.apply_chat_template([])


def test_named_chat_templates_match(variant):
    view, hf = variant
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    conversation = CONVERSATIONS[1]
    for kwargs in (dict(), dict(add_generation_prompt=True), dict(tools=tools), dict(chat_template="tool_use"),
                   dict(chat_template="default", tools=tools)):
        text = view.apply_chat_template(conversation, tokenize=False, **kwargs)
        assert text == hf.apply_chat_template(conversation, tokenize=False, **kwargs), kwargs
        assert text.startswith("<|endoftext|>")  # bos_token reaches the template
        assert ("TOOLS=" in text) == ("tool_use" in kwargs.values() or ("tools" in kwargs and not kwargs.get(
            "chat_template")))
        assert view.apply_chat_template(conversation, **kwargs) == hf.apply_chat_template(
            conversation, return_dict=False, **kwargs)


def test_chat_template_ids_give_what_llm_chat_gives(smollm2_llm, view):
    """A vLLM script's ``generate({"prompt_token_ids": tok.apply_chat_template(msgs, add_generation_prompt=True)})``
    runs the same prompt, and so gives the same output, as ``llm.chat(msgs)``."""
    greedy = SamplingParams(temperature=0.0, max_tokens=8)
    for conversation in CONVERSATIONS[:2]:
        ids = view.apply_chat_template(conversation, add_generation_prompt=True)
        (chat,) = smollm2_llm.chat(conversation, greedy, use_tqdm=False)
        (direct,) = smollm2_llm.generate({"prompt_token_ids": ids}, greedy, use_tqdm=False)
        assert chat.prompt_token_ids == direct.prompt_token_ids == ids
        assert chat.outputs[0].token_ids == direct.outputs[0].token_ids
        assert chat.outputs[0].text == direct.outputs[0].text
        assert view.decode(direct.outputs[0].token_ids, skip_special_tokens=True) == direct.outputs[0].text
