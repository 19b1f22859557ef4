"""The `cohort` command line's arguments: one parser with a sub-command per command, and nothing that runs.

:mod:`cohort.cli` dispatches a parsed command line to its command by name (``args.command``);
:mod:`cohort.commands.pipeline` parses a stage's arguments with the same parser to check them before any stage
runs. Both import this module, so neither imports the other for it.
"""

from __future__ import annotations

import argparse
import math

from cohort import __version__
from cohort.choices import ENGINES, VLLM_GPU_MEMORY_UTILIZATION

__all__ = ["build_parser"]


def _positive_int(text: str) -> int:
    """Returns text as an int >= 1 (argparse turns the ValueError into a one-line usage error)."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text} must be an integer >= 1")
    return value


def _finite_float(minimum: float, strict: bool):
    """Returns an argparse type: a finite float > minimum (strict) or >= minimum."""

    def parse(text: str) -> float:
        value = float(text)
        if not math.isfinite(value) or value < minimum or (strict and value == minimum):
            bound = "" if minimum == -math.inf else f" {'>' if strict else '>='} {minimum:g}"
            raise argparse.ArgumentTypeError(f"{text} must be a finite number{bound}")
        return value

    parse.__name__ = "number"
    return parse


def _data_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        required=True,
        help="local model folder, LoRA adapter folder (adapter_config.json) or hub name",
    )
    p.add_argument("--task", help="built-in task: addition or multistep")
    p.add_argument("--data", help="JSONL file or `datasets` name with a prompt column")
    p.add_argument(
        "--split", default="train", help="dataset split (or 'test' for a built-in task's held-out set)"
    )
    p.add_argument("--prompt-column", default="prompt")
    p.add_argument(
        "--n", type=_positive_int, default=200, help="rows to use (built-in tasks generate this many)"
    )
    p.add_argument("--task-seed", type=int, default=1234)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--device", default="cpu")
    p.add_argument("--seed", type=int, default=0)


def _talk_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        required=True,
        help="local model folder, LoRA adapter folder (adapter_config.json) or hub name",
    )
    p.add_argument("--max-new-tokens", type=_positive_int, default=256, help="most new tokens per reply")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (> 0)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1 = off)")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (0 = off)")
    p.add_argument(
        "--greedy", action="store_true", help="argmax decoding (temperature, top-p, top-k ignored)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--device", default="cpu")


def build_parser() -> argparse.ArgumentParser:
    """Return the argument parser of the `cohort` command."""
    parser = argparse.ArgumentParser(
        prog="cohort", description="GRPO-family training for Hugging Face causal LMs."
    )
    parser.add_argument("--version", action="version", version=f"cohort {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser(
        "demo", help="build a tiny model, warm-start it, GRPO-train it on CPU, report before/after"
    )
    p.add_argument("--out", default="runs/demo", help="run directory (default runs/demo)")
    p.add_argument(
        "--steps", type=_positive_int, default=None, help="GRPO steps (default: the tuned recipe's)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-progress", action="store_true", help="no progress bar or step lines")

    p = sub.add_parser(
        "train",
        help="GRPO training from a YAML config plus key=value overrides",
        epilog="Every key, its default and what it does: `cohort config` (or `cohort config algo.` for one section).",
    )
    p.add_argument(
        "config", nargs="?", help="YAML config file (optional when every key is given as override)"
    )
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. algo.beta=0.04 rollout.group_size=16")

    p = sub.add_parser(
        "doctor",
        help="rehearse a training config in a minute: load, sample a few groups, score, one update, report",
        description="Loads the model and data of CONFIG, samples a few groups, scores them, takes one update on "
        "a copy and reports what would go wrong (exit code 1 on a blocking problem). Nothing is written to "
        "out_dir.",
    )
    p.add_argument(
        "config", nargs="?", help="YAML config file (optional when every key is given as override)"
    )
    p.add_argument("overrides", nargs="*", help="dotted overrides, as for `cohort train`")
    p.add_argument("--groups", type=int, default=4, help="groups to sample (default 4)")

    p = sub.add_parser(
        "pipeline",
        help="run the R1 recipe's stages (sft, train, sample, ...) from one YAML file, each stage resumable",
        description="Runs each stage of the pipeline file in its own folder under out_dir, skipping stages that "
        "finished; a killed train stage resumes from its checkpoint. See cohort.commands.pipeline for the file format.",
    )
    p.add_argument("config", help="pipeline YAML file (out_dir, model, stages)")

    p = sub.add_parser(
        "rm",
        help="train a reward model: pairwise (prompt/chosen/rejected) or pointwise (prompt/completion/label)",
    )
    p.add_argument(
        "--model", required=True, help="causal LM (a score head is added) or reward model to start from"
    )
    p.add_argument("--data", required=True, help="JSONL file or `datasets` name")
    p.add_argument("--eval-data", default=None, help="held-out examples (default: --eval-fraction of --data)")
    p.add_argument("--eval-fraction", type=_finite_float(0.0, strict=True), default=0.1)
    p.add_argument("--prompt-column", default="prompt")
    p.add_argument("--steps", type=_positive_int, default=200)
    p.add_argument("--batch-size", type=_positive_int, default=16)
    p.add_argument("--lr", type=_finite_float(0.0, strict=True), default=1e-4)
    p.add_argument("--warmup-steps", type=int, default=10)
    p.add_argument("--max-length", type=_positive_int, default=1024)
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--save-every", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True, help="run directory (the model goes to OUT/model; reruns resume)")

    p = sub.add_parser("sft", help="supervised fine-tuning on prompt/completion pairs (cold start)")
    _data_args(p)
    p.add_argument("--completion-column", default="completion")
    p.add_argument("--steps", type=_positive_int, default=200)
    p.add_argument("--batch-size", type=_positive_int, default=32)
    p.add_argument("--lr", type=_finite_float(0.0, strict=True), default=1e-4)
    p.add_argument("--out", required=True, help="folder for the fine-tuned model")

    for name, helptext in (
        (
            "eval",
            "greedy accuracy, pass@k and maj@k on a dataset's prompts (--split test: a task's held-out set)",
        ),
        ("sample", "rejection sampling: keep completions that pass a reward, as SFT data (JSONL)"),
    ):
        p = sub.add_parser(name, help=helptext)
        _data_args(p)
        p.add_argument("--reward", default="accuracy", help="reward function deciding correctness")
        p.add_argument(
            "--k", type=_positive_int, default=1 if name == "eval" else 4, help="samples per prompt"
        )
        p.add_argument("--temperature", type=_finite_float(0.0, strict=True), default=1.0)
        p.add_argument("--max-completion-length", type=_positive_int, default=256)
        p.add_argument("--engine", default="builtin", choices=ENGINES)
        if name == "sample":
            p.add_argument("--threshold", type=_finite_float(-math.inf, strict=False), default=1.0)
            p.add_argument("--out", required=True, help="JSONL file to write")

    p = sub.add_parser(
        "generate",
        help="sample completions for prompts given on the command line or in a file; JSONL out",
    )
    _talk_args(p)
    p.add_argument("--prompt", action="append", default=[], help="a prompt (repeat for several)")
    p.add_argument("--prompts", help="file of prompts: .txt (one per line) or .jsonl / .json (prompt column)")
    p.add_argument("--prompt-column", default="prompt", help="prompt column of a .jsonl / .json file")
    p.add_argument("--out", help="JSONL file to write (default: standard output)")
    p.add_argument("--n", type=_positive_int, default=1, help="completions per prompt")
    p.add_argument(
        "--chat-template",
        choices=("auto", "on", "off"),
        default="auto",
        help="auto: chat messages through the template, plain text as is; on: plain text too; off: never",
    )

    p = sub.add_parser("chat", help="talk to a model in the terminal, through its chat template")
    _talk_args(p)
    p.add_argument("--system", help="system message at the start of the conversation")
    p.add_argument(
        "--show-prompt", action="store_true", help="print the templated prompt of each reply (debugging)"
    )

    p = sub.add_parser(
        "merge", help="merge a LoRA adapter folder into its base model: a plain save_pretrained folder"
    )
    p.add_argument("adapter", help="adapter folder (a LoRA checkpoint or final folder of a run)")
    p.add_argument("out", help="folder for the merged model and tokenizer")
    p.add_argument("--dtype", default="auto", help="dtype of the merged weights (default: the base model's)")

    p = sub.add_parser(
        "report",
        help="rebuild RUN_DIR/report.html from its logs, or overlay several runs on one page",
        description="One run: writes RUN_DIR/report.html. Several: writes one page overlaying their curves, "
        "with their summaries and config differences side by side (--out, default compare.html).",
    )
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directories (the out_dir of each run)")
    p.add_argument("--out", help="file for the comparison page of several runs (default: compare.html)")
    p.add_argument("--title", help="page title")
    p.add_argument(
        "--groups", type=int, default=12, help="sample groups shown in a single run's report (default 12)"
    )

    p = sub.add_parser(
        "serve",
        help="a rollout worker: sample completions for a trainer (rollout.workers) on this model's own copy",
        description="Loads the model and answers a trainer's generate requests on a ZeroMQ socket; the trainer "
        "pushes its weights after every optimizer step. See docs/serving.md (and docs/vllm.md for --engine vllm).",
    )
    p.add_argument(
        "--model", required=True, help="model folder or hub name (the trainer's model.name_or_path)"
    )
    p.add_argument(
        "--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)"
    )
    p.add_argument("--port", type=int, default=5555, help="port to listen on (default 5555; 0: a free one)")
    p.add_argument(
        "--engine",
        choices=("builtin", "vllm"),
        default="builtin",
        help="builtin (default): cohort's engines on a transformers model, the draws of the in-process engine; "
        "vllm: vLLM on this machine's GPUs, for a trainer with rollout.engine=vllm (pip install 'cohort[vllm]')",
    )
    p.add_argument(
        "--device",
        default=None,
        help="device to sample on (cpu, cuda, cuda:1, auto = this machine's GPU if it has one; default cpu; builtin only)",
    )
    p.add_argument("--dtype", default="float32", help="parameter dtype (the trainer's model.dtype)")
    p.add_argument(
        "--attn-implementation",
        default=None,
        help="attention kernel (the trainer's model.attn_implementation; default sdpa; builtin only)",
    )
    p.add_argument("--threads", type=_positive_int, default=1, help="torch threads (default 1)")
    p.add_argument(
        "--parent-pid", type=int, default=None, help=argparse.SUPPRESS
    )  # set by a trainer that starts it
    v = p.add_argument_group("vLLM (--engine vllm only; unset: vLLM's default, but for the memory share)")
    v.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=None,
        help=f"share of each GPU's memory vLLM may take (default {VLLM_GPU_MEMORY_UTILIZATION}, vLLM's own before "
        "0.34, which leaves room for weight pushes)",
    )
    v.add_argument(
        "--tensor-parallel-size", type=_positive_int, default=None, help="GPUs the model is split over"
    )
    v.add_argument("--max-model-len", type=_positive_int, default=None, help="longest prompt + completion")
    v.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="reuse prompt prefixes' KV cache across requests (reset after every weight push)",
    )
    v.add_argument("--enforce-eager", action="store_true", default=None, help="no CUDA graphs")
    v.add_argument(
        "--seed",
        type=int,
        default=None,
        help="vLLM's engine seed, 0 .. 2**32 - 1 (default 0; seeded requests do not use it)",
    )

    p = sub.add_parser("config", help="list every config key with its default and what it does")
    p.add_argument("prefix", nargs="?", default="", help="only keys starting with this (e.g. algo or fast.)")
    p.add_argument(
        "--presets",
        action="store_true",
        help="list the named presets instead, each with its source and values",
    )
    return parser
