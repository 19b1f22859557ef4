"""Datasets for cohort: built-in synthetic tasks, JSONL / JSON / `datasets` loading, prompt encoding."""

from cohort.data.code_tasks import CodeTask
from cohort.data.multiply_task import MultiplyTask
from cohort.data.prompts import as_completions, encode_prompts, is_conversational, prompt_text
from cohort.data.sources import (
    RESERVED_COLUMNS,
    DataError,
    Rows,
    load_json,
    load_jsonl,
    load_rows,
    row_place,
    validate_rows,
)
from cohort.data.tasks import TASKS, AdditionTask, MultistepTask, Task, get_task, make_task, sft_completion

# defined apart from tasks.py (on top of its Task), registered with the others
TASKS[CodeTask.name] = CodeTask
TASKS[MultiplyTask.name] = MultiplyTask

__all__ = [
    "RESERVED_COLUMNS",
    "TASKS",
    "AdditionTask",
    "CodeTask",
    "DataError",
    "MultiplyTask",
    "MultistepTask",
    "Rows",
    "Task",
    "as_completions",
    "encode_prompts",
    "get_task",
    "is_conversational",
    "load_json",
    "load_jsonl",
    "load_rows",
    "make_task",
    "prompt_text",
    "row_place",
    "sft_completion",
    "validate_rows",
]
