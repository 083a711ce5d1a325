"""Results as JSON, a markdown table and a PNG plot; the targets printed last.

The markdown and the PNG are drawn from the JSON alone, so :func:`rebuild` makes them again from
any results file, that of a run killed half way included (``chatlearn-mem bench-report PATH``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

from chatlearn_mem.atomic_files import write_json_atomic
from chatlearn_mem_bench.checkpoint_saves import checkpoint_lines
from chatlearn_mem_bench.config import PARTS
from chatlearn_mem_bench.plan import format_bytes
from chatlearn_mem_bench.planner_speed import planner_lines
from chatlearn_mem_bench.plot import plot as draw
from chatlearn_mem_bench.torch_native import torch_native_lines

__all__ = ["SUFFIXES", "free_stem", "markdown", "missing_summary", "print_targets", "rebuild", "write_outputs"]

MiB = 2**20


def missing_summary(res: dict) -> str:
    """What an incomplete run did not measure, one sentence; empty for a complete run."""
    if res.get("complete", True):
        return ""
    missing = res.get("missing_parts", [])
    what = [
        f"parts {', '.join(missing)}" if missing else "",
        "" if "cycles" in res else "the repeated full cycles",
        "" if "integrity" in res else "the integrity check",
    ]
    return (
        "Incomplete run (stopped, killed or timed out): missing "
        + "; ".join(w for w in what if w)
        + ". Every row below was measured; the targets cover those rows only."
    )


def _ms(x: float) -> str:
    return f"{x * 1e3:.1f}"


def markdown(res: dict) -> str:
    hw, v, m = res["hardware"], res["versions"], res["model"]
    dev = hw.get("gpu_name") or f"{hw['cpu_model']} ({hw['cpu_count']} cores, torch threads {hw['torch_num_threads']})"
    lines = [
        f"# chatlearn-mem memory benchmark, {res['date']}",
        "",
        f"Produced by `{res['command']}` (started {res['started_utc']}, git {res.get('git_revision') or 'unknown'}).",
        "",
        *([f"**{missing_summary(res)}**", ""] if missing_summary(res) else []),
        f"- device: {hw['device']}, {dev}; host memory {hw['memory_total_bytes'] / 2**30:.1f} GiB; "
        f"load average at start {', '.join(f'{x:.2f}' for x in hw['load_average_at_start'] or [])}",
        "- versions: " + ", ".join(f"{k} {val}" for k, val in v.items() if val),
        f"- trainer: {m['parameters'] / 1e6:.1f} M parameters, {res['config']['trainer']['precision']}, "
        f"distributed optimizer {res['config']['trainer']['use_distributed_optimizer']}; pinned host buffers "
        f"{m['pinned_host']}; bytes per part: "
        + ", ".join(f"{k} {n / MiB:.1f} MiB" for k, n in m["bytes_per_part"].items()),
        f"- {res['config']['repeats']} timed repeats after {res['config']['warmup']} warm-up, methods interleaved; "
        "median with interquartile range (IQR). `manager is` compares IQRs: `noise` means the "
        "difference is within the measured spread.",
        *_plan_lines(res),
        "",
        "## Time per part",
        "",
        "| part | direction | method | median ms | IQR ms | min-max ms | GB/s (IQR) | manager/ceiling | manager/release bound | time / manager's | manager is |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in res["timings"]:
        s = r["seconds"]
        gbs = f"{r['gb_per_s']:.2f} ({r['gb_per_s_iqr'][0]:.2f}-{r['gb_per_s_iqr'][1]:.2f})" if r["gb_per_s"] else "-"
        vc = f"{r['vs_ceiling']:.2f}" if r.get("vs_ceiling") is not None else ""
        vb = f"{r['vs_release_bound']:.2f}" if r.get("vs_release_bound") is not None else ""
        tm = f"{r['time_vs_manager']:.2f}x" if r.get("time_vs_manager") is not None else ""
        lines.append(
            f"| {r['part']} | {r['direction']} | {r['method']} | {_ms(s['median'])} | "
            f"{_ms(s['q25'])}-{_ms(s['q75'])} | {_ms(s['min'])}-{_ms(s['max'])} | {gbs} | {vc} | {vb} | {tm} | "
            f"{r.get('manager_is', '')} |"
        )
    lines += [
        "",
        "Methods: " + "; ".join(f"`{k}`: {val}" for k, val in res["methods"].items()) + ".",
        *[f"Not run: `{k}`: {why}." for k, why in (res.get("skipped_methods") or {}).items()],
        "",
        *_versus_lines(res),
        *_host_work_lines(res),
        "## Memory per stage (first timed repeat)",
        "",
        "Device bytes: CUDA allocated/reserved on GPU; on CPU the manager's `residency()` for the "
        "manager, the part's storages (+ new buffers) for the others. Host: bytes the method holds "
        "(pinned in brackets).",
        "",
    ]
    cuda = any("cuda_allocated_bytes" in x for x in res["memory"])
    head = "| part | method | device MiB before / offloaded / onloaded | host MiB offloaded (pinned) | RSS MiB before / offloaded / onloaded |"
    if cuda:
        head += " CUDA alloc MiB b/o/o | CUDA reserved MiB b/o/o |"
        lines.insert(
            -1,
            "CUDA figures include the benchmark's own ceiling and bound buffers for the part "
            "(`benchmark_device_buffers_bytes` in the JSON).",
        )
    lines += [head, "|---|---|---|---|---|" + ("---|---|" if cuda else "")]
    by = {}
    for x in res["memory"]:
        by.setdefault((x["part"], x["method"]), {})[x["stage"]] = x
    for (part, method), st in by.items():
        b, o, n = st["before"], st["after_offload"], st["after_onload"]
        row = (
            f"| {part} | {method} | {b['device_bytes'] / MiB:.1f} / {o['device_bytes'] / MiB:.1f} / "
            f"{n['device_bytes'] / MiB:.1f} | {o['host_bytes'] / MiB:.1f} ({o['pinned_bytes'] / MiB:.1f}) | "
            f"{b['rss_bytes'] / MiB:.0f} / {o['rss_bytes'] / MiB:.0f} / {n['rss_bytes'] / MiB:.0f} |"
        )
        if cuda:
            row += " / ".join(f"{s['cuda_allocated_bytes'] / MiB:.0f}" for s in (b, o, n)) + " | "
            row += " / ".join(f"{s['cuda_reserved_bytes'] / MiB:.0f}" for s in (b, o, n)) + " |"
        lines.append(row)
    lines += _cycle_lines(res.get("cycles"))
    lines += _overlap_lines(res.get("overlap"))
    lines += _tail_lines(res.get("onload_tail"))
    lines += checkpoint_lines(res.get("checkpoint"))
    lines += torch_native_lines(res.get("torch_native"))
    lines += planner_lines(res.get("planner"))
    lines += _soak_lines(res.get("soak"))
    lines += ["", "## Targets", ""]
    if not res.get("complete", True):
        lines += ["Targets of the rows measured so far: the run did not finish.", ""]
    lines += ["| target | result | detail |", "|---|---|---|"]
    for t in res.get("targets", []):
        lines.append(f"| {t['name']} | {'PASS' if t['passed'] else 'MISS'} | {t['detail']} |")
    integ = res.get("integrity")
    if integ:
        lines += [
            "",
            f"Integrity: tensors bit-identical after every method: "
            f"{integ['tensors_bit_identical_after_all_methods']}; audit ok: {integ['audit_ok']}."
            + "".join(
                f" {m} left {', '.join(ps)} with other bytes than before its rounds."
                for m, ps in (integ.get("changed_by") or {}).items()
            ),
            "",
        ]
    for method, parts in (res.get("detached_grad_hooks") or {}).items():
        for part, n in parts.items():
            lines += [
                f"{method} on {part} detached {n} of DDP's gradient hooks (torch drops a weight's "
                "grad-accumulator node when its `.data` moves to another device): its gradients would "
                "never be reduced again. The benchmark hooked them again after each round.",
                "",
            ]
    return "\n".join(lines) + ("" if integ else "\n")


def _cycle_lines(cyc) -> list[str]:
    if not cyc:
        return []
    rows = cyc["rows"]
    lines = [
        "",
        f"## {len(rows)} repeated full cycles (manager)",
        "",
        f"Cycle time (offload + onload) median {cyc['cycle_s_first_half']['median']:.3f} s "
        f"(IQR {cyc['cycle_s_first_half']['q25']:.3f}-{cyc['cycle_s_first_half']['q75']:.3f}) in the first half, "
        f"{cyc['cycle_s_second_half']['median']:.3f} s "
        f"(IQR {cyc['cycle_s_second_half']['q25']:.3f}-{cyc['cycle_s_second_half']['q75']:.3f}) in the second.",
        "",
        "| cycle | offload ms | onload ms | device MiB offloaded / onloaded | host store MiB | RSS MiB offloaded / onloaded |",
        "|---:|---:|---:|---|---:|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['cycle']} | {_ms(r['offload_s'])} | {_ms(r['onload_s'])} | "
            f"{r['device_bytes_after_offload'] / MiB:.1f} / {r['device_bytes_after_onload'] / MiB:.1f} | "
            f"{r['host_bytes_after_offload'] / MiB:.1f} | "
            f"{r['rss_after_offload'] / MiB:.0f} / {r['rss_after_onload'] / MiB:.0f} |"
        )
    return lines


def _tail_lines(tail) -> list[str]:
    if not tail:
        return []
    on, cp = tail["onload_s"], tail["copy_s"]
    return [
        "",
        f"## Weights onload, {on['n']} times (blocking), beside a plain copy of its {tail['bytes'] / MiB:.0f} MiB",
        "",
        "| | median ms | IQR ms | 90th percentile ms | max ms |",
        "|---|---:|---:|---:|---:|",
        f"| manager onload | {_ms(on['median'])} | {_ms(on['q25'])}-{_ms(on['q75'])} | "
        f"{_ms(tail['p90_onload_s'])} | {_ms(on['max'])} |",
        f"| plain copy | {_ms(cp['median'])} | {_ms(cp['q25'])}-{_ms(cp['q75'])} | | {_ms(cp['max'])} |",
        "",
        f"Onload / copy: {tail['onload_over_copy']:.2f} (per-pair IQR {tail['ratio_spread'][0]:.2f}-"
        f"{tail['ratio_spread'][1]:.2f}); 90th percentile / median: {tail['p90_over_median']:.2f}.",
    ]


def _soak_lines(soak) -> list[str]:
    if not soak:
        return []
    cuda = "cuda_reserved_bytes" in soak["samples"][0]
    lines = [
        "",
        f"## Soak: {soak['cycles']} full cycles, a train step every {soak['train_every']}",
        "",
        f"Cycle median {_ms(soak['cycle_s']['median'])} ms; audit ok at the end: {soak['audit_ok']}.",
        "",
        "| cycle | RSS MiB |" + (" CUDA reserved MiB |" if cuda else ""),
        "|---:|---:|" + ("---:|" if cuda else ""),
    ]
    for s in soak["samples"]:
        row = f"| {s['cycle']} | {s['rss_bytes'] / MiB:.0f} |"
        if cuda:
            row += f" {s['cuda_reserved_bytes'] / MiB:.0f} |"
        lines.append(row)
    return lines


def _overlap_lines(rows) -> list[str]:
    if not rows:
        return []
    threads = rows[0].get("threads")
    lines = [
        "",
        "## Overlap: each transition the copy engine overlaps, against its serial counterpart",
        "",
        f"Medians (IQR) over the timed repeats, interleaved; {threads} compute thread(s) on a CPU device "
        "(`overlap_threads`: a core is left to the copy lane). `onload_then_forward`: onload(weights) then a "
        "no-grad forward vs onload(weights, blocking=False) and the forward at once; `swap`: a.offload() then "
        "b.onload() vs swap(out=a, into=b); `full_cycle`: one blocking call per part vs offload() + onload().",
        "",
        "| row | serial ms (IQR) | overlapped ms (IQR) | overlapped / serial (IQR) | note |",
        "|---|---:|---:|---:|---|",
    ]
    for r in rows:
        s, o, q = r["serial_spread_s"], r["overlapped_spread_s"], r.get("ratio_spread") or [r["ratio"]] * 2
        note = ""
        if r["name"] == "onload_then_forward":
            onload = r.get("onload_alone_s")
            first = r.get("first_module_copy_s")
            note = (
                f"forward alone {_ms(r['forward_alone_s'])} ms"
                + (f", onload alone {_ms(onload)} ms" if onload is not None else "")
                + (
                    f", first module ({r['first_module_bytes'] / MiB:.0f} MiB) copied in {_ms(first)} ms"
                    if first is not None
                    else ""
                )
                + f": no schedule beats {r['best_possible_ratio']:.2f}; overlapped = "
                f"{r['overlapped_vs_forward']:.2f}x the forward"
            )
        elif r["name"] == "swap":
            note = (
                f"out {r['out_bytes'] / MiB:.0f} MiB, in {r['in_bytes'] / MiB:.0f} MiB "
                f"({r['critic_layers']}-layer trainer)"
            )
            if r.get("copy_bound_ratio") is not None:
                note += (
                    f"; two host copies at once take {r['copy_bound_ratio']:.2f} of serial here: "
                    f"no swap beats that on this machine"
                )
        lines.append(
            f"| {r['name']} | {_ms(r['serial_s'])} ({_ms(s[0])}-{_ms(s[1])}) | {_ms(r['overlapped_s'])} "
            f"({_ms(o[0])}-{_ms(o[1])}) | {r['ratio']:.2f} ({q[0]:.2f}-{q[1]:.2f}) | {note} |"
        )
    return lines


VERSUS = ("torch_memory_saver", "megatron_builtin")
"""The peers' own ways of putting a trainer to sleep, compared with the manager part by part."""


def _versus_lines(res: dict) -> list[str]:
    """The manager against torch_memory_saver and megatron-core's own offload, per part and
    direction: each one's median time and its time over the manager's (the ratio the README's
    headline quotes)."""
    by = {(r["part"], r["method"], r["direction"]): r for r in res["timings"]}
    peers = [m for m in VERSUS if any(k[1] == m for k in by)]
    if not peers:
        return []
    head = "| part | direction | manager ms |" + "".join(f" {m} ms | {m} / manager |" for m in peers)
    lines = [
        "## The manager against " + " and ".join(f"`{m}`" for m in peers),
        "",
        "Median times in the same run, rounds interleaved; `x / manager` is how many times longer the "
        "peer takes. torch_memory_saver runs in a worker process of its own on the same trainer (same "
        "config, seed and first step), built under its tags: pausing `weights` pauses its `model` tag, the "
        "weights with the grads (megatron allocates both in one constructor); `given back` is the device "
        "memory its pause returned (its allocator segments whole).",
        "",
        head + (" torch_memory_saver given back GiB |" if "torch_memory_saver" in peers else ""),
        "|---|---|---:|" + "---:|---:|" * len(peers) + ("---:|" if "torch_memory_saver" in peers else ""),
    ]
    for part in PARTS:
        for d in ("offload", "onload"):
            mgr = by.get((part, "manager", d))
            if mgr is None or not any((part, m, d) in by for m in peers):
                continue
            row = f"| {part} | {d} | {_ms(mgr['seconds']['median'])} |"
            for m in peers:
                r = by.get((part, m, d))
                row += f" {_ms(r['seconds']['median'])} | **{r['time_vs_manager']:.1f}x** |" if r else " - | - |"
            if "torch_memory_saver" in peers:
                r = by.get((part, "torch_memory_saver", d))
                given = r.get("tms_released_bytes") if r else None
                row += f" {given / 2**30:.2f} |" if given is not None and d == "offload" else " |"
            lines.append(row)
    tms = res.get("torch_memory_saver")
    if tms:
        w = tms.get("worker") or {}
        env = w.get("environment") or {}
        facts = [f"{k}={v}" for k, v in env.items() if v is not None and k != "LD_PRELOAD"]
        facts += [f"{k}: {v}" for k, v in (w.get("settings") or {}).items()]
        facts.append(f"its worker built its trainer in {w.get('build_s', 0):.0f} s")
        if len(w.get("libcudart") or []) > 1:
            facts.append(f"two CUDA runtimes in its worker ({', '.join(w['libcudart'])}): its figures are suspect")
        if tms.get("failed"):
            facts.append(f"it failed: {tms['failed']}")
        if "same_forward_loss" in tms:
            same = "the same bits" if tms["same_forward_loss"] else "different bits"
            facts.append(f"the forward loss of both trainers after every round: {same}")
        what = (
            "a stand-in for torch_memory_saver (host copies: a test)"
            if w.get("fake")
            else (f"torch_memory_saver {w.get('version')}")
        )
        lines += ["", f"{what}: " + "; ".join(facts) + "."]
    return lines + [""]


def _host_work_lines(res: dict) -> list[str]:
    """The table of the host's time issuing the manager's transitions (its ``TransferStats``)."""
    rows = [r for r in res["timings"] if r["method"] == "manager" and r.get("host_seconds")]
    if not rows:
        return []
    cuda = res["hardware"]["device"].startswith("cuda")
    lines = [
        "## The manager's host work",
        "",
        "Host time running the transition's actions (summed `TransferStats.host_seconds`, median) "
        "against the call's time. "
        + (
            "On CUDA the host only issues the copies: a share well below 1 means the copies, not "
            "the host, bound the call."
            if cuda
            else "On a CPU device the host time includes the copies themselves, and the regrows (on the "
            "calling thread) and the copies (on the lane's) add up from two threads, so a share can exceed 1."
        ),
        "",
        "| part | direction | steps | actions | host ms | call ms | host share |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        share = f"{r['host_share']:.2f}" if r.get("host_share") is not None else ""
        lines.append(
            f"| {r['part']} | {r['direction']} | {r.get('steps', '')} | {r.get('actions', '')} | "
            f"{_ms(r['host_seconds']['median'])} | {_ms(r['seconds']['median'])} | {share} |"
        )
    return lines + [""]


def _plan_lines(res: dict) -> list[str]:
    """The host memory plan, the time estimate against the measured seconds, who pays empty_cache."""
    out = []
    plan = res.get("host_memory_plan")
    if plan:
        peak = plan.get("rss_bytes_peak")
        measured = (
            f"; process RSS {format_bytes(plan['rss_bytes_at_start'])} when planned, peak (ru_maxrss) "
            f"{format_bytes(peak)}"
            if peak
            else ""
        )
        usable = plan.get("usable_bytes_at_start")
        out.append(
            f"- host memory plan (checked before the first timing): peak {format_bytes(plan['pinned_bytes'])} "
            f"pinned + {format_bytes(plan['pageable_bytes'])} pageable"
            + (f" of {format_bytes(usable)} usable" if usable else "")
            + measured
        )
    est = res.get("time_estimate")
    if est:
        done = res.get("part_seconds", {})
        per = ", ".join(
            f"{p} {s:.0f} s" + (f" (took {done[p]:.0f} s)" if p in done else "") for p, s in est["parts_s"].items()
        )
        took = f"; took {res['elapsed_seconds']:.0f} s" if "elapsed_seconds" in res else ""
        out.append(
            f"- time estimate {est['total_s']:.0f} s{took}: setup {est['setup_s']:.0f} s "
            f"(took {res.get('setup_seconds', 0):.0f} s), {per}, cycles {est['cycles_s']:.0f} s"
        )
    pays = res.get("pays_empty_cache")
    if pays and res["hardware"]["device"].startswith("cuda"):
        out.append(
            "- `torch.cuda.empty_cache()` after releasing device memory: paid by "
            + (", ".join(m for m, p in pays.items() if p) or "none")
            + "; not by "
            + (", ".join(m for m, p in pays.items() if not p) or "none")
        )
    return out


SUFFIXES = (".json", ".md", ".png")
"""The files one run writes: ``<stem>.json``, ``<stem>.md``, ``<stem>.png``."""


def free_stem(out_dir: Path, stem: str, overwrite: bool = False) -> str:
    """``stem``, or with ``overwrite`` false and files of that stem in ``out_dir`` already, the
    first of ``stem_2``, ``stem_3``, ... that names no file."""
    if overwrite:
        return stem
    candidate, n = stem, 1
    while any((Path(out_dir) / f"{candidate}{suffix}").exists() for suffix in SUFFIXES):
        n += 1
        candidate = f"{stem}_{n}"
    return candidate


def write_outputs(res: dict, out_dir: Path, stem: str, plot: bool = True, quiet: bool = False) -> list[Path]:
    """Write ``<stem>.json``, ``.md`` and (with ``plot``) ``.png`` to ``out_dir``; return the paths.
    Replaces files of that stem: pick the stem with :func:`free_stem`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / f"{stem}.json", out_dir / f"{stem}.md"]
    write_json_atomic(paths[0], res)  # a run killed mid-write leaves the previous part's results
    md = markdown(res)
    tmp = paths[1].with_name(f".{paths[1].name}.tmp")
    tmp.write_text(md)
    tmp.replace(paths[1])
    if plot:
        paths.append(out_dir / f"{stem}.png")
        draw(res, paths[-1])
    if not quiet:
        print(md.split("## Targets")[0])
    return paths


def rebuild(json_path: Path, plot: bool = True) -> tuple[dict, list[Path]]:
    """Write ``<stem>.md`` (and ``.png``) next to a results JSON again, from it alone; for a run
    that did not finish, with the targets of the rows it measured.

    Returns:
        The results read and the paths written.

    Raises:
        FileNotFoundError / ValueError: No such file, or not a benchmark's results (the command
            prints either as one ``error:`` line).
    """
    from chatlearn_mem_bench.targets import check_targets

    json_path = Path(json_path)
    try:
        res = json.loads(json_path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{json_path} is not JSON ({e}); pass the .json a benchmark run wrote") from None
    if not isinstance(res, dict) or not {"timings", "memory", "hardware", "config"} <= set(res):
        raise ValueError(
            f"{json_path} is not a chatlearn-mem benchmark's results (no timings, memory, hardware "
            "and config); pass the .json that `chatlearn-mem bench` wrote"
        )
    if not res.get("complete", True):
        res["targets"] = check_targets(res)
    stem, out_dir = json_path.stem, json_path.parent
    paths = [out_dir / f"{stem}.md"]
    paths[0].write_text(markdown(res))
    if plot:
        paths.append(out_dir / f"{stem}.png")
        draw(res, paths[-1])
    return res, paths


def print_targets(res: dict, echo: Callable[[str], None] = print) -> None:
    """The targets, last thing printed."""
    echo("== targets" + (" (GPU)" if res["hardware"]["device"].startswith("cuda") else " (CPU)"))
    for t in res["targets"]:
        echo(f"{'PASS' if t['passed'] else 'MISS'}  {t['name']}: {t['detail']}")
    missed = sum(not t["passed"] for t in res["targets"])
    echo(f"== {len(res['targets']) - missed} of {len(res['targets'])} targets met")
