"""Chat templates bridle ships (jinja text), shared by the renderer and the tokenizer folders it writes."""

# The chat template shipped with bridle's Qwen tokenizer folder. Same output as Qwen3's official template
# (Qwen/Qwen3-* tokenizer_config.json), including the enable_thinking switch.
QWEN3_CHAT_TEMPLATE = """\
{%- macro tool_json(t) -%}{{ t | tojson }}{%- endmacro -%}
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}
{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n' }}
{{- 'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}
{%- for t in tools %}{{- '\\n' + tool_json(t) }}{%- endfor %}
{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within '
    '<tool_call></tool_call> XML tags:\\n<tool_call>\\n{"name": <function-name>, "arguments": '
    '<args-json-object>}\\n</tool_call><|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- set st = namespace(open=true, last_query=messages|length - 1) %}
{%- for m in messages | reverse %}
{%- set i = messages|length - 1 - loop.index0 %}
{%- if st.open and m.role == 'user' and m.content is string
      and not (m.content.startswith('<tool_response>') and m.content.endswith('</tool_response>')) %}
{%- set st.open = false %}{%- set st.last_query = i %}
{%- endif %}
{%- endfor %}
{%- for m in messages %}
{%- set body = m.content if m.content is string else '' %}
{%- if m.role == 'user' or (m.role == 'system' and not loop.first) %}
{{- '<|im_start|>' + m.role + '\\n' + body + '<|im_end|>\\n' }}
{%- elif m.role == 'assistant' %}
{%- set think = '' %}
{%- if m.reasoning_content is string %}{%- set think = m.reasoning_content %}
{%- elif '</think>' in body %}
{%- set think = body.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
{%- set body = body.split('</think>')[-1].lstrip('\\n') %}
{%- endif %}
{%- if loop.index0 > st.last_query and (loop.last or think) %}
{{- '<|im_start|>assistant\\n<think>\\n' + think.strip('\\n') + '\\n</think>\\n\\n' + body.lstrip('\\n') }}
{%- else %}
{{- '<|im_start|>assistant\\n' + body }}
{%- endif %}
{%- for c in (m.tool_calls or []) %}
{%- set f = c.function if c.function else c %}
{%- if not loop.first or body %}{{- '\\n' }}{%- endif %}
{{- '<tool_call>\\n{"name": "' + f.name + '", "arguments": ' }}
{{- f.arguments if f.arguments is string else (f.arguments | tojson) }}
{{- '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif m.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\\n<tool_response>\\n' + body + '\\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}
{%- endif %}
"""
