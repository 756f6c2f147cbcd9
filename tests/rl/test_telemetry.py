"""rl.telemetry without Ray actors: the episodes' time split and the engines' pace between two reads."""
from rl.rollout.engine_api import EngineStats
from rl.telemetry import EnginePace, EpisodeTime


def test_episode_time_weights_each_step_by_its_episodes():
    t = EpisodeTime()
    assert t.summary() is None
    t.observe({"rollout/episodes": 1.0, "rollout/episode_s/generate": 2.0})
    t.observe({"rollout/episodes": 3.0, "rollout/episode_s/generate": 4.0, "rollout/episode_s/grade": 1.0})
    line = t.summary()
    assert line.startswith("episodes: 4.25 s each on average (") and "generating 3.50" in line


def test_engine_pace_between_never_negative():
    pace = EnginePace.__new__(EnginePace)  # no workers to read: _between alone
    pace.workers = [object(), object()]
    a = EngineStats(busy_s=1.0, steps=10, generated_tokens=100, extra={"launch_s": 0.1, "wait_s": 0.2,
                                                                          "graph_capture_s": 0.0})
    b = EngineStats(busy_s=3.0, steps=20, generated_tokens=300, extra={"launch_s": 0.3, "wait_s": 0.4,
                                                                          "graph_capture_s": 0.0})
    m = pace._between((0.0, a), (2.0, b))
    assert m["engine/steps"] == 10 and m["engine/step_ms"] == 200.0 and m["engine/tokens_per_step"] == 20.0
    assert abs(m["time/rollout_idle_frac"] - 0.5) < 1e-9
    restarted = pace._between((0.0, b), (1.0, a))  # a worker restarted: its counters start at zero
    assert "engine/steps" not in restarted and restarted["engine/busy_s"] == 0.0
