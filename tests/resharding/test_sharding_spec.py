import pytest
from jax.sharding import PartitionSpec as P

from meshpar import ShardingSpec


@pytest.mark.parametrize(
    "text, dims",
    [
        ("S0RR", ((0,), (), ())),
        ("RS01R", ((), (0, 1), ())),
        ("RRS0", ((), (), (0,))),
        ("S1S0", ((1,), (0,))),
        ("S10R", ((1, 0), ())),
        ("R", ((),)),
        ("s^0 r", ((0,), ())),
    ],
)
def test_parse_and_format_round_trip(text, dims):
    spec = ShardingSpec.parse(text)
    assert spec.dims == dims
    assert ShardingSpec.parse(str(spec)) == spec


@pytest.mark.parametrize(
    "spec, pspec",
    [
        ("S0RR", P("x", None, None)),
        ("RS01R", P(None, ("x", "y"), None)),
        ("RRS1", P(None, None, "y")),
        ("S10R", P(("y", "x"), None)),
        ("RRR", P(None, None, None)),
    ],
)
def test_partition_spec_round_trip(spec, pspec):
    s = ShardingSpec.parse(spec)
    assert s.to_partition_spec(("x", "y")) == pspec
    assert ShardingSpec.from_partition_spec(pspec, ("x", "y"), s.rank) == s


def test_short_partition_spec_pads_with_replicated():
    assert str(ShardingSpec.from_partition_spec(P("y"), ("x", "y"), 3)) == "S1RR"


@pytest.mark.parametrize(
    "text, match",
    [("S0X", "cannot parse"), ("", "cannot parse"), ("S0S0", "mesh axis 0 is used by more than one"), ("S00R", "mesh axis 0")],
)
def test_bad_spec_text(text, match):
    with pytest.raises(ValueError, match=match):
        ShardingSpec.parse(text)


def test_validate_names_rank_and_axis():
    spec = ShardingSpec.parse("S0R")
    with pytest.raises(ValueError, match="dst_spec: 'S0R' has 2 dimensions but the tensor has rank 3"):
        spec.validate(3, 2, arg="dst_spec")
    with pytest.raises(ValueError, match="mesh axis 2, but the mesh has only 2 axes"):
        ShardingSpec.parse("S2R").validate(2, 2)


def test_partition_spec_unknown_axis():
    with pytest.raises(ValueError, match="axis 'z' is not a mesh axis"):
        ShardingSpec.from_partition_spec(P("z"), ("x", "y"), 2)
