"""Token layout of an episode, shared by the rollout worker and the supervised warm-up so both see
exactly the same sequence: chat prompt (the environment's tools shown by the chat template), then
per turn the assistant's tokens (its reasoning, then a tool call or the answer, ending on a stop
token) and, when the episode goes on, the tool result tokens (never trained on). Reasoning stays in
the context of every later turn: it is part of the turn's tokens."""
from __future__ import annotations

from typing import Any, Iterator, Mapping, Sequence


def stop_token_ids(tokenizer) -> set[int]:
    """Tokens that end an assistant turn: end of turn, or the close of a tool call."""
    return {tokenizer.eos_id, tokenizer.tool_call_close_id}


def reference_example(tokenizer, messages: list[dict[str, str]], turns: list[dict[str, Any]],
                      effort: str, tools: Sequence[dict] | None = None) -> dict[str, list[int]]:
    """A reference episode's tokens and loss mask; its actions (in the environments' markup) are
    written in the policy's own format."""
    tokens = tokenizer.apply_chat_template(messages, effort=effort, add_generation_prompt=True, tools=tools or None)
    mask = [0] * len(tokens)
    stops = stop_token_ids(tokenizer)
    for turn in turns:
        action = tokenizer.encode(tokenizer.render_action(turn["action"]))
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
    from policy.tokenizer import tools_text

    if episode.get("tools"):
        yield tools_text(episode["tools"])
    for message in episode["messages"]:
        yield message["content"]
    for turn in episode["turns"]:
        yield turn["action"]
        if turn["observation"] is not None:
            yield turn["observation"]


def tool_fallback_warnings(tokenizer, tools_by_env: Mapping[str, Sequence[dict]]) -> list[str]:
    """One line per environment whose tools the policy's chat template cannot show (the tokenizer
    then describes them in the system prompt itself: policy/hf_tokenizer.py)."""
    if not getattr(tokenizer, "tool_fallback", False):
        return []
    return [f"warning: environment {env!r} offers tools ({', '.join(t['function']['name'] for t in tools)}) "
            f"that the model's chat template cannot show: they are listed in the system prompt with the "
            f"call syntax {tokenizer.call_markers[0].strip()}{{\"name\": ..., \"arguments\": ...}}"
            f"{tokenizer.call_markers[1].strip()} instead"
            for env, tools in tools_by_env.items() if tools]
