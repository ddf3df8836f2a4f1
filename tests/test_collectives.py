import jax
import jax.numpy as jnp
import numpy as np
import pytest

import parstrat

ARR = jnp.arange(200, dtype=jnp.float32)
EXPECTED = ARR / ARR.sum()


def _mesh(shape, names=("p", "v")):
  return jax.make_mesh(shape, names, axis_types=(jax.sharding.AxisType.Auto,) * len(shape))


@pytest.mark.parametrize("shape", [(4, 2), (2, 4), (8, 1)])
def test_normalize_on_a_2d_mesh_matches_single_device(shape):
  mesh = _mesh(shape)
  out = parstrat.collectives.normalize_on_mesh(ARR.reshape(shape[0] * 5, 40 // shape[0]), mesh)
  assert float(out.sum()) == pytest.approx(1.0, abs=1e-6)
  np.testing.assert_allclose(np.asarray(out).reshape(-1), EXPECTED, rtol=1e-6)
  assert out.sharding.spec == jax.sharding.PartitionSpec("p", "v")


def test_pmap_of_vmap_with_a_tuple_of_axis_names():
  lanes = jax.vmap(lambda x: parstrat.collectives.global_normalize(x, ("p", "v")), axis_name="v")
  out = jax.pmap(lanes, axis_name="p")(ARR.reshape(8, 25))
  assert float(out.sum()) == pytest.approx(1.0, abs=1e-6)
  np.testing.assert_allclose(out.reshape(-1), EXPECTED, rtol=1e-6)


def test_one_axis_only_normalises_within_it():
  out = jax.vmap(
    jax.vmap(lambda x: parstrat.collectives.global_normalize(x, "v"), axis_name="v"),
    axis_name="p",
  )(ARR.reshape(8, 25))
  np.testing.assert_allclose(out.sum(axis=1), np.ones(8), rtol=1e-6)


def test_bad_meshes_and_shapes():
  with pytest.raises(ValueError, match="needs a 2-D mesh, got axes \\('p',\\)"):
    parstrat.collectives.normalize_on_mesh(ARR.reshape(8, 25), _mesh((8,), ("p",)))
  message = r"shape \(10, 20\) does not split over the mesh \{'p': 4, 'v': 2\}"
  with pytest.raises(ValueError, match=message):
    parstrat.collectives.normalize_on_mesh(ARR.reshape(10, 20), _mesh((4, 2)))
