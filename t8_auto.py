from common import *
V,T,B=32,6,16
def net(batch_in):
  tok, extra = batch_in["tok"], batch_in["extra"]
  x = hk.Embed(V, 16)(tok) + hk.Linear(16)(extra)
  x = hk.BatchNorm(True, True, 0.9)(x, is_training=True)
  x = jax.nn.relu(hk.Linear(32)(x))
  return {"logits": hk.Linear(V)(x), "aux": jnp.mean(x ** 2)}
m = hk.transform_with_state(net)
r = np.random.RandomState(0)
def mk():
  return {"tok": r.randint(0, V, (B, T)).astype(np.int32), "extra": r.randn(B, T, 3).astype(np.float32),
          "targets": r.randint(0, V, (B, T)).astype(np.int32), "mask": (r.rand(B, T) > .2).astype(np.float32)}
bs = [mk() for _ in range(3)]
def loss_fn(out, b):
  l = optax.losses.softmax_cross_entropy_with_integer_labels(out["logits"], b["targets"])
  return (l * b["mask"]).mean() + 0.01 * out["aux"]
mi = lambda b: {"tok": b["tok"], "extra": b["extra"]}
tr = parstrat.Auto(verbose=True)(m, optax.adamw(1e-3), model_inputs=mi, loss_fn=loss_fn)
s = tr.init(jax.random.key(0), mi(bs[0]), sample_batch=bs[0])
print("chose", tr.strategy)
for b in bs:
  s, met = tr.step(s, b); print(float(met["loss"]))
out = tr.apply(s, mi(bs[0])); print(jax.tree.map(jnp.shape, out))
run("auto stateful dict", parstrat.Auto(verbose=False), m, {"sgd": optax.sgd(0.1)}, batches=bs, loss_fn=loss_fn, model_inputs=mi)
