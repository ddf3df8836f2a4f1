import pytest

import parstrat


def test_builtin_names_are_registered():
  assert parstrat.available() == sorted(parstrat.available())
  assert {"data_parallel", "pipeline", "hybrid"} <= set(parstrat.available())


def test_get_builds_the_registered_class_with_config():
  assert parstrat.get("data_parallel", data=4) == parstrat.DataParallel(data=4)
  assert isinstance(parstrat.get("pipeline", stages=2), parstrat.PipelineModelParallel)
  assert isinstance(parstrat.get("hybrid", data=2, stages=4), parstrat.Hybrid)


def test_unknown_name_lists_names_and_closest_match():
  with pytest.raises(KeyError) as info:
    parstrat.get("data_paralel")
  message = str(info.value)
  assert "'data_paralel'" in message
  assert "data_parallel, fsdp, hybrid, pipeline, tensor" in message
  assert "Did you mean 'data_parallel'?" in message


@pytest.mark.parametrize(
  ("typed", "meant"),
  [("PIPELINE", "pipeline"), ("Data-Parallel", "data_parallel"), ("FSDP", "fsdp")],
)
def test_a_name_typed_in_another_case_or_with_hyphens_is_still_matched(typed, meant):
  # Names are looked up as registered (no alias is accepted), but "did you mean"
  # ignores case and takes "-" for "_": before, "PIPELINE" got no suggestion.
  with pytest.raises(KeyError, match=f"Did you mean '{meant}'"):
    parstrat.get(typed)


def test_custom_registration_and_duplicates():
  @parstrat.register("test_custom")
  class Custom(parstrat.DataParallel):
    pass

  try:
    assert "test_custom" in parstrat.available()
    assert isinstance(parstrat.get("test_custom", data=2), Custom)
    with pytest.raises(ValueError, match="already registered as 'test_custom'.*overwrite=True"):

      @parstrat.register("test_custom")
      class Other(parstrat.DataParallel):
        pass

    @parstrat.register("test_custom", overwrite=True)
    class Replacement(parstrat.DataParallel):
      pass

    assert type(parstrat.get("test_custom")) is Replacement
  finally:
    parstrat.unregister("test_custom")
  assert "test_custom" not in parstrat.available()


def test_register_rejects_non_strategies_and_bad_names():
  with pytest.raises(TypeError, match="subclass of parstrat.Strategy"):
    parstrat.register("nope")(int)
  with pytest.raises(ValueError, match="non-empty string"):
    parstrat.register("")
  for bad in (" mine", "my,strategy", "my strategy", "--mine"):  # (--compare splits on commas)
    with pytest.raises(ValueError, match=f"or start with '-', got {bad!r}"):
      parstrat.register(bad)
  with pytest.raises(TypeError, match=r"needs a name: write @parstrat.register\('my_name'\)"):

    @parstrat.register
    class Nameless(parstrat.DataParallel):
      pass

  class Unfinished(parstrat.Strategy):  # no make_plan
    def make_mesh(self):
      return parstrat.build_mesh({"data": None})

  with pytest.raises(
    TypeError, match=r"register\('nope'\): .*Unfinished does not implement make_plan"
  ):
    parstrat.register("nope")(Unfinished)
  assert "nope" not in parstrat.available()


def test_unknown_config_is_a_type_error():
  with pytest.raises(
    TypeError, match="'data_parallel' has no option 'stages'; its options are devices, debug, data"
  ):
    parstrat.get("data_parallel", stages=2)
  with pytest.raises(TypeError, match=r"has no option 'dat'; .* Did you mean 'data'\?"):
    parstrat.get("data_parallel", dat=4)
  with pytest.raises(TypeError, match=r"has no option 'Stages'; .* Did you mean 'stages'\?"):
    parstrat.get("pipeline", Stages=2)


class _Noted:
  """A mixin whose `__init__` takes an option of its own (`note`)."""

  def __init__(self, *, note="x", **kwargs):
    super().__init__(**kwargs)
    object.__setattr__(self, "note", note)


def test_get_passes_the_options_a_constructor_takes_dataclass_or_not():
  # `get` read the options from the dataclass fields only: an __init__ of a class's
  # own, or a mixin's, had its options refused ("has no option 'note'").
  class FromMixin(_Noted, parstrat.DataParallel):
    pass

  class PassThrough(parstrat.DataParallel):
    def __init__(self, **kwargs):  # passes everything on: get leaves the checks to it
      super().__init__(**kwargs)

  try:
    parstrat.register("noted")(FromMixin)
    parstrat.register("passes")(PassThrough)
    parstrat.register("plain")(type("NoInit", (parstrat.DataParallel,), {}))  # inherited
    assert parstrat.get("noted", note="y", data=2).note == "y"
    assert parstrat.get("passes", data=2).data == 2
    assert parstrat.get("plain", data=2).data == 2
    for name, bad in (("noted", "note_"), ("passes", "hosts")):  # (**kwargs: the class refuses)
      with pytest.raises(TypeError, match=f"unexpected keyword argument '{bad}'"):
        parstrat.get(name, **{bad: 2})
    with pytest.raises(TypeError, match=r"Strategy 'data_parallel' has no option 'dat'.*'data'"):
      parstrat.get("data_parallel", dat=2)
  finally:
    for name in ("noted", "passes", "plain"):
      parstrat.unregister(name)
