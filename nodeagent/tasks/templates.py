"""Prompts through the model's own chat template, rendered in a sandboxed Jinja environment.

Templates come from model files, so they are untrusted code: an immutable
sandbox, no filesystem access, and strict undefined-variable handling that
still lets templates test ``is defined``. A model without a template gets the
built-in template of the first known format whose turn tokens its vocabulary
has (Gemma's ``<start_of_turn>``, Llama 3's ``<|start_header_id|>``, ...), or
ChatML when it has none of them; the result says which stood in and why.
"""

from __future__ import annotations

from contextvars import ContextVar
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from typing import Any, Callable

from nodeagent.errors import TemplateError

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


@dataclass(frozen=True)
class RenderedPrompt:
    text: str
    fallback: Fallback | None  # the built-in template that stood in when the model had none


# The sandbox's resource limits. Templates come from model files: a hostile one must not exhaust memory or time.
MAX_RENDERED_CHARS = 8 << 20  # the whole prompt; the task input is bounded well below this
MAX_VALUE_CHARS = 8 << 20  # one string or list built by '*' or '+'
MAX_RANGE_ITEMS = 100_000  # all range() calls of one render together: nested loops count their product
MAX_POWER_BITS = 64  # '**' results beyond 2 ** this are refused
_range_left: ContextVar[int] = ContextVar("range_left", default=MAX_RANGE_ITEMS)


class SandboxLimit(TemplateError):
    """A template went past one of the sandbox's resource limits."""


def _raise(message: str) -> None:
    raise TemplateError(message)


def _limited_range(*args: int) -> range:
    r = range(*args)
    left = _range_left.get() - len(r)
    if left < 0:
        raise SandboxLimit(f"the chat template asked for more than {MAX_RANGE_ITEMS} range() items in one render")
    _range_left.set(left)
    return r


def _size(value: Any) -> int | None:
    return len(value) if isinstance(value, (str, list, tuple)) else None


def _check_binop(operator: str, left: Any, right: Any) -> None:
    if operator == "**":
        if isinstance(left, (int, float)) and isinstance(right, (int, float)) and abs(left) > 1 and right > 0:
            import math

            if right * math.log2(abs(left)) > MAX_POWER_BITS:
                raise SandboxLimit(f"the chat template computes {left!r} ** {right!r}, past the sandbox's "
                                   f"2**{MAX_POWER_BITS} limit")
    elif operator == "*":
        for seq, n in ((left, right), (right, left)):
            size = _size(seq)
            if size is not None and isinstance(n, int) and size * n > MAX_VALUE_CHARS:
                raise SandboxLimit(f"the chat template builds a value of {size * n} items, over the sandbox's "
                                    f"{MAX_VALUE_CHARS}")
    elif operator == "+":
        a, b = _size(left), _size(right)
        if a is not None and b is not None and a + b > MAX_VALUE_CHARS:
            raise SandboxLimit(f"the chat template builds a value of {a + b} items, over the sandbox's "
                                f"{MAX_VALUE_CHARS}")


@lru_cache(maxsize=32)
def _compiled(template: str) -> Any:
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class LimitedSandbox(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset({"*", "**", "+"})

        def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
            _check_binop(operator, left, right)
            return super().call_binop(context, operator, left, right)

    env = LimitedSandbox(trim_blocks=True, lstrip_blocks=True, autoescape=False)
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.globals["range"] = _limited_range
    return env.from_string(template)


def _render_bounded(template: str, **context: Any) -> str:
    """Render, stopping as soon as the output passes MAX_RENDERED_CHARS; range() items are counted per render."""
    token = _range_left.set(MAX_RANGE_ITEMS)
    try:
        parts, size = [], 0
        for chunk in _compiled(template).generate(**context):
            size += len(chunk)
            if size > MAX_RENDERED_CHARS:
                raise SandboxLimit(f"the chat template renders more than {MAX_RENDERED_CHARS} characters")
            parts.append(chunk)
        return "".join(parts)
    finally:
        _range_left.reset(token)


def render(template: str | None, messages: list[dict[str, str]], bos_token: str = "", eos_token: str = "",
           extra: dict[str, Any] | None = None, fallback: Fallback = DEFAULT_FALLBACK) -> RenderedPrompt:
    """Render ``messages`` with ``template``, or with ``fallback``'s template when there is none. Whatever goes
    wrong while rendering (a template error, a limit of the sandbox, any exception the template provokes)
    is a TemplateError."""
    used = None if template else fallback
    try:
        text = _render_bounded(template or fallback.template, messages=messages, add_generation_prompt=True,
                               bos_token=bos_token, eos_token=eos_token, **(extra or {}))
    except SandboxLimit:
        raise
    except Exception as exc:  # noqa: BLE001  (untrusted code: any exception it provokes is its failure)
        if used:
            raise TemplateError(f"the built-in {used.name} template failed: {exc}") from None
        # a template that cannot render our messages (e.g. no system role): fold the system prompt in
        if messages and messages[0]["role"] == "system" and len(messages) > 1:
            merged = [{"role": "user", "content": messages[0]["content"] + "\n\n" + messages[1]["content"]}]
            return render(template, merged + messages[2:], bos_token, eos_token, extra, fallback)
        raise TemplateError(f"the model's chat template failed: {type(exc).__name__}: {exc}") from None
    return RenderedPrompt(text=text, fallback=used)
