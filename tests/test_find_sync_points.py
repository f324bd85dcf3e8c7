import inspect

import torch

from compile_pass import _compat
from compile_pass.find_sync_points import attribute_name, find_cpu_mirrors, find_sync_points
from passlib import make_fb


def line_of(fn, marker):
    lines, start = inspect.getsourcelines(fn)
    for i, text in enumerate(lines):
        if marker in text:
            return f"test_find_sync_points.py:{start + i}"
    raise AssertionError(marker)


def capture(fn, *args):
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    with _compat.capture_scalar_outputs():
        torch.compile(fn, backend=backend, fullgraph=True)(*args)
    graph = graphs[0].graph
    mirrors = find_cpu_mirrors(graph, {})
    return find_sync_points(graph, mirrors), mirrors


def spellings(x, fb):
    a = fb.seq_lens.max().item()  # @item
    b = int(fb.seq_lens.max())  # @int
    c = torch.max(fb.seq_lens).item()  # @torchmax
    d = fb.seq_lens.amax().item()  # @amax
    e = max(fb.seq_lens.tolist())  # @tolist
    f = x.cpu()  # @cpu
    g = fb.seq_lens_cpu.max().item()  # @mirror
    h = x.sum().item()  # @plain
    return a + b + c + d + e + g + h, f


def test_each_kind_found_with_its_line():
    fb = make_fb([3, 9, 5])
    points, mirrors = capture(spellings, torch.randn(3), fb)
    found = [(p.kind, p.location, p.is_max) for p in points]
    expect = [
        ("item", line_of(spellings, "@item"), True),
        ("item", line_of(spellings, "@int"), True),
        ("item", line_of(spellings, "@torchmax"), True),
        ("item", line_of(spellings, "@amax"), True),
        ("tolist", line_of(spellings, "@tolist"), True),
        ("cpu_copy", line_of(spellings, "@cpu"), False),
        ("cpu_mirror", line_of(spellings, "@mirror"), True),
        ("item", line_of(spellings, "@plain"), False),
    ]
    assert found == expect
    by_kind = {p.location: p for p in points}
    assert not by_kind[line_of(spellings, "@mirror")].host_sync  # a host read of a CPU mirror
    assert by_kind[line_of(spellings, "@item")].host_sync
    assert [n.name for n in mirrors] == ["l_fb_seq_lens_cpu"]
    assert mirrors[next(iter(mirrors))].name == "l_fb_seq_lens"


def test_mirror_without_twin():
    def fn(fb):
        return fb.seq_lens_cpu.max().item() + 1

    fb = make_fb([3, 9])
    points, mirrors = capture(fn, fb)
    assert list(mirrors.values()) == [None]
    assert [p.kind for p in points] == ["cpu_mirror"]


def test_attribute_name():
    assert attribute_name("L['fb'].seq_lens_cpu") == "seq_lens_cpu"
    assert attribute_name("L['batch']['seq_lens_cpu']") == "seq_lens_cpu"
    assert attribute_name(None) is None


def test_numpy_max_is_found():
    def fn(fb, x):
        return x * int(fb.seq_lens.numpy().max())

    points, _ = capture(fn, make_fb([3, 9]), torch.ones(2))
    assert [(p.kind, p.is_max, p.host_sync) for p in points] == [("numpy", True, True)]


def test_a_device_tensor_named_like_a_mirror_is_not_one():
    """The name alone does not make a mirror: a `seq_lens_cpu` that is not on the CPU is a device sync."""

    def fn(fb):
        return fb.seq_lens_cpu.max().item() + 1

    fb = make_fb([3, 9])
    fb.seq_lens_cpu = fb.seq_lens_cpu.to("meta")
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return lambda *args: (torch.tensor(0),)

    with _compat.capture_scalar_outputs():
        try:
            torch.compile(fn, backend=backend, fullgraph=True)(fb)
        except Exception:
            pass  # the stand-in output does not matter; the graph does
    graph = graphs[0].graph
    mirrors = find_cpu_mirrors(graph, {})
    assert mirrors == {}
    [point] = find_sync_points(graph, mirrors)
    assert point.kind == "item" and point.host_sync


def test_mirror_twin_needs_the_same_shape():
    def fn(fb):
        return fb.seq_lens_cpu.max().item() + fb.seq_lens.sum()

    fb = make_fb([3, 9])
    fb.seq_lens = torch.tensor([3, 9, 4])
    _, mirrors = capture(fn, fb)
    assert list(mirrors.values()) == [None]
