"""The one training loop every trainer runs.

A trainer (train/eagle.py, train/medusa.py, train/distill.py) builds its config, target, data,
trainable module and step function into a :class:`Recipe` (``build(cfg)``), which runs them with
:func:`run_training`::

    accelerator = start_run(cfg, MEMORY)   # seeds before any weights, then the memory check
    target = load_target(cfg.target, device=accelerator.device)   # frozen; never prepared
    batches = make_batches(dataset, cfg, accelerator, collate, lengths=..., weights=...)
    model = EagleLoss(head, ...)                            # the trainable module

    def step(model, batch, micro_index) -> StepOutput:       # one micro-batch
        loss, parts = model(batch, reduction="sum")          # summed over scored tokens
        return StepOutput(loss, {"acc_0": (parts["acc_0"] * n, n)})

    result = run_training(cfg, accelerator, model=model, batches=batches, step=step,
                          target_identity=target.identity(), evaluators=[AcceptanceEval(...)])
    if result.completed: ...export accelerator.unwrap_model(result.model)...
    result.metrics.close()

The loop owns everything that is the same for every method: the optimizer (AdamW) and the
learning rate of each step, ``accelerator.prepare`` of the trainable module alone (DDP; or its
FSDP2 shards, train/sharding.py, when the launch asks for FSDP2), resuming from
and saving checkpoints, gradient accumulation and clipping, the per-token normalisation of the loss
over the whole optimizer step (:func:`draftsmith.train.batches.loss_scale`), logging, periodic evaluation,
stopping on SIGINT/SIGTERM, and stopping on a non-finite loss (nothing is saved or exported then,
and the error names the step and the rows).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from torch import nn

from draftsmith.files.command_line import shell_command
from draftsmith.heads.artifact import save_artifact
from draftsmith.train.accelerator import attention_kernels, close_process_group, make_accelerator
from draftsmith.train.batches import TrainBatches, loss_scale, padded_tokens
from draftsmith.train.checkpoints import Checkpointer, TrainState, check_resume_layout
from draftsmith.train.config import FeatureKeys
from draftsmith.train.estimate import MemoryModel, check_fits
from draftsmith.train.features import feature_cache_dir
from draftsmith.train.optimizer import apply_learning_rate, make_optimizer
from draftsmith.train.sharding import (
    FSDP2,
    check_shared_directory,
    check_target_shards,
    full_state_dict,
    gradient_sync,
    run_plan,
    shard_trained,
)
from draftsmith.train.signals import GracefulStop
from draftsmith.train.tracking import MetricsLogger, PeriodicEval, peak_memory_gb


@dataclass
class StepOutput:
    """What a trainer's step function returns for one micro-batch."""

    loss: torch.Tensor  # () differentiable, SUMMED over the micro-batch's scored positions
    # name -> (total, count): logged as sum(total) / sum(count) over the logging window and the
    # processes (a mean per micro-batch is (value, 1); a token accuracy (correct, tokens))
    metrics: dict[str, tuple[Any, Any]] = field(default_factory=dict)


@dataclass
class TrainResult:
    state: TrainState
    model: nn.Module  # the prepared module (unwrap it to export)
    stopped: str | None  # the stop message when a signal ended the run early, else None
    checkpoint: Path | None  # the last checkpoint written
    metrics: MetricsLogger  # still open: the trainer logs its final records, then closes it

    @property
    def completed(self) -> bool:
        return self.stopped is None


@dataclass
class Recipe:
    """What a trainer builds (``build(cfg)`` in train/<method>.py) and the loop runs.

    ``main(cfg)`` of every trainer is ``recipe = build(cfg); return recipe.export(recipe.train())``;
    ``python -m draftsmith.train.speed`` builds the same recipe and times it.
    """

    cfg: Any
    accelerator: Accelerator
    target: Any  # draftsmith.targets.target.Target: the frozen target (never prepared)
    batches: TrainBatches
    model: nn.Module  # the trainable module alone
    step: Callable[[nn.Module, dict, int], StepOutput]
    export: Callable[[TrainResult], dict]  # what main(cfg) returns, after writing the artifact
    evaluators: Sequence[PeriodicEval] = ()
    first_record: dict | None = None
    on_resume: Callable[[TrainState, nn.Module], None] | None = None
    # the frozen target's no-grad forward exactly as ``step`` makes it on a micro-batch (what
    # python -m draftsmith.train.speed times); None: the step does not run the target (offline features)
    target_forward: Callable[[dict], Any] | None = None

    def train(self, stop: GracefulStop | None = None) -> TrainResult:
        return run_training(self.cfg, self.accelerator, model=self.model, batches=self.batches,
                            step=self.step, target_identity=self.target.identity(),
                            evaluators=self.evaluators, first_record=self.first_record,
                            on_resume=self.on_resume, stop=stop)


def start_run(cfg, memory: MemoryModel) -> Accelerator:
    """The first step of every trainer's ``build``: the accelerator (it seeds, before any weight
    exists), then everything that can refuse the run before minutes of loading the target: the
    sharding (:func:`draftsmith.train.sharding.sharding_plan`: the mesh, the launch's engine), what a
    sharded run cannot do, the checkpoint to resume from (written with the same engine), the
    output directory (and an offline feature cache) shared by every process, and the memory
    check."""
    accelerator = make_accelerator(cfg)
    plan = run_plan(cfg, accelerator)
    if plan.any and cfg.eval_every:
        raise ValueError(
            f"eval_every is {cfg.eval_every}, but this run shards "
            f"{'the trained module' if plan.trained == FSDP2 else 'the target'}: every forward "
            f"of a sharded module needs all processes at once, and each process would decode "
            f"its own prompts; set eval_every: 0 and measure the artifact with python -m "
            f"draftsmith.eval.bench after training")
    check_target_shards(cfg, plan)
    check_resume_layout(cfg, plan)
    check_shared_directory(accelerator, Path(cfg.output_dir), "output_dir")
    if isinstance(cfg, FeatureKeys) and cfg.feature_mode == "offline":  # every process reads every file
        check_shared_directory(accelerator, feature_cache_dir(cfg), "feature_cache_dir")
    check_fits(cfg, accelerator, memory, plan)
    return accelerator


def write_run_artifact(cfg, accelerator: Accelerator, result: TrainResult, *, method: str,
                       config: dict, target, module: str, formats: str,
                       bench_prefix: str) -> tuple[Path | None, nn.Module]:
    """The end of a run whose draft is one submodule of the trained module (``module``: the
    head of an EagleLoss, the draft of a DFlashLoss): every process gathers the weights, the
    main process of a completed run writes ``<output_dir>/artifact`` and prints the commands that
    export and measure it; then the metrics and the accelerator are closed. -> (the artifact or
    None, the unwrapped draft)."""
    weights = full_state_dict(accelerator.unwrap_model(result.model))  # every process gathers
    draft = getattr(accelerator.unwrap_model(result.model), module)
    artifact = None
    if accelerator.is_main_process and result.completed:
        state_dict = {name.removeprefix(f"{module}."): tensor for name, tensor in weights.items()}
        artifact = save_artifact(Path(cfg.output_dir) / "artifact", method, config, state_dict,
                                 target.identity(), overwrite=cfg.overwrite)
        export_command = shell_command("draftsmith", "export", artifact, "--format",
                                       "vllm", "--out", Path(cfg.output_dir) / "vllm")
        measure = shell_command("python", "-m", "draftsmith.eval.bench", "--target", cfg.target, "--method",
                                "hf", "--method", f"{bench_prefix}:{artifact}", "--prompts",
                                cfg.eval_prompts, "--num-prompts", "8")
        accelerator.print(f"[draftsmith] {method} written to {artifact}\n"
                          f"  export:  {export_command}   (or {formats})\n"
                          f"  measure: {measure}")
    accelerator.wait_for_everyone()
    result.metrics.close()
    close_process_group(accelerator)
    return artifact, draft


class NonFiniteLoss(ValueError):
    """The loss became NaN or infinite: training stopped, nothing was saved or exported."""


def run_training(cfg, accelerator: Accelerator, *, model: nn.Module, batches: TrainBatches,
                 step: Callable[[nn.Module, dict, int], StepOutput], target_identity: dict,
                 evaluators: Sequence[PeriodicEval] = (), first_record: dict | None = None,
                 on_resume: Callable[[TrainState, nn.Module], None] | None = None,
                 stop: GracefulStop | None = None) -> TrainResult:
    """Train ``model`` (the trainable module alone) with ``step`` until the config says stop.

    ``step(model, batch, micro_index)`` runs one micro-batch (a dict of tensors on the device,
    under the accelerator's autocast) and returns a :class:`StepOutput`; ``micro_index`` counts
    this process's micro-batches over the whole run (resumed runs continue the count), for
    schedules that must not depend on where a run was resumed. ``evaluators`` run every
    ``every`` steps (and at step 0 of a fresh run, after ``first_record`` is logged);
    ``on_resume(state, unwrapped_model)`` checks a resumed module before training continues.
    ``stop`` replaces the SIGINT/SIGTERM handler (a subclass that requests a stop after some
    step, say).
    """
    sharded = run_plan(cfg, accelerator).trained == FSDP2
    if sharded:  # FSDP2 through torch (accelerate shards only on GPUs); never prepared
        model = shard_trained(model, run_plan(cfg, accelerator), accelerator.device)
        optimizer = make_optimizer(model, cfg)
    else:
        optimizer = make_optimizer(model, cfg)
        model, optimizer = accelerator.prepare(model, optimizer)
    checkpointer = Checkpointer(accelerator, cfg, target_identity, batches.plan, model=model,
                                optimizer=optimizer, sharded=sharded)
    state = checkpointer.resume()
    if on_resume is not None and state.resumed_from is not None:
        on_resume(state, accelerator.unwrap_model(model))
    metrics = MetricsLogger(accelerator, cfg, state)
    if state.step == 0:  # where the run starts, for comparison
        if first_record:
            metrics.log({"step": 0, **first_record})
        for evaluator in evaluators:
            evaluator.maybe_run(state, model, metrics, force=True)

    plan, accumulation = batches.plan, accelerator.gradient_accumulation_steps
    processes = accelerator.num_processes
    first_bad = torch.full((), -1, dtype=torch.long, device=accelerator.device)
    saved = stopped = None
    with stop or GracefulStop(accelerator) as stop:
        steps = batches.steps(state.step, accelerator.device) if not state.done else iter(())
        for index, planned, micro_batches in steps:
            lr = apply_learning_rate(optimizer, cfg, state.step, state.total_steps)
            scale = loss_scale(planned.weight, processes, accumulation)
            mine = plan.rows_of(planned, accelerator.process_index)
            for slot, batch in enumerate(micro_batches):
                micro_index = index * accumulation + slot
                with accelerator.accumulate(model), gradient_sync(model,
                                                                  accelerator.sync_gradients):
                    with accelerator.autocast(), attention_kernels(cfg):
                        out = step(model, batch, micro_index)
                    accelerator.backward(out.loss * scale)
                    if accelerator.sync_gradients and cfg.max_grad_norm > 0:
                        accelerator.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
                    optimizer.step()
                    optimizer.zero_grad()
                loss = out.loss.detach()
                first_bad = torch.where((first_bad < 0) & ~torch.isfinite(loss),
                                        torch.tensor(micro_index, device=first_bad.device),
                                        first_bad)
                metrics.add("loss", loss, plan.micro_weight(mine[slot], micro_index))
                for name, (total, count) in out.metrics.items():
                    metrics.add(name, total, count)
                metrics.count_tokens(batch["attention_mask"].sum())
            real, padded = padded_tokens(plan.lengths, planned.micro_batches, plan.packed)
            metrics.add("padding", padded - real, padded)
            state.step += 1
            state.rows_seen += planned.rows()
            state.tokens_seen += real
            stopping = stop.should_stop()  # every process, every step
            saving = checkpointer.due(state) or stopping or state.done
            if saving or metrics.due(state) or state.done:
                _check_finite(accelerator, first_bad, plan, checkpointer)
            metrics.step(state, force=stopping or state.done, lr=lr,
                         peak_memory_gb=round(peak_memory_gb(accelerator.device), 3))
            for evaluator in evaluators:
                evaluator.maybe_run(state, model, metrics)
            if saving:
                saved = checkpointer.save(state)
            if stopping:
                stopped = stop.message(state, saved)
                accelerator.print(stopped)
                break
            if state.done:
                break
    return TrainResult(state=state, model=model, stopped=stopped,
                       checkpoint=saved or state.resumed_from, metrics=metrics)


def _check_finite(accelerator: Accelerator, first_bad: torch.Tensor, plan,
                  checkpointer: Checkpointer) -> None:
    """Raise :class:`NonFiniteLoss` if any process saw a non-finite loss (one sync, on logging
    and saving steps only)."""
    flags = first_bad.reshape(1).clone()
    if accelerator.num_processes > 1:
        flags = accelerator.gather(flags)
    bad = [(rank, int(v)) for rank, v in enumerate(flags.tolist()) if v >= 0]
    if not bad:
        return
    rank, micro_index = bad[0]
    accumulation = plan.accumulation
    step_index, slot = divmod(micro_index, accumulation)
    _, planned = next(plan.steps(step_index))
    rows = plan.rows_of(planned, rank)[slot]
    last = checkpointer.last_saved_step
    raise NonFiniteLoss(
        f"the loss became non-finite (NaN or inf) at optimizer step {step_index + 1}, "
        f"micro-batch {slot} of process {rank} (training rows {list(rows)[:16]}"
        f"{' ...' if len(rows) > 16 else ''}); training stopped and nothing more was saved or "
        f"exported. Lower learning_rate or set max_grad_norm, check those rows, then continue "
        f"from the last checkpoint"
        + (f" (step {last}) with --resume latest" if last else " (none was saved)"))
