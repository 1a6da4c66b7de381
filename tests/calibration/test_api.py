"""dapple.calibrate on traces made by the simulator from "true" documents that differ from the ones given: it finds
the differences (compute per stage and kind, links per class, AllReduce), and the refit documents predict the true
step, of the traced plan and of plans it never saw."""

from __future__ import annotations

import json

import pytest

import dapple
from dapple.core.timeline import Event
from dapple.planner import Stage
from dapple.profiler import LayerProfile
from tests.calibration.synthetic import simulated_trace


def profile(call_ms=(0.0, 0.0), weight=False) -> dapple.Profile:
    """8 layers profiled at 2 and 4 rows: 1 to 2.4 ms per row forward, backward 2x (a third weight gradients),
    activations of 64 KiB x (layer + 1) per row, parameters of 1 to 8 MB."""
    layers = []
    for i in range(8):
        f, act = 1.0 + 0.2 * i, 65536 * (i + 1)
        layers.append(LayerProfile(f"l{i}", [2 * f, 4 * f], [4 * f, 8 * f], [2 * act, 4 * act],
                                   [4 * 65536, 8 * 65536], (1 + i % 8) * 1_000_000,
                                   weight_ms=[4 * f / 3, 8 * f / 3] if weight else None))
    return dapple.Profile("eight", "synthetic", [2, 4], layers, call_ms=list(call_ms))


def cluster(**kw) -> dapple.Cluster:
    args = dict(servers=2, devices_per_server=2, intra_bandwidth=5e9, inter_bandwidth=1e9, intra_latency=20e-6,
                inter_latency=50e-6, device_memory=16e9)
    return dapple.Cluster(**{**args, **kw})


def plan(stages, schedule="dapple", micro=4, batch=32) -> dapple.Plan:
    """A plan of ``stages`` ((first layer, end layer, devices) each) for :func:`profile`'s 8 layers."""
    est = dapple.evaluate(profile(), cluster(), [(a, c, d) for a, c, d in stages], batch, micro, model="refined")
    return dapple.Plan(batch, micro, [Stage((a, c), d, k["warmup"]) for (a, c, d), k in
                                      zip(stages, est.details["stages"])], schedule=schedule,
                       layer_names=[f"l{i}" for i in range(8)])


HYBRID = [(0, 3, [0, 1]), (3, 6, [2]), (6, 8, [3])]  # replicated first stage, stages on both servers
ACROSS = [(0, 3, [0, 2]), (3, 6, [1]), (6, 8, [3])]  # a replicated stage on both servers, two cuts between them
STRAIGHT = [(0, 2, [0]), (2, 4, [1]), (4, 6, [2]), (6, 8, [3])]


def slowed(prof: dapple.Profile, layers: range, factor: float, backward: float | None = None) -> dapple.Profile:
    """``prof`` with ``layers`` taking ``factor`` x as long (their backward ``backward`` x if given)."""
    out = dapple.Profile.from_dict(prof.to_dict())
    for i in layers:
        layer = out.layers[i]
        b = factor if backward is None else backward
        layer.forward_ms = [v * factor for v in layer.forward_ms]
        layer.backward_ms = [v * b for v in layer.backward_ms]
        if layer.weight_ms is not None:
            layer.weight_ms = [v * b for v in layer.weight_ms]
    return out


def sim_ms(p: dapple.Plan, prof: dapple.Profile, c: dapple.Cluster) -> float:
    return dapple.simulate(p, prof, c, overlap=True).latency_ms


def test_finds_a_slow_stage_slow_links_and_a_slow_allreduce_and_predicts_the_true_step():
    base_prof, base_cl = profile(), cluster()
    running = plan(ACROSS)
    true_prof = slowed(base_prof, range(3, 6), 3.0)  # stage 1's layers 3x
    true_cl = cluster(inter_bandwidth=0.25e9, intra_latency=60e-6, inter_allreduce_bandwidth=0.1e9,
                      inter_allreduce_latency=1e-4)
    prof, cl = dapple.calibrate(base_prof, base_cl, simulated_trace(running, true_prof, true_cl))
    scales = {(s["stage"], s["kind"]): s["scale"] for s in prof.meta["calibration"]["stages"][0]}
    assert scales == pytest.approx({(0, "F"): 1.0, (0, "B"): 1.0, (1, "F"): 3.0, (1, "B"): 3.0, (2, "F"): 1.0,
                                    (2, "B"): 1.0}, rel=1e-6)
    assert cl.inter_bandwidth == pytest.approx(0.25e9, rel=1e-6)
    assert cl.inter_latency == pytest.approx(50e-6, rel=1e-3)  # several message sizes: a least-squares line
    links = cl.meta["calibration"]["links"]
    assert links["inter"]["method"] == "least squares" and links["intra"]["method"] == "scaled"  # one size
    assert cl.meta["calibration"]["allreduce"] == [{"replicas": 2, "spans_servers": True, "factor": pytest.approx(
        cl.meta["calibration"]["allreduce"][0]["factor"]), "samples": 3}]
    assert cl.inter_allreduce_bandwidth < 0.25e9
    truth = sim_ms(running, true_prof, true_cl)
    assert sim_ms(running, base_prof, base_cl) < 0.8 * truth  # the documents were far off
    assert sim_ms(running, prof, cl) == pytest.approx(truth, rel=0.01)
    acc = prof.meta["calibration"]["accuracy"][0]
    assert acc["measured_ms"] == pytest.approx(truth, rel=1e-6)
    assert abs(acc["simulated_after_error"]) < 0.01 and abs(acc["estimate_after_error"]) < 0.05
    assert acc["simulated_before_error"] < -0.2


def test_the_refit_documents_predict_plans_that_were_never_traced():
    base_prof, base_cl = profile(), cluster()
    true_prof, true_cl = slowed(base_prof, range(2, 4), 2.5), cluster(inter_bandwidth=0.4e9)
    prof, cl = dapple.calibrate(base_prof, base_cl, simulated_trace(plan(STRAIGHT), true_prof, true_cl))
    for stages in (HYBRID, [(0, 4, [0, 1]), (4, 8, [2, 3])], [(0, 5, [0]), (5, 8, [1, 2, 3])]):
        held_out = plan(stages)
        assert sim_ms(held_out, prof, cl) == pytest.approx(sim_ms(held_out, true_prof, true_cl), rel=0.01), stages


def test_several_traces_are_pooled_and_a_layer_gets_its_own_scale():
    base_prof, base_cl = profile(), cluster()
    true_prof = slowed(base_prof, range(4, 5), 2.0)  # one layer of a 2-layer stage in STRAIGHT
    a = simulated_trace(plan(STRAIGHT), true_prof, base_cl)
    b = simulated_trace(plan([(0, 4, [0]), (4, 5, [1]), (5, 8, [2, 3])]), true_prof, base_cl)
    prof, _ = dapple.calibrate(base_prof, base_cl, [a, b])
    ratio = [p.forward_ms[1] / q.forward_ms[1] for p, q in zip(prof.layers, base_prof.layers)]
    assert ratio[4] > ratio[5] > 1.0 and ratio[0] == pytest.approx(1.0)  # b sees layer 4 alone
    assert len(prof.meta["calibration"]["traces"]) == 2


def test_a_split_backward_gets_separate_input_and_weight_gradient_scales():
    base_prof, base_cl = profile(weight=True), cluster()
    running = plan(STRAIGHT, schedule="zb-h1")
    true_prof = dapple.Profile.from_dict(base_prof.to_dict())
    for layer in true_prof.layers[2:4]:  # stage 1: weight gradients 3x, input gradients as profiled
        extra = [2 * w for w in layer.weight_ms]
        layer.weight_ms = [w * 3 for w in layer.weight_ms]
        layer.backward_ms = [b + e for b, e in zip(layer.backward_ms, extra)]
    prof, cl = dapple.calibrate(base_prof, base_cl, simulated_trace(running, true_prof, base_cl))
    scales = {(s["stage"], s["kind"]): s["scale"] for s in prof.meta["calibration"]["stages"][0]}
    assert scales[(1, "W")] == pytest.approx(3.0) and scales[(1, "B")] == pytest.approx(1.0)
    assert (0, "B") not in scales and scales[(0, "W")] == pytest.approx(1.0)  # stage 0's B is empty under zb-h1
    assert sim_ms(running, prof, cl) == pytest.approx(sim_ms(running, true_prof, base_cl), rel=1e-6)
    assert prof.weight_share(2, 4, 4) == pytest.approx(true_prof.weight_share(2, 4, 4))


def test_a_stage_pays_its_call_cost_once_after_scaling():
    base = profile(call_ms=(0.5, 0.8))
    running = plan(STRAIGHT)
    true_prof = slowed(base, range(0, 8), 1.0)
    # the truth: every stage op takes 2x its modelled time (layers' net times and the call cost alike)
    for layer in true_prof.layers:
        layer.forward_ms = [2 * v - 0.5 for v in layer.forward_ms]  # net 2x, call once: 2 * (2 nets + call)
        layer.backward_ms = [2 * v - 0.8 for v in layer.backward_ms]
    true_prof.call_ms = [1.0, 1.6]
    prof, cl = dapple.calibrate(base, cluster(), simulated_trace(running, true_prof, cluster()))
    assert sim_ms(running, prof, cl) == pytest.approx(sim_ms(running, true_prof, cluster()), rel=1e-6)


def test_runtime_gaps_between_ops_become_a_per_op_cost():
    base, c = profile(call_ms=(0.1, 0.2)), cluster()
    running = plan(STRAIGHT)  # M = 8: 16 ops per rank
    events, meta = simulated_trace(running, base, c, steps=2)
    shifted = []
    for e in events:  # 0.3 ms of runtime work before each op but the first: every later event of the rank pushed back
        if e.kind in ("forward", "backward", "idle"):
            k = sum(1 for x in events if x.rank == e.rank and x.args["step"] == e.args["step"]
                    and x.kind in ("forward", "backward") and x.start <= e.start and x is not e)
            e = Event(e.rank, e.kind, e.name, e.start + k * 3e-4, e.end + k * 3e-4, e.micro_batch, e.args)
        shifted.append(e)
    prof, _ = dapple.calibrate(base, c, (shifted, meta))
    overhead = prof.meta["calibration"]["overhead_ms_per_op"]
    assert 0.0 < overhead <= 0.3 * 15 / 16 + 1e-6  # the gaps right before an op (not those before a wait)
    assert prof.call_ms == pytest.approx([0.1 + overhead, 0.2 + overhead], abs=1e-4)
    net = [f - p for f, p in zip(prof.net_ms(4)[0], base.net_ms(4)[0])]
    assert net == pytest.approx([0.0] * 8, abs=1e-9)  # the layers' own times are as measured (unchanged)


def test_the_steps_fixed_cost_after_its_work_becomes_step_ms():
    base, c = profile(), cluster()
    running = plan(HYBRID)
    prof, cl = dapple.calibrate(base, c, simulated_trace(running, base, c, tail_ms=6.0))
    assert prof.step_ms == pytest.approx(6.0) and prof.meta["calibration"]["step_ms"] == pytest.approx(6.0)
    assert sim_ms(running, prof, cl) == pytest.approx(sim_ms(running, base, c) + 6.0)
    assert prof.meta["calibration"]["accuracy"][0]["simulated_after_error"] == pytest.approx(0.0, abs=1e-4)


def test_one_message_size_scales_the_link_and_no_message_leaves_it():
    base, c = profile(), cluster()
    one_size = dapple.Profile.from_dict(base.to_dict())
    for layer in one_size.layers:
        layer.boundary_bytes = [2 * 65536, 4 * 65536]
    running = plan(STRAIGHT)
    true_cl = cluster(intra_latency=100e-6, intra_bandwidth=2.5e9)
    prof, cl = dapple.calibrate(one_size, c, simulated_trace(running, one_size, true_cl))
    fit = cl.meta["calibration"]["links"]["intra"]
    assert fit["method"] == "scaled" and fit["samples"] > 0
    k = fit["measured_median_s"] / fit["modelled_median_s"]
    assert cl.intra_latency == pytest.approx(20e-6 * k) and cl.intra_bandwidth == pytest.approx(5e9 / k)
    assert cl.meta["calibration"]["links"]["inter"]["method"] != "unchanged"
    one_server = plan([(0, 4, [0]), (4, 8, [1])])
    _, cl = dapple.calibrate(base, c, simulated_trace(one_server, base, c))
    assert cl.meta["calibration"]["links"]["inter"]["method"] == "unchanged"
    assert cl.inter_bandwidth == c.inter_bandwidth and cl.inter_latency == c.inter_latency


def test_documents_are_plain_yaml_with_provenance_and_the_inputs_are_untouched(tmp_path):
    base, c = profile(), cluster()
    before_p, before_c = json.dumps(base.to_dict()), json.dumps(c.to_dict())
    running = plan(HYBRID)
    path = tmp_path / "trace.json"
    from dapple.core.timeline import save_chrome_trace
    events, meta = simulated_trace(running, slowed(base, range(0, 3), 1.5), c)
    save_chrome_trace(events, path, meta)
    prof, cl = dapple.calibrate(base, c, str(path), skip=1)
    assert json.dumps(base.to_dict()) == before_p and json.dumps(c.to_dict()) == before_c
    prof.save(tmp_path / "p.yaml")
    cl.save(tmp_path / "c.yaml")
    p2, c2 = dapple.Profile.load(tmp_path / "p.yaml"), dapple.Cluster.load(tmp_path / "c.yaml")
    cal = p2.meta["calibration"]
    assert cal["traces"] == [str(path)] and cal["steps"] == [[2, 3]] and cal["plans"][0] == running.to_dict()
    assert c2.meta["calibration"]["traces"] == [str(path)]
    assert sim_ms(running, p2, c2) == pytest.approx(sim_ms(running, prof, cl), rel=1e-5)


def test_bad_traces_are_named():
    base, c = profile(), cluster()
    with pytest.raises(ValueError, match="holds no plan"):
        dapple.calibrate(base, c, {"traceEvents": [], "otherData": {}})
    events, meta = simulated_trace(plan(STRAIGHT), base, c, steps=1)
    with pytest.raises(ValueError, match="none left after skipping 1"):
        dapple.calibrate(base, c, (events, meta), skip=1)
    with pytest.raises(ValueError, match="devices"):
        dapple.calibrate(base, cluster(servers=1), (events, meta))
    other = dapple.Profile.from_dict({**base.to_dict(), "layers": base.to_dict()["layers"][:7]})
    with pytest.raises(ValueError, match="layer"):
        dapple.calibrate(other, c, (events, meta))
    with pytest.raises(ValueError, match="expected at least one trace"):
        dapple.calibrate(base, c, [])
    chunks = dapple.Plan(32, 4, [Stage((0, 2), [0]), Stage((2, 4), [1]), Stage((4, 6), [1]), Stage((6, 8), [0])],
                         schedule="zb-v", layer_names=[f"l{i}" for i in range(8)])
    with pytest.raises(ValueError, match=r"several chunks on a device \(device 0: stages 0, 3\)"):
        dapple.calibrate(base, c, (events, {**meta, "plan": chunks.to_dict()}))
