"""Tokenizer: training, round trips, special tokens, chat template."""
from __future__ import annotations

import pytest

from policy import Tokenizer

CORPUS = [f"def f{i}(x):\n    return x * {i} + 1  # ünïcode ✓" for i in range(200)] + \
         [f"The answer to question {i} is {i * 7}." for i in range(200)]


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.train(CORPUS, vocab_size=400)


def test_round_trip_and_ids(tok, tmp_path):
    assert tok.vocab_size <= 400 and (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 1, 2)
    assert len({tok.pad_id, tok.bos_id, tok.eos_id, tok.tool_call_id, tok.tool_call_close_id,
                tok.tool_result_id, *tok.effort_ids.values()}) == 10
    for text in ["def f3(x):\n    return 42", "emoji 🚀 and tabs\t", "", "never seen: QZXJ ñ"]:
        assert tok.decode(tok.encode(text)) == text
    ids = tok.encode('run <|tool_call|>{"name": "py"}<|/tool_call|>')
    assert tok.tool_call_id in ids and ids[-1] == tok.tool_call_close_id
    assert tok.decode(ids) == 'run <|tool_call|>{"name": "py"}<|/tool_call|>'
    tok.save(tmp_path)
    back = Tokenizer.load(tmp_path)
    assert back.encode(CORPUS[5]) == tok.encode(CORPUS[5]) and back.eos_id == tok.eos_id


def test_chat_template_matches_incremental_rollout(tok):
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "what is 6*7?"}]
    prompt = tok.apply_chat_template(msgs, effort="high")
    assert prompt[:2] == [tok.bos_id, tok.effort_ids["high"]] and prompt[-1] == tok.token_id("<|assistant|>")
    call = 'let me check <|tool_call|>{"name": "py", "arguments": {}}<|/tool_call|>'
    rollout = prompt + tok.encode(call) + tok.encode_tool_result("42") + tok.encode("42") + [tok.eos_id]
    full = tok.apply_chat_template(msgs + [{"role": "assistant", "content": call},
                                           {"role": "tool", "content": "42"},
                                           {"role": "assistant", "content": "42"}],
                                   effort="high", add_generation_prompt=False)
    assert rollout == full
    assert tok.decode(full) == "be briefwhat is 6*7?" + call + "4242"
    efforts = {tuple(tok.apply_chat_template(msgs, effort=e)[:2]) for e in ("low", "medium", "high", "max")}
    assert len(efforts) == 4


def test_errors(tok):
    with pytest.raises(ValueError, match="effort"):
        tok.apply_chat_template([], effort="huge")
    with pytest.raises(ValueError, match="role"):
        tok.apply_chat_template([{"role": "robot", "content": "x"}])
    with pytest.raises(ValueError, match="vocab_size"):
        Tokenizer.train(CORPUS, vocab_size=100)
