"""Prompt rendering: the sandbox, and the built-in template chosen for a model that has none."""

import pytest

from nodeagent.tasks.templates import DEFAULT_FALLBACK, FALLBACKS, TemplateError, pick_fallback, render

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": " Hi there \n"},
            {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye"}]


def _vocab(*tokens):
    return lambda text: text in tokens


def test_fallback_follows_the_vocabulary_turn_tokens():
    assert pick_fallback(_vocab("<start_of_turn>", "<end_of_turn>", "<bos>")).name == "Gemma"
    assert pick_fallback(_vocab("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")).name == "Llama 3"
    assert pick_fallback(_vocab("<|user|>", "<|assistant|>", "<|end|>")).name == "Phi-3"
    assert pick_fallback(_vocab("<|im_start|>", "<|im_end|>")).name == "ChatML"
    # every marker is needed: one turn token alone does not make a format
    assert pick_fallback(_vocab("<start_of_turn>")) is DEFAULT_FALLBACK
    assert "no known format" in DEFAULT_FALLBACK.note
    assert "<start_of_turn> and <end_of_turn>" in pick_fallback(_vocab("<start_of_turn>", "<end_of_turn>")).note


def test_gemma_fallback_renders_as_gemma_3s_own_template():
    gemma = next(fb for fb in FALLBACKS if fb.name == "Gemma")
    r = render(None, MESSAGES, bos_token="<bos>", fallback=gemma)
    # Gemma 3's template: no system role (its text opens the first user turn), "model" for the assistant,
    # contents trimmed
    assert r.text == ("<bos><start_of_turn>user\nBe brief.\n\nHi there<end_of_turn>\n"
                      "<start_of_turn>model\nHello.<end_of_turn>\n"
                      "<start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n")
    assert r.fallback is gemma
    assert render(None, MESSAGES[1:2], bos_token="<bos>", fallback=gemma).text == \
        "<bos><start_of_turn>user\nHi there<end_of_turn>\n<start_of_turn>model\n"


def test_each_fallback_ends_with_the_assistant_turn_open():
    ends = {"ChatML": "<|im_start|>assistant\n", "Gemma": "<start_of_turn>model\n",
            "Llama 3": "<|start_header_id|>assistant<|end_header_id|>\n\n", "Phi-3": "<|assistant|>\n"}
    for fb in FALLBACKS:
        text = render(None, MESSAGES, bos_token="<s>", fallback=fb).text
        assert text.endswith(ends[fb.name]) and "Be brief." in text and "Bye" in text, fb.name


def test_model_template_wins_and_is_not_a_fallback():
    r = render("{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}", MESSAGES[:2])
    assert r.text == "[system]Be brief.[user] Hi there \n" and r.fallback is None


def test_template_without_system_role_gets_it_folded_into_the_user_turn():
    strict = ("{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system role') }}"
              "{% endif %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}")
    assert render(strict, [MESSAGES[0], {"role": "user", "content": "Hi"}]).text == "<user>Be brief.\n\nHi"


def test_sandbox_refuses_a_hostile_template():
    with pytest.raises(TemplateError, match="chat template failed"):
        render("{{ ''.__class__.__mro__[1].__subclasses__() }}", MESSAGES[:2])
