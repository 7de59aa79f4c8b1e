"""Running lm-eval on lopa_fast: `evaluate` (lm-eval's Python API, the result dict saved and the lopa_fast totals
added) and `main` (`python -m lopa_fast lm-eval ARGS`: lm-eval's own command line)."""
from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from lopa_fast import logs
from lopa_fast.errors import LopaError
from lopa_fast.lm_eval.model import LopaFastLM

LM_EVAL_DEFAULT_DEVICE = "cuda:0"  # lm-eval's EvaluatorConfig.device when --device is not given


def _results_dir(tracker) -> Path:
    """The directory lm-eval's EvaluationTracker saved this run's results file in (its own rule: a `.json`
    output_path is a file name, anything else a directory with one subdirectory per model)."""
    p = Path(tracker.output_path)
    return p.parent if p.suffix == ".json" else p / str(tracker.general_config_tracker.model_name_sanitized)


def evaluate(model, tasks, *, output_path: str | None = None, log_samples: bool = False, model_args=None,
             hf_hub_log_args: dict | None = None, wandb_args: dict | None = None,
             wandb_config_args: dict | None = None, trackio_args: dict | None = None, show_config: bool = False,
             **simple_evaluate_kwargs) -> dict | None:
    """`lm_eval.simple_evaluate(model, tasks=tasks, ...)` on a model instance (a `LopaFastLM`, or any lm-eval model
    or model name), lm-eval's result dict saved where asked by lm-eval's own `EvaluationTracker` (output_path: a
    directory or a .json path; with log_samples the per-task samples next to it), the lopa_fast totals added under
    "lopa_fast" and written with every generate_until request (`records`, restarted for each run) to
    lopa_fast_stats_<date>.json beside the results, the results table printed. wandb_args / trackio_args /
    hf_hub_log_args: lm-eval's loggers, as `lm-eval run` uses them. Returns the result dict (None off rank 0)."""
    from lm_eval import simple_evaluate
    from lm_eval.loggers import EvaluationTracker
    from lm_eval.utils import handle_non_serializable, make_table

    log_samples = log_samples or bool(simple_evaluate_kwargs.get("predict_only"))  # lm-eval's rule: saved apart
    hub = dict(hf_hub_log_args or {})
    if output_path:
        hub["output_path"] = output_path
    if os.environ.get("HF_TOKEN") and "token" not in hub:  # as `lm-eval run` does, for push_*_to_hub
        hub["token"] = os.environ["HF_TOKEN"]
    tracker = EvaluationTracker(**hub)
    loggers = _loggers(wandb_args, wandb_config_args, trackio_args)
    lm = model if isinstance(model, LopaFastLM) else None
    if lm is not None:  # the recorded model_args name the model directory (lm-eval's output subdirectory)
        model_args = {"pretrained": lm.path, **(model_args or {})}
        lm.records.clear()  # the stats are this run's
    results = simple_evaluate(model=model, model_args=model_args, tasks=tasks, log_samples=log_samples,
                              evaluation_tracker=tracker, **simple_evaluate_kwargs)
    if results is None:
        return None
    samples = results.pop("samples", None) if log_samples else None
    summary = None
    if lm is not None:  # generate_until totals, and the loglikelihood estimator's settings (defaults included)
        summary = results["lopa_fast"] = lm.summary()
    if show_config:
        print(json.dumps(results, indent=2, default=handle_non_serializable, ensure_ascii=False))
    _log_results(loggers, results, samples)
    tracker.save_results_aggregated(results=results, samples=samples)
    if samples is not None:
        for task_name in results["configs"]:
            tracker.save_results_samples(task_name=task_name, samples=samples[task_name])
    if tracker.push_results_to_hub or tracker.push_samples_to_hub:
        tracker.recreate_metadata_card()
    name = "lopa_fast" if lm is not None else results["config"]["model"]
    print(f"{name} ({model_args}), limit: {simple_evaluate_kwargs.get('limit')}, "
          f"num_fewshot: {simple_evaluate_kwargs.get('num_fewshot')}")
    print(make_table(results))
    if "groups" in results:
        print(make_table(results, "groups"))
    if summary is not None:
        t = summary["total"]
        print(f"lopa_fast: {t['requests']} generate_until requests, {t['generated_tokens']} tokens, "
              f"{t['forwards']} forwards, TPF {t['tpf']:.2f}")
        if output_path:
            path = _results_dir(tracker) / f"lopa_fast_stats_{tracker.date_id}.json"
            path.write_text(json.dumps(dict(summary, requests=lm.records), indent=2))
            print(f"lopa_fast: wrote {path}")
    for lg in loggers:
        (lg.finish if hasattr(lg, "finish") else lg.run.finish)()  # TrackioLogger.finish; W&B: its run's
    return results


def _loggers(wandb_args, wandb_config_args, trackio_args) -> list:
    """lm-eval's W&B / Trackio loggers for the flags given, created before the run as `lm-eval run` creates them."""
    from lm_eval.loggers import TrackioLogger, WandbLogger

    out = [WandbLogger(wandb_args, wandb_config_args or {})] if wandb_args else []
    return out + ([TrackioLogger(trackio_args)] if trackio_args else [])


def _log_results(loggers: list, results: dict, samples) -> None:
    """Each logger's results (and samples) as `lm-eval run` logs them: a failure is logged, never fatal."""
    for lg in loggers:
        try:
            lg.post_init(results)
            lg.log_eval_result()
            if samples is not None:
                lg.log_eval_samples(samples)
        except Exception as e:  # noqa: BLE001
            logging.getLogger(__name__).info("lopa_fast: logging to %s failed: %s", type(lg).__name__, e)


# what a user's input raises from lm-eval's configuration, the model's arguments and the task's data (a misspelt
# model arg, block_size=0, a task not found, a data file not where the task YAML says): one line, exit 2
USER_ERRORS = (TypeError, ValueError, FileNotFoundError)


class LmEvalInputError(LopaError, ValueError):
    """A user's lm-eval input refused (`one_line`): the CLI prints it as one line, exit 2, as every LopaError."""


def one_line(where: str, fn, *args, **kwargs):
    """fn(*args, **kwargs), its USER_ERRORS raised again as one CLI error line `where: message` (the first line of
    the message; a FileNotFoundError also names the working directory, which relative data_files are read from)."""
    try:
        return fn(*args, **kwargs)
    except LopaError:
        raise
    except USER_ERRORS as e:
        msg = (str(e).strip().splitlines() or [type(e).__name__])[0]
        if isinstance(e, FileNotFoundError):
            msg += f" (relative data_files are read from the working directory {os.getcwd()})"
        raise LmEvalInputError(f"{where}: {msg}") from e


def _run(args) -> int:
    """`lm-eval run` with the parsed flags: lm-eval's EvaluatorConfig (defaults, --config YAML, checks), the
    `lopa_fast` model built as an instance, then `evaluate`."""
    from lm_eval.config.evaluate_config import EvaluatorConfig

    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # as lm-eval's run does
    log = logging.getLogger(__name__)
    with logs.step(log, "reading lm-eval's configuration", "read lm-eval's configuration", long=False):
        cfg = one_line("lm-eval", EvaluatorConfig.from_cli, args)
    if cfg.model == "lopa_fast":  # a model_arg wins over the flag of the same name
        # --device unnamed: lm-eval's default cuda:0 is not asked for; the model's own default (cuda when
        # available, else the CPU, without a warning) applies
        named = getattr(args, "device", None) is not None or cfg.device != LM_EVAL_DEFAULT_DEVICE
        flags = {"batch_size": cfg.batch_size, "max_batch_size": cfg.max_batch_size,
                 "device": cfg.device if named else None}
        with logs.step(log, "loading the model", "loaded the model", long=False):
            model = one_line("lm-eval --model_args", LopaFastLM.create_from_arg_obj, cfg.model_args,
                             {k: v for k, v in flags.items() if k not in cfg.model_args})
    else:  # another lm-eval model: lm-eval builds it
        model = cfg.model
    seed = cfg.seed or [None] * 4
    with logs.step(log, "indexing lm-eval's tasks", "indexed lm-eval's tasks", long=False):
        tasks = one_line("lm-eval --tasks", cfg.process_tasks, cfg.metadata)
    one_line("lm-eval", evaluate, model, cfg.tasks, output_path=cfg.output_path, log_samples=cfg.log_samples,
             model_args=cfg.model_args,
             hf_hub_log_args=cfg.hf_hub_log_args, wandb_args=cfg.wandb_args, wandb_config_args=cfg.wandb_config_args,
             trackio_args=cfg.trackio_args, show_config=cfg.show_config, num_fewshot=cfg.num_fewshot,
             batch_size=cfg.batch_size, max_batch_size=cfg.max_batch_size,
             device=str(model._device) if isinstance(model, LopaFastLM) else cfg.device,
             use_cache=cfg.use_cache, cache_requests=cfg.cache_requests.get("cache_requests", False),
             rewrite_requests_cache=cfg.cache_requests.get("rewrite_requests_cache", False),
             delete_requests_cache=cfg.cache_requests.get("delete_requests_cache", False), limit=cfg.limit,
             samples=cfg.samples, check_integrity=cfg.check_integrity, write_out=cfg.write_out,
             system_instruction=cfg.system_instruction, apply_chat_template=cfg.apply_chat_template,
             fewshot_as_multiturn=cfg.fewshot_as_multiturn, gen_kwargs=cfg.gen_kwargs,
             task_manager=tasks, predict_only=cfg.predict_only, random_seed=seed[0],
             numpy_random_seed=seed[1], torch_random_seed=seed[2], fewshot_random_seed=seed[3],
             confirm_run_unsafe_code=cfg.confirm_run_unsafe_code, metadata=cfg.metadata)
    return 0


def prepare() -> None:
    """Import what `main` needs (lm-eval's command line, its evaluator, torch): the slow part of a start, done
    under the CLI's progress line."""
    import lm_eval._cli  # noqa: F401
    import lm_eval.evaluator  # noqa: F401
    import torch  # noqa: F401


def main(argv: list[str]) -> int:
    """`python -m lopa_fast lm-eval ARGS`: ARGS parsed by lm-eval's own command-line parser (its `run`, `ls`,
    `validate`; flags without a subcommand mean `run`, as in `lm-eval`); `run` goes through `_run` (the Python
    API), the others run as lm-eval runs them."""
    from lm_eval._cli import HarnessCLI

    cli = HarnessCLI()
    argv = list(argv)
    if len(argv) > 1 and argv[0] not in cli._subparsers.choices:  # lm-eval's legacy rule (HarnessCLI.parse_args)
        argv.insert(0, "run")
    elif argv == ["run"]:  # a bare `run`: its help, as lm-eval prints it
        argv.append("--help")
    named = any(a in ("--model", "-M", "--config", "-C") or a.startswith(("--model=", "--config=")) for a in argv)
    if argv and argv[0] == "run" and not named:
        argv[1:1] = ["--model", "lopa_fast"]  # under `python -m lopa_fast lm-eval` the model is lopa_fast's
    args = cli._parser.parse_args(argv)
    if args.command != "run":
        cli.execute(args)
        return 0
    return _run(args)
