"""Pipeline and hybrid MNIST through the registry: the same model, a one-word change.

A 784-512-512-512-10 MLP is cut into 4 stages (one per device) by
`"pipeline"`, and into 4 stages inside each of 2 data replicas by `"hybrid"`;
both train on the same batches from the same seed as `"data_parallel"` and
print the same losses and accuracy.

Run: python examples/pipeline_and_hybrid_mnist.py
"""

import parstrat.testing

parstrat.testing.use_cpu_devices(8)

import haiku as hk  # noqa: E402
import jax  # noqa: E402
import optax  # noqa: E402

import parstrat  # noqa: E402
from parstrat.datasets import batches  # noqa: E402
from parstrat.datasets import load_mnist  # noqa: E402

STRATEGIES = {
  "data_parallel": dict(data=8),
  "pipeline": dict(stages=4, microbatches=8, schedule="1f1b"),
  "hybrid": dict(data=2, stages=4, microbatches=4, schedule="gpipe"),
}


def main(steps: int = 30, batch_size: int = 256) -> dict[str, tuple[float, float]]:
  data = load_mnist("sample")
  model = hk.transform(lambda x: hk.nets.MLP([512, 512, 512, 10], activation=jax.nn.swish)(x))
  results = {}
  for name, config in STRATEGIES.items():
    trainer = parstrat.get(name, **config)(model, optax.adam(1e-3))
    state = trainer.init(jax.random.key(0), data.train_images[:1])
    if name == "pipeline":
      print(trainer.plan.description)
    for _, batch in zip(
      range(steps),
      batches(data.train_images, data.train_labels, batch_size, seed=0, epoch=0),
      strict=False,
    ):
      state, metrics = trainer.step(state, batch)
    n = len(data.eval_labels) // batch_size * batch_size
    logits = trainer.apply(state, data.eval_images[:n])
    accuracy = float((logits.argmax(-1) == data.eval_labels[:n]).mean())
    results[name] = (float(metrics["loss"]), accuracy)
    print(
      f"{name:14} mesh {dict(trainer.mesh.shape)}: loss after {steps} steps "
      f"{results[name][0]:.6f}, eval accuracy {accuracy:.4f}"
    )
  return results


if __name__ == "__main__":
  main()
