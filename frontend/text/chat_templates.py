"""Built-in chat templates for GGUF files whose metadata carries none.

llama.cpp's converter copies `tokenizer.chat_template` only when the source checkpoint had one;
the Gemma 3 270M GGUF has none, and llama.cpp then falls back to templates it knows. This keeps
the same fallback for the architectures the engine serves, with the model family's own template
(Gemma 3's is the one of google/gemma-3-270m-it's tokenizer_config.json).
"""

from __future__ import annotations

GEMMA3_CHAT_TEMPLATE = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\\n\\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ '<start_of_image>' }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\\n'}}
{%- endif -%}
"""

# general.architecture -> the template used when the GGUF has no tokenizer.chat_template.
GGUF_ARCHITECTURE_TO_CHAT_TEMPLATE = {"gemma3": GEMMA3_CHAT_TEMPLATE}


def default_gguf_chat_template(architecture: str | None) -> str | None:
    """The built-in template of a GGUF architecture, None when there is none."""
    return GGUF_ARCHITECTURE_TO_CHAT_TEMPLATE.get(architecture or "")
