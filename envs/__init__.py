"""envs: environment API, registry, built-in domains, grading and the quality gate.

    import envs
    envs.list_envs(); env = envs.make("math", max_operand=20)
    obs, info = env.reset(seed=0, options={"effort": "low"})
    obs, reward, terminated, truncated, info = env.step("The answer is 17.")
    grade = GraderPool().grade(env.grade_request())
"""
from envs.base import EFFORTS, Environment, Tool, bash_tool
from envs.grades import Grade, Grader, GradeRequest
from envs.registry import EnvSpec, env_names, list_envs, make, register_env, register_file
from envs.toolcall import format_tool_call, parse_turn

__all__ = [
    "EFFORTS", "Environment", "Tool", "bash_tool", "Grade", "Grader", "GradeRequest", "EnvSpec",
    "env_names", "list_envs", "make", "register_env", "register_file", "format_tool_call", "parse_turn",
    "check_env", "EnvQualityError", "require_env_ok",
]


def __getattr__(name: str):  # the gate imports the registry; load it lazily to avoid a cycle
    if name in ("check_env", "EnvQualityError", "require_env_ok"):
        from envs import quality

        return getattr(quality, name)
    raise AttributeError(f"module 'envs' has no attribute {name!r}")
