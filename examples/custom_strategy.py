"""Register your own strategy and train with it by name.

`TwoLevelDataParallel` is data parallelism over a 2-D mesh ("host", "local"),
say machines x devices per machine. The batch is split over both axes and the
gradients are averaged over the *tuple* of axis names at once, the seed's
lesson on `axis_name`: one `pmean` over ("host", "local") reduces over every
device of the mesh.

A strategy says which mesh it wants (`make_mesh`) and returns a `Plan`: how the
params are stored and sharded, how the batch is split, and how one device
computes its loss and averaged gradients. parstrat does the rest.

Run: python examples/custom_strategy.py
Or from the command line, in this folder:
  parstrat train --import custom_strategy --strategy two_level_data_parallel
(importing the module registers the strategy and starts nothing: the devices are
made in `__main__` below, or by whoever imports it).
"""

import dataclasses

import haiku as hk
import jax
import optax
from jax import lax
from jax.sharding import PartitionSpec as P

import parstrat
import parstrat.testing
from parstrat.datasets import batches
from parstrat.datasets import load_mnist

AXES = ("host", "local")


@parstrat.register("two_level_data_parallel")
@dataclasses.dataclass(frozen=True, kw_only=True, repr=False)
class TwoLevelDataParallel(parstrat.Strategy):
  """Data parallelism over a hosts x local-devices mesh, averaged over both axes."""

  hosts: int = 2
  axis_names = AXES

  def make_mesh(self):
    return parstrat.build_mesh({"host": self.hosts, "local": None}, self.devices)

  def make_plan(self, model, loss_fn, mesh, sample_params, sample_inputs):
    # `model` follows Haiku's stateful contract: apply(params, state, rng, inputs)
    # -> (outputs, state). This strategy does not declare supports_rng or
    # supports_state, so the trainer only gives it models that need neither.
    def loss_and_grad(params, inputs, labels, rng, model_state):
      def local_loss(p):
        outputs, _ = model.apply(p, model_state, rng, inputs)
        return loss_fn(outputs, labels)

      # Per-device gradients (params made device-varying first), then one
      # average over the tuple of axis names.
      local = lax.pcast(params, AXES, to="varying")
      loss, grads = jax.value_and_grad(local_loss)(local)
      loss, grads = lax.pmean((loss, grads), AXES)
      return loss, grads, model_state

    return parstrat.Plan(
      param_spec=P(),
      batch_spec=P(AXES),  # the batch's leading axis split over both mesh axes
      to_stored=lambda params: params,
      to_params=lambda stored: stored,
      loss_and_grad=loss_and_grad,
      forward=lambda params, inputs, rng, model_state: model.apply(
        params, model_state, rng, inputs
      )[0],
      description="params replicated; batch split over ('host', 'local')",
    )


def main(epochs: int = 1, batch_size: int = 256) -> float:
  model = hk.transform(lambda x: hk.nets.MLP([512, 10], activation=jax.nn.swish)(x))
  trainer = parstrat.get("two_level_data_parallel", hosts=2)(model, optax.adam(1e-3))
  data = load_mnist("sample")
  state = trainer.init(jax.random.key(0), data.train_images[:1])
  print(f"mesh: {dict(trainer.mesh.shape)}")
  for epoch in range(epochs):
    for images, labels in batches(
      data.train_images, data.train_labels, batch_size, seed=0, epoch=epoch
    ):
      state, metrics = trainer.step(state, (images, labels))
    print(f"epoch {epoch + 1}: loss {float(metrics['loss']):.4f}")
  logits = trainer.apply(state, data.eval_images)  # all 2,000: 250 per device
  accuracy = float((logits.argmax(-1) == data.eval_labels).mean())
  print(f"eval accuracy: {accuracy:.4f} on {len(data.eval_labels)} images")
  reports = parstrat.testing.check_strategy("two_level_data_parallel", steps=5, batch=32)
  for report in reports:
    print(f"conformance: {report}")
  return accuracy


if __name__ == "__main__":
  parstrat.testing.use_cpu_devices(8)  # before anything starts JAX's backend
  main()
