"""Whether Ray can place the worker pools a deployment asks for, checked before any worker starts.

A pool's ``min_replicas`` actors each ask for ``cpus``, ``gpus`` and custom ``resources``; an actor Ray cannot
place waits forever, silently. :func:`placement_problems` compares what the pools ask with what the cluster
has (in all, and per node: one actor must fit on one node) and names every shortfall with the flag that
changes it; ``LocalCluster.start`` refuses to start on a cluster it started itself, and warns on one it
joined (an autoscaling cluster may still grow).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

FLAGS = {"CPU": "--worker-cpus", "GPU": "--worker-gpus"}


def demand(specs: Mapping) -> dict[str, float]:
    """Resources the pools' minimum replicas ask for in all: {"CPU": ..., "GPU": ..., custom: ...}."""
    total: dict[str, float] = {}
    for spec in specs.values():
        for name, amount in _asks(spec).items():
            total[name] = total.get(name, 0.0) + amount * spec.min_replicas
    return total


def _asks(spec) -> dict[str, float]:
    """One actor's ask."""
    asks = {
        "CPU": float(spec.cpus),
        "GPU": float(spec.gpus),
        **{k: float(v) for k, v in spec.resources.items()},
    }
    return {k: v for k, v in asks.items() if v > 0}


def placement_problems(
    specs: Mapping, total: Mapping[str, float], nodes: Sequence[Mapping[str, float]]
) -> list[str]:
    """What cannot be placed ([] when everything fits): ``total`` is the cluster's resources, ``nodes`` each
    live node's."""
    problems = []
    for name, need in sorted(demand(specs).items()):
        have = float(total.get(name, 0.0))
        if need > have + 1e-9:
            parts = " + ".join(
                f"{spec.min_replicas} {kind} x {_asks(spec).get(name, 0):g}"
                for kind, spec in specs.items()
                if _asks(spec).get(name, 0)
            )
            flag = FLAGS.get(name, "--node-groups / the nodes' custom resources")
            problems.append(
                f"the worker pools ask Ray for {need:g} {name} ({parts}) but the cluster has {have:g}: "
                f"start fewer workers (--prefill, --decode) or ask less each ({flag})"
            )
    for kind, spec in specs.items():
        asks = _asks(spec)
        if nodes and not any(all(node.get(k, 0.0) + 1e-9 >= v for k, v in asks.items()) for node in nodes):
            want = ", ".join(f"{v:g} {k}" for k, v in sorted(asks.items()))
            problems.append(f"no node has what one {kind} worker asks for ({want})")
    return problems
