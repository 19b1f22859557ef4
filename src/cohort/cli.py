"""`cohort demo | train | rm | sft | eval | sample | generate | chat | merge | report | config | serve`: the command-line entry points."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Callable
from pathlib import Path

from cohort.commands.arguments import build_parser


def _cmd_demo(args: argparse.Namespace) -> int:
    from cohort.commands.demo import run_demo

    _check_output(args.out, folder=True)
    run_demo(args.out, steps=args.steps, seed=args.seed, progress=not args.no_progress)
    return 0


def _train_config(args: argparse.Namespace):
    """Returns the TrainConfig of a `train` / `doctor` command line: an optional YAML file, then overrides."""
    from cohort.config import load_config

    config, overrides = args.config, list(args.overrides)
    if config is not None and "=" in config and not Path(config).is_file():
        config, overrides = None, [config, *overrides]  # only overrides were given
    return load_config(config, overrides)


def _cmd_train(args: argparse.Namespace) -> int:
    from cohort.trainer import GRPOTrainer

    trainer = GRPOTrainer(_train_config(args))
    summary = trainer.train()
    final = trainer.save_final()
    summary["final_model"] = str(final)
    from cohort.runtime import distributed as dist

    if dist.is_main():  # under torchrun, one summary rather than one per process
        print(json.dumps({k: v for k, v in summary.items()}, indent=2, default=str))
    dist.shutdown()
    return 0


def _cmd_doctor(args: argparse.Namespace) -> int:
    from cohort.commands.doctor import run_doctor

    if args.groups < 1:
        raise ValueError(f"--groups {args.groups} must be >= 1")
    return run_doctor(lambda: _train_config(args), groups=args.groups)


def _cmd_pipeline(args: argparse.Namespace) -> int:
    from cohort.commands.pipeline import load_pipeline, run_pipeline

    results = run_pipeline(load_pipeline(args.config), run=main)
    print(json.dumps(results, indent=2))
    return 0


def _check_output(path: str | None, flag: str = "--out", *, folder: bool = False) -> None:
    """Raises ValueError before any model loads when `path` cannot be written as a file (or a folder)."""
    if path is None:
        return
    out = Path(path).expanduser()
    if folder and out.exists() and not out.is_dir():
        raise ValueError(f"{flag} {path} is a file; pass a folder to save the model in")
    if not folder and out.is_dir():
        raise ValueError(f"{flag} {path} is a folder; pass a file name, e.g. {out / 'out.jsonl'}")
    existing = next((p for p in out.parents if p.exists()), None)
    if existing is not None and not existing.is_dir():
        raise ValueError(f"{flag} {path} sits under {existing}, which is a file; choose another path")
    if existing is not None and not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"{flag} {path} cannot be written ({existing} is not writable); choose another path")


def _created_folders(path: str | os.PathLike) -> str:
    """Returns "" when `path`'s folder exists, else "; created the folder F" after creating it (and any missing
    parents: F is the first that was missing), so a command never makes folders without saying so."""
    parent = Path(path).expanduser().absolute().parent
    missing = [p for p in (parent, *parent.parents) if not p.exists()]
    if not missing:
        return ""
    parent.mkdir(parents=True, exist_ok=True)
    return f"; created the folder {missing[-1]}"


def _write_lines(path: str | os.PathLike, lines: list[str]) -> str:
    """Returns the note of `_created_folders` after writing `lines` to `path` whole or not at all (a temporary
    file renamed over it), so a failed write leaves the file that was there."""
    from cohort.errors import disk_full_named

    note = _created_folders(path)
    out = Path(path).expanduser()
    tmp = out.with_name(f".{out.name}.tmp")
    fix = "free some space there or pass another --out; an earlier file there is intact"
    with disk_full_named(out.parent, out.name, fix):
        try:
            with open(tmp, "w", encoding="utf-8") as f:
                f.writelines(lines)
            tmp.replace(out)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
    return note


_TASK_SPLITS = {"train": False, "test": True, "eval": True, "held-out": True}
"""--split values a built-in task understands, and whether each means its held-out problems."""


_DATA_NEEDS = {
    "sft": "SFT needs at least one prompt/completion pair to train on",
    "eval": "`cohort eval` needs at least one prompt to evaluate on",
    "sample": "`cohort sample` needs at least one prompt to sample from",
}
"""What each command's --data is for, said when it has no rows."""


def _model_and_rows(args: argparse.Namespace, *, need_completion: bool = False, reward=None):
    """Return (tokenizer, model, rows) for the sft / eval / sample commands, checking data first.

    `reward`: the reward function the command scores with; its dataset columns are checked before the model
    loads."""
    from cohort.data import load_rows, make_task, sft_completion
    from cohort.models import is_adapter_folder, load_model, load_tokenizer
    from cohort.rewards import check_reward_columns

    if need_completion and is_adapter_folder(args.model):
        raise ValueError(
            f"{args.model} is a LoRA adapter folder; merge it into its base model first "
            "(cohort merge ADAPTER OUT) and fine-tune the merged folder"
        )
    if args.task:
        split = getattr(args, "split", "train")
        if split not in _TASK_SPLITS:
            raise ValueError(
                f"--split {split}: a built-in task has the splits {', '.join(_TASK_SPLITS)}; "
                "pass --split test for its held-out problems"
            )
        train, held = make_task(args.task, n_train=args.n, n_eval=args.n, seed=args.task_seed)
        rows = held if _TASK_SPLITS[split] else train
        if need_completion:
            rows = [{**r, args.completion_column: sft_completion(args.task, r)} for r in rows]
    elif args.data:
        rows = load_rows(
            args.data, split=args.split, prompt_column=args.prompt_column, need=_DATA_NEEDS[args.command]
        )
        if args.n:
            rows = rows[: args.n]
    else:
        raise ValueError(
            "give --task NAME (addition, multistep, code, multiply) or --data FILE.jsonl / dataset name"
        )
    if need_completion and args.completion_column not in rows[0]:
        raise ValueError(
            f"SFT data needs a {args.completion_column!r} column; found {sorted(rows[0])}. "
            "Pass --completion-column NAME"
        )
    if reward is not None:
        where = f"--data {args.data}" if args.data else f"the {args.task} task"
        check_reward_columns([reward], [c for c in rows[0] if c != args.prompt_column], where=where)
    tokenizer = load_tokenizer(args.model)
    model = load_model(args.model, dtype=args.dtype, device=args.device)
    return tokenizer, model, rows


def _fit_completion_length(model, prompt_ids: list[list[int]], max_new: int) -> int:
    """Returns --max-completion-length, lowered (with a note) so that every prompt plus its completion fits the
    model's context; raises ValueError naming the first prompt that leaves no room at all."""
    from cohort.commands.evaluation import fit_completion_length

    return fit_completion_length(model, prompt_ids, max_new)


def _engine(args: argparse.Namespace, model, tokenizer):
    """Return the rollout engine named by --engine, stopping at the model's EOS tokens."""
    from cohort.models import stop_token_ids
    from cohort.rollout import make_engine

    eos_ids, pad = stop_token_ids(model, tokenizer)
    return make_engine(args.engine, eos_token_ids=eos_ids, pad_token_id=pad)


def _cmd_sft(args: argparse.Namespace) -> int:
    from cohort.commands.sft import SFTConfig, check_output_folder, encode_pairs, sft_train
    from cohort.data import encode_prompts

    _check_output(args.out, folder=True)
    check_output_folder(args.out, args.model)
    tokenizer, model, rows = _model_and_rows(args, need_completion=True)
    prompt_ids = encode_prompts(tokenizer, [r[args.prompt_column] for r in rows])
    pairs = encode_pairs(tokenizer, prompt_ids, [str(r[args.completion_column]) for r in rows])
    cfg = SFTConfig(steps=args.steps, batch_size=args.batch_size, seed=args.seed)
    cfg.optim.lr = args.lr
    sft_train(model, pairs, cfg, log=lambda row: print(json.dumps(row)))
    out = Path(args.out)
    note = _created_folders(out / "config.json")
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    print(f"saved the fine-tuned model to {out}{note}")
    return 0


def _cmd_rm(args: argparse.Namespace) -> int:
    from cohort.commands.rm import RMConfig, train_reward_model

    _check_output(args.out, folder=True)
    cfg = RMConfig(
        model=args.model,
        data=args.data,
        eval_data=args.eval_data,
        eval_fraction=args.eval_fraction,
        out_dir=args.out,
        steps=args.steps,
        batch_size=args.batch_size,
        max_length=args.max_length,
        seed=args.seed,
        eval_every=args.eval_every,
        save_every=args.save_every,
        prompt_column=args.prompt_column,
    )
    cfg.optim.lr, cfg.optim.warmup_steps = args.lr, args.warmup_steps
    cfg.validate()
    for path, flag in ((cfg.data, "--data"), (cfg.eval_data, "--eval-data")):
        if path and Path(path).suffix in (".jsonl", ".json") and not Path(path).is_file():
            raise ValueError(f"{flag} {path!r} does not exist; give a JSONL file or a `datasets` name")
    train_reward_model(cfg)
    return 0


def _cmd_eval(args: argparse.Namespace) -> int:
    import torch

    from cohort.commands.evaluation import evaluate
    from cohort.data import encode_prompts
    from cohort.models import input_device
    from cohort.rewards import resolve_reward_funcs

    reward = resolve_reward_funcs([args.reward])[0]
    tokenizer, model, rows = _model_and_rows(args, reward=reward)
    engine = _engine(args, model, tokenizer)
    prompt_ids = encode_prompts(tokenizer, [r[args.prompt_column] for r in rows])
    args.max_completion_length = _fit_completion_length(model, prompt_ids, args.max_completion_length)

    result = evaluate(
        model,
        tokenizer,
        rows,
        reward,
        prompt_ids=prompt_ids,
        engine=engine,
        max_completion_length=args.max_completion_length,
        prompt_column=args.prompt_column,
        k=args.k,
        temperature=args.temperature,
        generator=torch.Generator(device=input_device(model)).manual_seed(args.seed),  # the engine's device
    )
    print(json.dumps(result, indent=2))
    return 0


def _cmd_sample(args: argparse.Namespace) -> int:
    import torch

    from cohort.data import as_completions, encode_prompts
    from cohort.models import input_device
    from cohort.rewards import resolve_reward_funcs, score
    from cohort.rollout import SamplingParams

    _check_output(args.out)
    reward = resolve_reward_funcs([args.reward])[0]
    tokenizer, model, rows = _model_and_rows(args, reward=reward)
    engine = _engine(args, model, tokenizer)
    prompt_ids = encode_prompts(tokenizer, [r[args.prompt_column] for r in rows])
    args.max_completion_length = _fit_completion_length(model, prompt_ids, args.max_completion_length)
    gen = torch.Generator(device=input_device(model)).manual_seed(args.seed)  # the engine's device
    params = SamplingParams(max_completion_length=args.max_completion_length, temperature=args.temperature)
    kept: list[str] = []
    for start in range(0, len(rows), 32):
        chunk = rows[start : start + 32]
        batch = engine.generate(model, prompt_ids[start : start + 32], args.k, params, gen)
        texts = tokenizer.batch_decode(batch.completion_ids, skip_special_tokens=True)
        cols = {c: [r[c] for r in chunk for _ in range(args.k)] for c in chunk[0] if c != args.prompt_column}
        rewards = score(
            [reward],
            prompts=[r[args.prompt_column] for r in chunk for _ in range(args.k)],
            completions=as_completions(texts, chunk[0][args.prompt_column]),
            completion_ids=batch.completion_ids,
            columns=cols,
        )[:, 0]
        for j, row in enumerate(chunk):
            for i in range(j * args.k, (j + 1) * args.k):
                if float(rewards[i]) >= args.threshold:
                    kept.append(json.dumps({**row, "completion": texts[i]}) + "\n")
                    break  # one accepted completion per prompt
    note = _write_lines(args.out, kept)
    what = (
        f"wrote them to {args.out}"
        if kept
        else f"wrote {args.out} with no rows (lower --threshold or raise --k to keep some)"
    )
    print(
        f"kept {len(kept)} of {len(rows)} prompts with a completion scoring >= {args.threshold}; {what}{note}"
    )
    return 0


def _sampling_params(args: argparse.Namespace):
    """Returns the SamplingParams of the generate / chat flags, after checking them (ValueError: exit code 2)."""
    from cohort.rollout import SamplingParams

    if not math.isfinite(args.temperature) or (args.temperature <= 0 and not args.greedy):
        raise ValueError(
            f"--temperature must be a finite number > 0, got {args.temperature:g}; "
            "pass --greedy for argmax decoding"
        )
    if not 0.0 < args.top_p <= 1.0:
        raise ValueError(f"--top-p must be in (0, 1], got {args.top_p:g}; 1 switches it off")
    if args.top_k < 0:
        raise ValueError(f"--top-k must be >= 0, got {args.top_k}; 0 switches it off")
    return SamplingParams(
        max_completion_length=args.max_new_tokens,
        temperature=args.temperature if args.temperature > 0 else 1.0,
        top_p=args.top_p,
        top_k=args.top_k,
        greedy=args.greedy,
    )


def _cmd_generate(args: argparse.Namespace) -> int:
    from cohort.commands.generate import CHAT_TEMPLATE_MODES, generate_rows, read_prompts
    from cohort.models import load_model, load_tokenizer

    if args.prompt and args.prompts:
        raise ValueError("give either --prompt TEXT (repeatable) or --prompts FILE, not both")
    if not args.prompt and not args.prompts:
        raise ValueError(
            "no prompt given; pass --prompt TEXT (repeatable) or --prompts FILE (.txt, .jsonl, .json)"
        )
    if args.prompt and not all(p.strip() for p in args.prompt):
        raise ValueError("--prompt got an empty text; every prompt needs at least one character")
    params = _sampling_params(args)
    _check_output(args.out)
    prompts = args.prompt or read_prompts(args.prompts, prompt_column=args.prompt_column)
    tokenizer = load_tokenizer(args.model)
    chat_template = CHAT_TEMPLATE_MODES[args.chat_template]
    if chat_template and getattr(tokenizer, "chat_template", None) is None:
        raise ValueError(
            f"--chat-template on, but the tokenizer of {args.model} has no chat template; use off"
        )
    model = load_model(args.model, dtype=args.dtype, device=args.device)
    rows = generate_rows(
        model, tokenizer, prompts, params, n=args.n, seed=args.seed, chat_template=chat_template
    )
    lines = [json.dumps(row, ensure_ascii=False) + "\n" for row in rows]
    if args.out is None:
        sys.stdout.writelines(lines)
        return 0
    note = _write_lines(args.out, lines)
    print(f"wrote {len(rows)} row(s), {args.n} completion(s) each, to {args.out}{note}")
    return 0


def _cmd_chat(args: argparse.Namespace) -> int:
    from cohort.commands.generate import ChatSession, chat_loop
    from cohort.models import load_model, load_tokenizer

    params = _sampling_params(args)
    tokenizer = load_tokenizer(args.model)
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError(
            f"the tokenizer of {args.model} has no chat template, which `cohort chat` needs; "
            f"use `cohort generate --model {args.model} --prompt TEXT` for plain-text prompts"
        )
    model = load_model(args.model, dtype=args.dtype, device=args.device)
    session = ChatSession(model, tokenizer, params, system=args.system, seed=args.seed)
    if sys.stdin.isatty():
        try:
            import readline  # noqa: F401  (line editing and history for input())
        except ImportError:
            pass
    return chat_loop(session, write=lambda line: print(line, flush=True), show_prompt=args.show_prompt)


_VLLM_FLAGS = (
    "gpu_memory_utilization",
    "tensor_parallel_size",
    "max_model_len",
    "enable_prefix_caching",
    "enforce_eager",
    "seed",
)
"""`cohort serve` flags that configure vLLM (cohort.serve.vllm_backend.VLLMOptions fields of the same name)."""


def _cmd_serve(args: argparse.Namespace) -> int:
    from cohort.models import resolve_device
    from cohort.serve.worker import serve

    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port {args.port} must be in 0 .. 65535 (0: a free port, printed on start)")
    given = {k: getattr(args, k) for k in _VLLM_FLAGS if getattr(args, k) is not None}
    options = None
    if args.engine == "vllm":
        from cohort.choices import VLLM_SEED_MAX
        from cohort.serve.vllm_backend import VLLMOptions

        for flag, value in (("--device", args.device), ("--attn-implementation", args.attn_implementation)):
            if value is not None:
                raise ValueError(
                    f"{flag} is for --engine builtin; vLLM chooses its own (its GPUs are those "
                    "CUDA_VISIBLE_DEVICES shows, its attention kernels its own): drop it"
                )
        share = given.get("gpu_memory_utilization")
        if share is not None and not 0 < share <= 1:
            raise ValueError(
                f"--gpu-memory-utilization {share} must be in (0, 1]: a share of each GPU's memory"
            )
        seed = given.get("seed")
        if seed is not None and not 0 <= seed <= VLLM_SEED_MAX:
            raise ValueError(
                f"--seed {seed} must be in 0 .. {VLLM_SEED_MAX} (2**32 - 1): vLLM's engine seeds"
            )
        options = VLLMOptions(**given)
    elif given:
        flag = "--" + next(iter(given)).replace("_", "-")
        raise ValueError(f"{flag} configures vLLM: add --engine vllm, or drop it")
    return serve(
        args.model,
        host=args.host,
        port=args.port,
        device=str(resolve_device(args.device or "cpu", "--device")),
        dtype=args.dtype,
        attn_implementation=args.attn_implementation or "sdpa",
        threads=args.threads,
        parent_pid=args.parent_pid,
        engine=args.engine,
        vllm_options=options,
    )


def _cmd_config(args: argparse.Namespace) -> int:
    from cohort.config import describe_keys

    if getattr(args, "presets", False):
        from cohort.config.presets import describe_presets

        print("\n".join(describe_presets()))
        return 0
    rows = [row for row in describe_keys() if row[0].startswith(args.prefix)]
    if not rows:
        print(
            f"error: no config key starts with {args.prefix!r}; run `cohort config` for all", file=sys.stderr
        )
        return 2
    for key, default, doc in rows:
        print(f"{key} = {default!r}\n    {' '.join(doc.split())}")
    return 0


def _cmd_merge(args: argparse.Namespace) -> int:
    from cohort.commands.sft import check_output_folder
    from cohort.models import is_adapter_folder, load_model, load_tokenizer, run_dir_hint, save_merged

    if not Path(args.adapter).expanduser().exists():
        raise ValueError(
            f"{args.adapter} does not exist; pass the LoRA adapter folder of a run (its final folder)"
        )
    if not is_adapter_folder(args.adapter):
        raise ValueError(
            f"{args.adapter} is not a LoRA adapter folder (it holds no adapter_config.json){run_dir_hint(args.adapter)}"
        )
    _check_output(args.out, "OUT", folder=True)
    check_output_folder(args.out, args.adapter, flag="OUT", made="the merged model", read="adapter folder")
    tokenizer = load_tokenizer(args.adapter)
    model = load_model(args.adapter, dtype=args.dtype)
    note = _created_folders(Path(args.out) / "config.json")
    print(f"saved the merged model to {save_merged(model, tokenizer, args.out)}{note}")
    return 0


def _cmd_report(args: argparse.Namespace) -> int:
    from cohort.report import write_comparison, write_report

    if args.groups < 0:
        raise ValueError(f"--groups {args.groups} must be >= 0")
    if len(args.run_dirs) == 1:
        if args.out is not None:
            raise ValueError("--out is for comparing several runs; one run's report is RUN_DIR/report.html")
        print(write_report(args.run_dirs[0], title=args.title, max_groups=args.groups))
        return 0
    out = args.out or "compare.html"
    note = ""
    if not Path(out).is_dir():  # a folder gets compare.html inside
        _check_output(out)
        note = _created_folders(out)
    print(write_comparison(args.run_dirs, out, title=args.title))
    if note:  # standard output holds the page's path alone
        print(note.removeprefix("; "), file=sys.stderr)
    return 0


COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "demo": _cmd_demo,
    "train": _cmd_train,
    "doctor": _cmd_doctor,
    "pipeline": _cmd_pipeline,
    "rm": _cmd_rm,
    "sft": _cmd_sft,
    "eval": _cmd_eval,
    "sample": _cmd_sample,
    "generate": _cmd_generate,
    "chat": _cmd_chat,
    "merge": _cmd_merge,
    "report": _cmd_report,
    "config": _cmd_config,
    "serve": _cmd_serve,
}
"""Each sub-command of cohort.commands.arguments' parser and the function that runs it."""


def main(argv: list[str] | None = None) -> int:
    """Run the `cohort` command line and return its exit code."""
    args = build_parser().parse_args(argv)
    from cohort.errors import ConfigError, ReportedElsewhere, TrainingError
    from cohort.fastpath import FastPathError
    from cohort.report.progress import quiet_hf_progress
    from cohort.runtime.rundir import RunLockedError

    try:
        # cohort prints its own lines; transformers' load and save bars broke them up
        with quiet_hf_progress():
            code = COMMANDS[args.command](args)
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            from cohort.runtime.distributed import exit_without_teardown

            exit_without_teardown(code)
        return code
    except KeyboardInterrupt as e:
        print(f"\ninterrupted: {e}" if str(e) else "\ninterrupted", file=sys.stderr)
        return 128 + int(getattr(e, "signal", None) or 2)  # 130 for Ctrl-C, 143 for SIGTERM, as shells report
    except ReportedElsewhere:  # process 0 of the group prints the failure, once
        return 1
    except ImportError as e:
        if (e.name or "").split(".")[0] == "cohort":
            raise  # a name missing inside cohort is cohort's bug: the traceback is for it
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (ConfigError, FileNotFoundError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except FastPathError as e:  # a fast path switched on that this model cannot take: a config choice
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (TrainingError, RunLockedError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
