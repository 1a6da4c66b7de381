"""Emulated-accelerator layers hold for their set time (forward rows x ms, backward twice that)."""

import time

import torch

from dapple.models import EmulatedLayer
from dapple.models.emulated import hold


def _elapsed_ms(fn) -> float:
    t = time.perf_counter()
    fn()
    return 1e3 * (time.perf_counter() - t)


def test_hold_is_never_short_and_rarely_late():
    took = sorted(_elapsed_ms(lambda: hold(0.003)) for _ in range(9))
    assert took[0] >= 3.0  # never returns early: the busy-wait ends on the deadline
    assert took[4] < 3.0 + 5.0  # median: generous for a loaded CI machine


def test_layer_forward_and_backward_times_scale_with_rows():
    torch.manual_seed(0)
    layer = EmulatedLayer(4, ms_per_row=0.5)
    x = torch.randn(6, 4)  # 6 rows: forward 3 ms, backward 6 ms
    out = {}
    fwd = _elapsed_ms(lambda: out.setdefault("y", layer(x)))
    bwd = _elapsed_ms(lambda: out["y"].sum().backward())
    assert fwd >= 3.0 and bwd >= 6.0
    assert layer.linear.weight.grad is not None  # the Linear before the hold still gets its gradient


def test_weight_share_is_held_in_the_weight_gradient_backward():
    """weight_share=0.5: half of the backward holds on the weight's path, which a split backward runs in W."""
    from dapple.core.backward import backward_input, backward_weight
    torch.manual_seed(0)
    layer = EmulatedLayer(4, ms_per_row=1.0, weight_share=0.5)
    x = torch.randn(6, 4, requires_grad=True)  # 6 rows: forward 6 ms, backward 12 ms: B 6, W 6
    params = list(layer.parameters())
    y = layer(x)
    backward_weight(backward_input([y], [torch.ones_like(y)], [x], params)[1])  # first: autograd's one-off costs
    layer.zero_grad()
    y, out = layer(x), {}
    b = _elapsed_ms(lambda: out.setdefault("b", backward_input([y], [torch.ones_like(y)], [x], params)))
    w = _elapsed_ms(lambda: backward_weight(out["b"][1]))
    assert 6.0 <= b < 6.0 + 5.0 and 6.0 <= w < 6.0 + 5.0, (b, w)
    ref = EmulatedLayer(4, ms_per_row=0.0)
    ref.load_state_dict(layer.state_dict())
    ref(x).sum().backward()
    torch.testing.assert_close(layer.linear.weight.grad, ref.linear.weight.grad)
    torch.testing.assert_close(out["b"][0][0], x.grad)


def test_slow_down_takes_effect_in_a_traced_graph_and_is_not_state():
    """The factor is read at run time (a traced graph bakes ms_per_row in as a constant), on this copy only."""
    from dapple.profiler import trace_layers
    torch.manual_seed(0)
    layer = EmulatedLayer(4, ms_per_row=1.0)
    gm = trace_layers(torch.nn.Sequential(layer)).gm
    x = torch.randn(2, 4)
    gm(x)  # first call: autograd's one-off costs
    normal = min(_elapsed_ms(lambda: gm(x)) for _ in range(3))
    layer.slow_down(4.0)
    slow = min(_elapsed_ms(lambda: gm(x)) for _ in range(3))
    assert normal >= 2.0 and slow >= 8.0 and slow > 2.5 * normal, (normal, slow)
    assert "slowdown" not in "".join(layer.state_dict())
    try:
        layer.slow_down(0.0)
        raise AssertionError("a factor of 0 was accepted")
    except ValueError as e:
        assert "factor > 0" in str(e)
