"""Tables, the sweep's linearity check and the targets of the speed issue, from the results dict."""

from __future__ import annotations

TARGETS = {
    "completions_2x_b": "cohort >= 2x TRL's completions/s on workload (b), both sizes",
    "rss_0.4x_c": "cohort peak RSS <= 0.4x TRL's on workload (c)",
    "floor_1.5x_b14m": "cohort step time <= 1.5x the FLOP floor on workload (b), 14M model",
    "linear_sweep": "cohort step time linear in G and in completion tokens (sweep)",
    "tta_third": "cohort time to accuracy <= 1/3 of TRL's",
}


def _fit(xs: list[float], ys: list[float]) -> dict:
    """Return the least-squares line y = a + b x and its R^2."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys))
    b = sxy / sxx if sxx else 0.0
    a = my - b * mx
    ss_tot = sum((y - my) ** 2 for y in ys)
    ss_res = sum((y - a - b * x) ** 2 for x, y in zip(xs, ys))
    return {"intercept": a, "slope": b, "r2": 1 - ss_res / ss_tot if ss_tot else 1.0}


def linearity(points: list[dict], Gs: list[int], Ls: list[int]) -> dict:
    """Return affine fits of step time in G (per length), in length (per G) and in completion tokens.

    `worst_growth` is the largest (time ratio) / (size ratio) between neighbouring points of a row or
    column: 1.0 means proportional, < 1 sub-linear (fixed costs amortised), > 1 super-linear.
    `worst_growth_over_floor` divides by the FLOP floor's own growth instead of the size ratio:
    attention makes the work itself grow faster than the token count, and this isolates what the
    implementation adds on top of that.
    """
    if not points:
        return {}
    t = {(p["G"], p["length"]): p["seconds_per_step"] for p in points}
    f = {(p["G"], p["length"]): p.get("floor_seconds") for p in points}
    out: dict = {"by_G": {}, "by_length": {}}
    growth, over_floor = [], []

    def pair(a, b, size_ratio):
        growth.append((t[b] / t[a]) / size_ratio)
        if f[a] and f[b]:
            over_floor.append((t[b] / t[a]) / (f[b] / f[a]))

    for L in Ls:
        xs = [G for G in Gs if (G, L) in t]
        out["by_G"][L] = _fit(xs, [t[(G, L)] for G in xs]) if len(xs) > 1 else None
        for a, b in zip(xs, xs[1:]):
            pair((a, L), (b, L), b / a)
    for G in Gs:
        xs = [L for L in Ls if (G, L) in t]
        out["by_length"][G] = _fit(xs, [t[(G, L)] for L in xs]) if len(xs) > 1 else None
        for a, b in zip(xs, xs[1:]):
            pair((G, a), (G, b), b / a)
    tok = [p["completion_tokens"] for p in points]
    out["by_tokens"] = _fit(tok, [p["seconds_per_step"] for p in points]) if len(points) > 1 else None
    out["worst_growth"] = max(growth) if growth else None
    out["worst_growth_over_floor"] = max(over_floor) if over_floor else None
    out["min_r2"] = min(f["r2"] for f in [*out["by_G"].values(), *out["by_length"].values()] if f)
    return out


def targets(results: dict) -> list[dict]:
    """Return each target with its measured value and whether it is met (None when not measured)."""
    out = []
    speed = {(e["workload"], e["model"]): e for e in results.get("speed", [])}

    def ratio(wl, m, key):
        e = speed.get((wl, m))
        return e["ratio"][key] if e and "ratio" in e else None

    vals = [ratio("b_gsm8k", m, "completions_per_s") for m in ("0.5m", "14m")]
    got = [v for v in vals if v is not None]
    out.append(
        {
            "target": TARGETS["completions_2x_b"],
            "value": {"0.5m": vals[0], "14m": vals[1]},
            "met": (min(got) >= 2.0) if len(got) == 2 else None,
        }
    )
    v = ratio("c_vocab", "vocab152k", "peak_rss_mib")
    out.append({"target": TARGETS["rss_0.4x_c"], "value": v, "met": None if v is None else v <= 0.4})
    e = speed.get(("b_gsm8k", "14m"))
    v = e["cohort"]["step_over_floor"] if e and "cohort" in e else None
    out.append({"target": TARGETS["floor_1.5x_b14m"], "value": v, "met": None if v is None else v <= 1.5})
    lin = results.get("sweep", {}).get("linearity", {}).get("cohort")
    if lin:
        met = lin["worst_growth"] <= 1.1 and lin["min_r2"] >= 0.98
        out.append(
            {
                "target": TARGETS["linear_sweep"],
                "value": {
                    "worst_growth": lin["worst_growth"],
                    "worst_growth_over_floor": lin.get("worst_growth_over_floor"),
                    "min_r2": lin["min_r2"],
                },
                "met": met,
            }
        )
    else:
        out.append({"target": TARGETS["linear_sweep"], "value": None, "met": None})
    runs = results.get("tta", {}).get("runs", [])
    rs = [r.get("ratio_seconds_to_target", r.get("ratio_seconds_to_target_at_most")) for r in runs]
    if runs and all(r is not None for r in rs):
        v = sum(rs) / len(rs)
        bound = any("ratio_seconds_to_target" not in r for r in runs)
        note = (
            "TRL did not reach the target within its budget: the value is an upper bound" if bound else None
        )
        out.append({"target": TARGETS["tta_third"], "value": v, "met": v <= 1 / 3, "note": note})
    elif runs:
        out.append(
            {
                "target": TARGETS["tta_third"],
                "value": None,
                "met": False,
                "note": "cohort did not reach the target",
            }
        )
    else:
        out.append({"target": TARGETS["tta_third"], "value": None, "met": None})
    return out


def _f(x, spec=".3g") -> str:
    return "-" if x is None else format(x, spec)


def print_speed(entries: list[dict]) -> None:
    """Print one block per workload/model: both frameworks' figures and the cohort/TRL ratios."""
    head = f"{'workload':9} {'model':9} {'framework':9} {'s/step':>7} {'gen s':>6} {'upd s':>6} {'compl/s':>8} {'tok/s':>7} {'len':>5} {'RSS MiB':>8} {'floor s':>8} {'/floor':>6} {'/dfloor':>7} {'GFLOP/s':>7} {'others%':>7}"
    print(head)
    for e in entries:
        for fw in ("cohort", "trl"):
            if fw not in e:
                continue
            r = e[fw]
            print(
                f"{e['workload']:9} {e['model']:9} {fw:9} {r['seconds_per_step']:7.3f} {r['seconds_generate']:6.2f} "
                f"{r['seconds_update']:6.2f} {r['completions_per_s']:8.1f} {r['tokens_per_s']:7.0f} "
                f"{r['mean_completion_length']:5.1f} {r['peak_rss_mib']:8.0f} {r['floor_seconds']:8.3f} "
                f"{r['step_over_floor']:6.2f} {_f(r.get('step_over_decode_floor'), '7.2f')} {r['useful_gflops']:7.1f} "
                f"{100 * max(r['others_cpu_during']):7.0f}"
                + (f"  GPU peak {r['peak_gpu_mib']:.0f} MiB" if r.get("peak_gpu_mib") else "")
            )
        if "ratio" in e:
            x = e["ratio"]
            print(
                f"{e['workload']:9} {e['model']:9} {'cohort/TRL':9} {_f(x['seconds_per_step'], '7.3f')} "
                f"{_f(x['seconds_generate'], '6.2f')} {_f(x['seconds_update'], '6.2f')} {_f(x['completions_per_s'], '8.2f')} "
                f"{_f(x['tokens_per_s'], '7.2f')} {'':5} {_f(x['peak_rss_mib'], '8.2f')}"
            )


def print_sweep(sweep: dict) -> None:
    """Print the sweep's step times as a G x length grid per framework, then the linearity fits."""
    for fw in sorted({p["framework"] for p in sweep["points"]}):
        pts = {(p["G"], p["length"]): p for p in sweep["points"] if p["framework"] == fw}
        print(
            f"{fw}: seconds per step ({sweep['prompts_per_step']} prompts x G completions; model {sweep['model']})"
        )
        print("   G \\ len " + "".join(f"{L:>10}" for L in sweep["lengths"]))
        for G in sweep["G"]:
            cells = "".join(
                f"{pts[(G, L)]['seconds_per_step']:10.3f}" if (G, L) in pts else f"{'-':>10}"
                for L in sweep["lengths"]
            )
            print(f"  {G:8d} {cells}")
        lin = sweep["linearity"].get(fw) or {}
        if lin.get("by_tokens"):
            f = lin["by_tokens"]
            print(
                f"  fit over completion tokens: {f['intercept']:.3f} s + {1000 * f['slope']:.3f} ms/token "
                f"(R^2 {f['r2']:.4f}); worst growth {lin['worst_growth']:.2f}x proportional "
                f"({_f(lin.get('worst_growth_over_floor'), '.2f')}x the FLOP floor's growth); min R^2 {lin['min_r2']:.4f}"
            )


def print_tta(tta: dict) -> None:
    """Print each seed's time to the accuracy target for both frameworks."""
    print(
        f"time to {100 * tta['target']:.0f}% held-out greedy accuracy (eval every {tta['eval_every']} steps, eval time excluded)"
    )
    for r in tta["runs"]:
        for fw in ("cohort", "trl"):
            if fw in r:
                x = r[fw]
                curve = ", ".join(f"{c['step']}:{100 * c['accuracy']:.0f}%" for c in x["curve"][:12])
                curve += ", ..." if len(x["curve"]) > 12 else ""
                print(
                    f"  seed {r['seed']} {fw:6}: {_f(x.get('seconds_to_target'), '.1f')} s, {_f(x.get('steps_to_target'), 'd')} steps, "
                    f"{x['seconds_per_step']:.3f} s/step  [{curve}]"
                )
        if r.get("ratio_seconds_to_target") is not None:
            print(f"  seed {r['seed']} cohort/TRL: {r['ratio_seconds_to_target']:.3f}")
        elif r.get("ratio_seconds_to_target_at_most") is not None:
            print(
                f"  seed {r['seed']} cohort/TRL: <= {r['ratio_seconds_to_target_at_most']:.3f} (TRL stopped at its budget)"
            )


def print_all(results: dict) -> None:
    """Print every section present, then the targets."""
    if results.get("speed"):
        print_speed(results["speed"])
    if results.get("sweep"):
        print_sweep(results["sweep"])
    if results.get("tta"):
        print_tta(results["tta"])
    print("targets:")
    for t in results.get("targets", []):
        status = {True: "MET", False: "MISSED", None: "not measured"}[t["met"]]
        print(f"  [{status}] {t['target']}: {t['value']}" + (f" ({t['note']})" if t.get("note") else ""))
