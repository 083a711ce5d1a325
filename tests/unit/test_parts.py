"""Part names: one enum, accepted as members or plain names, every mistake named."""

import pytest

from chatlearn_mem import Part
from chatlearn_mem.parts import parse_parts
from chatlearn_mem.residency import CATEGORIES


def test_plain_names_and_members_are_the_same_part():
    assert Part("weights") is Part.WEIGHTS and Part.WEIGHTS == "weights"
    assert f"{Part.MAIN_WEIGHTS}" == "main_weights" and {Part.GRADS: 1}["grads"] == 1
    assert CATEGORIES == ("weights", "grads", "main_weights", "optimizer_states", "other")


def test_parse_parts_orders_dedups_and_defaults_to_all():
    available = list(Part)
    assert parse_parts(None, available) == available
    assert parse_parts("grads", available) == [Part.GRADS]
    assert parse_parts(["optimizer_states", Part.WEIGHTS, "weights"], available) == [
        Part.WEIGHTS,
        Part.OPTIMIZER_STATES,
    ]
    assert parse_parts([], available) == []


def test_parse_parts_names_every_mistake():
    with pytest.raises(ValueError, match=r"unknown part 'optimizer'; parts are \['weights', 'grads'"):
        parse_parts(["weights", "optimizer"], list(Part))
    with pytest.raises(ValueError, match=r"'grads' is not a part of this manager"):
        parse_parts("grads", [Part.WEIGHTS])
    with pytest.raises(TypeError, match="parts must be a Part"):
        parse_parts(3, list(Part))


def test_own_tensors_are_the_modules_parameters_then_buffers_each_once():
    import torch

    from chatlearn_mem.parts_state import _own_tensors

    m = torch.nn.Linear(3, 2)
    m.register_buffer("scale", torch.ones(2))
    m.register_buffer("absent", None)
    m.register_parameter("missing", None)
    m.tied = m.weight  # the same tensor under a second name
    m.child = torch.nn.Linear(2, 2)  # a child's tensors are not the module's own
    expected = list(m.parameters(recurse=False)) + list(m.buffers(recurse=False))
    got = _own_tensors(m)
    assert [id(t) for t in got] == [id(t) for t in expected] == [id(m.weight), id(m.bias), id(m.scale)]
    assert _own_tensors(torch.nn.ReLU()) == []
