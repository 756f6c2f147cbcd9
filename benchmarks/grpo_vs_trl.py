"""Our GRPO against TRL's GRPOTrainer on the same task, model, samples and hyperparameters, in one call:
configs/vllm_cpu.yaml's SmolLM2-135M-Instruct on small sums, 8 prompts x 8 samples a step, at most 24
new tokens (the config's medium effort for every group, so both sides read the same prompts and stop
at the same budget), temperature 1, lr 5e-6, no KL, AdamW (0.9, 0.99), gradient clipping 1, token-mean
loss over the batch (TRL's "dapo"), no reward scaling, no dynamic sampling (TRL trains on every group).

- TRL 1.16 runs in its own virtualenv (`--setup` creates it: PyPI's trl and transformers at this
  repository's version, beside the same CPU torch 2.13.0), on the CPU with `--threads` threads and
  transformers' generate, on the prompts of our scheduler's stream in the same order (the token ids
  are checked equal), graded by this repository's grader (the driver serves it over a local socket).
- Ours: `rl train configs/vllm_cpu.yaml` with the same settings, synchronous (max_staleness 0) and
  asynchronous (max_staleness 1).
- `--precision bfloat16`: both sides train and sample in bf16 mixed precision (TRL: `bf16=True`,
  accelerate's CPU autocast, generate included; ours: `train.cpu_matmul_dtype=bfloat16` and vLLM serving
  in bfloat16); float32 weights and optimizer on both. float32: everything in float32.
- Held-out reward: each trained model is evaluated the same way (`rl eval`: the config's held-out
  tasks x 4 samples at temperature 1, served by vLLM-CPU).

Seconds per step are medians over the steps after the first (start-up excluded); samples/s is
samples a step over that; each figure's spread is over `--repeats` runs (mean, min, max), with the
machine's load average before and after each run (this CPU is shared: measure when it is quiet).

    python benchmarks/grpo_vs_trl.py --setup                     # once: the TRL virtualenv
    python benchmarks/grpo_vs_trl.py [--steps 24 --repeats 2 --only trl ours-sync ours-async]
                                     [--precision bfloat16 --out runs/bench-trl-bf16]
    python benchmarks/grpo_vs_trl.py --report runs/bench-trl/results.json   # the table again

Each run's figures are added to the results file as it finishes (a later call with --only adds
more runs to the same file)."""
from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Listener
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path[0] = str(REPO)  # the repository's packages, not benchmarks/'s files of the same names (sandbox.py)

from benchmarks.bench_common import log  # noqa: E402

CONFIG = REPO / "configs" / "vllm_cpu.yaml"
TRL_VENV = REPO / ".cache" / "trl-venv"
TORCH_PIN = "torch==2.13.0"  # the CPU build this machine has; never an unpinned torch
TRL_PIN = "trl==1.16.0"
EFFORT = "medium"  # the config's 24-token budget
# shared by both sides; ours through the config (and these overrides), TRL's through its GRPOConfig
SAME = [f"effort.weights={{low: 0, medium: 0, high: 0, max: 0, {EFFORT}: 1}}", f"eval.efforts=[{EFFORT}]",
        "rollout.drop_uniform_groups=false", "train.loss_agg=token_mean", "train.adv_std_norm=none",
        "train.kl_coef=0", "eval.before_and_after=false", "gate.enabled=false", "logging.wandb_mode=disabled",
        "logging.progress=false", "checkpoint.every=1000"]
VARIANTS = {"ours-sync": ["rollout.max_staleness=0"], "ours-async": ["rollout.max_staleness=1"]}


# -- setup --------------------------------------------------------------------------------------
def setup_trl(venv: Path = TRL_VENV) -> None:
    """The TRL virtualenv: trl and this repository's transformers from PyPI beside the pinned CPU
    torch (every pip line carries the pin), then a check that its torch is the CPU build."""
    import transformers

    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run([str(venv / "bin" / "pip"), "install", "-q", TORCH_PIN, TRL_PIN,
                    f"transformers=={transformers.__version__}"], check=True)
    check_trl(venv)


def check_trl(venv: Path = TRL_VENV) -> dict[str, str]:
    python = venv / "bin" / "python"
    if not python.exists():
        raise SystemExit(f"no TRL virtualenv at {venv}: run `python benchmarks/grpo_vs_trl.py --setup` first")
    out = subprocess.run([str(python), "-c", "import json, torch, trl, transformers; print(json.dumps({'torch': "
                          "torch.__version__, 'cuda': torch.version.cuda, 'trl': trl.__version__, "
                          "'transformers': transformers.__version__}))"], check=True, capture_output=True, text=True)
    versions = json.loads(out.stdout.strip().splitlines()[-1])
    if versions["cuda"] is not None or "+cpu" not in versions["torch"]:
        raise SystemExit(f"the TRL virtualenv's torch is not the CPU build: {versions}")
    return versions


# -- the task both sides train on -----------------------------------------------------------------
def task_prompts(config: Path, overrides: list[str], steps: int) -> list[dict[str, Any]]:
    """The groups our scheduler draws for `steps` steps, in stream order: each one's prompt as the
    text TRL tokenizes (our chat template rendered, effort line included), the question and the gold
    answer. The text is checked to tokenize to exactly our prompt's ids."""
    import envs
    from policy.hf_tokenizer import HFChatTokenizer
    from rl.cluster import env_kwargs
    from rl.config import load_config
    from rl.rollout.scheduler import SamplingPlan
    from transformers import AutoTokenizer

    cfg = load_config(str(config), overrides)
    if len(cfg.envs) != 1:
        raise SystemExit("the comparison runs on one environment")
    name = cfg.envs[0].name
    env = envs.make(name, **env_kwargs(cfg, name))
    train = env.dataset("train")
    tasks = {row["task_id"]: dict(row) for row in train}
    plan = SamplingPlan(env_weights={name: 1.0}, effort_weights=cfg.effort.weights, effort_budgets=cfg.effort.budgets,
                        group_size=cfg.rollout.group_size, temperature=cfg.rollout.temperature,
                        top_p=cfg.rollout.top_p, seed=cfg.seed)
    ours = HFChatTokenizer.load(cfg.model.hf_path)
    theirs = AutoTokenizer.from_pretrained(cfg.model.hf_path)
    out = []
    for index in range(steps * cfg.rollout.groups_per_step):
        item = plan.item(index, {name: list(train["task_id"])})
        task = tasks[item.task_id]
        messages = [{"role": "system", "content": env.system_prompt}, {"role": "user", "content": env.prompt(task)}]
        ids = ours.apply_chat_template(messages, effort=item.effort, add_generation_prompt=True)
        text = ours.decode(ids, keep_special=True)
        if theirs(text, add_special_tokens=False)["input_ids"] != ids:
            raise SystemExit(f"group {index}: TRL would tokenize the prompt differently from ours")
        out.append({"text": text, "question": task["question"], "answer": str(task["answer"]),
                    "effort": item.effort, "max_new_tokens": item.max_new_tokens})
    return out


class GraderServer:
    """This repository's grader for the TRL process: it sends [(response, question, gold)], gets the
    rewards back (envs' math grader, the config's answer style)."""

    def __init__(self, answer_style: str) -> None:
        from envs.domains.math import MathGrader

        self.grader = MathGrader(answer_style=answer_style)
        self.key = secrets.token_bytes(16)
        self.listener = Listener(("127.0.0.1", 0), authkey=self.key)
        self.graded = 0
        threading.Thread(target=self._serve, daemon=True).start()

    def grade(self, batch: list[tuple[str, str, str]]) -> list[float]:
        return [float(self.grader.score({"response": r, "question": q, "gold": g}).reward) for r, q, g in batch]

    def _serve(self) -> None:
        with self.listener.accept() as conn:
            while True:
                try:
                    batch = conn.recv()
                except EOFError:
                    return
                conn.send(self.grade(batch))
                self.graded += len(batch)

    @property
    def address(self) -> dict[str, Any]:
        return {"address": list(self.listener.address), "key": self.key.hex()}


# -- runs ----------------------------------------------------------------------------------------
def run_trl(out: Path, prompts: list[dict[str, Any]], hyper: dict[str, Any], threads: int, seed: int,
            model_dir: str, answer_style: str) -> dict[str, Any]:
    server = GraderServer(answer_style)
    spec = {"model_dir": model_dir, "out_dir": str(out / "trainer"), "model_out": str(out / "model"),
            "result": str(out / "trl.json"), "threads": threads, "seed": seed, "hyper": hyper,
            "grader": server.address,
            "prompts": [{"prompt": p["text"], "question": p["question"], "answer": p["answer"]} for p in prompts]}
    (out / "spec.json").write_text(json.dumps(spec))
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false"}
    started = time.perf_counter()
    with open(out / "trl.log", "w") as logf:
        subprocess.run([str(TRL_VENV / "bin" / "python"), str(REPO / "benchmarks" / "_trl_grpo_side.py"),
                        str(out / "spec.json")], check=True, env=env, stdout=logf, stderr=subprocess.STDOUT)
    result = json.loads((out / "trl.json").read_text())
    result["process_s"] = time.perf_counter() - started
    result["graded"] = server.graded
    _save_tokenizer(model_dir, out / "model")
    return {**result, "checkpoint": str(out / "model")}


def _save_tokenizer(model_dir: str, dest: Path) -> None:
    """`rl eval` reads a policy folder with its tokenizer in tokenizer/ (as our checkpoints hold it)."""
    from policy.hf_tokenizer import HFChatTokenizer

    HFChatTokenizer.load(model_dir).save(str(dest / "tokenizer"))


def run_ours(out: Path, overrides: list[str]) -> dict[str, Any]:
    from rl.metrics import read_metrics

    started = time.perf_counter()
    with open(out / "train.log", "w") as logf:
        subprocess.run([str(REPO / ".venv" / "bin" / "rl"), "train", str(CONFIG), *overrides,
                        f"output_dir={out}", "name=ours"], check=True, stdout=logf, stderr=subprocess.STDOUT, cwd=REPO)
    process_s = time.perf_counter() - started
    run_dir = max((p for p in out.iterdir() if p.is_dir() and (p / "metrics.jsonl").exists()), key=lambda p: p.stat().st_mtime)
    metrics = [m for m in read_metrics(run_dir) if m["step"] >= 0]
    last = max(m["step"] for m in metrics)
    keys = ("time/step_s", "time/rollout_s", "time/train_s", "time/sync_s", "rollout/reward", "train/seq_tokens",
            "train/mismatch")
    return {"step_s": [m["time/step_s"] for m in metrics], "process_s": process_s,
            "parts": {k: [m.get(k) for m in metrics] for k in keys},
            "train_reward": [m["rollout/reward"] for m in metrics],
            "checkpoint": str(run_dir / "checkpoints" / f"step_{last}" / "hf")}


def evaluate(checkpoint: str, out: Path, overrides: list[str]) -> dict[str, Any]:
    """Held-out reward of a trained model, the same way for both sides."""
    dest = out / "eval.json"
    with open(out / "eval.log", "w") as logf:
        subprocess.run([str(REPO / ".venv" / "bin" / "rl"), "eval", str(CONFIG), "--checkpoint", checkpoint,
                        "-o", str(dest), *overrides], check=True, stdout=logf, stderr=subprocess.STDOUT, cwd=REPO)
    cell = json.loads(dest.read_text())["all"]["all"]
    return {"reward": cell["reward"], "stderr": cell["stderr"], "n": cell["n"]}


def step_figures(step_s: list[float], samples_per_step: int) -> dict[str, float]:
    """Seconds per step after the first (start-up, first compilations) and samples/s over them."""
    steady = step_s[1:] or step_s
    med = statistics.median(steady)
    return {"s_per_step": med, "samples_per_s": samples_per_step / med,
            "steady_samples_per_s": samples_per_step * len(steady) / sum(steady)}


def spread(values: list[float]) -> dict[str, float]:
    return {"mean": statistics.fmean(values), "min": min(values), "max": max(values), "n": len(values)}


def summarise(results: dict[str, Any]) -> dict[str, Any]:
    """Per side: each figure's mean, min and max over its runs, and the speed-up over TRL."""
    out: dict[str, Any] = {}
    for side, runs in results["runs"].items():
        if runs:
            out[side] = {key: spread([r[key] for r in runs])
                         for key in ("s_per_step", "samples_per_s", "heldout_reward")}
    if "trl" in out:
        for side in out:
            out[side]["speedup_vs_trl"] = out[side]["samples_per_s"]["mean"] / out["trl"]["samples_per_s"]["mean"]
    return out


def table(summary: dict[str, Any], steps: int) -> str:
    lines = [f"| side | s/step | samples/s | held-out reward after {steps} steps | vs TRL |", "|---|---|---|---|---|"]
    for side, s in summary.items():
        f = lambda k, d: f"{s[k]['mean']:.{d}f} ({s[k]['min']:.{d}f}-{s[k]['max']:.{d}f})"  # noqa: E731
        versus = f"{s['speedup_vs_trl']:.2f}x" if "speedup_vs_trl" in s else "-"
        lines.append(f"| {side} | {f('s_per_step', 1)} | {f('samples_per_s', 2)} | {f('heldout_reward', 3)} | {versus} |")
    return "\n".join(lines)


def hyperparameters(config: Path, overrides: list[str], steps: int) -> dict[str, Any]:
    from rl.config import load_config

    cfg = load_config(str(config), overrides)
    t = cfg.train
    return {"steps": steps, "groups": cfg.rollout.groups_per_step, "group_size": cfg.rollout.group_size,
            "max_new_tokens": cfg.effort.budgets[EFFORT], "temperature": cfg.rollout.temperature, "lr": t.lr,
            "betas": list(t.betas), "adam_eps": t.adam_eps, "weight_decay": t.weight_decay, "grad_clip": t.grad_clip,
            "eps_low": t.eps_low, "eps_high": t.eps_high, "precision": t.cpu_matmul_dtype}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--setup", action="store_true", help="create the TRL virtualenv and exit")
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2, help="torch threads on TRL's side (ours: train.threads)")
    ap.add_argument("--precision", choices=["float32", "bfloat16"], default="float32",
                    help="both sides' training precision (bfloat16: mixed, float32 weights and optimizer)")
    ap.add_argument("--only", nargs="+", choices=["trl", *VARIANTS], default=["trl", *VARIANTS])
    ap.add_argument("--out", default=str(REPO / "runs" / "bench-trl"))
    ap.add_argument("--report", default=None, help="print the table of an existing results file and exit")
    args = ap.parse_args()
    if args.setup:
        setup_trl()
        return
    if args.report:
        results = json.loads(Path(args.report).read_text())
        print(table(summarise(results), results["steps"]))
        return
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "results.json"
    common = [*SAME, f"train.steps={args.steps}", f"train.threads={args.threads}",
              f"train.cpu_matmul_dtype={args.precision}", f"rollout.vllm.dtype={args.precision}"]
    results = json.loads(path.read_text()) if path.exists() else {"steps": args.steps, "runs": {},
                                                                  "precision": args.precision}
    if results["steps"] != args.steps or results.get("precision", "float32") != args.precision:
        raise SystemExit(f"{path} holds runs of {results['steps']} steps in {results.get('precision', 'float32')}, "
                         f"not {args.steps} in {args.precision}")
    from rl.config import load_config

    cfg = load_config(str(CONFIG), common)
    samples_per_step = cfg.rollout.groups_per_step * cfg.rollout.group_size
    if "trl" in args.only:
        results["trl_versions"] = check_trl()
        prompts = task_prompts(CONFIG, common, args.steps)
        hyper = hyperparameters(CONFIG, common, args.steps)
        results["hyper"] = hyper
    answer_style = cfg.envs[0].kwargs.get("answer_style", "marker")
    for repeat in range(args.repeats):
        for side in args.only:
            run_dir = out / f"{side}-{int(time.time())}"
            run_dir.mkdir()
            load_before = os.getloadavg()
            log(f"{side} run {repeat + 1}/{args.repeats}: load {load_before[0]:.2f} {load_before[1]:.2f}")
            if side == "trl":
                run = run_trl(run_dir, prompts, hyper, args.threads, cfg.seed, cfg.model.hf_path, answer_style)
            else:
                run = run_ours(run_dir, [*common, *VARIANTS[side]])
            run.update(step_figures(run["step_s"], samples_per_step))
            run["load_before"], run["load_after"] = list(load_before), list(os.getloadavg())
            heldout = evaluate(run["checkpoint"], run_dir, common)
            run["heldout_reward"], run["heldout_stderr"], run["heldout_n"] = heldout["reward"], heldout["stderr"], heldout["n"]
            log(f"{side}: {run['s_per_step']:.1f} s a step, {run['samples_per_s']:.2f} samples/s, held-out reward "
                f"{run['heldout_reward']:.3f} +- {run['heldout_stderr']:.3f} (load after {run['load_after'][0]:.2f})")
            results["runs"].setdefault(side, []).append(run)
            path.write_text(json.dumps(results, indent=1))
    results["summary"] = summarise(results)
    path.write_text(json.dumps(results, indent=1))
    print(table(results["summary"], args.steps))


if __name__ == "__main__":
    main()
