"""Data-parallel MNIST: written out by hand with jax.pmap, then through parstrat.

The hand-written version does what the seed describes: replicate the params on
every device, split each batch of NUM_DEVICES x BATCH_SIZE images into one
slice per device, and average the gradients with `lax.pmean` over the device
axis. The parstrat version is one line: `parstrat.get("data_parallel")`. Both
start from the same params and see the same batches, so they reach the same
accuracy.

Run: python examples/data_parallel_mnist.py
"""

import functools

import parstrat.testing

parstrat.testing.use_cpu_devices(8)

import haiku as hk  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax import lax  # noqa: E402

import parstrat  # noqa: E402
from parstrat.datasets import batches  # noqa: E402
from parstrat.datasets import load_mnist  # noqa: E402

NUM_DEVICES = jax.device_count()
BATCH_SIZE = 32  # per device
EPOCHS = 1

model = hk.transform(lambda x: hk.nets.MLP([512, 10], activation=jax.nn.swish)(x))
optimizer = optax.adam(1e-3)


def loss_fn(params, images, labels):
  return parstrat.softmax_cross_entropy(model.apply(params, None, images), labels)


@functools.partial(jax.pmap, axis_name="devices")
def pmap_step(params, opt_state, images, labels):
  loss, grads = jax.value_and_grad(loss_fn)(params, images, labels)
  grads = lax.pmean(grads, "devices")  # average the gradients over the devices
  updates, opt_state = optimizer.update(grads, opt_state, params)
  return optax.apply_updates(params, updates), opt_state, lax.pmean(loss, "devices")


def by_hand(data, params) -> float:
  replicate = lambda tree: jax.tree.map(lambda x: np.stack([x] * NUM_DEVICES), tree)  # noqa: E731
  params, opt_state = replicate(params), replicate(optimizer.init(params))
  for epoch in range(EPOCHS):
    for images, labels in batches(
      data.train_images, data.train_labels, NUM_DEVICES * BATCH_SIZE, seed=0, epoch=epoch
    ):
      images = images.reshape(NUM_DEVICES, BATCH_SIZE, -1)
      labels = labels.reshape(NUM_DEVICES, BATCH_SIZE)
      params, opt_state, _ = pmap_step(params, opt_state, images, labels)
  single = jax.tree.map(lambda x: x[0], params)
  logits = model.apply(single, None, data.eval_images)
  return float((logits.argmax(-1) == data.eval_labels).mean())


def with_parstrat(data) -> float:
  trainer = parstrat.get("data_parallel")(model, optimizer)
  state = trainer.init(jax.random.key(0), data.train_images[:1])
  for epoch in range(EPOCHS):
    for batch in batches(
      data.train_images, data.train_labels, NUM_DEVICES * BATCH_SIZE, seed=0, epoch=epoch
    ):
      state, _ = trainer.step(state, batch)
  logits = model.apply(trainer.params(state), None, data.eval_images)
  return float((logits.argmax(-1) == data.eval_labels).mean())


def main() -> tuple[float, float]:
  data = load_mnist("sample")
  params = jax.jit(model.init)(jax.random.key(0), data.train_images[:1])
  hand, library = by_hand(data, params), with_parstrat(data)
  print(f"devices: {NUM_DEVICES}, global batch {NUM_DEVICES * BATCH_SIZE}")
  print(f"pmap by hand:           eval accuracy {hand:.4f}")
  print(f"parstrat data_parallel: eval accuracy {library:.4f}")
  return hand, library


if __name__ == "__main__":
  main()
