# ruff: noqa: E501  (template lines are kept as the real templates write them)
"""Short, faithful copies of real families' chat templates (the markup each writes for
turns, tools, tool calls, tool results and reasoning; long system texts cut), for tiny
test checkpoints: mlx-lm chooses a tool parser from this text as it would from the real
tokenizer_config.json. Sources: zai-org/GLM-4.7's chat_template.jinja, openai/gpt-oss-20b's
(harmony), Qwen/Qwen3-Coder-30B-A3B-Instruct's and MiniMaxAI/MiniMax-M2's."""

# GLM-4.7: `[gMASK]<sop>`, <|user|>/<|assistant|>/<|observation|>, reasoning in <think>
# (the generation prompt opens it), calls as name<arg_key>k</arg_key><arg_value>v</arg_value>.
GLM47 = """[gMASK]<sop>
{%- if tools -%}
<|system|>
# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{% for tool in tools %}
{{ tool | tojson(ensure_ascii=False) }}
{% endfor %}
</tools>

For each function call, output the function name and arguments within the following XML format:
<tool_call>{function-name}<arg_key>{arg-key-1}</arg_key><arg_value>{arg-value-1}</arg_value><arg_key>{arg-key-2}</arg_key><arg_value>{arg-value-2}</arg_value>...</tool_call>{%- endif -%}
{%- for m in messages -%}
{%- if m.role == 'user' -%}<|user|>{{ m.content }}
{%- elif m.role == 'assistant' -%}<|assistant|>
{%- if m.reasoning_content -%}{{ '<think>' + m.reasoning_content.strip() + '</think>' }}
{%- else -%}{{ '</think>' }}{%- endif -%}
{%- if m.content and m.content.strip() -%}{{ m.content.strip() }}{%- endif -%}
{%- if m.tool_calls -%}
{%- for tc in m.tool_calls -%}
{%- if tc.function %}{%- set tc = tc.function %}{%- endif -%}
{{- '<tool_call>' + tc.name -}}
{%- for k, v in tc.arguments.items() -%}<arg_key>{{ k }}</arg_key><arg_value>{{ v | tojson(ensure_ascii=False) if v is not string else v }}</arg_value>{%- endfor -%}</tool_call>
{%- endfor -%}
{%- endif -%}
{%- elif m.role == 'tool' -%}
{%- if loop.first or (messages[loop.index0 - 1].role != 'tool') -%}{{- '<|observation|>' }}{%- endif -%}
{{- '<tool_response>' + m.content + '</tool_response>' -}}
{%- elif m.role == 'system' -%}<|system|>{{ m.content }}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}<|assistant|>{{- '</think>' if (enable_thinking is defined and not enable_thinking) else '<think>' -}}{%- endif -%}"""

# gpt-oss (harmony): every message <|start|>role<|channel|>...<|message|>...<|end|>; tools
# as a TypeScript namespace in the developer message; a call goes to the commentary
# channel addressed to functions.NAME and ends with <|call|>; reasoning is the analysis
# channel; the generation prompt is <|start|>assistant.
GPT_OSS = """{#- harmony -#}
<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.
Knowledge cutoff: 2024-06

Reasoning: {{ reasoning_effort | default('medium') }}

# Valid channels: analysis, commentary, final. Channel must be included for every message.
{%- if tools %}
Calls to these tools must go to the commentary channel: 'functions'.
{%- endif -%}
<|end|>
{%- set ns = namespace(developer='', tool_name='') -%}
{%- for m in messages if m.role in ('system', 'developer') -%}{%- set ns.developer = m.content -%}{%- endfor -%}
{%- if ns.developer or tools -%}
<|start|>developer<|message|>
{%- if ns.developer %}# Instructions

{{ ns.developer }}

{% endif -%}
{%- if tools -%}
# Tools

## functions

namespace functions {
{% for tool in tools -%}
{%- set tool = tool.function if tool.function is defined else tool %}
// {{ tool.description }}
type {{ tool.name }} = (_: {{ tool.parameters | tojson }}) => any;
{% endfor -%}
} // namespace functions
{%- endif -%}
<|end|>
{%- endif -%}
{%- for m in messages -%}
{%- if m.role == 'user' -%}<|start|>user<|message|>{{ m.content }}<|end|>
{%- elif m.role == 'assistant' -%}
{%- if m.thinking -%}<|start|>assistant<|channel|>analysis<|message|>{{ m.thinking }}<|end|>{%- endif -%}
{%- if m.tool_calls -%}
{%- set tc = m.tool_calls[0].function if m.tool_calls[0].function is defined else m.tool_calls[0] -%}
{%- set ns.tool_name = tc.name -%}
<|start|>assistant to=functions.{{ tc.name }}<|channel|>commentary json<|message|>{{ tc.arguments | tojson }}<|call|>
{%- else -%}<|start|>assistant<|channel|>final<|message|>{{ m.content }}<|end|>
{%- endif -%}
{%- elif m.role == 'tool' -%}<|start|>functions.{{ ns.tool_name }} to=assistant<|channel|>commentary<|message|>{{ m.content | tojson }}<|end|>
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}<|start|>assistant{%- endif -%}"""

# Qwen3-Coder: ChatML turns; tools in <tools> as <function><name>…; a call is XML:
# <tool_call>\n<function=NAME>\n<parameter=KEY>\nVALUE\n</parameter>\n</function>\n</tool_call>.
QWEN3_CODER = """{%- if tools -%}
<|im_start|>system
You are Qwen, a helpful AI assistant that can interact with a computer to solve tasks.

# Tools

You have access to the following functions:

<tools>
{%- for tool in tools %}
{%- set tool = tool.function if tool.function is defined else tool %}
<function>
<name>{{ tool.name }}</name>
<description>{{ tool.description }}</description>
<parameters>
{%- for name, p in tool.parameters.properties.items() %}
<parameter>
<name>{{ name }}</name>
<type>{{ p.type }}</type>
</parameter>
{%- endfor %}
</parameters>
</function>
{%- endfor %}
</tools>

If you choose to call a function ONLY reply in the following format with NO suffix:

<tool_call>
<function=example_function_name>
<parameter=example_parameter_1>
value_1
</parameter>
</function>
</tool_call><|im_end|>
{% endif -%}
{%- for m in messages -%}
{%- if m.role == 'assistant' and m.tool_calls -%}
<|im_start|>assistant
{%- if m.content %}
{{ m.content }}{% endif -%}
{%- for tc in m.tool_calls -%}
{%- if tc.function is defined %}{%- set tc = tc.function %}{%- endif %}
<tool_call>
<function={{ tc.name }}>
{% for k, v in tc.arguments.items() -%}
<parameter={{ k }}>
{{ v if v is string else v | tojson }}
</parameter>
{% endfor -%}
</function>
</tool_call>
{%- endfor -%}<|im_end|>
{% elif m.role == 'tool' -%}
<|im_start|>user
<tool_response>
{{ m.content }}
</tool_response><|im_end|>
{% else -%}
<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif -%}
{%- endfor -%}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif -%}"""

# MiniMax-M2: turns as ]~b]role ... [e~[ (]~!b[ opens the conversation), tools in <tools>
# as <tool>JSON</tool>, reasoning in <think> (the generation prompt opens it), a call as
# <minimax:tool_call><invoke name="N"><parameter name="K">V</parameter></invoke>...
MINIMAX_M2 = """{%- set ns = namespace(system='You are a helpful assistant.') -%}
{%- if messages[0].role == 'system' -%}{%- set ns.system = messages[0].content -%}{%- endif -%}
{{- ']~!b[' ~ ']~b]system' ~ '\n' ~ ns.system }}
{%- if tools %}

# Tools
You may call one or more tools to assist with the user query.
Here are the tools available in JSONSchema format:

<tools>
{% for tool in tools %}<tool>{{ tool.function | tojson(ensure_ascii=False) }}</tool>
{% endfor -%}
</tools>

When making tool calls, use XML format to invoke tools and pass parameters:

<minimax:tool_call>
<invoke name="tool-name-1">
<parameter name="param-key-1">param-value-1</parameter>
</invoke>
</minimax:tool_call>
{%- endif -%}
{{- '[e~[\n' }}
{%- for m in messages -%}
{%- if m.role == 'user' -%}{{- ']~b]user' ~ '\n' ~ m.content ~ '[e~[' ~ '\n' }}
{%- elif m.role == 'assistant' -%}{{- ']~b]ai' ~ '\n' }}
{%- if m.reasoning_content -%}{{- '<think>' ~ '\n' ~ m.reasoning_content ~ '\n' ~ '</think>' ~ '\n\n' }}{%- endif -%}
{%- if m.content -%}{{- m.content }}{%- endif -%}
{%- if m.tool_calls -%}
{{- '\n' ~ '<minimax:tool_call>' ~ '\n' }}
{%- for tc in m.tool_calls -%}{%- set tc = tc.function if tc.function is defined else tc -%}
{{- '<invoke name="' ~ tc.name ~ '">' ~ '\n' }}
{%- for k, v in tc.arguments.items() -%}{{- '<parameter name="' ~ k ~ '">' ~ (v if v is string else v | tojson) ~ '</parameter>' ~ '\n' }}{%- endfor -%}
{{- '</invoke>' ~ '\n' }}
{%- endfor -%}
{{- '</minimax:tool_call>' }}
{%- endif -%}
{{- '[e~[' ~ '\n' }}
{%- elif m.role == 'tool' -%}{{- ']~b]tool' ~ '\n' ~ '<response>' ~ m.content ~ '</response>' ~ '[e~[' ~ '\n' }}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- ']~b]ai' ~ '\n' ~ '<think>' ~ '\n' }}{%- endif -%}"""
