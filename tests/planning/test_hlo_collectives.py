"""passes.hlo_collectives: the collectives read from HLO text, on hand-written HLO in each
replica-group syntax and on programs XLA compiles here, against bytes counted by hand; and
``compiled_tensor_parallel`` against plain ``jax.jit`` of the same step."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from examples.gpt import GPT, gpt_batch, gpt_loss
from examples.train_step import supervised_step
from meshpar.passes.planning.hlo_collectives import (Collective, CollectiveKind, all_reduce_equivalent_bytes,
                                                  collective_groups, collectives)
from meshpar.step_profile import compiled_tensor_parallel, profile_step
from pipeline_models import make_state

HLO = """
HloModule m, entry_computation_layout={(f32[8,16]{1,0})->f32[8,16]{1,0}}

%wrapped (p: f32[64]) -> f32[16] {
  %p = f32[64]{0} parameter(0)
  ROOT %reduce-scatter.1 = f32[16]{0} reduce-scatter(%p), channel_id=3, replica_groups={{0,1,2,3}}, dimensions={0}, to_apply=%add
}

ENTRY %main (x: f32[8,16]) -> f32[8,16] {
  %x = f32[8,16]{1,0} parameter(0)
  %all-reduce = f32[8,16]{1,0} all-reduce(%x), channel_id=1, replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_1'}, to_apply=%add
  %ag = bf16[8,32]{1,0} all-gather(%y), channel_id=2, replica_groups=[4,2]<=[8], dimensions={1}
  %ars = (f32[4]{0}, f32[4]{0}) all-reduce-start(%a, %b), channel_id=4, replica_groups={}
  %ard = (f32[4]{0}, f32[4]{0}, f32[1]{0}, f32[1]{0}, f32[1]{0}, /*index=5*/f32[2]{0}) all-reduce-done(%ars)
  %fusion = f32[8,16]{1,0} fusion(%all-reduce), kind=kLoop, calls=%f
  %cp = s32[2,2]{1,0} collective-permute(%z), channel_id=5, source_target_pairs={{0,1},{1,0}}
  ROOT %a2a = f32[8,16]{1,0} all-to-all(%fusion), channel_id=6, replica_groups=[2,4]<=[8], dimensions={0}
}
"""


def test_reads_every_collective_kind_and_replica_group_syntax():
    got = collectives(HLO)
    assert got == (
        Collective(CollectiveKind.REDUCE_SCATTER, 16 * 4, 4),
        Collective(CollectiveKind.ALL_REDUCE, 8 * 16 * 4, 4),
        Collective(CollectiveKind.ALL_GATHER, 8 * 32 * 2, 2),
        Collective(CollectiveKind.ALL_REDUCE, 13 * 4, None),  # the -done; the -start is not counted
        Collective(CollectiveKind.COLLECTIVE_PERMUTE, 4 * 4, None),
        Collective(CollectiveKind.ALL_TO_ALL, 8 * 16 * 4, 4),
    )
    # reduce-scatter: t·R/2; all-reduce: R; all-gather: R/2; permute: R; all-to-all: R/2
    want = 4 * 64 / 2 + 512 + 512 / 2 + 52 + 16 + 512 / 2
    assert all_reduce_equivalent_bytes(HLO, 8) == want


def test_rejects_what_it_cannot_count():
    with pytest.raises(ValueError, match="unknown element type"):
        collectives("%x = f99[4]{0} all-reduce(%y), replica_groups={}")
    with pytest.raises(ValueError, match="num_devices"):
        all_reduce_equivalent_bytes(HLO, 0)
    with pytest.raises(TypeError, match="hlo_text"):
        collectives(None)


def _compiled(fun, *args) -> str:
    return jax.jit(fun).lower(*args).compile().as_text()


def test_a_megatron_mlp_forward_all_reduces_its_output_once():
    """Column- then row-split weights: XLA sums the partial outputs with one all-reduce of
    the ``[b, h]`` output, ``b · h · 4`` bytes, in a group of the 4 model devices."""
    mesh = Mesh(np.array(jax.devices()[:4]).reshape(1, 4), ("data", "model"))
    b, h = 8, 16
    x = jax.device_put(jnp.ones((b, h)), NamedSharding(mesh, P()))
    w1 = jax.device_put(jnp.ones((h, 4 * h)), NamedSharding(mesh, P(None, "model")))
    w2 = jax.device_put(jnp.ones((4 * h, h)), NamedSharding(mesh, P("model", None)))
    hlo = _compiled(lambda x, w1, w2: jnp.tanh(jax.nn.gelu(x @ w1) @ w2), x, w1, w2)
    assert collectives(hlo) == (Collective(CollectiveKind.ALL_REDUCE, b * h * 4, 4),)


def test_gathering_a_split_array_is_half_its_bytes_of_all_reduce():
    mesh = Mesh(np.array(jax.devices()[:4]), ("d",))
    x = jax.device_put(jnp.ones((16, 8)), NamedSharding(mesh, P("d")))
    hlo = jax.jit(lambda x: x * 2, out_shardings=NamedSharding(mesh, P())).lower(x).compile().as_text()
    assert all_reduce_equivalent_bytes(hlo, 4) == 16 * 8 * 4 / 2


def test_compiled_tensor_parallel_sizes_the_profile_by_the_program_plain_jit_compiles():
    """meshpar's one-program step on a (1, 4) mesh and plain ``jax.jit`` with the flax
    partitioning's shardings in and out compile the same collectives; the profile's ``tp_bytes`` sum to
    them per example, spread among layers as Megatron's rule spreads them."""
    import flax.linen as nn

    model = GPT(num_stages=2, num_layers=2)
    batch = gpt_batch(0, 8, 8, 64)
    state = make_state(model, batch["x"][:1])
    step = supervised_step(gpt_loss)
    devices = jax.devices()[:4]
    profile = profile_step(step, (state, batch), (1,))
    sized, scale = compiled_tensor_parallel(profile, step, (state, batch), (1,), devices)

    mesh = Mesh(np.array(devices).reshape(1, 4), ("data", "model"))
    specs = nn.get_partition_spec(state)
    shardings = (jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda s: isinstance(s, P)),
                 jax.tree.map(lambda _: NamedSharding(mesh, P()), batch))
    hlo = jax.jit(step, in_shardings=shardings, out_shardings=(shardings[0], NamedSharding(mesh, P()))).lower(
        state, batch).compile().as_text()
    want = all_reduce_equivalent_bytes(hlo, 4) / 8
    assert want > 0
    np.testing.assert_allclose(2 * sum(x.tp_bytes for x in sized.layers), want, rtol=1e-12)
    for before, after in zip(profile.layers, sized.layers):
        np.testing.assert_allclose(after.tp_bytes, before.tp_bytes * scale, rtol=1e-12)
        assert dataclasses.replace(before, tp_bytes=0.0) == dataclasses.replace(after, tp_bytes=0.0)
    assert compiled_tensor_parallel(profile, step, (state, batch), (1,), devices[:1]) == (profile, 1.0)
    with pytest.raises(TypeError, match="profile: expected a ModelProfile"):
        compiled_tensor_parallel(None, step, (state, batch), (1,), devices)
    with pytest.raises(ValueError, match="devices: expected distinct devices"):
        compiled_tensor_parallel(profile, step, (state, batch), (1,), [devices[0]] * 2)


@pytest.mark.parametrize("groups, want", [
    ("{{0,2},{1,3}}", ((0, 2), (1, 3))),
    ("[2,2]<=[2,2]T(1,0)", ((0, 2), (1, 3))),
    ("[2,2]<=[4]", ((0, 1), (2, 3))),
    ("mesh['axis_0'=2,'axis_1'=1,'axis_2'=2] {'axis_0'}", ((0, 2), (1, 3))),
    ("mesh['axis_0'=2,'axis_1'=1,'axis_2'=2] {'axis_2'}", ((0, 1), (2, 3))),
    ("mesh['axis_0'=2,'axis_1'=2] {'axis_0','axis_1'}", ((0, 1, 2, 3),)),
    ("{}", ((0, 1, 2, 3),)),
])
def test_collective_groups_spell_out_every_replica_group_syntax(groups, want):
    line = f"  %all-reduce.2 = f32[8]{{0}} all-reduce(%p), channel_id=1, replica_groups={groups}, to_apply=%add"
    ((collective, got),) = collective_groups(line, 4)
    assert collective == Collective(CollectiveKind.ALL_REDUCE, 32, collective.group_size)
    assert got == want
    # Brute force: every device in exactly one group, of the size collectives() reads.
    assert sorted(d for g in got for d in g) == [0, 1, 2, 3]
    assert collective.group_size in (None, len(got[0]))


def test_collective_groups_checks_num_devices():
    with pytest.raises(ValueError, match="num_devices"):
        collective_groups(HLO, 0)
