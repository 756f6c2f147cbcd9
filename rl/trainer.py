"""The driver of `rl train`: run folder, tokenizer, quality gate, warm-up, the GRPO loop with
weight pushes and checkpoints, and the before/after evaluation table."""
from __future__ import annotations

import json
import random
import shutil
import time
from pathlib import Path
from typing import Any

import ray

from envs.registry import EnvRegistryError, check_names
from rl.cluster import RunActors, env_kwargs, model_spec, start_env_side, start_policy_side, start_ray
from rl.config import ConfigError, RunConfig, dump_config, load_config
from rl.errors import RunRefused
from rl.rollout.layout import episode_texts, reference_example
from rl.evaluation import effort_table, eval_table, summarise_eval
from rl.metrics import MetricsLogger, rollout_metrics
from rl.progress import StepProgress
from rl.types import env_worker_index

CHECKPOINTS = "checkpoints"


def new_run_dir(cfg: RunConfig) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    base = Path(cfg.output_dir) / f"{cfg.name}-{stamp}"
    run_dir, n = base, 1
    while run_dir.exists():
        n += 1
        run_dir = base.with_name(f"{base.name}-{n}")
    run_dir.mkdir(parents=True)
    return run_dir


def latest_checkpoint(run_dir: Path) -> tuple[str, int] | None:
    marker = run_dir / CHECKPOINTS / "latest"
    if not marker.exists():
        return None
    tag = marker.read_text().strip()
    return tag, int(tag.split("_")[1])


class Trainer:
    def __init__(self, cfg: RunConfig, run_dir: Path, resume: bool = False, console=None) -> None:
        self.cfg = cfg
        self.run_dir = run_dir
        self.resume = resume
        self.console = console
        self.run_id = run_dir.name
        self.actors: RunActors | None = None
        self.version = 0
        self._started_ray = False
        self._env_workers: list = []

    def say(self, text: str) -> None:
        if self.console is not None:
            self.console.print(text)

    # -- set-up ----------------------------------------------------------------------------------
    def _reference_episodes(self, env_workers: list, per_env: int) -> dict[str, list[dict[str, Any]]]:
        out = {}
        for entry in self.cfg.envs:
            worker = env_workers[env_worker_index(entry.name, len(env_workers))]
            ids = ray.get(worker.task_ids.remote(entry.name, "train"))[:per_env]
            out[entry.name] = ray.get(worker.reference_episodes.remote(entry.name, ids, "medium", self.cfg.seed))
        return out

    def _tokenizer(self, episodes: dict[str, list[dict[str, Any]]]):
        from policy import Tokenizer

        tok_dir = self.run_dir / "tokenizer"
        if tok_dir.exists():
            return Tokenizer.load(str(tok_dir))
        texts = [t for eps in episodes.values() for ep in eps for t in episode_texts(ep)]
        tok = Tokenizer.train(texts, vocab_size=self.cfg.model.vocab_size)
        tok.save(str(tok_dir))
        return tok

    def _gate(self) -> None:
        from envs.quality import check_env

        if not self.cfg.gate.enabled:
            return
        reports = {}
        for entry in self.cfg.envs:
            report = check_env(entry.name, env_kwargs(self.cfg, entry.name), max_tasks=self.cfg.gate.max_tasks)
            reports[entry.name] = report.to_dict()
            ok = reports[entry.name]["ok"]
            reason = "; ".join(reports[entry.name].get("reasons", []))
            self.say(f"quality gate: {entry.name}: {'ok' if ok else 'FAILED ' + reason}")
            if not ok and not self.cfg.gate.allow_failing:
                (self.run_dir / "gate.json").write_text(json.dumps(reports, indent=1))
                raise RunRefused(f"environment {entry.name!r} failed the quality gate ({reason}); "
                                 f"fix it or set gate.allow_failing=true")
        (self.run_dir / "gate.json").write_text(json.dumps(reports, indent=1))

    def _push_weights(self) -> None:
        ref = self.actors.learner.get_weights.remote()
        ray.get(self.actors.scheduler.set_weights.remote([ref], self.version))

    # -- phases ----------------------------------------------------------------------------------
    def _warmup(self, examples: list[dict[str, list[int]]], logger: MetricsLogger) -> None:
        w = self.cfg.warmup
        rng = random.Random(self.cfg.seed)
        progress = StepProgress("warm-up", w.steps, enabled=self.cfg.logging.progress)
        with progress:
            for i in range(w.steps):
                batch = rng.sample(examples, min(w.batch_size, len(examples)))
                metrics = ray.get(self.actors.learner.sft_step.remote(batch, w.lr))
                progress.advance(f"loss {metrics['sft/loss']:.3f}")
                if i == w.steps - 1 or i % 10 == 0:
                    logger.log(-w.steps + i, metrics)
        self.version += w.steps

    def _evaluate(self, tag: str) -> dict[str, Any]:
        e = self.cfg.eval
        envs = [entry.name for entry in self.cfg.envs]
        result = ray.get(self.actors.scheduler.evaluate.remote(envs, e.efforts, e.tasks_per_env,
                                                                   e.samples_per_task, e.temperature, tag))
        summary = summarise_eval(result["samples"])
        (self.run_dir / f"eval_{tag}.json").write_text(json.dumps(summary, indent=1))
        return summary

    def _save(self, step: int) -> None:
        ckpt_root = self.run_dir / CHECKPOINTS
        tag = f"step_{step}"
        ray.get(self.actors.learner.save.remote(str(ckpt_root), tag, {"step": step}))
        shutil.copytree(self.run_dir / "tokenizer", ckpt_root / tag / "hf" / "tokenizer", dirs_exist_ok=True)
        (ckpt_root / "latest").write_text(tag)
        tags = sorted((p for p in ckpt_root.glob("step_*") if p.is_dir()), key=lambda p: int(p.name.split("_")[1]))
        for old in tags[: -self.cfg.checkpoint.keep]:
            shutil.rmtree(old, ignore_errors=True)

    def _restore(self) -> tuple[int, dict[str, Any] | None] | None:
        """Load the newest checkpoint of a resumed run: (first step to run, the "before" eval)."""
        found = latest_checkpoint(self.run_dir) if self.resume else None
        if not found:
            return None
        tag, step = found
        state = ray.get(self.actors.learner.load.remote(str(self.run_dir / CHECKPOINTS), tag))
        self.version = int(state["version"])
        self.say(f"resumed from {tag}: continuing at step {step + 1}")
        path = self.run_dir / "eval_before.json"
        return step + 1, (json.loads(path.read_text()) if path.exists() else None)

    def run(self) -> dict[str, Any]:
        cfg = self.cfg
        self._started_ray = start_ray(cfg)
        logger = None
        try:
            if not self.resume:
                self._gate()
            self._env_workers = start_env_side(cfg, self.run_id)
            resuming = self.resume and latest_checkpoint(self.run_dir) is not None
            tok_ready = (self.run_dir / "tokenizer").exists()
            # Reference episodes train the tokenizer and feed the warm-up; a resumed run needs neither.
            episodes = {} if resuming and tok_ready else self._reference_episodes(self._env_workers,
                                                                                   cfg.warmup.tasks_per_env)
            self.tokenizer = tok = self._tokenizer(episodes)
            spec = model_spec(cfg, tok.vocab_size)
            self.actors = start_policy_side(cfg, self.run_id, spec, str(self.run_dir / "tokenizer"), tok.pad_id,
                                            self._env_workers)
            logger = MetricsLogger(self.run_dir, cfg.logging.wandb_mode, cfg.logging.wandb_project, self.run_id,
                                   cfg.model_dump(mode="json"), resume=self.resume)
            restored = self._restore()
            if restored:
                start_step, before = restored
                self._push_weights()
            else:
                start_step = 0
                if cfg.warmup.steps:
                    levels = [lvl for lvl, w in cfg.effort.weights.items() if w > 0]
                    rng = random.Random(cfg.seed)
                    examples = [reference_example(tok, ep["messages"], ep["turns"], rng.choice(levels))
                                for eps in episodes.values() for ep in eps]
                    self._warmup(examples, logger)
                self._push_weights()
                before = self._evaluate("before") if cfg.eval.before_and_after else None
            self._train_loop(start_step, logger)
            after = self._evaluate("after") if cfg.eval.before_and_after else None
            if after is not None and self.console is not None:
                self.console.print(eval_table(before, after))
                self.console.print(effort_table(before, after))
            return {"run_dir": str(self.run_dir), "before": before, "after": after, "steps": cfg.train.steps}
        finally:
            if logger is not None:
                logger.close()
            if self.actors is not None:
                self.actors.shutdown()
            else:
                for worker in self._env_workers:
                    ray.kill(worker, no_restart=True)
            if self._started_ray:
                ray.shutdown()

    def _response_text(self, sample) -> str:
        """The policy's own tokens of an episode, decoded (tool results left out)."""
        return self.tokenizer.decode([t for t, m in zip(sample.tokens, sample.loss_mask) if m])

    def _train_loop(self, start_step: int, logger: MetricsLogger) -> None:
        cfg = self.cfg
        progress = StepProgress("GRPO", cfg.train.steps, completed=start_step, enabled=cfg.logging.progress)
        rollouts_log = self.run_dir / "rollouts.jsonl"
        with progress:
            for step in range(start_step, cfg.train.steps):
                t0 = time.monotonic()
                result = ray.get(self.actors.scheduler.collect.remote(step, cfg.rollout.groups_per_step))
                samples = result["samples"]
                metrics = rollout_metrics(samples, self.version)
                gen_tokens = sum(s.response_tokens for s in samples)
                metrics["rollout/tokens_per_s"] = gen_tokens / max(result["seconds"], 1e-9)
                metrics["rollout/reissued"] = float(result["reissued"])
                metrics["rollout/failed_groups"] = float(result["failed_groups"])
                if result["failed_groups"]:
                    self.say(f"step {step}: {result['failed_groups']} group(s) failed and were left out; "
                             f"latest: {result['errors'][-1]}")
                metrics["time/rollout_s"] = result["seconds"]
                t1 = time.monotonic()
                metrics.update(ray.get(self.actors.learner.train_step.remote(
                    samples, cfg.train.adv_std_norm, cfg.train.filter_uniform_groups)))
                self.version += 1
                metrics["time/train_s"] = time.monotonic() - t1
                self._push_weights()
                metrics["time/step_s"] = time.monotonic() - t0
                metrics["weights/version"] = float(self.version)
                logger.log(step, metrics)
                with rollouts_log.open("a") as f:
                    for s in samples:
                        f.write(json.dumps({"step": step, "uid": s.uid, "env": s.env, "effort": s.effort,
                                            "reward": s.reward, "version": s.weight_version,
                                            "tokens": s.response_tokens, "error": s.grade_error,
                                            "response": self._response_text(s)}) + "\n")
                if (step + 1) % cfg.checkpoint.every == 0 or step == cfg.train.steps - 1:
                    self._save(step)
                progress.advance(f"reward {metrics['rollout/reward']:.3f}  kl {metrics.get('train/kl', 0.0):.4f}  "
                                 f"mismatch {metrics.get('train/mismatch', 0.0):.4f}  "
                                 f"{metrics['rollout/tokens_per_s']:.0f} tok/s")


def train(config_path: str | None, overrides: list[str], resume: str | None = None, console=None) -> dict[str, Any]:
    """Entry point shared by the CLI and tests."""
    if resume:
        run_dir = Path(resume)
        saved = run_dir / "config.yaml"
        if not saved.exists():
            raise RunRefused(f"--resume: {run_dir} has no config.yaml (is it a run folder?)")
        cfg = load_config(saved, overrides)
    else:
        if config_path is None:
            raise RunRefused("rl train needs a CONFIG file or --resume RUN_DIR")
        cfg = load_config(config_path, overrides)
        try:  # a misspelt name, or a class that no longer imports: one line, before anything starts
            check_names([e.name for e in cfg.envs])
        except EnvRegistryError as exc:
            raise ConfigError(f"config error: {exc}") from None
        run_dir = new_run_dir(cfg)
    dump_config(cfg, run_dir / "config.yaml")
    if console is not None:
        console.print(f"run folder: {run_dir}")
    return Trainer(cfg, run_dir, resume=bool(resume), console=console).run()
