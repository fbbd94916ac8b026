"""What Ray cannot place is named before any worker starts (``deploy/placement.py``)."""

from __future__ import annotations

from vlkv.deploy.autoscaler import PoolSpec
from vlkv.deploy.placement import demand, placement_problems


def test_demand_sums_the_minimum_replicas():
    specs = {"prefill": PoolSpec(min_replicas=3, max_replicas=5), "decode": PoolSpec(cpus=0.5, gpus=1.0)}
    assert demand(specs) == {"CPU": 3.5, "GPU": 1.0}


def test_fits_and_shortfalls():
    specs = {"prefill": PoolSpec(min_replicas=2, max_replicas=2), "decode": PoolSpec(gpus=1.0)}
    assert placement_problems(specs, {"CPU": 4, "GPU": 1}, [{"CPU": 4, "GPU": 1}]) == []
    [cpu] = placement_problems(specs, {"CPU": 2, "GPU": 1}, [{"CPU": 2, "GPU": 1}])
    assert "3 CPU" in cpu and "has 2" in cpu and "--worker-cpus" in cpu
    gpu = placement_problems(specs, {"CPU": 8}, [{"CPU": 8}])
    assert any("GPU" in p and "--worker-gpus" in p for p in gpu)


def test_an_actor_must_fit_on_one_node():
    specs = {"prefill": PoolSpec(cpus=3.0), "decode": PoolSpec()}
    problems = placement_problems(specs, {"CPU": 4}, [{"CPU": 2}, {"CPU": 2}])
    assert problems == ["no node has what one prefill worker asks for (3 CPU)"]


def test_custom_resources_name_the_node_groups():
    specs = {"prefill": PoolSpec(resources={"vlkv_prefill": 1.0}), "decode": PoolSpec()}
    [p] = placement_problems(specs, {"CPU": 4}, [])
    assert "vlkv_prefill" in p and "--node-groups" in p
