"""Multi-turn episodes with tool calls: the foundation the episode loop builds on.

- `tools`: Tool / ToolSet from plain and async functions (schemas by transformers' get_json_schema), and a
  TRL-style environment's public methods as tools.
- `parsers`: tool calls out of an assistant turn (Hermes / Qwen, Llama 3.x JSON, Mistral, or transformers'
  response parsing), telling no call, complete calls and a malformed call apart.
- `templates`: the start-up checks of a tool-calling chat template (tool support, prefix preservation),
  the token ids of a tool turn, and small templates of the three families.
- `environments`: the gym-like `TextEnvironment` protocol (reset / step), its checks, the `GuessNumber` game;
  `openenv` adapts an OpenEnv server to it.
- `decoding`, `loop`, `spec`: the episode loop the trainer runs (imported from their modules: they load models).
- `execution`: running calls (sync on threads, async on an event loop, each under a timeout, failures as
  TRL's `{'error': ...}` text) and TRL's tool metrics.
"""

from cohort.episodes.environments import (
    EnvStep,
    GuessNumber,
    TextEnvironment,
    check_environment_factory,
    is_text_environment,
)
from cohort.episodes.execution import (
    ToolExecutor,
    ToolResult,
    call_frequency,
    error_text,
    execute,
    failure_frequency,
    render_result,
    tool_metrics,
    truncate_result,
)
from cohort.episodes.parsers import (
    TOOL_PARSERS,
    HermesParser,
    Llama3JsonParser,
    MistralParser,
    ParsedResponse,
    ToolCall,
    ToolParser,
    TransformersParser,
    parser_for,
    template_family,
)
from cohort.episodes.templates import (
    TOOL_FORMATS,
    ToolFormat,
    check_prefix_preserving,
    check_tool_support,
    check_tool_template,
    install_tool_format,
    render_tool_turn,
    supports_tools,
)
from cohort.episodes.tools import Tool, ToolSet, environment_tools, make_tool, tool_set

__all__ = [
    "EnvStep",
    "GuessNumber",
    "TextEnvironment",
    "check_environment_factory",
    "is_text_environment",
    "TOOL_FORMATS",
    "TOOL_PARSERS",
    "HermesParser",
    "Llama3JsonParser",
    "MistralParser",
    "ParsedResponse",
    "Tool",
    "ToolCall",
    "ToolExecutor",
    "ToolFormat",
    "ToolParser",
    "ToolResult",
    "ToolSet",
    "TransformersParser",
    "call_frequency",
    "check_prefix_preserving",
    "check_tool_support",
    "check_tool_template",
    "environment_tools",
    "error_text",
    "execute",
    "failure_frequency",
    "install_tool_format",
    "make_tool",
    "parser_for",
    "render_result",
    "render_tool_turn",
    "supports_tools",
    "template_family",
    "tool_metrics",
    "tool_set",
    "truncate_result",
]
