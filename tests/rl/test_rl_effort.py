"""Effort as a training variable: budgets over a whole episode's reasoning and response tokens (the
rollout worker, with a scripted engine), the reasoning segment in the chat format and in the token
layout the learner trains on, length shaping per level on hand-built episodes, and the effort
Pareto an evaluation writes."""
from __future__ import annotations

import asyncio
import json

import pytest

from envs.grades import Grade
from envs.toolcall import format_tool_call, parse_turn
from policy import Tokenizer
from rl.config import EffortConfig, LevelShaping
from rl.evaluation import effort_pareto, effort_table, pareto_table, summarise_eval, write_pareto
from rl.learner.batches import collate, rows_from_samples
from rl.metrics import rollout_metrics
from rl.rollout.engine_api import RolloutEngine, SamplingParams, SequenceRecord, TurnOutput
from rl.rollout.env_worker import EpisodeEnd, EpisodeStart, StepReply
from rl.rollout.layout import reference_example
from rl.rollout.worker import RolloutWorker
from rl.shaping import length_cost, overlong_penalty, shape_rewards
from rl.types import Sample, WorkItem
from fake_remote import LocalCall

CALL = format_tool_call("search", {"query": "amber-fox"})


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.train([CALL, "The answer is 7.", "amber-fox: 7", "next amber-fox", "hello world"] * 20,
                           vocab_size=320)


class ScriptedEngine(RolloutEngine):
    """Each generate call of a sequence takes the next scripted chunk, cut at max_new_tokens (stopped
    when the whole chunk fitted and ends on a stop id); records every context it generated from."""

    name = "scripted"

    def __init__(self, chunks: list[list[int]], stops: frozenset[int]) -> None:
        self.version, self.chunks, self.stops = 0, chunks, stops
        self.seqs: dict[str, list[int]] = {}
        self.contexts: list[list[int]] = []  # what each call generated after
        self.calls = 0

    async def start_group(self, seq_ids, prompt):
        for sid in seq_ids:
            self.seqs[sid] = list(prompt)

    async def generate(self, seq_id, append, params: SamplingParams):
        self.seqs[seq_id] += append
        self.contexts.append(list(self.seqs[seq_id]))
        chunk = self.chunks[self.calls]
        self.calls += 1
        out = chunk[:params.max_new_tokens]
        self.seqs[seq_id] += out
        return TurnOutput(out, [-0.5] * len(out), [0] * len(out),
                          stopped=len(out) == len(chunk) and bool(out) and out[-1] in self.stops)

    async def finish(self, seq_id):
        return SequenceRecord(fed_tokens=len(self.seqs.get(seq_id, [])))

    async def update_weights(self, weights, version):
        self.version = version


class LookupEnv:
    """A tool turn gets 'amber-fox: 7'; a turn without a call is the answer (passed if it says 7)."""

    def __init__(self) -> None:
        self.steps: list[str] = []
        self.answer: str | None = None
        self.step = LocalCall(self._step)
        self.finish = LocalCall(lambda sid: EpisodeEnd(Grade(float(self.answer == "The answer is 7."),
                                                         self.answer == "The answer is 7.", "1")))
        self.abort = LocalCall(lambda prefix: 0)

    def _step(self, sid: str, text: str) -> StepReply:
        self.steps.append(text)
        parsed = parse_turn(text)
        if parsed.wants_tool:
            return StepReply("amber-fox: 7", False, False)
        self.answer = parsed.text
        return StepReply(None, True, False)


def play(tok, chunks: list[list[int]], budget: int, reserve: int) -> tuple[Sample, ScriptedEngine, LookupEnv]:
    w = RolloutWorker.__new__(RolloutWorker)  # the actor's logic, without Ray
    w.tokenizer, w.max_context, w.answer_reserve = tok, 512, reserve
    w.stop_ids = frozenset({tok.eos_id, tok.tool_call_close_id})
    w._engine = ScriptedEngine(chunks, w.stop_ids)
    w.context_policy, w.keep_tool_outputs, w.elided = "none", 1, []
    env = LookupEnv()
    item = WorkItem(uid="g", env="lookup", task_id="t", effort="low", group_size=1, seed=1, max_new_tokens=budget,
                    temperature=1.0, top_p=1.0)
    start = EpisodeStart([{"role": "user", "content": "Find amber-fox."}], "tool_use", max_turns=3)
    prompt = tok.apply_chat_template(start.messages, effort="low")

    async def go():
        await w.engine.start_group(["g/0"], prompt)
        return await w._episode(item, 0, "g/0", prompt, start, env, ["g/0"])

    samples = asyncio.run(go())
    assert len(samples) == 1
    return samples[0], w.engine, env


def answer(tok) -> list[int]:
    return tok.encode("The answer is 7.") + [tok.eos_id]


def test_reasoning_cut_by_the_budget_is_closed_and_answered_within_the_reserve(tok):
    thinking = [tok.think_id] + tok.encode("next amber-fox next amber-fox next amber-fox")
    sample, engine, env = play(tok, [thinking, answer(tok)], budget=8 + len(answer(tok)), reserve=len(answer(tok)))
    assert engine.calls == 2 and engine.contexts[1][-1] == tok.think_close_id  # the worker closed it
    assert sample.forced_turns == 1 and not sample.budget_cut and not sample.truncated and sample.passed
    assert sample.response_tokens == sample.budget and sample.reasoning_tokens == 8
    close = len(engine.contexts[1]) - 1
    assert sample.tokens[close] == tok.think_close_id and sample.loss_mask[close] == 0  # never trained on
    assert env.steps == [tok.decode(thinking[:8] + [tok.think_close_id] + answer(tok))]


def test_a_turn_still_cut_when_the_budget_is_spent_ends_the_episode_unstepped(tok):
    rambling = tok.encode("hello world " * 10)
    sample, engine, env = play(tok, [rambling, rambling], budget=12, reserve=4)
    assert [len(c) for c in engine.contexts][1] - len(engine.contexts[0]) == 8  # 12 - 4, then the reserve
    assert sample.response_tokens == 12 and sample.budget_cut and sample.truncated and sample.forced_turns == 0
    assert env.steps == [] and not sample.passed  # graded as it stands: no final answer
    cut = sample.transcript[-1]  # the record still shows what was said
    assert cut["role"] == "assistant" and cut["cut"] == "budget" and cut["content"].startswith("hello world")


def test_reasoning_stays_in_the_next_turns_context_and_in_the_learners_rows(tok):
    turn1 = [tok.think_id] + tok.encode("next amber-fox") + [tok.think_close_id] + tok.encode(CALL)
    sample, engine, env = play(tok, [turn1, answer(tok)], budget=64, reserve=8)
    assert sample.passed and sample.forced_turns == 0 and not sample.budget_cut
    assert sample.reasoning_tokens == len(tok.encode("next amber-fox")) + 2
    start = len(engine.contexts[0])
    assert engine.contexts[1][start:start + len(turn1)] == turn1  # the second turn sees the first's reasoning
    assert sample.tokens[start:start + len(turn1)] == turn1 and all(sample.loss_mask[start:start + len(turn1)])
    assert parse_turn(env.steps[0]).reasoning == "next amber-fox" and parse_turn(env.steps[0]).call.name == "search"
    mb = collate(rows_from_samples([sample], [1.0]), tok.pad_id, True, None)
    assert mb.input_ids[0].tolist() == sample.tokens and mb.loss_mask[0].tolist()[start:start + len(turn1)] == [1.0] * len(turn1)
    # the warm-up lays a reference out the same way, and the K3.1-style message form renders it too
    messages = [{"role": "user", "content": "Find amber-fox."}]
    ref = reference_example(tok, messages, [{"action": tok.decode(turn1), "observation": "amber-fox: 7"},
                                            {"action": "The answer is 7.", "observation": None}], "low")
    assert ref["tokens"] == sample.tokens
    rendered = tok.apply_chat_template(messages + [
        {"role": "assistant", "reasoning_content": "next amber-fox", "content": CALL},
        {"role": "tool", "content": "amber-fox: 7"}, {"role": "assistant", "content": "The answer is 7."}],
        effort="low", add_generation_prompt=False)
    assert rendered == sample.tokens


def test_an_answer_inside_reasoning_is_never_graded():
    import envs

    env = envs.make("multihop", n_train=8, n_heldout=4)
    task = env.dataset("heldout")[0]
    env.reset(seed=0, options={"task_id": task["task_id"]})
    env.step(f"<|think|>The answer is {task['answer']}.<|/think|>")
    assert env.final_answer == "" and not env.grade().passed
    env.reset(seed=0, options={"task_id": task["task_id"]})
    env.step(f"<|think|>{CALL}")  # a call inside unclosed reasoning is not a call
    assert env.done and env.final_answer == ""


def test_multihop_references_reason_more_at_higher_levels_and_pass_the_gate():
    import envs
    from envs.quality import check_env

    env = envs.make("multihop")
    task = next(t for t in env.dataset("train") if t["hops"] == 3)
    lengths = []
    for level in ("low", "medium", "high", "max"):
        env.reset(seed=0, options={"task_id": task["task_id"], "effort": level})
        refs = env.reference_actions(task["task_id"])
        assert len(refs) == 4 and refs[-1].endswith(f"The answer is {task['answer']}.")
        lengths.append(sum(len(parse_turn(r).reasoning) for r in refs))
    assert lengths[0] == 0 and lengths == sorted(lengths) and len(set(lengths)) == 4
    # max's last turn opens its check with a fixed word: answer or search again is decided on the token
    # after the tool's reply (the whole path rewritten first left max multi-hop at 0.05)
    assert parse_turn(refs[-1]).reasoning == f"check: {task['path'][-1]}"
    assert check_env("multihop", {}, max_tasks=4).ok


def test_low_effort_hops_makes_the_low_reference_answer_within_its_hops():
    """low_effort_hops=1: at low the reference searches once and answers with where that led (short
    enough for a budget of one hop); a 1-hop task and every other level keep the whole path."""
    import envs
    from envs.quality import check_env

    env = envs.make("multihop", max_hops=3, low_effort_hops=1)
    three = next(t for t in env.dataset("train") if t["hops"] == 3)
    one = next(t for t in env.dataset("train") if t["hops"] == 1)
    env.reset(seed=0, options={"task_id": three["task_id"], "effort": "low"})
    refs = env.reference_actions(three["task_id"])
    assert refs == [format_tool_call("search", {"query": three["path"][0]}), f"The answer is {three['path'][1]}."]
    env.reset(seed=0, options={"task_id": one["task_id"], "effort": "low"})
    assert env.reference_actions(one["task_id"])[-1] == f"The answer is {one['answer']}."
    for level in ("medium", "high", "max"):
        env.reset(seed=0, options={"task_id": three["task_id"], "effort": level})
        assert env.reference_actions(three["task_id"])[-1].endswith(f"The answer is {three['answer']}.")
    with pytest.raises(ValueError, match="low_effort_hops"):
        envs.make("multihop", max_hops=3, low_effort_hops=4)
    assert check_env("multihop", {"max_hops": 3, "low_effort_hops": 1}, max_tasks=4).ok


def episode(uid: str, effort: str, reward: float, tokens: int, budget: int, reasoning: int = 0,
            segment_tokens: list[int] | None = None, forced: int = 0, cut: bool = False) -> list[Sample]:
    """A hand-built episode: one sample per segment, `tokens` generated in all."""
    parts = segment_tokens or [tokens]
    return [Sample(uid=uid + (f"@{k}" if k else ""), group_uid=uid.split("/")[0], env="e", domain="d", task_id="t",
                   effort=effort, tokens=[1] * (n + 2), loss_mask=[0, 0] + [1] * n, behavior_logprobs=[0.0] * (n + 2),
                   token_versions=[0] * (n + 2), reward=reward, passed=reward == 1.0, budget=budget,
                   reasoning_tokens=reasoning if k == 0 else 0, forced_turns=forced, budget_cut=cut, segment=k)
            for k, n in enumerate(parts)]


def test_overlong_penalty_and_length_cost_formulas():
    # DAPO's Eq. 13 with L_max = 100, L_cache = 20, scaled by 0.5
    assert overlong_penalty(80, 100, 20, 0.5) == 0.0
    assert overlong_penalty(90, 100, 20, 0.5) == pytest.approx(-0.25)
    assert overlong_penalty(100, 100, 20, 0.5) == pytest.approx(-0.5)
    assert overlong_penalty(130, 100, 20, 0.5) == pytest.approx(-0.5)  # beyond the budget: the floor
    assert overlong_penalty(90, 100, 0, 0.5) == 0.0 and overlong_penalty(90, 0, 20, 0.5) == 0.0
    assert length_cost(25, 100, 0.2) == pytest.approx(-0.05) and length_cost(400, 100, 0.2) == pytest.approx(-0.2)


def test_shaping_on_hand_built_episodes_per_level():
    shaping = EffortConfig(budgets={"low": 40, "max": 100}, weights={"low": 1, "max": 1},
                           shaping={"low": {"overlong_buffer": 10, "overlong_penalty": 0.4, "length_cost": 0.2}}).shaping
    samples = (episode("a/0", "low", 1.0, 20, 40) + episode("a/1", "low", 1.0, 35, 40)
               + episode("a/2", "low", 0.0, 40, 40, cut=True)
               + episode("b/0", "max", 1.0, 90, 100, segment_tokens=[60, 30]) + episode("b/1", "max", 0.0, 10, 100))
    shaped, metrics = shape_rewards(samples, shaping)
    expect = {"a/0": 1 - 0.2 * 20 / 40, "a/1": 1 - 0.4 * 5 / 10 - 0.2 * 35 / 40, "a/2": 0 - 0.4 - 0.2,
              "b/0": 1.0, "b/1": 0.0}  # max: no shaping configured
    assert shaped == pytest.approx([expect[s.episode] for s in samples])
    assert metrics["shaping/low/reward"] == pytest.approx(2 / 3)
    assert metrics["shaping/low/shaped_reward"] == pytest.approx(sum(expect[k] for k in ("a/0", "a/1", "a/2")) / 3)
    assert metrics["shaping/low/in_buffer"] == pytest.approx(2 / 3)
    assert metrics["shaping/low/overlong"] == pytest.approx((-0.2 - 0.4) / 3)
    assert metrics["shaping/max/budget_used"] == pytest.approx((0.9 + 0.1) / 2)
    assert metrics["shaping/max/shaped_reward"] == metrics["shaping/max/reward"] == 0.5
    # no verdict is bought with length: the longest pass keeps more than the shortest fail
    worst_pass = 1 + overlong_penalty(40, 40, 10, 0.4) + length_cost(40, 40, 0.2)
    best_fail = 0 + length_cost(1, 40, 0.2)
    assert worst_pass > best_fail
    with pytest.raises(ValueError, match="below 1"):
        LevelShaping(overlong_buffer=5, overlong_penalty=0.7, length_cost=0.3)


def test_budget_metrics_per_level_count_each_episode_once():
    samples = (episode("a/0", "low", 1.0, 20, 40, reasoning=0) + episode("a/1", "low", 0.0, 40, 40, cut=True)
               + episode("b/0", "max", 1.0, 90, 100, reasoning=50, segment_tokens=[60, 30])
               + episode("b/1", "max", 1.0, 60, 100, reasoning=30, forced=1))
    m = rollout_metrics(samples, 0)
    assert m["rollout/effort/low/within_budget"] == 0.5 and m["rollout/effort/low/budget_cut"] == 0.5
    assert m["rollout/effort/max/within_budget"] == 0.5 and m["rollout/effort/max/forced"] == 0.5
    assert m["rollout/effort/max/reasoning_tokens"] == 40 and m["rollout/effort/max/response_tokens"] == 75
    assert m["rollout/effort/low/budget_used"] == pytest.approx(0.75)


def test_the_pareto_orders_levels_and_is_written_as_json_and_png(tmp_path):
    samples = []
    for level, (budget, used, right) in {"low": (30, 20, 1), "medium": (60, 40, 2), "high": (90, 70, 3),
                                         "max": (120, 90, 3)}.items():
        for i in range(4):
            samples += episode(f"{level}/{i}", level, float(i < right), used, budget, reasoning=used // 4)
    summary = summarise_eval(samples)
    assert summary["all"]["low"]["budget"] == 30 and summary["all"]["max"]["within_budget"] == 1.0
    pareto = effort_pareto(summary)
    assert [p["effort"] for p in pareto["points"]] == ["low", "medium", "high", "max"]
    assert [p["accuracy"] for p in pareto["points"]] == [0.25, 0.5, 0.75, 0.75]
    assert pareto["tokens_increasing"] and pareto["reward_non_decreasing"]
    flat = {lvl: {**cell, "tokens": 50.0} for lvl, cell in summary["all"].items()}
    assert not effort_pareto({"all": flat})["tokens_increasing"]
    files = write_pareto({"before RL": summary, "after RL": summary}, tmp_path / "effort_pareto.json")
    data = json.loads(files[0].read_text())
    assert data["after RL"]["all"]["points"][2]["tokens"] == 70 and data["before RL"]["d"]["tokens_increasing"]
    assert files[1].suffix == ".png" and files[1].read_bytes()[:4] == b"\x89PNG"
    from rich.console import Console

    console = Console(record=True, width=160)
    console.print(effort_table(summary, summary))
    console.print(pareto_table({"after RL": pareto}))
    text = console.export_text()
    assert "within budget" in text and "0.25 -> 0.25" in text and "max" in text
