"""A transformers model's own tokenizer and chat template behind our Tokenizer's interface, for
policies given by `model.hf_path` (SmolLM2, Qwen3, Llama ...): the rollout worker and the warm-up
build token sequences the same way for either kind.

Reasoning effort goes into the system prompt (these models have no effort token). Tool results
are rendered as a user turn ("Tool result: ..."), since most small chat templates have no tool
role; the model's end-of-turn token ends an assistant turn (it stands in for the tool-call close
too: these models call no tools in our markup)."""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

from .effort import EFFORT_LEVELS

_EFFORT_LINE = "Reasoning effort: {effort}."
_MARKER = "\u2063"  # an invisible separator that splits a rendered template at the tool result


class HFChatTokenizer:
    kind = "hf"

    def __init__(self, tok) -> None:
        if not getattr(tok, "chat_template", None):
            raise ValueError("HFChatTokenizer: the tokenizer has no chat template")
        self._tok = tok
        eos = tok.convert_tokens_to_ids(tok.eos_token) if tok.eos_token else None
        if eos is None:
            raise ValueError("HFChatTokenizer: the tokenizer has no end-of-turn (eos) token")
        self.eos_id = self.tool_call_close_id = int(eos)
        self.pad_id = int(tok.pad_token_id if tok.pad_token_id is not None else eos)

    @classmethod
    def load(cls, path: str | Path) -> "HFChatTokenizer":
        from transformers import AutoTokenizer

        return cls(AutoTokenizer.from_pretrained(str(path)))

    def save(self, path: str | Path) -> None:
        self._tok.save_pretrained(str(path))

    @property
    def vocab_size(self) -> int:
        return len(self._tok)

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int], keep_special: bool = False) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=not keep_special)

    def _render(self, messages: list[dict], add_generation_prompt: bool) -> list[int]:
        return list(self._tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=add_generation_prompt,
                                                  return_dict=False))

    def apply_chat_template(self, messages: Sequence[dict], effort: str = "medium",
                            add_generation_prompt: bool = True) -> list[int]:
        if effort not in EFFORT_LEVELS:
            raise ValueError(f"effort must be one of {EFFORT_LEVELS}, got {effort!r}")
        msgs = [dict(m) for m in messages]
        line = _EFFORT_LINE.format(effort=effort)
        if msgs and msgs[0]["role"] == "system":
            msgs[0]["content"] = f"{msgs[0]['content']}\n{line}"
        else:
            msgs.insert(0, {"role": "system", "content": line})
        return self._render([_as_template_role(m) for m in msgs], add_generation_prompt)

    def encode_tool_result(self, text: str) -> list[int]:
        """The tokens after an assistant turn's end: the tool result as a user turn, then the next
        assistant prompt (the template's rendering of exactly that suffix)."""
        head = [{"role": "user", "content": _MARKER}, {"role": "assistant", "content": _MARKER}]
        full = self._render(head + [_as_template_role({"role": "tool", "content": text})], True)
        prefix = self._render(head, False)
        # the generated turn ended on the end-of-turn token: what the template puts after it follows
        end = len(prefix) - 1 - prefix[::-1].index(self.eos_id) if self.eos_id in prefix else -1
        if end < 0 or full[:end + 1] != prefix[:end + 1]:
            raise ValueError("HFChatTokenizer: the chat template does not render turns as a plain suffix")
        return full[end + 1:]


def _as_template_role(message: dict) -> dict:
    if message["role"] == "tool":
        return {"role": "user", "content": f"Tool result: {message['content']}"}
    return message


def load_tokenizer(path: str | Path):
    """Our BPE tokenizer, or a transformers model's (told apart by tokenizer_config.json)."""
    import json

    from .tokenizer import Tokenizer

    config = Path(path) / "tokenizer_config.json"
    if config.exists() and json.loads(config.read_text()).get("format", "").startswith("policy.tokenizer"):
        return Tokenizer.load(path)
    return HFChatTokenizer.load(path)
