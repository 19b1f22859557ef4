"""The configs in which the captured decode step is refused before the model loads, shared by the tests of both
switches that ask for it (fast.graph_decode=on, and fast.compile_decode=on, which compiles it)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any


def refused_configs(model_dir: Path | str, fast: dict[str, str]) -> Iterator[tuple[dict[str, Any], str]]:
    """Yields (config dict with `fast`, what the refusal names) for a CPU device, eager attention and the hf
    engine."""
    base = {"model": {"name_or_path": str(model_dir), "device": "cpu"}, "data": {"task": "addition"}}
    for over, why in [
        ({}, "CUDA graphs need a CUDA GPU, and model.device='cpu'"),
        ({"model": {"device": "cuda", "attn_implementation": "eager"}}, "model.attn_implementation='eager'"),
        ({"rollout": {"engine": "hf"}}, "rollout.engine='hf'"),
    ]:
        cfg: dict[str, Any] = {**base, "fast": dict(fast)}
        for k, v in over.items():
            cfg[k] = {**cfg.get(k, {}), **v}
        yield cfg, why
