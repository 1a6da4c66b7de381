"""Plan and Cluster documents: round trips, validation naming values, presets, topology graph."""

from __future__ import annotations

import pytest
import yaml

from dapple import Cluster, Plan
from dapple.core.documents import DocumentError
from dapple.planner import Estimate, Stage


def _plan(**kw):
    args = dict(global_batch_size=16, micro_batch_size=4,
                stages=[Stage((0, 3), [0, 1]), Stage((3, 5), [2])], layer_names=list("abcde"))
    args.update(kw)
    return Plan(**args)


def test_plan_defaults_and_round_trip(tmp_path):
    p = _plan(estimate=Estimate(10.0, 2.0, 6.0, 2.0, 1, details={"bubble_fraction": 0.25}))
    assert p.num_micro_batches == 4 and p.warmup == [2, 1]
    p.save(tmp_path / "plan.yaml")
    q = Plan.load(tmp_path / "plan.yaml")
    assert q == p
    text = str(q)
    assert "[0, 3) a .. c" in text and "0-1 (x2)" in text and "pivot stage Q = 1" in text


def test_plan_shape_in_the_papers_notation():
    assert _plan().shape == "2:1"
    assert _plan(stages=[Stage((0, 5), [0, 1, 2])]).shape == "DP"
    assert _plan(stages=[Stage((0, 1), [0]), Stage((1, 3), [1]), Stage((3, 5), [2])]).shape == "straight3"


@pytest.mark.parametrize("kw, message", [
    (dict(micro_batch_size=5), "not divisible by micro_batch_size 5"),
    # no K_i given: checked before the policy's K_i are worked out from M = global / micro
    (dict(micro_batch_size=0), "Plan.micro_batch_size: expected a positive integer, got 0"),
    (dict(micro_batch_size=-2), "Plan.micro_batch_size: expected a positive integer, got -2"),
    (dict(micro_batch_size=32), "global_batch_size 16 is not divisible by micro_batch_size 32"),
    (dict(global_batch_size=True), "Plan.global_batch_size: expected a positive integer, got True"),
    (dict(stages=[Stage((0, 2), [0]), Stage((3, 5), [1])]), "starting at layer 2"),
    (dict(stages=[Stage((0, 3.0), [0]), Stage((3, 5), [1])]), "stages[0].layers: expected a non-empty range"),
    (dict(stages=[Stage((0, 3), [0, 1]), Stage((3, 5), [1])]), "device 1 is already in stage 0"),
    (dict(stages=[Stage((0, 3), [0]), Stage((3, 5), [2])]), "device ids must be 0..1"),
    (dict(stages=[Stage((0, 3), [0]), Stage((3, 5), [True])]), "expected device ids >= 0, got True"),
    (dict(stages=[Stage((0, 3), [0], True), Stage((3, 5), [1], 1)]), "K_0 must be a positive integer, got True"),
    (dict(stages=[Stage((0, 3), [0], 2.5), Stage((3, 5), [1], 1)]), "K_0 must be a positive integer, got 2.5"),
    (dict(stages=[Stage((0, 5), [0, 1, 2, 3, 4])]), "5 replicas cannot split a micro-batch of 4"),
    (dict(schedule="1f1b"), "schedule: expected one of"),
    (dict(stages=[Stage((0, 3), [0], 1), Stage((3, 5), [1], 2)]), "K_1=2 exceeds K_0=1"),
    (dict(layer_names=list("abc")), "stages cover 5 layers but layer_names lists 3"),
])
def test_invalid_plans_name_the_value(kw, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        _plan(**kw)


def test_bad_plan_file_names_file(tmp_path):
    d = _plan().to_dict()
    d["stages"][1]["devices"] = "two"
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(d))
    with pytest.raises(DocumentError, match=r"p.yaml.stages\[1\].devices: expected a list of integers"):
        Plan.load(path)


@pytest.mark.parametrize("edit, message", [
    (lambda d: d.update(warmup_polcy="B"), "p.yaml: unknown field 'warmup_polcy' (did you mean 'warmup_policy'?); "
                                           "known: dapple_plan, global_batch_size"),
    (lambda d: d.update(schedul="gpipe"), "unknown field 'schedul' (did you mean 'schedule'?)"),
    (lambda d: d.update(note="x"), "p.yaml: unknown field 'note'; known: dapple_plan, global_batch_size, "
                                   "micro_batch_size, schedule, warmup_policy, stages, layer_names, estimate, meta, "
                                   "mixed_precision, reduce_dtype, shard_optimizer, tracing; "
                                   "free-form values go under 'meta'"),
    (lambda d: d["stages"][1].update(warmpu=4), "p.yaml.stages[1]: unknown field 'warmpu' (did you mean 'warmup'?)"),
    (lambda d: d["estimate"].update(latency=1.0), "p.yaml.estimate: unknown field 'latency' (did you mean "),
    (lambda d: d.update(meta=[1, 2]), "p.yaml.meta: expected a mapping, got [1, 2]"),
])
def test_a_misspelt_field_is_named_not_ignored(tmp_path, edit, message):
    d = _plan(estimate=Estimate(10.0, 2.0, 6.0, 2.0, 1)).to_dict()
    edit(d)
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(d))
    with pytest.raises(DocumentError) as e:
        Plan.load(path)
    assert message in str(e.value)


def test_cluster_presets_and_links():
    a = Cluster.preset("A")
    assert (a.servers, a.devices_per_server, a.num_devices) == (2, 8, 16)
    assert a.link(0, 7) == (a.intra_bandwidth, a.intra_latency)
    assert a.link(7, 8) == (a.inter_bandwidth, a.inter_latency)
    assert a.span_link(range(8))[0] == a.intra_bandwidth and a.span_link([0, 8])[0] == a.inter_bandwidth
    assert a.inter_bandwidth == pytest.approx(25e9 / 8)
    assert Cluster.preset("c").inter_bandwidth == pytest.approx(10e9 / 8)
    assert Cluster.preset("B").num_devices == 16
    assert a.path(0, 9) == [("device", 0), ("server", 0), "network", ("server", 1), ("device", 9)]
    for c, (x, y) in ((a, (0, 9)), (a, (0, 7)), (Cluster.preset("B"), (0, 5))):  # edge latencies add up to link's
        g = c.graph()
        path = c.path(x, y)
        assert sum(g.edges[u, v]["latency"] for u, v in zip(path, path[1:])) == pytest.approx(c.link(x, y)[1])
    with pytest.raises(ValueError, match="unknown cluster preset 'D'"):
        Cluster.preset("D")


def test_cluster_round_trip_and_errors(tmp_path):
    c = Cluster(servers=2, devices_per_server=4, intra_bandwidth=1e10, inter_bandwidth=1e9)
    c.save(tmp_path / "c.yaml")
    assert Cluster.load(tmp_path / "c.yaml") == c
    with pytest.raises(ValueError, match=r"devices_per_server: expected a positive integer, got 0"):
        Cluster(servers=1, devices_per_server=0, intra_bandwidth=1, inter_bandwidth=1)
    for bad in (float("nan"), True, float("inf")):  # none is a number of seconds (inf made estimates 0 ms)
        with pytest.raises(ValueError, match=rf"Cluster.inter_latency: expected a finite number of seconds >= 0, "
                                             rf"got {bad}"):
            Cluster(servers=1, devices_per_server=2, intra_bandwidth=1, inter_bandwidth=1, inter_latency=bad)
        with pytest.raises(ValueError, match=rf"Cluster.inter_allreduce_latency: expected None .* got {bad}"):
            Cluster(servers=1, devices_per_server=2, intra_bandwidth=1, inter_bandwidth=1, inter_allreduce_latency=bad)
    for key in ("device_memory", "inter_bandwidth"):  # an inf device memory overflowed the K_i bound D
        with pytest.raises(ValueError, match=rf"Cluster.{key}: expected a positive finite number, got inf"):
            Cluster(**{**dict(servers=1, devices_per_server=2, intra_bandwidth=1, inter_bandwidth=1),
                       key: float("inf")})
    with pytest.raises(ValueError, match=r"Cluster.preset: servers: expected a positive integer, got 0"):
        Cluster.preset("A", servers=0)
    assert Cluster.local(3, measure=False).num_devices == 3
    shared = Cluster(servers=1, devices_per_server=2, intra_bandwidth=1, inter_bandwidth=1, link_sharing="shared")
    shared.save(tmp_path / "s.yaml")
    assert Cluster.load(tmp_path / "s.yaml").link_sharing == "shared" and c.link_sharing == "held"
    with pytest.raises(ValueError, match=r"link_sharing: expected one of \('held', 'shared'\), got 'fair'"):
        Cluster(servers=1, devices_per_server=2, intra_bandwidth=1, inter_bandwidth=1, link_sharing="fair")
    d = c.to_dict()
    d["inter_bandwith"] = d.pop("inter_bandwidth")
    (tmp_path / "typo.yaml").write_text(yaml.safe_dump(d))
    with pytest.raises(DocumentError, match=r"typo.yaml: unknown field 'inter_bandwith' \(did you mean "
                                            r"'inter_bandwidth'\?\)"):
        Cluster.load(tmp_path / "typo.yaml")


def test_measured_allreduce_numbers_override_the_links():
    fits = {"servers": 2, "devices_per_server": 4, "intra": (1e-5, 1e10), "inter": (5e-5, 1e9),
            "allreduce": (2e-4, 5e8), "allreduce_intra": (3e-5, 4e9), "hosts": ["a", "b"]}
    c = Cluster.from_probe(fits, device_memory=8e9)
    assert (c.servers, c.devices_per_server, c.intra_bandwidth, c.inter_latency) == (2, 4, 1e10, 5e-5)
    assert c.allreduce_link(range(4)) == (4e9, 3e-5) and c.allreduce_link([0, 4]) == (5e8, 2e-4)
    assert c.link(0, 5) == (1e9, 5e-5)  # P2P keeps the link numbers
    plain = Cluster(servers=2, devices_per_server=4, intra_bandwidth=1e10, inter_bandwidth=1e9)
    assert plain.allreduce_link([0, 4]) == (1e9, plain.inter_latency)
    with pytest.raises(ValueError, match="intra_allreduce_bandwidth: expected None or a positive number, got 0"):
        Cluster(servers=1, devices_per_server=2, intra_bandwidth=1, inter_bandwidth=1, intra_allreduce_bandwidth=0)


def test_allreduce_numbers_by_group_size(tmp_path):
    fits = {"servers": 1, "devices_per_server": 4, "intra": (1e-4, 2e9), "allreduce": (1e-3, 1e9),
            "allreduce_by_size": {2: (1e-4, 2e9), 4: (1e-3, 1e9)}, "hosts": ["a"]}
    c = Cluster.from_probe(fits)
    assert c.intra_allreduce_by_size == {2: [1e-4, 2e9], 4: [1e-3, 1e9]}
    assert c.allreduce_link([0, 1]) == (2e9, 1e-4) and c.allreduce_link(range(4)) == (1e9, 1e-3)
    bw, lat = c.allreduce_link([0, 1, 2])  # halfway: latency and seconds per byte interpolated
    assert lat == pytest.approx(5.5e-4) and 1 / bw == pytest.approx(0.5 / 2e9 + 0.5 / 1e9)
    assert c.allreduce_link(spans_servers=False, replicas=8) == (1e9, 1e-3)  # past the largest measured size
    assert c.allreduce_link(spans_servers=False) == (1e9, 1e-3)  # no size given: the whole-server numbers
    c.save(tmp_path / "c.yaml")
    assert Cluster.load(tmp_path / "c.yaml") == c
    with pytest.raises(ValueError, match=r"intra_allreduce_by_size: group sizes must be integers >= 2, got 1"):
        Cluster(servers=1, devices_per_server=2, intra_bandwidth=1, inter_bandwidth=1,
                intra_allreduce_by_size={1: [0.0, 1e9]})
    with pytest.raises(ValueError, match=r"intra_allreduce_by_size\[2\]: expected \[latency s >= 0, bandwidth"):
        Cluster(servers=1, devices_per_server=2, intra_bandwidth=1, inter_bandwidth=1,
                intra_allreduce_by_size={2: [0.0, 0.0]})


def test_yaml_numbers_in_scientific_notation_without_a_dot(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("dapple_cluster: 1\nservers: 2\ndevices_per_server: 8\nintra_bandwidth: 130e9\n"
                    "inter_bandwidth: 3.125E9\ninter_latency: 30e-6\n")
    c = Cluster.load(path)
    assert (c.intra_bandwidth, c.inter_bandwidth, c.inter_latency) == (130e9, 3.125e9, 30e-6)


def test_a_stage_that_recomputes_round_trips_and_only_then_is_written(tmp_path):
    plan = Plan(global_batch_size=8, micro_batch_size=4,
                stages=[Stage((0, 2), [0]), Stage((2, 4), [1], recompute=True)])
    plan.save(tmp_path / "p.yaml")
    doc = yaml.safe_load((tmp_path / "p.yaml").read_text())
    assert [("recompute" in st) for st in doc["stages"]] == [False, True]
    assert [s.recompute for s in Plan.load(tmp_path / "p.yaml").stages] == [False, True]
    doc["stages"][0]["recompute"] = "yes"
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(doc))
    with pytest.raises(DocumentError, match=r"stages\[0\]\.recompute: expected false, true, layers or selective, got "
                                            r"'yes'"):
        Plan.load(tmp_path / "bad.yaml")
