"""Turn per-rank job outputs into the figures stored in the JSON results file."""

from __future__ import annotations

import torch

from .modes import Mode

MB = 1024 * 1024


def percentile(values: list[float], q: float) -> float:
    return torch.quantile(torch.tensor(values, dtype=torch.float64), q).item()


def wire_bytes_per_rank(comm: dict[str, int], world_size: int) -> int:
    """Bytes each rank sends with ring collectives: all_reduce 2(n-1)/n, gather/scatter (n-1)/n."""
    n = world_size
    factor = {
        "all_reduce": 2 * (n - 1) / n,
        "all_gather": (n - 1) / n,
        "reduce_scatter": (n - 1) / n,
    }
    return int(sum(factor[kind] * b for kind, b in comm.items()))


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    if a.keys() != b.keys():
        raise ValueError(f"parameter names differ: {sorted(a.keys() ^ b.keys())}")
    return max((a[k] - b[k]).abs().max().item() for k in a)


def summarize(mode: Mode, ranks: list[dict], comm: dict[str, int], world_size: int) -> dict:
    """One record of figures for a (model, mode) job, from every rank's result dict.

    ``params`` (rank 0's full parameters) is kept under ``_params`` for the parity check and is
    not written to JSON.
    """
    failed = [r for r in ranks if r["status"] != "ok"]
    record = {
        "mode": mode.name,
        "description": mode.description,
        "reference": mode.reference,
        "sharded": mode.sharded,
        "ablation": mode.ablation,
        "ablation_of": mode.ablation_of,
        "status": "ok",
    }
    if failed:
        # Prefer a rank's own diagnosis over a peer's "timed out" waiting for it.
        first = next((r for r in failed if r["status"] == "n/a"), failed[0])
        record.update(status=first["status"], reason=first.get("reason", ""))
        if "traceback" in first:
            record["traceback"] = first["traceback"]
        return record
    r0 = ranks[0]
    steps_ms = [1000 * s for s in r0["step_seconds"]]
    record.update(
        step_ms={
            "median": percentile(steps_ms, 0.5),
            "p10": percentile(steps_ms, 0.1),
            "p90": percentile(steps_ms, 0.9),
            "min": min(steps_ms),
            "max": max(steps_ms),
        },
        steps_ms=steps_ms,
        cpu_ms_median=percentile([1000 * s for s in r0["step_cpu_seconds"]], 0.5),
        first_call_s=r0["first_call_seconds"],
        compile_s=r0["compile_seconds"],
        compiles=r0["compiles"],
        compiles_while_timed=r0["compiles_while_timed"],
        graph_collectives=r0["graph_collectives"],
        persistent_bytes_per_rank=[
            None if r["persistent_bytes"] is None else r["persistent_bytes"]["total"] for r in ranks
        ],
        persistent_breakdown_per_rank=[r["persistent_bytes"] for r in ranks],
        rss_peak_mb_per_rank=[r["rss_peak_bytes"] / MB for r in ranks],
        rss_base_mb_per_rank=[r["rss_base_bytes"] / MB for r in ranks],
        memory_per_rank=[r.get("memory") for r in ranks],
        comm_bytes_per_step=comm,
        comm_total_bytes=sum(comm.values()),
        wire_bytes_per_rank=wire_bytes_per_rank(comm, world_size),
        loss_rank0=r0["loss"],
        profile=r0["profile"],
        _params=r0["params"],
    )
    return record


def shared_core_bound(ok: dict[str, dict]) -> float | None:
    """compute's median + comm's CPU time per step (ms): the bound for a replicate step when
    every core runs a rank, so a rank's collective work (gloo's reductions and loopback copies)
    shares a core with its compute instead of overlapping it. None without both references."""
    if not {"compute", "comm"} <= ok.keys():
        return None
    return ok["compute"]["step_ms"]["median"] + ok["comm"]["cpu_ms_median"]


def add_comparisons(records: list[dict]) -> float | None:
    """Fill ratios and parity in place; returns the lower bound in ms (or None).

    Lower bound = max(compute, comm) medians. Parity = max |param - DDP's param| after the same
    steps on the same data from the same initialization.
    """
    ok = {r["mode"]: r for r in records if r["status"] == "ok"}
    median = {name: r["step_ms"]["median"] for name, r in ok.items()}
    lower = max(median["compute"], median["comm"]) if {"compute", "comm"} <= median.keys() else None
    shared = shared_core_bound(ok)
    ddp_params = ok["ddp"]["_params"] if "ddp" in ok else None
    ddp_cpu = ok["ddp"]["cpu_ms_median"] if "ddp" in ok else None
    for r in ok.values():
        m = r["step_ms"]["median"]
        r["ratio_to_ddp"] = m / median["ddp"] if "ddp" in median else None
        r["ratio_to_ddp_tuned"] = m / median["ddp_tuned"] if "ddp_tuned" in median else None
        r["ratio_to_fsdp2"] = m / median["fsdp2"] if "fsdp2" in median else None
        for ref in ("ddp_compile", "fsdp2_compile"):  # the torch.compile peers
            r[f"ratio_to_{ref}"] = m / median[ref] if ref in median else None
        r["ratio_to_lower_bound"] = m / lower if lower else None
        r["ratio_to_shared_core_bound"] = m / shared if shared and not r["sharded"] else None
        r["cpu_ratio_to_ddp"] = r["cpu_ms_median"] / ddp_cpu if ddp_cpu else None
        params = r.pop("_params")
        r["parity_max_abs_diff"] = (
            max_abs_diff(params, ddp_params) if params is not None and ddp_params else None
        )
    return lower
