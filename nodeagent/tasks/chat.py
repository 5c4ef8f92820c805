"""Prompts through the model's own chat template, rendered in a sandboxed Jinja environment.

Templates come from model files, so they are untrusted code: an immutable
sandbox, no filesystem access, and strict undefined-variable handling that
still lets templates test ``is defined``. A model without a template gets a
ChatML fallback, and the result says so.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from datetime import datetime
from typing import Any

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


class TemplateError(Exception):
    pass


@dataclass(frozen=True)
class RenderedPrompt:
    text: str
    fallback: bool  # True when the model had no chat template and ChatML stood in


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
           extra: dict[str, Any] | None = None) -> RenderedPrompt:
    from jinja2 import TemplateError as JinjaError

    fallback = not template
    try:
        text = _compiled(template or CHATML).render(
            messages=messages, add_generation_prompt=True, bos_token=bos_token, eos_token=eos_token,
            **(extra or {}))
    except (JinjaError, TemplateError) as exc:
        if fallback:
            raise
        # a template that cannot render our messages (e.g. no system role): fold the system prompt in
        if messages and messages[0]["role"] == "system":
            merged = [{"role": "user", "content": messages[0]["content"] + "\n\n" + messages[1]["content"]}]
            return render(template, merged + messages[2:], bos_token, eos_token, extra)
        raise TemplateError(f"the model's chat template failed: {exc}") from None
    return RenderedPrompt(text=text, fallback=fallback)
