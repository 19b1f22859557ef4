"""A torch.compile backend for tests: it counts the graphs Dynamo hands it and runs each as traced, or through a
cheap backend (a CPU's inductor spends tens of seconds compiling C++ even for a tiny model)."""

from __future__ import annotations


class Recorder:
    """A torch.compile backend that counts the graphs it is handed and runs each as traced (or, with `then`, as
    that backend compiles it: "aot_eager" runs AOTAutograd's functional graph, what inductor lowers)."""

    def __init__(self, then: str | None = None) -> None:
        self.graphs = 0
        self.then = then

    def __call__(self, gm, example_inputs):
        """Returns the traced graph's own forward (or `then`'s compiled function), after counting it."""
        self.graphs += 1
        if self.then is None:
            return gm.forward
        from torch._dynamo.backends.registry import lookup_backend

        return lookup_backend(self.then)(gm, example_inputs)
