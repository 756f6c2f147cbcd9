"""A transformers model's own tokenizer and chat template behind our Tokenizer's interface, for
policies given by `model.hf_path` (SmolLM2, Qwen3, Llama ...): the rollout worker and the warm-up
build token sequences the same way for either kind.

Reasoning effort goes into the system prompt (these models have no effort token).

Tools reach the model through the template's `tools=` argument when the template shows them (a
probe renders a conversation with and without a tool: a template that never reads `tools` renders
both alike). When it does not (SmolLM2's template ignores tools), the fallback lists the tools'
JSON schemas in the system prompt with the call syntax and an example call, in the format below;
`tool_fallback` says so, and the trainer warns about it in one line at start.

Tool calls are read in the format the template teaches: the markers it writes around an assistant
message's `tool_calls` (a probe renders one), else `<tool_call>\\n{"name": ..., "arguments": ...}\\n
</tool_call>` (the Hermes / Qwen format the fallback describes). `canonical_action` turns what the
model wrote into the environments' markup (`<|tool_call|>...<|/tool_call|>`), `render_action` the
reverse (reference solutions in the model's format for the warm-up). Reasoning is written
`<think>...</think>` (as Qwen3 and DeepSeek-R1 do) and maps to the environments' `<|think|>` tags.

Tool results: a `tool` turn where the template shows tools, else a user turn ("Tool result: ...")
since most small chat templates have no tool role. The model's end-of-turn token ends an assistant
turn (it stands in for the tool-call close too)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

from kimi_vocab.effort import EFFORT_LEVELS

_EFFORT_LINE = "Reasoning effort: {effort}."
_MARKER = "\u2063"  # an invisible separator that splits a rendered template at the tool result
_PROBE_CONTENT = "probe content zq"
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
DEFAULT_CALL_MARKERS = ("<tool_call>\n", "\n</tool_call>")
# the environments' markup (envs.toolcall, policy.tokenizer): what canonical_action writes
_CANONICAL = {"call": ("<|tool_call|>", "<|/tool_call|>"), "think": ("<|think|>", "<|/think|>")}
_PROBE_TOOL = {"type": "function", "function": {
    "name": "probe_tool_zq", "description": "probe", "parameters": {
        "type": "object", "properties": {"probe_arg": {"type": "integer"}}, "required": ["probe_arg"]}}}


class HFChatTokenizer:
    kind = "hf"
    reasoning = True  # text markers: every vocabulary can write them

    def __init__(self, tok) -> None:
        if not getattr(tok, "chat_template", None):
            raise ValueError("HFChatTokenizer: the tokenizer has no chat template")
        self._tok = tok
        eos = tok.convert_tokens_to_ids(tok.eos_token) if tok.eos_token else None
        if eos is None:
            raise ValueError("HFChatTokenizer: the tokenizer has no end-of-turn (eos) token")
        self.eos_id = self.tool_call_close_id = int(eos)
        self.pad_id = int(tok.pad_token_id if tok.pad_token_id is not None else eos)
        self.template_shows_tools = self._probe_tools()
        self.call_markers = self._probe_call_markers() or DEFAULT_CALL_MARKERS
        self.forced_answer_ids = self.encode(f"{THINK_CLOSE}\n")

    @classmethod
    def load(cls, path: str | Path) -> "HFChatTokenizer":
        from transformers import AutoTokenizer

        return cls(AutoTokenizer.from_pretrained(str(path)))

    def save(self, path: str | Path) -> None:
        self._tok.save_pretrained(str(path))

    @property
    def vocab_size(self) -> int:
        return len(self._tok)

    @property
    def tool_fallback(self) -> bool:
        """Whether tools are described by us in the system prompt (the template cannot show them)."""
        return not self.template_shows_tools

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int], keep_special: bool = False) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=not keep_special)

    def _render(self, messages: list[dict], add_generation_prompt: bool, tools: list[dict] | None = None,
                tokenize: bool = True):
        return self._tok.apply_chat_template(messages, tools=tools, tokenize=tokenize,
                                             add_generation_prompt=add_generation_prompt,
                                             **({"return_dict": False} if tokenize else {}))

    # ---- what the template can show ------------------------------------------------------------
    def _probe_tools(self) -> bool:
        msgs = [{"role": "user", "content": "hi"}]
        try:
            with_tool = self._render(msgs, True, [_PROBE_TOOL], tokenize=False)
        except Exception:  # noqa: BLE001 - a template that chokes on tools cannot show them
            return False
        return with_tool != self._render(msgs, True, tokenize=False) and "probe_tool_zq" in with_tool

    def _probe_call_markers(self) -> tuple[str, str] | None:
        """The text a template writes around a tool call's JSON, if it renders `tool_calls` (after the
        message's content, as templates do)."""
        call = {"type": "function", "function": {"name": "probe_tool_zq", "arguments": {"probe_arg": 7}}}
        head = [{"role": "user", "content": "hi"}]
        said = {"role": "assistant", "content": _PROBE_CONTENT}
        try:
            plain = self._render(head + [said], False, tokenize=False)
            called = self._render(head + [{**said, "tool_calls": [call]}], False, tokenize=False)
        except Exception:  # noqa: BLE001 - no tool calls in this template
            return None
        tail = plain[plain.find(_PROBE_CONTENT) + len(_PROBE_CONTENT):]
        start = called.find(_PROBE_CONTENT) + len(_PROBE_CONTENT)
        if "probe_tool_zq" not in called or _PROBE_CONTENT not in plain or not called.endswith(tail):
            return None
        region = called[start:len(called) - len(tail)]
        first = region.find("{")
        depth, last = 0, -1
        for i in range(max(first, 0), len(region)):
            depth += {"{": 1, "}": -1}.get(region[i], 0)
            if depth == 0:
                last = i
                break
        opening, closing = region[:max(first, 0)], region[last + 1:]
        if first < 0 or last < 0 or not opening.strip() or not closing.strip():  # bare JSON: no markers
            return None
        return opening, closing

    # ---- chat ------------------------------------------------------------------------------------
    def apply_chat_template(self, messages: Sequence[dict], effort: str = "medium",
                            add_generation_prompt: bool = True, tools: Sequence[dict] | None = None) -> list[int]:
        if effort not in EFFORT_LEVELS:
            raise ValueError(f"effort must be one of {EFFORT_LEVELS}, got {effort!r}")
        msgs = [self._as_template_message(m) for m in messages]
        line = _EFFORT_LINE.format(effort=effort)
        if tools and not self.template_shows_tools:
            line = f"{line}\n{self.tools_fallback_text(tools)}"
        if msgs and msgs[0]["role"] == "system":
            msgs[0]["content"] = f"{msgs[0]['content']}\n{line}"
        else:
            msgs.insert(0, {"role": "system", "content": line})
        native = list(tools) if tools and self.template_shows_tools else None
        return list(self._render(msgs, add_generation_prompt, native))

    def tools_fallback_text(self, tools: Sequence[dict]) -> str:
        """The tools and the call syntax, for a template that cannot show them."""
        opening, closing = self.call_markers
        fn = tools[0].get("function", tools[0])
        props = (fn.get("parameters") or {}).get("properties", {}) or {}
        example = {k: 0 if v.get("type") in ("integer", "number") else "..." for k, v in props.items()}
        schemas = "\n".join(json.dumps(t.get("function", t), ensure_ascii=False) for t in tools)
        call = json.dumps({"name": fn.get("name", "?"), "arguments": example}, ensure_ascii=False)
        return (f"You can call these tools:\n{schemas}\nTo call a tool, reply with only:\n"
                f"{opening}{call}{closing}\nThe tool's result comes back in the next message.")

    def encode_tool_result(self, text: str) -> list[int]:
        """The tokens after an assistant turn's end: the tool result (a tool turn, or a user turn),
        then the next assistant prompt (the template's rendering of exactly that suffix)."""
        head = [{"role": "user", "content": _MARKER}, {"role": "assistant", "content": _MARKER}]
        full = self._render(head + [self._as_template_message({"role": "tool", "content": text})], True)
        prefix = self._render(head, False)
        # the generated turn ended on the end-of-turn token: what the template puts after it follows
        end = len(prefix) - 1 - prefix[::-1].index(self.eos_id) if self.eos_id in prefix else -1
        if end < 0 or full[:end + 1] != prefix[:end + 1]:
            raise ValueError("HFChatTokenizer: the chat template does not render turns as a plain suffix")
        return full[end + 1:]

    def _as_template_message(self, message: dict) -> dict:
        m = dict(message)
        if m["role"] == "tool" and not self.template_shows_tools:
            return {"role": "user", "content": f"Tool result: {m['content']}"}
        if m["role"] == "assistant":
            reasoning = m.pop("reasoning_content", None)  # kept, as the K3.1 API asks of clients
            content = self.render_action(m.get("content") or "")
            m["content"] = f"{THINK_OPEN}{reasoning}{THINK_CLOSE}{content}" if reasoning else content
        return m

    # ---- actions in the model's format and the environments' -----------------------------------
    def render_action(self, text: str) -> str:
        """An action in the environments' markup, written as this model writes it."""
        (c_open, c_close), (t_open, t_close) = _CANONICAL["call"], _CANONICAL["think"]
        opening, closing = self.call_markers
        return (text.replace(c_open, opening).replace(c_close, closing)
                .replace(t_open, THINK_OPEN).replace(t_close, THINK_CLOSE))

    def canonical_action(self, text: str) -> str:
        """What the model wrote, in the environments' markup (their parser reads only that)."""
        (c_open, c_close), (t_open, t_close) = _CANONICAL["call"], _CANONICAL["think"]
        opening, closing = (m.strip() for m in self.call_markers)
        return (text.replace(opening, c_open).replace(closing, c_close)
                .replace(THINK_OPEN, t_open).replace(THINK_CLOSE, t_close))

    def reasoning_split(self, ids: Sequence[int]) -> tuple[int, bool]:
        """Of a turn's generated tokens: how many are reasoning (from the token that begins
        `<think>` through the one that ends `</think>`), and whether it is still open at the end."""
        ids = list(ids)
        text = self.decode(ids)
        start_char = text.find(THINK_OPEN)
        if start_char < 0:
            return 0, False
        start = self._tokens_within(ids, start_char)  # tokens wholly before the marker
        close_char = text.find(THINK_CLOSE, start_char + len(THINK_OPEN))
        if close_char < 0:
            return len(ids) - start, True
        end = self._tokens_within(ids, close_char + len(THINK_CLOSE) - 1) + 1  # through the close's last char
        return end - start, False

    def _tokens_within(self, ids: list[int], chars: int) -> int:
        """The most tokens whose decoded text is at most `chars` characters long (binary search:
        a prefix's text grows with it)."""
        lo, hi = 0, len(ids)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if len(self.decode(ids[:mid])) <= chars:
                lo = mid
            else:
                hi = mid - 1
        return lo


def load_tokenizer(path: str | Path):
    """Our BPE tokenizer, or a transformers model's (told apart by tokenizer_config.json)."""
    from .tokenizer import Tokenizer

    config = Path(path) / "tokenizer_config.json"
    if config.exists() and json.loads(config.read_text()).get("format", "").startswith("policy.tokenizer"):
        return Tokenizer.load(path)
    return HFChatTokenizer.load(path)
