"""A real adapter under another chat template: its tokenizer and model, the template given."""

from __future__ import annotations

from typing import Any, Sequence

import jinja2.sandbox

# A tiny template that thinks, in Qwen3's shape: ChatML turns; the generation prompt opens a think block, or
# writes it closed when ``enable_thinking`` is false; an earlier answer's ``reasoning_content`` is rendered back.
THINK_TEMPLATE = """{%- for m in messages %}
<|im_start|>{{ m.role }}
{% if m.role == "assistant" and m.reasoning_content %}<think>
{{ m.reasoning_content }}
</think>

{% endif %}{{ m.content }}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}
<|im_start|>assistant
{% if enable_thinking is defined and not enable_thinking %}<think>

</think>

{% else %}<think>
{% endif %}
{%- endif %}
"""


class Templated:
    """``adapter`` (delegated to) with ``render_chat`` from ``template``, compiled as the llama.cpp adapter does."""

    def __init__(self, adapter: Any, template: str) -> None:
        self.adapter = adapter
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        self.template = env.from_string(template)
        self.chat_template = template

    def __getattr__(self, name: str) -> Any:
        return getattr(self.adapter, name)

    def render_chat(
        self,
        messages: Sequence[dict[str, Any]],
        *,
        tools: Sequence[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        **kwargs: Any,
    ) -> str:
        return self.template.render(
            messages=list(messages),
            tools=list(tools) if tools else None,
            add_generation_prompt=add_generation_prompt,
            **kwargs,
        )


def _raise(message: str) -> None:
    raise jinja2.TemplateError(message)
