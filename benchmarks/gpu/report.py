"""Collects the GPU check's parts (benchmarks/gpu/check.sh) into one JSON file and a markdown table.

    python benchmarks/gpu/report.py PARTS OUT   # reads env.json, steps.json, tests.jsonl, decode.json, grpo.json

Writes OUT/gpu-check.json and OUT/gpu-check.md and prints the tables. A part that is missing or broken
(its step failed or ran out of time) is reported as such; the others still are.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def load(path: Path) -> dict | None:
    """Returns a JSON file's content, {"error": ...} when it cannot be read, None when it is absent."""
    if not path.exists():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        return {"error": f"{path.name}: {type(e).__name__}: {e}"}


def test_counts(path: Path, steps: dict) -> dict | None:
    """Returns the suite's counts per outcome, the failing test ids and whether it finished (tests.jsonl)."""
    if not path.exists():
        return None
    counts: dict[str, int] = {}
    failing, slowest, finished, exitstatus = [], [], False, None
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if rec.get("finished"):
            finished, exitstatus = True, rec.get("exitstatus")
            continue
        counts[rec["outcome"]] = counts.get(rec["outcome"], 0) + 1
        if rec["outcome"] in ("failed", "error"):
            failing.append(
                {"id": rec["nodeid"], "when": rec["when"], "message": rec.get("message", "")[-300:]}
            )
        slowest.append((rec.get("seconds", 0.0), rec["nodeid"]))
    slowest.sort(reverse=True)
    return {
        "counts": counts,
        "passed": counts.get("passed", 0),
        "failed": counts.get("failed", 0) + counts.get("error", 0),
        "skipped": counts.get("skipped", 0) + counts.get("xfailed", 0),
        "finished": finished,
        "exitstatus": exitstatus,
        "step": steps.get("pytest"),
        "failing": failing,
        "slowest": [{"id": n, "seconds": s} for s, n in slowest[:10]],
    }


def fmt(x, digits: int = 2, suffix: str = "") -> str:
    """Returns a number for the table ('-' when absent)."""
    if x is None:
        return "-"
    return f"{x:.{digits}f}{suffix}"


def decode_table(decode: dict | None) -> list[str]:
    """Returns the markdown lines of the decode section."""
    head = decode.get("header", {}) if decode else {}
    lines = [
        f"## Decode: ms per decode step ({head.get('rows', '?')} rows x {head.get('tokens', '?')} new tokens, "
        f"prompts of {head.get('prompt_len', '?')} tokens, median of {head.get('repeats', '?')})",
        "",
    ]
    if not decode or "error" in decode and "results" not in decode:
        return [*lines, f"not measured: {decode.get('error') if decode else 'decode.json is missing'}", ""]
    lines += [
        "| shape | precision | cohort eager | cohort captured | cohort captured, compiled | HF static (compiled) | "
        "HF eager | captured / HF static | compiled / HF static | captured / eager |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in decode.get("summary", []):
        lines.append(
            f"| {row['shape']} | {row['precision']} | {fmt(row.get('eager_ms'))} | {fmt(row.get('captured_ms'))} | "
            f"{fmt(row.get('compiled_ms'))} | {fmt(row.get('hf-static_ms'))} | {fmt(row.get('hf-eager_ms'))} | "
            f"{fmt(row.get('captured/hf-static'), suffix='x')} | {fmt(row.get('compiled/hf-static'), suffix='x')} | "
            f"{fmt(row.get('captured/eager'), suffix='x')} |"
        )
    for row in decode.get("summary", []):
        if row.get("eager/eager-nocast") is not None:
            lines.append(
                f"- {row['shape']} {row['precision']}: eager step with the weights cast once (fast.cast_once) "
                f"{fmt(row.get('eager_ms'))} ms against {fmt(row.get('eager-nocast_ms'))} ms cast at every step "
                f"({fmt(row['eager/eager-nocast'], suffix='x')})"
            )
        if row.get("episodes/episodes-eager") is not None:
            lines.append(
                f"- {row['shape']} {row['precision']}: multi-turn episodes, sampled tokens/s with each turn captured "
                f"{fmt(row.get('episodes_tokens_per_s'), 0)} against {fmt(row.get('episodes-eager_tokens_per_s'), 0)} "
                f"eager ({fmt(row['episodes/episodes-eager'], suffix='x')})"
            )
    problems = [r for r in decode.get("results", []) if "error" in r or "skipped" in r]
    for r in problems:
        why = r.get("error") or r.get("skipped")
        lines.append(f"- {r['shape']} {r['precision']} {r['engine']}: {str(why).splitlines()[0][:200]}")
    eq = decode.get("equality")
    if eq is not None:
        if "tokens_equal" in eq:
            lines.append(
                f"- equality (greedy, float32, {eq['rows']} rows x {eq['tokens']} tokens, captured vs eager): "
                f"tokens equal {eq['tokens_equal']}, max log-prob gap {eq['max_logprob_gap']:.2e} "
                f"({'ok' if eq['ok'] else 'NOT ok'})"
            )
        else:
            lines.append(f"- equality: {eq.get('skipped') or eq.get('error', '')[:200]}")
    return [*lines, ""]


def grpo_table(grpo: dict | None) -> list[str]:
    """Returns the markdown lines of the GRPO section."""
    head = grpo.get("header", {}) if grpo else {}
    title = (
        f"## GRPO step: cohort vs TRL ({head.get('shape', '?')}, {head.get('prompts', '?')} prompts x G = "
        f"{head.get('group', '?')}, <= {head.get('max_tokens', '?')} new tokens, beta {head.get('beta', '?')}, "
        f"{head.get('loss', '?')})"
    )
    lines = [title, ""]
    if not grpo or "runs" not in grpo:
        return [*lines, f"not measured: {grpo.get('error') if grpo else 'grpo.json is missing'}", ""]
    lines += [
        "| shape | precision | cohort s/step (generation) | TRL s/step (generation) | cohort throughput vs TRL | "
        "peak CUDA GiB cohort / TRL | memory vs TRL |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in grpo.get("comparison", []):
        lines.append(
            f"| {row.get('shape', head.get('shape', '?'))} | {row['precision']} | "
            f"{fmt(row['cohort_s_per_step'])} ({fmt(row['cohort_generate_s'])}) | "
            f"{fmt(row['trl_s_per_step'])} ({fmt(row['trl_generate_s'])}) | "
            f"{fmt(row.get('throughput_vs_trl'), suffix='x')} | "
            f"{fmt(row['cohort_peak_gib'], 1)} / {fmt(row['trl_peak_gib'], 1)} | "
            f"{fmt(row.get('memory_vs_trl'), suffix='x')} |"
        )
    variants = [r for r in grpo["runs"] if r.get("variant") and r.get("s_per_step") is not None]
    if variants:  # cohort runs with config overrides (--variants), against the same precision's TRL run
        trl = {
            (r.get("shape"), r["precision"]): r.get("s_per_step")
            for r in grpo["runs"]
            if r["framework"] == "trl"
        }
        lines += [
            "",
            "| cohort variant | precision | s/step (generation) | vs TRL | peak CUDA GiB |",
            "|---|---|---|---|---|",
        ]
        for r in variants:
            base = trl.get((r.get("shape"), r["precision"]))
            ratio = base / r["s_per_step"] if base else None
            lines.append(
                f"| {r['variant']} | {r['precision']} | {fmt(r['s_per_step'])} ({fmt(r.get('generate_s'))}) | "
                f"{fmt(ratio, suffix='x')} | {fmt(r.get('peak_cuda_gib'), 1)} |"
            )
    for r in grpo["runs"]:
        notes = [
            r[k] if k != "timed_out" else "timed out"
            for k in ("error", "skipped", "note", "timed_out")
            if r.get(k)
        ]
        if notes:
            lines.append(
                f"- {r['framework']} {r['precision']}{' ' + r['variant'] if r.get('variant') else ''}: {'; '.join(str(n).splitlines()[0][:200] for n in notes)}"
            )
    for r in grpo["runs"]:
        if r.get("segments_allocated") is not None:  # the caching allocator's cudaMalloc / cudaFree calls
            name = f"{r['framework']} {r.get('shape', '')} {r['precision']}{' ' + r['variant'] if r.get('variant') else ''}"
            lines.append(
                f"- {' '.join(name.split())}: segments taken from / given back to the driver a measured step: "
                f"{r['segments_allocated']} / {r.get('segments_freed')}"
            )
    return [*lines, ""]


def main(argv=None) -> None:
    """Writes gpu-check.json and gpu-check.md from the parts folder into the output folder and prints the tables."""
    parts, out = (Path(p) for p in (argv or sys.argv[1:])[:2])
    env = load(parts / "env.json") or {}
    steps = load(parts / "steps.json") or {}
    tests = test_counts(parts / "tests.jsonl", steps)
    decode, grpo = load(parts / "decode.json"), load(parts / "grpo.json")
    result = {"environment": env, "steps": steps, "tests": tests, "decode": decode, "grpo": grpo}
    (out / "gpu-check.json").write_text(json.dumps(result, indent=1))
    lines = [
        "# cohort GPU check",
        "",
        f"Card: **{env.get('device', '?')}**; torch {env.get('torch', '?')}, transformers "
        f"{env.get('transformers', '?')}, TRL {env.get('trl', '?')}, Python {env.get('python', '?')}; "
        f"cohort {env.get('commit', '?')} from source.",
        "",
    ]
    if env.get("imports"):
        bad = {k: v for k, v in env["imports"].items() if v != "ok"}
        if bad:
            lines += [f"Missing imports: {bad}", ""]
    lines += ["## Test suite (pytest -n 16, cohort from source)", ""]
    if tests is None:
        lines += ["not run: tests.jsonl is missing", ""]
    else:
        done = "finished" if tests["finished"] else "stopped by its time limit"
        lines += [
            f"{tests['passed']} passed, {tests['failed']} failed, {tests['skipped']} skipped ({done}; "
            f"exit status {tests['exitstatus']})",
            "",
        ]
        lines += [f"- FAILED {f['id']} ({f['when']})" for f in tests["failing"][:60]]
        lines.append("")
    lines += decode_table(decode)
    lines += grpo_table(grpo)
    lines += [
        "Steps: " + ", ".join(f"{k} {v.get('status')} after {v.get('seconds')} s" for k, v in steps.items()),
        "",
    ]
    text = "\n".join(lines)
    (out / "gpu-check.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
