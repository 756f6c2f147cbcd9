"""The chat format's tools and reasoning for both kinds of tokenizer: ours shows the tools in the system
turn and renders K3.1-style `reasoning_content`; a Hugging Face template shows tools through its own
`tools=` argument when it reads it, else through the documented fallback, and tool calls are read in
the format the template teaches."""
from __future__ import annotations

import json

import pytest

from envs.toolcall import format_tool_call, parse_turn
from policy import Tokenizer
from policy.hf_tokenizer import HFChatTokenizer
from policy.tokenizer import REASONING_TOKENS, SPECIAL_TOKENS, tool_signature
from rl.rollout.layout import reference_example, tool_fallback_warnings

SEARCH = {"type": "function", "function": {
    "name": "search", "description": "Look a key up.",
    "parameters": {"type": "object", "properties": {"query": {"type": "string"}, "limit": {"type": "integer"}},
                   "required": ["query"]}}}
CALL = format_tool_call("search", {"query": "amber-fox"})
MESSAGES = [{"role": "system", "content": "Use the tools."}, {"role": "user", "content": "Find amber-fox."}]

# a Qwen-like template that reads `tools` and writes `tool_calls`, with markers of its own
TOOLS_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n{% if messages[0].role == 'system' %}{{ messages[0].content }}\n{% endif %}"
    "# Tools\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}<|im_end|>\n"
    "{%- elif messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n{% endif %}"
    "{%- for m in messages %}{% if m.role == 'system' %}"
    "{% elif m.role == 'tool' %}<|im_start|>user\n<tool_response>{{ m.content }}</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}{% if m.tool_calls %}{% for c in m.tool_calls %}"
    "<function_call>\n{\"name\": \"{{ c.function.name }}\", \"arguments\": {{ c.function.arguments | tojson }}}"
    "\n</function_call>{% endfor %}{% endif %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.train([CALL, "The answer is 7.", "Find amber-fox.", tool_signature(SEARCH)] * 20, vocab_size=320)


@pytest.fixture(scope="module")
def chatml_dir(tmp_path_factory):
    from tiny_hf_models import save_tiny_chat_model

    return save_tiny_chat_model(tmp_path_factory.mktemp("chatml"), [CALL, "The answer is 7.", "<think>x</think>"] * 20)


def hf(directory, template: str | None = None) -> HFChatTokenizer:
    from transformers import AutoTokenizer

    raw = AutoTokenizer.from_pretrained(str(directory))
    if template is not None:
        raw.chat_template = template
    return HFChatTokenizer(raw)


def test_our_format_lists_the_tools_and_keeps_reasoning(tok):
    assert tool_signature(SEARCH) == "search(query: string, limit?: integer) - Look a key up."
    prompt = tok.decode(tok.apply_chat_template(MESSAGES, effort="low", tools=[SEARCH]))
    assert prompt.startswith("Use the tools.\nTools (call one as <|tool_call|>") and tool_signature(SEARCH) in prompt
    assert tok.apply_chat_template(MESSAGES, tools=[]) == tok.apply_chat_template(MESSAGES)
    ids = tok.apply_chat_template([{"role": "assistant", "reasoning_content": "look it up", "content": CALL}],
                                  add_generation_prompt=False)
    turn = ids[ids.index(tok.token_id("<|assistant|>")) + 1:]
    assert turn[0] == tok.think_id and tok.think_close_id in turn and turn[-1] == tok.tool_call_close_id
    assert tok.reasoning_split(turn) == (2 + len(tok.encode("look it up")), False)
    assert tok.reasoning_split(turn[:3]) == (3, True) and tok.reasoning_split(tok.encode(CALL)) == (0, False)
    assert tok.decode(turn) == "<|think|>look it up<|/think|>" + CALL  # the environment reads the tags
    assert tok.forced_answer_ids == [tok.think_close_id]


def test_a_tokenizer_trained_before_reasoning_tokens_still_loads(tmp_path):
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, pre_tokenizers, trainers

    backend = Backend(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.train_from_iterator(["hello"] * 5, trainers.BpeTrainer(
        vocab_size=300, special_tokens=SPECIAL_TOKENS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    old = Tokenizer(backend)
    assert not old.reasoning and old.forced_answer_ids == [] and old.reasoning_split([5, 6]) == (0, False)
    with pytest.raises(ValueError, match="no reasoning tokens"):
        old.apply_chat_template([{"role": "assistant", "reasoning_content": "x", "content": "y"}])
    assert all(Tokenizer.train(["hello"] * 5, vocab_size=300).token_id(t) for t in REASONING_TOKENS)


def test_a_template_that_ignores_tools_gets_the_fallback_and_a_warning(chatml_dir):
    t = hf(chatml_dir)
    assert t.tool_fallback and t.call_markers == ("<tool_call>\n", "\n</tool_call>")
    text = t.decode(t.apply_chat_template(MESSAGES, effort="high", tools=[SEARCH]), keep_special=True)
    assert json.dumps(SEARCH["function"]) in text and "Reasoning effort: high." in text
    assert '<tool_call>\n{"name": "search", "arguments": {"query": "...", "limit": 0}}\n</tool_call>' in text
    assert "Tool result: amber-fox: 7" in t.decode(t.encode_tool_result("amber-fox: 7"))
    [line] = tool_fallback_warnings(t, {"multihop": [SEARCH], "math": []})
    assert "'multihop'" in line and "search" in line and "<tool_call>" in line


def test_tool_calls_and_reasoning_round_trip_through_the_models_format(chatml_dir):
    t = hf(chatml_dir)
    action = "<|think|>next amber-fox<|/think|>" + CALL
    written = t.render_action(action)
    assert written == '<think>next amber-fox</think><tool_call>\n{"name": "search", "arguments": {"query": "amber-fox"}}\n</tool_call>'
    parsed = parse_turn(t.canonical_action(t.decode(t.encode(written))))
    assert parsed.call.name == "search" and parsed.call.arguments == {"query": "amber-fox"}
    assert parsed.reasoning == "next amber-fox"
    ids = t.encode(written)
    n, still_open = t.reasoning_split(ids)
    assert not still_open and t.decode(ids[:n]).endswith("</think>") and t.decode(ids[n:]).startswith("<tool_call>")
    n_open, still_open = t.reasoning_split(t.encode("<think>next amber"))
    assert still_open and n_open == len(t.encode("<think>next amber"))
    # the warm-up writes references in the model's own format
    ex = reference_example(t, MESSAGES, [{"action": action, "observation": "amber-fox: 7"},
                                         {"action": "The answer is 7.", "observation": None}], "low", [SEARCH])
    text = t.decode(ex["tokens"], keep_special=True)
    assert "<think>next amber-fox</think><tool_call>" in text and "You can call these tools" in text
    generated = t.decode([x for x, m in zip(ex["tokens"], ex["loss_mask"]) if m])
    assert "Tool result" not in generated and "The answer is 7." in generated


def test_a_template_that_shows_tools_gets_them_natively_in_its_own_call_format(chatml_dir):
    t = hf(chatml_dir, TOOLS_TEMPLATE)
    assert not t.tool_fallback and t.call_markers == ("<function_call>\n", "\n</function_call>")
    text = t.decode(t.apply_chat_template(MESSAGES, tools=[SEARCH]), keep_special=True)
    assert "# Tools\n" in text and "Look a key up." in text  # the template's own rendering of the tools
    assert "You can call these tools" not in text and "Reasoning effort: medium." in text
    assert t.decode(t.encode_tool_result("amber-fox: 7")).strip().startswith("user\n<tool_response>amber-fox: 7")
    model_says = '<function_call>\n{"name": "search", "arguments": {"query": "amber-fox"}}\n</function_call>'
    assert t.render_action(CALL) == model_says
    assert parse_turn(t.canonical_action(model_says)).call.arguments == {"query": "amber-fox"}
    assert tool_fallback_warnings(t, {"multihop": [SEARCH]}) == []
