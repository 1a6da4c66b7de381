"""Profile documents: YAML round trip, validation errors that name the field, PipeDream import, the fit."""

from __future__ import annotations

import pytest

from dapple import Profile
from dapple.core.documents import DocumentError
from dapple.core.profile import interpolate
from dapple.profiler import LayerProfile
from tests.conftest import PIPEDREAM_MODELS, pipedream_path


def _profile():
    layers = [LayerProfile(f"l{i}", [1.0 + i, 2.0 + 2 * i], [2.0, 4.0], [100, 200], [300, 600], 10 * i)
              for i in range(3)]
    return Profile(model="toy", device="cpu", batch_sizes=[4, 8], layers=layers)


def test_yaml_round_trip(tmp_path):
    p = _profile()
    p.save(tmp_path / "p.yaml")
    q = Profile.load(tmp_path / "p.yaml")
    assert q == p
    assert "dapple_profile: 1" in (tmp_path / "p.yaml").read_text()


def test_a_profile_knows_the_file_it_was_loaded_from_or_saved_to(tmp_path, monkeypatch):
    """Profile.path (absolute, not in the document): what a plan records so that `dapple simulate` finds it."""
    p = _profile()
    assert p.path is None and p.source() == {}
    monkeypatch.chdir(tmp_path)
    p.save("p.yaml")  # a relative path, recorded absolute
    assert p.path == str(tmp_path / "p.yaml") and p.source() == {"profile_file": p.path}
    assert "path" not in (tmp_path / "p.yaml").read_text()
    assert Profile.load("p.yaml").path == p.path
    assert Profile.from_dict(p.to_dict()).path is None
    vgg = Profile.from_pipedream(pipedream_path("vgg19"), 32)  # its batch size is not in the file: recorded too
    assert vgg.source() == {"profile_file": str(pipedream_path("vgg19").resolve()), "profile_batch": 32}
    vgg.save(tmp_path / "vgg19.yaml")  # now a dapple profile: no batch to give
    assert vgg.source() == {"profile_file": str(tmp_path / "vgg19.yaml")}


def test_call_ms_round_trips_and_is_left_out_when_zero(tmp_path):
    p = _profile()
    assert p.call_ms == [0.0, 0.0] and "call_ms" not in p.to_dict()  # documents without it load as before
    p.call_ms = [0.05, 0.125]
    p.save(tmp_path / "p.yaml")
    assert Profile.load(tmp_path / "p.yaml").call_ms == [0.05, 0.125]
    assert "0.050 / 0.125 ms of calling it" in str(p)


def test_step_ms_round_trips_is_left_out_when_zero_and_is_checked(tmp_path):
    p = _profile()
    assert p.step_ms == 0.0 and "step_ms" not in p.to_dict()  # documents without it load as before
    p.step_ms = 2.5
    p.save(tmp_path / "p.yaml")
    assert Profile.load(tmp_path / "p.yaml").step_ms == 2.5 and "2.5 ms" in str(p)
    with pytest.raises(ValueError, match="step_ms: expected a finite number >= 0"):
        Profile(model="toy", device="cpu", batch_sizes=[4, 8], layers=_profile().layers, step_ms=-1.0)


def test_net_ms_takes_the_call_off_each_layer_and_none_below_zero():
    p = _profile()  # at batch 4: forward 1, 2, 3 ms; backward 2 ms each
    assert p.net_ms(4) == (p.costs(4).forward_ms, p.costs(4).backward_ms)  # no call cost: the layers' own
    p.call_ms = [1.5, 0.5]
    assert p.net_ms(4) == ([0.0, 0.5, 1.5], [1.5, 1.5, 1.5])


@pytest.mark.parametrize("edit, message", [
    (lambda d: d.pop("dapple_profile"), "missing header field 'dapple_profile'"),
    (lambda d: d.update(dapple_profile=7), "dapple_profile is 7"),
    (lambda d: d["layers"][1].update(forward_ms=[1.0]), "layers[1].forward_ms: expected a list of 2 numbers"),
    (lambda d: d["layers"][2].pop("param_bytes"), "layers[2]: missing field 'param_bytes'"),
    (lambda d: d["layers"][0].update(saved_bytes=[1, -5]), "layers[0].saved_bytes[1]: expected number >= 0"),
    (lambda d: d["layers"][0].update(forward_ms=[1.0, float("nan")]), "layers[0].forward_ms[1]: expected number"),
    (lambda d: d["layers"][2].update(param_bytes=float("nan")), "layers[2].param_bytes: expected a number"),
    (lambda d: d.update(batch_sizes=[8, 4]), "batch_sizes: expected strictly increasing"),
    (lambda d: d["layers"][1].update(backward_ms=[1.0, float("inf")]), "layers[1] (l1).backward_ms: expected finite "
                                                                        "numbers >= 0, got [1.0, inf]"),
    (lambda d: d.update(batch_size=[4, 8]), "unknown field 'batch_size' (did you mean 'batch_sizes'?)"),
    (lambda d: d.update(call_ms=[0.1]), "call_ms: expected a list of 2 numbers"),
    (lambda d: d.update(call_ms=[0.1, -1]), "call_ms[1]: expected number >= 0"),
    (lambda d: d["layers"][1].update(forward=[1.0, 2.0]), "layers[1]: unknown field 'forward' (did you mean "
                                                          "'forward_ms'?)"),
])
def test_bad_yaml_names_file_and_field(tmp_path, edit, message):
    d = _profile().to_dict()
    edit(d)
    import yaml
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(d))
    with pytest.raises(DocumentError) as e:
        Profile.load(path)
    assert str(path) in str(e.value) and message in str(e.value)


@pytest.mark.parametrize("field, value, message", [
    ("forward_ms", [float("nan"), 2.0], "layers[0] (l0).forward_ms: expected finite numbers >= 0, got [nan, 2.0]"),
    ("saved_bytes", [1.0, float("inf")], "layers[0] (l0).saved_bytes: expected finite numbers >= 0"),
    ("forward_ms", ["1", 2.0], "layers[0] (l0).forward_ms: expected finite numbers >= 0, got ['1', 2.0]"),
    ("param_bytes", float("nan"), "layers[0] (l0).param_bytes: expected a finite number >= 0, got nan"),
    ("param_bytes", True, "layers[0] (l0).param_bytes: expected a finite number >= 0, got True"),
    ("name", 3, "layers[0].name: expected a string (the module path), got 3"),
    ("call_ms", [0.1, float("nan")], "Profile.call_ms: expected [forward, backward], two finite numbers >= 0"),
    ("call_ms", 0.1, "Profile.call_ms: expected [forward, backward], two finite numbers >= 0 (ms), got 0.1"),
])
def test_a_cost_that_would_fit_as_free_is_refused(field, value, message):
    """A NaN (or inf) forward time used to fit as 0 ms: the planner took the layer for free."""
    layer, extra = _profile().layers[0], {}
    if field == "call_ms":
        extra["call_ms"] = value
    else:
        setattr(layer, field, value)
    with pytest.raises((ValueError, TypeError)) as e:
        Profile(model="toy", device="cpu", batch_sizes=[4, 8], layers=[layer], **extra)
    assert message in str(e.value)


def test_not_yaml(tmp_path):
    path = tmp_path / "x.yaml"
    path.write_text("a: [1, 2\n")
    with pytest.raises(DocumentError, match="not valid YAML"):
        Profile.load(path)


def test_linear_fit_between_and_beyond_profiled_points():
    assert interpolate([4, 8], [1.0, 2.0], 6) == pytest.approx(1.5)
    assert interpolate([4, 8], [1.0, 2.0], 16) == pytest.approx(4.0)
    assert interpolate([4, 8], [1.0, 2.0], 2) == pytest.approx(0.5)
    assert interpolate([32], [3.2], 8) == pytest.approx(0.8)  # one point: proportional
    p = _profile()
    assert p.forward_ms(2, 6.0) == pytest.approx(4.5)
    assert p.costs(2.5).saved_bytes[0] == pytest.approx(187.5)


@pytest.mark.parametrize("name", sorted(PIPEDREAM_MODELS))
def test_all_shared_pipedream_profiles_import(name):
    prof = Profile.from_pipedream(pipedream_path(name), batch_size=PIPEDREAM_MODELS[name])
    assert prof.num_layers > 10 and prof.batch_sizes == [PIPEDREAM_MODELS[name]]
    assert prof.param_bytes() > 0
    assert prof.layers[-1].boundary_bytes == [0]
    assert all(all(j < i for j in layer.inputs) for i, layer in enumerate(prof.layers))


def test_pipedream_vgg19_numbers():
    prof = Profile.from_pipedream(pipedream_path("vgg19"), batch_size=32)
    assert prof.num_layers == 26
    assert prof.layers[22].name.endswith("FC1") and prof.layers[22].param_bytes == 392015625
    assert prof.layers[21].boundary_bytes == [3000000]  # the 3 MB activation between convs and FCs


def test_pipedream_skip_edges_count_in_boundary(tmp_path):
    path = tmp_path / "g.txt"
    path.write_text(
        "node1 -- a -- forward_compute_time=1, backward_compute_time=2, activation_size=10, parameter_size=0\n"
        "node2 -- b -- forward_compute_time=1, backward_compute_time=2, activation_size=20, parameter_size=5\n"
        "node3 -- c -- forward_compute_time=1, backward_compute_time=2, activation_size=30, parameter_size=0\n"
        "\tnode1 -- node2\n\tnode2 -- node3\n\tnode1 -- node3\n")
    prof = Profile.from_pipedream(path, batch_size=4)
    assert [layer.boundary_bytes[0] for layer in prof.layers] == [10, 30, 0]
    assert prof.layers[2].inputs == [0, 1]


def test_pipedream_bad_line(tmp_path):
    path = tmp_path / "g.txt"
    path.write_text("node1 -- a -- forward_compute_time=x, backward_compute_time=2, activation_size=1, "
                    "parameter_size=0\n")
    with pytest.raises(DocumentError, match=r"g.txt:1: forward_compute_time='x'"):
        Profile.from_pipedream(path, batch_size=1)


def test_fit_beyond_the_profiled_points_stays_sensible():
    # a steep (noisy) first segment: a small slice still costs at least its proportional share
    assert interpolate([4, 8], [1.0, 3.0], 1) == pytest.approx(0.25)
    assert interpolate([4, 8], [2.0, 3.0], 2) == pytest.approx(1.5)  # fixed cost: the affine value, not less
    # a falling (noisy) last segment: more rows never cost less than the last point
    assert interpolate([4, 8], [3.0, 2.0], 16) == pytest.approx(2.0)
    assert interpolate([2, 4, 8], [1.0, 2.0, 5.0], 6) == pytest.approx(3.5)


def test_weight_ms_is_optional_round_trips_and_gives_the_weight_share(tmp_path):
    layers = [LayerProfile("a", [1.0], [2.0], [0], [0], 0, weight_ms=[0.5]),
              LayerProfile("b", [1.0], [6.0], [0], [0], 0, weight_ms=[4.5])]
    prof = Profile("m", "cpu", [8], layers)
    prof.save(tmp_path / "p.yaml")
    back = Profile.load(tmp_path / "p.yaml")
    assert [layer.weight_ms for layer in back.layers] == [[0.5], [4.5]]
    assert back.weight_share(0, 2, 8) == pytest.approx(5.0 / 8.0)
    older = Profile("m", "cpu", [8], [LayerProfile("a", [1.0], [2.0], [0], [0], 0)])
    assert "weight_ms" not in older.to_dict()["layers"][0] and older.weight_share(0, 1, 8) is None
    with pytest.raises(ValueError, match=r"layers\[0\] \(a\)\.weight_ms: expected 1 values"):
        Profile("m", "cpu", [8], [LayerProfile("a", [1.0], [2.0], [0], [0], 0, weight_ms=[1.0, 2.0])])


def test_selective_measurements_round_trip_and_are_optional(tmp_path):
    import dataclasses

    from dapple.profiler import LayerProfile
    layers = [LayerProfile("a", [1.0], [2.0], [10], [20], 4, selective_bytes=[5.0], selective_ms=[0.5]),
              LayerProfile("b", [1.0], [2.0], [10], [20], 4)]
    prof = Profile("m", "cpu", [4], layers)
    prof.save(tmp_path / "p.yaml")
    back = Profile.load(tmp_path / "p.yaml")
    assert back.layers[0].selective_bytes == [5.0] and back.layers[0].selective_ms == [0.5]
    assert back.layers[1].selective_bytes is None and not back.selective
    whole = dataclasses.replace(prof, layers=[layers[0], dataclasses.replace(layers[1], selective_bytes=[1.0],
                                                                             selective_ms=[0.0])])
    assert whole.selective and whole.selective_costs(8) == ([10.0, 2.0], [1.0, 0.0])
    with pytest.raises(ValueError, match=r"layers\[0\] \(a\).selective_ms: expected 1 values"):
        Profile("m", "cpu", [4], [dataclasses.replace(layers[0], selective_ms=[0.5, 1.0])])
