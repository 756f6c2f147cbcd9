"""The driver of `rl train`: run folder, tokenizer, quality gate, warm-up, the GRPO loop (batches
from the scheduler, learner steps, weight pushes, checkpoints) and the before/after evaluation."""
from __future__ import annotations

import json
import random
import shutil
import time
from contextlib import closing
from dataclasses import replace
from pathlib import Path
from typing import Any

import ray

from envs.registry import EnvRegistryError, check_kwargs, check_names
from rl.checkpoint_store import CheckpointMirror
from rl.cluster import (RunActors, env_kwargs, model_spec, names_released, start_env_side, start_policy_side,
                        start_ray)
from rl.config import ConfigError, RunConfig, dump_config, load_config
from rl.errors import RunRefused, RunStopped
from rl.faults import StopOnSignal, actor_death, first_line, innermost, no_space, stop_line
from rl.evaluation import effort_table, eval_table, summarise_eval, write_pareto
from rl.gpu_busy import GpuBusy
from rl.hack_monitor import HackMonitor, responses_from_records
from rl.metrics import MetricsLogger
from rl.progress import StepProgress
from rl.step_report import RunRates, SignalMonitor, skip_reason, step_line
from rl.rollout.layout import episode_texts, reference_example, tool_fallback_warnings
from rl.rollout.scheduler import BatchReport, StreamPosition, WorkerLost
from rl.run_folder import (CHECKPOINT_HF, CHECKPOINTS, CONFIG, EFFORT_PARETO, EVAL_AFTER, EVAL_BEFORE, GATE, LATEST,
                           MOE_LOAD, ROLLOUTS, SCHEDULER, STEP_LOGS, TOKENIZER, append_jsonl, latest_checkpoint,
                           new_run_dir, read_json, rewind_step_logs, run_tracked, write_state)
from rl.telemetry import EnginePace, EnvHealth, EpisodeTime
from rl.types import env_worker_index
from rl.weight_sync import SyncSpec


class Trainer:
    def __init__(self, cfg: RunConfig, run_dir: Path, resume: bool = False, console=None) -> None:
        self.cfg = cfg
        self.run_dir = run_dir
        self.resume = resume
        self.console = console
        self.run_id = run_dir.name
        self.actors: RunActors | None = None
        self._sync_open = False
        self._started_ray = False
        ckpt_dir = cfg.checkpoint.dir
        self.mirror = CheckpointMirror.of_run(ckpt_dir, run_dir.name) if ckpt_dir else None
        self._env_workers: list = []
        self._where = "during set-up"  # where a stopped run's line says it stopped
        self._left_out: dict[str, float] = {}  # reference episodes left out, per environment: metrics
        self._signals = StopOnSignal(self._stop_line)

    def say(self, text: str) -> None:
        if self.console is not None:
            self.console.print(text)

    @property
    def bars(self) -> bool:
        """Progress bars only on a terminal: written to a file or a pipe, a bar prints once, at the
        end, cut to 80 columns; there each step prints a plain line instead."""
        return self.cfg.logging.progress and self.console is not None and self.console.is_terminal

    def phase(self, text: str) -> None:
        """A timestamped line at each phase boundary: readable in a log, also without progress bars."""
        self.say(f"[{time.strftime('%H:%M:%S')}] {text}")

    # -- set-up ----------------------------------------------------------------------------------
    def _reference_episodes(self, env_workers: list, per_env: int) -> dict[str, list[dict[str, Any]]]:
        """Reference episodes of each environment, its tasks dealt out over the levels trained on in
        turn: a reference may depend on the level (its reasoning), and the warm-up teaches each its own."""
        levels = [lvl for lvl, w in self.cfg.effort.weights.items() if w > 0]
        out = {}
        for entry in self.cfg.envs:
            worker = env_workers[env_worker_index(entry.name, len(env_workers))]
            ids = ray.get(worker.task_ids.remote(entry.name, "train"))[:per_env]
            parts = ray.get([worker.reference_episodes.remote(entry.name, ids[i::len(levels)], level, self.cfg.seed)
                             for i, level in enumerate(levels)])
            out[entry.name] = [ep for episodes, _ in parts for ep in episodes]
            failures = [line for _, failed in parts for line in failed]
            if failures:
                self.say(f"{entry.name}: {len(failures)} of {len(ids)} reference episode(s) raised and were left out "
                         f"of the tokenizer and the warm-up (first: {failures[0]})")
                self._left_out[f"warmup/reference_failed/{entry.name}"] = float(len(failures))
            if not out[entry.name]:
                raise RuntimeError(f"environment {entry.name!r}: every reference episode raised "
                                   f"(first: {failures[0] if failures else 'no tasks'})")
        return out

    def _tokenizer(self, episodes: dict[str, list[dict[str, Any]]]):
        """A transformers policy's own tokenizer, else a BPE tokenizer trained on the environments'
        text; saved in the run folder either way (the rollout workers load it from there)."""
        from policy import HFChatTokenizer, Tokenizer, load_tokenizer

        tok_dir = self.run_dir / TOKENIZER
        if tok_dir.exists():
            return load_tokenizer(str(tok_dir))
        if self.cfg.model.hf_path:
            tok = HFChatTokenizer.load(self.cfg.model.hf_path)
        else:
            texts = [t for eps in episodes.values() for ep in eps for t in episode_texts(ep)]
            tok = Tokenizer.train(texts, vocab_size=self.cfg.model.vocab_size)
        tok.save(str(tok_dir))
        return tok

    def _gate(self) -> None:
        """Every environment through the quality gate, `gate.workers` at a time on Ray actors; a report
        kept from an earlier run under the same code, data and settings is used as it is (gate.cache)."""
        from envs.gate_cache import default_cache
        from envs.gate_parallel import check_all
        from envs.registry import resolve

        gate = self.cfg.gate
        if not gate.enabled:
            return
        names = [entry.name for entry in self.cfg.envs]
        checks = [(name, resolve(name, env_kwargs(self.cfg, name)), env_kwargs(self.cfg, name)) for name in names]
        few = len(names) <= 8  # a line per environment; for many, the failures and a summary

        def said(name: str, report: dict[str, Any]) -> None:
            if few or not report["ok"]:
                reason = "; ".join(report.get("reasons", []))
                self.say(f"quality gate: {name}: {'ok' if report['ok'] else 'FAILED ' + reason}"
                         + (" (cached)" if report.get("cached") else ""))

        started = time.monotonic()
        reports = check_all(checks, gate.max_tasks, gate.workers or self.cfg.rollout.env_workers,
                            default_cache() if gate.cache else None, said)
        (self.run_dir / GATE).write_text(json.dumps(reports, indent=1))
        failed = [name for name in names if not reports[name]["ok"]]
        cached = sum(1 for r in reports.values() if r.get("cached"))
        self.phase(f"quality gate: {len(names) - len(failed)}/{len(names)} environments passed "
                   f"({cached} from the cache) in {time.monotonic() - started:.1f} s")
        if failed and not gate.allow_failing:
            reason = "; ".join(reports[failed[0]].get("reasons", []))
            more = f" (and {len(failed) - 1} more: see {GATE})" if len(failed) > 1 else ""
            raise RunRefused(f"environment {failed[0]!r} failed the quality gate ({reason}){more}; "
                             f"fix it or set gate.allow_failing=true")

    def _push_weights(self, version: int) -> float:
        """The learner's weights to every rollout worker, labelled `version` (GRPO steps trained): a
        bucketed sync through the object store (rl.weight_sync), written straight into the native
        engine's model; the vLLM and transformers engines take it as a state dict."""
        learner = self.actors.learner
        if not self._sync_open:
            bucket_bytes = self.cfg.rollout.sync_bucket_mb << 20
            learner.open_weight_sync(SyncSpec(transport="object_store", bucket_bytes=bucket_bytes))
            self._sync_open = True
        # full every time: a worker Ray restarted holds nothing a delta could build on
        ref = learner.push_weights(version, True)
        return ray.get(self.actors.scheduler.set_weights.remote([ref], version))

    # -- phases ----------------------------------------------------------------------------------
    def _warmup(self, examples: list[dict[str, list[int]]], logger: MetricsLogger) -> None:
        w = self.cfg.warmup
        self.phase(f"warm-up: {w.steps} supervised steps on {len(examples)} reference episodes")
        rng = random.Random(self.cfg.seed)
        progress = StepProgress("warm-up", w.steps, enabled=self.bars, console=self.console)
        with progress:
            for i in range(w.steps):
                batch = rng.sample(examples, min(w.batch_size, len(examples)))
                metrics = self.actors.learner.sft_step(batch, w.lr).metrics
                progress.advance(f"loss {metrics['sft/loss']:.3f}")
                logger.log(-w.steps + i, metrics)
        if w.steps and not self.bars:
            self.phase(f"warm-up: done, loss {metrics['sft/loss']:.3f}")

    def _evaluate(self, tag: str, logger: MetricsLogger) -> dict[str, Any]:
        """Held-out reward of the current weights, written to eval_{tag}.json. Groups that failed are
        said on the console and counted in eval/{tag}/failed_groups: with the first GRPO step's row
        (before), in a row of the last step's own (after)."""
        e = self.cfg.eval
        envs = [entry.name for entry in self.cfg.envs]
        self.phase(f"evaluating ({tag}): {e.tasks_per_env} held-out tasks x {len(e.efforts)} effort levels x "
                   f"{e.samples_per_task} samples per environment")
        result = ray.get(self.actors.scheduler.evaluate.remote(envs, e.efforts, e.tasks_per_env,
                                                               e.samples_per_task, e.temperature, tag))
        if result.failure_line():
            self.say(result.failure_line())
            failed = {f"eval/{tag}/failed_groups": float(len(result.failed))}
            if tag == "before":
                logger.add_to_next(failed)
            else:
                logger.log(self.cfg.train.steps - 1, failed)
        summary = summarise_eval(result.samples)
        (self.run_dir / {"before": EVAL_BEFORE, "after": EVAL_AFTER}[tag]).write_text(json.dumps(summary, indent=1))
        return summary

    def _save(self, step: int) -> None:
        from rl.integrity import MANIFEST, write_manifest

        ckpt_root = self.run_dir / CHECKPOINTS
        tag = f"step_{step}"
        # a step saved again is not whole until its new manifest is written
        (ckpt_root / tag / MANIFEST).unlink(missing_ok=True)
        self.actors.learner.save(str(ckpt_root), tag, {"step": step})
        shutil.copytree(self.run_dir / TOKENIZER, ckpt_root / tag / CHECKPOINT_HF / TOKENIZER, dirs_exist_ok=True)
        # the stream's position and the groups issued but not trained on: a resumed run plays them again
        snapshot = ray.get(self.actors.scheduler.snapshot.remote())
        (ckpt_root / tag / SCHEDULER).write_text(json.dumps(snapshot.to_dict()))
        write_manifest(ckpt_root / tag)  # last: every file of the checkpoint is on disk
        (ckpt_root / LATEST).write_text(tag)
        tags = sorted((p for p in ckpt_root.glob("step_*") if p.is_dir()), key=lambda p: int(p.name.split("_")[1]))
        for old in tags[: -self.cfg.checkpoint.keep]:
            shutil.rmtree(old, ignore_errors=True)
        if self.mirror is not None:  # the copy beyond the run folder, manifest and marker last
            self.mirror.upload(ckpt_root / tag)
            self.mirror.prune(self.cfg.checkpoint.keep)

    def _fetch_newer_from_mirror(self) -> None:
        """Resuming: a newer whole checkpoint in checkpoint.dir than in the run folder (the run folder's
        lost or torn) is downloaded into the run folder first."""
        if self.mirror is None:
            return
        local = latest_checkpoint(self.run_dir)
        newest = self.mirror.steps()
        if not newest or (local is not None and local[1] >= newest[-1][0]):
            return
        tag, passed_over = self.mirror.download_newest(self.run_dir / CHECKPOINTS)
        for line in passed_over:
            self.say(line)
        if tag is not None and (local is None or int(tag[5:]) > local[1]):
            (self.run_dir / CHECKPOINTS / LATEST).write_text(tag)
            self.say(f"{CHECKPOINTS}/{tag} fetched from {self.mirror.where(tag)}")

    def _restore(self) -> tuple[int, dict[str, Any]] | None:
        """Load the newest checkpoint of a resumed run: (first step to run, scheduler snapshot)."""
        from rl.run_folder import checkpoint_to_resume

        found, passed_over = checkpoint_to_resume(self.run_dir) if self.resume else (None, None)
        if passed_over:
            self.say(passed_over)
        if not found:
            return None
        tag, step = found
        self.actors.learner.load(str(self.run_dir / CHECKPOINTS), tag)
        saved = read_json(self.run_dir / CHECKPOINTS / tag / SCHEDULER)
        # the next batch is for the step after the checkpoint's, whatever an older file says
        snapshot = replace(StreamPosition.from_dict(saved) if saved else StreamPosition(), batches_taken=step + 1)
        write_state(self.run_dir, "running", resumed_at_step=step + 1)
        if step + 1 < self.cfg.train.steps:
            self.say(f"resumed from {tag}: continuing at step {step + 1}")
        return step + 1, snapshot

    def run(self) -> dict[str, Any]:
        cfg = self.cfg
        signals = self._signals
        signals.install()
        logger = None
        stopped = False
        try:
            self._started_ray = start_ray(cfg)
            signals.install()  # ray.init put its own SIGTERM handler in place
            if not (self.resume and (self.run_dir / GATE).exists()):
                self._where = "during the quality gate"
                self._gate()
            self._where = "during set-up"
            self._env_workers = start_env_side(cfg, self.run_id)
            if self.resume:
                self._fetch_newer_from_mirror()
            resuming = self.resume and latest_checkpoint(self.run_dir) is not None
            if self.resume and not resuming:  # it stopped before its first checkpoint: it starts again
                for name in (*STEP_LOGS, EVAL_BEFORE):
                    (self.run_dir / name).unlink(missing_ok=True)
            tok_ready = (self.run_dir / TOKENIZER).exists()
            # Reference episodes train the tokenizer and feed the warm-up; a resumed run needs neither.
            episodes = {} if resuming and tok_ready else self._reference_episodes(self._env_workers,
                                                                                   cfg.warmup.tasks_per_env)
            self.tokenizer = tok = self._tokenizer(episodes)
            for line in tool_fallback_warnings(tok, {name: eps[0]["tools"] for name, eps in episodes.items() if eps}):
                self.say(line)
            spec = model_spec(cfg, tok.vocab_size)
            self.actors = start_policy_side(cfg, self.run_id, spec, str(self.run_dir / TOKENIZER), tok.pad_id,
                                            self._env_workers)
            for line in self.actors.learner.startup_notes():
                self.say(line)
            if resuming:  # the steps after the checkpoint run again: their log lines go first
                rewind_step_logs(self.run_dir, latest_checkpoint(self.run_dir)[1])
            logger = MetricsLogger(self.run_dir, cfg.logging.wandb_mode, cfg.logging.wandb_project, self.run_id,
                                   cfg.model_dump(mode="json"), resume=self.resume)
            logger.add_to_next(self._left_out)
            restored = self._restore()
            before = read_json(self.run_dir / EVAL_BEFORE)
            if restored:
                start_step, snapshot = restored
                finished = read_json(self.run_dir / EVAL_AFTER)
                if start_step >= cfg.train.steps and (finished is not None or not cfg.eval.before_and_after):
                    self.say(f"the run already finished its {cfg.train.steps} steps; nothing to do "
                             f"(pass train.steps=N to train further)")
                    self._print_tables(before, finished)
                    return {"run_dir": str(self.run_dir), "before": before, "after": finished,
                            "steps": cfg.train.steps}
                self._push_weights(start_step)
            else:
                start_step, snapshot = 0, StreamPosition()
                if cfg.warmup.steps:
                    examples = [reference_example(tok, ep["messages"], ep["turns"], ep["effort"], ep["tools"])
                                for eps in episodes.values() for ep in eps]
                    self._where = "during the warm-up"
                    self._warmup(examples, logger)
                if cfg.train.kl_coef > 0:  # the KL pulls toward the policy GRPO starts from
                    self.actors.learner.set_reference()
                self._push_weights(0)
                self._where = "during the evaluation before RL"
                before = self._evaluate("before", logger) if cfg.eval.before_and_after else None
            self._train_loop(start_step, snapshot, logger)
            self._where = "during the evaluation after RL"
            after = self._evaluate("after", logger) if cfg.eval.before_and_after else None
            self._print_tables(before, after)
            if after is not None:
                files = write_pareto({"before RL": before, "after RL": after} if before else {"after RL": after},
                                     self.run_dir / EFFORT_PARETO, f"{cfg.name}: held-out, per effort level")
                self.say(f"effort Pareto (accuracy against tokens used): {', '.join(str(f) for f in files)}")
            return {"run_dir": str(self.run_dir), "before": before, "after": after, "steps": cfg.train.steps}
        except RunStopped:
            stopped = True
            raise
        except Exception as exc:
            if signals.stop is not None:  # the signal's RunStopped, wrapped on its way (a SystemError)
                raise signals.stop from None
            reason = self._stop_reason(exc)
            if reason is None:  # not a fault a run stops on (a bug): its traceback is the report
                raise
            stopped = True
            raise RunStopped(self._stop_line(*reason)) from exc
        finally:
            self._shut_down(logger, stopped)
            signals.restore()

    def _stop_line(self, what: str, detail: str = "") -> str:
        return stop_line(self.run_dir, f"{what} {self._where}" + (f": {detail}" if detail else ""))

    def _stop_reason(self, exc: Exception) -> tuple[str, str] | None:
        """(what stopped the run, how) for the faults a run stops on: a worker that will not come
        back, an actor of the driver's that died, a full disk; None for anything else."""
        cause = innermost(exc)
        if isinstance(cause, WorkerLost):
            what, _, how = str(cause).partition(": ")
            return what, how
        death = actor_death(exc, self._actor_names())
        if death is not None:
            return death
        space = no_space(exc, self.run_dir) if isinstance(cause, OSError) else None
        return (space, "") if space else None

    def _actor_names(self) -> dict[str, str]:
        """Actor id (hex) -> its name in the stop line."""
        names = {w._actor_id.hex(): f"environment worker {e}" for e, w in enumerate(self._env_workers)}
        if self.actors is not None:
            names[self.actors.scheduler._actor_id.hex()] = "the rollout scheduler"
            names.update({w._actor_id.hex(): f"rollout worker {i}" for i, w in enumerate(self.actors.rollout_workers)})
            if self.actors.learner is not None:
                names.update({a._actor_id.hex(): f"the learner (rank {r})"
                              for r, a in enumerate(self.actors.learner.actors)})
        return names

    def _shut_down(self, logger: MetricsLogger | None, stopped: bool) -> None:
        """Close the sinks and the actors. A run that stopped has its line to print: nothing here may
        replace it (Ray itself may be half gone), and the learner, mid-step or dead, is killed
        rather than asked to stop."""

        def attempt(close) -> None:
            try:
                close()
            except Exception:
                if not stopped:
                    raise

        if logger is not None:
            attempt(logger.close)
        if self.actors is not None:
            if stopped and self.actors.learner is not None:
                attempt(self.actors.learner.kill)
            attempt(self.actors.shutdown)
        else:
            for worker in self._env_workers:
                attempt(lambda worker=worker: ray.kill(worker, no_restart=True))
        if self._started_ray:
            attempt(ray.shutdown)
        elif ray.is_initialized():  # a cluster that outlives the run: its names free for the next when this returns
            attempt(self._wait_for_names)

    def _wait_for_names(self) -> None:
        held = names_released(self.run_id)
        if held:
            self.say(f"Ray still holds {len(held)} actor name(s) of this run ({', '.join(held[:3])}): a run "
                     f"started at once on this cluster may find them taken")

    def _print_tables(self, before: dict[str, Any] | None, after: dict[str, Any] | None) -> None:
        if after is not None and self.console is not None:
            self.console.print(eval_table(before, after))
            self.console.print(effort_table(before, after))

    def _train_loop(self, start_step: int, snapshot: StreamPosition, logger: MetricsLogger) -> None:
        cfg, actors = self.cfg, self.actors
        progress = StepProgress("GRPO", cfg.train.steps, completed=start_step, enabled=self.bars, console=self.console)
        rates = RunRates()  # the end-of-training line: rates over the steps that trained
        ray.get(actors.scheduler.start_training.remote(snapshot))
        self.phase(f"GRPO: steps {start_step}..{cfg.train.steps - 1}, {cfg.rollout.groups_per_step} groups of "
                   f"{cfg.rollout.group_size} a step, max_staleness {cfg.rollout.max_staleness}")
        pace = EnginePace(actors.rollout_workers, self.say)
        episode_time = EpisodeTime()
        health = EnvHealth(actors.env_workers)
        hacks = HackMonitor()  # its history starts again on resume: a flag needs 2 windows of this process
        signal = SignalMonitor(cfg.logging.no_signal_steps)  # domains whose groups' rewards all agree, step after step
        release = releases_rollout_caches(cfg)
        with progress, closing(GpuBusy.start()) as busy:  # NVML sampled in a thread; reads {} without a GPU
            for step in range(start_step, cfg.train.steps):
                self._signals.check()
                self._where = f"at step {step}"
                t0 = time.monotonic()
                batch_ref, report = self._next_batch(step)
                t1 = time.monotonic()
                released_mb = release_rollout_caches(actors.rollout_workers) if release else None
                trained = actors.learner.train_step(batch_ref[0])  # resolved by Ray in each rank, never here
                t2 = time.monotonic()
                sync_s = self._push_weights(step + 1)
                t3 = time.monotonic()
                metrics = {**report.metrics, **trained.metrics}
                samples = len(report.records)  # every sample played for this step, trained or dropped
                tokens = sum(r["tokens"] for r in report.records)
                metrics.update({
                    "time/rollout_s": t1 - t0, "time/train_s": t2 - t1, "time/sync_s": sync_s, "time/step_s": t3 - t0,
                    "time/learner_idle_frac": (t1 - t0 + t3 - t2) / max(t3 - t0, 1e-9),
                    "throughput/samples_per_s": samples / max(t3 - t0, 1e-9),
                    "throughput/tokens_per_s": tokens / max(t3 - t0, 1e-9),
                    "rollout/tokens_per_s": tokens / max(t3 - t0, 1e-9),
                    "weights/version": float(step + 1),
                    **health.metrics(),
                    **pace.metrics(),
                    **busy.step(t0, t1, t2, t3),  # gpu/busy_frac: kernel time over the step's wall time
                })
                hack_metrics, hack_warnings = hacks.observe(step, responses_from_records(report.records))
                metrics.update(hack_metrics)
                if released_mb is not None:
                    metrics["memory/rollout_cache_released_mb"] = released_mb
                for line in hack_warnings:
                    self.say(line)
                signal_metrics, signal_warnings = signal.observe(step, report.records, trained.shaped_rewards)
                metrics.update(signal_metrics)
                for line in signal_warnings:
                    self.say(line)
                logger.log(step, metrics)
                episode_time.observe(metrics)
                rates.observe(step, metrics, samples, tokens)
                shaped = trained.shaped_rewards or {}
                for record in report.records:  # the reward trained on beside the verifier's (None: not trained)
                    record["shaped_reward"] = shaped.get(record["uid"])
                append_jsonl(self.run_dir / ROLLOUTS, report.records)
                if trained.moe_load:
                    layers = sorted(trained.moe_load)
                    append_jsonl(self.run_dir / MOE_LOAD, [
                        {"step": step, "layers": layers, "load": [trained.moe_load[i] for i in layers]}])
                self._say_problems(step, report, metrics)
                if (step + 1) % cfg.checkpoint.every == 0 or step == cfg.train.steps - 1:
                    self._checkpoint(step)
                skipped = skip_reason(metrics)
                if not self.bars:  # no bar (a file, a pipe, logging.progress=false): a line per step
                    self.phase(step_line(step, cfg.train.steps, metrics))
                elif skipped:  # above the bar
                    self.say(f"step {step}: skipped: {skipped}")
                progress.advance(f"reward {metrics['rollout/reward']:.3f}  kl {metrics.get('train/kl', 0.0):.4f}  "
                                 f"mismatch {metrics.get('train/mismatch', 0.0):.4f}  " +
                                 ("skipped" if skipped else f"{metrics['throughput/samples_per_s']:.1f} samples/s"))
        ray.get(actors.scheduler.stop_training.remote())
        for line in (rates.summary(), pace.summary(), episode_time.summary()):
            if line is not None:
                self.phase(line)

    def _checkpoint(self, step: int) -> None:
        """Save; a save that fails stops the run in one line. What it wrote has no manifest, so it is
        never taken for whole; it is removed, giving back the space it took."""
        from rl.integrity import MANIFEST

        try:
            self._save(step)
        except Exception as exc:
            if isinstance(exc, RunStopped) or actor_death(exc, self._actor_names()) is not None:
                raise  # a signal, or the learner died: said as such by run()
            torn = self.run_dir / CHECKPOINTS / f"step_{step}"
            why = no_space(exc, torn) or first_line(exc)
            if not (torn / MANIFEST).exists():
                shutil.rmtree(torn, ignore_errors=True)
            raise RunStopped(stop_line(self.run_dir, f"checkpoint step_{step} failed: {why}")) from exc

    def _next_batch(self, step: int):
        """The scheduler's next batch; while it waits on workers Ray is restarting (a lost node's, that
        need a node with room for them), one line each says so."""
        ref = self.actors.scheduler.next_batch.remote(step)
        said: set[str] = set()
        while not ray.wait([ref], timeout=WAIT_REPORT_S)[0]:
            for name, seconds in ray.get(self.actors.scheduler.waiting_on.remote(WAIT_REPORT_S)):
                if name not in said:
                    said.add(name)
                    self.say(f"step {step}: waiting for {name} to come back ({seconds:.0f} s so far): Ray is "
                             f"restarting it, on a node with room for it (a lost node's workers wait for one to join)")
        return ray.get(ref)

    def _say_problems(self, step: int, report: BatchReport, metrics: dict[str, float]) -> None:
        """Worker restarts, grader actors replaced, failed groups and ungraded samples are said on
        the console, not only logged."""
        for line in report.faults:
            self.say(f"step {step}: {line}")
        replaced = int(metrics.get("faults/grader_actors_replaced", 0))
        if replaced:
            self.say(f"step {step}: {replaced} grader actor(s) died or hung and were replaced; "
                     f"their grades were retried")
        failed = int(metrics.get("rollout/failed_groups", 0))
        if failed:
            self.say(f"step {step}: {failed} group(s) failed and were left out; latest: {report.errors[-1]}")
        errors = [r for r in report.records if r["error"]]
        if errors:
            self.say(f"step {step}: {len(errors)} sample(s) could not be graded and scored 0; "
                     f"latest ({errors[-1]['env']}): {errors[-1]['error']}")


def releases_rollout_caches(cfg: RunConfig) -> bool:
    """Whether the rollout engines free their caches while the learner steps: colocated on its GPUs,
    unless the config keeps them; only a synchronous run asks (asynchronous rollouts run through
    the step, their engines holding sequences)."""
    res = cfg.resources
    return res.colocate and res.release_rollout_caches and cfg.rollout.max_staleness == 0


def release_rollout_caches(workers: list) -> float:
    """Every rollout worker frees its engine's cache if it holds no sequence (it is allocated again
    for the next group); the MiB freed in all. A worker restarting holds no cache to free."""
    freed = 0
    for ref in [w.release_cache.remote() for w in workers]:
        try:
            freed += ray.get(ref)
        except ray.exceptions.RayError:
            pass
    return freed / (1 << 20)


WAIT_REPORT_S = 10.0  # a step waiting this long on a restarting worker says so


def _check_environments(cfg: RunConfig) -> None:
    """Each environment is registered, its class loads and its constructor takes the entry's kwargs: one
    line naming the entry, before anything starts."""
    try:  # a misspelt name, or a class that no longer imports
        check_names([e.name for e in cfg.envs])
    except EnvRegistryError as exc:
        raise ConfigError(f"config error: {exc}") from None
    for i, entry in enumerate(cfg.envs):
        try:
            check_kwargs(entry.name, env_kwargs(cfg, entry.name))
        except EnvRegistryError as exc:
            raise ConfigError(f"config error: 'envs.{i}.kwargs': {exc}") from None


def train(config_path: str | None, overrides: list[str], resume: str | None = None, console=None) -> dict[str, Any]:
    """Entry point shared by the CLI and tests: the config and its environments are checked before Ray starts."""
    if resume:
        run_dir = Path(resume)
        saved = run_dir / CONFIG
        if not saved.exists():
            raise RunRefused(f"--resume: {run_dir} has no {CONFIG} (is it a run folder?)")
        cfg = load_config(saved, overrides)
    else:
        if config_path is None:
            raise RunRefused("rl train needs a CONFIG file or --resume RUN_DIR")
        cfg = load_config(config_path, overrides)
        if cfg.model.hf_path and not (Path(cfg.model.hf_path) / "config.json").exists():
            raise RunRefused(f"model.hf_path: no config.json in {cfg.model.hf_path} "
                             f"(for SmolLM2, convert it once: rl model import smollm2)")
    _check_environments(cfg)  # a resumed run's too: the registry may have changed since
    if not resume:
        try:
            run_dir = new_run_dir(cfg)
        except OSError as exc:
            raise ConfigError(f"config error: 'output_dir': cannot make a run folder in {cfg.output_dir}: "
                              f"{exc.strerror or exc}") from None
    dump_config(cfg, run_dir / CONFIG)
    if console is not None:
        console.print(f"run folder: {run_dir}")
    # state.json: running, then finished / failed / interrupted (rl dashboard and rl report show it)
    return run_tracked(run_dir, bool(resume), Trainer(cfg, run_dir, resume=bool(resume), console=console).run)
