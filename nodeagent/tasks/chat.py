"""Prompts through the model's own chat template, rendered in a sandboxed Jinja environment.

Templates come from model files, so they are untrusted code: an immutable
sandbox, no filesystem access, and strict undefined-variable handling that
still lets templates test ``is defined``. A model without a template gets the
built-in template of the first known format whose turn tokens its vocabulary
has (Gemma's ``<start_of_turn>``, Llama 3's ``<|start_header_id|>``, ...), or
ChatML when it has none of them; the result says which stood in and why.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from datetime import datetime
from typing import Any, Callable

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# Gemma has no system role: its own template puts the system prompt before the first user turn
GEMMA = ("{{ bos_token }}{% if messages[0]['role'] == 'system' %}"
         "{% set prefix = messages[0]['content'] + '\\n\\n' %}{% set rest = messages[1:] %}"
         "{% else %}{% set prefix = '' %}{% set rest = messages %}{% endif %}"
         "{% for m in rest %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
         "{{ prefix if loop.first else '' }}{{ m['content'] | trim }}<end_of_turn>\n{% endfor %}"
         "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")
LLAMA3 = ("{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
          "{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
          "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
PHI3 = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


@dataclass(frozen=True)
class Fallback:
    """A built-in template, for a model whose vocabulary has all of ``markers`` as single tokens (no
    markers: the default, for a vocabulary that matched no known format)."""
    name: str
    markers: tuple[str, ...]
    template: str

    @property
    def note(self) -> str:
        why = (f"its vocabulary has {' and '.join(self.markers)}" if self.markers
               else "its vocabulary has the turn tokens of no known format")
        return f"fallback chat template ({self.name}): the model has none; {why}"


FALLBACKS = (Fallback("ChatML", ("<|im_start|>", "<|im_end|>"), CHATML),
             Fallback("Gemma", ("<start_of_turn>", "<end_of_turn>"), GEMMA),
             Fallback("Llama 3", ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"), LLAMA3),
             Fallback("Phi-3", ("<|user|>", "<|assistant|>", "<|end|>"), PHI3))
DEFAULT_FALLBACK = Fallback("ChatML", (), CHATML)


def pick_fallback(has_token: Callable[[str], bool]) -> Fallback:
    """The first built-in template whose turn tokens are all in the vocabulary (``has_token(text)``: the
    text is one token), else ChatML."""
    return next((fb for fb in FALLBACKS if all(has_token(m) for m in fb.markers)), DEFAULT_FALLBACK)


class TemplateError(Exception):
    pass


@dataclass(frozen=True)
class RenderedPrompt:
    text: str
    fallback: Fallback | None  # the built-in template that stood in when the model had none


def _raise(message: str) -> None:
    raise TemplateError(message)


@lru_cache(maxsize=32)
def _compiled(template: str) -> Any:
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, autoescape=False)
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)


def render(template: str | None, messages: list[dict[str, str]], bos_token: str = "", eos_token: str = "",
           extra: dict[str, Any] | None = None, fallback: Fallback = DEFAULT_FALLBACK) -> RenderedPrompt:
    """Render ``messages`` with ``template``, or with ``fallback``'s template when there is none."""
    from jinja2 import TemplateError as JinjaError

    used = None if template else fallback
    try:
        text = _compiled(template or fallback.template).render(
            messages=messages, add_generation_prompt=True, bos_token=bos_token, eos_token=eos_token,
            **(extra or {}))
    except (JinjaError, TemplateError) as exc:
        if used:
            raise
        # a template that cannot render our messages (e.g. no system role): fold the system prompt in
        if messages and messages[0]["role"] == "system":
            merged = [{"role": "user", "content": messages[0]["content"] + "\n\n" + messages[1]["content"]}]
            return render(template, merged + messages[2:], bos_token, eos_token, extra, fallback)
        raise TemplateError(f"the model's chat template failed: {exc}") from None
    return RenderedPrompt(text=text, fallback=used)
