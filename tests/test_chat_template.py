"""worker/chat_template.py renders a chat template as transformers' apply_chat_template does,
in a process of its own (the bounds and cancels: tests/test_hostile_host.py, through workers)."""

from __future__ import annotations

from pathlib import Path

from worker import chat_template

# Every name transformers' environment adds, and the extensions it loads.
FEATURES = (
    "{%- set ns = namespace(seen=0) -%}{{ bos_token }}{%- for m in messages -%}"
    "{%- if m.role == 'stop' %}{% break %}{% endif -%}{%- set ns.seen = ns.seen + 1 -%}"
    "{% generation %}<{{ m.role }}>{{ m.content }}{% endgeneration %}"
    "{%- for call in m.tool_calls or [] %}{{ call.function | tojson(indent=2) }}{% endfor -%}"
    "{%- endfor -%}{{ dict(a=1) | tojson }}{{ ns.seen }}"
    "{%- if tools %}{{ tools | map(attribute='function.name') | join(',') }}{% endif -%}"
    "{{ strftime_now('%Y')[:2] }}{% if add_generation_prompt %}<assistant>{% endif %}"
)


def test_a_template_renders_as_transformers_renders_it(tiny_model_dir: Path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.chat_template = FEATURES
    messages = [
        {"role": "user", "content": "hé <b>"},
        {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": {"x": "ü"}}}]},
        {"role": "stop", "content": "never"},
    ]
    tools = [{"type": "function", "function": {"name": "f"}}, {"type": "function", "function": {"name": "g"}}]
    expected = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
    rendered = chat_template.render(FEATURES, messages, tools, add_generation_prompt=True,
                                    variables=dict(tokenizer.special_tokens_map), context_length=2048)
    assert rendered == expected
