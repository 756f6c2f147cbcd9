"""Token layout of an episode, shared by the rollout worker and the supervised warm-up so both see
exactly the same sequence: chat prompt, then per turn the assistant's tokens (ending on a stop
token) and, when the episode goes on, the tool result tokens (never trained on)."""
from __future__ import annotations

from typing import Any, Iterator


def stop_token_ids(tokenizer) -> set[int]:
    """Tokens that end an assistant turn: end of turn, or the close of a tool call."""
    return {tokenizer.eos_id, tokenizer.tool_call_close_id}


def reference_example(tokenizer, messages: list[dict[str, str]], turns: list[dict[str, Any]],
                      effort: str) -> dict[str, list[int]]:
    tokens = tokenizer.apply_chat_template(messages, effort=effort, add_generation_prompt=True)
    mask = [0] * len(tokens)
    stops = stop_token_ids(tokenizer)
    for turn in turns:
        action = tokenizer.encode(turn["action"])
        if not action or action[-1] not in stops:
            action.append(tokenizer.eos_id)
        tokens += action
        mask += [1] * len(action)
        if turn["observation"] is not None:
            result = tokenizer.encode_tool_result(turn["observation"])
            tokens += result
            mask += [0] * len(result)
    return {"tokens": tokens, "loss_mask": mask}


def episode_texts(episode: dict[str, Any]) -> Iterator[str]:
    """Every text of a reference episode: the corpus the tokenizer is trained on."""
    for message in episode["messages"]:
        yield message["content"]
    for turn in episode["turns"]:
        yield turn["action"]
        if turn["observation"] is not None:
            yield turn["observation"]
