"""Context policies for agentic episodes that outgrow the model's context: rebuild the context from
the prompt and the turns so far, with old tool outputs replaced by a short marker (token-in,
token-out: the policy's own tokens are kept as generated, never re-tokenized)."""
from __future__ import annotations

from dataclasses import dataclass

ELIDED = "[output elided]"


@dataclass
class Turn:
    action: list[int]  # the tokens the policy generated
    result: list[int]  # the tool-result tokens that followed (with the next assistant prompt)


def elide_tool_outputs(prompt: list[int], turns: list[Turn], elided: list[int], keep_last: int) -> list[int]:
    """The prompt, then every turn; the tool results of all but the last `keep_last` turns become
    `elided` (the tokens of the marker's tool-result turn)."""
    out = list(prompt)
    for i, turn in enumerate(turns):
        out += turn.action
        out += turn.result if i >= len(turns) - keep_last else elided
    return out
