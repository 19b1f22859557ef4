"""A torch.compile backend for tests: it counts the graphs Dynamo hands it and runs each as traced (a CPU's inductor
spends tens of seconds compiling C++ even for a tiny model)."""

from __future__ import annotations


class Recorder:
    """A torch.compile backend that counts the graphs it is handed and runs each as traced."""

    def __init__(self) -> None:
        self.graphs = 0

    def __call__(self, gm, example_inputs):
        """Returns the traced graph's own forward, after counting it."""
        self.graphs += 1
        return gm.forward
