"""Byte-level BPE tokenizer (the `tokenizers` library) with the pipeline's special tokens and chat template.

Template (one conversation):
    <|bos|><|effort:E|> then per message
      system/user:  <|system|>text<|eot|>   /  <|user|>text<|eot|>
      assistant:    <|assistant|>text<|eot|>   (no <|eot|> when text ends with <|/tool_call|>:
                    generation stops at the close tag and the tool result follows directly)
      tool:         <|tool_result|>text<|eot|>
    generation prompt: <|assistant|>
The effort token sits once at the start so that `encode_tool_result` (result + next assistant
prompt) needs no effort argument and rollouts tokenise exactly like the template.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable, Sequence

from tokenizers import Tokenizer as _HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from .effort import EFFORT_LEVELS as EFFORTS

PAD, BOS, EOT = "<|pad|>", "<|bos|>", "<|eot|>"
TOOL_CALL, TOOL_CALL_CLOSE, TOOL_RESULT = "<|tool_call|>", "<|/tool_call|>", "<|tool_result|>"
ROLE_TOKENS = {"system": "<|system|>", "user": "<|user|>", "assistant": "<|assistant|>", "tool": TOOL_RESULT}
EFFORT_TOKENS = {e: f"<|effort:{e}|>" for e in EFFORTS}
# order fixes the ids: pad=0, bos=1, eot=2 (the ModelConfig defaults)
SPECIAL_TOKENS: list[str] = [PAD, BOS, EOT, TOOL_CALL, TOOL_CALL_CLOSE, TOOL_RESULT,
                             "<|system|>", "<|user|>", "<|assistant|>", *EFFORT_TOKENS.values()]
# tokens that carry meaning inside assistant text (the env parses tool calls) and survive decode
_KEPT_ON_DECODE = {TOOL_CALL, TOOL_CALL_CLOSE}


class Tokenizer:
    """Wraps a trained `tokenizers.Tokenizer`; ids of the special tokens are exposed as attributes."""

    def __init__(self, backend: _HFTokenizer) -> None:
        self._tok = backend
        missing = [t for t in SPECIAL_TOKENS if backend.token_to_id(t) is None]
        if missing:
            raise ValueError(f"tokenizer lacks special tokens {missing}")
        self._id = {t: backend.token_to_id(t) for t in SPECIAL_TOKENS}
        self.pad_id: int = self._id[PAD]
        self.bos_id: int = self._id[BOS]
        self.eos_id: int = self._id[EOT]  # end of turn
        self.eot_id: int = self.eos_id
        self.tool_call_id: int = self._id[TOOL_CALL]
        self.tool_call_close_id: int = self._id[TOOL_CALL_CLOSE]
        self.tool_result_id: int = self._id[TOOL_RESULT]
        self.effort_ids: dict[str, int] = {e: self._id[t] for e, t in EFFORT_TOKENS.items()}
        self.special_ids: set[int] = set(self._id.values())
        self._drop_on_decode = {self._id[t] for t in SPECIAL_TOKENS if t not in _KEPT_ON_DECODE}

    # ---- construction ------------------------------------------------------------------------
    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int = 512, min_frequency: int = 2) -> "Tokenizer":
        """Train byte-level BPE on an iterable of strings (seconds for a few MB)."""
        n_base = len(pre_tokenizers.ByteLevel.alphabet()) + len(SPECIAL_TOKENS)
        if vocab_size < n_base:
            raise ValueError(f"vocab_size={vocab_size} is below the byte alphabet + special tokens ({n_base})")
        tok = _HFTokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=SPECIAL_TOKENS,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
        )
        tok.train_from_iterator(texts, trainer=trainer)
        return cls(tok)

    def save(self, path: str | Path) -> None:
        d = Path(path)
        d.mkdir(parents=True, exist_ok=True)
        self._tok.save(str(d / "tokenizer.json"))
        meta = {"special_tokens": SPECIAL_TOKENS, "efforts": list(EFFORTS), "format": "policy.tokenizer/1"}
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
                            add_generation_prompt: bool = True) -> list[int]:
        if effort not in self.effort_ids:
            raise ValueError(f"effort must be one of {EFFORTS}, got {effort!r}")
        ids = [self.bos_id, self.effort_ids[effort]]
        for n, m in enumerate(messages):
            role, content = m.get("role"), m.get("content")
            if role not in ROLE_TOKENS:
                raise ValueError(f"message {n}: role must be one of {sorted(ROLE_TOKENS)}, got {role!r}")
            if not isinstance(content, str):
                raise ValueError(f"message {n}: content must be a str, got {type(content).__name__}")
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
