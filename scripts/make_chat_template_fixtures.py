"""Capture transformers' chat-template rendering (and encode/decode) as fixtures for tests/test_tokenizer.py.

Run with a Python that has transformers (jaxserve itself never imports it):

    /tmp/venv311/bin/python scripts/make_chat_template_fixtures.py

For each case below it writes a model dir under tests/fixtures/chat_templates/models/<name>/ (a tiny byte-level
BPE tokenizer.json, tokenizer_config.json and, for some, chat_template.jinja / additional_chat_templates/),
loads it with transformers' PreTrainedTokenizerFast.from_pretrained (no download), and records
apply_chat_template(..., tokenize=False) -- or the error it raised -- plus a few encode/decode results in
tests/fixtures/chat_templates/cases.json. The templates are written here as data, modelled on public ones.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "fixtures" / "chat_templates"

SPECIALS = ["<s>", "</s>", "<unk>", "<pad>", "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
            "<|eot_id|>", "<|im_start|>", "<|im_end|>", "<|endoftext|>", "[INST]", "[/INST]"]
CORPUS = ["Hello world, how are you today?", "The weather in Paris is 22 degrees.", "Café crème, naïve résumé",
          "東京の天気は晴れです", "emoji 🙂🚀 test", "def add(a, b): return a + b", '{"name": "get_weather"}'] * 20


def build_tokenizer(bos_in_post_processor: bool) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    if bos_in_post_processor:
        bos = "<|begin_of_text|>"
        tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                           special_tokens=[(bos, tok.token_to_id(bos))])
    return tok


LLAMA3 = """{% set loop_messages = messages %}
{% for message in loop_messages %}
    {% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' %}
    {% if loop.index0 == 0 %}
        {% set content = bos_token + content %}
    {% endif %}
    {{ content }}
{% endfor %}
{% if add_generation_prompt %}
    {{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{% endif %}
"""

CHATML_TOOLS = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nReturn calls as <tool_call>{\\"name\\": ..., \\"arguments\\": ...}</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

MISTRAL = ("{{ bos_token }}{% for message in messages %}"
           "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
           "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
           "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
           "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token }}"
           "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}"
           "{% endfor %}")

LOOPCTL = """{% set ns = namespace(turns=0) %}
{% set meta = dict(year_len=strftime_now('%Y') | length) %}
Year digits: {{ meta.year_len }}
{% for message in messages %}
    {% if message.role == 'system' %}
        {% continue %}
    {% endif %}
    {% if message.content == 'STOP' %}
        {% break %}
    {% endif %}
    {% set ns.turns = ns.turns + 1 %}
    [{{ loop.index }}{{ '*' if loop.last else '' }}] {{ message.role }}: {{ message.content }}
{% endfor %}
turns={{ ns.turns }}
{% if add_generation_prompt %}
assistant:
{% endif %}
"""

KWARGS = """{%- for message in messages %}
<{{ message.role }}>
{%- if message.reasoning_content is defined %}[think:{{ message.thinking }}|{{ message.reasoning_content }}]{% endif %}
{%- if message.tool_calls is defined %}[tool_calls present]{% endif %}
{{ message.content if message.content is string else message.content | tojson(indent=2, sort_keys=True) }}
{%- endfor %}
{%- if documents %}
{%- for doc in documents %}
DOC {{ loop.index }}: {{ doc | tojson(separators=(',', ':'), sort_keys=True) }}
{%- endfor %}
{%- endif %}
{%- if tools is none %} no-tools{% endif %}
{%- if enable_thinking is defined and not enable_thinking %} /no_think{% endif %}
{%- if custom_list %} {{ custom_list | join('+') }}{% endif %}
{{ bos_token | default('NO-BOS') }}|{{ eos_token }}|{{ pad_token | default('NO-PAD') }}|{{ unk_token }}|{{ image_token | default('NO-IMAGE') }}
{%- if add_generation_prompt %}
<assistant>
{%- endif %}"""

NAMED_DEFAULT = "{% for m in messages %}DEFAULT {{ m.role }}: {{ m.content }}\n{% endfor %}"
NAMED_TOOL_USE = ("{% for t in tools %}TOOL {{ t.function.name }}\n{% endfor %}"
                  "{% for m in messages %}TOOL_USE {{ m.role }}: {{ m.content }}\n{% endfor %}")
JINJA_FILE = "{% for m in messages %}<<{{ m.role }}>>{{ m.content }}{{ eos_token }}\n{% endfor %}"
JINJA_TOOL_USE = "{{ tools | length }} tools; {% for m in messages %}{{ m.content }};{% endfor %}"

GENERATION = """{% set ns = namespace(n=0) %}
{% for m in messages %}
{% if m.role == 'assistant' %}
{% generation %}
{% set x = 1 %}{% set ns.n = ns.n + 1 %}[{{ m.content }}]
{% endgeneration %}
{% else %}
{{ m.content }}
{% endif %}
{% endfor %}
{{ x is defined }} {{ ns.n }}"""

USER = [{"role": "user", "content": "Hello!"}]
CHAT = [{"role": "system", "content": "  Be brief. \n"}, {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Hello! How can I help?"}, {"role": "user", "content": "Weather in Paris?"}]
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Get the weather — in °C",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "城市"}},
                   "required": ["city"]}}}]
TOOL_CHAT = [
    {"role": "user", "content": "Weather in Paris and 東京?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
        {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "東京"}}}]},
    {"role": "tool", "content": '{"temp": 22}'}, {"role": "tool", "content": '{"temp": 18}'},
    {"role": "assistant", "content": "Paris 22°C, 東京 18°C 🙂"}]

MODELS = {
    "llama3": {"post_bos": True, "config": {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>",
                                            "chat_template": LLAMA3}},
    "chatml_tools": {"config": {"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
                                "chat_template": CHATML_TOOLS}},
    "mistral": {"config": {"bos_token": {"content": "<s>", "lstrip": False, "normalized": False, "rstrip": False,
                                         "single_word": False, "special": True, "__type": "AddedToken"},
                           "eos_token": "</s>", "unk_token": "<unk>", "add_bos_token": True, "add_eos_token": False,
                           "chat_template": MISTRAL}},
    "mistral_eos": {"config": {"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True,
                               "add_eos_token": True}},
    "loopctl": {"config": {"eos_token": "</s>", "chat_template": LOOPCTL}},
    "kwargs": {"config": {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "image_token": "<pad>",
                          "chat_template": KWARGS}},
    "named": {"config": {"eos_token": "</s>", "chat_template": [{"name": "default", "template": NAMED_DEFAULT},
                                                                {"name": "tool_use", "template": NAMED_TOOL_USE}]}},
    "jinja_file": {"config": {"eos_token": "</s>", "chat_template": "IGNORED {{ messages }}"},
                   "files": {"chat_template.jinja": JINJA_FILE}},
    "jinja_dir": {"config": {"eos_token": "</s>"},
                  "files": {"chat_template.jinja": JINJA_FILE,
                            "additional_chat_templates/tool_use.jinja": JINJA_TOOL_USE}},
    "no_template": {"config": {"bos_token": "<s>", "eos_token": "</s>"}},
    # special / added tokens that tokenizer.json lacks: transformers adds them on load
    "extra_tokens": {"config": {
        "bos_token": "<|newbos|>", "eos_token": "</s>", "extra_special_tokens": ["<|extra|>"],
        "added_tokens_decoder": {"500": {"content": "<tool>", "lstrip": False, "normalized": True, "rstrip": False,
                                         "single_word": False, "special": False}}}},
}

CASES = [
    ("llama3", "basic", USER, {"add_generation_prompt": True}),
    ("llama3", "multi_turn", CHAT, {}),
    ("chatml_tools", "no_tools", CHAT, {"add_generation_prompt": True}),
    ("chatml_tools", "tools", TOOL_CHAT, {"tools": TOOLS, "add_generation_prompt": True}),
    ("chatml_tools", "continue_final", [*USER, {"role": "assistant", "content": "Sure, here "}],
     {"continue_final_message": True}),
    ("mistral", "alternating", CHAT[1:], {}),
    ("mistral", "not_alternating", [USER[0], USER[0]], {}),
    ("mistral", "system_role", CHAT, {}),
    ("loopctl", "loopcontrols", [*CHAT, {"role": "user", "content": "STOP"}, *USER], {"add_generation_prompt": True}),
    ("loopctl", "last", CHAT, {}),
    ("kwargs", "kwargs_documents", [
        {"role": "user", "content": "Summarise", "name": None},
        {"role": "assistant", "content": [{"type": "text", "text": "ok ✓"}, {"type": "x", "b": 1}],
         "reasoning_content": "hmm… 考虑", "tool_calls": None}],
     {"documents": [{"title": "Doc ü", "text": "Body — 本文"}], "enable_thinking": False,
      "custom_list": ["a", "ß"], "add_generation_prompt": True}),
    ("kwargs", "tools_empty_list", USER, {"tools": []}),
    ("named", "default", USER, {}),
    ("named", "tools_pick_tool_use", USER, {"tools": TOOLS}),
    ("named", "explicit_tool_use", USER, {"chat_template": "tool_use", "tools": TOOLS}),
    ("named", "literal_template", USER, {"chat_template": "LITERAL {{ messages | length }}"}),
    ("jinja_file", "file_wins", CHAT, {}),
    ("jinja_dir", "dir_default", CHAT, {}),
    ("jinja_dir", "dir_tool_use", CHAT, {"tools": TOOLS}),
    ("no_template", "literal_only", USER, {"chat_template": "{{ bos_token }}{{ messages[0].content }}"}),
    ("no_template", "generation_tag", CHAT, {"chat_template": GENERATION}),
]

ENCODE_TEXTS = ["Hello world", "Café 東京 🙂", "<s>[INST] hi [/INST]</s>", "", "<|newbos|>a<tool>b<|extra|>"]


def main() -> None:
    if OUT.exists():
        shutil.rmtree(OUT)
    (OUT / "models").mkdir(parents=True)
    for name, spec in MODELS.items():
        d = OUT / "models" / name
        d.mkdir()
        build_tokenizer(spec.get("post_bos", False)).save(str(d / "tokenizer.json"))
        (d / "tokenizer_config.json").write_text(json.dumps(spec["config"], indent=2, ensure_ascii=False) + "\n",
                                                 encoding="utf-8")
        for rel, text in spec.get("files", {}).items():
            (d / rel).parent.mkdir(parents=True, exist_ok=True)
            (d / rel).write_text(text, encoding="utf-8")

    def load(name: str):
        return transformers.PreTrainedTokenizerFast.from_pretrained(str(OUT / "models" / name))

    cases = []
    for model, name, messages, kwargs in CASES:
        tok = load(model)
        case = {"model": model, "name": name, "messages": messages, "kwargs": kwargs,
                "template": tok.get_chat_template(kwargs.get("chat_template"), kwargs.get("tools"))}
        try:
            case["expected"] = tok.apply_chat_template(messages, tokenize=False, **kwargs)
        except Exception as e:  # noqa: BLE001 -- the error is the expected outcome
            case["expected_error"] = str(e)
        cases.append(case)
    encode_cases, vocab_facts = [], {}
    for model in ["llama3", "mistral", "mistral_eos", "chatml_tools", "extra_tokens"]:
        tok = load(model)
        vocab_facts[model] = {"len": len(tok), "added_vocab": tok.get_added_vocab(),
                              "all_special_ids": tok.all_special_ids, "bos_token_id": tok.bos_token_id,
                              "eos_token_id": tok.eos_token_id, "special_tokens_map": tok.special_tokens_map}
        for text in ENCODE_TEXTS:
            for add in (True, False):
                ids = tok.encode(text, add_special_tokens=add)
                encode_cases.append({"model": model, "text": text, "add_special_tokens": add, "ids": ids,
                                     "decoded": tok.decode(ids, skip_special_tokens=False),
                                     "decoded_skip": tok.decode(ids, skip_special_tokens=True)})
    doc = {"generated_by": "scripts/make_chat_template_fixtures.py", "transformers_version": transformers.__version__,
           "python": sys.version.split()[0], "cases": cases, "encode_cases": encode_cases, "vocab_facts": vocab_facts}
    (OUT / "cases.json").write_text(json.dumps(doc, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    print(f"wrote {len(cases)} chat cases and {len(encode_cases)} encode cases to {OUT / 'cases.json'}")
    for c in cases:
        print(f"--- {c['model']}/{c['name']}:", repr(c.get("expected", c.get("expected_error")))[:200])


if __name__ == "__main__":
    main()
