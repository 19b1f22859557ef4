"""gloo standing in for NCCL, so the NCCL weight path (transport choice, channel polling and abort, buckets, the
vLLM workers' own receive) runs on a machine without GPUs. Run as a script, it is `cohort serve` with the stand-in
(`python tests/serve/_nccl_standin.py serve --model ...`)."""

from __future__ import annotations

import sys

from cohort.serve import weights


def nccl_as_gloo(monkeypatch=None, record: list | None = None) -> None:
    """Returns None after making every process group an NCCL channel builds a gloo one (each build appended to
    `record` as (rank, size)) and every device able to receive over "NCCL" (through pytest's `monkeypatch` when
    given: undone after the test)."""
    gloo = weights.GROUPS["gloo"]

    def group(store, rank, size, address, timeout):
        if record is not None:
            record.append((rank, size))
        return gloo(store, rank, size, address, timeout)

    def receivable(device):
        return ["gloo", "nccl"]

    if monkeypatch is None:
        weights.GROUPS["nccl"] = group
        weights.receivable = receivable  # type: ignore[assignment]
    else:
        monkeypatch.setitem(weights.GROUPS, "nccl", group)
        monkeypatch.setattr(weights, "receivable", receivable)


if __name__ == "__main__":
    nccl_as_gloo()
    from cohort.cli import main

    raise SystemExit(main(sys.argv[1:]))
