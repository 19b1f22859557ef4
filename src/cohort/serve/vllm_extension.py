"""Code that runs inside vLLM's worker processes for `cohort serve --engine vllm`: loading a weight push.

vLLM imports `WeightLoader` by its qualified name (LLM(worker_extension_cls="cohort.serve.vllm_extension.
WeightLoader")) and adds it to the bases of its GPU worker class (vllm/v1/worker/worker_base.py, 0.27.0 to
0.33.0), so `LLM.collective_rpc("cohort_load_weights", args=...)` runs the method below on every worker, with
`self` the worker (its `model_runner.model` is the vLLM model). vLLM asserts that the extension adds no name
its worker already has: hence the `cohort_` prefix.

NOT RUN inside vLLM (docs/vllm.md); tests/serve/test_serve_vllm.py runs it against a stand-in worker. Kept
free of cohort imports beyond torch, as it is imported in every vLLM worker process.
"""

from __future__ import annotations

from typing import Any

import torch


class WeightLoader:
    """The methods vLLM mixes into its workers (see the module's docstring)."""

    model_runner: Any
    """vLLM's worker provides it (an annotation only: vLLM's name-clash check reads attributes, not this)."""

    def cohort_load_weights(self, files: list[list], tensors: list[list]) -> int:
        """Returns the number of tensors handed to the model's `load_weights`.

        `files`: [path, dtype, numel] of each flat buffer the cohort worker received a push into (a file in
        shared memory; "" for an empty one). `tensors`: [name, dtype, offset, numel, shape] of each tensor, named
        as the trainer's transformers model names it, which is what vLLM's `load_weights` reads from a
        checkpoint (it maps them onto its own fused modules, and splits them across tensor-parallel ranks)."""
        flats: dict[str, torch.Tensor] = {}
        for path, dtype, numel in files:
            kind = getattr(torch, dtype)
            # shared=False: a private, read-only use of the file's pages (nothing is written back)
            flats[dtype] = (
                torch.from_file(path, shared=False, size=numel, dtype=kind)
                if numel
                else torch.empty(0, dtype=kind)
            )

        def named():
            for name, dtype, offset, numel, shape in tensors:
                yield name, flats[dtype][offset : offset + numel].view(shape)

        # The call TRL's weight sync and vLLM's RLHF examples make (trl/scripts/vllm_serve.py update_named_param;
        # examples/offline_inference/rlhf.py): the tensors are copied into vLLM's parameters in place.
        self.model_runner.model.load_weights(weights=named())
        return len(tensors)
