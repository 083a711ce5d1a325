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
