"""Byte-level BPE tokenizer (the `tokenizers` library) with the pipeline's special tokens and chat template.

Template (one conversation):
    <|bos|><|effort:E|> then per message
      system/user:  <|system|>text<|eot|>   /  <|user|>text<|eot|>
      assistant:    <|assistant|>[<|think|>reasoning<|/think|>]text<|eot|>   (no <|eot|> when text
                    ends with <|/tool_call|>: generation stops at the close tag and the tool result
                    follows directly)
      tool:         <|tool_result|>text<|eot|>
    generation prompt: <|assistant|>
The effort token sits once at the start so that `encode_tool_result` (result + next assistant
prompt) needs no effort argument and rollouts tokenise exactly like the template.

Reasoning: the model may think first, inside <|think|> ... <|/think|>, then call a tool or answer.
An assistant message's `reasoning_content` (as the K3.1 API returns it and asks to be sent back in
multi-turn tool use) is rendered there, so reasoning stays in the context of later turns.
Tools: `tools=` (OpenAI-style function schemas) are listed in the system turn, one signature a line,
with the call syntax.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable, Sequence

from tokenizers import Tokenizer as _HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from kimi_vocab.effort import EFFORT_LEVELS as EFFORTS

PAD, BOS, EOT = "<|pad|>", "<|bos|>", "<|eot|>"
TOOL_CALL, TOOL_CALL_CLOSE, TOOL_RESULT = "<|tool_call|>", "<|/tool_call|>", "<|tool_result|>"
THINK, THINK_CLOSE = "<|think|>", "<|/think|>"
ROLE_TOKENS = {"system": "<|system|>", "user": "<|user|>", "assistant": "<|assistant|>", "tool": TOOL_RESULT}
EFFORT_TOKENS = {e: f"<|effort:{e}|>" for e in EFFORTS}
# order fixes the ids: pad=0, bos=1, eot=2 (the ModelConfig defaults)
SPECIAL_TOKENS: list[str] = [PAD, BOS, EOT, TOOL_CALL, TOOL_CALL_CLOSE, TOOL_RESULT,
                             "<|system|>", "<|user|>", "<|assistant|>", *EFFORT_TOKENS.values()]
# after the others (their ids stay put); a tokenizer trained before they existed loads without
# them and its policy cannot reason (no forced answers either)
REASONING_TOKENS: list[str] = [THINK, THINK_CLOSE]
# tokens that carry meaning inside assistant text (the env parses tool calls and reasoning) and survive decode
_KEPT_ON_DECODE = {TOOL_CALL, TOOL_CALL_CLOSE, THINK, THINK_CLOSE}


def tool_signature(schema: dict) -> str:
    """One line for an OpenAI-style function schema: `name(arg: type, opt?: type) - description`."""
    fn = schema.get("function", schema)
    params = fn.get("parameters", {}) or {}
    required = set(params.get("required", []))
    args = ", ".join(f"{name}{'' if name in required else '?'}: {spec.get('type', 'any')}"
                     for name, spec in (params.get("properties", {}) or {}).items())
    return f"{fn.get('name', '?')}({args}) - {fn.get('description', '')}".rstrip(" -")


def tools_text(tools: Sequence[dict]) -> str:
    """The tools section of the system turn in our format."""
    lines = [tool_signature(t) for t in tools]
    return (f"Tools (call one as {TOOL_CALL}{{\"name\": ..., \"arguments\": {{...}}}}{TOOL_CALL_CLOSE}):\n"
            + "\n".join(lines))


class Tokenizer:
    """Wraps a trained `tokenizers.Tokenizer`; ids of the special tokens are exposed as attributes."""

    def __init__(self, backend: _HFTokenizer) -> None:
        self._tok = backend
        missing = [t for t in SPECIAL_TOKENS if backend.token_to_id(t) is None]
        if missing:
            raise ValueError(f"tokenizer lacks special tokens {missing}")
        self._id = {t: backend.token_to_id(t) for t in SPECIAL_TOKENS + REASONING_TOKENS
                    if backend.token_to_id(t) is not None}
        self.pad_id: int = self._id[PAD]
        self.bos_id: int = self._id[BOS]
        self.eos_id: int = self._id[EOT]  # end of turn
        self.eot_id: int = self.eos_id
        self.tool_call_id: int = self._id[TOOL_CALL]
        self.tool_call_close_id: int = self._id[TOOL_CALL_CLOSE]
        self.tool_result_id: int = self._id[TOOL_RESULT]
        self.effort_ids: dict[str, int] = {e: self._id[t] for e, t in EFFORT_TOKENS.items()}
        self.think_id: int | None = self._id.get(THINK)
        self.think_close_id: int | None = self._id.get(THINK_CLOSE)
        self.special_ids: set[int] = set(self._id.values())
        self._drop_on_decode = {i for t, i in self._id.items() if t not in _KEPT_ON_DECODE}

    @property
    def reasoning(self) -> bool:
        """Whether this tokenizer has the reasoning tokens (one trained before them has not)."""
        return self.think_id is not None and self.think_close_id is not None

    @property
    def forced_answer_ids(self) -> list[int]:
        """What the rollout worker appends to close reasoning cut off by the episode's budget."""
        return [self.think_close_id] if self.reasoning else []

    def reasoning_split(self, ids: Sequence[int]) -> tuple[int, bool]:
        """Of a turn's generated tokens: how many are reasoning (the think tags included), and
        whether the reasoning is still open at the end."""
        ids = list(ids)
        if not self.reasoning or self.think_id not in ids:
            return 0, False
        start = ids.index(self.think_id)
        if self.think_close_id in ids[start:]:
            return ids.index(self.think_close_id, start) - start + 1, False
        return len(ids) - start, True

    # ---- construction ------------------------------------------------------------------------
    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int = 512, min_frequency: int = 2) -> "Tokenizer":
        """Train byte-level BPE on an iterable of strings (seconds for a few MB)."""
        n_base = len(pre_tokenizers.ByteLevel.alphabet()) + len(SPECIAL_TOKENS) + len(REASONING_TOKENS)
        if vocab_size < n_base:
            raise ValueError(f"vocab_size={vocab_size} is below the byte alphabet + special tokens ({n_base})")
        tok = _HFTokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=SPECIAL_TOKENS + REASONING_TOKENS,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
        )
        tok.train_from_iterator(texts, trainer=trainer)
        return cls(tok)

    def save(self, path: str | Path) -> None:
        d = Path(path)
        d.mkdir(parents=True, exist_ok=True)
        self._tok.save(str(d / "tokenizer.json"))
        meta = {"special_tokens": list(self._id), "efforts": list(EFFORTS), "format": "policy.tokenizer/1"}
        (d / "tokenizer_config.json").write_text(json.dumps(meta, indent=2))

    @classmethod
    def load(cls, path: str | Path) -> "Tokenizer":
        f = Path(path)
        f = f / "tokenizer.json" if f.is_dir() else f
        if not f.exists():
            raise FileNotFoundError(f"no tokenizer.json at {path}")
        return cls(_HFTokenizer.from_file(str(f)))

    # ---- text <-> ids ------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    def __len__(self) -> int:
        return self.vocab_size

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int], keep_special: bool = False) -> str:
        """Text of `ids`. Tool-call tags always survive (the env parses them); other special tokens
        (pad, bos, end of turn, roles, effort) are dropped unless keep_special."""
        ids = [int(i) for i in ids]
        if keep_special:
            return self._tok.decode(ids, skip_special_tokens=False)
        # decode runs of ordinary ids and splice kept special tokens in by name
        out: list[str] = []
        run: list[int] = []
        for i in ids:
            if i in self.special_ids:
                if run:
                    out.append(self._tok.decode(run, skip_special_tokens=False))
                    run = []
                if i not in self._drop_on_decode:
                    out.append(self._tok.id_to_token(i))
            else:
                run.append(i)
        if run:
            out.append(self._tok.decode(run, skip_special_tokens=False))
        return "".join(out)

    def token_id(self, token: str) -> int:
        i = self._tok.token_to_id(token)
        if i is None:
            raise KeyError(f"unknown token {token!r}")
        return i

    # ---- chat --------------------------------------------------------------------------------
    def apply_chat_template(self, messages: Sequence[dict], effort: str = "medium",
                            add_generation_prompt: bool = True, tools: Sequence[dict] | None = None) -> list[int]:
        if effort not in self.effort_ids:
            raise ValueError(f"effort must be one of {EFFORTS}, got {effort!r}")
        messages = with_tools(messages, tools_text(tools)) if tools else messages
        ids = [self.bos_id, self.effort_ids[effort]]
        for n, m in enumerate(messages):
            role, content = m.get("role"), m.get("content")
            if role not in ROLE_TOKENS:
                raise ValueError(f"message {n}: role must be one of {sorted(ROLE_TOKENS)}, got {role!r}")
            if not isinstance(content, str):
                raise ValueError(f"message {n}: content must be a str, got {type(content).__name__}")
            reasoning = m.get("reasoning_content")
            if role == "assistant" and reasoning:
                if not self.reasoning:
                    raise ValueError(f"message {n}: this tokenizer has no reasoning tokens (trained before them)")
                content = f"{THINK}{reasoning}{THINK_CLOSE}{content}"
            body = self.encode(content)
            ids.append(self._id[ROLE_TOKENS[role]])
            ids.extend(body)
            if not (role == "assistant" and body and body[-1] == self.tool_call_close_id):
                ids.append(self.eos_id)
        if add_generation_prompt:
            ids.append(self._id["<|assistant|>"])
        return ids

    def encode_tool_result(self, text: str) -> list[int]:
        """What follows a generated `<|/tool_call|>`: the result turn and the next assistant prompt."""
        return [self.tool_result_id, *self.encode(text), self.eos_id, self._id["<|assistant|>"]]

    def render_action(self, text: str) -> str:
        """An action in the environments' markup, as this policy writes it (the same: it is ours)."""
        return text

    def canonical_action(self, text: str) -> str:
        """What this policy wrote, in the environments' markup (the same: it is ours)."""
        return text


def with_tools(messages: Sequence[dict], text: str) -> list[dict]:
    """The messages with `text` appended to the system message (one is put first if there is none)."""
    msgs = [dict(m) for m in messages]
    if msgs and msgs[0].get("role") == "system":
        msgs[0]["content"] = f"{msgs[0]['content']}\n{text}"
    else:
        msgs.insert(0, {"role": "system", "content": text})
    return msgs
