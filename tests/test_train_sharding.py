"""Mesh construction and per-process batch rows."""

import jax
import pytest

from jax_twell.train import sharding
from jax_twell.train.config import MeshConfig


def test_mesh_fills_the_minus_one_axis():
    n = jax.device_count()
    mesh = sharding.make_mesh(MeshConfig(data=-1, fsdp=1, tensor=1))
    assert dict(mesh.shape) == {"data": n, "fsdp": 1, "tensor": 1}
    mesh = sharding.make_mesh(MeshConfig(data=1, fsdp=1, tensor=1), jax.devices()[:1])
    assert mesh.size == 1


@pytest.mark.parametrize("cfg", [MeshConfig(data=-1, fsdp=-1), MeshConfig(data=3 * jax.device_count()),
                                 MeshConfig(data=-1, tensor=jax.device_count() + 1)])
def test_bad_mesh_shapes_raise(cfg):
    with pytest.raises(ValueError, match="mesh"):
        sharding.make_mesh(cfg)


def test_single_process_loads_every_row():
    assert sharding.process_rows(8) == slice(0, 8)


def test_process_rows_follow_the_mesh():
    """One process holds every row; with grad_accum the rows come micro-batch by micro-batch."""
    mesh = sharding.make_mesh(MeshConfig(data=2, fsdp=1, tensor=-1))
    assert sharding.process_rows(8, mesh).tolist() == list(range(8))
    assert sharding.process_rows(8, mesh, grad_accum=2).tolist() == list(range(8))
    with pytest.raises(ValueError, match="grad_accum"):
        sharding.process_rows(8, mesh, grad_accum=3)


def test_config_agreement_is_a_no_op_for_one_process():
    assert sharding.is_lead()
    sharding.assert_same_across_processes({"steps": 1})
